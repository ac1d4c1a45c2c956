#!/usr/bin/env python3
"""HF transformers dumps (format 1, harness/adapters/llmdiff_dump.py) of the tiny HF folders in
golden/hf/, made from the folders themselves in fp32: the candidate side of
`llmdiff diff-layers FOLDER --candidate DUMP`, with no layout declared beyond what the adapter
writes (q/k after RoPE in HF's rotate-half order, declared "hf-rotate-half").

Usage: hf_folder_dump.py GOLDEN_HF_DIR   (writes FOLDER.dump.safetensors beside each folder)
Not run by CI (needs torch + transformers); its output is committed.
"""
import json, os, sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "harness", "adapters"))
import llmdiff_dump  # noqa: E402

FOLDERS = {"llama31-bf16": llmdiff_dump.HF_LLAMA, "deepseek-v3-bf16": llmdiff_dump.HF_DEEPSEEK_V3}


def main():
    root = sys.argv[1]
    torch.set_num_threads(2)
    for name, mapping in FOLDERS.items():
        folder = os.path.join(root, name)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokens = json.load(open(os.path.join(root, f"{name}.json")))["cases"][1]["tokens"]
        dumper = llmdiff_dump.Dumper(model, mapping=dict(mapping))
        with dumper, torch.no_grad():
            model(torch.tensor([tokens]))
        path = os.path.join(root, f"{name}.dump.safetensors")
        dumper.save(path, tokens, model=name)
        print(path, len(dumper.tensors), "tensors", os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
