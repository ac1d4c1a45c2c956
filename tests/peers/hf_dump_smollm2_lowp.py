#!/usr/bin/env python3
"""HF transformers bf16 / fp16 dumps of SmolLM2 with planted faults, for `llmdiff diff-layers
--candidate` (format 1, tensors stored in the compute dtype, `llmdiff.compute_dtype` recorded).

The model is loaded from the GGUF into transformers in fp32 (HF dequantizes the same bytes our
reference reads), then cast with `model.to(dtype)`. The rotary embedding's `inv_freq` buffer is put
back to fp32 after the cast: `from_pretrained(..., dtype=bf16)` keeps it fp32 (it is computed
in fp32 at init and is not a checkpoint tensor), while `model.to()` would round it to bf16 too,
a rope-angle error real bf16 deployments do not have. It is then hooked with
harness/adapters/llmdiff_dump.py and run once per fault on the same tokens; into OUTDIR go
`NAME.safetensors` and `manifest.json` (each fault: what was planted, where, the tap it must be
localized at and the class the issue asks for).

Faults (each planted by monkeypatching the HF modules; a forward pre-hook on o_proj registered
before the dump's, so the dump sees what o_proj really got):
  healthy               the model as is
  attn-zero             o_proj's input zeroed in layer FAULT_LAYER
  head-swap             heads 0 and 1 of o_proj's input swapped in layer FAULT_LAYER
  head-scale-S          head HEAD of o_proj's input times S in layer FAULT_LAYER (S = 1.05, 1.03,
                        1.02, 1.01: the smallest detectable scale is to be found)
  rope-theta-div10      every layer: RoPE base / 10 (the rotary embedding's inv_freq recomputed)
  rms-eps-1e-2          every RMSNorm's eps (variance_epsilon) set to 1e-2

Usage: hf_dump_smollm2_lowp.py MODEL.gguf OUTDIR --dtype bf16|f16 [--layers 0,1] [--fault-layer 1]
           [--head 4] [--no-logits] [--faults a,b,...] [--tokens 1,2,...] [--store model|f32]
Defaults: all 30 layers + logits, fault layer 12, head 4, the 16-token chat prompt
"<|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n<|im_start|>assistant\\n"
(ids from `llmdiff tokenize`).

The small dumps in golden/candidate-smollm2-bf16/ and golden/candidate-smollm2-f16/ come from:
  hf_dump_smollm2_lowp.py .cache/SmolLM2-135M-Instruct.Q4_1.gguf golden/candidate-smollm2-bf16 \
      --dtype bf16 --layers 0,1 --fault-layer 1 --no-logits \
      --faults healthy,attn-zero,head-swap,head-scale-1.05,head-scale-1.02,head-scale-1.01,rope-theta-div10,rms-eps-1e-2
  hf_dump_smollm2_lowp.py .cache/SmolLM2-135M-Instruct.Q4_1.gguf golden/candidate-smollm2-f16 \
      --dtype f16 --layers 0,1 --fault-layer 1 --no-logits \
      --faults healthy,attn-zero,head-swap,head-scale-1.05,head-scale-1.02,rope-theta-div10,rms-eps-1e-2
(embed + layers 0-1, 16 tokens, fault in layer 1, 540 KB each: 8 + 7 files, about 8 MB.) The
full-model dumps (all faults, all 30 layers + logits) are made with the defaults and are not
committed. Not run by CI (needs torch, transformers, accelerate, gguf); its output for the small
case is committed.
"""
import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "harness", "adapters"))
import llmdiff_dump  # noqa: E402

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
TOKENS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
SCALES = ["1.05", "1.03", "1.02", "1.01"]
ALL_FAULTS = ["healthy", "attn-zero", "head-swap"] + [f"head-scale-{s}" for s in SCALES] + [
    "rope-theta-div10", "rms-eps-1e-2"]


def rope_theta(config):
    if getattr(config, "rope_theta", None) is not None:
        return float(config.rope_theta)
    params = getattr(config, "rope_parameters", None) or {}
    return float(params["rope_theta"])


def inv_freq(theta, dim):
    """Llama's default RoPE inverse frequencies, computed in f64 and stored f32."""
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    return (1.0 / theta ** (i / dim)).to(torch.float32)


class Faults:
    """Plants one fault into the model; `undo()` restores it."""

    def __init__(self, model, fault_layer, head):
        self.model = model
        self.fault_layer = fault_layer
        self.head = head
        self.cfg = model.config
        self.hd = getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.cfg.num_attention_heads
        self.undos = []

    def _o_proj_hook(self, fn):
        o_proj = self.model.model.layers[self.fault_layer].self_attn.o_proj
        h = o_proj.register_forward_pre_hook(lambda m, a: (fn(a[0]),))
        self.undos.append(h.remove)

    def plant(self, name):
        hd, h = self.hd, self.head
        if name == "healthy":
            return {"what": "none"}
        if name == "attn-zero":
            self._o_proj_hook(torch.zeros_like)
            return {"what": "o_proj input zeroed", "layer": self.fault_layer}
        if name == "head-swap":
            def swap(x):
                y = x.clone()
                y[..., 0:hd], y[..., hd:2 * hd] = x[..., hd:2 * hd], x[..., 0:hd]
                return y
            self._o_proj_hook(swap)
            return {"what": "heads 0 and 1 of o_proj input swapped", "layer": self.fault_layer, "heads": [0, 1]}
        if name.startswith("head-scale-"):
            s = float(name[len("head-scale-"):])

            def scale(x):
                y = x.clone()
                y[..., h * hd:(h + 1) * hd] = x[..., h * hd:(h + 1) * hd] * s
                return y
            self._o_proj_hook(scale)
            return {"what": f"head {h} of o_proj input times {s}", "layer": self.fault_layer, "heads": [h], "scale": s}
        if name == "rope-theta-div10":
            rot = self.model.model.rotary_emb
            old = rot.inv_freq
            theta = rope_theta(self.cfg)
            rot.inv_freq = inv_freq(theta / 10, old.numel() * 2).to(old.device)
            self.undos.append(lambda: setattr(rot, "inv_freq", old))
            return {"what": f"RoPE base {theta:g} / 10 in every layer (inv_freq recomputed)"}
        if name == "rms-eps-1e-2":
            norms = [m for m in self.model.modules() if hasattr(m, "variance_epsilon")]
            olds = [m.variance_epsilon for m in norms]
            for m in norms:
                m.variance_epsilon = 1e-2

            def undo():
                for m, e in zip(norms, olds):
                    m.variance_epsilon = e
            self.undos.append(undo)
            return {"what": f"every RMSNorm's eps ({len(norms)} norms, {olds[0]:g} in the model) set to 1e-2"}
        raise SystemExit(f"unknown fault {name!r}; known: {', '.join(ALL_FAULTS)}")

    def undo(self):
        while self.undos:
            self.undos.pop()()


def expectation(name, fault_layer, first_layer):
    """The tap the fault must be localized at and the class issue 44 asks for."""
    if name == "healthy":
        return {"verdict": "agree"}
    if name == "attn-zero":
        return {"verdict": "diverged", "first_tap": f"blk.{fault_layer}.attn_out", "class": ["stale-output"]}
    if name == "head-swap":
        return {"verdict": "diverged", "first_tap": f"blk.{fault_layer}.attn_out", "class": ["head-permutation"]}
    if name.startswith("head-scale-"):
        return {"verdict": "diverged", "first_tap": f"blk.{fault_layer}.attn_out", "class": ["scale-mismatch"]}
    if name == "rope-theta-div10":
        return {"verdict": "diverged", "first_tap": f"blk.{first_layer}.q", "class": ["rope"]}
    if name == "rms-eps-1e-2":
        return {"verdict": "diverged", "first_tap": f"blk.{first_layer}.attn_norm",
                "class": ["config-drift", "norm"]}
    return {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("outdir")
    ap.add_argument("--dtype", choices=sorted(DTYPES), required=True)
    ap.add_argument("--layers", default=None)
    ap.add_argument("--fault-layer", type=int, default=12)
    ap.add_argument("--head", type=int, default=4)
    ap.add_argument("--no-logits", action="store_true")
    ap.add_argument("--faults", default=",".join(ALL_FAULTS))
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--store", choices=llmdiff_dump.STORE, default="model")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("HF_DUMP_THREADS", "2")))
    d, f = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    rot = model.model.rotary_emb
    inv32 = rot.inv_freq.detach().clone()
    model.to(DTYPES[args.dtype])
    rot.inv_freq = inv32  # fp32, as from_pretrained(dtype=...) leaves it (see the module doc)
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    first_layer = 0 if layers is None else min(layers)
    if layers is not None and args.fault_layer not in layers:
        raise SystemExit(f"--fault-layer {args.fault_layer} is not among --layers {args.layers}")
    tokens = TOKENS if args.tokens is None else [int(x) for x in args.tokens.split(",")]
    mapping = dict(llmdiff_dump.HF_LLAMA)
    if args.no_logits:
        mapping.pop("logits")
        mapping.pop("output_norm")
    os.makedirs(args.outdir, exist_ok=True)
    faults = Faults(model, args.fault_layer, args.head)
    manifest = {
        "script": "tests/peers/hf_dump_smollm2_lowp.py",
        "model": f,
        "dtype": args.dtype,
        "store": args.store,
        "tokens": tokens,
        "layers": layers if layers is not None else "all",
        "logits": not args.no_logits,
        "fault_layer": args.fault_layer,
        "head": args.head,
        "faults": {},
    }
    for name in args.faults.split(","):
        planted = faults.plant(name)
        dumper = llmdiff_dump.Dumper(model, mapping=mapping, layers=layers, store=args.store)
        try:
            with dumper, torch.no_grad():
                model(torch.tensor([tokens]))
        finally:
            faults.undo()
        path = os.path.join(args.outdir, f"{name}.safetensors")
        dumper.save(path, tokens, model=f)
        manifest["faults"][name] = {"planted": planted, "expect": expectation(name, args.fault_layer, first_layer)}
        print(path, len(dumper.tensors), "tensors", os.path.getsize(path), "bytes", flush=True)
    with open(os.path.join(args.outdir, "manifest.json"), "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
