#!/usr/bin/env python3
"""Tiny HF checkpoint folders (config.json + safetensors + tokenizer.json, as transformers 5 saves
them) for `llmdiff MODEL=FOLDER`, with HF fp32 log-probabilities over the FULL vocabulary at every
position of the prompts, and llama.cpp's GGUF conversion of the same folder (for the cross-source
checks: the folder read by llmdiff must be the GGUF the converter writes, tensor for tensor).

Folders (under OUT_DIR/hf/):
- llama31-bf16: llama with Llama 3.1 rope scaling (the rope_freqs the converter computes), q/k in
  HF's rotate-half order; saved SHARDED (two safetensors files and model.safetensors.index.json).
- qwen3-f32: fp32 weights, q/k norms.
- qwen3moe-bf16: per-expert tensors (the converter stacks them).
- deepseek-v3-bf16: MLA with kv_b whole (the converter splits it into k_b / v_b) + MoE.
- glm-dsa-bf16: GLM-5's DSA indexer, top_k 3 below the prompt lengths; the seed (of 16) with the
  largest indexer margin on the bf16-rounded weights, so fp32 and f64 select the same keys.
- glm4moe-bf16: partial rotary, q/k/v biases, sigmoid routing with the correction bias, a shared
  expert, a leading dense layer (its pre-FFN norm is the converter's `post_attention_norm`).
- gemma2-f32, gemma3-f32: HF's norms compute x·(1 + w) (the converter stores 1 + w), sliding
  windows, soft-capping, gemma3's per-layer-type RoPE bases; fp32 so `1 + w` is the converter's
  value bit for bit.
- gpt-oss-bf16: attention sinks and biases, alternating sliding window, fused experts (gate/up
  interleaved) in bf16 (the converter de-interleaves and transposes them).
- deepseek-v3-fp8: the deepseek-v3 model block-quantized to float8_e4m3fn with 128×128
  `weight_scale_inv` blocks as DeepSeek's FP8 checkpoints store them (intermediate_size 160, so
  blocks are partial at the edges); `quantization_config` in config.json. Its expectations are HF
  fp32 run on the explicitly dequantized weights (value.float() × scale, torch), and each
  dequantized weight's sha256 (f32 little-endian bytes, torch layout).

- qwen3-fp8-channel: compressed-tensors' channel-wise FP8 weights (`weight_scale` [rows, 1],
  dynamic activations, as llm-compressor's FP8_DYNAMIC writes them); expectations as for
  deepseek-v3-fp8.

- gpt-oss-mxfp4: gpt-oss with its experts in MXFP4 `_blocks`/`_scales` (as the released
  checkpoints, `quant_method` mxfp4); expectations are HF fp32 on transformers' own dequantization
  of those blocks (`convert_moe_packed_tensors`) and each dequantized expert weight's sha256.

Each FOLDER gets OUT_DIR/hf/FOLDER.json ({"cases": [{prompt, tokens, logprobs}]}), and the bf16 and
f32 ones OUT_DIR/hf/FOLDER.gguf (convert_hf_to_gguf.py from the folder itself, --outtype bf16 or f32 as
the folder is stored: the same weights, bit for bit).

Usage: hf_folders.py CONVERT_HF_TO_GGUF.py OUT_DIR [FOLDER...]   Not run by CI.
"""
import copy, hashlib, importlib.util, json, math, os, shutil, sys, tempfile

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_tiny  # noqa: E402
import llama31_tiny  # noqa: E402
import deepseek32_tiny  # noqa: E402

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old dragon who counted waves.",
    "The capital of France is Paris.",
]


def rounded_bf16(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(b.bfloat16().float())
    return model


def deepseek_v3(vocab, ffn=96):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = deepseek32_tiny.common_config(vocab, 0)
    for k in ("index_n_heads", "index_head_dim", "index_topk"):
        cfg.pop(k)
    cfg["intermediate_size"] = ffn
    model = DeepseekV3ForCausalLM(DeepseekV3Config(n_group=4, topk_group=2, **cfg)).float().eval()
    deepseek32_tiny.init_weights(model, 0)
    return model


def glm_dsa(tok):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    types = ["full", "shared", "full", "shared"]

    def make(seed):
        cfg = GlmMoeDsaConfig(n_group=1, topk_group=1, indexer_types=types,
                              **deepseek32_tiny.common_config(len(tok), 3))
        m = GlmMoeDsaForCausalLM(cfg).float().eval()
        deepseek32_tiny.init_weights(m, seed)
        return rounded_bf16(m)

    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    best = max(range(16), key=lambda s: min(deepseek32_tiny.indexer_margins(make(s), i) for i in ids))
    model = make(best)
    margin = min(deepseek32_tiny.indexer_margins(model, i) for i in ids)
    print(f"glm-dsa: seed {best}, smallest relative indexer margin {margin:.2e}")
    assert margin > 2e-5
    return model


def fp8_quantize(w):
    """DeepSeek's block FP8: 128×128 blocks (partial at the edges), scale_inv = amax / 448."""
    rows, cols = w.shape
    br, bc = (rows + 127) // 128, (cols + 127) // 128
    scale = torch.empty(br, bc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            s = (blk.abs().max() / 448.0).clamp(min=1e-12)
            scale[i, j] = s
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q, scale):
    """The explicit dequantization the reference must equal bit for bit: f32(value) × scale."""
    s = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


def fp8_quantize_channel(w):
    """compressed-tensors' channel-wise FP8: one scale per output row, amax / 448, shape [rows, 1]."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def save_fp8(model, tok, out, scheme="block"):
    """Saves `model` as an FP8 block-quantized folder (per-expert tensors, as save_pretrained
    writes them); returns the model loaded from the dequantized weights (f32) and the digests."""
    from safetensors.torch import load_file, save_file
    with tempfile.TemporaryDirectory() as tmp:
        plain, deq_dir = os.path.join(tmp, "plain"), os.path.join(tmp, "deq")
        model.save_pretrained(plain, safe_serialization=True)
        sd = {}
        for f in sorted(os.listdir(plain)):
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(plain, f)))
        tensors, deq, digests = {}, {}, {}
        for name, t in sd.items():
            quantize = (t.dim() == 2 and name.startswith("model.layers.") and name.endswith("proj.weight")
                        and ".mlp.gate." not in name)
            if quantize and scheme == "channel":
                q, s = fp8_quantize_channel(t)
                tensors[name] = q
                tensors[name.replace(".weight", ".weight_scale")] = s
                dq = q.float() * s
                digests[name] = hashlib.sha256(dq.contiguous().numpy().tobytes()).hexdigest()
                deq[name] = dq
            elif quantize:
                q, s = fp8_quantize(t)
                tensors[name] = q
                tensors[name.replace(".weight", ".weight_scale_inv")] = s
                dq = fp8_dequantize(q, s)
                digests[name] = hashlib.sha256(dq.contiguous().numpy().tobytes()).hexdigest()
                deq[name] = dq
            else:
                # Embeddings, norms, the router and lm_head stay bf16, as in DeepSeek's checkpoints.
                tensors[name] = t.bfloat16()
                deq[name] = t.bfloat16().float()
        os.makedirs(out, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = json.load(open(os.path.join(plain, "config.json")))
        os.makedirs(deq_dir)
        json.dump(cfg, open(os.path.join(deq_dir, "config.json"), "w"), indent=2)
        save_file({k: v.contiguous() for k, v in deq.items()}, os.path.join(deq_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        if scheme == "channel":
            # As llm-compressor's FP8_DYNAMIC scheme writes it.
            cfg["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
                "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                    "input_activations": {"dynamic": True, "num_bits": 8, "type": "float", "strategy": "token",
                                          "symmetric": True},
                    "weights": {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "channel",
                                "symmetric": True, "group_size": None, "block_structure": None, "actorder": None}}}}
        else:
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
        cfg["dtype"] = "bfloat16"
        json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
        tok.save_pretrained(out)
        peer = type(model).from_pretrained(deq_dir, dtype=torch.float32).eval()
    return peer, digests


def mxfp4_quantize(w):
    """[E, rows, in] → OpenAI's MXFP4 checkpoint form: `_blocks` [E, rows, in/32, 16] (value 2i in
    byte i's low nibble, 2i+1 in its high one) and `_scales` [E, rows, in/32] (E8M0, bias 127);
    each 32-block's scale the smallest power of two with |w| / scale ≤ 6, values rounded to the
    nearest FP4 (E2M1)."""
    from transformers.integrations.mxfp4 import FP4_VALUES
    grid = torch.tensor(FP4_VALUES[:8])
    e, rows, inner = w.shape
    blk = w.float().reshape(e, rows, inner // 32, 32)
    amax = blk.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = blk / torch.ldexp(torch.ones_like(amax), exp.int()).unsqueeze(-1)
    idx = (x.abs().unsqueeze(-1) - grid).abs().argmin(-1) + 8 * (x < 0).long()
    idx = idx.to(torch.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks.contiguous(), (exp.int() + 127).to(torch.uint8).contiguous()


def save_mxfp4(model, tok, out):
    """gpt-oss with its experts in MXFP4 (as the released checkpoints): returns the model loaded
    with transformers' own dequantization of those blocks (convert_moe_packed_tensors, f32) and
    the sha256 of each dequantized expert weight in the GGUF's [E, rows, in] order."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    sd = model.state_dict()
    tensors, digests = {}, {}
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # [E, out, in]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
            with torch.no_grad():
                t.copy_(deq)
            gguf_order = deq.transpose(1, 2)  # [E, out, in]
            if name.endswith("gate_up_proj"):
                for which, part in (("gate", gguf_order[:, 0::2]), ("up", gguf_order[:, 1::2])):
                    digests[name.replace("gate_up_proj", which)] = hashlib.sha256(
                        (part + 0.0).contiguous().numpy().tobytes()).hexdigest()
            else:
                # (+ 0.0: GGML's MXFP4 table has one zero, FP4's code 8 is -0.0 in transformers')
                digests[name] = hashlib.sha256((gguf_order + 0.0).contiguous().numpy().tobytes()).hexdigest()
        else:
            tensors[name] = t.bfloat16()
            with torch.no_grad():
                t.copy_(t.bfloat16().float())
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_diff_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cfg["dtype"] = "bfloat16"
    cfg["architectures"] = ["GptOssForCausalLM"]
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    tok.save_pretrained(out)
    return model, digests


def convert(convert_script, hf_dir, out_path, outtype):
    src = os.path.dirname(os.path.abspath(convert_script))
    if "convert_hf_to_gguf" not in sys.modules:
        sys.path[:0] = [src, os.path.join(src, "gguf-py")]
        spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", convert_script)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["convert_hf_to_gguf"] = mod
        spec.loader.exec_module(mod)
        sys.modules["conversion.base"].TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    mod = sys.modules["convert_hf_to_gguf"]
    import conversion
    arch = json.load(open(os.path.join(hf_dir, "config.json")))["architectures"][0]
    conversion.get_model_class(arch).set_vocab = lambda self: self._set_vocab_gpt2()
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", outtype, "--outfile", out_path]
    mod.main()


def main():
    convert_script, out_dir = sys.argv[1], os.path.join(sys.argv[2], "hf")
    wanted = sys.argv[3:]
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(2)
    tok320 = family_tiny.build_tokenizer()
    tok512 = deepseek32_tiny.build_tokenizer()
    plans = {
        "llama31-bf16": lambda: (rounded_bf16(llama31_tiny.build_model(len(tok320))), tok320, "bf16", "60KB"),
        "qwen3-f32": lambda: (family_tiny.build_model("qwen3", len(tok320)), tok320, "f32", None),
        "qwen3moe-bf16": lambda: (rounded_bf16(family_tiny.build_model("qwen3moe", len(tok320))), tok320, "bf16", None),
        "deepseek-v3-bf16": lambda: (rounded_bf16(deepseek_v3(len(tok512))), tok512, "bf16", None),
        "glm-dsa-bf16": lambda: (glm_dsa(tok512), tok512, "bf16", None),
        "glm4moe-bf16": lambda: (rounded_bf16(family_tiny.build_model("glm4moe", len(tok320))), tok320, "bf16", None),
        "gemma2-f32": lambda: (family_tiny.build_model("gemma2", len(tok320)), tok320, "f32", None),
        "gemma3-f32": lambda: (family_tiny.build_model("gemma3", len(tok320)), tok320, "f32", None),
        "gpt-oss-bf16": lambda: (rounded_bf16(family_tiny.build_model("gpt-oss", len(tok320))), tok320, "bf16", None),
        "deepseek-v3-fp8": lambda: (deepseek_v3(len(tok512), ffn=160), tok512, "fp8", None),
        "gpt-oss-mxfp4": lambda: (family_tiny.build_model("gpt-oss", len(tok320)), tok320, "mxfp4", None),
        "qwen3-fp8-channel": lambda: (family_tiny.build_model("qwen3", len(tok320)), tok320, "fp8-channel", None),
    }
    for name, plan in plans.items():
        if wanted and name not in wanted:
            continue
        model, tok, dtype, shard = plan()
        folder = os.path.join(out_dir, name)
        shutil.rmtree(folder, ignore_errors=True)
        digests = None
        if dtype == "mxfp4":
            model, digests = save_mxfp4(model, tok, folder)
        elif dtype.startswith("fp8"):
            model, digests = save_fp8(model, tok, folder, "channel" if dtype == "fp8-channel" else "block")
        else:
            # A copy is cast for saving: casting the model itself would round its rotary buffers.
            m = model if dtype == "f32" else copy.deepcopy(model).to(torch.bfloat16)
            kw = {"max_shard_size": shard} if shard else {}
            m.save_pretrained(folder, safe_serialization=True, **kw)
            tok.save_pretrained(folder)
        for f in ("generation_config.json",):
            if os.path.exists(os.path.join(folder, f)):
                os.remove(os.path.join(folder, f))
        cases = []
        for p in PROMPTS:
            ids = tok(p, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            cases.append({"prompt": p, "tokens": ids, "logprobs": [[round(float(x), 6) for x in r] for r in lp]})
        doc = {"format": 1, "folder": name, "peer": f"transformers {transformers.__version__}, torch "
               f"{torch.__version__}, float32 on the stored weights", "generated_by": "tests/peers/hf_folders.py",
               "cases": cases}
        if digests:
            doc["dequantized_sha256"] = digests
        json.dump(doc, open(os.path.join(out_dir, f"{name}.json"), "w"), separators=(",", ":"))
        if not dtype.startswith("fp8"):
            with tempfile.TemporaryDirectory() as tmp:
                # The converter names the model after the folder; a copy keeps the folder pristine.
                src = os.path.join(tmp, name)
                shutil.copytree(folder, src)
                if name.startswith(("deepseek", "glm")):
                    cfg = json.load(open(os.path.join(src, "config.json")))
                    cfg["scoring_func"], cfg["topk_method"] = "sigmoid", "noaux_tc"
                    json.dump(cfg, open(os.path.join(src, "config.json"), "w"), indent=1)
                convert(convert_script, src, os.path.join(out_dir, f"{name}.gguf"), "f32" if dtype == "f32" else "bf16")
        print(f"{name}: {sum(len(c['tokens']) for c in cases)} positions")


if __name__ == "__main__":
    main()
