#!/usr/bin/env python3
"""Build a tiny DeepSeek-V3.2 (`deepseek32`: MLA + MoE + the DSA lightning indexer) with HF
transformers, convert it with llama.cpp's convert_hf_to_gguf.py to an F32 GGUF, and record HF fp32
top-50 log-probabilities for prompts longer than the indexer's top_k, so the sparse selection
matters.

The same weights are also run with the indexer's top_k raised above every prompt's length (dense
attention); those log-probabilities go into the JSON as `dense_positions`, to show that the
difference between sparse and dense is the selection (tests/tests/hf_dsa.rs checks both).

Also used by tests/peers/glm_dsa_tiny.py (`glm-dsa`: GLM-5's variant, interleaved indexer RoPE and
`shared` indexer layers that reuse the previous `full` layer's selection).

Converter notes (llama-cpp-python 0.3.36's vendored llama.cpp): the converter's set_vocab for these
classes wants DeepSeek's / GLM's real tokenizers (BOS flag, GLM's [gMASK] and role tokens); our tiny
byte-level BPE is written with the plain GPT-2 vocab writer instead (set_vocab is patched), which
changes nothing but the vocabulary metadata. The MoE gating function is read from config.json, so
`scoring_func: sigmoid` is added there.

Usage: deepseek32_tiny.py CONVERT_HF_TO_GGUF.py OUT_DIR
Writes OUT_DIR/deepseek32-tiny.f32.gguf and OUT_DIR/hf-deepseek32-tiny.json. Not run by CI.
"""
import importlib.util, json, math, os, sys, tempfile

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import PreTrainedTokenizerFast

# Each prompt is longer than 16 tokens with this tokenizer, far above the indexers' top_k.
PROMPTS = [
    "The capital of France is Paris and the capital of Italy is Rome, while the capital of",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2)) and then print(add(3, 4))",
    "Once upon a time there was a dragon in a small village by the sea, and the dragon",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "A lightning indexer selects a few keys for each query; sparse attention reads only those keys.",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Once upon a time, in a small village by the sea, there lived a dragon.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Multi-head latent attention compresses keys and values into a latent vector.",
    "A mixture of experts routes each token to a few experts and a shared expert.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12",
]

DENSE_TOPK = 1 << 20


def build_tokenizer(vocab_size=512):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def common_config(vocab, index_topk):
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
        qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        index_n_heads=8, index_head_dim=32, index_topk=index_topk,
    )


def init_weights(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("norm.bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":
                p.normal_(0.0, 4.0 / math.sqrt(p.shape[1]))
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))


def set_topk(model, k):
    n = 0
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = k
            n += 1
    assert n > 0, "no indexer found"


def indexer_margins(model, ids):
    """Smallest gap, over layers and positions with more keys than top_k, between the top_k-th
    and the next index score (relative to the score scale): near-ties would make the selection
    depend on rounding."""
    gaps = []
    hooks = []

    def hook(mod, args, kwargs, out):
        hs, q_resid, pe = args[0], args[1], args[2]
        mask = args[3]
        k_sel = mod.index_topk
        # recompute the scores the module used (same code path, returning scores)
        cos, sin = pe
        bsz, s, _ = hs.shape
        q = mod.wq_b(q_resid).view(bsz, s, mod.n_heads, mod.head_dim)
        k = mod.k_norm(mod.wk(hs)).unsqueeze(2)
        r = mod.qk_rope_head_dim
        q_rot, q_pass = q[..., :r], q[..., r:]
        k_rot, k_pass = k[..., :r], k[..., r:]
        fn = sys.modules[type(mod).__module__]
        if hasattr(fn, "apply_rotary_pos_emb_interleave") and "Glm" in type(mod).__name__:
            q_rot, k_rot = fn.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        else:
            q_rot, k_rot = fn.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], -1)
        k = torch.cat([k_rot, k_pass], -1).squeeze(2)
        sc = torch.relu(torch.matmul(q.double(), k.double().transpose(-1, -2).unsqueeze(1)) * mod.softmax_scale)
        w = mod.weights_proj(hs).double() * mod.n_heads ** -0.5
        idx = torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)[0]  # [S, T]
        for i in range(s):
            if i + 1 > k_sel:
                row = torch.sort(idx[i, : i + 1], descending=True).values
                scale = row.abs().max().item() + 1e-30
                gaps.append((row[k_sel - 1] - row[k_sel]).item() / scale)

    for m in model.modules():
        if hasattr(m, "index_topk"):
            hooks.append(m.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return min(gaps)


def convert(convert_script, hf_dir, out_path):
    src = os.path.dirname(os.path.abspath(convert_script))
    sys.path[:0] = [src, os.path.join(src, "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", convert_script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = mod
    spec.loader.exec_module(mod)
    base = sys.modules["conversion.base"]
    # Our tokenizer is new to the converter's hash list: it is a plain GPT-2 byte-level BPE.
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    for cls_mod, cls_name in (("conversion.deepseek", "DeepseekV32Model"), ("conversion.glm", "GlmMoeDsaModel")):
        if cls_mod not in sys.modules:
            importlib.import_module(cls_mod)
        getattr(sys.modules[cls_mod], cls_name).set_vocab = lambda self: self._set_vocab_gpt2()
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out_path]
    mod.main()


def logprob_positions(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    out = []
    for row in lp:
        v, i = torch.topk(row, 50)
        out.append({"top": [[int(a), float(b)] for a, b in zip(i, v)]})
    return out, lp


def run(name, make_model, index_topk, extra_cfg_json, convert_script, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.set_num_threads(2)
    tok = build_tokenizer()
    all_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert all(len(ids) >= 16 for ids in all_ids), [len(i) for i in all_ids]
    # Random weights leave some near-ties at the indexer's cut-off; take the seed (of 24) whose
    # smallest gap is largest, so fp32 (HF) and f64 (the reference) select the same keys.
    best = None
    for seed in range(24):
        model = make_model(len(tok), index_topk)
        init_weights(model, seed)
        margin = min(indexer_margins(model, ids) for ids in all_ids)
        if best is None or margin > best[1]:
            best = (seed, margin)
    seed, margin = best
    print(f"seed {seed}: smallest relative indexer margin at the cut-off {margin:.2e}")
    assert margin > 2e-5, "near-ties at the indexer cut-off"
    model = make_model(len(tok), index_topk)
    init_weights(model, seed)
    gguf_path = os.path.join(out_dir, f"{name}-tiny.f32.gguf")
    with tempfile.TemporaryDirectory() as hf_dir:
        model.save_pretrained(hf_dir, safe_serialization=True)
        tok.save_pretrained(hf_dir)
        cfg_path = os.path.join(hf_dir, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["scoring_func"] = "sigmoid"
        cfg["topk_method"] = "noaux_tc"
        cfg.update(extra_cfg_json)
        json.dump(cfg, open(cfg_path, "w"), indent=1)
        convert(convert_script, hf_dir, gguf_path)
    cases = []
    worst_dense = 0.0
    for p, ids in zip(PROMPTS, all_ids):
        set_topk(model, index_topk)
        positions, lp_sparse = logprob_positions(model, ids)
        set_topk(model, DENSE_TOPK)
        dense_positions, lp_dense = logprob_positions(model, ids)
        set_topk(model, index_topk)
        worst_dense = max(worst_dense, (lp_sparse - lp_dense).abs().max().item())
        cases.append({"prompt": p, "tokens": ids, "positions": positions, "dense_positions": dense_positions})
    doc = {"format": 1, "model": os.path.basename(gguf_path),
           "peer": f"transformers {transformers.__version__}, torch {torch.__version__}, float32",
           "generated_by": f"tests/peers/{name.replace('-', '_')}_tiny.py",
           "indexer_top_k": index_topk,
           "dense_note": "dense_positions: the same weights with the indexer's top_k above the sequence",
           "sparse_vs_dense_max_abs_dlogprob": worst_dense,
           "cases": cases}
    out_json = os.path.join(out_dir, f"hf-{name}-tiny.json")
    json.dump(doc, open(out_json, "w"), separators=(",", ":"))
    print(f"wrote {gguf_path} and {out_json}; HF sparse vs dense: max |dlogprob| {worst_dense:.3f}")


def make_deepseek32(vocab, index_topk):
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    cfg = DeepseekV32Config(n_group=4, topk_group=2, **common_config(vocab, index_topk))
    return DeepseekV32ForCausalLM(cfg).float().eval()


def main():
    run("deepseek32", make_deepseek32, 4, {}, sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    main()
