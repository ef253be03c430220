"""A --vllm rollout worker's engine on a CPU: in this process (what model.VLLMGenerator builds there)
against vLLM's default of an engine process and a model-runner process, measured in the same run.

For each layout and repeat a fresh Python process builds VLLMGenerator and times (1) seconds from its
start to a ready engine, imports included, and (2) sampled tokens/s on a fixed workload (median of 3
calls after a warm-up call). Medians over the repeats; layouts alternate so load drifts hit both.

    env -u MKL_NUM_THREADS python bench/vllm_start.py [--model tiny|smollm2-135m] [--repeats 3]

Writes results/vllm_start.json (tiny) or results/vllm_start_<model>.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"one process (VLLMGenerator)": "0", "engine + runner processes (vLLM default)": "1"}

CHILD = """
import json, os, statistics, sys, time
from types import SimpleNamespace
t0 = float(sys.argv[1])
import vllm
from model import VLLMGenerator
from modeldir import resolve_model
if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1":  # vLLM default: its own executor (processes)
    real = vllm.LLM
    vllm.LLM = lambda **kw: real(**{k: v for k, v in kw.items() if k != "distributed_executor_backend"})
cfg = SimpleNamespace(lora_rank=16, dtype="fp32", temperature=1.0, top_p=1.0)
gen = VLLMGenerator(resolve_model(sys.argv[2]), cfg, {2}, seed=0)
ready = time.time() - t0
prefixes = [[1] + [5 + (i * 7 + j) % 40 for j in range(12)] for i in range(64)]
rates = []
for _ in range(4):
    t = time.perf_counter()
    made = sum(len(s.ids) for s in gen.generate(prefixes, 32, 64))
    rates.append(made / (time.perf_counter() - t))
print("RESULT " + json.dumps({"start_s": ready, "tokens_per_s": statistics.median(rates[1:])}), flush=True)
"""


def once(model: str, multiprocessing: str) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(time.time()), model],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="as train.py's --model; the real one: smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = {name: [] for name in LAYOUTS}
    for r in range(args.repeats):
        for name, mp in LAYOUTS.items():
            runs[name].append(once(args.model, mp))
            print(f"repeat {r + 1}, {name}: {runs[name][-1]}", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("start_s", "tokens_per_s")}
           for name, rs in runs.items()}
    (one, _), (default, _) = LAYOUTS.items()
    table = ["| layout | start to ready (s) | tokens/s (64 x 32 sampled) |", "|---|---|---|"]
    table += [f"| {name} | {m['start_s']:.1f} | {m['tokens_per_s']:.0f} |" for name, m in med.items()]
    table.append(f"| ratio one / default | {med[one]['start_s'] / med[default]['start_s']:.2f}x | "
                 f"{med[one]['tokens_per_s'] / med[default]['tokens_per_s']:.2f}x |")
    print("\n".join(table))
    name = "vllm_start.json" if args.model == "tiny" else f"vllm_start_{args.model}.json"
    out = {"command": "python bench/vllm_start.py " + " ".join(sys.argv[1:]), "runs": runs, "medians": med,
           "table": table}
    (ROOT / "results" / name).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
