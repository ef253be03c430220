"""What a client may POST to the trainer's inbox (serve.Inbox, behind a real HTTP server): every
batch the training loop cannot use gets a 4xx and is counted, and whatever was accepted collates."""
import dataclasses
import itertools
import json
import math
import socket
import subprocess
import threading
import time
import types

import pytest
import torch

import algos
import rollouts
import serve
import train
import utils
import transport
from model import LLMPolicy
from rollouts import WIRE
from transport import Request, encode

K, VOCAB, MAX_LEN = 4, 50, 64
KEYS = set(WIRE) | {"reward_int_correct"}  # an arith run's (serve.wire_keys)
SEQ = itertools.count()  # every batch posted here is a new one


@pytest.fixture
def inbox():
    cfg = utils.load_config(train.Config, ["--task", "arith", "--batch", "8", "--group-size", str(K), "--role",
                                           "trainer", "--max-staleness", "2"])
    box = serve.Inbox(cfg, VOCAB, 0, MAX_LEN, KEYS)
    box.restore(0)  # a fresh run's first worker id
    box.serve(0, bytearray(b"v0"), 0.0)
    yield box
    box.close()


def forge(groups: int = 1, length: int = 12, **extra) -> dict:
    """A batch every check passes (a 4-token prompt), for the cases below to break."""
    n = groups * K
    t = {"tokens": torch.ones(n, length, dtype=torch.int64), "attn": torch.ones(n, length),
         "mask": torch.cat([torch.zeros(n, 4), torch.ones(n, length - 4)], 1), "logp": torch.zeros(n, length),
         "rewards": torch.zeros(n, length), "truncated": torch.zeros(n, dtype=torch.bool),
         "group": torch.arange(n) // K, "version": torch.zeros(n, dtype=torch.int64), "reward_int_correct": torch.zeros(n)}
    return {k: v for k, v in {**t, **extra}.items() if v is not None}


def post(box, batch: dict, **meta):
    sent = {"worker": 0, "run": box.run, "seq": next(SEQ)}  # a new batch of worker 0, of this trainer's run
    return box.receive(Request("/batch", {}, encode(batch, sent | meta)))


MULTI = {"turns": torch.ones(K), "solved": torch.zeros(K), "solved_first_turn": torch.zeros(K)}


@pytest.mark.parametrize("name,batch", [
    ("turns without solved", forge(turns=torch.ones(K))),
    ("multi-turn stats but one", forge(**(MULTI | {"solved": None}))),
    ("reward keys unlike the run's", forge(reward_int_correct=None, reward_other=torch.zeros(K))),
    ("an extra reward key", forge(reward_other=torch.zeros(K))),
    ("multi-turn stats after single-turn batches", forge(**MULTI)),
    ("a sequence longer than the model's maximum", forge(length=MAX_LEN + 1)),
    ("more groups in one POST than the queue holds", forge(groups=3 * 2 + 1)),
    ("NaN in a reward stat", forge(reward_int_correct=torch.full((K,), math.nan))),
])
def test_a_batch_the_loop_cannot_use_gets_400_is_counted_and_the_queue_still_collates(inbox, name, batch):
    assert post(inbox, forge())[0] == 200
    status, reply = post(inbox, batch)
    assert status == 400 and inbox.counts["batches_rejected"] == 1, (name, reply)
    assert post(inbox, forge())[0] == 200
    rows, meta = inbox.take(0, {0})
    assert rows["tokens"].shape == (2 * K, 12) and meta["batches_rejected"] == 1


def test_a_multi_turn_run_takes_multi_turn_batches_alone(inbox):
    inbox.keys = set(WIRE) | set(MULTI) | {"reward_int_correct"}  # as forge() sends them
    assert post(inbox, forge())[0] == 400
    assert post(inbox, forge(**MULTI))[0] == 200
    assert post(inbox, forge(**MULTI))[0] == 200
    rows, _ = inbox.take(0, {0})
    assert set(MULTI) <= set(rows) and rows["turns"].shape == (2 * K,)


@pytest.mark.parametrize("apply_s", [1e400, -1e400, math.nan, 10**400, -1.0, "1", None])
def test_sync_times_that_are_not_times_are_ignored_and_the_batch_still_lands(inbox, apply_s):
    assert post(inbox, forge(), apply_s=apply_s, metrics={"gen_rounds": apply_s})[0] == 200
    assert post(inbox, forge(), apply_s=0.25)[0] == 200
    _, meta = inbox.take(0, {0})
    assert meta["sync_apply_s"] == 0.25 and math.isfinite(meta.get("gen_rounds", 0.0))


def test_a_step_without_batches_says_every_so_often_what_it_waits_for_then_takes_them(inbox, monkeypatch, capsys):
    monkeypatch.setattr(serve, "WAITING", 0.2)
    assert inbox.hello(Request("/hello", {}, encode_hello(inbox)))[0] == 200  # worker 0: live, sends nothing
    got = []
    taking = threading.Thread(target=lambda: got.append(inbox.take(2, {0})), daemon=True)  # a hang fails alone
    taking.start()
    time.sleep(1.0)  # about five waits of 0.2 s, each a line
    assert post(inbox, forge(groups=2))[0] == 200  # the step's 2 groups (batch 8, K 4)
    taking.join(10)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2 and set(lines) == {"step 2: waiting for batches (1 live workers)"}
    assert got[0][0]["tokens"].shape == (8, 12) and got[0][1]["live_workers"] == 1
    monkeypatch.setattr(serve, "HEARTBEAT", 0.0)  # or close() waits for worker 0, which never polls


def test_a_step_waiting_for_batches_says_how_many_were_refused_and_why(inbox, monkeypatch, capsys):
    """A worker whose every batch is refused (rows longer than the trainer takes, say) left the trainer
    saying only that it waited: the reason was in the worker's log, perhaps on another machine."""
    monkeypatch.setattr(serve, "WAITING", 0.2)
    assert [post(inbox, forge(length=MAX_LEN + 1))[0] for _ in range(2)] == [400, 400]
    taking = threading.Thread(target=lambda: inbox.take(2, {0}), daemon=True)
    taking.start()
    time.sleep(0.5)
    assert post(inbox, forge(groups=2))[0] == 200
    taking.join(10)
    assert set(capsys.readouterr().err.splitlines()) == {
        "step 2: waiting for batches (0 live workers; 2 batches refused, the latest: 4 rows of 65 tokens; at most "
        "2 groups of 4 rows, 64 long)"}


def test_liveness_counts_only_worker_ids_the_trainer_issued(inbox):
    assert inbox.hello(Request("/hello", {}, encode_hello(inbox)))[0] == 200  # issues worker 0
    for spoofed in (1, 7, 10**9, -1, "0", None):
        post(inbox, forge(), worker=spoofed)
    assert inbox.live() == {0}


@pytest.mark.parametrize("body", [b"", b"\xff\xfe", b"[]", b'{"fingerprint": "abc"}', b"[" * 100_000 + b"]" * 100_000,
                                  b'{"fingerprint": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_hello_that_is_not_a_fingerprint_gets_400_and_no_worker_id(inbox, body):
    assert inbox.hello(Request("/hello", {}, body)) == (400, {"error": 'POST /hello needs JSON {"fingerprint": {...}}'})
    assert inbox.next_worker == 0  # nested past Python's stack it was a 500 and a logged traceback


def encode_hello(inbox) -> bytes:
    return json.dumps({"fingerprint": serve.fingerprint(inbox.cfg)}).encode()


def one_line_error(capsys, argv) -> str:
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and not any("Traceback" in line for line in err), err
    return err[-1]


@pytest.mark.parametrize("token, url, fix", [("short-token", "", "at least 16 printable ASCII characters without spaces (got 11)"),
                                             (None, "http://0.0.0.0:0", "refusing to serve on '0.0.0.0' without a token")])
def test_a_trainer_that_would_serve_unsafely_stops_in_one_line(capsys, monkeypatch, tmp_path, token, url, fix):
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    monkeypatch.setattr(train, "LLMPolicy", lambda *a, **kw: pytest.fail("a model loaded first"))  # minutes
    if token:
        monkeypatch.setenv("NANORL_TOKEN", token)
    argv = ["--task", "arith", "--model", "tiny", "--no-progress", "--role", "trainer", "--steps", "1",
            "--out", str(tmp_path / "r"), *(["--trainer-url", url] if url else [])]
    assert fix in one_line_error(capsys, argv)


@pytest.mark.parametrize("token, fix", [(None, "no token: set NANORL_TOKEN to the trainer's (a trainer started without one takes only its own --workers"), ("short", "at least 16 printable")])
def test_a_worker_without_a_usable_token_stops_in_one_line(capsys, monkeypatch, token, fix):
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("NANORL_TOKEN", token)
    argv = ["--task", "arith", "--model", "tiny", "--role", "rollout", "--trainer-url", "http://127.0.0.1:9"]
    assert fix in one_line_error(capsys, argv)


def test_python_tool_without_an_isolating_sandbox_stops_in_one_line(capsys, monkeypatch, tmp_path):
    import sandbox

    def unavailable(mode):
        raise sandbox.SandboxUnavailable("sandbox: cannot isolate model code here (...); or pass --sandbox weak")

    monkeypatch.setattr(sandbox, "sandbox_plan", unavailable)
    err = one_line_error(capsys, ["--task", "python_tool", "--model", "tiny", "--no-progress", "--steps", "1",
                                  "--out", str(tmp_path / "r")])
    assert "--sandbox weak" in err


def test_a_group_no_judge_scored_lands_with_nan_reward_parts_only_on_its_own_rows(inbox):
    """--judge-down drop: the worker masks an unscored group out and marks it; its reward parts are
    NaN (logged by nanmean). NaN on a scored row, or inf anywhere, is still refused."""
    nan, marked = torch.full((K,), math.nan), torch.ones(K)
    inbox.keys = KEYS | {"judge_dropped_frac"}  # a --judge-down drop run's (serve.wire_keys)
    assert post(inbox, forge(reward_int_correct=nan, judge_dropped_frac=marked))[0] == 200
    assert post(inbox, forge(reward_int_correct=nan, judge_dropped_frac=torch.zeros(K)))[0] == 400
    assert post(inbox, forge(reward_int_correct=torch.full((K,), math.inf), judge_dropped_frac=marked))[0] == 400
    assert post(inbox, forge(judge_dropped_frac=torch.zeros(K)))[0] == 200
    rows, _ = inbox.take(0, {0})
    assert rows["reward_int_correct"].isnan().tolist() == [True] * K + [False] * K


def client(inbox) -> transport.Client:
    return transport.Client(inbox.server.url, token=inbox.server.token, retries=1)


@pytest.fixture
def parsed():
    """An inbox whose config came from the command line, as a trainer's does (task defaults applied)."""
    box = serve.Inbox(train.parse(["--task", "arith", "--role", "trainer"]), VOCAB, 0, MAX_LEN, KEYS)
    box.restore(0)
    box.serve(0, bytearray(b"v0"), 0.0)
    yield box
    box.close()


def test_a_worker_with_another_config_is_refused_at_hello_in_one_line_naming_the_fields(capsys, monkeypatch,
                                                                                       parsed):
    monkeypatch.setenv("NANORL_TOKEN", parsed.server.token)
    argv = ["--task", "arith", "--role", "rollout", "--trainer-url", parsed.server.url, "--seed", "1",
            "--eval-size", "5"]
    assert one_line_error(capsys, argv) == (
        "error: the trainer refused this worker (409): worker and trainer disagree on seed (trainer 0, "
        "worker 1); eval_size (trainer 100, worker 5): start the worker with the trainer's config")
    assert parsed.next_worker == 0 and parsed.live() == set()  # no id issued, nothing counted live
    same = train.parse(argv[:-4])  # the trainer's own config: welcome, as worker 0
    assert serve.hello(transport.Client(parsed.server.url, retries=1), same) == (0, parsed.run)
    assert parsed.next_worker == 1
    monkeypatch.setattr(serve, "HEARTBEAT", 0.0)  # or close() waits for worker 0, which never polls


def test_a_multiturn_worker_whose_episodes_end_elsewhere_is_refused_at_hello():
    """A worker's episodes longer than the trainer's --max-len would be refused batch after batch."""
    cfg = train.parse(["--task", "countdown", "--role", "trainer"])
    box = serve.Inbox(cfg, VOCAB, 0, MAX_LEN, KEYS)
    try:
        box.restore(0)
        theirs = serve.fingerprint(dataclasses.replace(cfg, max_len=4096, max_turns=2))
        status, body = box.hello(Request("/hello", {}, json.dumps({"fingerprint": theirs}).encode()))
        assert (status, body["error"].split(": start")[0]) == (409, "worker and trainer disagree on max_turns "
                                                                   "(trainer 4, worker 2); max_len (trainer 2048, worker 4096)")
    finally:
        box.close()


@pytest.mark.parametrize("query", ["", "?have=0", "?worker=0", "?have=&worker=0", "?have=x&worker=0",
                                   "?have=0&worker=1.5", "?have=0x1&worker=0", "?have=1234567890123&worker=0",
                                   "?have=0&worker=--1"])
def test_an_adapter_poll_without_a_version_and_worker_id_gets_400_and_no_adapter(inbox, query):
    status, body = client(inbox).get(f"/adapter{query}")
    assert (status, json.loads(body)) == (400, {"error": "GET /adapter needs ?have=VERSION&worker=ID"})
    assert inbox.counts["adapters_sent"] == 0 and inbox.server.counts["http_400"] == 1
    assert client(inbox).get(f"/adapter?have=-1&worker=0&run={inbox.run}") == (200, b"v0")  # well-formed


TEXTS = "meta texts must be one [prompt, completion, answer] of strings per row"


@pytest.mark.parametrize("batch, texts, why", [
    (forge(tokens=torch.ones(K, dtype=torch.int64)), None, "tokens must be [N, L]"),
    (forge(tokens=torch.ones(K, 12, 1, dtype=torch.int64)), None, "tokens must be [N, L]"),
    (forge(tokens=torch.ones(K, 12)), None, "tokens is torch.float32 [4, 12]; expected torch.int64 [4, 12]"),
    (forge(logp=torch.zeros(K, 11)), None, "logp is torch.float32 [4, 11]; expected torch.float32 [4, 12]"),
    # the wrong dtype on a field that sorts first ("attn") was a 500 and a traceback, on a later one the
    # message named the shape of the field before it
    (forge(attn=torch.ones(K, 12, dtype=torch.int64)), None,
     "attn is torch.int64 [4, 12]; expected torch.float32 [4, 12]"),
    (forge(truncated=torch.zeros(K, dtype=torch.int64)), None,
     "truncated is torch.int64 [4]; expected torch.bool [4]"),
    (forge(reward_int_correct=torch.zeros(K, 1)), None,
     "reward_int_correct is torch.float32 [4, 1]; expected torch.float32 [4]"),
    (forge(), "abc", TEXTS),
    (forge(), [["p", "c", "a"]] * (K - 1), TEXTS),  # a row short
    (forge(), [["p", "c"]] * K, TEXTS),
    (forge(), [["p", "c", 7]] * K, TEXTS),
    (forge(), ["pca"] * K, TEXTS),
])
def test_a_malformed_field_is_refused_naming_it_and_nothing_is_queued(inbox, batch, texts, why):
    meta = {"worker": 0, "run": inbox.run, "seq": 0}
    status, reply = client(inbox).post("/batch", encode(batch, meta | {"texts": texts}))
    assert (status, json.loads(reply)) == (400, {"error": why}) and inbox.counts["batches_rejected"] == 1
    assert inbox.queue == []
    rows = [["p", "c", "a"]] * 2 * K  # the step's two groups, well-formed
    assert client(inbox).post("/batch", encode(forge(groups=2), meta | {"texts": rows}))[0] == 200
    assert inbox.take(0, {0})[1]["texts"] == rows


def test_a_batch_from_a_worker_told_finished_gets_410_and_close_stops_waiting_for_it(inbox, monkeypatch):
    monkeypatch.setattr(serve, "LONG_POLL", 60.0)  # close() now waits 121 s for a live worker never told
    me = client(inbox)
    assert json.loads(me.post("/hello", encode_hello(inbox))[1]) == {"worker": 0, "run": inbox.run}
    closing = threading.Thread(target=inbox.close)
    closing.start()
    while not inbox.finished:  # close() has begun waiting for worker 0 to hear it
        time.sleep(0.01)
    status, reply = me.post("/batch", encode(forge(), {"worker": 0, "run": inbox.run, "seq": 0}))
    assert (status, json.loads(reply), inbox.told) == (410, {"finished": True}, {0})
    closing.join(30)  # a hang guard: told, worker 0 no longer holds close() for 121 s
    assert not closing.is_alive() and inbox.queue == [] and "groups_received" not in inbox.counts


def test_a_fresh_group_of_a_version_without_a_snapshot_is_dropped_and_counted(inbox):
    """A trainer resumed at step 1 holds the snapshot of version 1 alone, while a worker of the run
    before still sends version 0: within max_staleness, yet no snapshot holds the weights that sampled it."""
    v1 = forge(version=torch.ones(K, dtype=torch.int64))
    assert post(inbox, forge())[0] == 200
    inbox.serve(1, bytearray(b"v1"), 0.0)
    assert post(inbox, v1)[0] == 200  # the queue (2 groups) is full
    taken = []
    taking = threading.Thread(target=lambda: taken.append(inbox.take(1, {1})))
    taking.start()
    for _ in range(20):  # 429 only if the queue had not drained within LONG_POLL
        if post(inbox, v1)[0] != 429:
            break
    taking.join(30)
    rows, meta = taken[0]
    assert rows["version"].tolist() == [1] * 2 * K
    assert (meta["dropped_no_snapshot"], meta["dropped_stale"]) == (1, 0)


def test_inbox_refusals_name_the_first_rule_a_batch_breaks_one_past_each_limit(inbox):
    """Each batch breaks one rule by the smallest step; the same batch one step inside is accepted."""
    def edited(**fields):  # forge() with some rows' values changed: a 1 on row 0, column 5 by default
        t = forge()
        for name, (value, where) in fields.items():
            t[name][where] = value
        return t
    ids = "token ids outside the vocabulary [0, 50)"
    masks = "mask and attn must be 0/1, mask inside attn and 0 in column 0"
    refused = [
        (forge(mask=None), "batch keys: missing ['mask'], unexpected []"),
        (forge(note=torch.zeros(K)), "batch keys: missing [], unexpected ['note']"),
        (forge(group=torch.tensor([0, 0, 0, 1])), "every group needs exactly group_size=4 rows"),
        ({k: v[:0] for k, v in forge().items()}, "every group needs exactly group_size=4 rows"),  # N == 0
        (edited(tokens=(VOCAB, (0, 5))), ids), (edited(tokens=(-1, (3, 11))), ids),
        (edited(version=(-1, 0)), "versions start at 0 (got -1)"),
        (edited(mask=(0.5, (0, 5))), masks), (edited(attn=(2.0, (0, 5))), masks),
        (edited(attn=(0.0, (0, 5))), masks), (edited(mask=(1.0, (0, 0)), attn=(1.0, (0, 0))), masks),
    ]
    for batch, why in refused:
        assert post(inbox, batch) == (400, {"error": why})
    # a version past the published one is a worker ahead of a resumed trainer: 409, its next batch will do
    assert post(inbox, edited(version=(1, 2))) == (409, {"error": "versions 0..1 outside the published 0..0"})
    # ahead and malformed: 400, since no batch with newer weights mends a mask
    assert post(inbox, edited(version=(1, 2), mask=(0.5, (0, 5)))) == (400, {"error": masks})
    assert inbox.counts["batches_rejected"] == len(refused) + 2 and inbox.queue == []
    inside = edited(tokens=(VOCAB - 1, (0, 5)), mask=(0.0, (0, 5)), attn=(0.0, (0, 5)))  # a hole: 0 in both
    inside["tokens"][1, 5] = 0
    assert post(inbox, inside) == (200, {"queued": 1, "dropped": 0})
    assert post(inbox, forge(length=MAX_LEN, version=torch.zeros(K, dtype=torch.int64)))[0] == 200
    with_other_keys = forge(reward_int_correct=None, reward_other=torch.zeros(K))
    assert post(inbox, with_other_keys)[1]["error"] == (
        "batch keys: missing ['reward_int_correct'], unexpected ['reward_other']")


def drained(box, seconds: float = 10.0) -> bool:
    """Whether a step waiting in take() has emptied the queue within `seconds` (a hang fails, not waits)."""
    deadline = time.time() + seconds
    while box.queue and time.time() < deadline:
        time.sleep(0.01)
    return not box.queue


def test_a_group_may_lag_max_staleness_versions_when_it_arrives_and_when_it_is_taken(inbox):
    """max_staleness 2: a group of version v is used at step v + 2 and dropped (counted) at v + 3, both
    when it is received and when a step takes it. Each step takes batch / group_size = 2 groups."""
    inbox.serve(2, bytearray(b"v2"), 0.0)
    assert post(inbox, forge()) == (200, {"queued": 1, "dropped": 0})  # lags 2
    inbox.serve(3, bytearray(b"v3"), 0.0)
    assert post(inbox, forge()) == (200, {"queued": 0, "dropped": 1})  # lags 3
    assert post(inbox, forge(version=torch.full((K,), 3))) == (200, {"queued": 1, "dropped": 0})
    taken = []
    taking = threading.Thread(target=lambda: taken.append(inbox.take(3, {0, 2, 3})), daemon=True)
    taking.start()  # version 0 now lags 3: dropped; the step waits for a second group
    assert drained(inbox)
    assert post(inbox, forge(version=torch.full((K,), 2))) == (200, {"queued": 1, "dropped": 0})
    taking.join(10)
    rows, meta = taken[0]
    assert rows["version"].tolist() == [2] * K + [3] * K  # sorted by version
    assert (meta["dropped_stale"], meta["groups_received"], meta["sync_apply_s"]) == (2, 4, 0.0)


def test_a_step_takes_only_the_groups_it_lacks_and_leaves_the_rest_queued(inbox):
    assert post(inbox, forge())[0] == 200
    taken = []
    taking = threading.Thread(target=lambda: taken.append(inbox.take(0, {0})), daemon=True)
    taking.start()  # takes the one group, waits for one more
    assert drained(inbox)
    assert post(inbox, forge(groups=2))[0] == 200
    taking.join(10)
    assert taken[0][0]["tokens"].shape == (2 * K, 12) and len(inbox.queue) == 1


@pytest.mark.parametrize("first, second, median", [(0.0, 0.5, 0.25), (3600.0, 0.5, 0.5),
                                                   (3599.5, 0.5, 1800.0)])
def test_sync_times_from_0_up_to_an_hour_are_kept(inbox, first, second, median):
    assert post(inbox, forge(), apply_s=first)[0] == post(inbox, forge(), apply_s=second)[0] == 200
    assert inbox.take(0, {0})[1]["sync_apply_s"] == median


def test_worker_metrics_of_1e12_or_more_are_dropped_and_the_rest_averaged(inbox):
    assert post(inbox, forge(), metrics={"gen_rounds": 1e12, "gen_frac_zero_std": 1e12 - 1})[0] == 200
    assert post(inbox, forge(), metrics={"gen_rounds": 2, "gen_frac_zero_std": 0.5})[0] == 200
    meta = inbox.take(0, {0})[1]
    assert (meta["gen_rounds"], meta["gen_frac_zero_std"]) == (2.0, (1e12 - 1 + 0.5) / 2)


def test_a_full_queue_answers_429_and_a_post_waiting_for_room_hears_410_when_the_run_ends(inbox, monkeypatch):
    monkeypatch.setattr(serve, "LONG_POLL", 0.2)
    assert post(inbox, forge(groups=2))[0] == 200  # capacity: (max_staleness - 1) * 2 groups
    assert post(inbox, forge()) == (429, {"error": "queue full (2 groups); retry shortly"})
    monkeypatch.setattr(serve, "LONG_POLL", 30.0)
    replies = []
    waiting = threading.Thread(target=lambda: replies.append(post(inbox, forge())), daemon=True)
    waiting.start()
    time.sleep(0.3)  # inside its wait for room
    inbox.close()
    waiting.join(10)
    assert replies == [(410, {"finished": True})] and inbox.counts["groups_received"] == 2


def test_adapter_polls_get_the_newest_version_once_then_204_and_410_after_the_run(inbox, monkeypatch):
    monkeypatch.setattr(serve, "LONG_POLL", 0.1)
    query = lambda have: {"have": str(have), "worker": "0", "run": inbox.run}
    poll = lambda have: inbox.adapter(Request("/adapter", query(have), b""))
    assert poll(-1) == (200, b"v0") and poll(0) == (204, None)
    assert poll(5) == (200, b"v0")  # a worker ahead of a resumed trainer takes its weights
    assert inbox.counts["adapters_sent"] == 2
    inbox.close()
    assert poll(0) == poll(-1) == (410, {"finished": True})


def test_hello_waits_for_the_checkpoint_then_issues_ids_from_it_and_410_after_the_run(monkeypatch):
    monkeypatch.setattr(serve, "LONG_POLL", 0.1)
    cfg = utils.load_config(train.Config, ["--task", "arith", "--role", "trainer"])
    box = serve.Inbox(cfg, VOCAB, 0, MAX_LEN, KEYS)
    hello = lambda: box.hello(Request("/hello", {}, encode_hello(box)))
    try:
        assert hello() == (503, {"error": "the trainer is loading its checkpoint; ask again shortly"})
        box.restore(64)
        assert hello() == (200, {"worker": 64, "run": box.run})
        assert hello() == (200, {"worker": 65, "run": box.run})
        monkeypatch.setattr(serve, "HEARTBEAT", 0.0)  # or close() waits for them to poll
    finally:
        box.close()
    assert hello() == (410, {"finished": True}) and box.next_worker == 67


@pytest.mark.parametrize("host, cause, fix", [
    ("127.0.0.1", "Address already in use", "pick another port, or stop the process that holds it"),
    ("192.0.2.1", "Cannot assign requested address", "give this machine's host name or address (0.0.0.0: all of them)"),
])
def test_a_trainer_that_cannot_listen_at_its_url_stops_in_one_line_naming_it_and_the_fix(capsys, monkeypatch, tmp_path,
                                                                                        host, cause, fix):
    """A port another process holds, or an address of another machine (192.0.2.1: documentation's, no
    one's), was a 20-line OSError traceback out of the server's bind."""
    monkeypatch.setenv("NANORL_TOKEN", "inbox-test-token-0123456789")  # 192.0.2.1 is not loopback
    monkeypatch.setattr(train, "build", lambda cfg: serve.Inbox(cfg, VOCAB, 0, MAX_LEN, KEYS))  # no model
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        url = f"http://{host}:{held.getsockname()[1]}"
        argv = ["--task", "arith", "--no-progress", "--role", "trainer", "--steps", "1", "--out", str(tmp_path / "r"),
                "--trainer-url", url]
        assert one_line_error(capsys, argv) == f"error: --trainer-url {url}: cannot listen there ({cause}); {fix}"


def test_a_trainer_on_every_interface_tells_workers_its_host_name_not_0_0_0_0(capsys, monkeypatch):
    monkeypatch.setenv("NANORL_TOKEN", "inbox-test-token-0123456789")
    cfg = utils.load_config(train.Config, ["--task", "arith", "--role", "trainer", "--trainer-url", "http://0.0.0.0:0"])
    box = serve.Inbox(cfg, VOCAB, 0, MAX_LEN, KEYS)
    try:
        port = box.server.server_address[1]
        assert capsys.readouterr().err == (f"trainer listening on http://0.0.0.0:{port}; start workers with --role "
                                           f"rollout --trainer-url http://{socket.gethostname()}:{port} and the same "
                                           "NANORL_TOKEN\n")
    finally:
        box.close()


def test_a_batch_ahead_of_a_trainer_that_has_published_nothing_gets_409_saying_so():
    """A worker that outlived its trainer may post before the resumed one publishes ("outside 0..-1")."""
    cfg = utils.load_config(train.Config, ["--task", "arith", "--batch", "8", "--group-size", str(K), "--role", "trainer"])
    box = serve.Inbox(cfg, VOCAB, 0, MAX_LEN, KEYS)
    try:
        box.restore(0)
        assert post(box, forge()) == (409, {"error": "versions 0..0, but this trainer has published none yet"})
    finally:
        box.close()


@pytest.mark.parametrize("field, theirs, told", [
    ("batch", 32, "batch (trainer 8, worker 32)"),
    ("dynamic_sampling", True, "dynamic_sampling (trainer False, worker True)"),
    ("max_gen_batches", 2, "max_gen_batches (trainer 3, worker 2)"),
    ("prompt_reweight", 0.5, "prompt_reweight (trainer 0.0, worker 0.5)"),
    ("judge_down", "drop", "judge_down (trainer 'fail', worker 'drop')"),
    ("sandbox", "weak", "sandbox (trainer 'strict', worker 'weak')"),
])
def test_a_worker_whose_own_source_would_send_other_batches_is_refused_at_hello_naming_the_option(inbox, field, theirs,
                                                                                                 told):
    """Another --batch was welcomed, then had every batch refused (400) until the worker stopped naming the
    wrong fix (code, model files, token); other rollout options (--dynamic-sampling, ...) were silently the
    worker's own, whatever the trainer's config.yaml said."""
    theirs = serve.fingerprint(dataclasses.replace(inbox.cfg, **{field: theirs}))
    assert inbox.hello(Request("/hello", {}, json.dumps({"fingerprint": theirs}).encode())) == (
        409, {"error": f"worker and trainer disagree on {told}: start the worker with the trainer's config"})
    assert inbox.next_worker == 0


@pytest.mark.parametrize("theirs, shown", [(2, "2"), (None, "None")])
def test_a_worker_of_another_protocol_is_refused_at_hello_naming_the_version_not_the_config(inbox, theirs, shown):
    """A worker of another nanorl whose options all agree would be welcomed, then have batches of other keys
    refused until it stopped naming code, model files and token. Its protocol (None: a key it lacks) says so."""
    said = serve.fingerprint(inbox.cfg) | {"protocol": theirs}
    if theirs is None:
        del said["protocol"]
    assert serve.PROTOCOL == 1 and inbox.hello(Request("/hello", {}, json.dumps({"fingerprint": said}).encode())) == (
        409, {"error": f"worker and trainer disagree on protocol (trainer 1, worker {shown}): start the worker "
                       "with the trainer's nanorl version (another protocol)"})
    assert inbox.next_worker == 0


def test_a_worker_with_another_batch_stops_at_hello_in_one_line_naming_it(capsys, monkeypatch, parsed):
    monkeypatch.setenv("NANORL_TOKEN", parsed.server.token)
    monkeypatch.setattr(serve, "LLMPolicy", lambda cfg: pytest.fail("the worker was admitted"))  # (not a hang)
    argv = ["--task", "arith", "--role", "rollout", "--trainer-url", parsed.server.url, "--batch", "32"]
    assert one_line_error(capsys, argv) == (
        "error: the trainer refused this worker (409): worker and trainer disagree on batch (trainer 64, "
        "worker 32): start the worker with the trainer's config")


@pytest.mark.parametrize("token, alive", [(None, 0), ("inbox-test-token-0123456789", 0), (None, 1)])
def test_a_step_waiting_on_dead_workers_says_each_once_and_stops_when_no_other_can_join(monkeypatch, capsys, token,
                                                                                       alive):
    """A trainer whose --workers had all died (kill -9) waited for ever, "0 live workers" once a minute.
    Without NANORL_TOKEN no other worker can join: it stops. With one, or a worker left, it waits on."""
    monkeypatch.setattr(serve, "WAITING", 0.05)
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("NANORL_TOKEN", token)
    box = serve.Inbox(utils.load_config(train.Config, ["--task", "arith", "--batch", "8", "--group-size", str(K),
                                                      "--role", "trainer"]), VOCAB, 0, MAX_LEN, KEYS)
    procs = [subprocess.Popen(["sh", "-c", "kill -9 $$"]), subprocess.Popen(["sh", "-c", "exit 3"])]
    for p in procs:
        p.wait()
    procs += [subprocess.Popen(["sleep", "60"]) for _ in range(alive)]
    said = [f"worker process {procs[0].pid} exited with code -9", f"worker process {procs[1].pid} exited with code 3"]
    try:
        box.restore(0)
        box.serve(0, bytearray(b"v0"), 0.0)
        capsys.readouterr()  # the trainer's url
        if not token and not alive:
            with pytest.raises(utils.ConfigError) as stopped:
                box.take(0, {0}, procs)
            assert str(stopped.value) == ("all 2 --workers processes exited and, without NANORL_TOKEN, no other "
                                          "worker can join; see their output above")
            assert capsys.readouterr().err.splitlines() == said
            return
        got = []
        taking = threading.Thread(target=lambda: got.append(box.take(0, {0}, procs)), daemon=True)
        taking.start()
        err = ""
        while err.count("waiting for batches") < 3 and taking.is_alive():  # waits that look at the workers again
            err += capsys.readouterr().err
            time.sleep(0.01)
        assert post(box, forge(groups=2))[0] == 200
        taking.join(10)
        lines = (err + capsys.readouterr().err).splitlines()
        assert lines[:2] == said and set(lines[2:]) == {"step 0: waiting for batches (0 live workers)"}
        assert got[0][0]["tokens"].shape == (8, 12)
    finally:
        box.close()
        for p in procs[2:]:
            p.kill()
            p.wait()



def test_a_dead_worker_of_the_trainers_own_is_told_within_seconds_not_at_the_minutes_waiting_line(
        monkeypatch, capsys):
    """The --workers processes were looked at only when a "waiting for batches" line was due, a minute
    without a batch: a trainer whose workers had all died said so, and stopped, a minute late."""
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    box = serve.Inbox(utils.load_config(train.Config, ["--task", "arith", "--batch", "8", "--group-size", str(K),
                                                      "--role", "trainer"]), VOCAB, 0, MAX_LEN, KEYS)
    dead = subprocess.Popen(["sh", "-c", "exit 3"])
    dead.wait()
    box.restore(0)
    box.serve(0, bytearray(b"v0"), 0.0)
    raised = []

    def take():
        try:
            box.take(0, {0}, [dead])
        except utils.ConfigError as e:
            raised.append(str(e))

    taking = threading.Thread(target=take, daemon=True)
    try:
        taking.start()
        taking.join(serve.WAITING / 2)  # 30 s: the old code told it at 60
        assert raised and raised[0].startswith("all 1 --workers processes exited")
        assert "waiting for batches" not in capsys.readouterr().err
    finally:
        box.close()


def test_a_batch_or_poll_of_a_worker_another_trainer_registered_gets_412_and_is_never_taken(inbox):
    """A worker of a trainer since killed kept posting into the next run on its url (another --task even),
    which trained on its rows: the fingerprint was checked at /hello alone, and /adapter served anyone."""
    me = client(inbox)
    other = encode(forge(), {"worker": 0, "run": "0123456789abcdef", "seq": 0})
    status, reply = me.post("/batch", other)
    assert (status, json.loads(reply)) == (412, {"error": "this worker was registered by another trainer: "
                                                          "POST /hello again"})
    assert me.get("/adapter?have=-1&worker=0&run=0123456789abcdef")[0] == 412
    assert inbox.queue == [] and "groups_received" not in inbox.counts and inbox.counts["adapters_sent"] == 0
    assert me.post("/batch", encode(forge(), {"worker": 0, "run": inbox.run, "seq": 0}))[0] == 200  # its own


@pytest.mark.parametrize("first, claim, answer", [
    (64, 5, (200, {"worker": 5})),  # a --resumed trainer: worker 5 outlived the one before, keeps its id
    (64, 63, (200, {"worker": 63})),  # one that joined after the checkpoint (serve.SURVIVORS)
    (64, 64, (409, {"error": "worker id 64 was not issued by this run before its trainer restarted: restart "
                             "the worker"})),  # an id this trainer issues itself
    (0, 5, (409, {"error": "worker id 5 was not issued by this run before its trainer restarted: restart "
                           "the worker"})),  # a fresh run: a worker of another, with the same config
    (64, True, (409, {"error": "worker id True was not issued by this run before its trainer restarted: "
                               "restart the worker"})),
])
def test_a_worker_saying_hello_again_keeps_its_id_only_with_a_resumed_trainer_of_its_run(inbox, first, claim,
                                                                                         answer):
    inbox.restore(first)
    said = json.dumps({"fingerprint": serve.fingerprint(inbox.cfg), "worker": claim}).encode()
    status, reply = inbox.hello(Request("/hello", {}, said))
    assert (status, {k: v for k, v in reply.items() if k != "run"}) == answer and inbox.next_worker == first
    assert reply.get("run", inbox.run) == inbox.run
    inbox.seen.clear()  # or close() waits for worker 5 to poll


def test_a_batch_whose_reply_was_lost_is_sent_again_and_taken_once(inbox, monkeypatch):
    """serve.post sends a batch again when its reply is lost; the trainer had queued it, and trained it
    twice."""
    calls = []

    def slow(req):  # takes the batch, then answers after the worker's client gave up
        calls.append(inbox.receive(req))
        if len(calls) == 1:
            time.sleep(1.5)
        return calls[-1]
    monkeypatch.setitem(inbox.server.routes, ("POST", "/batch"), slow)
    me = transport.Client(inbox.server.url, token=inbox.server.token, timeout=0.5, retries=1)
    body = encode(forge(), {"worker": 0, "run": inbox.run, "seq": 7})
    assert serve.post(me, "/batch", body, gone=lambda: False)[0] == 200
    assert len(calls) == 2 and len(inbox.queue) == 1 and inbox.counts["groups_received"] == 1
    assert calls[1] == (200, {"queued": 0, "dropped": 0, "duplicate": True})
    assert serve.post(me, "/batch", body, gone=lambda: False)[0] == 200 and len(inbox.queue) == 1  # a replay
    body = encode(forge(), {"worker": 0, "run": inbox.run, "seq": 8})  # its next batch
    assert serve.post(me, "/batch", body, gone=lambda: False)[0] == 200 and len(inbox.queue) == 2


def test_the_inbox_remembers_the_last_batch_of_a_bounded_number_of_workers(inbox, monkeypatch):
    monkeypatch.setattr(serve, "SEQS", 3)
    assert [inbox.taken(w, seq) for w, seq in ((0, 0), (1, 0), (2, 0), (0, 1), (3, 0))] == [False] * 5
    assert inbox.seqs == {2: 0, 0: 1, 3: 0} and list(inbox.seqs) == [2, 0, 3]  # 1, least recently heard: gone
    assert [inbox.taken(w, seq) for w, seq in ((0, 0), (0, 1), (2, 1), (2, 1))] == [True, True, False, True]


def test_a_flood_of_hellos_leaves_only_the_seqs_workers_heard_last_and_live_counts_those(inbox, monkeypatch):
    """Each /hello issues an id and its time was kept for ever: 100,000 hellos, 100,000 entries and as
    many live workers."""
    monkeypatch.setattr(serve, "SEQS", 3)
    hello = lambda: inbox.hello(Request("/hello", {}, encode_hello(inbox)))[1]["worker"]
    assert [hello() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert list(inbox.seen) == [2, 3, 4] and inbox.live() == {2, 3, 4}  # 0 and 1, heard first: forgotten
    assert client(inbox).get(f"/adapter?have=-1&worker=2&run={inbox.run}") == (200, b"v0")  # 2 polls
    assert hello() == 5 and list(inbox.seen) == [4, 2, 5]  # 3, now the least recently heard: forgotten
    monkeypatch.setattr(serve, "HEARTBEAT", 0.0)
    assert inbox.live() == set()  # none heard within the heartbeat
    inbox.seen.clear()  # or close() waits for them to poll


def test_rows_of_no_tokens_get_a_counted_400_not_a_500_and_a_traceback(inbox):
    empty = {k: v[:, :0] if v.ndim == 2 else v for k, v in forge().items()}  # [4, 0] and [4]
    status, reply = client(inbox).post("/batch", encode(empty, {"worker": 0, "run": inbox.run, "seq": 0}))
    assert (status, json.loads(reply)) == (400, {"error": "rows need at least one token"})
    assert inbox.counts["batches_rejected"] == 1 and "http_500" not in inbox.server.counts


def rewarded(at: list[int], value: float) -> dict:
    """forge()'s group (completion tokens 4..11) with `value` as the reward of each row's tokens `at`."""
    t = forge()
    t["rewards"][:, at] = value
    return t


@pytest.mark.parametrize("batch, lands, grpo_finite", [
    (rewarded([10, 11], 3e38), False, False),  # each row's return: 6e38, inf in float32
    # each row's 1e38 is finite; their group's sum, 4e38, is not: GRPO's mean, now taken in float64, holds it,
    # but a batch mean in float32 (reinforce_baseline's) would not
    (rewarded([11], 1e38), False, True),
    (rewarded([4, 11], -3e38), False, False),  # -6e38: -inf
    (rewarded([11], 8e37), True, True),  # the group's sum: 3.2e38, under float32's largest, 3.4028e38
])
def test_rewards_whose_returns_or_group_sum_overflow_float32_get_a_counted_400_as_they_make_grpo_nan(
        inbox, batch, lands, grpo_finite):
    """Every reward finite, yet a row's return (or its group's sum, GRPO's mean) inf: the step was NaN."""
    rows = types.SimpleNamespace(rewards=batch["rewards"], mask=batch["mask"], group=batch["group"])
    assert algos.grpo(rows, types.SimpleNamespace(dr_grpo=False)).isfinite().all() == grpo_finite
    status, reply = post(inbox, batch)
    assert (status == 200, inbox.counts["batches_rejected"]) == (lands, 0 if lands else 1)
    if not lands:
        assert reply == {"error": "rewards summed over rows reach inf in float32 (a NaN step); keep them far "
                                  "below 3.4e38"}


def test_an_odd_first_batch_fixes_nothing_and_honest_workers_batches_land(inbox):
    """The first batch accepted fixed the run's keys: one odd batch, and every honest worker was refused."""
    odd = forge(reward_int_correct=None, reward_other=torch.zeros(K))
    assert post(inbox, odd) == (400, {"error": "batch keys: missing ['reward_int_correct'], unexpected "
                                               "['reward_other']"})
    assert post(inbox, forge())[0] == post(inbox, forge())[0] == 200


def test_batches_dropped_stale_leave_no_sync_times_or_metrics_behind(inbox):
    """The trainer kept each batch's apply time and metrics, queued or not: stale batches grew them until
    a step took groups, without limit."""
    inbox.serve(5, bytearray(b"v5"), 0.0)  # version 0 lags 5 > max_staleness 2
    for _ in range(50):
        reply = post(inbox, forge(), apply_s=0.5, metrics={"gen_rounds": 1})
        assert reply == (200, {"queued": 0, "dropped": 1})
    assert (inbox.apply_s, inbox.rollout_metrics, inbox.counts["dropped_stale"]) == ([], [], 50)


def test_worker_metrics_but_its_sources_are_ignored_and_never_overwrite_the_trainers(inbox):
    """Any [a-z_] key was averaged into the step's log, where it overwrote the trainer's own (loss,
    reward, eval_accuracy, queue_depth), and a batch could bring any number of them."""
    theirs = {"loss": 5.0, "reward": 9.0, "eval_accuracy": 1.0, "queue_depth": 99, "gen_rounds": 2}
    many = {"k" * n: 1.0 for n in range(1, 41)}
    assert post(inbox, forge(), metrics=theirs)[0] == post(inbox, forge(), metrics=many)[0] == 200
    assert inbox.rollout_metrics == [{"gen_rounds": 2.0}, {}]
    meta = inbox.take(0, {0})[1]
    assert meta["gen_rounds"] == 2.0 and meta["queue_depth"] == 0
    assert not {"loss", "reward", "eval_accuracy", "k"} & set(meta)


@pytest.mark.usefixtures("one_thread")
def test_every_metric_a_rollout_source_fills_reaches_the_trainer(inbox):
    """serve kept its own list of the keys a worker's source.last holds: a metric added to
    TaskRollouts.next was logged in sync runs and silently dropped from async ones."""
    cfg = utils.load_config(train.Config, ["--task", "arith", "--model", "tiny", "--lora", "--batch", "8",
                                           "--group-size", str(K), "--max-new-tokens", "4", "--algo", "grpo",
                                           "--dynamic-sampling", "--max-gen-batches", "1", "--no-progress"])
    source = rollouts.TaskRollouts(cfg, LLMPolicy(cfg))
    source.next(0)
    assert set(source.last) == set(rollouts.METRICS) and source.last["gen_rounds"] == 1  # one round allowed
    assert post(inbox, forge(), metrics=source.last)[0] == 200
    assert inbox.rollout_metrics == [{k: float(v) for k, v in source.last.items()}]  # none dropped


def test_a_hundred_workers_polling_leave_hello_and_batch_served_and_each_gets_the_next_adapter(inbox,
                                                                                             monkeypatch):
    """A GET /adapter held for LONG_POLL is a connection, and a worker asks again at once: with about
    MAX_CONNS workers their polls filled the server's cap, and every /hello and /batch was refused."""
    monkeypatch.setattr(serve, "LONG_POLL", 1.0)  # a shorter test: polls held half as long, as many held
    adapter = lambda v: encode({"w": torch.full((2,), float(v))}, {"version": v})
    inbox.serve(0, adapter(0), 0.0)
    url, token = inbox.server.url, inbox.server.token
    fetchers = [serve.AdapterFetcher(transport.Client(url, token, retries=1), inbox.cfg, w, inbox.run)
                for w in range(100)]
    for f in fetchers:
        f.start()
    try:
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while not all(f.have == 0 for f in fetchers) and time.monotonic() < deadline:
            time.sleep(0.05)
        client, statuses, ids = transport.Client(url, token, retries=1), [], []
        for path in ["/hello"] * 10 + ["/batch"] * 2:  # 2: the queue's capacity, so no POST waits for room
            time.sleep(0.2)  # spread over 2 polls' time: polls held together end together, freeing the cap
            meta = {"worker": ids[0] if ids else 0, "run": inbox.run, "seq": next(SEQ)}
            body = encode_hello(inbox) if path == "/hello" else encode(forge(), meta)
            try:
                status, reply = client.post(path, body)
            except transport.ServeError:  # closed unanswered: the server held its cap of connections
                status, reply = "refused", b"{}"
            statuses.append(status)
            ids += [json.loads(reply)["worker"]] if path == "/hello" and status == 200 else []
        assert statuses == [200] * 12 and ids == list(range(10)) and inbox.counts["groups_received"] == 2
        inbox.serve(1, adapter(1), 0.0)
        deadline = time.monotonic() + 60
        while not all(f.have == 1 for f in fetchers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [f.take()[0] for f in fetchers] == [1] * 100 and sum(f.rejected for f in fetchers) == 0
    finally:
        inbox.close()  # returns once the workers /hello registered (0 to 9) polled and heard the run is over
        for f in fetchers:
            f.done.set()
        for f in fetchers:
            f.join(10)


def test_a_hundred_workers_posting_into_a_full_queue_leave_hello_served_and_each_batch_lands(inbox,
                                                                                               monkeypatch):
    """A POST /batch waiting for room holds a connection for LONG_POLL, and serve.post sent it again 0.3 s
    after the 429: about MAX_CONNS workers ahead of a slow trainer filled the server's cap, and /hello was
    refused."""
    monkeypatch.setattr(serve, "LONG_POLL", 1.0)  # a shorter test: posts held half as long, as many held
    assert post(inbox, forge(groups=2), worker=-1)[0] == 200  # the queue's capacity: full until a step takes
    url, token, stop, answers = inbox.server.url, inbox.server.token, threading.Event(), {}

    def worker():  # run_worker's calls: /hello, then POST /batch until an answer other than 429 or 503
        me = transport.Client(url, token, retries=1)
        w, run = serve.hello(me, inbox.cfg)
        body = encode(forge(), {"worker": w, "run": run, "seq": 0})
        answers[w] = serve.post(me, "/batch", body, stop.is_set)
    workers = [threading.Thread(target=worker, daemon=True) for _ in range(100)]
    for t in workers:
        t.start()
    try:
        time.sleep(2.0)  # every worker past its /hello, posting into the full queue
        client, statuses, ids = transport.Client(url, token, retries=1), [], []
        for _ in range(10):
            time.sleep(0.2)  # spread over 2 holds' time: posts held together end together, freeing the cap
            try:
                status, reply = client.post("/hello", encode_hello(inbox))
            except transport.ServeError:  # closed unanswered: the server held its cap of connections
                status, reply = "refused", b"{}"
            statuses.append(status)
            ids += [json.loads(reply)["worker"]] if status == 200 else []
        assert statuses == [200] * 10 and len(set(ids)) == 10 and inbox.counts["groups_received"] == 2
        trainer = threading.Thread(target=lambda: [inbox.take(0, {0}) for _ in range(51)], daemon=True)
        trainer.start()  # 51 steps of 2 groups: the 2 queued first, then every worker's one
        trainer.join(60)  # a hang guard, not a timing assertion
        for t in workers:
            t.join(10)  # each has its reply
        # each worker's batch landed once: a copy sent again after a lost reply is answered 200, not queued
        assert not trainer.is_alive() and inbox.counts["groups_received"] == 102 and not inbox.queue
        assert len(answers) == 100 and {a[0] for a in answers.values()} == {200}
    finally:
        stop.set()
        for t in workers:
            t.join(10)
