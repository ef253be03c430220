"""Disaggregated training, measured in one run on this machine (medians; a markdown table at the end):

1. trained sequences/s: the synchronous loop vs a trainer + one rollout worker (HF, and with
   --vllm-e2e a vLLM one), same workload, and the most a split onto one core each could reach
   (each phase timed on one thread);
2. adapter sync: publish + fetch of one adapter over the real routes vs a raw loopback socket
   copy of the same bytes (and that copy plus the two SHA-256 passes: the floor of any verified
   transport), and the bytes per sync next to the adapter and model sizes;
3. completion tokens/s: each worker's generator (sampled-token logprobs captured, batch built
   and encoded) vs its raw engine called directly (HF `generate`, vLLM `LLM.generate`).

    python bench/async.py [--model tiny|smollm2-135m] [--steps 8] [--repeats 3] [--no-vllm] [--vllm-e2e]
        [--parts e2e,bound,sync,gen] [--gen-prompts 64]

Writes results/async.json (tiny) or results/async_<model>.json: every measurement, the command, the table.
"""
import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import rundir  # noqa: E402
import serve  # noqa: E402
import transport  # noqa: E402
import train  # noqa: E402
import utils  # noqa: E402
from model import LLMPolicy, VLLMGenerator  # noqa: E402
from rollouts import make_batch  # noqa: E402

TOKEN = "bench-token-0123456789"


# ---------------------------------------------------------------- 1. end to end
def workload(args) -> list[str]:
    # --lora --sft-steps 0: train.py's defaults for the tiny model are full fine-tuning after a warm-start;
    # these keep the trainer on what the other parts measure (LoRA, which --vllm needs) from a random init
    return ["--model", args.model, "--task", "arith", "--algo", "grpo", "--batch", str(args.batch), "--group-size", "8",
            "--max-new-tokens", str(args.tokens), "--eval-size", "8", "--lora", "--sft-steps", "0"]


def trained_per_second(args, role: list[str], env: dict, worker: list[str] | None = None) -> float:
    """Trained sequences/s between the first and the last logged update (start-up excluded).
    `worker`: flags of a rollout worker started beside the trainer (a --vllm worker cannot be
    one of the trainer's own --workers), pointed at a port picked here."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "train.py"), *workload(args), "--steps", str(args.steps),
               "--eval-every", "1000", "--no-progress", "--out", f"{tmp}/run", *role]
        env, procs = {**os.environ, **env}, []
        if worker is not None:
            with socket.create_server(("127.0.0.1", 0)) as probe:  # a free port, released for the trainer
                url = f"http://127.0.0.1:{probe.getsockname()[1]}"
            cmd += ["--trainer-url", url]
            wenv = {k: v for k, v in env.items() if k != "MKL_NUM_THREADS"}  # ENV.md: it pins vLLM to one core
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py"), *workload(args), "--role", "rollout",
                                           "--trainer-url", url, *worker], env=wenv, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in procs:  # a worker exits on its own once the trainer says the run is over
            p.wait(timeout=120)
        walls = {s: w for s, w, _ in rundir.read_metrics(Path(tmp) / "run" / "metrics.csv")["loss"]}
    return (args.steps - 1) * args.batch / (walls[args.steps] - walls[1])


def one_core_phases(args) -> dict:
    """Seconds per step of each phase on one thread, the same workload in this process: what a worker
    (generation) and the trainer (old-logp rescoring + prepare and update) each do. With the
    cores split one each, trained sequences/s can reach at most batch / max(gen, rescore + update)
    (perfect overlap, a free transport), and never more than 2 cores' worth of work:
    2 * batch / (gen + rescore + update)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = utils.load_config(train.Config, workload(args))
    policy, opt, source = train.build(cfg)
    times = {"gen": [], "rescore": [], "update": []}
    for step in range(args.steps + 2):  # 2 warm up
        t0 = time.perf_counter()
        batch = source.next(step)
        t1 = time.perf_counter()
        train.old_scores(policy, batch, cfg, source.weights)  # what an async trainer's prepare() adds: one version
        t2 = time.perf_counter()
        train.update(policy, opt, train.prepare(policy, batch, cfg), cfg)
        if step >= 2:
            for k, a, b in (("gen", t0, t1), ("rescore", t1, t2), ("update", t2, time.perf_counter())):
                times[k].append(b - a)
    torch.set_num_threads(threads)
    return {k: statistics.median(v) for k, v in times.items()}


# ---------------------------------------------------------------- 2. adapter sync
class RawCopy:
    """The floor any transport pays: a listener that sends `data` down every connection it accepts,
    like the trainer's server (one connection per request), and a reader that connects and fills a
    preallocated buffer (what the client does): no HTTP, no hashing, no parsing."""

    def __init__(self, data: bytearray):
        self.data, self.srv = data, socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self.serve, daemon=True).start()
        self.seconds()  # warm up

    def serve(self):
        while True:
            conn, _ = self.srv.accept()
            with conn:
                conn.sendall(self.data)

    def seconds(self) -> float:
        buf, got = bytearray(len(self.data)), 0
        t = time.perf_counter()
        with socket.create_connection(self.srv.getsockname()) as cli:
            view = memoryview(buf)
            while got < len(buf) and (n := cli.recv_into(view[got:])):
                got += n
        t = time.perf_counter() - t
        assert buf == self.data
        return t


def two_hashes_seconds(data: bytearray) -> float:
    """The SHA-256 passes the transport must make: the trainer's over what it sends, the worker's over what it got."""
    t = time.perf_counter()
    hashlib.sha256(data).digest()
    hashlib.sha256(data).digest()
    return time.perf_counter() - t


def adapter_sync(args) -> dict:
    cfg = utils.load_config(train.Config, ["--model", args.model, "--task", "arith", "--role", "trainer"])
    policy = LLMPolicy(cfg)
    worker = LLMPolicy(cfg)
    src = serve.AsyncRollouts(cfg, policy, SimpleNamespace(task=SimpleNamespace(rewards=[]), draw=None))
    client = transport.Client(src.inbox.server.url, token=src.inbox.server.token)
    sync, raw, hashes, copy = [], [], [], None
    for v in range(args.sync_repeats + 1):
        t = time.perf_counter()
        src.publish(v)  # snapshot + encode, as after every optimizer step
        status, body = client.get(f"/adapter?have={v - 1}&worker=-1&run={src.inbox.run}")
        tensors, meta = transport.decode(body)
        worker.load(meta["version"], tensors, meta, body)  # into the worker's policy, in place
        if v:  # v == 0 warms up
            sync.append(time.perf_counter() - t)
            copy = copy or RawCopy(body)  # every version's payload has the same size
            raw.append(copy.seconds())
            hashes.append(two_hashes_seconds(body))
    src.close()
    params = {n: p.numel() * p.element_size() for n, p in policy.named_parameters()}
    adapter = sum(v for n, v in params.items() if "lora_" in n)
    return {"sync_s": statistics.median(sync), "raw_s": statistics.median(raw), "hashes_s": statistics.median(hashes), "bytes": len(body),
            "adapter_bytes": adapter, "model_bytes": sum(params.values()) - adapter}


# ---------------------------------------------------------------- 3. generation
def tokens_per_second(fn, repeats: int) -> float:
    rates = []
    for i in range(repeats + 1):  # run 0 warms up
        t = time.perf_counter()
        n = fn()
        if i:
            rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates)


def worker_path(gen, policy, prefixes, tokens) -> int:
    """What a worker does per batch besides HTTP: generate with logprobs, build, encode."""
    samples = gen.generate(prefixes, tokens, 64)
    batch = make_batch(prefixes, samples, [0.0] * len(samples), policy.pad_id)
    transport.encode(batch.wire(), {"worker": 0})
    return sum(len(s.ids) for s in samples)


def hf_raw(policy, prefixes, tokens) -> int:
    """Completion tokens made, each row counted up to its end token included, as the worker counts."""
    made, eos = 0, torch.tensor(sorted(policy.eos_ids))
    for s in range(0, len(prefixes), 64):  # the chunk size the worker uses (gen_batch 64)
        chunk = prefixes[s : s + 64]
        P = max(map(len, chunk))
        ids = torch.tensor([[policy.pad_id] * (P - len(p)) + p for p in chunk])  # [B, P]
        # from the lengths, not ids != pad: a chat template writes the pad id (an end token) inside prompts
        attn = (torch.arange(P)[None] >= torch.tensor([P - len(p) for p in chunk])[:, None]).long()  # [B, P]
        out = policy.model.generate(input_ids=ids, attention_mask=attn, do_sample=True, top_k=0, top_p=1.0,
                                    temperature=1.0, max_new_tokens=tokens, pad_token_id=policy.pad_id,
                                    eos_token_id=sorted(policy.eos_ids))
        ended = torch.isin(out[:, P:], eos)  # [B, T]
        made += int(torch.where(ended.any(1), ended.int().argmax(1) + 1, out.shape[1] - P).sum())
    return made


def generation(args) -> dict:
    cfg = utils.load_config(train.Config, ["--model", args.model, "--task", "arith", "--max-new-tokens", str(args.gen_tokens)])
    policy = LLMPolicy(cfg)
    prefixes = [policy.encode_prompt(f"{a}+{a * 7 % 97}=") for a in range(args.gen_prompts) for _ in range(8)]
    hf = policy
    with torch.no_grad():
        out = {"hf_worker": tokens_per_second(lambda: worker_path(hf, policy, prefixes, args.gen_tokens), args.repeats),
               "hf_raw": tokens_per_second(lambda: hf_raw(policy, prefixes, args.gen_tokens), args.repeats)}
    if args.vllm:
        gen = VLLMGenerator(policy.path, cfg, policy.eos_ids, 0)
        names, meta = policy.wire_names(), {"adapter_config": policy.adapter_config()}
        tensors = {names[n]: t for n, t in policy.trainable_state().items()}
        gen.load(0, tensors, meta, transport.encode(tensors, meta))
        prompts = [{"prompt_token_ids": p} for p in prefixes]
        params = gen.SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.gen_tokens,
                                    stop_token_ids=sorted(policy.eos_ids))
        raw = lambda: sum(len(o.outputs[0].token_ids) for o in gen.llm.generate(prompts, params, lora_request=gen.request, use_tqdm=False))
        print(f"generation so far: {out}", flush=True)
        out["vllm_worker"] = tokens_per_second(lambda: worker_path(gen, policy, prefixes, args.gen_tokens), args.repeats)
        out["vllm_raw"] = tokens_per_second(raw, args.repeats)
    return out


def rows(r: dict, args) -> list[tuple[str, str, str]]:
    """The table's rows for whatever parts ran."""
    out = []
    if "e2e" in r:
        sync, split = r["e2e"]["sync"], r["e2e"]["hf_split"]
        out += [("trained sequences/s, sync loop", f"{sync:.2f}", ""),
                ("trained sequences/s, trainer + 1 HF worker", f"{split:.2f}", f"{split / sync:.2f}x sync")]
        if "vllm_split" in r["e2e"]:
            v = r["e2e"]["vllm_split"]
            out.append(("trained sequences/s, trainer + 1 vLLM worker", f"{v:.2f}", f"{v / sync:.2f}x sync"))
    if "bound" in r:
        p, sync = r["bound"], r.get("e2e", {}).get("sync")
        vs = (lambda x: f"{x / sync:.2f}x sync") if sync else (lambda x: "")
        balance, cores = args.batch / max(p["gen"], p["rescore"] + p["update"]), 2 * args.batch / sum(p.values())
        out += [("  its bound: one core each, perfect overlap, free transport", f"{balance:.2f}",
                 f"{vs(balance)} (gen {p['gen'] * 1e3:.0f} ms; trainer: rescore {p['rescore'] * 1e3:.0f} "
                 f"+ update {p['update'] * 1e3:.0f} ms per step)"),
                ("  its bound: all the work spread over 2 cores", f"{cores:.2f}", vs(cores))]
    if "sync" in r:
        a = r["sync"]
        out += [("adapter sync: publish + fetch + load (s)", f"{a['sync_s'] * 1e3:.1f} ms",
                 f"{a['sync_s'] / a['raw_s']:.1f}x raw socket copy ({a['raw_s'] * 1e3:.1f} ms)"),
                ("  its floor: raw copy + the 2 SHA-256 passes", f"{(a['raw_s'] + a['hashes_s']) * 1e3:.1f} ms",
                 f"{(a['raw_s'] + a['hashes_s']) / a['raw_s']:.1f}x raw socket copy (hashing {a['hashes_s'] * 1e3:.1f} ms)"),
                ("bytes per sync", f"{a['bytes']:,}", f"adapter {a['adapter_bytes']:,} B, base model {a['model_bytes']:,} B")]
    if "gen" in r:
        g, shape = r["gen"], f"{args.gen_prompts}x8x{args.gen_tokens}"
        out.append((f"HF worker tokens/s ({shape})", f"{g['hf_worker']:.0f}",
                    f"{g['hf_worker'] / g['hf_raw']:.0%} of raw HF generate ({g['hf_raw']:.0f}; goal >= 80%)"))
        if "vllm_raw" in g:
            out.append((f"vLLM worker tokens/s ({shape})", f"{g['vllm_worker']:.0f}",
                         f"{g['vllm_worker'] / g['vllm_raw']:.0%} of raw LLM.generate ({g['vllm_raw']:.0f}; goal >= 80%)"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="as train.py's --model; the real one: smollm2-135m")
    ap.add_argument("--parts", default="e2e,bound,sync,gen", help="comma list of what to measure")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16, help="max_new_tokens of the training workload")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--gen-prompts", type=int, default=64, help="x 8 samples each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sync-repeats", type=int, default=20, help="adapter syncs (milliseconds each)")
    ap.add_argument("--e2e-repeats", type=int, default=1, help="end-to-end runs per mode (each is minutes on 2 cores)")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false")
    ap.add_argument("--vllm-e2e", action="store_true", help="end to end with a vLLM worker too")
    ap.add_argument("--out", default="", help="default results/async.json (tiny), else async_<model>.json")
    args = ap.parse_args()
    parts, r = args.parts.split(","), {}
    name = "" if args.model == "tiny" else "_" + Path(args.model).name.removesuffix(".gguf")
    out = Path(args.out or ROOT / "results" / f"async{name}.json")
    meta = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_before": os.getloadavg(), **vars(args)}

    def save() -> None:  # after every part: a long run that dies keeps what it measured
        meta["load_after"] = os.getloadavg()
        out.write_text(json.dumps({"meta": meta, "results": r, "rows": rows(r, args)}, indent=1))

    if "e2e" in parts:
        one = {"OMP_NUM_THREADS": "1", "NANORL_TOKEN": TOKEN}  # trainer and worker get a core each
        modes = {"sync": ([], {}, None), "hf_split": (["--role", "trainer", "--workers", "1"], one, None)}
        if args.vllm_e2e:
            modes["vllm_split"] = (["--role", "trainer"], one, ["--vllm"])
        runs = [{m: trained_per_second(args, *spec) for m, spec in modes.items()}
                for _ in range(args.e2e_repeats)]  # interleaved: a drift in the machine's speed hits every mode
        r["e2e"] = {m: statistics.median(run[m] for run in runs) for m in modes}
        print(f"trained sequences/s: {r['e2e']}", flush=True)  # the table comes last
        save()
    if "bound" in parts:
        r["bound"] = one_core_phases(args)
        print(f"one-thread phases (s/step): {r['bound']}", flush=True)
        save()
    if "sync" in parts:
        r["sync"] = adapter_sync(args)
        print(f"adapter sync: {r['sync']}", flush=True)
        save()
    if "gen" in parts:
        r["gen"] = generation(args)
        save()
    print(f"\n{os.cpu_count()} cores, {args.model} model, medians of {args.repeats} ({args.e2e_repeats} for end to end)"
          "\n\n| measure | value | vs |\n|---|---|---|")
    for row in rows(r, args):
        print("| " + " | ".join(row) + " |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
