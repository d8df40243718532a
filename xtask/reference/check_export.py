#!/usr/bin/env python3
"""Check: a distlab model export loads unchanged in Hugging Face transformers and predicts
what distlab predicts.

DIR is a run's output directory holding model.safetensors and config.json (as
`distlab-worker run SPEC.json --out DIR` writes them, or the two files downloaded from
GET /api/experiments/{id}/model and /model/config): GPT-2 blocks load as GPT2LMHeadModel,
Llama blocks as LlamaForCausalLM (AutoModelForCausalLM picks by config.json). The script
runs it on a few tokens, asks distlab's own forward for the same next-token probabilities
(`distlab-worker probabilities DIR TOKENS...`) and prints the largest difference of the
probabilities and of the log-probabilities (= logits up to a constant per row); then
continues the tokens greedily on both sides and says whether the continuations are equal.
Exit code 1 when the log-probabilities differ by more than 1e-4 or the continuations differ.

A BPE run's directory also holds tokenizer.json: then transformers' AutoTokenizer must load
it unchanged and cut a text into the same ids as distlab (`distlab-worker tokenize DIR TEXT`),
decode them back to the text, and the tokens predicted on are that text's; the greedy
continuations are compared as text too.

Run by hand (needs torch and transformers; not part of CI):
  python3 xtask/reference/check_export.py DIR [--worker target/debug/distlab-worker] [--tokens 20] [--continue 8]
"""
import argparse
import json
import os
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def distlab_probabilities(worker, directory, tokens):
    out = subprocess.run([worker, "probabilities", directory, *map(str, tokens)],
                         check=True, capture_output=True, text=True).stdout
    return torch.tensor(json.loads(out), dtype=torch.float64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--worker", default="target/debug/distlab-worker")
    ap.add_argument("--tokens", type=int, default=20, help="how many tokens to predict after (at most the context)")
    ap.add_argument("--continue", dest="more", type=int, default=8, help="greedy tokens to compare after them")
    ap.add_argument("--text", default="ROMEO: But soft, what light through yonder window breaks?",
                    help="with tokenizer.json: the text whose tokens are predicted on")
    args = ap.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    # distlab's tokens carry no end-of-text meaning: continue for --continue tokens whatever comes.
    model.generation_config.eos_token_id = None
    cfg = model.config
    context = getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
    n = min(args.tokens, context - args.more)
    tokens = [(7 * i + 3) % cfg.vocab_size for i in range(n)]
    tokenizer_check = {}
    if os.path.exists(os.path.join(args.dir, "tokenizer.json")):
        tokenizer = AutoTokenizer.from_pretrained(args.dir)
        theirs_ids = tokenizer(args.text)["input_ids"]
        ours_ids = json.loads(subprocess.run([args.worker, "tokenize", args.dir, args.text],
                                             check=True, capture_output=True, text=True).stdout)
        tokenizer_check = {"tokenizer_class": type(tokenizer).__name__, "text_tokens": len(ours_ids),
                           "same_ids": theirs_ids == ours_ids,
                           "decodes_back": tokenizer.decode(theirs_ids) == args.text}
        n = min(len(ours_ids), context - args.more)
        tokens = ours_ids[:n]

    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    theirs = torch.log_softmax(logits, dim=-1)
    ours = distlab_probabilities(args.worker, args.dir, tokens)
    ours_log = torch.log(ours.clamp_min(1e-30))

    prob_diff = (ours - theirs.exp()).abs().max().item()
    # Compare log-probabilities where they are not vanishingly small (log(0) is -inf).
    mask = theirs.exp() > 1e-6
    log_diff = (ours_log - theirs)[mask].abs().max().item()

    # Greedy continuations: transformers' generate against distlab's argmax, token by token.
    with torch.no_grad():
        theirs_more = model.generate(torch.tensor([tokens]), max_new_tokens=args.more, do_sample=False,
                                     pad_token_id=0)[0, n:].tolist()
    ours_more, seen = [], list(tokens)
    for _ in range(args.more):
        nxt = int(distlab_probabilities(args.worker, args.dir, seen)[-1].argmax())
        ours_more.append(nxt)
        seen.append(nxt)

    if tokenizer_check:
        tokenizer_check["greedy_text_equal"] = tokenizer.decode(theirs_more) == tokenizer.decode(ours_more)
        tokenizer_check["greedy_text"] = tokenizer.decode(ours_more)
    print(json.dumps({**tokenizer_check,
        "dir": args.dir, "architecture": cfg.architectures, "tokens": n, "vocab": cfg.vocab_size,
        "layers": cfg.num_hidden_layers,
        "max_abs_prob_diff": prob_diff, "max_abs_logprob_diff": log_diff,
        "same_argmax": bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
        "greedy_transformers": theirs_more, "greedy_distlab": ours_more,
    }))
    tokenizer_ok = all(tokenizer_check.get(k, True) for k in ("same_ids", "decodes_back", "greedy_text_equal"))
    return 0 if log_diff <= 1e-4 and theirs_more == ours_more and tokenizer_ok else 1


if __name__ == "__main__":
    sys.exit(main())
