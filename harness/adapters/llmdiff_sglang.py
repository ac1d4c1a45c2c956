#!/usr/bin/env python3
"""SGLang dumper output -> llmdiff dump format 2 (one safetensors file per TP rank).

SGLang's debug dumper (`sglang.srt.debug_utils.dumper`) writes one `torch.save` file per tensor,
`DIR/<exp_name>/step=S___rank=R___dump_index=I___name=NAME[___TAG=V...].pt`, holding
{"value": tensor, "meta": {step, rank, dump_index, name, tags..., world_rank, world_size,
"sglang_parallel_info": {tp_rank, tp_size, ...}, "dims": "t h[tp]" (explicit dumps only)}}.
This reads them with `torch.load(weights_only=True)` (no pickle parser anywhere else) and writes
`OUT.rank{r}.safetensors` in format 2 (docs/tp-dumps.md) for `llmdiff diff-layers --candidate`:

  python harness/adapters/llmdiff_sglang.py DUMP_DIR OUT --model MODEL.gguf [--config config.json]

Names. Two kinds of dump are mapped to tap keys:
  * non-intrusive module dumps (`non_intrusive__<module path>.output[.N]` / `.inputs.N`): the
    module path is matched against MODULE_SITES below, which knows SGLang's own Llama-style tree
    (qkv_proj / gate_up_proj fused and split by the engine's local sizes; rotary_emb's output
    pair is q, k after RoPE; RMSNorm called with a residual returns (normed, residual), whose
    residual is the stream after the add) and HF's (q_proj, ..., for dumps of HF modules);
  * explicit `dumper.dump(SITE, tensor, layer_id=L, dims=...)` whose name is a tap site
    (`q`, `attn_out`, ...), or one of EXPLICIT_SITES (`o_proj_partial`, ...).
A name that maps to nothing is reported (and refused with --strict), never guessed.

Layouts. SGLang's dims annotation decides when present: the last dim annotated `[tp]` is
sharded (rank r of tp holds columns r*w:(r+1)*w, w its local width: SGLang's linear layers split
evenly), `[tp:partial]` is a pre-reduce partial (its input range is the rank's shard of the op's
input, the same even split), no tp annotation (or `# tp:replicated`) is replicated. Without
dims the module table says it: a column-parallel output or a row-parallel input is sharded, a
reduced output replicated, a logits tensor as wide as the vocabulary gathered.

The rank and TP degree come from `meta["sglang_parallel_info"]` (tp_rank, tp_size), else the
top-level `tp_rank`/`tp_size` tags, else the world rank and size. The tokens come from the
`input_ids` dump (SGLang dumps it as a core field) unless --tokens is given. SGLang's dumper
records no model config: pass the engine's config.json with --config to have it compared
(config-drift); without it `config` is empty and only the tensors are compared. Several
forward steps: the first is the prefill, each later one-row step becomes `KEY#stepK`.
Needs only torch and safetensors.
"""
import argparse
import json
import os
import re
import sys
from collections import defaultdict

import torch

FORMAT_TP = "2"

# Module path suffix (after `model.layers.{i}.` for layer modules) and dump part -> (site,
# layout kind, split). kind: "col" sharded output/input, "rep" replicated, "logits" gathered or
# sharded by width. split: None, or ("qkv", i) / ("gate_up", i) for the fused outputs.
MODULE_SITES = [
    # SGLang's Llama-style tree (LlamaForCausalLM, Qwen2/3, ...).
    (r"model\.embed_tokens\.output", None, "embed", "rep", None),
    (r"model\.layers\.(\d+)\.input_layernorm\.output(?:\.0)?", 1, "attn_norm", "rep", None),
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.output(?:\.0)?", 1, "v", "col", ("qkv", 2)),
    (r"model\.layers\.(\d+)\.self_attn\.rotary_emb\.output\.0", 1, "q", "col", None),
    (r"model\.layers\.(\d+)\.self_attn\.rotary_emb\.output\.1", 1, "k", "col", None),
    (r"model\.layers\.(\d+)\.self_attn\.attn\.output", 1, "attn_out", "col", None),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.output(?:\.0)?", 1, "attn_proj", "rep", None),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.output\.0", 1, "ffn_norm", "rep", None),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.output\.1", 1, "resid_attn", "rep", None),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.output(?:\.0)?", 1, "ffn_gate", "col", ("gate_up", 0)),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.output(?:\.0)?", 1, "ffn_up", "col", ("gate_up", 1)),
    (r"model\.layers\.(\d+)\.mlp\.output", 1, "ffn_out", "rep", None),
    (r"model\.norm\.output(?:\.0)?", None, "output_norm", "rep", None),
    (r"lm_head\.output", None, "logits", "logits", None),
    # HF's tree (q/k/v and gate/up unfused; the layernorm's input is the residual stream).
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.output", 1, "v", "col", None),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.inputs\.0", 1, "attn_out", "col", None),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.inputs\.0", 1, "resid_attn", "rep", None),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.output", 1, "ffn_norm", "rep", None),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.output", 1, "ffn_gate", "col", None),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.output", 1, "ffn_up", "col", None),
    (r"model\.layers\.(\d+)\.output(?:\.0)?", 1, "resid_out", "rep", None),
]
# Explicit dump names that are not tap sites -> (site, partial).
EXPLICIT_SITES = {
    "o_proj_partial": ("attn_proj", True),
    "down_proj_partial": ("ffn_out", True),
}
TAP_SITES = {"embed", "attn_norm", "q_a", "q", "kv_latent", "k_pe", "k", "v", "attn_out",
             "attn_proj", "resid_attn", "ffn_norm", "moe_logits", "ffn_gate", "ffn_up", "ffn_out",
             "resid_out", "output_norm", "logits_pre_cap", "logits"}
GLOBAL = {"embed", "output_norm", "logits_pre_cap", "logits"}
# A partial's input: the tap whose rank-local width is the partial's input shard.
PARTIAL_INPUT = {"attn_proj": "attn_out", "ffn_out": "ffn_gate"}
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class ConvertError(Exception):
    pass


def parse_dims(dims):
    """SGLang's dims string -> "sharded", "partial" or "replicated" for the last dim."""
    shape = dims.split("#", 1)[0].split()
    if not shape:
        raise ConvertError(f"dims {dims!r}: empty")
    last = shape[-1]
    m = re.fullmatch(r"(?:\([^)]*\)|[A-Za-z_]\w*|1)(?:\[([^\]]+)\])?", last)
    if m is None:
        raise ConvertError(f"dims {dims!r}: last dim {last!r} not understood")
    mods = [x.strip() for x in (m.group(1) or "").split(",") if x.strip()]
    for dim in shape[:-1]:
        if re.search(r"\[(?:[^\]]*,)?\s*(?:attn_)?tp\b", dim):
            raise ConvertError(f"dims {dims!r}: a tp-sharded dim other than the last")
    for mod in mods:
        axis, _, qual = mod.partition(":")
        if axis.strip() in ("tp", "attn_tp"):
            quals = {q.strip() for q in qual.split("+") if q.strip()} - {"sharded"}
            if quals == {"partial"}:
                return "partial"
            if not quals:
                return "sharded"
            raise ConvertError(f"dims {dims!r}: tp qualifier {qual!r} not supported")
        if axis.strip() in ("ep", "moe_ep", "moe_tp", "cp", "sp", "etp"):
            raise ConvertError(f"dims {dims!r}: axis {axis!r} is not converted (tp only)")
    return "replicated"


def rank_of(meta):
    info = meta.get("sglang_parallel_info")
    if isinstance(info, dict) and "tp_rank" in info and "tp_size" in info:
        return int(info["tp_rank"]), int(info["tp_size"])
    if "tp_rank" in meta and "tp_size" in meta:
        return int(meta["tp_rank"]), int(meta["tp_size"])
    return int(meta.get("world_rank", meta.get("rank", 0))), int(meta.get("world_size", 1))


def load(dump_dir):
    """Every .pt of the dumper's directory (DIR, or DIR/<exp_name> when it holds one)."""
    if not os.path.isdir(dump_dir):
        raise ConvertError(f"{dump_dir}: not a directory")
    entries = sorted(os.listdir(dump_dir))
    pts = [e for e in entries if e.endswith(".pt")]
    if not pts:
        subs = [e for e in entries if os.path.isdir(os.path.join(dump_dir, e))]
        if len(subs) != 1:
            raise ConvertError(f"{dump_dir}: no .pt files and {len(subs)} experiment folders "
                               "(give the one to convert)")
        return load(os.path.join(dump_dir, subs[0]))
    out = []
    for e in pts:
        path = os.path.join(dump_dir, e)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as ex:  # a truncated or non-tensor file
            raise ConvertError(f"{path}: not loadable with weights_only=True: {ex}") from ex
        if not isinstance(obj, dict) or "meta" not in obj or "value" not in obj:
            raise ConvertError(f"{path}: not an SGLang dumper file (no value/meta)")
        out.append((e, obj["value"], obj["meta"]))
    return out


def site_of(name, meta):
    """(site, layer, kind, split) for a dump name, or None."""
    if name in EXPLICIT_SITES or name in TAP_SITES:
        site, partial = EXPLICIT_SITES.get(name, (name, False))
        layer = meta.get("layer_id")
        if site not in GLOBAL and layer is None:
            raise ConvertError(f"explicit dump {name!r} without a layer_id tag")
        return site, (None if site in GLOBAL else int(layer)), ("partial" if partial else None), None
    if not name.startswith("non_intrusive__"):
        return None
    path = name[len("non_intrusive__"):]
    for pattern, group, site, kind, split in MODULE_SITES:
        m = re.fullmatch(pattern, path)
        if m:
            return site, (int(m.group(group)) if group else None), kind, split
    return None


def split_fused(t, split, cfg, tp):
    """The engine's own local sizes for a fused qkv / gate_up output."""
    which, i = split
    w = t.shape[-1]
    if which == "gate_up":
        if w % 2:
            raise ConvertError(f"gate_up output width {w} is odd")
        return t[..., i * w // 2:(i + 1) * w // 2]
    if cfg is None:
        raise ConvertError("qkv_proj is fused: --config (head counts, head_dim) is needed to split it")
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nq = cfg["num_attention_heads"] // tp
    nkv = max(1, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) // tp)
    sizes = [nq * hd, nkv * hd, nkv * hd]
    if sum(sizes) != w:
        raise ConvertError(f"qkv_proj output width {w} is not q {sizes[0]} + k {sizes[1]} + v {sizes[2]}")
    a = sum(sizes[:i])
    return t[..., a:a + sizes[i]]


def effective_config(cfg):
    """The engine's config.json in the keys llmdiff compares (as llmdiff_dump.effective_config
    records them from a live model; docs/tp-dumps.md)."""
    if cfg is None:
        return {}
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    heads = cfg.get("num_attention_heads")
    out = {
        "rope_theta": rp.get("rope_theta", cfg.get("rope_theta")),
        "rope_type": rp.get("rope_type", rp.get("type", "default")),
        "rope_scaling": json.dumps({k: v for k, v in sorted(rp.items())
                                    if k not in ("rope_theta", "rope_type", "type")}),
        "rms_norm_eps": cfg.get("rms_norm_eps"),
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim") or (cfg["hidden_size"] // heads if heads else None),
        "hidden_size": cfg.get("hidden_size"),
        "intermediate_size": cfg.get("intermediate_size"),
        "vocab_size": cfg.get("vocab_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
    return {k: v for k, v in out.items() if v is not None}


def convert(dump_dir, out, model, cfg=None, tokens=None, strict=False, normalize_qk="hf-rotate-half"):
    """Writes OUT.rank{r}.safetensors for every rank; returns (paths, unmapped names)."""
    from safetensors.torch import save_file
    files = load(dump_dir)
    ranks = {}
    steps = sorted({int(meta.get("step", 0)) for _, _, meta in files})
    step_index = {s: k for k, s in enumerate(steps)}  # 0 = the prefill, K = decode step K
    per_rank = defaultdict(dict)
    mapping = defaultdict(dict)
    classes = defaultdict(dict)
    unmapped = []
    ids = {}
    for fname, value, meta in files:
        name = meta.get("name")
        r, n = rank_of(meta)
        if ranks.setdefault("tp", n) != n:
            raise ConvertError(f"{fname}: tp_size {n} where other files say {ranks['tp']}")
        if not 0 <= r < n:
            raise ConvertError(f"{fname}: tp_rank {r} outside tp_size {n}")
        if name == "input_ids":
            ids.setdefault(step_index[int(meta.get("step", 0))], {})[r] = [int(x) for x in value.reshape(-1)]
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            unmapped.append(name)
            continue
        hit = site_of(name, meta)
        if hit is None:
            unmapped.append(name)
            continue
        site, layer, kind, split = hit
        t = value.detach().reshape(-1, value.shape[-1])
        if split is not None:
            t = split_fused(t, split, cfg, n)
        if "dims" in meta:
            lay = parse_dims(meta["dims"])
        elif kind == "partial":
            lay = "partial"
        elif kind == "col":
            lay = "sharded"
        elif kind == "logits":
            lay = "gathered" if cfg and t.shape[-1] == cfg.get("vocab_size") else "sharded"
        else:
            lay = "replicated"
        key = site if layer is None else f"blk.{layer}.{site}"
        key = f"{key}@r{r}" + ("#partial" if lay == "partial" else "")
        k = step_index[int(meta.get("step", 0))]
        if k:
            key = f"{key}#step{k}"
        if key in per_rank[r]:
            raise ConvertError(f"{fname}: {key} already given by {mapping[r][key]}")
        per_rank[r][key] = t.contiguous()
        mapping[r][key] = name
        cls = site + ("#partial" if lay == "partial" else "")
        classes[r].setdefault(cls, set()).add((lay, t.shape[-1]))
    if unmapped and strict:
        raise ConvertError(f"{len(unmapped)} dumps map to no tap: {sorted(set(unmapped))[:5]}")
    tp = ranks.get("tp")
    if tp is None:
        raise ConvertError(f"{dump_dir}: no tensors")
    missing = [r for r in range(tp) if r not in per_rank]
    if missing:
        raise ConvertError(f"ranks {missing} of {tp} wrote no mapped tensor")
    if tokens is None:
        if not ids:
            raise ConvertError("no input_ids dump: give --tokens")
        tokens = []
        for k in sorted(ids):
            seqs = list(ids[k].values())
            if any(s != seqs[0] for s in seqs):
                raise ConvertError(f"ranks disagree on input_ids at step {k}")
            tokens += seqs[0]
    # Several steps: the first is the prefill (its rows), each later one decodes one token.
    prefill = len(tokens) - (len(steps) - 1) if len(steps) > 1 else None
    dtypes = {DTYPE_NAMES.get(t.dtype) for r in per_rank for t in per_rank[r].values()}
    if None in dtypes or len(dtypes) != 1:
        raise ConvertError(f"tensor dtypes {sorted(map(str, dtypes))}: one of f32/bf16/f16 throughout")
    compute_dtype = dtypes.pop()
    paths = []
    for r in range(tp):
        layout = {}
        for cls, seen in classes[r].items():
            if len(seen) != 1:
                raise ConvertError(f"rank {r}: {cls} has several layouts/widths {sorted(seen)}")
            (lay, w), = seen
            if lay == "sharded":
                layout[cls] = f"sharded(1,{r * w}:{(r + 1) * w})"
            elif lay == "partial":
                site = cls.split("#")[0]
                inp = classes[r].get(PARTIAL_INPUT[site])
                if not inp:
                    raise ConvertError(f"rank {r}: {cls} without its input {PARTIAL_INPUT[site]} "
                                       "(the partial's input range is that tap's shard)")
                (_, wi), = inp
                layout[cls] = f"partial({r * wi}:{(r + 1) * wi})"
            else:
                layout[cls] = lay
        normalize = {}
        if normalize_qk and any(re.search(r"\.(q|k)@r\d+", k) for k in per_rank[r]):
            normalize = {"q": normalize_qk, "k": normalize_qk}
        meta = {
            "llmdiff.format": FORMAT_TP,
            "tokens": json.dumps(tokens),
            "model": str(model),
            "tp": str(tp),
            "rank": str(r),
            "mapping": json.dumps({k: f"sglang:{v}" for k, v in mapping[r].items()}),
            "layout": json.dumps(layout),
            "normalize": json.dumps(normalize),
            "config": json.dumps(effective_config(cfg)),
            "tp_plan": json.dumps({"source": "sglang dumper", "tp_size": tp}),
            "llmdiff.compute_dtype": compute_dtype,
            **({"prefill": str(prefill)} if prefill else {}),
        }
        path = f"{out}.rank{r}.safetensors"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save_file(per_rank[r], path, metadata=meta)
        paths.append(path)
    return paths, sorted(set(unmapped))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dump_dir", help="the dumper's dir (or its <exp_name> folder)")
    ap.add_argument("out", help="output prefix: OUT.rank{r}.safetensors")
    ap.add_argument("--model", required=True, help="the model's name or GGUF file name (metadata)")
    ap.add_argument("--config", help="the engine's config.json, recorded for the config check")
    ap.add_argument("--tokens", help="comma-separated token ids (default: the input_ids dump)")
    ap.add_argument("--strict", action="store_true", help="refuse dumps that map to no tap")
    ap.add_argument("--normalize-qk", default="hf-rotate-half",
                    help="q/k normalization (hf-rotate-half: NeoX-style rope, as SGLang's Llama)")
    a = ap.parse_args(argv)
    try:
        cfg = None
        if a.config:
            with open(a.config) as fh:
                cfg = json.load(fh)
        tokens = None if a.tokens is None else [int(x) for x in a.tokens.split(",")]
        paths, unmapped = convert(a.dump_dir, a.out, a.model, cfg, tokens, a.strict, a.normalize_qk)
    except (ConvertError, OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    if unmapped:
        print(f"{len(unmapped)} dump names map to no tap (not converted): "
              + ", ".join(unmapped[:8]) + (" ..." if len(unmapped) > 8 else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
