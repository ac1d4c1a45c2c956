#!/usr/bin/env python3
"""Build a tiny GLM-5 (`glm-dsa`: MLA + MoE + the DSA lightning indexer with interleaved RoPE, and
GLM-5.x's `shared` indexer layers that reuse the previous `full` layer's top-k selection) with HF
transformers, convert it with llama.cpp's convert_hf_to_gguf.py (llama-cpp-python 0.3.36) to an F32
GGUF, and record HF fp32 top-50 log-probabilities, sparse (top_k 3) and dense (top_k above the
sequence). Everything but the model class and the indexer layout is shared with
tests/peers/deepseek32_tiny.py (see its notes on the converter).

Layers: 0 dense FFN + full indexer, 1 MoE + shared indexer, 2 MoE + full, 3 MoE + shared.

Usage: glm_dsa_tiny.py CONVERT_HF_TO_GGUF.py OUT_DIR
Writes OUT_DIR/glm-dsa-tiny.f32.gguf and OUT_DIR/hf-glm-dsa-tiny.json. Not run by CI.
"""
import os, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from deepseek32_tiny import common_config, run  # noqa: E402

INDEXER_TYPES = ["full", "shared", "full", "shared"]


def make_glm_dsa(vocab, index_topk):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    cfg = GlmMoeDsaConfig(n_group=1, topk_group=1, indexer_types=INDEXER_TYPES,
                          **common_config(vocab, index_topk))
    return GlmMoeDsaForCausalLM(cfg).float().eval()


def main():
    run("glm-dsa", make_glm_dsa, 3, {"indexer_types": INDEXER_TYPES}, sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    main()
