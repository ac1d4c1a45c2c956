#!/usr/bin/env python3
"""HF transformers eager (bf16) prefill and decode timings on a GPU, on the two llama shapes that
`llmdiff bench --backend cuda` is measured on (tests/gpu/h200_peers_run.sh): SmolLM2-135M's and
the 8B synth's (32 layers, d 4096, ffn 14336, 32/8 heads, vocab 32000).

The weights are random, from a config: the timings of an eager forward do not depend on their
values. Timed as `llmdiff bench` times its engines:
- prefill: one forward over N prompt tokens (all logits, as an HF forward returns), best of reps;
- decode: after that prefill, one forward per new token with the KV cache; the steady figure is
  the mean over the steps after WARM, best of reps.
Every time ends with torch.cuda.synchronize(). Prints one JSON line per shape.

Usage: hf_gpu_bench.py [--shape smollm2 --shape 8b] [--n-prompt 512] [--n-decode 32] [--reps 3] [--device cpu]
Not run by CI (it needs a GPU and torch).
"""
import argparse, json, time

SHAPES = {
    # name: (layers, d, ffn, heads, kv heads, vocab, rope base, tied embeddings)
    "smollm2": (30, 576, 1536, 9, 3, 49152, 100000.0, True),
    "8b": (32, 4096, 14336, 32, 8, 32000, 10000.0, False),
}
WARM = 2


def build(name, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    layers, d, ffn, heads, kv, vocab, base, tied = SHAPES[name]
    cfg = LlamaConfig(hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, rope_theta=base, tie_word_embeddings=tied,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, attn_implementation="eager")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        m = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    return m.eval()


def synced(f):
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = f()
    sync()
    return time.perf_counter() - t0, out


def bench(name, n_prompt, n_decode, reps, device):
    import torch
    m = build(name, device)
    vocab = m.config.vocab_size
    ids = torch.tensor([[(i * 7919 + 100) % vocab for i in range(n_prompt)]], device=device)
    prefill, decode = float("inf"), float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first rep warms up kernels and the allocator
            t, out = synced(lambda: m(ids, use_cache=True))
            prefill = min(prefill, t)
            pkv = out.past_key_values
            steps = []
            for i in range(n_decode):
                tok = torch.tensor([[(i * 31 + 7) % vocab]], device=device)
                t, out = synced(lambda: m(tok, past_key_values=pkv, use_cache=True))
                pkv = out.past_key_values
                steps.append(t)
            if len(steps) > WARM:
                decode = min(decode, sum(steps[WARM:]) / len(steps[WARM:]))
    params = sum(p.numel() for p in m.parameters())
    attn = m.config._attn_implementation
    del m
    gpu = torch.cuda.get_device_name() if device == "cuda" else device
    torch.cuda.empty_cache()
    return {"peer": "hf-transformers-eager-bf16", "shape": name, "params": params, "n_prompt": n_prompt,
            "attn": attn, "n_decode": n_decode, "decode_warm_steps": WARM, "prefill_s": prefill, "decode_s_per_token": decode,
            "device": gpu, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of this script")
    a = ap.parse_args()
    for name in a.shape or ["smollm2", "8b"]:
        print(json.dumps(bench(name, a.n_prompt, a.n_decode, a.reps, a.device)), flush=True)


if __name__ == "__main__":
    main()
