#!/usr/bin/env python3
"""Checks llmdiff's vLLM module map (harness/adapters/vllm_sites.json) against vLLM's real model
classes, built on the meta device (no GPU, no weights) at tensor-parallel degree TP.

For each family (llama: LlamaForCausalLM, qwen3: Qwen3ForCausalLM, deepseek_v2:
DeepseekV3ForCausalLM, from the tiny configs in golden/hf/*/config.json) the model is
instantiated by vLLM's own constructor under `torch.device("meta")` with vLLM's config objects,
after vLLM's own distributed init (gloo, one process per rank under torchrun, TP = world size).
Then, for every site of the map and every layer kind (a dense layer; DeepSeek's MoE layer too):
  * the module path exists in `model.named_modules()`;
  * its class is (a subclass of) the one the map names;
  * the declared layout agrees with the module's sharding as vLLM built it: a `sharded` output of a
    column-parallel linear has gather_output False, a `sharded` input of a row-parallel linear has
    input_is_parallel True, a `replicated` row-parallel output has reduce_results True (and
    tp_size is the world size); a ReplicatedLinear output is replicated;
  * a fused split (`out.0:split(K)`) names an element of the module's output_sizes, the rank's
    width being output_sizes[K] / tp, and the split order equals vLLM's packed_modules_mapping
    (qkv_proj = q, k, v; gate_up_proj = gate, up; fused_qkv_a_proj = q_a, kv_a);
  * the map's packed_modules_mapping equals the model class's;
  * weights the map fingerprints (kv_b, o) have the declared sharded dim: the rank's local
    weight shape is the full one divided by tp on that dim.
Prints one line per check and a summary `N passed, M failed`; exit 1 on a failure.

Run: torchrun --nproc-per-node 2 tests/peers/vllm_map_check.py [--out tests/peers/vllm_map_check.out]
     [--sites MAP.json]
tests/peers/vllm_map_check.negative.out is the same check of a map with three planted mistakes
(the format-1 map's `self_attn.q_a_proj`, which vLLM's DeepseekV3 fuses into fused_qkv_a_proj;
v taken as qkv_proj's split 1, which is k; attn_proj declared sharded): each is a FAIL.
(needs the vllm wheel; see docs/tp-dumps.md for how it was installed here). Not run by CI.
"""
import argparse
import json
import os
import sys
import tempfile

# The CUDA wheel on a machine without a GPU: vLLM's CPU platform (its own switch) so its config
# objects can be built; nothing runs a kernel.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
CONFIGS = {"llama": "golden/hf/llama31-bf16/config.json", "qwen3": "golden/hf/qwen3-f32/config.json",
           "deepseek_v2": "golden/hf/deepseek-v3-bf16/config.json"}


def build(family, cfg_path, tp):
    import torch
    from vllm.config import VllmConfig, ModelConfig, ParallelConfig, LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture
    d = tempfile.mkdtemp(prefix=f"vllm-{family}-")
    with open(os.path.join(ROOT, cfg_path)) as fh:
        cfg = json.load(fh)
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    mc = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True, dtype="float32", enforce_eager=True)
    pc = ParallelConfig(tensor_parallel_size=tp)
    vc = VllmConfig(model_config=mc, parallel_config=pc, load_config=LoadConfig(load_format="dummy"))
    cls, arch = get_model_architecture(mc)
    with set_current_vllm_config(vc), torch.device("meta"):
        model = cls(vllm_config=vc)
    return model, cls, arch, cfg


def check_family(family, spec, tp, rank, out):
    ok = bad = 0

    def report(cond, what):
        nonlocal ok, bad
        if cond:
            ok += 1
        else:
            bad += 1
        if rank == 0:
            out.append(f"{'PASS' if cond else 'FAIL'} {family}: {what}")

    model, cls, arch, cfg = build(family, CONFIGS[family], tp)
    report(arch == spec["architecture"], f"architecture {arch} (map: {spec['architecture']})")
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    want = spec["packed_modules_mapping"]
    report({k: list(v) for k, v in packed.items()} == want,
           f"packed_modules_mapping {json.dumps(packed, sort_keys=True)}")
    names = dict(model.named_modules())
    n_layers = cfg["num_hidden_layers"]
    # Layer kinds: the first layer, and the first MoE layer where there is one.
    layers = [0]
    if "first_k_dense_replace" in cfg and cfg["first_k_dense_replace"] < n_layers:
        layers.append(cfg["first_k_dense_replace"])
    for site, (path, where, clsname, layout) in spec["sites"].items():
        for layer in (layers if "{i}" in path else [None]):
            name = path.format(i=layer)
            mod = names.get(name)
            if mod is None:
                report(False, f"{site} @ layer {layer}: module {name} does not exist")
                continue
            mro = [c.__name__ for c in type(mod).__mro__]
            report(clsname in mro, f"{site} @ layer {layer}: {name} is {type(mod).__name__} "
                                   f"(map: {clsname})")
            report(*layout_ok(mod, mro, where, layout, tp, site, layer, name, packed))
            if site in ("q", "k"):
                # q/k normalization: NeoX-style rotary (rotate_half) is what hf-rotate-half undoes.
                neox = bool(getattr(mod, "is_neox_style", False))
                norm = spec.get("qk_normalize")
                report((norm == "hf-rotate-half") == neox,
                       f"{site} @ layer {layer}: {name} is_neox_style={neox} (map: normalize {norm})")
    for kind, (path, clsname, lay) in spec.get("weights", {}).items():
        name = path.format(i=0)
        mod = names.get(name)
        if mod is None:
            report(False, f"weight {kind}: module {name} does not exist")
            continue
        dim = int(lay[len("sharded("):-1])
        w = mod.weight
        full = (getattr(mod, "output_size", None), getattr(mod, "input_size", None))
        local = tuple(w.shape)
        want_local = [full[0], full[1]]
        want_local[dim] //= tp
        report(list(local) == want_local and clsname in [c.__name__ for c in type(mod).__mro__],
               f"weight {kind}: {name} {type(mod).__name__} local weight {list(local)}, full "
               f"{list(full)}, declared {lay}")
    return ok, bad


def layout_ok(mod, mro, where, layout, tp, site, layer, name, packed):
    tag = f"{site} @ layer {layer}: {name} {where} declared {layout}"
    if "RowParallelLinear" in mro:
        if where == "in":
            return (layout == "sharded" and mod.input_is_parallel and mod.tp_size == tp,
                    f"{tag}; input_is_parallel={mod.input_is_parallel} tp_size={mod.tp_size}")
        return (layout == "replicated" and mod.reduce_results,
                f"{tag}; reduce_results={mod.reduce_results}")
    if "ReplicatedLinear" in mro:
        return layout == "replicated", f"{tag}; ReplicatedLinear"
    if "ColumnParallelLinear" in mro:
        tp_mod = getattr(mod, "tp_size", tp)
        sizes = list(getattr(mod, "output_sizes", [mod.output_size]))
        msg = f"{tag}; gather_output={mod.gather_output} tp_size={tp_mod} output_sizes={sizes}"
        if ":split(" in where:
            k = int(where.split(":split(")[1].rstrip(")"))
            short = name.rsplit(".", 1)[-1]
            order = packed.get(short)
            fused = {"qkv_proj": ["q", "k", "v"], "gate_up_proj": ["ffn_gate", "ffn_up"],
                     "fused_qkv_a_proj": ["q_a", "kv_a"]}.get(short, [])
            named = fused[k] if k < len(fused) else None
            site_ok = named == site
            msg += f"; split {k} of {len(sizes)} = {order[k] if order and k < len(order) else '?'}"
            if not (k < len(sizes) and site_ok and order is not None and len(order) == len(sizes)):
                return False, msg
            local = sizes[k] // tp_mod
            msg += f", rank width {local}"
        want = "replicated" if tp_mod == 1 or mod.gather_output else "sharded"
        return layout == want, msg + f" (vLLM: {want})"
    if "VocabParallelEmbedding" in mro:
        # vLLM's VocabParallelEmbedding all-reduces its masked lookups: the output is replicated.
        return layout == "replicated", f"{tag}; tp_size={getattr(mod, 'tp_size', '?')}"
    # An MLP / MoE block: its output is replicated when the block's last op reduces.
    last = getattr(mod, "experts", None) or getattr(mod, "down_proj", None)
    if last is not None and hasattr(last, "reduce_results"):
        return (layout == "replicated" and bool(last.reduce_results),
                f"{tag}; {type(mod).__name__}'s {type(last).__name__}.reduce_results={last.reduce_results}")
    # Norms, rotary, decoder layers: no sharding of their own; the map says what their output is
    # (the rotary acts on the rank's q/k heads: sharded).
    rot = "RotaryEmbedding" in mro
    return (layout == ("sharded" if rot else "replicated")), f"{tag}; {type(mod).__name__}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--families", default="llama,qwen3,deepseek_v2")
    ap.add_argument("--sites", default=os.path.join(ROOT, "harness", "adapters", "vllm_sites.json"),
                    help="the map to check (default: the adapter's)")
    args = ap.parse_args()
    import torch.distributed as dist
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world))):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                     distributed_init_method="env://", backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=world)
    import vllm
    with open(args.sites) as fh:
        doc = json.load(fh)
    out = [f"vllm {vllm.__version__}, TP {world}, models built on the meta device"]
    ok = bad = 0
    for fam in args.families.split(","):
        try:
            o, b = check_family(fam, doc[fam], world, rank, out)
        except Exception as e:  # a class vLLM cannot build here: recorded, counted as failed
            o, b = 0, 1
            out.append(f"FAIL {fam}: could not build: {type(e).__name__}: {e}")
        ok, bad = ok + o, bad + b
    out.append(f"{ok} passed, {bad} failed")
    if rank == 0:
        text = "\n".join(out) + "\n"
        print(text, end="")
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text)
    dist.barrier()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
