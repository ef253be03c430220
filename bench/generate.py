"""Sampling throughput: LLMPolicy.generate (hand-written KV-cache loop, logps captured) against
Hugging Face `generate` followed by the forward pass that recovers the same logps.

    python bench/generate.py [--model tiny|smollm2-135m] [--prompts 64] [--samples 8] [--tokens 16]
        [--gen-batch 64]

Writes results/generate.json (tiny) or results/generate_<model>.json.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from model import LLMPolicy  # noqa: E402
from train import Config  # noqa: E402


def hf_generate(policy: LLMPolicy, prefixes, max_new: int, gen_batch: int) -> int:
    """HF generate on left-padded chunks + one no-grad forward for logps; returns tokens made."""
    made = 0
    for s in range(0, len(prefixes), gen_batch):
        chunk = prefixes[s : s + gen_batch]
        P = max(map(len, chunk))
        ids = torch.tensor([[policy.pad_id] * (P - len(p)) + p for p in chunk])
        attn = (torch.arange(P)[None] >= torch.tensor([P - len(p) for p in chunk])[:, None]).long()
        out = policy.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, max_new_tokens=max_new,
                                    top_k=0, top_p=1.0, temperature=1.0, pad_token_id=policy.pad_id,
                                    eos_token_id=sorted(policy.eos_ids))
        full_attn = torch.cat([attn, (out[:, P:] != policy.pad_id).long()], 1)
        logits = policy.model(input_ids=out, attention_mask=full_attn).logits[:, P - 1 : -1].float()
        torch.log_softmax(logits, -1).gather(-1, out[:, P:, None])
        made += int((out[:, P:] != policy.pad_id).sum())
    return made


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--out", default="", help="default results/generate.json (tiny), else generate_<model>.json")
    args = ap.parse_args()
    for flag in ("prompts", "samples", "tokens", "gen_batch", "repeats"):  # 0 repeats: a median of nothing
        if getattr(args, flag) < 1:
            ap.exit(2, f"error: --{flag.replace('_', '-')} {getattr(args, flag)}: need at least 1\n")
    policy = LLMPolicy(Config(model=args.model, lora=not args.no_lora))
    prefixes = [policy.encode_prompt(f"{a}+{a * 7 % 97}=") for a in range(args.prompts) for _ in range(args.samples)]
    runs = {"nanorl": lambda: sum(len(s.ids) for s in policy.generate(prefixes, args.tokens, args.gen_batch)),
            "hf": lambda: hf_generate(policy, prefixes, args.tokens, args.gen_batch)}
    rates = {name: [] for name in runs}
    with torch.no_grad():
        for i in range(args.repeats + 1):  # interleaved, so a noisy neighbour hurts both alike; run 0 warms up
            for name, fn in runs.items():
                t = time.perf_counter()
                n = fn()
                if i:
                    rates[name].append(n / (time.perf_counter() - t))
    for name, r in rates.items():
        print(f"{name:7s} {statistics.median(r):9.0f} completion tokens/s (median of {args.repeats}: {', '.join(f'{x:.0f}' for x in r)})")
    name = "" if args.model == "tiny" else "_" + Path(args.model).name.removesuffix(".gguf")
    out = Path(args.out or ROOT / "results" / f"generate{name}.json")
    medians = {name: statistics.median(r) for name, r in rates.items()}
    out.write_text(json.dumps({"meta": {"command": " ".join(sys.argv), "threads": torch.get_num_threads(),
                                        "load": os.getloadavg(), **vars(args)},
                               "tokens_per_s": medians, "samples": rates}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
