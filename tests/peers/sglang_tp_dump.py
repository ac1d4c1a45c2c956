#!/usr/bin/env python3
"""SGLang's own tensor dumper (`sglang.srt.debug_utils.dumper`, unmodified, from the sglang wheel)
writing per-rank files of a real model under HF transformers tensor parallelism (CPU, gloo), for
`harness/adapters/llmdiff_sglang.py` to convert to format 2.

SGLang's model runner needs a GPU, so the model here is HF's (`tp_plan="auto"`), and the files
are written by SGLang's dumper the way an SGLang run writes them:
  * its non-intrusive mode (`non_intrusive_mode="all"`): a forward (pre-)hook on every module,
    files named `non_intrusive__<module path>.output` / `.inputs.N`, plus the `input_ids` core
    field, filtered by its `filter` expression to one layer and the embedding;
  * explicit `dumper.dump(name, tensor, dims=...)` calls (layer_id comes from the dumper's
    layer context) with SGLang's dims
    annotations (as one patches SGLang's model code or uses its source patcher), for what has no
    module of its own in HF: q and k after RoPE (`dims="t (h*d)[tp]"`) and the row-parallel
    pre-reduce partials taken at the all-reduce (`dims="t h[tp:partial]"`).
  * the rank context SGLang's scheduler sets, through SGLang's own
    `get_parallel().override_permanently(tp_rank=..., tp_size=...)`, so each file's
    `meta["sglang_parallel_info"]` holds tp_rank/tp_size as in a server.

Run (any TP that divides the heads; SmolLM2-135M: TP 3):
  DUMPER_ENABLE=1 torchrun --nproc-per-node 3 tests/peers/sglang_tp_dump.py MODEL.gguf OUTDIR \
      [--layer 1] [--tokens 504,3575,282,4649] [--faults healthy,attn-zero-r1,oproj-swap-r01]
writes OUTDIR/FAULT/<exp>/*.pt (SGLang's layout: `step=..___rank=..___dump_index=..___name=...pt`,
each a `torch.save` of {"value": tensor, "meta": {...}}). Then
  python harness/adapters/llmdiff_sglang.py OUTDIR/FAULT OUT/FAULT --model MODEL.gguf \
      --config OUTDIR/config.json
Faults (layer --layer): attn-zero-r1 (rank 1's attention output zeroed), oproj-swap-r01 (ranks 0
and 1 hold each other's o_proj weight shard).
Needs torch, transformers and the sglang wheel (`pip install --no-deps sglang` plus the few
pure-Python modules its import asks for); not run by CI: its output is committed in
golden/sglang-smollm2-tp3/ (see golden/README.md).
"""
import argparse
import os

import torch
import torch.distributed as dist

TOKENS = [504, 3575, 282, 4649]
FAULTS = ["healthy", "attn-zero-r1", "oproj-swap-r01"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("outdir")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--faults", default=",".join(FAULTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()

    from sglang.srt.debug_utils.dumper import dumper
    from sglang.srt.runtime_context import get_parallel
    from transformers import AutoModelForCausalLM

    # What SGLang's scheduler stamps in a server process: this rank's place in the TP group.
    get_parallel().override_permanently(
        tp_rank=rank, tp_size=tp, pp_rank=0, pp_size=1, attn_tp_rank=rank, attn_tp_size=tp,
        attn_dp_rank=0, attn_dp_size=1, attn_cp_rank=0, attn_cp_size=1, moe_ep_rank=0,
        moe_ep_size=1)

    d, f = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, tp_plan="auto")
    model.eval()
    if rank == 0:
        # The engine's config.json, as a user has it in the model folder (SGLang's dumper does
        # not record the config): the converter's --config.
        os.makedirs(args.outdir, exist_ok=True)
        model.config.to_json_file(os.path.join(args.outdir, "config.json"))
    tokens = TOKENS if args.tokens is None else [int(x) for x in args.tokens.split(",")]
    L = args.layer
    attn = model.model.layers[L].self_attn
    mlp = model.model.layers[L].mlp

    # q and k after RoPE: HF applies it in a function, not a module; dumped explicitly with dims.
    import transformers.models.llama.modeling_llama as ml
    real_rope = ml.apply_rotary_pos_emb
    in_layer = {"attn": False}

    def rope(q, k, *a, **kw):
        qo, ko = real_rope(q, k, *a, **kw)
        if in_layer["attn"]:
            # [1, heads, t, hd] -> [t, heads*hd]
            for name, x in (("q", qo), ("k", ko)):
                flat = x[0].transpose(0, 1).reshape(x.shape[2], -1)
                dumper.dump(name, flat, dims="t (num_heads*head_dim)[tp]")
        return qo, ko

    ml.apply_rotary_pos_emb = rope
    attn.register_forward_pre_hook(lambda m, a: in_layer.__setitem__("attn", True))
    attn.register_forward_hook(lambda m, a, o: in_layer.__setitem__("attn", False))

    # The row-parallel partials: transformers 5 all-reduces inside the module's forward, so the
    # tensor handed to all_reduce is the pre-reduce partial (SGLang's deferred-reduce
    # UnreducedOutput carries the same).
    real_reduce = dist.all_reduce
    reducing = {"name": None}

    def reduce(tensor, *a, **kw):
        if reducing["name"] is not None:
            dumper.dump(reducing["name"], tensor.reshape(-1, tensor.shape[-1]),
                        dims="t h[tp:partial]")
            reducing["name"] = None
        return real_reduce(tensor, *a, **kw)

    dist.all_reduce = reduce
    for mod, name in ((attn.o_proj, "o_proj_partial"), (mlp.down_proj, "down_proj_partial")):
        mod.register_forward_pre_hook(lambda m, a, n=name: reducing.__setitem__("name", n))
        mod.register_forward_hook(lambda m, a, o: reducing.__setitem__("name", None))

    def plant(name):
        if name == "attn-zero-r1":
            if rank != 1:
                return lambda: None
            h = attn.o_proj.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),))
            return h.remove
        if name == "oproj-swap-r01":
            w = attn.o_proj.weight
            local = w.to_local().contiguous()
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local)
            saved = local.clone()
            src = {0: 1, 1: 0}.get(rank)
            with torch.no_grad():
                if src is not None:
                    w.to_local().copy_(parts[src])

            def undo():
                with torch.no_grad():
                    w.to_local().copy_(saved)
            return undo
        assert name == "healthy", name
        return lambda: None

    # The dumper's filter sees each dump's tags: layer_id (set by its layer context hooks) and
    # name. One layer, the embedding and the input ids.
    filt = (f"layer_id == {L} or name == 'non_intrusive__model.layers.{L}.output' or "
            "(layer_id is None and (name == 'input_ids' or "
            "search('embed_tokens\\\\.output', name) is not None))")
    for name in args.faults.split(","):
        undo = plant(name)
        dumper.configure(enable=True, dir=os.path.join(os.path.abspath(args.outdir), name),
                         exp_name="dump", non_intrusive_mode="all", filter=filt,
                         enable_output_console=False, cleanup_previous=True)
        dumper.register_non_intrusive_dumper(model)
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
        dumper.step()
        dumper.reset()
        undo()
        dist.barrier()
        if rank == 0:
            n = len(os.listdir(os.path.join(args.outdir, name, "dump")))
            print(name, n, "files", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
