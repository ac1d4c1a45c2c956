#!/usr/bin/env python3
"""Tiny random models of the GQA/MoE families llmdiff's reference runs beside llama and deepseek2
(qwen2, qwen3, qwen3moe, glm4moe, gemma2, gemma3), built with HF transformers, converted by
llama.cpp's convert_hf_to_gguf.py to F32 GGUFs, with HF fp32 log-probabilities over the FULL
vocabulary at every position of a few prompts recorded beside them.

Each fixture reaches its family's branches: q/k/v biases (qwen2, glm4moe), q/k RMSNorm (qwen3,
qwen3moe), MoE with softmax routing and norm_topk_prob (qwen3moe), sigmoid routing with the
correction bias, a shared expert, leading dense layers and partial rotary (glm4moe), sliding
windows (4) shorter than the prompts, soft-capping, GELU-tanh and pre/post norms (gemma2), and
gemma3's global layer (every 6th) with its own RoPE base after five local ones. `gpt-oss-yarn` is
gpt-oss with YaRN RoPE as the released configs declare it (truncate false), on a small base and
original context so the ramp acts within the prompts.

Weights are random but scaled up (linear ~ N(0, 1/fan_in), embeddings ~ N(0, 1), biases and
router biases ~ N(0, 0.5), norms ~ 1 + N(0, 0.1)) so the outputs are not flat. The tokenizer is a
small byte-level BPE trained here; the converter's pre-tokenizer hash check is told "default".

Usage: family_tiny.py FAMILY CONVERT_HF_TO_GGUF.py OUT_DIR
(convert_hf_to_gguf.py from llama-cpp-python 0.3.36's sdist: vendor/llama.cpp/, beside its gguf-py.)
Writes OUT_DIR/FAMILY-tiny.f32.gguf and OUT_DIR/hf-FAMILY-tiny.json. Not run by CI.
"""
import importlib.util, json, math, os, sys, tempfile

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old dragon who counted waves.",
    "The capital of France is Paris.",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Once upon a time, in a small village by the sea, there lived a dragon.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Rotary position embeddings rotate pairs of query and key dimensions.",
    "The capital of France is Paris. The capital of Italy is Rome.",
]

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def family_config(family, vocab):
    t = transformers
    if family == "qwen2":
        return t.Qwen2ForCausalLM, t.Qwen2Config(vocab_size=vocab, intermediate_size=128, num_hidden_layers=2,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True, **COMMON)
    if family == "qwen3":
        return t.Qwen3ForCausalLM, t.Qwen3Config(vocab_size=vocab, intermediate_size=128, num_hidden_layers=2,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False, **COMMON)
    if family == "qwen3moe":
        return t.Qwen3MoeForCausalLM, t.Qwen3MoeConfig(vocab_size=vocab, intermediate_size=128,
            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False, **COMMON)
    if family == "glm4moe":
        return t.Glm4MoeForCausalLM, t.Glm4MoeConfig(vocab_size=vocab, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1,
            num_hidden_layers=3, rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=False,
            partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5}, num_nextn_predict_layers=0, tie_word_embeddings=False, **COMMON)
    if family == "gemma2":
        return t.Gemma2ForCausalLM, t.Gemma2Config(vocab_size=vocab, intermediate_size=128, num_hidden_layers=4,
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh", layer_types=["sliding_attention", "full_attention"] * 2,
            tie_word_embeddings=True, **COMMON)
    if family == "gemma3":
        return t.Gemma3ForCausalLM, t.Gemma3TextConfig(vocab_size=vocab, intermediate_size=64, num_hidden_layers=7,
            rms_norm_eps=1e-6, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=None,
            attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
            layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            tie_word_embeddings=True, **COMMON)
    if family in ("gpt-oss", "gpt-oss-yarn"):
        # gpt-oss-yarn: YaRN as the released gpt-oss configs declare it (truncate False), with a
        # small base and original context so the ramp and the attention factor act within 20
        # positions of a 16-dim head.
        rope = {"rope_type": "default", "rope_theta": 10000.0} if family == "gpt-oss" else {
            "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 64, "truncate": False}
        return t.GptOssForCausalLM, t.GptOssConfig(vocab_size=vocab, intermediate_size=32, num_hidden_layers=2,
            num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], attention_bias=True,
            rope_parameters=rope, tie_word_embeddings=False, **COMMON)
    raise SystemExit(f"unknown family {family}")


def build_tokenizer(vocab_size=320):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def build_model(family, vocab):
    cls, cfg = family_config(family, vocab)
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms compute x·(1 + w): w near 0 (the converter stores 1 + w).
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("bias") or "e_score_correction_bias" in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("sinks"):  # gpt-oss attention sinks, one logit per head
                p.normal_(0.0, 1.0)
            elif p.dim() == 3 and family.startswith("gpt-oss"):  # experts [E, in, out]
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            elif p.dim() == 3:  # fused experts [E, out, in]
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[2]))
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.5)
    return model


def convert(convert_script, hf_dir, out_path):
    src = os.path.dirname(os.path.abspath(convert_script))
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", convert_script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = mod
    spec.loader.exec_module(mod)
    base = sys.modules["conversion.base"]
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    # The families' own set_vocab want a SentencePiece model or GLM's special tokens; the tiny
    # byte-level BPE goes through the converter's generic GPT-2 path instead (the vocabulary only
    # names tokens: it does not change the forward pass being checked).
    arch = json.load(open(os.path.join(hf_dir, "config.json")))["architectures"][0]
    import conversion
    conversion.get_model_class(arch).set_vocab = lambda self: self._set_vocab_gpt2()
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out_path]
    mod.main()


def main():
    family, convert_script, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_model(family, len(tok))
    gguf_path = os.path.join(out_dir, f"{family}-tiny.f32.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, f"{family}-tiny")  # the converter names the model after it
        model.save_pretrained(hf_dir, safe_serialization=True)
        tok.save_pretrained(hf_dir)
        convert(convert_script, hf_dir, gguf_path)
    cases = []
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        rows = [[round(float(x), 6) for x in row] for row in lp]
        cases.append({"prompt": p, "tokens": ids, "logprobs": rows})
    doc = {"format": 1, "model": os.path.basename(gguf_path), "family": family,
           "config": model.config.to_diff_dict(),
           "peer": f"transformers {transformers.__version__}, torch {torch.__version__}, float32",
           "generated_by": f"tests/peers/family_tiny.py {family}", "cases": cases}
    out_json = os.path.join(out_dir, f"hf-{family}-tiny.json")
    json.dump(doc, open(out_json, "w"), separators=(",", ":"), default=str)
    print(f"wrote {gguf_path} and {out_json}: {sum(len(c['tokens']) for c in cases)} positions")


if __name__ == "__main__":
    main()
