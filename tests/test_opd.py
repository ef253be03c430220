"""On-policy distillation (--algo opd): the advantage is the teacher's log-prob minus the student's,
token by token, masked like the loss; a teacher identical to the student teaches nothing."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import rundir
import serve
import train
import utils
from modeldir import build_tiny_model
from rollouts import make_batch
from transport import Client, encode

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models with the same character tokenizer and different random weights."""
    root = tmp_path_factory.mktemp("models")
    size = dict(layers=1, hidden=64, heads=1, intermediate=128)
    return build_tiny_model(str(root / "student"), seed=0, **size), build_tiny_model(str(root / "teacher"), seed=1, **size)


def setup(student, teacher, *argv):
    cfg = utils.load_config(train.Config, ["--task", "arith", "--model", student, "--algo", "opd", "--teacher", teacher,
                                           "--batch", "8", "--group-size", "4", "--max-new-tokens", "4", *argv])
    train.validate(cfg)
    policy, opt, source = train.build(cfg)
    return cfg, policy, opt, source, train.load_teacher(cfg, policy)


def reference_logp(model_dir, batch):
    """log p(token) under a plain Hugging Face forward of each full row, no nanorl code involved."""
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = lm(input_ids=batch.tokens, attention_mask=batch.attn.long()).logits  # [N, L, V]
    out = torch.zeros_like(batch.mask)
    out[:, 1:] = F.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    return out * batch.mask  # [N, L]


@pytest.mark.parametrize("micro_batch", ["0", "3"])
def test_opd_advantage_is_teacher_minus_student_logp_token_by_token(models, micro_batch):
    student, teacher = models
    cfg, policy, _, source, t = setup(student, teacher, "--micro-batch", micro_batch)
    batch = train.prepare(policy, source.next(0), cfg, teacher=t)
    mask = batch.mask
    expected = reference_logp(teacher, batch) - reference_logp(student, batch)  # LoRA B = 0: the student is its base
    assert mask.sum() > 8 and (batch.adv[mask == 0] == 0).all()  # masked like the loss
    assert torch.allclose(batch.adv, expected, atol=1e-5)
    assert expected.abs().max() > 0.1  # two different models: the test can fail
    kl = ((reference_logp(student, batch) - reference_logp(teacher, batch)) * mask).sum() / mask.sum()
    assert batch.metrics["opd_reverse_kl"] == pytest.approx(kl.item(), abs=1e-5)


@pytest.mark.parametrize("lora", ["--lora", "--no-lora"])
def test_teacher_equal_to_student_gives_zero_advantage_and_leaves_the_weights_bitwise(models, lora):
    student, _ = models
    cfg, policy, opt, source, t = setup(student, student, lora, "--lr", "0.1")
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    for step in range(2):
        batch = train.prepare(policy, source.next(step), cfg, teacher=t)
        # The same weights through the same code: equal bit for bit, so the advantage is exactly 0
        # (LoRA's zero-initialised B adds exact zeros). Zero advantage gives exactly zero gradients,
        # and Adam's first steps from zero moments move nothing: the update is a no-op, bitwise.
        assert torch.equal(batch.adv, torch.zeros_like(batch.adv)) and batch.mask.sum() > 0
        assert batch.metrics["opd_reverse_kl"] == 0.0
        stats = train.update(policy, opt, batch, cfg)
        assert stats["grad_norm"] == 0.0
    after = policy.trainable_state()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reward_coef_mixes_the_task_return_in(models):
    student, teacher = models
    cfg, policy, _, source, t = setup(student, teacher, "--opd-reward-coef", "0.5")
    batch = source.next(0)
    batch.rewards = torch.rand(batch.rewards.shape) * batch.mask  # dense, so that the mix is visible
    batch = train.prepare(policy, batch, cfg, teacher=t)
    m, r = batch.mask, batch.rewards
    g = r.clone()  # the discounted return, written out: G_t = r_t + gamma G_{t+1} within the completion
    for t in reversed(range(r.shape[1] - 1)):
        g[:, t] += cfg.gamma * g[:, t + 1] * m[:, t + 1]
    expected = (batch.teacher_logp - batch.old_logp) * m + 0.5 * g * m
    assert torch.allclose(batch.adv, expected, atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--algo", "opd"], "--algo opd and --teacher MODEL go together"),
    (["--algo", "grpo", "--teacher", "tiny"], "--algo opd and --teacher MODEL go together"),
    (["--task", "cartpole", "--algo", "opd", "--teacher", "tiny"], "--teacher is for LLM tasks, not cartpole"),
])
def test_opd_flags_are_checked_up_front(argv, message):
    cfg = utils.load_config(train.Config, ["--task", "arith", "--group-size", "4", "--batch", "8", *argv])
    with pytest.raises(utils.ConfigError, match=message):
        train.validate(cfg)


def test_teacher_with_another_tokenizer_is_refused_in_one_line(models, tmp_path):
    from transformers import AutoTokenizer
    student, teacher = models
    other = tmp_path / "other"
    import shutil
    shutil.copytree(teacher, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(utils.ConfigError, match=r"--teacher .*tokenizer differs from the student's") as e:
        setup(student, str(other))
    assert "\n" not in str(e.value)


def test_a_teacher_that_cannot_load_is_named_by_its_own_flag(models, tmp_path):
    """The model loader's messages name --model: a missing teacher was reported as the student's flag."""
    student, _ = models
    with pytest.raises(utils.ConfigError) as e:
        setup(student, str(tmp_path / "nowhere"))
    assert str(e.value).startswith(f"--teacher {tmp_path / 'nowhere'}: no such directory") and "\n" not in str(e.value)


# ---------------------------------------------------------------- async: the trainer's teacher scores
def test_async_opd_advantage_is_teacher_minus_each_rows_sampling_version_for_rows_from_the_wire(models,
                                                                                                 monkeypatch):
    """Rows of two versions POSTed over real HTTP: the advantage is the teacher's log-prob minus the
    log-prob under the very version that sampled the row (a snapshot, not the live weights)."""
    student, teacher = models
    monkeypatch.setenv("NANORL_TOKEN", "opd-test-token-0123456789")  # this test posts as a worker would
    cfg, policy, _, src, t = setup(student, teacher, "--role", "trainer", "--max-staleness", "2")
    assert isinstance(src, serve.AsyncRollouts)
    client = Client(src.inbox.server.url, src.inbox.server.token)
    try:
        states = []
        for v in (0, 1):  # version 1: other adapter weights than version 0
            with torch.no_grad():
                for p in (p for p in policy.parameters() if p.requires_grad):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(v)) * 0.1)
            src.publish(v)
            states.append({k: x.clone() for k, x in policy.trainable_state().items()})
            prefixes = [policy.encode_prompt(f"{v}{i}+1=") for i in range(4)]
            rows = make_batch(prefixes, policy.generate(prefixes, 4), [0.0] * 4, policy.pad_id,
                              stats={"reward_int_correct": torch.zeros(4)})  # an arith worker's keys
            rows.group, rows.version = torch.zeros(4, dtype=torch.long), torch.full((4,), v)
            meta = {"worker": 0, "run": src.inbox.run, "seq": v}  # the run /hello gives; a batch's number
            assert client.post("/batch", encode(rows.wire(), meta))[0] == 200
        batch = train.prepare(policy, src.next(1), cfg, src.weights, teacher=t)
    finally:
        src.close()
    assert batch.version.tolist() == [0] * 4 + [1] * 4
    student_logp = torch.zeros_like(batch.mask)
    for v, state in enumerate(states):
        policy.load_trainable(state)
        with torch.no_grad():
            student_logp[4 * v : 4 * v + 4] = policy.score(batch, slice(0, 8))[0][4 * v : 4 * v + 4]
    expected = (reference_logp(teacher, batch) - student_logp) * batch.mask
    assert batch.mask.sum() > 8 and (batch.adv[batch.mask == 0] == 0).all()
    assert torch.allclose(batch.adv, expected, atol=1e-5) and expected.abs().max() > 0.1


def test_async_opd_run_with_the_student_as_teacher_trains_nothing(models, tmp_path, monkeypatch):
    """A real trainer (in this process: its start is not under test) and worker process: every step's
    advantage, reverse KL and gradient are exactly 0, so the adapter's B (zero at init) is still exactly 0."""
    student, _ = models
    run = tmp_path / "run"
    monkeypatch.setenv("NANORL_TOKEN", "opd-test-token-0123456789")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker's
    argv = ["--task", "arith", "--model", student, "--algo", "opd",
            "--teacher", student, "--batch", "8", "--group-size", "4", "--max-new-tokens", "4",
            "--steps", "3",
            "--eval-every", "1000", "--eval-size", "4", "--lr", "0.1", "--no-progress", "--out", str(run),
            "--role", "trainer", "--workers", "1", "--max-staleness", "2"]
    assert train.main(argv) == 0
    m = rundir.read_metrics(run / "metrics.csv")
    assert [s for s, _, _ in m["loss"]] == [1, 2, 3] and m["groups_received"][-1][2] >= 6  # from the worker
    for key in ("opd_reverse_kl", "adv_mean", "adv_std", "grad_norm"):
        assert [v for _, _, v in m[key]] == [0.0] * 3, key
    weights = load_file(str(rundir.checkpoints(run)[-1] / "weights.safetensors"))
    b = [w for n, w in weights.items() if "lora_B" in n]
    assert b and all(torch.equal(w, torch.zeros_like(w)) for w in b)


def test_an_opd_run_resumed_midway_logs_what_the_uninterrupted_run_logs(models, tmp_path):
    """4 steps in one run, and 2 + --resume to 4: every logged number equal (the README's resume is bitwise).
    The teacher drew its zero adapter's A from the run's RNG after the resume had restored it."""
    student, teacher = models
    argv = ["--task", "arith", "--model", student, "--algo", "opd", "--teacher", teacher, "--batch", "8",
            "--group-size", "4", "--max-new-tokens", "4", "--eval-every", "2", "--eval-size", "4",
            "--sft-steps", "0", "--lr", "0.01", "--no-progress"]
    assert train.main([*argv, "--steps", "4", "--out", str(tmp_path / "one")]) == 0
    assert train.main([*argv, "--steps", "2", "--out", str(tmp_path / "two")]) == 0
    assert train.main(["--resume", str(tmp_path / "two"), "--steps", "4"]) == 0
    one, two = (rundir.read_metrics(tmp_path / run / "metrics.csv") for run in ("one", "two"))
    values = lambda m: {k: [(s, v) for s, _, v in rows] for k, rows in m.items()}
    assert values(one) == values(two) and [s for s, _, _ in one["opd_reverse_kl"]] == [1, 2, 3, 4]


def test_a_teacher_whose_learned_positions_end_before_the_rows_stops_in_one_line(models, tmp_path):
    """A GPT-2 teacher (learned positions, here 12) with the student's character tokens: a row past 12
    tokens indexed past its position table, an IndexError's traceback mid-step (a ConfigError: the loop
    saves the last finished step and says it in one line)."""
    from transformers import AutoTokenizer, GenerationConfig, GPT2Config, GPT2LMHeadModel
    student, _ = models
    tok = AutoTokenizer.from_pretrained(student)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    size = dict(n_positions=12, n_embd=64, n_layer=1, n_head=1)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), **size, **ids))
    gpt2.generation_config = GenerationConfig(**ids)
    gpt2.save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    cfg, policy, _, source, t = setup(student, str(tmp_path / "gpt2"), "--max-new-tokens", "8")
    batch = source.next(0)
    assert int(batch.attn.sum(1).max()) > 12  # "12+7=" and its bos, then 8 tokens: past the table
    with pytest.raises(utils.ConfigError, match=r"passes its 12 learned positions") as e:
        train.prepare(policy, batch, cfg, teacher=t)
    assert "\n" not in str(e.value) and str(tmp_path / "gpt2") in str(e.value)


def test_a_bf16_teacher_keeps_its_rotary_frequencies_exact(models):
    """--dtype bf16 cast the whole teacher with .to(bf16), its rotary inv_freq buffer too: rounded by up to
    2^-9 of itself, so the angle of position 1000 was off by up to ~2 radians. Only its weights are cast now."""
    student, _ = models
    cfg, policy, *_, t = setup(student, student, "--dtype", "bf16")  # the student as its own teacher
    freq = lambda m: [b for name, b in m.named_buffers() if name.endswith("inv_freq")]
    exact = freq(policy)  # LoRA's base, loaded in bf16 by from_pretrained: its frequencies stay fp32
    assert exact and exact[0].dtype == torch.float32 and not torch.equal(exact[0], exact[0].bfloat16().float())
    assert [f.dtype for f in freq(t)] == [torch.float32] * len(exact) and all(map(torch.equal, freq(t), exact))
    assert {p.dtype for p in t.parameters()} == {torch.bfloat16} and not any(p.requires_grad for p in t.parameters())
