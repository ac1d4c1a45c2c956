"""llmdiff tensor dumps from PyTorch engines (formats 1 and 2; README "Foreign engines: tensor dumps",
docs/tp-dumps.md for format 2).

    from llmdiff_dump import Dumper
    with Dumper(model, layers=None) as d:          # registers forward hooks by module name
        model(torch.tensor([tokens]))
    d.save("dump.safetensors", tokens, model="SmolLM2-135M-Instruct.Q4_1.gguf")

then `llmdiff diff-layers MODEL.gguf --candidate dump.safetensors`.

Hooks CLONE every tensor at hook time (fused kernels may later mutate the buffer in place) and
store it as [n_tokens, width] (batch 1) in the dtype the engine held it in: a bf16 model's taps
are stored bf16, an fp16 model's f16, an fp32 model's f32 (any other dtype, e.g. fp8 or f64, is
stored f32). `Dumper(..., store="f32")` forces f32 for every tensor. The metadata key
`llmdiff.compute_dtype` (`f32`, `bf16` or `f16`) records the model's compute dtype, taken from
`next(model.parameters()).dtype` unless `compute_dtype=` names it; each tensor's own dtype is the
safetensors dtype it is stored in. A dump names each tensor by its tap key (`blk.3.attn_out`);
rank-local values (`blk.3.attn_out@r1`) go in one file per rank.

Under torch.distributed (world size > 1, e.g. HF `tp_plan="auto"` under torchrun) the Dumper writes
format 2: one file per rank (`save("x.safetensors", ...)` writes `x.rank{r}.safetensors`), every
tensor keyed `KEY@r{rank}`, with the layout of each site declared from the parameters' real DTensor
placements (`replicated`, `gathered`, `sharded(1,A:B)`), each rank's effective model config, the TP
degree and plan, and the true pre-reduce partial sums of the row-parallel modules (o_proj,
down_proj) as `KEY@r{rank}#partial` with layout `partial(A:B)` (A:B: the input columns the rank
holds). transformers 5 all-reduces inside the module's forward, so forward hooks see the reduced
output; the partials are taken by wrapping `torch.distributed.all_reduce`.

Module maps: HF_LLAMA and HF_DEEPSEEK_V3 run here (tests/peers/hf_dump_smollm2.py).
VLLM_LLAMA, VLLM_QWEN3 and VLLM_DEEPSEEK_V2 come from vllm_sites.json; their module paths,
classes, fused splits and layouts were checked against vLLM's model classes built on the meta
device (tests/peers/vllm_map_check.py), but no vLLM forward was run here (no GPU).
"""
import json
import re

import torch

FORMAT = "1"
FORMAT_TP = "2"

# Tap site -> (module name pattern with {i} for the layer, "in" | "out"): the tensor taken is the
# module's first input ("in", a forward pre-hook) or its output ("out").
HF_LLAMA = {
    "embed": ("model.embed_tokens", "out"),
    "attn_norm": ("model.layers.{i}.input_layernorm", "out"),
    "v": ("model.layers.{i}.self_attn.v_proj", "out"),
    "attn_out": ("model.layers.{i}.self_attn.o_proj", "in"),
    "attn_proj": ("model.layers.{i}.self_attn.o_proj", "out"),
    "resid_attn": ("model.layers.{i}.post_attention_layernorm", "in"),
    "ffn_norm": ("model.layers.{i}.post_attention_layernorm", "out"),
    "ffn_gate": ("model.layers.{i}.mlp.gate_proj", "out"),
    "ffn_up": ("model.layers.{i}.mlp.up_proj", "out"),
    "ffn_out": ("model.layers.{i}.mlp", "out"),
    "resid_out": ("model.layers.{i}", "out"),
    "output_norm": ("model.norm", "out"),
    "logits": ("lm_head", "out"),
}
# q and k after RoPE have no module of their own in HF: the adapter wraps the modeling file's
# apply_rotary_pos_emb (see _RopeTap) and records them in HF's rotate_half layout, declared as
# layout "hf-rotate-half" so llmdiff permutes them back to GGUF's per-head interleaved order.
HF_ROPE_SITES = {"q": "model.layers.{i}.self_attn:apply_rotary_pos_emb[0]",
                 "k": "model.layers.{i}.self_attn:apply_rotary_pos_emb[1]"}

HF_DEEPSEEK_V3 = {
    "embed": ("model.embed_tokens", "out"),
    "attn_norm": ("model.layers.{i}.input_layernorm", "out"),
    "q_a": ("model.layers.{i}.self_attn.q_a_proj", "out"),
    "kv_latent": ("model.layers.{i}.self_attn.kv_a_layernorm", "out"),
    "attn_out": ("model.layers.{i}.self_attn.o_proj", "in"),
    "attn_proj": ("model.layers.{i}.self_attn.o_proj", "out"),
    "resid_attn": ("model.layers.{i}.post_attention_layernorm", "in"),
    "ffn_norm": ("model.layers.{i}.post_attention_layernorm", "out"),
    "ffn_out": ("model.layers.{i}.mlp", "out"),
    "resid_out": ("model.layers.{i}", "out"),
    "output_norm": ("model.norm", "out"),
    "logits": ("lm_head", "out"),
}

# vLLM's module maps are data (vllm_sites.json beside this file), checked against vLLM's real model
# classes on the meta device by tests/peers/vllm_map_check.py: fused qkv_proj / gate_up_proj are
# split by the module's own output_sizes, RMSNorm's (normed, residual) pair and the decoder
# layer's deferred residual add are taken apart (see "where" in the file).
def _vllm_maps():
    import os
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_sites.json")) as fh:
        doc = json.load(fh)
    return {fam: {site: (v[0], v[1]) for site, v in spec["sites"].items()}
            for fam, spec in doc.items() if not fam.startswith("_")}


VLLM_MAPS = _vllm_maps()
VLLM_LLAMA = VLLM_MAPS["llama"]
VLLM_QWEN3 = VLLM_MAPS["qwen3"]
VLLM_DEEPSEEK_V2 = VLLM_MAPS["deepseek_v2"]

# Family taps. Gemma 2/3 with `final_logit_softcapping` cap the logits after lm_head: HF's
# lm_head output is `logits_pre_cap`, and the capped `logits` (the model's output) have no
# module: merge this into a Gemma mapping in place of its "logits" entry. gpt-oss's `attn_sink`
# (the probability each head's sink takes) is computed inside HF's attention function, with no
# module to hook: leave it out (it is listed as missing, not guessed).
HF_FINAL_SOFTCAP = {"logits_pre_cap": ("lm_head", "out")}

GLOBAL = {"embed", "output_norm", "logits_pre_cap", "logits"}


def _first(x):
    while isinstance(x, (tuple, list)):
        x = x[0]
    return x


def _take(where, mod, o):
    """The tensor `where` names in a module's output (see vllm_sites.json): "out", "out.N",
    "out.N:split(K)" (a fused output split by the module's output_sizes / tp), "out:sum"."""
    if where == "out:sum":
        parts = [t for t in o if isinstance(t, torch.Tensor)] if isinstance(o, (tuple, list)) else [o]
        return sum(parts[1:], parts[0])
    m = re.fullmatch(r"out(?:\.(\d+))?(?::split\((\d+)\))?", where)
    if m is None:
        raise ValueError(f"where={where!r} not understood")
    # vLLM's RMSNorm returns a bare tensor when called without a residual (layer 0's
    # input_layernorm): "out.0" is then that tensor.
    if m.group(1) is not None and isinstance(o, (tuple, list)):
        t = o[int(m.group(1))]
    elif m.group(1) not in (None, "0"):
        raise ValueError(f"where={where!r}: the module returned one tensor, not a tuple")
    else:
        t = o
    t = _first(t)
    if m.group(2) is not None:
        tp = int(getattr(mod, "tp_size", 1) or 1)
        sizes = [int(x) // tp for x in mod.output_sizes]
        k = int(m.group(2))
        a = sum(sizes[:k])
        t = t[..., a:a + sizes[k]]
    return t


# torch dtype -> the name `llmdiff.compute_dtype` uses; these three are also the dtypes a dump
# stores tensors in.
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
STORE = ("model", "f32")


def _rows(t, store="model"):
    """[1, n, w] or [n, w] or [1, H, n, hd] (heads first) -> a [n, width] clone, in the tensor's
    own dtype when that is f32, bf16 or f16 and store == "model", else f32."""
    t = t.detach()
    if t.dim() == 4:  # [b, heads, n, hd]
        t = t[0].transpose(0, 1).reshape(t.shape[2], -1)
    elif t.dim() == 3:
        t = t[0]
    if store == "f32" or t.dtype not in DTYPE_NAMES:
        t = t.to(torch.float32)
    return t.clone().contiguous()


def compute_dtype_of(model):
    """The model's compute dtype as `llmdiff.compute_dtype` names it (its first parameter's)."""
    dt = next(model.parameters()).dtype
    if dt not in DTYPE_NAMES:
        raise ValueError(f"model parameters are {dt}; pass Dumper(compute_dtype='f32'|'bf16'|'f16')")
    return DTYPE_NAMES[dt]


class Dumper:
    def __init__(self, model, mapping=None, layers=None, rank=None, rope=True, store="model", compute_dtype=None):
        if store not in STORE:
            raise ValueError(f"store={store!r}: one of {STORE}")
        if compute_dtype is not None and compute_dtype not in DTYPE_NAMES.values():
            raise ValueError(f"compute_dtype={compute_dtype!r}: one of {sorted(DTYPE_NAMES.values())}")
        self.model = model
        self.store = store
        self.compute_dtype = compute_dtype if compute_dtype is not None else compute_dtype_of(model)
        self.mapping = mapping if mapping is not None else HF_LLAMA
        self.layers = layers
        self.rank = rank
        self.rope = rope
        self.tensors = {}
        self.used = {}
        self.handles = []
        self._layer = None
        self._patched = None
        self._reduce_patched = None
        self._current = None
        # Decode steps: set `d.step = k` (1, 2, ...) before the k-th one-token forward after the
        # prefill; its taps are stored as `KEY#stepK` and `prefill` is recorded (format 2).
        self.step = 0
        self._max_step = 0
        self.dist = _dist()
        if self.dist is not None:
            if rank is not None and rank != self.dist.get_rank():
                raise ValueError(f"rank={rank} but torch.distributed says {self.dist.get_rank()}")
            self.rank = self.dist.get_rank()
            self.tp = self.dist.get_world_size()
        else:
            self.tp = None

    def _key(self, site, layer):
        k = site if layer is None else f"blk.{layer}.{site}"
        return k if self.rank is None else f"{k}@r{self.rank}"

    def _put(self, key, t):
        if self.step:
            key = f"{key}#step{self.step}"
            self._max_step = max(self._max_step, self.step)
        self.tensors[key] = _rows(t, self.store)

    def __enter__(self):
        names = dict(self.model.named_modules())
        n_layers = sum(1 for n in names if re.fullmatch(r"model\.layers\.\d+", n))
        layers = range(n_layers) if self.layers is None else self.layers
        for site, (pattern, where) in self.mapping.items():
            for layer in ([None] if site in GLOBAL else layers):
                name = pattern.format(i=layer)
                mod = names.get(name)
                if mod is None:
                    continue
                key = self._key(site, layer)
                self.used[key] = f"{name}:{'input' if where == 'in' else 'output' if where == 'out' else where}"
                if where == "in":
                    h = mod.register_forward_pre_hook(lambda m, a, key=key: self._put(key, _first(a)))
                elif where == "out":
                    h = mod.register_forward_hook(lambda m, a, o, key=key: self._put(key, _first(o)))
                else:
                    h = mod.register_forward_hook(
                        lambda m, a, o, key=key, where=where: self._put(key, _take(where, m, o)))
                self.handles.append(h)
        if self.rope and getattr(getattr(self.model, "config", None), "model_type", None) == "llama":
            self._hook_rope(names, layers)
        if self.dist is not None:
            self._hook_reduce(names, layers)
        return self

    def _hook_reduce(self, names, layers):
        """Pre-reduce partials: the module's all_reduce (inside its forward in transformers 5) is
        wrapped; the tensor handed to it while a row-parallel module runs is its partial."""
        for site, pattern in ROW_PARALLEL.items():
            for layer in layers:
                name = pattern.format(i=layer)
                mod = names.get(name)
                if mod is None or not _sharded_dim(getattr(mod, "weight", None)) == 1:
                    continue
                key = self._key(site, layer) + "#partial"
                self.used[key] = f"{name}:all_reduce input"
                self.handles.append(mod.register_forward_pre_hook(lambda m, a, key=key: setattr(self, "_current", key)))
                self.handles.append(mod.register_forward_hook(lambda m, a, o: setattr(self, "_current", None)))
        orig = self.dist.all_reduce

        def wrapped(tensor, *a, **kw):
            if self._current is not None:
                self._put(self._current, tensor)
                self._current = None
            return orig(tensor, *a, **kw)

        self.dist.all_reduce = wrapped
        self._reduce_patched = orig

    def layouts(self):
        """Each tensor class's layout on this rank, from the modules' real parameter placements."""
        names = dict(self.model.named_modules())
        out = {}
        for key in self.tensors:
            m = re.fullmatch(r"(?:blk\.(\d+)\.)?([a-z_]+)@r\d+(#partial)?(?:#step\d+)?", key)
            if not m:
                continue
            layer, site, partial = m.group(1), m.group(2), m.group(3)
            cls = site + (partial or "")
            if cls in out:
                continue
            src = SHARD_SOURCES.get(cls)
            lay = None
            if src is not None:
                mod = names.get(src[0].format(i=layer))
                w = getattr(mod, "weight", None)
                rng = _local_range(w, src[1])
                if rng is not None and not partial and self.tensors[key].shape[-1] == w.shape[src[1]]:
                    # The module gathers its shards (e.g. lm_head "colwise_gather_output").
                    lay = "gathered"
                elif rng is not None:
                    lay = f"partial({rng[0]}:{rng[1]})" if partial else f"sharded(1,{rng[0]}:{rng[1]})"
            if lay is None and partial:
                raise ValueError(f"{key}: a partial without a row-parallel weight")
            out[cls] = lay or "replicated"
        return out

    def _hook_rope(self, names, layers):
        from transformers.models.llama import modeling_llama
        for layer in layers:
            attn = names.get(f"model.layers.{layer}.self_attn")
            if attn is None:
                continue
            for site, src in HF_ROPE_SITES.items():
                self.used[self._key(site, layer)] = src.format(i=layer)
            self.handles.append(attn.register_forward_pre_hook(lambda m, a, l=layer: setattr(self, "_layer", l)))
            self.handles.append(attn.register_forward_hook(lambda m, a, o: setattr(self, "_layer", None)))
        orig = modeling_llama.apply_rotary_pos_emb

        def tapped(q, k, *a, **kw):
            q2, k2 = orig(q, k, *a, **kw)
            if self._layer is not None:
                self._put(self._key("q", self._layer), q2)
                self._put(self._key("k", self._layer), k2)
            return q2, k2

        modeling_llama.apply_rotary_pos_emb = tapped
        self._patched = (modeling_llama, orig)

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self._patched:
            mod, orig = self._patched
            mod.apply_rotary_pos_emb = orig
            self._patched = None
        if self._reduce_patched is not None:
            self.dist.all_reduce = self._reduce_patched
            self._reduce_patched = None

    def save(self, path, tokens, model, tp=1, layout=None):
        from safetensors.torch import save_file
        if self.dist is not None:
            return self._save_tp(path, tokens, model)
        if layout is None and any(re.search(r"\.(q|k)(@r\d+)?$", k) for k in self.used):
            layout = {"q": "hf-rotate-half", "k": "hf-rotate-half"}
        meta = {
            "llmdiff.format": FORMAT,
            "tokens": json.dumps([int(t) for t in tokens]),
            "model": str(model),
            "tp": str(tp),
            "mapping": json.dumps(self.used),
            "layout": json.dumps(layout or {}),
            "llmdiff.compute_dtype": self.compute_dtype,
        }
        save_file(self.tensors, path, metadata=meta)


# Row-parallel modules whose output the engine all-reduces: site -> module pattern.
ROW_PARALLEL = {"attn_proj": "model.layers.{i}.self_attn.o_proj", "ffn_out": "model.layers.{i}.mlp.down_proj"}
# Tensor class -> (module whose weight's placement gives the rank's range, the weight dim that
# range is on): colwise outputs are the weight's rows (dim 0), row-parallel inputs and partials
# its columns (dim 1).
SHARD_SOURCES = {
    "q": ("model.layers.{i}.self_attn.q_proj", 0),
    "k": ("model.layers.{i}.self_attn.k_proj", 0),
    "v": ("model.layers.{i}.self_attn.v_proj", 0),
    "attn_out": ("model.layers.{i}.self_attn.o_proj", 1),
    "attn_proj#partial": ("model.layers.{i}.self_attn.o_proj", 1),
    "ffn_gate": ("model.layers.{i}.mlp.gate_proj", 0),
    "ffn_up": ("model.layers.{i}.mlp.up_proj", 0),
    "ffn_out#partial": ("model.layers.{i}.mlp.down_proj", 1),
    "logits": ("lm_head", 0),
}


def _dist():
    """torch.distributed when a multi-process group is running, else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _sharded_dim(w):
    """The dim a DTensor parameter is sharded on over its first mesh dim, or None."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        return None
    if not isinstance(w, DTensor):
        return None
    for p in w.placements[:1]:
        if isinstance(p, Shard):
            return p.dim % w.dim()
    return None


def _local_range(w, dim):
    """[start, end) of this rank's slice of a DTensor parameter along `dim`, or None when not
    sharded there (replicated)."""
    if _sharded_dim(w) != dim % 2:
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    return int(offset[dim]), int(offset[dim]) + int(shape[dim])


def _local(w):
    return w.to_local() if hasattr(w, "to_local") else w


def effective_config(model):
    """The model's effective configuration as this process sees it: the config's values and what
    the modules really use (the rotary base from the inverse frequencies). Keys: see docs/tp-dumps.md."""
    cfg = model.config
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    out = {
        "rope_theta": rp.get("rope_theta", getattr(cfg, "rope_theta", None)),
        "rope_type": rp.get("rope_type", "default"),
        "rope_scaling": json.dumps({k: v for k, v in sorted(rp.items()) if k not in ("rope_theta", "rope_type")}),
        "rms_norm_eps": getattr(cfg, "rms_norm_eps", None),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
    }
    for name, mod in model.named_modules():
        inv = getattr(mod, "inv_freq", None)
        # Only a plain rotation's frequencies give the base back (scaled types change them).
        if name.endswith("rotary_emb") and inv is not None and inv.numel() > 1 \
                and getattr(mod, "rope_type", "default") == "default":
            dim = 2 * inv.numel()
            out["rope_theta_effective"] = float(inv.double()[1] ** (-dim / 2))
            break
    return {k: v for k, v in out.items() if v is not None}


def tp_plan_of(model):
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    try:
        return {str(k): str(v) for k, v in dict(plan).items()}
    except (TypeError, ValueError):
        return {"plan": str(plan)}


# Weight fingerprints: module pattern -> the weight kind llmdiff names it by (blk.L.w.KIND).
HF_LLAMA_WEIGHTS = {
    "q": "model.layers.{i}.self_attn.q_proj", "k": "model.layers.{i}.self_attn.k_proj",
    "v": "model.layers.{i}.self_attn.v_proj", "o": "model.layers.{i}.self_attn.o_proj",
    "gate": "model.layers.{i}.mlp.gate_proj", "up": "model.layers.{i}.mlp.up_proj",
    "down": "model.layers.{i}.mlp.down_proj",
}
SAMPLED_ROWS = 2
SAMPLED_VALUES = 32


def fingerprint(w, layout=None):
    """A weight as this rank loaded it: its layout (from the DTensor placement), local shape,
    dtype, the sha256 of its local values as contiguous little-endian f32, every local row's L2
    norm (f64) and the first SAMPLED_VALUES values of SAMPLED_ROWS rows (first and middle)."""
    import hashlib
    local = _local(w).detach()
    if layout is None:  # else declared by the caller (an engine that shards outside DTensor)
        dim = _sharded_dim(w)
        rng = _local_range(w, dim) if dim is not None else None
        layout = "replicated" if rng is None else f"sharded({dim},{rng[0]}:{rng[1]})"
    f32 = local.to(torch.float32).contiguous()
    rows = f32.shape[0]
    picks = sorted({0, rows // 2})[:SAMPLED_ROWS]
    return {
        "layout": layout,
        "shape": list(f32.shape),
        "dtype": str(local.dtype).replace("torch.", ""),
        "sha256": hashlib.sha256(f32.numpy().tobytes()).hexdigest(),
        "row_norms": [float(x) for x in f32.double().norm(dim=1)],
        "rows": {str(r): [float(x) for x in f32[r, :SAMPLED_VALUES]] for r in picks},
    }


def _fingerprints(self, weights=None):
    """Fingerprints of the dumped layers' weights, keyed `blk.L.w.KIND@rN`."""
    weights = HF_LLAMA_WEIGHTS if weights is None else weights
    names = dict(self.model.named_modules())
    n_layers = sum(1 for n in names if re.fullmatch(r"model\.layers\.\d+", n))
    layers = range(n_layers) if self.layers is None else self.layers
    out = {}
    for layer in layers:
        for kind, pattern in weights.items():
            mod = names.get(pattern.format(i=layer))
            w = getattr(mod, "weight", None)
            if w is None:
                continue
            fp = fingerprint(w)
            fp["module"] = pattern.format(i=layer)
            out[f"blk.{layer}.w.{kind}@r{self.rank}"] = fp
    return out


Dumper.fingerprints = _fingerprints


def _save_tp(self, path, tokens, model):
    from safetensors.torch import save_file
    root, ext = (path[:-len(".safetensors")], ".safetensors") if path.endswith(".safetensors") else (path, ".safetensors")
    out = f"{root}.rank{self.rank}{ext}"
    layout = self.layouts()
    normalize = {}
    if any(re.search(r"\.(q|k)@r\d+$", k) for k in self.used):
        normalize = {"q": "hf-rotate-half", "k": "hf-rotate-half"}
    meta = {
        "llmdiff.format": FORMAT_TP,
        "tokens": json.dumps([int(t) for t in tokens]),
        "model": str(model),
        "tp": str(self.tp),
        "rank": str(self.rank),
        "mapping": json.dumps(self.used),
        "layout": json.dumps(layout),
        "normalize": json.dumps(normalize),
        "config": json.dumps(effective_config(self.model)),
        "tp_plan": json.dumps(tp_plan_of(self.model)),
        "weights": json.dumps(self.fingerprints()),
        **({"prefill": str(len(tokens) - self._max_step)} if self._max_step else {}),
        "llmdiff.compute_dtype": self.compute_dtype,
    }
    save_file(self.tensors, out, metadata=meta)
    return out


Dumper._save_tp = _save_tp
