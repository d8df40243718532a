#!/usr/bin/env python3
"""Check: a distlab model export loads unchanged in Hugging Face transformers and predicts
what distlab predicts.

DIR is a run's output directory holding model.safetensors and config.json (as
`distlab-worker run SPEC.json --out DIR` writes them, or the two files downloaded from
GET /api/experiments/{id}/model and /model/config). The script loads DIR with
GPT2LMHeadModel.from_pretrained, runs it on a few tokens, asks distlab's own forward for the
same next-token probabilities (`distlab-worker probabilities DIR TOKENS...`) and prints the
largest difference of the probabilities and of the log-probabilities (= logits up to a
constant per row). Exit code 1 when the log-probabilities differ by more than 1e-3.

Run by hand (needs torch and transformers; not part of CI):
  python3 xtask/reference/check_export.py DIR [--worker target/debug/distlab-worker] [--tokens 20]
"""
import argparse
import json
import subprocess
import sys

import torch
from transformers import GPT2LMHeadModel


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--worker", default="target/debug/distlab-worker")
    ap.add_argument("--tokens", type=int, default=20, help="how many tokens to predict after (at most n_positions)")
    args = ap.parse_args()

    model = GPT2LMHeadModel.from_pretrained(args.dir).eval()
    cfg = model.config
    n = min(args.tokens, cfg.n_positions)
    tokens = [(7 * i + 3) % cfg.vocab_size for i in range(n)]

    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    theirs = torch.log_softmax(logits, dim=-1)

    out = subprocess.run([args.worker, "probabilities", args.dir, *map(str, tokens)],
                         check=True, capture_output=True, text=True).stdout
    ours = torch.tensor(json.loads(out), dtype=torch.float64)
    ours_log = torch.log(ours.clamp_min(1e-30))

    prob_diff = (ours - theirs.exp()).abs().max().item()
    # Compare log-probabilities where they are not vanishingly small (log(0) is -inf).
    mask = theirs.exp() > 1e-6
    log_diff = (ours_log - theirs)[mask].abs().max().item()
    print(json.dumps({
        "dir": args.dir, "tokens": n, "vocab": cfg.vocab_size, "layers": cfg.n_layer,
        "max_abs_prob_diff": prob_diff, "max_abs_logprob_diff": log_diff,
        "same_argmax": bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
    }))
    return 0 if log_diff <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
