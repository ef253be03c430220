"""A rollout worker (serve.run_worker, in process) against a real trainer inbox on 127.0.0.1: it stops
in one line when no trainer answers, exits 0 from a finished run, goes on past an adapter it cannot
use or a batch the trainer refuses (until five in a row), and unwinds on SIGTERM; the trainer starts its
worker processes with its config and token, and stops them."""
import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

import serve
import tasks
import train
import transport
import utils
from model import LLMPolicy
from rawhttp import bare_peer
from rollouts import WIRE, from_wire, sources
from modeldir import build_tiny_model


def argv(model: str, *extra) -> list[str]:
    return ["--task", "arith", "--model", model, "--batch", "8", "--group-size", "4", "--max-new-tokens", "8",
            "--eval-size", "4", "--lora-rank", "8", "--no-progress", "--worker-patience", "8", *extra]


def until(cond, what: str, limit: float = 60.0):
    """Polls until cond() (a hang guard, not a timing assertion)."""
    deadline = time.time() + limit
    while not cond():
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def inbox(monkeypatch):
    """Opens an inbox as a trainer with the worker's flags does (so the fingerprints match), and puts
    its token in the environment, where the worker reads it. No model is loaded here."""
    boxes = []

    def open_inbox(model: str, vocab: int = 50, max_len: int = 64, *extra) -> serve.Inbox:
        keys = set(WIRE) | {"reward_int_correct"}  # an arith run's (serve.wire_keys)
        cfg = train.parse(argv(model, "--role", "trainer", *extra))
        boxes.append(serve.Inbox(cfg, vocab, 0, max_len, keys))
        boxes[-1].restore(0)  # a fresh run's ids
        monkeypatch.setenv("NANORL_TOKEN", boxes[-1].server.token)
        return boxes[-1]
    yield open_inbox
    for box in boxes:
        box.close()


def worker(box, model: str, *extra) -> int:
    return train.main(argv(model, "--role", "rollout", "--trainer-url", box.server.url, *extra))


def test_a_worker_that_reaches_no_trainer_stops_in_one_line_with_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("NANORL_TOKEN", "worker-test-token-0123456789")
    with socket.socket() as bound:  # bound, never listening: connections are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        rc = train.main(["--task", "arith", "--role", "rollout", "--trainer-url", url,
                         "--worker-patience", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (rc, err) == (2, [f"error: no trainer answered at {url} for 1 s"])


@pytest.mark.parametrize("status, body", [(200, b"<html>welcome</html>"), (404, b"Not Found"),
                                          (200, b'{"id": 3}'), (409, b"[1, 2]"),
                                          (502, b"<html>" + b"x" * 200 + b"</html>")])  # shown: 80 bytes
def test_a_worker_pointed_at_another_server_stops_in_one_line_naming_the_url(capsys, monkeypatch, status,
                                                                             body):
    """A port that answers HTTP, with the token, but is no nanorl trainer (its replies are not ours)."""
    token = "worker-test-token-0123456789"
    monkeypatch.setenv("NANORL_TOKEN", token)
    with transport.Server({("POST", "/hello"): lambda req: (status, body)}, token=token) as other:
        rc = train.main(["--task", "arith", "--role", "rollout", "--trainer-url", other.url])
    err = capsys.readouterr().err.strip().splitlines()
    assert (rc, err) == (2, [f"error: {other.url} is no nanorl trainer: POST /hello got {status} {body[:80]!r}; "
                             "check --trainer-url"])


def test_a_worker_pointed_at_a_peer_announcing_a_huge_reply_stops_in_one_line_not_out_of_memory(capsys,
                                                                                                 monkeypatch):
    """It allocated the 1e14 bytes announced, and said "out of memory; lower --micro-batch"."""
    monkeypatch.setenv("NANORL_TOKEN", "worker-test-token-0123456789")
    with bare_peer(b"HTTP/1.0 200 OK\r\nContent-Length: 100000000000000\r\n\r\n{}") as (url, seen):
        rc = train.main(["--task", "arith", "--role", "rollout", "--trainer-url", url])
    said = (f"error: POST {url}/hello: a reply of 100,000,000,000,000 bytes is over this client's cap of "
            f"1,073,741,824; {url} does not look like a nanorl trainer: check --trainer-url")
    assert (rc, capsys.readouterr().err.strip().splitlines(), len(seen)) == (2, [said], 1)  # not retried


def test_a_worker_whose_adapter_polls_keep_failing_says_why_once_and_leaves_after_its_patience(capsys):
    """Every adapter cut mid-body (a link too slow for it): the headers of each refreshed the patience, so
    the worker polled for ever, and said nothing."""
    cut = b"HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10
    with bare_peer(cut) as (url, seen):
        client = transport.Client(url, "worker-test-token-0123456789", retries=1)
        cfg = dataclasses.replace(train.parse(argv("unused")), worker_patience=1.0)
        fetcher = serve.AdapterFetcher(client, cfg, 0, "run0")
        fetcher.start()
        fetcher.join(10)  # a hang guard: polls every 0.5 s, for 1 s
        assert not fetcher.is_alive() and fetcher.done.is_set() and len(seen) >= 2  # retried, said once
    why = (f"GET {url}/adapter?have=-1&worker=0&run=run0 failed during the request after 1 tries: "
           "IncompleteRead: IncompleteRead(10 bytes read, 90 more expected); the reply was cut: a trainer "
           "gives one 30 s plus 1 s per 1 MiB to arrive, or it stopped")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"worker 0: cannot fetch an adapter ({why}); polling again",
                   f"worker 0: trainer unreachable for 1 s ({why}); exiting"]


def test_a_post_answered_429_or_503_is_sent_again_until_the_trainer_answers(monkeypatch):
    """429 (the queue is full) and 503 (the trainer loads its checkpoint) mean "again shortly": the
    batch is not dropped as refused. Once gone() says the run is over, post gives up (None)."""
    monkeypatch.setattr(serve, "LONG_POLL", 0.1)  # a refusal at once is sent again in 0.05-0.15 s, not 1-3 s
    token = "worker-test-token-0123456789"
    monkeypatch.setenv("NANORL_TOKEN", token)
    answers = [429, 503, 429, 200]
    with transport.Server({("POST", "/batch"): lambda req: (answers.pop(0), {"left": len(answers)})},
                          token=token) as trainer:
        client = transport.Client(trainer.url, retries=1)
        assert serve.post(client, "/batch", b"rows", gone=lambda: False) == (200, bytearray(b'{"left": 0}'))
        assert answers == [] and serve.post(client, "/batch", b"rows", gone=lambda: True) is None


def test_a_worker_that_joins_a_finished_run_exits_0_before_loading_its_model(inbox, capsys, monkeypatch):
    trainer_inbox = inbox("/no/such/model")
    monkeypatch.setattr(serve, "LONG_POLL", 60.0)  # close() now waits 121 s for worker 0 to hear it
    first = transport.Client(trainer_inbox.server.url, retries=1)
    assert serve.hello(first, train.parse(argv("/no/such/model"))) == (0, trainer_inbox.run)
    closing = threading.Thread(target=trainer_inbox.close)
    closing.start()
    until(lambda: trainer_inbox.finished, "close() to begin")
    assert worker(trainer_inbox, "/no/such/model") == 0  # its model does not exist: never loaded
    assert "error" not in capsys.readouterr().err and trainer_inbox.told == {1}
    assert first.get(f"/adapter?have=0&worker=0&run={trainer_inbox.run}")[0] == 410  # worker 0 hears it too
    closing.join(30)
    assert not closing.is_alive() and trainer_inbox.told == {0, 1}


@pytest.mark.parametrize("version", [-1, "0", None, True])
def test_an_adapter_whose_version_is_not_newer_is_rejected_and_the_old_one_kept(inbox, capsys, monkeypatch,
                                                                                version):
    trainer_inbox = inbox("unused")
    monkeypatch.setattr(serve, "LONG_POLL", 0.2)  # the fetcher's last long poll ends soon after it is done
    weights = {"w": torch.arange(4.0)}
    trainer_inbox.serve(0, transport.encode(weights, {} if version is None else {"version": version}), 0.0)
    client = transport.Client(trainer_inbox.server.url, retries=1)
    fetcher = serve.AdapterFetcher(client, trainer_inbox.cfg, 0, trainer_inbox.run)
    fetcher.start()
    try:
        until(lambda: fetcher.rejected >= 1, "a rejected adapter")
        assert (fetcher.take(), fetcher.have) == (None, -1)
        assert (f"worker 0: adapter rejected, keeping version -1: version {version!r} is not newer than -1"
                in capsys.readouterr().err)
        trainer_inbox.serve(1, transport.encode(weights, {"version": 1}), 0.0)
        until(lambda: fetcher.have == 1, "the good adapter")
        have, got, meta, _, _, run = fetcher.take()
        assert (have, got["w"].tolist(), meta) == (1, [0.0, 1.0, 2.0, 3.0], {"version": 1})
        assert run == trainer_inbox.run  # its batches say which trainer sent their weights
    finally:
        fetcher.done.set()
        fetcher.join(30)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("cache") / "tiny"), layers=2, hidden=128, heads=2,
                            intermediate=256)


@pytest.fixture(scope="module")
def adapter(tiny):
    """The tiny model's adapter as a trainer publishes it, and its vocabulary size."""
    policy = LLMPolicy(train.parse(argv(tiny)))
    return policy.wire_state(), policy.adapter_config(), policy.model.get_input_embeddings().num_embeddings


def publish(box, adapter, version: int, drop: int = 0):
    """Serves version `version` of the adapter, its first `drop` tensors left out (another model's)."""
    tensors = dict(sorted(adapter[0].items())[drop:])
    box.serve(version, transport.encode(tensors, {"version": version, "adapter_config": adapter[1]}), 0.0)


def fetcher() -> serve.AdapterFetcher | None:
    return next((t for t in threading.enumerate() if isinstance(t, serve.AdapterFetcher)), None)


def taken(fetcher, version: int) -> bool:
    """The worker's sampler took `version` from its fetcher (under the lock that sets both)."""
    if fetcher is None:
        return False
    with fetcher.lock:
        return fetcher.have == version and fetcher.pending is None


def test_a_worker_that_cannot_load_an_adapter_keeps_its_own_and_samples_with_the_next(tiny, adapter, inbox,
                                                                                      capsys, one_thread):
    box = inbox(tiny, vocab=adapter[2], max_len=1024)
    publish(box, adapter, 0, drop=1)

    def trainer():
        try:
            until(lambda: taken(fetcher(), 0), "the worker to take v0")
            publish(box, adapter, 1)
            until(lambda: box.counts["groups_received"], "a batch")
        finally:
            box.close()
    threading.Thread(target=trainer, daemon=True).start()
    assert worker(box, tiny) == 0
    err = capsys.readouterr().err
    assert err.count("worker 0: cannot load adapter v0, keeping v-1: trainable state does not match") == 1
    assert "Traceback" not in err and box.queue and all(g["version"].eq(1).all() for g, _ in box.queue)


def refusing(monkeypatch, why, ahead: int = 0):
    """The inbox refuses a well-formed batch n (1, 2, ...) for why(n), or takes it when that is None;
    batches 1..ahead carry a version past the published one, as if sampled for the run before a --resume."""
    real_check, seen = serve.Inbox.check, []

    def check(self, t, meta):
        seen.append(t)
        t["version"] += 9 * (len(seen) <= ahead)
        return real_check(self, t, meta) or why(len(seen))
    monkeypatch.setattr(serve.Inbox, "check", check)


def take_then_close(box, steps: int) -> None:
    """A trainer thread: `steps` steps take a batch each (room for the next), then the run ends."""
    def trainer():
        try:
            for _ in range(steps):
                box.take(0, {0})
        finally:
            box.close()
    threading.Thread(target=trainer, daemon=True).start()


def test_a_refused_batch_is_logged_and_the_worker_goes_on_until_five_in_a_row_stop_it_in_one_line(
        tiny, adapter, inbox, capsys, one_thread):
    """A refusal after a --resume is expected and passes; one the trainer repeats for every batch (another
    tokenizer, another code version, a new token) would have the worker generate for nobody for ever."""
    box = inbox(tiny, vocab=2, max_len=1024)  # every token id is out of range
    publish(box, adapter, 0)
    guard = threading.Timer(60, box.close)  # a hang guard: a worker that never stops ends with the run
    guard.start()
    rc = worker(box, tiny)  # the trainer stays open: the worker stops on its own
    guard.cancel()
    assert rc == 2
    err, why = capsys.readouterr().err, """(400): b'{"error": "token ids outside the vocabulary [0, 2)"}'"""
    assert err.count(f"worker 0: batch refused {why}") == 4 and box.counts["batches_rejected"] == 5
    assert err.endswith(f"error: worker 0: 5 batches in a row refused, the latest {why}; run the worker with "
                        "the trainer's code, model files and NANORL_TOKEN\n")
    assert "Traceback" not in err and box.queue == [] and fetcher() is None


def refused_run(monkeypatch, inbox, tiny, adapter, capsys, steps: int, why, ahead: int = 0):
    """A worker against a trainer that refuses for why(n) and takes `steps` batches: (rc, stderr, inbox)."""
    refusing(monkeypatch, why, ahead)
    box = inbox(tiny, vocab=adapter[2], max_len=1024)
    publish(box, adapter, 0)
    take_then_close(box, steps=steps)
    rc = worker(box, tiny)
    return rc, capsys.readouterr().err, box


def test_refusals_between_accepted_batches_never_stop_a_worker(tiny, adapter, inbox, capsys, one_thread,
                                                              monkeypatch):
    rc, err, box = refused_run(monkeypatch, inbox, tiny, adapter, capsys, steps=3,  # 4 refused, 1 taken, ...
                               why=lambda n: None if n % 5 == 0 else "refused on purpose")
    assert rc == 0
    assert err.count("batch refused (400)") == 12 and box.counts["batches_rejected"] == 12
    assert "in a row" not in err and "Traceback" not in err


def test_batches_sampled_ahead_of_a_resumed_trainer_are_refused_409_and_never_stop_a_worker(
        tiny, adapter, inbox, capsys, one_thread, monkeypatch):
    """A trainer resumed from an older checkpoint refuses the versions it lost until the worker has its
    weights; a fast worker may post many such batches first (CI: 5 before its fetcher had them)."""
    rc, err, box = refused_run(monkeypatch, inbox, tiny, adapter, capsys, steps=1, why=lambda n: None,
                               ahead=7)
    assert rc == 0
    assert err.count("""batch refused (409): b'{"error": "versions 9..9 outside the published 0..0"}'""") == 7
    assert box.counts["batches_rejected"] == 7
    assert "in a row" not in err and "Traceback" not in err


def test_a_worker_whose_batch_hears_the_run_is_over_stops_without_generating_another(tiny, adapter, inbox,
                                                                                    capsys, one_thread,
                                                                                    monkeypatch):
    """The trainer's 410 to a /batch ends the worker there, not at its fetcher's next poll (one more batch
    generated for nobody); a batch the trainer took is never logged as refused. /adapter stays silent (204)
    at the end here, so that only /batch says it, unless the worker posts past the end regardless."""
    real_adapter, real_receive, ended = serve.Inbox.adapter, serve.Inbox.receive, []
    monkeypatch.setattr(serve, "LONG_POLL", 60.0)  # the fixture's close() then waits for the worker to hear

    def silent_adapter(self, req):
        status, body = real_adapter(self, req)
        if status != 410 or len(ended) >= 3:  # 3 batches past the end: the worker did not stop, let it go
            return status, body
        time.sleep(0.05)
        return 204, None

    def receive(self, req):
        status, reply = real_receive(self, req)
        ended.extend([status] if status == 410 else [])
        return status, reply
    monkeypatch.setattr(serve.Inbox, "adapter", silent_adapter)  # before the inbox binds its routes
    monkeypatch.setattr(serve.Inbox, "receive", receive)
    box = inbox(tiny, vocab=adapter[2], max_len=1024)
    publish(box, adapter, 0)

    def trainer():
        try:
            until(lambda: box.counts["groups_received"], "a batch")
        finally:
            with box.cond:  # close()'s first half: the run is over (its second stops the server)
                box.finished = True
                box.cond.notify_all()
    threading.Thread(target=trainer, daemon=True).start()
    assert worker(box, tiny) == 0
    err = capsys.readouterr().err
    assert ended == [410] and box.counts["groups_received"] >= 2  # every batch before the end was taken
    assert "refused" not in err and "rejected" not in err and "Traceback" not in err  # a 204 is no adapter


def test_a_worker_whose_run_ends_before_its_first_adapter_exits_0_without_sampling(tiny, inbox, capsys,
                                                                                   one_thread, monkeypatch):
    """A worker waits for its first adapter before it samples; a run that ends first (a trainer stopped
    during its step-0 eval) must end that wait, not leave the worker waiting for ever, nor sampling a
    batch for nobody with the base model's weights."""
    box, gone, sampled = inbox(tiny), threading.Event(), []
    real_generate = LLMPolicy.generate
    monkeypatch.setattr(LLMPolicy, "generate",
                        lambda self, *a, **k: sampled.append(1) or real_generate(self, *a, **k))

    def trainer():
        until(lambda: box.next_worker == 1, "the worker's hello")
        box.close()  # no adapter was ever published
        if not gone.wait(30) and signal.getsignal(signal.SIGTERM) is signal.default_int_handler:
            os.kill(os.getpid(), signal.SIGTERM)  # a hang guard: the worker unwinds into exit 130
    threading.Thread(target=trainer, daemon=True).start()
    rc = worker(box, tiny)
    gone.set()
    err = capsys.readouterr().err  # told the run is over: not left to find the trainer gone (patience)
    assert rc == 0 and fetcher() is None and "unreachable" not in err and "Traceback" not in err
    assert sampled == []


def test_a_samplers_apply_time_is_the_adapters_decode_time_plus_its_load():
    """sync_apply_s (a duration, so bounds, not a value): the fetcher's decode time of the newest adapter
    plus the generator's load, no more than the switch took on top of the decode. A unit test of
    _Sampler.newest: the fetcher and the generator are stand-ins."""
    fetched = iter([(5, {}, {}, b"", 0.25, "r"), None])  # (version, tensors, meta, body, decode s, run)
    fetcher = types.SimpleNamespace(take=lambda: next(fetched), done=threading.Event(), worker=0)
    sampler = serve._Sampler(None, types.SimpleNamespace(load=lambda *a: time.sleep(0.01), generate=None), fetcher)
    t = time.perf_counter()
    assert sampler.newest() is True
    wall = time.perf_counter() - t
    assert sampler.version == 5 and 0.25 + 0.01 <= sampler.apply_s <= 0.25 + wall


def test_worker_w_of_a_run_with_seed_s_samples_from_seed_s_million_plus_w(tiny, inbox, monkeypatch,
                                                                           one_thread):
    """Workers share --seed but not their sampling noise, and a run with another --seed gets other noise."""
    monkeypatch.setattr(serve, "LONG_POLL", 0.2)  # close() waits for worker 0, which never asks again
    box = inbox(tiny, 50, 64, "--seed", "3")
    first = transport.Client(box.server.url, retries=1)
    assert serve.hello(first, train.parse(argv(tiny, "--seed", "3"))) == (0, box.run)

    def trainer():
        until(lambda: box.next_worker == 2, "the second worker's hello")
        box.close()  # no adapter ever: the worker stops waiting for one and exits 0
    threading.Thread(target=trainer, daemon=True).start()
    torch.manual_seed(0)
    assert worker(box, tiny, "--seed", "3") == 0 and torch.initial_seed() == 3 * serve.STRIDE + 1


def test_a_worker_whose_trainer_comes_back_with_another_token_stops_in_one_line(tiny, inbox, capsys,
                                                                                 one_thread):
    """A trainer killed and resumed under another NANORL_TOKEN: the worker's polls all get 401, each an
    answer, so its patience never runs out; waiting for its first adapter, it would wait for ever."""
    box, gone = inbox(tiny), threading.Event()

    def trainer():
        until(lambda: box.next_worker == 1, "the worker's hello")
        box.server.token = "another-token-0123456789"
        if not gone.wait(30) and signal.getsignal(signal.SIGTERM) is signal.default_int_handler:
            os.kill(os.getpid(), signal.SIGTERM)  # a hang guard: the worker unwinds into exit 130
    threading.Thread(target=trainer, daemon=True).start()
    rc = worker(box, tiny)
    gone.set()
    assert rc == 2
    err = capsys.readouterr().err
    assert err.endswith(f"error: worker 0: the trainer at {box.server.url} refuses this worker's "
                        "NANORL_TOKEN (401); restart the worker with the trainer's\n")
    assert "Traceback" not in err and fetcher() is None


def test_a_sigterm_unwinds_a_worker_mid_batch_into_exit_130_with_its_fetcher_joined(tiny, adapter, inbox,
                                                                                     capsys, one_thread):
    """SIGTERM (the trainer closing its --workers, a scheduler) killed a worker where it stood: exit -15,
    its fetcher thread and a vLLM worker's adapter files left to die with it. It now unwinds as Ctrl-C."""
    box = inbox(tiny, vocab=adapter[2], max_len=1024)
    publish(box, adapter, 0)
    before = signal.getsignal(signal.SIGTERM)

    def scheduler():
        try:
            until(lambda: box.counts["groups_received"], "a batch")  # the worker is in its loop
        finally:
            if signal.getsignal(signal.SIGTERM) is utils.interrupt:  # else this process would die
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                box.close()  # the run is over: 410, exit 0
    threading.Thread(target=scheduler, daemon=True).start()
    assert worker(box, tiny) == 130  # main(): a stop, as for Ctrl-C
    assert fetcher() is None and signal.getsignal(signal.SIGTERM) is before
    assert "Traceback" not in capsys.readouterr().err


def test_closing_the_trainer_stops_its_workers_sessions_and_kills_one_that_does_not_stop():
    """The batch a local worker is generating at the end has no taker: close() sends SIGTERM to each
    worker's session at once (it waited up to 60 s for the batch), then SIGKILL to one that ignores it."""
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); "
                "time.sleep(600)")
    source = serve.AsyncRollouts.__new__(serve.AsyncRollouts)
    source.inbox, source.procs = None, [Impatient(["true"]), Impatient(["sleep", "600"]),
                                        Impatient([sys.executable, "-c", stubborn], stdout=subprocess.PIPE)]
    try:
        source.procs[2].stdout.readline()  # its handler is set
        source.close()
        assert [p.wait(timeout=30) for p in source.procs] == [0, -signal.SIGTERM, -signal.SIGKILL]
    finally:
        for p in source.procs:
            p.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_only_a_worker_that_a_trainer_started_dies_with_it(monkeypatch):
    """A worker started by hand sets no death signal; one a trainer's --workers started (that trainer's pid
    in NANORL_TRAINER_PID) gets LAUNCHER_GONE when it dies, or, the trainer already dead, exits in a line."""
    monkeypatch.setattr(serve, "hello", lambda client, cfg: None)  # a finished run: it returns before loading
    monkeypatch.delenv("NANORL_TRAINER_PID", raising=False)
    monkeypatch.setenv("NANORL_TOKEN", "worker-test-token-0123456789")
    cfg = train.parse(argv("unused", "--role", "rollout", "--trainer-url", "http://127.0.0.1:5"))
    gone = subprocess.Popen(["true"])
    gone.wait()
    pending, got, before = ctypes.c_int(-1), [], signal.getsignal(utils.LAUNCHER_GONE)
    try:
        for trainer in (None, os.getppid(), gone.pid):  # by hand; our parent stands in for a trainer
            if trainer:
                monkeypatch.setenv("NANORL_TRAINER_PID", str(trainer))
            with pytest.raises(SystemExit) if trainer == gone.pid else contextlib.nullcontext() as died:
                assert serve.run_worker(cfg) == 0
            ctypes.CDLL(None).prctl(2, ctypes.byref(pending))  # 2: PR_GET_PDEATHSIG
            got.append(pending.value)
        with pytest.raises(KeyboardInterrupt):  # the first: a dead trainer's threads each send one
            utils.interrupt(utils.LAUNCHER_GONE, None)
        signal.getsignal(utils.LAUNCHER_GONE)(utils.LAUNCHER_GONE, None)  # one sent before: it cuts nothing
        ctypes.CDLL(None).prctl(2, ctypes.byref(pending))
        got.append(pending.value)
    finally:
        signal.signal(utils.LAUNCHER_GONE, before)
        utils.death_signal(0)
    assert got == [0, utils.LAUNCHER_GONE, utils.LAUNCHER_GONE, 0]  # and none is sent after
    assert str(died.value) == f"error: worker: its launcher (pid {gone.pid}) has exited; so does this worker"


class Impatient(subprocess.Popen):
    """A worker process as spawn_workers starts one (a session of its own), whose grace at close() is 2 s."""

    def __init__(self, argv, **kw):
        super().__init__(argv, start_new_session=True, **kw)

    def wait(self, timeout=None):
        return super().wait(timeout if timeout is None else min(timeout, 2.0))


def test_spawned_workers_get_the_run_config_by_pipe_the_token_and_no_torchrun_rank(tmp_path, monkeypatch):
    """--workers 2: each local worker is a process of its own session whose stdin is this run's config
    as a worker ("--config /dev/stdin"), with the environment less torchrun's rank variables (a worker
    is no rank) plus the token. The interpreter is stood in for by a script that records what it got."""
    record = tmp_path / "python"
    record.write_text('#!/bin/sh\nd="$(dirname "$0")/$$"; mkdir "$d"; echo "$@" > "$d/argv"; env > "$d/env"; '
                      'cat > "$d/config"; cut -d " " -f 6 /proc/$$/stat > "$d/sid"\n')
    record.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(record))
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "NANORL_TEST_KEPT": "yes", "NANORL_TOKEN": "the trainer's own"}.items():
        monkeypatch.setenv(name, value)
    cfg = train.parse(argv("tiny", "--role", "trainer", "--workers", "2", "--out", str(tmp_path / "run")))
    procs = serve.spawn_workers(cfg, "http://127.0.0.1:5", "t0ken")
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    runs = sorted(tmp_path.glob("[0-9]*"))
    assert sorted(int(d.name) for d in runs) == sorted(p.pid for p in procs)
    for d in runs:
        script, *flags = (d / "argv").read_text().split()
        assert script.endswith("/train.py") and flags == ["--config", "/dev/stdin"]
        env = dict(line.split("=", 1) for line in (d / "env").read_text().splitlines() if "=" in line)
        assert env["NANORL_TOKEN"] == "t0ken" and env["NANORL_TEST_KEPT"] == "yes"
        assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"} & env.keys()
        assert int((d / "sid").read_text()) == int(d.name)  # a session of its own: Ctrl-C is the trainer's
        got = train.parse(["--config", str(d / "config")])
        assert got == dataclasses.replace(cfg, role="rollout", trainer_url="http://127.0.0.1:5", workers=0,
                                          out="", resume="")


@pytest.mark.parametrize("extra, first, told", [
    ((), 64, ""),  # the trainer killed and --resumed: worker 0 of the run before goes on, as worker 0
    ((), 0, "the trainer refused this worker (409): worker id 0 was not issued by this run before its "
            "trainer restarted: restart the worker"),  # a fresh run, of the same config, started on its url
    (("--seed", "3"), 64, "the trainer refused this worker (409): worker and trainer disagree on seed "
                          "(trainer 3, worker 0): start the worker with the trainer's config"),  # another run
])
def test_a_worker_another_trainer_registered_says_hello_again_and_goes_on_only_in_its_own_run(
        inbox, monkeypatch, extra, first, told):
    """A worker's trainer killed, another run started on its url (another --task even): the worker went on
    fetching that run's adapters and posting its batches, which that run trained on."""
    monkeypatch.setattr(serve, "LONG_POLL", 0.2)
    box = inbox("unused", 50, 64, *extra)
    box.restore(first)
    box.serve(0, transport.encode({"w": torch.arange(4.0)}, {"version": 0}), 0.0)
    client = transport.Client(box.server.url, retries=1)
    fetcher = serve.AdapterFetcher(client, train.parse(argv("unused")), 0, "the-killed-trainers-run")
    fetcher.start()
    try:
        until(lambda: fetcher.have == 0 or fetcher.done.is_set(), "an adapter or a stop")
        stopped = (told, -1, True) if told else ("", 0, False)  # why, the adapter version, done
        assert (fetcher.error, fetcher.have, fetcher.done.is_set()) == stopped
        assert fetcher.nonce == ("the-killed-trainers-run" if told else box.run)
        assert box.counts["adapters_sent"] == (not told)
    finally:
        fetcher.done.set()
        fetcher.join(30)
    box.seen.clear()  # or close() waits for worker 0 to poll


@pytest.mark.parametrize("task", [("--judge-down", "drop"), ("--task", "countdown"),
                                  ("--task", "countdown_multiturn")])
def test_the_keys_a_trainer_expects_are_the_keys_its_workers_source_sends(tiny, task, one_thread):
    """The first batch a trainer took fixed its keys: one odd batch, and every honest worker was refused."""
    cfg = train.parse(argv(tiny, *task))
    local = sources()[cfg.task](cfg, LLMPolicy(cfg))
    assert set(local.next(0).wire()) == serve.wire_keys(cfg, local)


@pytest.mark.parametrize("extra, resumed", [(("--seed", "3"), False), ((), True)])
def test_a_worker_whose_trainer_is_replaced_on_its_url_goes_on_only_for_the_same_run_resumed(
        tiny, adapter, inbox, capsys, one_thread, monkeypatch, extra, resumed):
    """Trainer A killed, B started on its url: a run of another config took the worker's batches and
    trained on them; A --resumed must keep its workers, under their ids."""
    monkeypatch.setattr(serve, "LONG_POLL", 0.2)
    a, boxes = inbox(tiny, adapter[2], 1024), []
    publish(a, adapter, 0)

    def replace():  # the worker runs in the main thread (its SIGTERM handler), the trainers here
        until(lambda: a.counts["groups_received"], "a batch for trainer A")
        a.server.close()  # killed: its worker hears no "finished"
        boxes.append(b := inbox(tiny, adapter[2], 1024, "--trainer-url", a.server.url, *extra))  # A's token
        b.restore(serve.SURVIVORS if resumed else 0)  # a --resumed trainer's first new id; a fresh run's
        publish(b, adapter, 0)
        until(lambda: b.counts["groups_received"] or not resumed, "a batch for trainer B")
        boxes.append(threading.Timer(0 if resumed else 60, b.close))  # a hang guard: a worker never stopping
        boxes[-1].start()
    threading.Thread(target=replace, daemon=True).start()
    rc, err, (b, guard) = worker(a, tiny), capsys.readouterr().err, boxes
    guard.cancel()
    if resumed:
        assert rc == 0 and list(b.seqs) == [0] and b.next_worker == serve.SURVIVORS  # worker 0 still
    else:
        assert rc == 2 and err.endswith("error: worker 0: the trainer refused this worker (409): worker and "
                                        "trainer disagree on seed (trainer 3, worker 0): start the worker "
                                        "with the trainer's config\n")
        assert "groups_received" not in b.counts and b.counts["adapters_sent"] == 0 and b.queue == []
    assert "Traceback" not in err


def test_a_batch_sampled_with_a_killed_trainers_adapter_is_never_scored_as_its_resumed_trainers_version(
        tiny, adapter, inbox, capsys, one_thread, monkeypatch):
    """Trainer A killed while its worker sampled with A's v0; A --resumed (B) publishes a v0 of its own: the
    same number, other weights (a version past B's checkpoint, retrained). The worker had said hello to B
    meanwhile, so the batch went out under B's run and B took it as its v0: old_logp of weights that never
    sampled it. A batch now carries the run of the adapter that sampled it, and the worker takes B's v0
    although it had a v0 (B answered 204 for ever: same number)."""
    monkeypatch.setattr(serve, "LONG_POLL", 0.2)
    held, boxes = threading.Event(), []

    def gate(prompt, completion, answer):  # a slow reward (a judge, say): batch 2's waits for B's hello
        if boxes and boxes[0].counts["groups_received"]:
            held.wait(60)
        return 0.0
    monkeypatch.setattr(tasks.Arith, "rewards", tasks.Arith.rewards + [(gate, 0.0)])
    keys = set(WIRE) | {"reward_int_correct", "reward_gate"}
    boxes.append(a := inbox(tiny, adapter[2], 1024))
    a.keys, other = keys, {n: t + 0.05 for n, t in adapter[0].items()}  # B's v0: not A's
    publish(a, adapter, 0)

    def replace():
        until(lambda: a.counts["groups_received"], "a batch for trainer A")
        a.server.close()  # killed while the worker samples batch 2 with A's v0
        boxes.append(b := inbox(tiny, adapter[2], 1024, "--trainer-url", a.server.url))
        b.keys = keys
        b.restore(serve.SURVIVORS)  # --resumed: worker 0 keeps its id
        publish(b, (other, adapter[1]), 0)
        until(lambda: 0 in b.seen, "the worker's hello to B")
        held.set()
        until(lambda: b.counts["groups_received"], "a batch for trainer B")
        b.close()
    threading.Thread(target=replace, daemon=True).start()
    assert worker(a, tiny) == 0
    b, policy = boxes[1], LLMPolicy(train.parse(argv(tiny)))
    policy.load_trainable(other)
    for group, _ in b.queue:  # every row B took was sampled by B's v0: the sampler's logp is B's
        batch = from_wire(group, [("", "", "")] * len(group["tokens"]))
        with torch.no_grad():
            logp = policy.score(batch, slice(None))[0]
        assert (logp - batch.logp).abs().max() < 1e-4
    assert b.queue and "Traceback" not in capsys.readouterr().err
