#!/usr/bin/env python3
"""Build a tiny DeepSeek-V3 (MLA + MoE) with HF transformers, convert it with llama.cpp's
convert_hf_to_gguf.py to an F32 GGUF, and record HF fp32 top-50 log-probabilities for prompts.

Weights are random but scaled up (linear ~ N(0, 1/fan_in), lm_head ~ N(0, 16/d)) so the outputs
are not flat. The tokenizer is a small byte-level BPE trained here; the converter's pre-tokenizer
hash check is told it is "default" (the converter refuses unknown hashes).

Usage: deepseek_v3_tiny.py CONVERT_HF_TO_GGUF.py OUT_DIR [--yarn]
Writes OUT_DIR/deepseek-v3-tiny.f32.gguf and OUT_DIR/hf-deepseek-v3-tiny.json. Not run by CI.
--yarn: deepseek-v3-yarn-tiny instead, with YaRN RoPE as DeepSeek-V3 declares it (mscale =
mscale_all_dim), on base 100, factor 4 and original context 64 so the ramp acts within the prompts.
"""
import importlib.util, json, math, os, sys, tempfile

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b",
    "Once upon a time there was a dragon",
    "1 2 3 4 5 6 7 8",
    "MLA compresses keys and values into a latent",
    "mixture of experts routes each token",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Once upon a time, in a small village by the sea, there lived a dragon.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Multi-head latent attention compresses keys and values into a latent vector.",
    "A mixture of experts routes each token to a few experts and a shared expert.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12",
]


def build_tokenizer(vocab_size=512):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    return fast


def build_model(vocab, yarn=False):
    rope = dict(rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "beta_fast": 8.0, "beta_slow": 1.0,
                                 "mscale": 1.0, "mscale_all_dim": 1.0}) if yarn else dict(rope_theta=10000.0)
    cfg = DeepseekV3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=96,
        qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, **rope,
        rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":
                p.normal_(0.0, 4.0 / math.sqrt(p.shape[1]))
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    return model


def convert(convert_script, hf_dir, out_path):
    src = os.path.dirname(os.path.abspath(convert_script))
    # The converter imports its sibling package `conversion` and llama.cpp's own gguf-py.
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", convert_script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = mod
    spec.loader.exec_module(mod)
    # Our tokenizer is new to the converter's hash list: it is a plain GPT-2 byte-level BPE.
    sys.modules["conversion.base"].TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out_path]
    mod.main()


def main():
    convert_script, out_dir = sys.argv[1], sys.argv[2]
    yarn = "--yarn" in sys.argv[3:]
    name = "deepseek-v3-yarn-tiny" if yarn else "deepseek-v3-tiny"
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(2)
    tok = build_tokenizer()
    model = build_model(len(tok), yarn)
    gguf_path = os.path.join(out_dir, f"{name}.f32.gguf")
    with tempfile.TemporaryDirectory() as hf_dir:
        model.save_pretrained(hf_dir, safe_serialization=True)
        tok.save_pretrained(hf_dir)
        # The converter reads the gating function from config.json (absent means softmax there).
        cfg_path = os.path.join(hf_dir, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["scoring_func"] = "sigmoid"
        cfg["topk_method"] = "noaux_tc"
        json.dump(cfg, open(cfg_path, "w"), indent=1)
        convert(convert_script, hf_dir, gguf_path)
    cases = []
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        positions = []
        for row in lp:
            v, i = torch.topk(row, 50)
            positions.append({"top": [[int(a), float(b)] for a, b in zip(i, v)]})
        cases.append({"prompt": p, "tokens": ids, "positions": positions})
    doc = {"format": 1, "model": os.path.basename(gguf_path),
           "peer": f"transformers {transformers.__version__}, torch {torch.__version__}, float32",
           "generated_by": "tests/peers/deepseek_v3_tiny.py" + (" --yarn" if yarn else ""), "cases": cases}
    out_json = os.path.join(out_dir, f"hf-{name}.json")
    json.dump(doc, open(out_json, "w"), separators=(",", ":"))
    print(f"wrote {gguf_path} and {out_json}")


if __name__ == "__main__":
    main()
