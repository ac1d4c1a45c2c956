"""llmdiff tensor dumps from PyTorch engines (format 1; README "Foreign engines: tensor dumps").

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

Module maps: HF_LLAMA and HF_DEEPSEEK_V3 run here (tests/peers/hf_dump_smollm2.py).
VLLM_LLAMA and VLLM_DEEPSEEK_V2 are offered for users to try and were NOT run here (no vLLM on
these machines): vLLM fuses q/k/v (qkv_proj) and gate/up (gate_up_proj), so those are split by
width, and its rotary runs in place inside the attention op.
"""
import json
import re

import torch

FORMAT = "1"

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

# Not run here (no vLLM on these machines). qkv_proj / gate_up_proj outputs are fused: split them
# yourself or leave q/k/v/ffn_gate/ffn_up out (they are then listed as missing, not guessed).
VLLM_LLAMA = {
    "embed": ("model.embed_tokens", "out"),
    "attn_norm": ("model.layers.{i}.input_layernorm", "out"),
    "attn_out": ("model.layers.{i}.self_attn.o_proj", "in"),
    "attn_proj": ("model.layers.{i}.self_attn.o_proj", "out"),
    "ffn_norm": ("model.layers.{i}.post_attention_layernorm", "out"),
    "ffn_out": ("model.layers.{i}.mlp", "out"),
    "output_norm": ("model.norm", "out"),
}
VLLM_DEEPSEEK_V2 = {
    "embed": ("model.embed_tokens", "out"),
    "attn_norm": ("model.layers.{i}.input_layernorm", "out"),
    "q_a": ("model.layers.{i}.self_attn.q_a_proj", "out"),
    "kv_latent": ("model.layers.{i}.self_attn.kv_a_layernorm", "out"),
    "attn_out": ("model.layers.{i}.self_attn.o_proj", "in"),
    "attn_proj": ("model.layers.{i}.self_attn.o_proj", "out"),
    "ffn_norm": ("model.layers.{i}.post_attention_layernorm", "out"),
    "ffn_out": ("model.layers.{i}.mlp", "out"),
    "output_norm": ("model.norm", "out"),
}

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

    def _key(self, site, layer):
        k = site if layer is None else f"blk.{layer}.{site}"
        return k if self.rank is None else f"{k}@r{self.rank}"

    def _put(self, key, t):
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
                self.used[key] = f"{name}:{'input' if where == 'in' else 'output'}"
                if where == "in":
                    h = mod.register_forward_pre_hook(lambda m, a, key=key: self._put(key, _first(a)))
                else:
                    h = mod.register_forward_hook(lambda m, a, o, key=key: self._put(key, _first(o)))
                self.handles.append(h)
        if self.rope and getattr(getattr(self.model, "config", None), "model_type", None) == "llama":
            self._hook_rope(names, layers)
        return self

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

    def save(self, path, tokens, model, tp=1, layout=None):
        from safetensors.torch import save_file
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
