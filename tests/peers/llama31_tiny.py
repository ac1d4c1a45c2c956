#!/usr/bin/env python3
"""Build a tiny Llama-3.1-style model (rope_type "llama3": factor 8, low/high frequency factors 1
and 4, original context 64) with HF transformers, convert it with llama.cpp's convert_hf_to_gguf.py
to an F32 GGUF (the converter turns the rope parameters into the `rope_freqs.weight` tensor), and
record HF fp32 log-probabilities over the FULL vocabulary at every position of a few prompts.

With head_dim 16 and base 10000 the 8 rotary pairs have wavelengths 6.3, 19.9, 62.8, 199, ... so
one pair is above the high-frequency band (unchanged), two are inside the smoothed band and five
are below the low-frequency band (divided by 8); the prompts run past position 64, the original
context. A reader that ignores `rope_freqs.weight` is far off at every position past the first.

Weights are random but scaled up (linear ~ N(0, 1/fan_in), tied embeddings ~ N(0, 1)) so the
outputs are not flat. The tokenizer is a small byte-level BPE trained here; the converter's
pre-tokenizer hash check is told it is "default".

Usage: llama31_tiny.py CONVERT_HF_TO_GGUF.py OUT_DIR
(convert_hf_to_gguf.py from llama-cpp-python's sdist: vendor/llama.cpp/, beside its gguf-py.)
Writes OUT_DIR/llama31-tiny.f32.gguf and OUT_DIR/hf-llama31-tiny.json. Not run by CI.
"""
import importlib.util, json, math, os, sys, tempfile

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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

ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def build_tokenizer(vocab_size=320):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def build_model(vocab):
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=512, rope_parameters=dict(ROPE), tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    return model


def convert(convert_script, hf_dir, out_path):
    src = os.path.dirname(os.path.abspath(convert_script))
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", convert_script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = mod
    spec.loader.exec_module(mod)
    sys.modules["conversion.base"].TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out_path]
    mod.main()


def main():
    convert_script, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(2)
    tok = build_tokenizer()
    model = build_model(len(tok))
    assert model.config.rope_parameters["rope_type"] == "llama3", model.config.rope_parameters
    gguf_path = os.path.join(out_dir, "llama31-tiny.f32.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "llama31-tiny")  # the converter names the model after it
        model.save_pretrained(hf_dir, safe_serialization=True)
        tok.save_pretrained(hf_dir)
        convert(convert_script, hf_dir, gguf_path)
    cases = []
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        # Every position, the whole vocabulary, rounded to 1e-6 (far below the 2e-3 bound).
        rows = [[round(float(x), 6) for x in row] for row in lp]
        cases.append({"prompt": p, "tokens": ids, "logprobs": rows})
    doc = {"format": 1, "model": os.path.basename(gguf_path), "rope_parameters": ROPE,
           "peer": f"transformers {transformers.__version__}, torch {torch.__version__}, float32",
           "generated_by": "tests/peers/llama31_tiny.py", "cases": cases}
    out_json = os.path.join(out_dir, "hf-llama31-tiny.json")
    json.dump(doc, open(out_json, "w"), separators=(",", ":"))
    print(f"wrote {gguf_path} and {out_json}: {sum(len(c['tokens']) for c in cases)} positions")


if __name__ == "__main__":
    main()
