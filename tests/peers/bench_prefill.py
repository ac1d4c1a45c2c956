#!/usr/bin/env python3
"""Prefill (64 tokens) and decode timings on one GGUF, llmdiff beside its peers, same machine and
thread count, in one run: HF transformers fp32 (CPU), llama.cpp (llama-cpp-python), and
`llmdiff bench` for the reference and the CPU engine (TP 1 and 3).

Usage: bench_prefill.py MODEL.gguf [--threads 2] [--llmdiff target/release/llmdiff]
Prints a table and the ratios against HF and llama.cpp. Not run by CI.
"""
import argparse, json, os, subprocess, sys, time


def best(f, reps):
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - t0)
    return t


def tokens(n, vocab):
    return [(i * 7919 + 100) % vocab for i in range(n)]


def bench_hf(model, n, threads, reps):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    d, f = os.path.split(os.path.abspath(model))
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    ids = torch.tensor([tokens(n, m.config.vocab_size)])
    with torch.no_grad():
        return best(lambda: m(ids), reps)


def bench_llamacpp(model, n, threads, reps, n_decode):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, logits_all=False)
    ids = tokens(n, llm.n_vocab())

    def prefill():
        llm.reset()
        llm.eval(ids)

    p = best(prefill, reps)
    dbest = float("inf")
    for _ in range(reps):
        prefill()
        t0 = time.perf_counter()
        for i in range(n_decode):
            llm.eval([(i * 31 + 7) % llm.n_vocab()])
        dbest = min(dbest, (time.perf_counter() - t0) / n_decode)
    return p, dbest, llama_cpp.__version__


def bench_llmdiff(exe, model, backend, tp, n, reps, n_decode):
    out = subprocess.run([exe, "bench", model, "--backend", backend, "--tp", str(tp), "--n-prompt", str(n),
                          "--n-decode", str(n_decode), "--reps", str(reps), "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--n-decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llmdiff", default="target/release/llmdiff")
    a = ap.parse_args()
    rows = []
    ref = bench_llmdiff(a.llmdiff, a.model, "reference", 1, a.n, a.reps, 0)
    rows.append(("llmdiff reference (f64 accum)", ref["prefill_s"], None, ref["peak_rss_kib"]))
    for tp in (1, 3):
        e = bench_llmdiff(a.llmdiff, a.model, "cpu", tp, a.n, a.reps, a.n_decode)
        rows.append((f"llmdiff engine cpu TP {tp}", e["prefill_s"], e["decode_s_per_token"], e["peak_rss_kib"]))
    hf = bench_hf(a.model, a.n, a.threads, a.reps)
    rows.append(("HF transformers fp32", hf, None, None))
    lp, ld, ver = bench_llamacpp(a.model, a.n, a.threads, a.reps, a.n_decode)
    rows.append((f"llama.cpp (llama-cpp-python {ver})", lp, ld, None))
    print(f"{a.n}-token prefill and decode on {os.path.basename(a.model)}, {a.threads} threads, best of {a.reps}")
    print(f"{'':40} {'prefill s':>10} {'vs HF':>7} {'vs llama.cpp':>12} {'decode ms':>10} {'vs llama.cpp':>12} {'peak RSS MiB':>12}")
    for name, p, d, rss in rows:
        dd = f"{d*1e3:10.2f}" if d else f"{'-':>10}"
        dr = f"{d/ld:12.2f}" if d else f"{'-':>12}"
        rs = f"{rss/1024:12.1f}" if rss else f"{'-':>12}"
        print(f"{name:40} {p:10.3f} {p/hf:7.2f} {p/lp:12.2f} {dd} {dr} {rs}")


if __name__ == "__main__":
    main()
