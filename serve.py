"""Disaggregated training: a trainer process serves, rollout workers call it.

    NANORL_TOKEN=... python train.py --config C --role trainer [--workers 2]   # prints its url
    NANORL_TOKEN=... python train.py --config C --role rollout --trainer-url http://HOST:PORT [--vllm]

Routes: POST /hello (fingerprint check, worker id), GET /adapter?have=V (long-polls a newer adapter),
POST /batch (scored groups, numbered by their worker). Both carry the trainer process's run, which /hello
gives. HTTP, token and codec are transport.py's; workers run rollouts.py's sources.
"""
import contextlib
import errno
import json
import os
import random
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

import tasks
import utils
from model import LLMPolicy, VLLMGenerator
from rollouts import METRICS, WIRE, Batch, BatchSource, EnvRollouts, from_wire, sources
from transport import Client, PayloadError, Request, ServeError, Server, decode, encode, split_url

FINGERPRINT = ("task", "seed", "eval_size", "data", "model", "lora", "lora_rank", "lora_alpha",
               "lora_targets", "max_new_tokens", "batch", "group_size", "temperature", "top_p",
               "chat_template", "thinking", "overlong_buffer", "max_turns", "max_len", "dynamic_sampling",
               "max_gen_batches", "prompt_reweight", "judge_down", "sandbox")
PROTOCOL = 1  # raised when a route or a batch's keys change: /hello refuses a worker of another nanorl
STRIDE = 1_000_000  # worker w samples train problems w*STRIDE, w*STRIDE+1, ...: workers never share a prompt
SURVIVORS = 64  # ids a resumed trainer skips: those issued after its checkpoint, to workers that outlived it
LONG_POLL = 2.0  # seconds GET /adapter waits for a newer version; also the workers' heartbeat period
HEARTBEAT = 10.0  # a worker silent for longer is not counted as live
WAITING = 60.0  # seconds a step waits without a batch between its "waiting for batches" lines
CHECKS = 2.0  # seconds between looks at the trainer's own --workers while it waits: a dead one is told soon
REFUSALS = 5  # bad batches in a row that stop a worker: not 409s (ahead of a --resumed trainer), OTHER_RUN's
OTHER_RUN = 412  # a request of a worker another trainer process registered: it says /hello again
FINISHED = 410, {"finished": True}  # the answer to every request once the run is over: the worker exits
SEQS = 4096  # workers whose last batch, and heartbeat, the inbox remembers (the least recently heard go)


def fingerprint(cfg) -> dict:
    """What trainer and workers must agree on: the task split, the model, how it samples, and every option
    the worker's own source runs (what it sends would differ)."""
    return {"protocol": PROTOCOL, **{k: getattr(cfg, k) for k in FINGERPRINT}}


def wire_keys(cfg, local: BatchSource) -> set[str]:
    """The keys of every batch this run's workers send: rollouts.WIRE's and the stats their source fills,
    multi-turn's or a reward_<fn> per reward, as tasks.Task.score names them."""
    if isinstance(local, EnvRollouts):
        return set(WIRE) | {"solved", "solved_first_turn", "turns"}  # a multi-turn source sends all of these
    dropped = {"judge_dropped_frac"} if cfg.judge_down == "drop" else set()
    return set(WIRE) | {f"reward_{n}" for n in tasks.reward_names(local.task.rewards)} | dropped


def collate(groups: list[dict], pad_id: int) -> dict:
    """Concatenates groups of rows, right-padding [n, L] tensors to the longest L."""
    L = max(g["tokens"].shape[1] for g in groups)
    pad = lambda n, x: torch.nn.functional.pad(x, (0, L - x.shape[1]), value=pad_id if n == "tokens" else 0)
    return {n: torch.cat([pad(n, g[n]) if g[n].ndim > 1 else g[n] for g in groups]) for n in groups[0]}


class Inbox:
    """The trainer's HTTP side (rank 0 only): the routes run in the server's threads, and everything
    they share with the training thread is guarded by `cond`."""

    def __init__(self, cfg, vocab: int, pad_id: int, max_len: int, keys: set[str]):
        self.cfg, self.vocab, self.pad_id, self.groups = cfg, vocab, pad_id, cfg.batch // cfg.group_size
        self.max_len, self.keys = max_len, keys  # longest row; the key set of every batch (wire_keys)
        # This process's requests carry it: a worker registered by another (a trainer killed, a run started
        # anew on its url) is told OTHER_RUN and says /hello again, whose fingerprint check it may fail.
        self.run, self.reclaim = secrets.token_hex(8), 0  # reclaim: ids issued before this process (restore)
        self.seqs = {}  # worker -> its last batch taken: a copy sent again after a lost reply is not trained
        # Groups. A batch ages a step while generated and one per batch queued ahead of it: max_staleness - 1
        # batches keep most fresh (bench/async.py: ~10% of groups dropped stale, ~25% with max_staleness).
        self.capacity = max(1, cfg.max_staleness - 1) * self.groups
        self.cond = threading.Condition()
        self.queue: list[tuple[dict, list]] = []  # (tensors of one group, its rows' texts)
        self.version, self.payload, self.finished, self.next_worker = -1, b"", False, 0
        self.seen, self.told = {}, set()  # worker -> time of its last request; workers told "finished"
        self.restored = False  # until restore(): an id issued before may be one a past worker of the run had
        self.counts, self.apply_s, self.publish_s, self.rollout_metrics = Counter(), [], 0.0, []
        self.refusal = ""  # why the latest refused batch was: a step waiting for batches says it
        self.alone, self.exited = not os.environ.get("NANORL_TOKEN"), set()  # only --workers join; dead pids
        self.resumed = Counter()  # the counts up to a --resumed run's checkpoint: its logged totals go on
        host, port = split_url(cfg.trainer_url or "http://127.0.0.1:0")  # none: a loopback port, never taken
        try:
            self.server = Server({("POST", "/hello"): self.hello, ("GET", "/adapter"): self.adapter,
                                  ("POST", "/batch"): self.receive}, host, port or 0)
        except OSError as e:  # the port is taken (or root's), or the host is not this machine's, or unknown
            fix = ("pick another port, or stop the process that holds it" if e.errno == errno.EADDRINUSE
                   else "pick a port above 1023 (those below need root)" if e.errno == errno.EACCES
                   else "give this machine's host name or address (0.0.0.0: all of them)")
            why = f"--trainer-url {cfg.trainer_url}: cannot listen there ({e.strerror}); {fix}"
            raise utils.ConfigError(why) from None
        # 0.0.0.0 (or ::) is every interface here, which a worker on another machine cannot dial
        reach = (f"http://{socket.gethostname()}:{self.server.server_address[1]}" if host in ("0.0.0.0", "::")
                 else self.server.url)
        alone = " (none is set: only --workers started here join)" if self.alone else ""
        utils.stderr(f"trainer listening on {self.server.url}; start workers with --role rollout "
                     f"--trainer-url {reach} and the same NANORL_TOKEN{alone}")

    def _heard(self, worker) -> bool:
        """Heartbeat; True once the run is over (the route answers 410 and the worker exits)."""
        if type(worker) is int and 0 <= worker < self.next_worker:  # only ids /hello issued count as live
            self.seen.pop(worker, None)  # as seqs: SEQS at most, since each /hello issues an id (a flood)
            self.seen[worker] = time.time()
            if len(self.seen) > SEQS:
                del self.seen[next(iter(self.seen))]
            if self.finished:
                self.told.add(worker)
                self.cond.notify_all()  # close() waits for every live worker to hear it
        return self.finished

    def hello(self, req: Request):
        try:
            said = json.loads(req.body)
            theirs, claim = dict(said["fingerprint"]), said.get("worker")  # claim: a registered worker's id
        except (ValueError, KeyError, TypeError, RecursionError):  # Recursion: [[[[... nested past the stack
            return 400, {"error": 'POST /hello needs JSON {"fingerprint": {...}}'}
        if diff := [f"{k} (trainer {v!r}, worker {theirs.get(k)!r})" for k, v in fingerprint(self.cfg).items()
                    if theirs.get(k) != v]:
            fix = "config" if theirs.get("protocol") == PROTOCOL else "nanorl version (another protocol)"
            return 409, {"error": f"worker and trainer disagree on {'; '.join(diff)}: start the worker with "
                                  f"the trainer's {fix}"}
        with self.cond:
            if not self.cond.wait_for(lambda: self.restored or self.finished, timeout=LONG_POLL):
                return 503, {"error": "the trainer is loading its checkpoint; ask again shortly"}
            if claim is None:
                claim, self.next_worker = self.next_worker, self.next_worker + 1
            elif not (type(claim) is int and 0 <= claim < self.reclaim):  # ids of trainers before a --resume
                return 409, {"error": f"worker id {claim!r} was not issued by this run before its trainer "
                                      "restarted: restart the worker"}
            return FINISHED if self._heard(claim) else (200, {"worker": claim, "run": self.run})

    def restore(self, next_worker: int) -> None:
        """The first worker id to issue (a checkpoint's, or 0): /hello answers from now on."""
        with self.cond:
            self.next_worker, self.reclaim, self.restored = next_worker, next_worker, True
            self.cond.notify_all()

    def adapter(self, req: Request):
        """The newest adapter once it is not ?have=V's, waiting up to LONG_POLL for one (if crowded: 503)."""
        if not all(re.fullmatch(r"-?[0-9]{1,12}", req.query.get(k, "")) for k in ("have", "worker")):
            return 400, {"error": "GET /adapter needs ?have=VERSION&worker=ID"}
        if req.query.get("run") != self.run:
            return OTHER_RUN, {"error": "this worker was registered by another trainer: POST /hello again"}
        # A worker ahead of this trainer sampled for its run before a --resume: it takes this one's weights.
        other = lambda: self.version >= 0 and self.version != int(req.query["have"])
        with self.cond:
            self.cond.wait_for(lambda: other() or self.finished, timeout=0 if req.crowded else LONG_POLL)
            if self._heard(int(req.query["worker"])):
                return FINISHED
            self.counts["adapters_sent"] += other()
            return (200, self.payload) if other() else (503 if req.crowded else 204, None)

    def check(self, t: dict, meta: dict) -> str | None:
        """Why the loop cannot use a worker's batch (rollouts.WIRE's keys, dtypes and shapes, [N] float32
        stats, values), or None. Every batch has the run's keys: groups collate, stats stay whole."""
        k, keys = self.cfg.group_size, set(t)
        if keys != self.keys:
            return f"batch keys: missing {sorted(self.keys - keys)}, unexpected {sorted(keys - self.keys)}"
        if not all(type(meta.get(n)) is int for n in ("worker", "seq")):
            return "meta needs the worker's id and the batch's sequence number seq (integers)"
        if t["tokens"].ndim != 2:
            return "tokens must be [N, L]"
        N, L = t["tokens"].shape
        if L == 0:
            return "rows need at least one token"
        if L > self.max_len or N > self.capacity * k:  # more groups than the queue holds would never fit
            return f"{N} rows of {L} tokens; at most {self.capacity} groups of {k} rows, {self.max_len} long"
        for n, x in t.items():
            dims, dtype = WIRE.get(n, (1, torch.float32))
            if list(x.shape) != (shape := [N, L][:dims]) or x.dtype != dtype:  # sets shape for the message
                return f"{n} is {x.dtype} {list(x.shape)}; expected {dtype} {shape}"
        # --judge-down drop: a row no judge scored has NaN reward parts (logged by nanmean, never trained)
        unscored = t.get("judge_dropped_frac", torch.zeros(N)) == 1  # [N]
        for n, x in t.items():
            ok = x.isfinite() | unscored & x.isnan() if n.startswith("reward_") else x.isfinite()
            if not ok.all():
                return f"{n} holds NaN or inf; expected finite values"
        if N == 0 or (t["group"].unique(return_counts=True)[1] != k).any():  # so N is a multiple of k
            return f"every group needs exactly group_size={k} rows"
        if t["tokens"].min() < 0 or t["tokens"].max() >= self.vocab:
            return f"token ids outside the vocabulary [0, {self.vocab})"
        if t["version"].min() < 0:
            return f"versions start at 0 (got {int(t['version'].min())})"
        m, a = t["mask"], t["attn"]
        if ((m != 0) & (m != 1)).any() or ((a != 0) & (a != 1)).any() or (m > a).any() or m[:, 0].any():
            return "mask and attn must be 0/1, mask inside attn and 0 in column 0"
        if not (t["rewards"] * m).sum(1).abs().sum().isfinite():  # [N] returns; the total bounds a group's
            return "rewards summed over rows reach inf in float32 (a NaN step); keep them far below 3.4e38"
        if (texts := meta.get("texts")) is None or isinstance(texts, list) and len(texts) == N and all(
                isinstance(r, list) and len(r) == 3 and all(isinstance(x, str) for x in r) for r in texts):
            return None
        return "meta texts must be one [prompt, completion, answer] of strings per row"

    def receive(self, req: Request):
        tensors, meta = decode(req.body)  # a PayloadError answers 400
        if meta.get("run") != self.run:
            return OTHER_RUN, {"error": "this worker was registered by another trainer: POST /hello again"}
        with self.cond:
            if self._heard(meta.get("worker")):
                return FINISHED
            why, status = self.check(tensors, meta), 400
            if not why and (v := tensors["version"]).max() > self.version:  # a worker ahead of a trainer
                # --resumed from an older checkpoint: 409, a conflict its next batch (these weights) resolves
                status, lo, hi = 409, int(v.min()), int(v.max())
                why = (f"versions {lo}..{hi} outside the published 0..{self.version}" if self.version >= 0
                       else f"versions {lo}..{hi}, but this trainer has published none yet")
            if why:
                self.counts["batches_rejected"] += 1
                self.refusal = f"; {self.counts['batches_rejected']} batches refused, the latest: {why}"
                return status, {"error": why}
            texts = meta.get("texts") or [["", "", ""]] * len(tensors["tokens"])
            rows = [(tensors["group"] == g).nonzero()[:, 0] for g in tensors["group"].unique()]  # [k] each
            groups = [({n: x[r] for n, x in tensors.items()}, [texts[i] for i in r.tolist()]) for r in rows]
            room = lambda: self.finished or len(self.queue) + len(groups) <= self.capacity
            if not self.cond.wait_for(room, timeout=0 if req.crowded else LONG_POLL):  # crowded: as /adapter
                return 429, {"error": f"queue full ({len(self.queue)} groups); retry shortly"}
            if self.finished:
                return FINISHED
            if self.taken(meta["worker"], meta["seq"]):  # after the wait: a copy may have landed meanwhile
                self.counts["batches_duplicate"] += 1
                return 200, {"queued": 0, "dropped": 0, "duplicate": True}
            fresh = [g for g in groups if self.fresh(g[0], self.version)]
            self.counts.update(groups_received=len(groups), dropped_stale=len(groups) - len(fresh))
            a = meta.get("apply_s")  # seconds: 1e400 (inf), NaN or 10**400 is not a time
            # only with groups queued: those lists grow until a step takes groups
            self.apply_s += [float(a)] if fresh and type(a) in (int, float) and 0 <= a < 3600 else []
            theirs = meta.get("metrics") if isinstance(meta.get("metrics"), dict) else {}
            # METRICS alone: any other key would overwrite the trainer's own in the step's log (loss, ...)
            self.rollout_metrics += [{k: float(v) for k in METRICS if type(v := theirs.get(k)) in (int, float)
                                      and abs(v) < 1e12}] if fresh else []
            self.queue.extend(fresh)
            self.cond.notify_all()
            return 200, {"queued": len(fresh), "dropped": len(groups) - len(fresh)}

    def taken(self, worker: int, seq: int) -> bool:
        """Whether the worker's batch `seq` was taken already (a worker numbers its batches 0, 1, ... and
        sends one at a time); if not, it is now. Remembers the last SEQS workers heard."""
        last = self.seqs.pop(worker, -1)  # put back last: the dict's order is least recently heard first
        self.seqs[worker] = max(last, seq)
        if len(self.seqs) > SEQS:
            del self.seqs[next(iter(self.seqs))]
        return seq <= last

    def serve(self, version: int, payload: bytearray, publish_s: float) -> None:
        """GET /adapter answers with this payload from now on."""
        with self.cond:
            self.version, self.payload, self.publish_s = version, payload, publish_s
            self.cond.notify_all()

    def take(self, step: int, scorable: set[int], procs: list = ()) -> tuple[dict, dict]:
        """The step's usable groups, sorted by version, collated; and the transport's numbers (with
        the rows' texts). A group too old, or of a version without a snapshot, is dropped and counted.
        procs: the --workers processes, whose deaths a step waiting for batches tells."""
        got, said = [], time.monotonic()
        with self.cond:  # wait_for releases it while the HTTP threads fill the queue
            while len(got) < self.groups:
                if not self.cond.wait_for(lambda: self.queue, timeout=min(CHECKS, WAITING)):
                    self.check_workers(procs)
                    utils.beat()  # torchrun: the other ranks, in broadcast_bytes, wait on past --dist-timeout
                    if time.monotonic() - said >= WAITING:
                        said, live = time.monotonic(), len(self.live())
                        utils.stderr(f"step {step}: waiting for batches ({live} live workers{self.refusal})")
                taken, self.queue = self.queue[: self.groups - len(got)], self.queue[self.groups - len(got):]
                self.cond.notify_all()  # room for a worker whose POST is waiting
                for g in taken:
                    if not self.fresh(g[0], step):
                        self.counts["dropped_stale"] += 1
                    elif any(int(v) not in scorable for v in g[0]["version"].unique()):
                        self.counts["dropped_no_snapshot"] += 1
                    else:
                        got.append(g)
            meta = dict(queue_depth=len(self.queue), live_workers=len(self.live()),
                        sync_bytes=len(self.payload), sync_publish_s=self.publish_s,
                        sync_apply_s=statistics.median(self.apply_s or [0.0]), **self.totals())
            for k in {k for m in self.rollout_metrics for k in m}:  # the workers' source.last, averaged
                meta[k] = statistics.mean(m[k] for m in self.rollout_metrics if k in m)
            self.apply_s, self.rollout_metrics = [], []
        got.sort(key=lambda g: int(g[0]["version"].min()))  # by version: its rows share micro-batches
        return collate([g for g, _ in got], self.pad_id), {**meta, "texts": [t for _, ts in got for t in ts]}

    def totals(self) -> Counter:
        """The run's counts: the inbox's and the server's (refused requests: http_401, ...; dropped
        connections), from the checkpoint's on after a --resume, so that their logged curves never fall."""
        total = Counter(self.resumed)
        for counts in (self.counts, self.server.counts):
            total.update(counts)  # update, not +: a count of 0 is still logged
        return total

    def check_workers(self, procs: list) -> None:
        """Says once of each --workers process that it exited; raises once all have and no other can join."""
        for p in procs:
            if p.poll() is not None and p.pid not in self.exited:
                self.exited.add(p.pid)
                utils.stderr(f"worker process {p.pid} exited with code {p.returncode}")
        if procs and len(self.exited) == len(procs) and self.alone:  # a fresh token: no other worker has it
            raise utils.ConfigError(f"all {len(procs)} --workers processes exited and, without NANORL_TOKEN, "
                                    "no other worker can join; see their output above")  # train adds --resume

    def fresh(self, group: dict, step: int) -> bool:
        return step - int(group["version"].min()) <= self.cfg.max_staleness

    def live(self) -> set[int]:
        return {w for w, t in self.seen.items() if time.time() - t < HEARTBEAT}

    def close(self) -> None:
        """Answers 'finished' until every live worker has heard it (a few seconds at most), then
        stops; a worker that missed it exits after --worker-patience of refused connections."""
        with self.cond:
            self.finished = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.live() - self.told, timeout=2 * LONG_POLL + 1)
        self.server.close()


def spawn_workers(cfg, url: str, token: str) -> list[subprocess.Popen]:
    """--workers N: local rollout workers with exactly this run's config (so the fingerprints
    match), sent by pipe (no file stays), and the token, without torchrun's rank variables. Each has a
    session of its own: a terminal's Ctrl-C is for the trainer, which finishes its step on their batches."""
    ranks = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in ranks} | {"NANORL_TOKEN": token}
    env["NANORL_TRAINER_PID"] = str(os.getpid())  # each dies with this process: see run_worker
    config = utils.dump_config(replace(cfg, role="rollout", trainer_url=url, workers=0, out="", resume=""))
    argv = [sys.executable, str(Path(__file__).with_name("train.py")), "--config", "/dev/stdin"]
    procs = [subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, start_new_session=True)
             for _ in range(cfg.workers)]
    for p in procs:
        p.stdin.write(config.encode())
        p.stdin.close()
    return procs


class AsyncRollouts(BatchSource):
    """The trainer's batch source: the workers' groups (Inbox), a snapshot of each version within
    max_staleness (`weights`: stage 2 scores a row under its own), a local source for eval and warm-start."""

    def __init__(self, cfg, policy, local: BatchSource):
        self.cfg, self.policy, self.local = cfg, policy, local
        self.version, self.snapshots, self.last = -1, {}, {}  # version -> adapter tensors (wire names)
        self.config_json = policy.adapter_config()  # saves an adapter to check PEFT's names: once per run
        self.inbox, self.procs = None, []  # under torchrun rank 0 alone serves the workers
        if utils.rank() == 0:
            # The longest row: a multi-turn episode ends by --max-len, a single-turn one by the context
            # (a model that names none: a prompt of up to --max-len and the token budget)
            context = getattr(policy.model.config, "max_position_embeddings", None)
            limit = (min(cfg.max_len, context or cfg.max_len) if isinstance(local, EnvRollouts)
                     else context or cfg.max_len + cfg.max_new_tokens)
            vocab = policy.model.get_input_embeddings().num_embeddings
            self.inbox = Inbox(cfg, vocab, policy.pad_id, limit, wire_keys(cfg, local))
            self.procs = spawn_workers(cfg, self.inbox.server.url, self.inbox.server.token)

    def next(self, step: int) -> Batch:
        if self.version < step:
            self.publish(step)  # the first call: after any resume or SFT warm-start, so v0 is what trains
        rows, meta = self.inbox.take(step, set(self.snapshots), self.procs) if self.inbox else ({}, {})
        if utils.world() > 1:  # torchrun: rank 0's rows and meta on every rank, as a payload (never pickled)
            rows, meta = decode(utils.broadcast_bytes(encode(rows, meta) if self.inbox else None))
        n, r = self.cfg.batch // utils.world(), utils.rank()  # this rank's rows: whole groups (see validate)
        batch = from_wire(rows, [tuple(t) for t in meta.pop("texts")]).select(slice(r * n, r * n + n))
        batch.group = torch.arange(n) // self.cfg.group_size  # [N]
        lag = step - batch.version.float()  # [N]
        self.last = {**meta, "staleness_mean": lag.mean().item(), "staleness_max": lag.max().item()}
        return batch

    @contextlib.contextmanager
    def weights(self, version: int):
        """The policy under the snapshot of `version`, and the live weights back afterwards."""
        if version != self.version:
            self.policy.load_trainable(self.snapshots[version])
        try:
            yield
        finally:
            if version != self.version:
                self.policy.load_trainable(self.snapshots[self.version])

    def publish(self, step: int) -> None:
        """Version `step`: the adapter encoded once for all workers; the payload's tensors (views, not
        copies, named as on the wire as workers load them) are also the snapshot that scores its rows."""
        t = time.perf_counter()
        payload = encode(self.policy.wire_state(), {"version": step, "adapter_config": self.config_json})
        self.snapshots = {v: s for v, s in self.snapshots.items() if v >= step - self.cfg.max_staleness}
        self.snapshots[step], self.version = decode(payload, own=True)[0], step
        if self.inbox:
            self.inbox.serve(step, payload, time.perf_counter() - t)

    def evaluate(self) -> dict:
        return self.local.evaluate()  # with the trainer's live weights, never a worker's

    eval_batch = property(lambda self: self.local.eval_batch)  # the rows of that evaluation

    def demonstrations(self, n: int) -> Batch:
        return self.local.demonstrations(n)  # the warm-start runs on the trainer

    def state(self) -> dict:  # position: where a --role sync resume draws problems no worker drew
        workers, counts = (self.inbox.next_worker, dict(self.inbox.totals())) if self.inbox else (0, {})
        return {"next_worker": workers, "position": workers * STRIDE} | ({"counts": counts} if counts else {})

    def load_state(self, state: dict) -> None:
        if self.inbox:  # after a sync run's checkpoint, workers draw past the problems it drew
            survivors = SURVIVORS if "next_worker" in state else 0  # theirs: counted live, never reissued
            self.inbox.restore(state.get("next_worker", -(-state.get("position", 0) // STRIDE)) + survivors)
            self.inbox.resumed = Counter(state.get("counts", {}))  # none in a sync run's or an older one's

    def close(self) -> None:
        """Tells every worker the run is over, then stops the local ones: no one takes the batch each is
        still generating, so the end of a run (a second Ctrl-C above all) need not wait for it."""
        if self.inbox:
            self.inbox.close()
        for p in self.procs:  # the whole session: a sandboxed tool's process, vLLM's engine
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)  # run_worker unwinds: its threads joined, its files removed
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)


# ---------------------------------------------------------------- the worker side
class AdapterFetcher(threading.Thread):
    """Long-polls GET /adapter in the background so the worker never waits for weights (the newest
    waits for `take`). Sets `done` once the trainer finished, or its polls failed for --worker-patience s.
    Told OTHER_RUN, says /hello again as `worker` and takes the new trainer's `run` (or stops, refused)."""

    def __init__(self, client: Client, cfg, worker: int, run: str):
        super().__init__(daemon=True)
        self.client, self.cfg, self.worker = client, cfg, worker
        self.nonce = run  # the trainer's Inbox.run (self.run is the thread's method)
        self.have, self.pending, self.lock, self.done = -1, None, threading.Lock(), threading.Event()
        self.rejected = 0  # corrupt payloads; the previous adapter stays in use
        self.error, self.causes = "", set()  # why no request will ever pass; why polls failed, each said once

    def run(self):
        heard, patience = time.time(), self.cfg.worker_patience  # heard: the last poll answered whole
        while not self.done.is_set():
            try:
                query = f"have={self.have}&worker={self.worker}&run={self.nonce}"
                status, body = self.client.get(f"/adapter?{query}")
                heard = time.time()  # no batch's answer, no cut adapter's headers: they made patience endless
                if status == OTHER_RUN:  # another trainer: a --resumed one takes it back (its v5 is not ours)
                    said = hello(self.client, self.cfg, self.worker)  # None: over; another run: ConfigError
                    status, self.nonce, self.have = (410, "", -1) if said is None else (status, said[1], -1)
                elif status == 200:
                    t = time.perf_counter()
                    tensors, meta = decode(body)
                    v, secs = meta.get("version"), time.perf_counter() - t  # v older: a --resumed trainer
                    if type(v) is not int or v < 0 or v == self.have:
                        raise PayloadError(f"version {v!r} is not newer than {self.have}")
                    with self.lock:  # with the run that sent it: the batches it samples carry that run
                        self.have, self.pending = v, (v, tensors, meta, body, secs, self.nonce)
                    continue
            except ServeError as e:
                status, cause = 0, type(e.__cause__).__name__
                if cause not in self.causes:  # once, not at each retry
                    self.causes.add(cause)
                    utils.stderr(f"worker {self.worker}: cannot fetch an adapter ({e}); polling again")
                if time.time() - heard > patience:
                    utils.stderr(f"worker {self.worker}: trainer unreachable for "
                                 f"{patience:.0f} s ({e}); exiting")
                    self.done.set()
            except PayloadError as e:
                self.rejected += 1
                utils.stderr(f"worker {self.worker}: adapter rejected, keeping version {self.have}: {e}")
            except utils.ConfigError as e:  # refused at /hello, or a reply over the client's cap (no trainer)
                status, self.error = 0, str(e)
            if status == 401:  # a trainer restarted with another token: no poll will ever pass
                self.error = (f"the trainer at {self.client.url} refuses this worker's NANORL_TOKEN (401); "
                              "restart the worker with the trainer's")
            if status == 410 or self.error:
                self.done.set()
            if status not in (204, 410):  # 503: crowded, ask again in 1-3 s, spread out; error: do not spin
                self.done.wait(random.uniform(0.5, 1.5) * LONG_POLL if status == 503 else 0.5)

    def take(self):
        with self.lock:
            new, self.pending = self.pending, None
        return new


def post(client: Client, path: str, body: bytes, gone) -> tuple[int, bytearray] | None:
    """POSTs until the trainer answers (429 and 503 mean: again shortly), or None once gone() says to stop.
    A batch whose reply was lost may have landed: its copy is safe to send, as the inbox takes a seq once."""
    while not gone():
        start = time.monotonic()
        with contextlib.suppress(ServeError):  # trainer unreachable: gone() says when that is final
            if (answer := client.post(path, body))[0] not in (429, 503):
                return answer
        # tries ~LONG_POLL apart, jittered: at once after a held 429 (full queue), 1-3 s after a quick refusal
        time.sleep(random.uniform(0.5, 1.5) * max(0.0, start + LONG_POLL - time.monotonic()))
    return None


def hello(client: Client, cfg, worker: int | None = None) -> tuple[int, str] | None:
    """Registers with the trainer (again, as `worker`): this worker's id and the trainer's run, or None
    when the run is already over."""
    said = {"fingerprint": fingerprint(cfg)} | ({} if worker is None else {"worker": worker})
    body, start = json.dumps(said).encode(), time.time()
    # patience runs out only while nothing answers: a 503 (the trainer loading its checkpoint) is an answer
    lost = lambda: time.time() - max(start, client.answered) > cfg.worker_patience
    if (answer := post(client, "/hello", body, lost)) is None:
        raise utils.ConfigError(f"no trainer answered at {cfg.trainer_url} for {cfg.worker_patience:.0f} s")
    status, reply = answer
    try:
        said = json.loads(reply)
        if status in (200, 410):  # 410: the run is already over
            return (said["worker"], said["run"]) if status == 200 else None
        why = said["error"]
    except (ValueError, KeyError, TypeError):  # e.g. another server on that port
        raise utils.ConfigError(f"{cfg.trainer_url} is no nanorl trainer: POST /hello got {status} "
                                f"{bytes(reply[:80])!r}; check --trainer-url") from None
    raise utils.ConfigError(f"the trainer refused this worker ({status}): {why}")


class _Sampler:
    """The policy the rollouts see: its tokenizer side, and the worker's generator (vLLM or HF) to sample."""

    def __init__(self, policy, gen, fetcher: AdapterFetcher):
        self.policy, self.gen, self.fetcher = policy, gen, fetcher
        self.generate = gen.generate  # the generator's own: LLMPolicy's and VLLMGenerator's agree
        self.version, self.apply_s, self.run = -1, 0.0, ""  # run: the trainer process that sent `version`

    def __getattr__(self, name):  # tokenizer, decode, encode_prompt, pad_id, use_template, ...
        return getattr(self.policy, name)

    def newest(self) -> bool:
        """Switches to the newest adapter fetched (waiting for the first); False once the run is over."""
        while (new := self.fetcher.take()) or self.version < 0:
            if new:
                t = time.perf_counter()
                try:
                    self.gen.load(*new[:4])
                    self.version, self.apply_s, self.run = new[0], new[4] + time.perf_counter() - t, new[5]
                except (ValueError, KeyError, OSError) as e:  # e.g. tensors for a different model
                    utils.stderr(f"worker {self.fetcher.worker}: cannot load adapter v{new[0]}, "
                                 f"keeping v{self.version}: {e}")
            elif self.fetcher.done.wait(0.05):
                return False
        return not self.fetcher.done.is_set()


def run_worker(cfg) -> int:
    """A rollout worker: the trainer's own batch source (rollouts.sources()) over a sampler that
    holds the newest adapter, one version per batch; POSTs each batch. Returns the exit code."""
    if trainer := os.environ.get("NANORL_TRAINER_PID"):  # started by --workers, not by hand: before the model
        utils.die_with_launcher(int(trainer), "worker")  # its pid, not LAUNCHER: an adopter if it is gone
    client = Client(cfg.trainer_url, timeout=30 + LONG_POLL, retries=1)
    if (said := hello(client, cfg)) is None:  # before loading a model: a mismatched worker fails in seconds
        return 0
    me, run = said
    policy = LLMPolicy(cfg)  # --vllm: its tokenizer side only; HF: it samples too, each version loaded in
    client.max_reply += sum(t.nbytes for t in policy.wire_state().values())  # a full-weight run's adapter
    torch.manual_seed(seed := cfg.seed * STRIDE + me)  # workers share cfg.seed, not their sampling noise
    gen = VLLMGenerator(policy.path, cfg, policy.eos_ids, seed) if cfg.vllm else policy
    fetcher = AdapterFetcher(client, cfg, me, run)
    fetcher.start()
    sampler = _Sampler(policy, gen, fetcher)
    source = sources()[cfg.task](cfg, sampler)  # every rollout option behaves as in a sync run
    source.load_state({"position": me * STRIDE})  # worker w draws problems w*STRIDE, w*STRIDE+1, ...
    utils.stderr(f"worker {me}: generating for {cfg.trainer_url} with {'vLLM' if cfg.vllm else 'HF'}")
    previous, refused, seq = signal.signal(signal.SIGTERM, utils.interrupt), 0, -1  # into this finally
    try:
        while sampler.newest():  # the newest adapter, waiting for the first
            seq += 1  # the inbox takes each seq once: a copy sent again (a reply lost) is not trained twice
            batch = source.next(sampler.version)  # --debug-samples: the trainer prints these rows' texts
            meta = {"worker": me, "run": sampler.run, "seq": seq, "apply_s": sampler.apply_s,
                    "texts": batch.texts, "metrics": source.last}
            answer = post(client, "/batch", encode(batch.wire(), meta), fetcher.done.is_set)
            if answer is None or answer[0] == 410:  # told to stop, or the run is over (410)
                break
            if answer[0] == 200:
                refused = 0
            elif (refused := refused + (answer[0] not in (409, OTHER_RUN))) < REFUSALS:  # see REFUSALS
                utils.stderr(f"worker {me}: batch refused ({answer[0]}): {bytes(answer[1][:300])!r}")
            else:  # the trainer cannot use what this worker makes: stop spending compute on it
                raise utils.ConfigError(f"worker {me}: {REFUSALS} batches in a row refused, the latest "
                                        f"({answer[0]}): {bytes(answer[1][:300])!r}; run the worker with the "
                                        "trainer's code, model files and NANORL_TOKEN")
    finally:  # a daemon thread still inside torch when the interpreter exits aborts it (SIGABRT, not 0)
        signal.signal(signal.SIGTERM, previous)
        fetcher.done.set()
        fetcher.join(client.timeout)
    if fetcher.error:
        raise utils.ConfigError(f"worker {me}: {fetcher.error}")
    return 0
