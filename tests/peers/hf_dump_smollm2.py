#!/usr/bin/env python3
"""HF transformers dumps of SmolLM2 for `llmdiff diff-layers --candidate` (format 1).

Loads the GGUF into transformers in fp32 (HF dequantizes the same bytes our reference reads),
hooks it with harness/adapters/llmdiff_dump.py and writes, into OUTDIR:
  healthy.safetensors         the model as is
  attn-zero.safetensors       layer FAULT_LAYER's attention output (o_proj input) zeroed
  head-swap.safetensors       heads 0 and 1 of layer FAULT_LAYER's o_proj input swapped
Faults are planted by monkeypatching the HF module (a forward pre-hook on o_proj registered
before the dump's, so the dump sees what o_proj really got).

Usage: hf_dump_smollm2.py MODEL.gguf OUTDIR [--layers 0,1,2] [--fault-layer 1] [--no-logits]
The small dumps in golden/candidate-smollm2/ come from:
  hf_dump_smollm2.py .cache/SmolLM2-135M-Instruct.Q4_1.gguf golden/candidate-smollm2 --layers 0,1,2 --fault-layer 1 --no-logits
Not run by CI (needs torch + transformers); its output for the small case is committed.
"""
import argparse, os, sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "harness", "adapters"))
import llmdiff_dump  # noqa: E402

TOKENS = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("outdir")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--fault-layer", type=int, default=1)
    ap.add_argument("--no-logits", action="store_true")
    ap.add_argument("--tokens", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    d, f = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    tokens = TOKENS if args.tokens is None else [int(x) for x in args.tokens.split(",")]
    mapping = dict(llmdiff_dump.HF_LLAMA)
    if args.no_logits:
        mapping.pop("logits")
        mapping.pop("output_norm")
    os.makedirs(args.outdir, exist_ok=True)
    o_proj = model.model.layers[args.fault_layer].self_attn.o_proj
    hd = model.config.hidden_size // model.config.num_attention_heads

    def zero(m, a):
        return (torch.zeros_like(a[0]),)

    def swap(m, a):
        x = a[0].clone()
        x[..., 0:hd], x[..., hd:2 * hd] = a[0][..., hd:2 * hd], a[0][..., 0:hd]
        return (x,)

    for name, fault in [("healthy", None), ("attn-zero", zero), ("head-swap", swap)]:
        h = o_proj.register_forward_pre_hook(fault) if fault else None
        dumper = llmdiff_dump.Dumper(model, mapping=mapping, layers=layers)
        with dumper, torch.no_grad():
            model(torch.tensor([tokens]))
        if h:
            h.remove()
        path = os.path.join(args.outdir, f"{name}.safetensors")
        dumper.save(path, tokens, model=f)
        print(path, len(dumper.tensors), "tensors", os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
