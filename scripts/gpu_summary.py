#!/usr/bin/env python3
"""The summaries scripts/gpu-evidence.sh prints: one subcommand per step, each reading what
llmdiff (or llama-bench, or tests/peers/hf_gpu_bench.py) wrote as JSON.

    gpu_summary.py check CHECK.json           kernel checks: how many pass, the failing cases
    gpu_summary.py verdict RUN.json           one diff-layers run: verdict, first divergence, taps
    gpu_summary.py healthy healthy.txt        how many healthy cases agree
    gpu_summary.py same DIR                   DIR/cuda.json against DIR/cpu.json (fault matrix)
    gpu_summary.py faults faults.txt          how many fault cases are the SAME on cuda and cpu
    gpu_summary.py tag LABEL MODEL < b.json   one bench document as a JSON line, labelled
    gpu_summary.py bench bench.jsonl          decode / prefill per label and model (min, max)
    gpu_summary.py kbench BENCH.json [INSPECT.json]  copy bandwidth, the HBM bound, GEMV and GEMM
    gpu_summary.py hf hf.jsonl                HF transformers eager timings
    gpu_summary.py lcpp MODEL LCPP.json       llama-bench rows
Standard library only.
"""
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"error": f"{path}: {e}"}


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError):
        return []


def check(path):
    d = load(path)
    c = d.get("checks")
    if not c:
        print("no kernel check results:", d.get("error", "empty"))
        return
    bad = [x["case"] for x in c if not x["pass"]]
    print(f"kernels --check: {len(c) - len(bad)} of {len(c)} pass; failing: {bad[:20]}")


def verdict(path):
    d = load(path)
    if "verdict" not in d:
        print("n/a", d.get("error", ""))
        return
    fd = d.get("first_divergence") or {}
    t = d.get("timings_s") or {}
    print(d["verdict"], d.get("backend"), f"taps {len(d.get('taps', []))}", fd.get("tap"),
          (d.get("diagnosis") or {}).get("class"), f"total {t.get('total', 0):.2f} s")


def healthy(path):
    rows = open(path).read().splitlines()
    ok = [r for r in rows if " agree " in f" {r} "]
    print(f"healthy diff-layers on cuda: {len(ok)} of {len(rows)} agree")
    for r in rows:
        if r not in ok:
            print("  NOT AGREE:", r)


def same(folder):
    r = []
    for be in ("cuda", "cpu"):
        d = load(os.path.join(folder, f"{be}.json"))
        if "verdict" in d:
            r.append((d["verdict"], (d.get("first_divergence") or {}).get("tap"),
                      (d.get("diagnosis") or {}).get("class")))
        else:
            err = open(os.path.join(folder, f"{be}.err")).read().strip().splitlines()
            r.append(("refused", (err or [""])[-1][:100], None))
    print("cuda:", r[0], "cpu:", r[1], "SAME" if r[0] == r[1] else "DIFF")


def faults(path):
    rows = open(path).read().splitlines()
    n = sum(r.endswith("SAME") for r in rows)
    print(f"fault matrix: {n} of {len(rows)} cases the same on cuda and cpu (verdict, first tap, class)")
    for r in rows:
        if not r.endswith("SAME"):
            print("  ", r)


def tag(label, model):
    try:
        d = json.load(sys.stdin)
    except ValueError:
        d = {"error": "no bench document"}
    d["label"], d["model_name"] = label, model
    print(json.dumps(d))


def bench(path):
    rows = {}
    for d in lines(path):
        rows.setdefault((d["model_name"], d["label"]), []).append(d)
    for (model, label), ds in sorted(rows.items()):
        ds = [d for d in ds if "decode_s_per_token" in d]
        if not ds:
            print(model, label, "no result")
            continue
        dec = sorted(d["decode_s_per_token"] * 1e3 for d in ds)
        plain = [(d.get("decode_graphs") or {}).get("decode_plain_s_per_token") for d in ds]
        pre = sorted(d["prefill_last_tok_s"] for d in ds)
        bitwise = {(d.get("decode_graphs") or {}).get("logits_bitwise_equal") for d in ds}
        chk = max((d.get("decode_check") or {}).get("rel_l2") or 0 for d in ds)
        plain = [p * 1e3 for p in plain if p]
        print(f"{model} {label}: decode {dec[0]:.3f}-{dec[-1]:.3f} ms"
              + (f" (graphs off {min(plain):.3f})" if plain else "")
              + f", prefill 512 (last logits) {pre[0]:.0f}-{pre[-1]:.0f} tok/s,"
              f" all logits {min(d['prefill_s'] for d in ds) * 1e3:.1f} ms, graph logits bitwise {bitwise},"
              f" decode check rel_l2 {chk:.1e}, runs {len(ds)}")


def kbench(path, inspect=None):
    d = load(path)
    if "copy_gb_per_s" not in d:
        print("no kernels --bench results:", d.get("error", ""))
        return
    gbs = d["copy_gb_per_s"]
    print(f"copy {gbs:.0f} GB/s")
    if inspect:
        n = sum(t["n_bytes"] for t in load(inspect).get("tensors", []))
        print(f"8B Q4_K: {n / 1e9:.3f} GB of tensors, HBM bound {n / (gbs * 1e9) * 1e3:.3f} ms a decode step")
    cases = {}
    for r in d.get("bench", []):
        cases.setdefault(r["case"], []).append(r)
    for c, rs in cases.items():
        dflt = [r for r in rs if r.get("default")] or [r for r in rs if r.get("variant") is None]
        if dflt:
            r = dflt[0]
            print(f"{c}: {r['seconds'] * 1e6:.2f} us, {100 * r['fraction_of_copy']:.1f} % of copy")
    for r in d.get("read_probe", []):
        print(r["case"], r["pattern"], f"{r['seconds'] * 1e6:.2f} us {100 * r['fraction_of_copy']:.1f} %")
    for g in d.get("gemm_bench", []):
        print(g["case"], " | ".join(f"{p['path']} {p['seconds'] * 1e6:.1f} us {p['tflops']:.1f} TF" for p in g["paths"]))
    for a in d.get("attention_decode_bench", []):
        parts = " | ".join(f"L={s['chunk']} {s['seconds'] * 1e6:.1f} us" for s in a["split"])
        print(a["case"], f"per-head {a['old_seconds'] * 1e6:.1f} us | split {parts}")
    if "launch_cost_us" in d:
        print("launch cost (us)", d["launch_cost_us"])


def hf(path):
    for d in lines(path):
        print(f"HF {d['shape']}: decode {d['decode_s_per_token'] * 1e3:.2f} ms, prefill 512 {d['prefill_s'] * 1e3:.1f} ms"
              f" ({d.get('attn')}, torch {d.get('torch')}, transformers {d.get('transformers')})")


def lcpp(model, path):
    rows = load(path)
    if not isinstance(rows, list):
        print("llama.cpp", model, "no result:", rows.get("error"))
        return
    for r in rows:
        kind = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        best = max(r.get("samples_ts") or [r["avg_ts"]])
        print(f"llama.cpp {model} {kind} depth {r.get('n_depth', 0)}: mean {r['avg_ts']:.1f} tok/s"
              f" ({1e3 / r['avg_ts']:.3f} ms a token), best {best:.1f} ({1e3 / best:.3f} ms)")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"check": check, "verdict": verdict, "healthy": healthy, "same": same, "faults": faults, "tag": tag,
     "bench": bench, "kbench": kbench, "hf": hf, "lcpp": lcpp}[cmd](*args)
