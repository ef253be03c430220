"""GPU check: builds a ~308M-parameter Llama locally (random init, no download, no internet) and,
under bf16 autocast with LoRA and with full fine-tuning, measures peak memory, scoring tokens/s,
training tokens/s (forward + backward), and sampling tokens/s (LLMPolicy.generate); then checks,
on this device, the two invariants the loop relies on:
  - ratio == 1: the first epoch's log-probs (with grad) equal the old ones prepare() recomputed;
  - micro-batching: gradients summed over micro-batches equal one backward on the whole batch
    (reported next to what a per-micro-batch denominator, the classic bug, would give).

    python bench/gpu_check.py                # one NVIDIA GPU, about 2 minutes
    python bench/gpu_check.py --small        # tiny dims: runs on a CPU in seconds (tests use it)

Prints a markdown table and writes the numbers to --json (default runs/gpu_check.json).
Token rates count every real token a forward pass reads (prompt + completion); sampling counts
generated tokens. Exit status 1 if an invariant fails.
"""
import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train  # noqa: E402
import utils  # noqa: E402
from algos import loss_weights, policy_loss  # noqa: E402
from model import LLMPolicy, Sample  # noqa: E402
from modeldir import SPECIALS, build_tiny_model  # noqa: E402
from rollouts import make_batch  # noqa: E402

BIG = dict(layers=24, hidden=1024, heads=16, intermediate=2816, max_len=2048)  # ~308M parameters
SMALL = dict(layers=2, hidden=128, heads=2, intermediate=256, max_len=256)
# Tolerances: ratio deviations are in fp32 log-softmax space whatever the autocast dtype; micro-batch
# gradients differ by bf16 rounding of differently shaped matmuls (~1e-3), a wrong denominator by ~1e-1.
RATIO_TOL, GRAD_TOL = {"fp32": 1e-6, "bf16": 1e-6}, {"fp32": 1e-5, "bf16": 2e-2}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def synthetic_batch(policy: LLMPolicy, rows: int, prompt_len: int, new_tokens: int, seed: int = 0):
    """Random prompts and completions of different lengths (1 .. new_tokens), so micro-batches
    hold different token counts and a wrong loss denominator would show."""
    g = torch.Generator().manual_seed(seed)
    low = len(SPECIALS)  # ordinary characters only: no pad/eos inside the text
    vocab = len(policy.tokenizer)
    prefixes = [torch.randint(low, vocab, (prompt_len,), generator=g).tolist() for _ in range(rows)]
    lengths = torch.linspace(1, new_tokens, rows).round().long().tolist()
    samples = [Sample(torch.randint(low, vocab, (n,), generator=g).tolist(), [0.0] * n, True) for n in lengths]
    batch = make_batch(prefixes, samples, torch.randn(rows, generator=g).tolist(), policy.pad_id)
    batch.adv = torch.randn(rows, 1, generator=g) * batch.mask  # [N, L]
    batch.weights = loss_weights(batch.mask)
    return batch


def grads(policy: LLMPolicy, batch, micro: int, per_micro_denominator: bool = False) -> torch.Tensor:
    params = [p for p in policy.parameters() if p.requires_grad]
    policy.zero_grad(set_to_none=True)
    for rows in train.micro_slices(torch.arange(len(batch)), micro):
        w = batch.weights[rows]
        w = w / w.sum() * len(rows) / len(batch) if per_micro_denominator else w
        logp = policy.score(batch, rows)[0]
        policy_loss(logp, logp.detach(), batch.adv[rows], w, batch.mask[rows])[0].backward()
    out = torch.cat([p.grad.flatten().float() for p in params])
    policy.zero_grad(set_to_none=True)
    return out


def check_mode(path: str, lora: bool, dtype: str, a) -> dict:
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    policy = LLMPolicy(train.Config(model=path, lora=lora, dtype=dtype, chat_template=False), device=a.device)
    batch = synthetic_batch(policy, a.rows, a.prompt_len, a.new_tokens)
    tokens = batch.attn.sum().item()
    every = torch.arange(a.rows)

    def score():
        with torch.no_grad():
            for rows in train.micro_slices(every, a.micro_batch):
                policy.score(batch, rows)

    def fwd_bwd():
        grads(policy, batch, a.micro_batch)

    prompts = [torch.randint(len(SPECIALS), len(policy.tokenizer), (a.prompt_len,)).tolist() for _ in range(a.gen_prompts)]
    made = []

    def sample():
        made.append(sum(len(s.ids) for s in policy.generate(prompts, a.new_tokens, a.gen_prompts)))

    out = {"mode": "lora" if lora else "full", "dtype": dtype,
           "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
           "score_tok_s": tokens / timed(score, device, a.repeats),
           "train_tok_s": tokens / timed(fwd_bwd, device, a.repeats)}
    seconds = timed(sample, device, a.repeats)
    out["gen_tok_s"] = made[-1] / seconds

    # ratio == 1: prepare() recomputes old log-probs without grad, with the update's micro-batches
    cfg = utils.load_config(train.Config, ["--task", "arith", "--algo", "grpo", "--group-size", "2",
                                           "--inner-epochs", "2", "--micro-batch", str(a.micro_batch)])
    ratio_batch = train.prepare(policy, dataclasses.replace(batch, group=every // 2), cfg)
    dev = 0.0
    for rows in train.micro_slices(every, a.micro_batch):
        logp = policy.score(ratio_batch, rows)[0]
        m = ratio_batch.mask[rows] > 0
        dev = max(dev, (torch.exp(logp - ratio_batch.old_logp[rows])[m] - 1).abs().max().item())
    out["ratio_max_dev"] = dev

    one = grads(policy, batch, 0)
    rel = lambda g: ((g - one).norm() / one.norm()).item()
    out["grad_rel_err"] = rel(grads(policy, batch, a.micro_batch))
    out["grad_rel_err_wrong_denominator"] = rel(grads(policy, batch, a.micro_batch, per_micro_denominator=True))
    out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    out["ratio_ok"] = dev <= RATIO_TOL[dtype]
    out["grads_ok"] = out["grad_rel_err"] <= GRAD_TOL[dtype] < out["grad_rel_err_wrong_denominator"]
    del policy
    return out


def table(report: dict) -> str:
    cols = ["mode", "dtype", "trainable_params", "peak_mem_gib", "score_tok_s", "train_tok_s", "gen_tok_s",
            "ratio_max_dev", "grad_rel_err", "grad_rel_err_wrong_denominator", "ratio_ok", "grads_ok"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = [f"{report['device']}, {report['params'] / 1e6:.3g}M-parameter Llama, torch {report['torch']}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(m[c]) for c in cols) + " |" for m in report["modes"]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny dims, for a CPU smoke test")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--json", default="runs/gpu_check.json")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.device == "cpu" and not a.small:  # the full check is a ~300M model's: tens of minutes on a CPU
        print("no GPU here: checking on the CPU; --small checks in seconds", file=sys.stderr)
    dims = SMALL if a.small else BIG
    a.rows, a.prompt_len, a.new_tokens, a.micro_batch, a.gen_prompts = (4, 8, 8, 3, 4) if a.small else (16, 128, 384, 6, 64)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(str(Path(tmp) / "model"), **dims)
        modes = [check_mode(path, lora, a.dtype, a) for lora in (True, False)]
    report = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "small": a.small, "params": modes[1]["trainable_params"], "dims": dims,
              "modes": modes}
    report["passed"] = all(m["ratio_ok"] and m["grads_ok"] for m in report["modes"])
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"\n{'PASSED' if report['passed'] else 'FAILED'}; numbers in {a.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
