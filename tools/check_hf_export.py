#!/usr/bin/env python3
"""check_hf_export.py: does transformers load what `mtrl export` wrote, and compute mtrl's logits?

Run where transformers >= 5 (kimi_linear), torch and safetensors are installed (the GPU machine):

    build/mtrl export EXPERIMENT.ini CHECKPOINT --out /tmp/exp --logits /tmp/exp-logits.safetensors
    python3 tools/check_hf_export.py /tmp/exp /tmp/exp-logits.safetensors [--atol 1e-3] [--device cpu]

The logits file holds mtrl's fp32 logits of three token sequences (NAME.ids, NAME.logits for
NAME = short, chunk, long; `mtrl import` and `mtrl export` write it with --logits). This script
loads the folder with KimiLinearForCausalLM.from_pretrained (fp32, eager attention), checks that
no weight was left uninitialised or unused, runs the same ids and prints the largest absolute
difference per sequence and of the log-probabilities. Exit 0 when every difference is within
--atol, 1 otherwise.
"""
import argparse
import sys

import torch
from safetensors.torch import load_file
from transformers import KimiLinearForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("logits")
    ap.add_argument("--atol", type=float, default=1e-3)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    model, info = KimiLinearForCausalLM.from_pretrained(a.folder, dtype=torch.float32, attn_implementation="eager",
                                                        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        print("loading info not clean: %s" % bad)
        return 1
    model = model.to(a.device).eval()
    want = load_file(a.logits)
    worst = 0.0
    for name in sorted({k.split(".")[0] for k in want}):
        ids = want[name + ".ids"].round().long().to(a.device)
        ref = want[name + ".logits"].double()
        with torch.no_grad():
            got = model(ids[None], use_cache=False).logits[0].double().cpu()
        d = (got - ref).abs().max().item()
        dl = (torch.log_softmax(got, -1) - torch.log_softmax(ref, -1)).abs().max().item()
        worst = max(worst, d, dl)
        print("%-6s %3d tokens: max |logit diff| %.3g, max |log-prob diff| %.3g" % (name, ids.numel(), d, dl))
    ok = worst <= a.atol
    print("%s: worst %.3g against atol %.3g" % ("OK" if ok else "FAIL", worst, a.atol))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
