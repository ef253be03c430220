"""Peak memory (RSS) of one GRPO update (stages 2 and 3 of a default LLM run: on-policy, so the loss's
forward and backward) by rows per micro-batch, on --rows completions of exactly --tokens tokens.

    python bench/memory.py [--model smollm2-135m] [--rows 16] [--tokens 512] [--micro 0,8,4]

Each setting runs in a process of its own (ru_maxrss is a process's high-water mark) on the same
synthetic batch: countdown prompts and random completion ids, so no generation is timed or held.
--no-lora and the loop's other flags are the task defaults (LoRA r=16 all-linear, fp32). Writes
results/memory_<model>_<rows>x<tokens>.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train  # noqa: E402
from model import Sample  # noqa: E402
from rollouts import make_batch  # noqa: E402


def one(model: str, rows: int, tokens: int, micro: int) -> dict:
    """In this process: build the run's policy, then prepare + update one batch; peak RSS in GiB."""
    cfg = train.parse(["--task", "countdown", "--model", model, "--batch", str(rows), "--micro-batch", str(micro),
                       "--max-new-tokens", str(tokens), "--no-progress"])
    policy, opt, source = train.build(cfg)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    g = torch.Generator().manual_seed(0)
    problems = [source.task.train_problem(i) for i in range(rows // cfg.group_size)]
    prefixes = [policy.encode_prompt(p.prompt) for p in problems for _ in range(cfg.group_size)]
    ids = torch.randint(3, min(1000, len(policy.tokenizer)), (rows, tokens), generator=g).tolist()
    samples = [Sample(x, [-1.0] * tokens, True) for x in ids]
    batch = make_batch(prefixes, samples, torch.rand(rows, generator=g).tolist(), policy.pad_id,
                       group_size=cfg.group_size)
    t0 = time.perf_counter()
    train.update(policy, opt, train.prepare(policy, batch, cfg), cfg)
    return {"rows": rows, "tokens": tokens, "micro_batch": micro, "prompt_tokens": max(map(len, prefixes)),
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "model_gib": before,
            "update_s": time.perf_counter() - t0}


def settings(ap: argparse.ArgumentParser, args) -> list[int]:
    """The micro-batch sizes; arguments no child could measure stop here, in one line (exit 2)."""
    group = train.task_defaults({"task": "countdown", "model": args.model})["group_size"]
    if args.rows < group or args.rows % group:  # else the batch holds rows // group whole groups: fewer rows
        ap.exit(2, f"error: --rows {args.rows}: whole groups of {group} completions (a GRPO group); "
                   f"try --rows {group * max(1, args.rows // group)}\n")
    if args.tokens < 1:
        ap.exit(2, f"error: --tokens {args.tokens}: a completion needs at least 1 token; try --tokens 512\n")
    if not all(m.isdigit() for m in args.micro.split(",")):
        ap.exit(2, f"error: --micro {args.micro}: rows per micro-batch, integers >= 0 (0: the whole batch), "
                   "comma-separated; e.g. --micro 0,8,4\n")
    return [int(m) for m in args.micro.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--micro", default="0,8,4")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child's side
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.model, args.rows, args.tokens, int(args.micro))))
        return
    results = []
    for micro in settings(ap, args):
        run = subprocess.run([sys.executable, __file__, "--one", "--model", args.model, "--rows", str(args.rows),
                              "--tokens", str(args.tokens), "--micro", str(micro)], capture_output=True, text=True)
        if run.returncode:
            why = run.stderr.strip().splitlines()[-1:] or [f"exit status {run.returncode}"]  # killed: no line
            results.append({"micro_batch": micro, "error": why})
        else:
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    if not any("peak_gib" in r for r in results):  # nothing measured: no file, and the first child's error
        sys.exit(f"error: every setting failed, the first with: {results[0]['error'][0]}")
    whole = next((r for r in results if r.get("micro_batch") == 0 and "peak_gib" in r), None)
    for r in results:
        if whole and "peak_gib" in r:
            r["peak_vs_whole"] = r["peak_gib"] / whole["peak_gib"]
    out = ROOT / "results" / f"memory_{Path(args.model).name}_{args.rows}x{args.tokens}.json"
    meta = {"command": " ".join(["bench/memory.py", *sys.argv[1:]]), "torch": torch.__version__,
            "median_update_s": statistics.median(r["update_s"] for r in results if "update_s" in r)}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(out)


if __name__ == "__main__":
    main()
