#!/usr/bin/env python3
"""Run `llmdiff entropy --server --against-reference` and `llmdiff gate --server` against a real
llama-cpp-python server, healthy and with one fault at a time, and print (or write as JSON) the
verdict, band and named cause of each: the table of docs/entropy.md and the healthy floors of
golden/kld-calibration.json.

Faults on the server side are llama-cpp-python server options (RoPE frequency base or scale, KV
cache type, chat format); the others are a rewritten copy of the GGUF, edited in place with
gguf-py's reader (header layout untouched, so any loader accepts it): the RMS norm epsilon, the
add_bos_token flag, and one layer's attn_output weights scaled by a factor (Q4_1/Q8_0 block
scales, F16/F32 values).

Needs a Python with llama-cpp-python[server] and numpy (the venv of docs/entropy.md) and gguf-py
(pip's `gguf`, or the copy vendored in llama-cpp-python's source: --gguf-py DIR).

  server_faults.py --llmdiff target/release/llmdiff --model SmolLM2.gguf \
      --prompts golden/prompts-20.txt --cases healthy,rope-base-div10,... [--json-out F]
  server_faults.py ... --merge-into golden/kld-faults-smollm2.json   # update those cases' rows

Cases: healthy, healthy-f32kv, rope-scale-0.5, rope-base-div10, norm-eps-1e-2, kv-q4_0, kv-q8_0,
bos-added, chat-template-wrong, attn-out-x1.1-L<N>.
"""
import argparse, json, os, shutil, socket, subprocess, sys, tempfile, time

# llama.cpp's ggml_type numbers for the KV cache type options.
GGML_TYPE = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def scale_tensor(reader, name, factor):
    import numpy as np

    t = next(t for t in reader.tensors if t.name == name)
    raw = np.asarray(t.data).view(np.uint8).reshape(-1)
    kind = t.tensor_type.name
    if kind in ("Q4_1", "Q8_0"):
        bsz = {"Q4_1": 20, "Q8_0": 34}[kind]
        blocks = raw.reshape(-1, bsz)
        # Q4_1: f16 d, f16 m (x = d·q + m); Q8_0: f16 d (x = d·q): scale d (and m).
        n_half = 2 if kind == "Q4_1" else 1
        halves = blocks[:, : 2 * n_half].copy().view(np.float16)
        halves = (halves.astype(np.float32) * factor).astype(np.float16)
        blocks[:, : 2 * n_half] = halves.view(np.uint8).reshape(blocks.shape[0], 2 * n_half)
    elif kind == "F32":
        v = raw.view(np.float32)
        v *= factor
    elif kind == "F16":
        v = raw.view(np.float16)
        v[:] = (v.astype(np.float32) * factor).astype(np.float16)
    else:
        raise SystemExit(f"{name}: scaling {kind} not supported")


def set_field(reader, key, value):
    f = reader.fields[key]
    f.parts[f.data[0]][0] = value


def make_variant(src, dst, case, gguf_py):
    if gguf_py:
        sys.path.insert(0, gguf_py)
    from gguf import GGUFReader

    shutil.copyfile(src, dst)
    r = GGUFReader(dst, "r+")
    if case == "norm-eps-1e-2":
        set_field(r, f"{r.fields['general.architecture'].contents()}.attention.layer_norm_rms_epsilon", 1e-2)
    elif case == "bos-added":
        set_field(r, "tokenizer.ggml.add_bos_token", True)
    elif case.startswith("attn-out-x"):
        factor, layer = case[len("attn-out-x") :].split("-L")
        scale_tensor(r, f"blk.{int(layer)}.attn_output.weight", float(factor))
    else:
        raise SystemExit(f"no file rewrite for {case}")
    r.data.flush()
    del r


def server_args(case):
    """(extra server options, needs a rewritten file)"""
    if case == "healthy":
        return [], False
    if case == "healthy-f32kv":
        return ["--type_k", "0", "--type_v", "0"], False
    if case == "rope-scale-0.5":
        return ["--rope_freq_scale", "0.5"], False
    if case == "rope-base-div10":
        return ["--rope_freq_base", "10000"], False
    if case.startswith("kv-"):
        t = GGML_TYPE[case[3:]]
        return ["--type_k", str(t), "--type_v", str(t), "--flash_attn", "true"], False
    if case == "chat-template-wrong":
        return ["--chat_format", "llama-2"], False
    return [], True


def start_server(python, model, extra, port, threads):
    cmd = [python, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", "2048", "--logits_all", "true", "--n_threads", str(threads), "--n_threads_batch", str(threads)] + extra
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 120:
        if p.poll() is not None:
            log.seek(0)
            raise SystemExit(f"server exited: {' '.join(cmd)}\n{log.read()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p
        except OSError:
            time.sleep(0.5)
    p.kill()
    raise SystemExit("server did not start in 120 s")


def run_llmdiff(cmd):
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr, time.time() - t0


def merge(path, row, note):
    """Replaces (or appends) `row`'s case in the committed rows file; fields the new row lacks are
    kept from the old one."""
    doc = json.load(open(path))
    cases = [r["case"] for r in doc["rows"]]
    if row["case"] in cases:
        i = cases.index(row["case"])
        merged = dict(doc["rows"][i])
        merged.update(row)
        doc["rows"][i] = merged
    else:
        doc["rows"].append(row)
    if note and note not in doc["what"]:
        doc["what"] = doc["what"].rstrip() + " " + note
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llmdiff", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--golden", help="gate --server against this golden file too")
    ap.add_argument("--cases", default="healthy")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--gguf-py")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--calibration", help="--kld-calibration for llmdiff")
    ap.add_argument("--json-out")
    ap.add_argument("--no-chat", action="store_true", help="skip --chat")
    ap.add_argument("--top-logprobs", type=int, default=20)
    ap.add_argument("--keep", help="keep each case's entropy JSON (per-position KLD) in this folder")
    ap.add_argument("--merge-into", help="a committed rows file ({what, rows}): replace the rows of the cases run "
                    "(fields this run did not measure, e.g. gate or chat without --golden / with --no-chat, are kept "
                    "from the old row) and write it back")
    ap.add_argument("--entropy-args", default="", help="more arguments for `llmdiff entropy`, space-separated "
                    "(e.g. --repeat-probe always)")
    ap.add_argument("--note", help="with --merge-into: appended to the file's `what`")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="llmdiff-faults-")
    keep = a.keep or tmp
    os.makedirs(keep, exist_ok=True)
    rows = []
    for case in a.cases.split(","):
        extra, rewrite = server_args(case)
        model = a.model
        if rewrite:
            model = os.path.join(tmp, f"{case}.gguf")
            make_variant(a.model, model, case, a.gguf_py)
        port = free_port()
        srv = start_server(a.python, model, extra, port, a.threads)
        url = f"http://127.0.0.1:{port}"
        cal = ["--kld-calibration", a.calibration] if a.calibration else []
        try:
            out = os.path.join(keep, f"{case}.json")
            # A rewritten file is the deployed one: MODEL is it, the original is --trusted-model.
            trusted = ["--trusted-model", a.model] if rewrite else []
            chat = [] if a.no_chat else ["--chat"]
            code, so, se, secs = run_llmdiff([a.llmdiff, "entropy", model, "--server", url, "--prompts", a.prompts,
                                              "--max-new-tokens", str(a.max_new_tokens), "--against-reference",
                                              "--concurrency", "1", "--top-logprobs", str(a.top_logprobs),
                                              "--json-out", out] + trusted + chat + cal + a.entropy_args.split())
            row = {"case": case, "entropy_exit": code, "entropy_seconds": round(secs, 1)}
            if os.path.exists(out):
                doc = json.load(open(out))
                v = doc.get("kld_verdict") or {}
                row.update({
                    "entropy_verdict": doc.get("verdict"),
                    "prompts_not_healthy": sum(p["verdict"] != "healthy" for p in doc["prompts"]),
                    "band": v.get("band_name"), "cause": v.get("cause"),
                    "n_positions": v.get("n_positions"), "mean": v.get("mean"), "mean_se": v.get("mean_se"),
                    "p95": v.get("p95"), "p99": v.get("p99"), "max": v.get("max"),
                    "mean_x_floor": v.get("mean_x_floor"), "p99_x_floor": v.get("p99_x_floor"),
                    "growth": v.get("growth"), "evidence": v.get("evidence"),
                    "repeat_probe": v.get("repeat_probe"),
                    "same_top1_pct": doc["kld"]["same_top1_pct"] if doc.get("kld") else None,
                    "warnings": doc.get("warnings", []),
                    "metadata_differences": v.get("metadata_differences"),
                })
                if doc.get("chat"):
                    row["chat"] = [p["finding"] for p in doc["chat"].get("prompts", [])]
                    row["chat_verdict"] = (doc["chat"].get("verdict") or {}).get("headline")
            else:
                row["error"] = se.strip().splitlines()[-1:] if se.strip() else so[-300:]
            if a.golden:
                code, so, se, _ = run_llmdiff([a.llmdiff, "gate", "--server", url, "--golden", a.golden,
                                               "--concurrency", "1", "--json"] + cal)
                row["gate_exit"] = code
                try:
                    g = json.loads(so)
                    s = g["suites"][0]
                    row["gate_verdict"] = g["verdict"]
                    row["gate_failed_cases"] = [c["name"] for c in s["cases"] if not c["passed"]]
                    agree = next((c for c in s["cases"] if c["name"] == "agreement"), None)
                    row["gate_agreement"] = agree["failures"][0]["item"] if agree and agree["failures"] else "pass"
                    row["gate_mean"] = s["server"]["kld"]["mean"]
                except Exception:
                    row["gate_error"] = se.strip().splitlines()[-1:] if se.strip() else so[-300:]
        finally:
            srv.terminate()
            srv.wait(timeout=30)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if a.merge_into:
            merge(a.merge_into, row, a.note if len(rows) == 1 else None)
    if a.json_out:
        json.dump(rows, open(a.json_out, "w"), indent=1)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
