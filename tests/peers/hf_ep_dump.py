#!/usr/bin/env python3
"""HF transformers expert parallelism (CPU, gloo, fp32 compute) on the tiny Qwen3-MoE model,
dumped in format 2 with `experts(ids)`, for `llmdiff diff-layers MODEL.gguf --candidate
OUT/NAME.rank*.safetensors`.

  torchrun --nproc-per-node 2 tests/peers/hf_ep_dump.py golden/hf/qwen3moe-bf16 OUTDIR

HF runs `DistributedConfig(tp_size=2, tp_plan="auto", ep_size=2, ep_implementation="all_reduce")`:
attention is tensor-parallel, and each rank holds a contiguous range of the routed experts
(rank r: experts r*E/2 .. (r+1)*E/2 - 1), runs them on the whole batch with the other ranks'
routes masked, and all-reduces the outputs (transformers' `AllReduceEP`). The pre-reduce MoE
output is taken by wrapping `torch.distributed.all_reduce` while a MoE block runs: that is the
rank's expert-parallel partial, `blk.L.ffn_out@rR#partial`, declared `experts(ids)`. Also dumped
per rank: `ffn_norm` and `moe_logits` (the partial's inputs, `replicated`) and the reduced
`ffn_out` (`replicated`). Other taps are left out: this exercises the EP layout only.

Writes OUTDIR/FAULT.rank{r}.safetensors for:
  healthy        the model as HF shards it
  expert-slot-r1 rank 1's second local expert (expert E-1) holds its first one's weights (E-2),
                 so expert E-1's tokens are computed with expert E-2's weights
Not run by CI (needs torch + transformers); its output is committed in
golden/candidate-qwen3moe-ep2/ (see golden/README.md).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig


def local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tokens", default="5,58,111,164,217,270,3,56,109,162,215,268")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    dc = DistributedConfig(tp_size=2, tp_plan="auto", ep_size=2, ep_implementation="all_reduce")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, distributed_config=dc)
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model.config
    n_exp = cfg.num_experts if hasattr(cfg, "num_experts") else cfg.num_local_experts
    per = n_exp // world
    ids = list(range(rank * per, (rank + 1) * per))
    taps = {}
    state = {"layer": None}
    orig = dist.all_reduce

    def wrap(t, *a, **k):
        if state["layer"] is not None:
            taps[f"blk.{state['layer']}.ffn_out@r{rank}#partial"] = t.detach().reshape(len(tokens), -1).clone()
        return orig(t, *a, **k)

    dist.all_reduce = wrap
    for l, layer in enumerate(model.model.layers):
        def norm_hook(m, i, o, l=l):
            taps[f"blk.{l}.ffn_norm@r{rank}"] = o.detach().reshape(len(tokens), -1).clone()

        def gate_hook(m, i, o, l=l):
            taps[f"blk.{l}.moe_logits@r{rank}"] = o[0].detach().reshape(len(tokens), -1).clone()

        def pre(m, i, l=l):
            state["layer"] = l

        def post(m, i, o, l=l):
            state["layer"] = None
            taps[f"blk.{l}.ffn_out@r{rank}"] = o.detach().reshape(len(tokens), -1).clone()

        layer.post_attention_layernorm.register_forward_hook(norm_hook)
        layer.mlp.gate.register_forward_hook(gate_hook)
        layer.mlp.register_forward_pre_hook(pre)
        layer.mlp.register_forward_hook(post)

    os.makedirs(args.out, exist_ok=True)
    layout = {
        "ffn_norm": "replicated",
        "moe_logits": "replicated",
        "ffn_out": "replicated",
        "ffn_out#partial": "experts(" + ",".join(map(str, ids)) + ")",
    }
    for fault in ["healthy", "expert-slot-r1"]:
        saved = []
        if fault == "expert-slot-r1" and rank == 1:
            for layer in model.model.layers:
                for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    w = local(p.data)
                    saved.append((w, w[-1].clone()))
                    w[-1].copy_(w[-2])
        taps.clear()
        with torch.no_grad():
            model(torch.tensor([tokens]))
        for w, old in saved:
            w[-1].copy_(old)
        meta = {
            "llmdiff.format": "2",
            "tokens": json.dumps(tokens),
            "model": "qwen3moe-bf16 (HF transformers TP 2 / EP 2, fp32 compute)",
            "tp": str(world),
            "rank": str(rank),
            "mapping": json.dumps({"ffn_out#partial": "mlp.experts (all_reduce input)", "moe_logits": "mlp.gate[0]"}),
            "layout": json.dumps(layout),
            "normalize": "{}",
            "config": json.dumps({"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size}),
            "tp_plan": json.dumps({"ep_size": world, "ep_implementation": "all_reduce", "experts": ids}),
            "llmdiff.compute_dtype": "f32",
        }
        save_file({k: v.contiguous() for k, v in taps.items()}, os.path.join(args.out, f"{fault}.rank{rank}.safetensors"), meta)
        if rank == 0:
            print(fault, sorted(taps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
