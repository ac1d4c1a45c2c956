#!/usr/bin/env python3
"""HF transformers tensor parallelism (tp_plan="auto", CPU, gloo) dumping SmolLM2 in format 2,
healthy and with planted TP faults, for `llmdiff diff-layers --candidate OUT/NAME.rank*.safetensors`.

Run with torchrun, any TP that divides the heads (SmolLM2-135M: 9 heads, 3 kv heads, so TP 3):
  torchrun --nproc-per-node 3 tests/peers/hf_tp_dump.py MODEL.gguf OUTDIR [--layers 0,1,2]
      [--fault-layer 1] [--no-logits] [--tokens 504,3575,282,4649] [--faults healthy,attn-zero-r1]

Writes OUTDIR/FAULT.rank{r}.safetensors for each fault (one forward per fault, the fault planted
before it and removed after):
  healthy            the model as HF shards it
  skip-oproj-reduce  layer FAULT_LAYER's o_proj all-reduce skipped on every rank
  skip-down-reduce   layer FAULT_LAYER's down_proj all-reduce skipped on every rank
  oproj-swap-r01     ranks 0 and 1 hold each other's o_proj weight shard in layer FAULT_LAYER
  qproj-rank0        the last rank's q_proj shard in layer FAULT_LAYER replaced by rank 0's
  attn-zero-r1       rank 1's attention output (o_proj input) in layer FAULT_LAYER zeroed
  rope-base-last       the last rank runs with rope_theta / 10 (config and inverse frequencies)
  decode-attn-zero-r1  with --decode-steps S >= 2: rank 1's attention output in layer FAULT_LAYER
                       zeroed in decode step 2 only (the prefill and step 1 are healthy)
With --decode-steps S the last S tokens are decoded one at a time with HF's KV cache after a
prefill of the rest, and the dump holds every step (`KEY#stepK`, metadata `prefill`).
Not run by CI (needs torch + transformers); its output for the small case is committed in
golden/candidate-smollm2-tp{2,3}/ (see golden/README.md).
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "harness", "adapters"))
import llmdiff_dump  # noqa: E402

TOKENS = [504, 3575, 282, 4649, 314]  # "The capital of France is"
FAULTS = ["healthy", "skip-oproj-reduce", "skip-down-reduce", "oproj-swap-r01", "qproj-rank0",
          "attn-zero-r1", "rope-base-last", "decode-attn-zero-r1"]


def gather_local(w):
    """Every rank's local shard of a DTensor parameter."""
    local = w.to_local().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return local, parts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("outdir")
    ap.add_argument("--layers", default=None)
    ap.add_argument("--fault-layer", type=int, default=1)
    ap.add_argument("--no-logits", action="store_true")
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--decode-steps", type=int, default=0)
    ap.add_argument("--rope-parameters", default=None,
                    help="JSON rope_parameters to set after loading (HF's GGUF loader drops Llama 3.1 "
                         "rope scaling: llmdiff reports that as config-drift rope_type)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(os.path.abspath(args.model))
    dtype = torch.float32 if args.dtype == "f32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype, tp_plan="auto")
    model.eval()
    if args.rope_parameters:
        import json
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        model.config.rope_parameters.update(json.loads(args.rope_parameters))
        rot = model.model.rotary_emb
        rot.rope_type = model.config.rope_parameters["rope_type"]
        inv, scale = ROPE_INIT_FUNCTIONS[rot.rope_type](model.config, None)
        rot.inv_freq.copy_(inv)
        rot.original_inv_freq.copy_(inv)
        rot.attention_scaling = scale
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    tokens = TOKENS if args.tokens is None else [int(x) for x in args.tokens.split(",")]
    mapping = dict(llmdiff_dump.HF_LLAMA)
    if args.no_logits:
        mapping.pop("logits")
        mapping.pop("output_norm")
    os.makedirs(args.outdir, exist_ok=True)
    L = args.fault_layer
    attn = model.model.layers[L].self_attn
    mlp = model.model.layers[L].mlp
    last = tp - 1

    # Skipping a reduce: this wrapper sits under the Dumper's (which records the partial first).
    skip = {"module": None, "active": None}
    real_reduce = dist.all_reduce

    def maybe_reduce(tensor, *a, **kw):
        if skip["active"] is not None and skip["active"] is skip["module"]:
            skip["active"] = None
            return None
        return real_reduce(tensor, *a, **kw)

    dist.all_reduce = maybe_reduce
    for m in (attn.o_proj, mlp.down_proj):
        m.register_forward_pre_hook(lambda mod, a: skip.__setitem__("active", mod))
        m.register_forward_hook(lambda mod, a, o: skip.__setitem__("active", None))

    def plant(name):
        """Plants a fault; returns its undo."""
        if name == "skip-oproj-reduce":
            skip["module"] = attn.o_proj
            return lambda: skip.__setitem__("module", None)
        if name == "skip-down-reduce":
            skip["module"] = mlp.down_proj
            return lambda: skip.__setitem__("module", None)
        if name in ("oproj-swap-r01", "qproj-rank0"):
            w = attn.o_proj.weight if name == "oproj-swap-r01" else attn.q_proj.weight
            local, parts = gather_local(w)
            saved = local.clone()
            src = {0: 1, 1: 0}.get(rank) if name == "oproj-swap-r01" else (0 if rank == last else None)
            with torch.no_grad():
                if src is not None:
                    w.to_local().copy_(parts[src])

            def undo():
                with torch.no_grad():
                    w.to_local().copy_(saved)
            return undo
        if name == "decode-attn-zero-r1":
            if rank != 1:
                return lambda: None
            h = attn.o_proj.register_forward_pre_hook(
                lambda m, a: (torch.zeros_like(a[0]),) if state["step"] == 2 else None)
            return h.remove
        if name == "attn-zero-r1":
            if rank != 1:
                return lambda: None
            h = attn.o_proj.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
            return h.remove
        if name == "rope-base-last":
            if rank != last:
                return lambda: None
            rot = model.model.rotary_emb
            rp = model.config.rope_parameters
            old_theta, old_inv = rp["rope_theta"], rot.inv_freq.clone()
            rp["rope_theta"] = old_theta / 10
            if rot.rope_type == "default":
                inv, _ = rot.compute_default_rope_parameters(model.config)
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
                inv, _ = ROPE_INIT_FUNCTIONS[rot.rope_type](model.config, None)
            rot.inv_freq.copy_(inv)

            def undo():
                rp["rope_theta"] = old_theta
                rot.inv_freq.copy_(old_inv)
            return undo
        assert name == "healthy", name
        return lambda: None

    state = {"step": 0}
    faults = args.faults.split(",")
    if args.decode_steps < 2:
        faults = [x for x in faults if x != "decode-attn-zero-r1"]
    for name in faults:
        undo = plant(name)
        dumper = llmdiff_dump.Dumper(model, mapping=mapping, layers=layers)
        with dumper, torch.no_grad():
            if args.decode_steps == 0:
                model(torch.tensor([tokens]))
            else:
                from transformers import DynamicCache
                p = len(tokens) - args.decode_steps
                cache = DynamicCache()
                state["step"] = 0
                model(torch.tensor([tokens[:p]]), past_key_values=cache, use_cache=True)
                for k, t in enumerate(tokens[p:], start=1):
                    state["step"] = dumper.step = k
                    model(torch.tensor([[t]]), past_key_values=cache, use_cache=True,
                          position_ids=torch.tensor([[p + k - 1]]))
                state["step"] = dumper.step = 0
        # Saved before the undo: the metadata records the config the forward ran with.
        path = dumper.save(os.path.join(args.outdir, f"{name}.safetensors"), tokens, model=f)
        undo()
        print(path, len(dumper.tensors), "tensors", os.path.getsize(path), "bytes", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
