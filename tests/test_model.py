"""model.py's LLM policy on a tiny locally built Llama: the invariants the training loop relies on."""
import json
import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import modeldir
import rollouts
import rundir
import train
import utils
from algos import loss_weights, policy_loss
from model import LLMPolicy, Sample, add_lora
from modeldir import CHARS, SPECIALS, build_tiny_model, resolve_model
from rollouts import make_batch

DIMS = dict(layers=2, hidden=128, heads=2, intermediate=256, max_len=256)  # 2 x 64 heads: small and fast
PROMPTS = ["1+2=", "17*3=", "(12+30)/6=?\n", "x"]  # 5, 6, 13 and 2 tokens with bos: a ragged batch


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("cache") / "tiny"), **DIMS)


def policy(path, **kw) -> LLMPolicy:
    torch.manual_seed(0)
    return LLMPolicy(train.Config(model=path, **kw), device="cpu")


def variant(tiny, tmp_path, **generation) -> str:
    """A copy of the tiny model whose generation_config.json also sets `generation`."""
    path = tmp_path / "variant"
    shutil.copytree(tiny, path)
    cfg = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**cfg, **generation}))
    return str(path)


def randomise_adapter(pol: LLMPolicy, scale: float = 0.05) -> None:
    """lora_B starts at zero, which hides bugs; give every trained tensor a random value."""
    g = torch.Generator().manual_seed(1)
    pol.load_trainable({n: torch.randn(t.shape, generator=g) * scale for n, t in pol.trainable_state().items()})


def rollout(pol: LLMPolicy, max_new: int = 12, n: int = 2, seed: int = 0):
    prefixes = [pol.encode_prompt(p) for p in PROMPTS for _ in range(n)]
    torch.manual_seed(seed)
    samples = pol.generate(prefixes, max_new)
    return prefixes, samples, make_batch(prefixes, samples, [float(i) for i in range(len(samples))], pol.pad_id)


# ---------------------------------------------------------------- the tiny model
def test_build_tiny_model_is_idempotent_and_loads_in_transformers_and_peft(tiny, monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = os.path.join(tiny, "model.safetensors")
    stamp = os.stat(weights).st_mtime_ns
    monkeypatch.setattr(modeldir, "publish", lambda *a: pytest.fail("built again"))  # found before building
    assert build_tiny_model(tiny, **DIMS) == tiny and os.stat(weights).st_mtime_ns == stamp  # reused, not rewritten
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(tiny))
    assert not [f for f in os.listdir(os.path.dirname(tiny)) if f.startswith(".tmp")]
    lm = AutoModelForCausalLM.from_pretrained(tiny)
    assert (lm.config.head_dim, lm.config.num_hidden_layers, lm.config.vocab_size) == (64, 2, len(SPECIALS) + len(CHARS))
    assert len(SPECIALS) + len(CHARS) == 83
    tok = AutoTokenizer.from_pretrained(tiny)
    text = "(12+3)*4=60\n<answer>Yes, x_1!</answer>?"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) + 1 and ids[0] == tok.bos_token_id  # one token per character, after bos
    assert tok.decode(ids, skip_special_tokens=True) == text
    peft_lm = get_peft_model(lm, LoraConfig(r=4, target_modules=["q_proj"]))
    assert peft_lm(input_ids=torch.tensor([ids])).logits.shape == (1, len(ids), 83)


@pytest.mark.parametrize("dims, fix", [(dict(hidden=256, heads=2), "got 256 / 2); try heads=4"),
                                       (dict(hidden=100, heads=2), "got 100 / 2); try hidden=128")])
def test_a_tiny_model_whose_heads_are_not_64_wide_is_refused_naming_the_fix(tmp_path, dims, fix):
    with pytest.raises(utils.ConfigError, match=re.escape(f"tiny model needs hidden / heads == 64 ({fix}") + "$"):
        build_tiny_model(str(tmp_path / "m"), **dims)  # its head_dim is 64: heads * 64 is the width
    assert not (tmp_path / "m").exists()


def test_resolve_tiny_builds_under_nanorl_cache(tmp_path, monkeypatch):
    cache = tmp_path / "home" / ".cache" / "nanorl"  # a fresh home has no ~/.cache yet
    monkeypatch.setenv("NANORL_CACHE", str(cache))
    path = resolve_model("tiny")
    assert os.path.dirname(path) == str(cache) and os.path.basename(path) == "tiny-v1-l4-d256-h4-f512-n1024-s0"
    modes = {f.name: f.stat().st_mode & 0o777 for f in Path(path).iterdir()}  # a cache users share: safetensors'
    assert modes == dict.fromkeys(modes, 0o666 & ~utils.UMASK), modes  # own file was 0600, theirs to read
    lock = cache / ".lock-tiny-v1-l4-d256-h4-f512-n1024-s0"  # another user's builds open it too
    assert lock.stat().st_mode & 0o777 == 0o666 & ~utils.UMASK


def test_a_builder_that_waited_for_the_lock_finds_the_model_written_and_writes_nothing(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stamps = {f.name: f.stat().st_mtime_ns for f in Path(tiny).iterdir()}
    lm, tok = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    assert modeldir.publish(Path(tiny), lm, tok) == tiny  # as the second of two runs building at once
    assert {f.name: f.stat().st_mtime_ns for f in Path(tiny).iterdir()} == stamps


def test_a_build_killed_mid_write_is_swept_by_the_next_and_a_live_one_is_waited_for(tmp_path, monkeypatch):
    """A model build killed outright (the OOM killer, say) left its .tmp-* directory in the cache for good: a
    fp32 copy of the model, GBs for a big GGUF. Builders now take turns, so the next one sweeps it."""
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path))
    dims = dict(layers=1, hidden=64, heads=1, intermediate=128)

    def killed_mid_write():
        modeldir.save_file = lambda *args, **kw: time.sleep(600)  # in the forked child only
        build_tiny_model(**dims)

    child = multiprocessing.get_context("fork").Process(target=killed_mid_write)
    child.start()
    try:
        deadline = time.time() + 60
        while not list(tmp_path.glob(".tmp-tiny-*/config.json")) and time.time() < deadline:
            time.sleep(0.05)
        waiter = threading.Thread(target=build_tiny_model, kwargs=dims)  # a second run needing the model
        waiter.start()
        waiter.join(timeout=3)
        assert waiter.is_alive() and len(list(tmp_path.glob(".tmp-tiny-*"))) == 1  # waits; the live one's kept
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    waiter.join(timeout=60)
    built = "tiny-v1-l1-d64-h1-f128-n1024-s0"
    assert not waiter.is_alive() and sorted(p.name for p in tmp_path.iterdir()) == [f".lock-{built}", built]
    assert LLMPolicy(train.Config(model=str(tmp_path / built), lora=False)).model.config.hidden_size == 64


def test_bad_model_id_fails_at_start_up_naming_the_fix(tmp_path):
    with pytest.raises(utils.ConfigError, match="no such directory; check the model id, or pass a local directory"):
        LLMPolicy(train.Config(model="./no-such-model"))
    with pytest.raises(utils.ConfigError, match=r"--model .*: no config.json in it, so no model; check the"):
        resolve_model(str(tmp_path))  # a directory, but no config.json inside
    with pytest.raises(utils.ConfigError, match="^--model is empty; name one: tiny, smollm2-135m"):
        resolve_model("")  # it was the working directory
    with pytest.raises(utils.ConfigError, match=r"cannot load it \(.*\); did you mean 'smollm2-135m'\?; check"):
        resolve_model("smollm2:135m")  # not a hub id (fails without a hub lookup): the name it is close to
    with pytest.raises(utils.ConfigError, match="choices: fp32, bf16"):
        LLMPolicy(train.Config(model=str(tmp_path), dtype="fp16"))


def test_a_model_directory_without_tokenizer_files_says_so(tmp_path):
    """A copy that lost its tokenizer.json said "Couldn't instantiate the backend tokenizer from one of: )",
    transformers' first line of a list, which names no file."""
    lost = tmp_path / "lost"
    shutil.copytree(resolve_model("tiny"), lost)
    (lost / "tokenizer.json").unlink()
    with pytest.raises(utils.ConfigError) as e:
        LLMPolicy(train.Config(model=str(lost)))
    assert str(e.value) == (f"--model {lost}: cannot load its tokenizer (no tokenizer.json, tokenizer.model, "
                            "vocab.json in it); check the model id, or pass a local directory holding "
                            "config.json, weights and tokenizer files")


def test_an_offline_hub_id_loads_from_the_hub_cache_at_once_or_names_the_download(
        tmp_path, monkeypatch, hub_out_of_reach):
    """Offline (no DNS), a cached hub id cost a 7 s run 3 min 18 s of the hub client's retries (~28 s for
    each file it asked of the hub, hundreds of warnings); an uncached one ~28 s before its error."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    tries, connect = [], socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *args, **kw: tries.append(args) or connect(*args, **kw))
    utils.connects.cache_clear()
    assert utils.hub_out_of_reach()
    snapshot = tmp_path / "models--acme--tiny-chat" / "snapshots" / "abc123"  # the hub client's cache layout
    shutil.copytree(resolve_model("tiny"), snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    assert resolve_model("acme/tiny-chat") == str(snapshot)  # a directory: later loads never ask the hub
    assert LLMPolicy(train.Config(model="acme/tiny-chat", lora=False)).path == str(snapshot)
    assert len(tries) == 1  # one try a process: behind a dropping firewall, each waits out its timeout
    with pytest.raises(utils.ConfigError, match=rf"^--model acme/other: cannot load it \({hub_out_of_reach} is "
                       rf"out of reach and {tmp_path} does not hold acme/other: `hf download acme/other` where"):
        resolve_model("acme/other")
    with socket.create_server(("127.0.0.1", 0)) as server:  # a hub that takes connections is asked
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert not utils.hub_out_of_reach()
    monkeypatch.setattr(constants, "ENDPOINT", hub_out_of_reach)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    assert not utils.hub_out_of_reach()  # a proxy may reach what this machine cannot: the client asks it
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert not utils.hub_out_of_reach()  # the client reads its cache at once: left to it
    assert resolve_model("acme/tiny-chat") == "acme/tiny-chat"


def test_an_encoder_that_loads_as_a_causal_lm_stops_in_one_line_at_its_first_rollout(tmp_path):
    """AutoModelForCausalLM loads a BERT (as BertLMHeadModel, with a warning), which returns no KV cache
    and attends ahead: the first rollout died in an AttributeError traceback."""
    from transformers import BertConfig, BertForMaskedLM

    from modeldir import char_tokenizer

    tok = char_tokenizer(64)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                               intermediate_size=32, **ids)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    pol = policy(str(tmp_path))
    with pytest.raises(utils.ConfigError, match=rf"^--model {tmp_path} gives no KV cache: not a causal LM; pick"):
        pol.generate([pol.encode_prompt("1+1=")], 4)


def test_a_model_directory_without_usable_weights_or_not_a_causal_lm_fails_in_one_line(tiny, tmp_path, monkeypatch):
    from transformers import T5Config

    def copy(name, damage):
        d = tmp_path / name
        shutil.copytree(tiny, d)
        damage(d / "model.safetensors")
        return d

    cut = lambda f: f.write_bytes(f.read_bytes()[:100])  # a copy or a full disk cut it short
    for d in (copy("missing", lambda f: f.unlink()), copy("cut", cut)):  # were tracebacks (OSError, SafetensorError)
        with pytest.raises(utils.ConfigError, match=rf"^--model {d}: no causal LM loads from it \(.+\); check the"):
            LLMPolicy(train.Config(model=str(d)))
    t5 = copy("t5", lambda f: f.unlink())
    T5Config().save_pretrained(t5)
    with pytest.raises(utils.ConfigError, match=r"no causal LM loads from it \(Unrecognized configuration class"):
        LLMPolicy(train.Config(model=str(t5)))  # it said "--attn sdpa: ... (try --attn sdpa)"
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path / "cache"))
    cached = Path(resolve_model("tiny"))
    cut(cached / "model.safetensors")
    with pytest.raises(utils.ConfigError, match=rf"; delete {cached} \(the cache's copy\) and rerun$"):
        LLMPolicy(train.Config(model="tiny"))  # the cache reuses a directory that has its config.json
    (cached / "tokenizer.json").unlink()  # its tokenizer said "check the model id, or pass a local directory"
    with pytest.raises(utils.ConfigError, match=rf"its tokenizer \(.*\); delete {cached} \(the cache's copy\) and"):
        LLMPolicy(train.Config(model="tiny"))


def test_an_adapter_a_broken_chat_template_or_no_eos_token_fails_in_one_line_naming_the_fix(tiny, tmp_path):
    adapter = policy(tiny).save_adapter(str(tmp_path / "adapter"))  # what --export writes for a LoRA run
    with pytest.raises(utils.ConfigError, match=r"a LoRA adapter \(an --export\), not a model; --export DIR --exp"):
        resolve_model(adapter)  # it said "Unrecognized model" with no way forward
    broken, silent = tmp_path / "broken", tmp_path / "silent"
    for d in (broken, silent):
        shutil.copytree(tiny, d)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% if %}"}))
    with pytest.raises(utils.ConfigError, match=r"its chat template fails \(TemplateSyntaxError: .*--no-chat-tem"):
        LLMPolicy(train.Config(model=str(broken)))  # a jinja2 traceback at the first rollout
    assert LLMPolicy(train.Config(model=str(broken), chat_template=False)).use_template is False  # the named fix
    (silent / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    for name in ("config.json", "generation_config.json"):
        (silent / name).write_text(json.dumps({**json.loads((silent / name).read_text()), "eos_token_id": None}))
    with pytest.raises(utils.ConfigError, match="no eos token ends a completion; set eos_token in tokenizer_config.json or eos_token_id in"):
        LLMPolicy(train.Config(model=str(silent)))


def test_a_prompt_past_the_context_is_measured_without_transformers_warning_of_indexing_errors(tiny):
    """too_long encodes a data row to skip it and name it: transformers' "will result in indexing errors"
    beside that one line contradicted it (nothing runs past the context)."""
    pol, said = policy(tiny), []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)  # its loggers' parent; it prints via its own
    try:
        ids = pol.encode_prompt("ab" * pol.context)  # a character tokenizer: one id a character, plus bos
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert len(ids) == 2 * pol.context + len(pol.bos)
    assert not [m for m in said if "indexing errors" in m]


# ---------------------------------------------------------------- sampling == scoring
def test_sampler_logps_equal_recomputed_logps(tiny):
    pol = policy(tiny)
    randomise_adapter(pol)
    prefixes, samples, batch = rollout(pol, max_new=16, n=3)
    mask = batch.mask > 0
    assert mask.sum() == sum(len(s.ids) for s in samples) and not mask[:, 0].any()
    logp, entropy, values = pol.score(batch, slice(0, len(samples)))  # one micro-batch
    assert values is None and logp.shape == batch.tokens.shape
    assert (logp[mask] - batch.logp[mask]).abs().max() < 1e-5
    assert (logp[~mask] == 0).all() and (entropy[mask] > 0).all()
    singles = torch.cat([pol.score(batch, torch.tensor([r]))[0] for r in range(len(samples))])  # micro-batches of 1
    assert (singles[mask] - batch.logp[mask]).abs().max() < 1e-5


def test_ppo_values_are_the_critic_on_the_last_hidden_state_that_predicts_each_token(tiny):
    pol = policy(tiny, algo="ppo")
    randomise_adapter(pol)  # the critic head too: it starts at zero
    assert pol.v.weight.abs().sum() > 0
    _, _, batch = rollout(pol, max_new=6, n=1)
    _, _, values = pol.score(batch, slice(None))
    with torch.no_grad():  # right-padded rows: the plain forward's positions are theirs
        out = pol.model(input_ids=batch.tokens, attention_mask=batch.attn, output_hidden_states=True)
        before = pol.v(out.hidden_states[-1][:, :-1]).squeeze(-1)  # [n, L-1]: the state before token t
    mask = batch.mask > 0
    torch.testing.assert_close(values[:, 1:][mask[:, 1:]], before[mask[:, 1:]], rtol=0, atol=1e-5)
    assert (values[~mask] == 0).all() and values.requires_grad  # the critic trains through them


def test_entropy_is_the_full_distribution_entropy_at_temperature(tiny):
    pol = policy(tiny, temperature=0.7)
    randomise_adapter(pol)
    prefixes, samples, batch = rollout(pol, max_new=4, n=1)
    logp, entropy, _ = pol.score(batch, slice(0, 1))
    t = int(batch.mask[0].nonzero()[0])
    logits = pol.model(input_ids=batch.tokens[:1, :t]).logits[0, -1] / 0.7
    p = logits.softmax(-1)
    assert abs(entropy[0, t].item() - -(p * p.log()).sum().item()) < 1e-5
    assert abs(logp[0, t].item() - p[batch.tokens[0, t]].log().item()) < 1e-5


def test_left_padded_batch_generates_like_each_row_alone(tiny):
    pol = policy(tiny)
    randomise_adapter(pol)
    prefixes = [pol.encode_prompt(p) for p in PROMPTS]
    together = pol.generate(prefixes, 10, greedy=True)
    alone = pol.generate(prefixes, 10, gen_batch=1, greedy=True)
    for a, b in zip(together, alone):
        assert a.ids == b.ids and a.truncated == b.truncated
        assert max(abs(x - y) for x, y in zip(a.logps, b.logps)) < 1e-5


def test_generation_config_warpers_are_neutralised(tiny, tmp_path):
    noisy = variant(tiny, tmp_path, do_sample=True, top_k=1, top_p=0.1, min_p=0.9, typical_p=0.2,
                    repetition_penalty=5.0, no_repeat_ngram_size=1, temperature=0.05)
    plain, warped = policy(tiny), policy(noisy)
    assert warped.model.generation_config.top_k == 1  # the settings really were loaded...
    _, a, _ = rollout(plain, n=4, seed=3)
    _, b, _ = rollout(warped, n=4, seed=3)
    assert a == b  # ...and change nothing: same ids, same logps, same truncation
    assert len({tuple(s.ids) for s in a[:4]}) == 4  # and it really sampled (top_k=1 would make 4 copies)


def test_top_p_below_one_warns_once_that_the_ratio_is_approximate(tiny):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pol = policy(tiny, top_p=0.5)
        rollout(pol, n=2)
    assert [str(w.message)[:30] for w in caught] == ["top_p=0.5: samples come from a"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy(tiny, top_p=1.0)
    assert [str(w.message) for w in caught if "top_p" in str(w.message)] == []  # exact: nothing to warn of


def test_top_p_samples_exactly_the_nucleus_and_records_the_full_softmaxs_logp(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that the ratio is then approximate
        pol = policy(tiny, top_p=0.5, temperature=0.8)
    randomise_adapter(pol)
    prefix = pol.encode_prompt(PROMPTS[0])
    with torch.no_grad():
        p = (pol.model(input_ids=torch.tensor([prefix])).logits[0, -1] / 0.8).softmax(-1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]  # the mass of the tokens more probable than each
    nucleus = set(order[before <= 0.5].tolist())  # the most probable until 0.5, and the first past it
    torch.manual_seed(0)
    samples = pol.generate([prefix] * 2000, 1, gen_batch=2000)  # each nucleus token ~50 times
    assert {s.ids[0] for s in samples} == nucleus and 10 < len(nucleus) < len(p) - 10
    for s in samples[:100]:  # what the loss models: the full softmax, not the renormalised nucleus
        assert abs(s.logps[0] - p[s.ids[0]].log().item()) < 1e-5


# ---------------------------------------------------------------- stop tokens and batches
def test_second_eos_from_generation_config_stops_and_reward_sits_on_last_real_token(tiny, tmp_path):
    prefixes = [policy(tiny).encode_prompt(p) for p in PROMPTS]
    free = policy(tiny).generate(prefixes, 10, greedy=True)
    stop = free[0].ids[3]  # a token the greedy model emits, so it must end row 0 by step 4
    pol = policy(variant(tiny, tmp_path, eos_token_id=[2, stop]))
    assert pol.eos_ids == {2, stop}
    samples = pol.generate(prefixes, 10, greedy=True)
    for f, s in zip(free, samples):
        cut = next((i + 1 for i, t in enumerate(f.ids) if t in (2, stop)), None)  # first end token, included
        assert s.ids == f.ids[: cut or 10] and s.truncated == (cut is None)
    assert samples[0].ids[-1] == stop and len(samples[0].ids) <= 4 and not samples[0].truncated
    batch = make_batch(prefixes, samples, [1.0, 2.0, 3.0, 4.0], pol.pad_id)
    ends = [len(p) + len(s.ids) for p, s in zip(prefixes, samples)]
    assert batch.tokens.shape[1] == max(ends)
    for r, end in enumerate(ends):
        assert batch.rewards[r].nonzero().flatten().tolist() == [end - 1] and batch.rewards[r, end - 1] == r + 1
        assert batch.attn[r].sum() == end and (batch.tokens[r, end:] == pol.pad_id).all()
        assert batch.mask[r].sum() == len(samples[r].ids) and batch.mask[r, end - 1] == 1
    assert batch.truncated.tolist() == [s.truncated for s in samples]


def test_loss_mask_hides_environment_tokens_and_reward_sits_on_last_policy_token(tiny):
    pol = policy(tiny)
    samples = [Sample([10, 11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0, -5.0], False), Sample([20, 21], [-0.5, -0.25], True)]
    batch = make_batch([[1, 5], [1]], samples, [7.0, 9.0], pol.pad_id, loss_mask=[[1, 0, 0, 1, 0], [1, 1]])
    assert batch.tokens.tolist() == [[1, 5, 10, 11, 12, 13, 14], [1, 20, 21, 0, 0, 0, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 0, 0]]
    assert batch.logp.tolist() == [[0, 0, -1, 0, 0, -4, 0], [0, -0.5, -0.25, 0, 0, 0, 0]]
    assert batch.rewards.tolist() == [[0, 0, 0, 0, 0, 7, 0], [0, 0, 9, 0, 0, 0, 0]]
    assert batch.attn.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]] and batch.truncated.tolist() == [False, True]


# ---------------------------------------------------------------- training
def test_microbatched_backward_matches_one_shot(tiny):
    pol = policy(tiny)
    randomise_adapter(pol)
    _, samples, batch = rollout(pol, max_new=10, n=2)
    n = len(samples)
    adv = torch.linspace(-1, 1, n)[:, None] * batch.mask  # [N, L]
    w = loss_weights(batch.mask)  # one global denominator for every split

    def grads(size: int) -> dict:
        pol.zero_grad(set_to_none=True)
        for s in range(0, n, size):
            rows = torch.arange(s, min(s + size, n))
            logp, _, _ = pol.score(batch, rows)
            policy_loss(logp, batch.logp[rows], adv[rows], w[rows], batch.mask[rows])[0].backward()
        return {k: p.grad.clone() for k, p in pol.named_parameters() if p.requires_grad}

    one, micro = grads(n), grads(3)
    assert max(g.abs().max() for g in one.values()) > 1e-4  # not trivially zero
    for k in one:
        torch.testing.assert_close(micro[k], one[k], rtol=1e-4, atol=1e-7)


def test_shared_prompt_scoring_matches_separate_rows_in_logp_and_gradient(tiny):
    pol = policy(tiny)
    randomise_adapter(pol)
    seen = []
    hook = pol.model.get_base_model().model.register_forward_pre_hook(lambda m, a, k: seen.append(tuple(k["input_ids"].shape)), with_kwargs=True)
    _, samples, batch = rollout(pol, max_new=10, n=3)  # 4 ragged prompts x 3 rows each
    longest = max(len(p) for p in map(pol.encode_prompt, PROMPTS))
    assert seen[0] == (4, longest) and seen[1] == (12, 1)  # the sampler's prefill: each prompt once
    batch.mask[1, 7:9] = 0  # a hole, like an environment reply inside a multi-turn completion
    n = len(samples)

    def run(share: bool):
        pol.share_prompts, seen[:] = share, []
        pol.zero_grad(set_to_none=True)
        logp, entropy, _ = pol.score(batch, torch.arange(n))
        (logp * torch.linspace(-1, 2, n)[:, None]).sum().backward()
        return logp.detach(), entropy, {k: p.grad.clone() for k, p in pol.trained.items()}, pol.ref_logp(batch, torch.arange(n)), list(seen)

    (lp0, h0, g0, ref0, calls0), (lp1, h1, g1, ref1, calls1) = run(False), run(True)
    hook.remove()
    assert calls0[0][0] == n and calls1[0] == (4, longest)  # each prompt ran once, then every row's suffix
    assert calls1[1][0] == n and calls1[1][1] < calls0[0][1]
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    # the sampler ran each prompt once too: its log-probs match rows scored one by one
    torch.testing.assert_close(batch.logp[batch.mask > 0], lp0[batch.mask > 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(h1, h0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ref1, ref0, rtol=0, atol=1e-5)
    assert (lp1[1, 7:9] == 0).all() and (lp1[batch.mask > 0] < 0).all()
    assert max(g.abs().max() for g in g0.values()) > 1e-3  # not trivially zero
    for k in g0:  # sums in another order: equal to float32 rounding of the tensor's own scale
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-4 * float(g0[k].abs().max()))


OTHER_ARCHS = {  # the same code path on other attention layouts: GQA, a hybrid with conv state, sliding windows
    "qwen3": dict(num_key_value_heads=1, head_dim=64),
    "lfm2": dict(num_key_value_heads=1, layer_types=["conv", "full_attention"]),
    "gemma3_text": dict(num_key_value_heads=1, head_dim=64, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("arch", sorted(OTHER_ARCHS))
def test_other_architectures_sample_and_score_exactly_with_shared_prompts(tiny, tmp_path, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoConfig.from_pretrained(tiny)
    cfg = AutoConfig.for_model(arch, vocab_size=base.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=2, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                               pad_token_id=base.pad_token_id, **OTHER_ARCHS[arch])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    for f in os.listdir(tiny):  # the tiny model's character tokenizer
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(tiny, f), tmp_path)
    pol = policy(str(tmp_path))
    assert pol.model.get_base_model().config.model_type == arch
    randomise_adapter(pol)
    _, _, batch = rollout(pol, max_new=10, n=2)  # 12 characters of prompt and more: past gemma's window of 4
    mask = batch.mask > 0
    pol.share_prompts = False
    one_by_one = pol.score(batch, torch.arange(len(mask)))[0].detach()
    pol.share_prompts = True
    torch.testing.assert_close(pol.score(batch, torch.arange(len(mask)))[0].detach(), one_by_one, rtol=0, atol=1e-5)
    torch.testing.assert_close(batch.logp[mask], one_by_one[mask], rtol=0, atol=1e-5)  # the sampler's, prefilled once per prompt


def test_lora_trains_only_adapter_and_base_stays_bit_identical(tiny):
    pol = policy(tiny)
    trained = {k for k, p in pol.named_parameters() if p.requires_grad}
    # every linear layer of the architecture, found from the model: 7 per layer x 2 layers x (A, B)
    assert len(trained) == 28 and all(".lora_A." in k or ".lora_B." in k for k in trained)
    assert {k.split(".")[-4] for k in trained} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # r=16 on 128-wide layers: q,k,v,o 4 x (16*128 + 128*16); gate, up, down 3 x (16*128 + 256*16); x 2 layers
    assert sum(pol.get_parameter(k).numel() for k in trained) == 2 * (4 * 4096 + 3 * 6144)
    assert set(pol.trainable_state()) == trained
    base = {k: p.detach().clone() for k, p in pol.named_parameters() if not p.requires_grad}
    before = pol.trainable_state()
    opt = torch.optim.Adam([p for p in pol.parameters() if p.requires_grad], lr=1e-2)
    _, _, batch = rollout(pol, max_new=6, n=1)
    logp, _, _ = pol.score(batch, slice(0, 4))
    (-(logp * batch.mask).sum()).backward()
    opt.step()
    assert all(torch.equal(p, base[k]) for k, p in pol.named_parameters() if not p.requires_grad)
    moved = {k for k, p in pol.named_parameters() if p.requires_grad and not torch.equal(p, before[k])}
    assert moved == {k for k in trained if ".lora_B." in k}  # lora_A's gradient is 0 while lora_B is still 0


def test_lora_targets_comma_list_and_unknown_name(tiny):
    pol = policy(tiny, lora_targets="q_proj, v_proj", lora_rank=4)
    assert len(pol.trainable_state()) == 2 * 2 * 2
    with pytest.raises(utils.ConfigError, match="linear layers are down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"):
        policy(tiny, lora_targets="q_proj,qkv_proj")


def test_export_writes_an_adapter_or_a_merged_model_and_never_into_a_directory_that_holds_anything(tiny, tmp_path):
    pol = policy(tiny)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="that directory is not empty"):
        pol.export(str(tmp_path / "mine"))  # validate() checked it; something was put there since
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert pol.export(str(tmp_path / "adapter")) == str(tmp_path / "adapter")  # LoRA: the adapter by default
    assert (tmp_path / "adapter" / "adapter_config.json").is_file() and not (tmp_path / "adapter" / "config.json").exists()
    assert pol.export(str(tmp_path / "full"), merged=True) == str(tmp_path / "full")
    assert (tmp_path / "full" / "config.json").is_file() and not (tmp_path / "full" / "adapter_config.json").exists()


def test_adapter_config_is_peft_s_own_for_lora_and_empty_for_full_fine_tuning(tiny):
    config = json.loads(policy(tiny, lora_rank=4, lora_alpha=8).adapter_config())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}  # all-linear: every projection of a Llama layer
    assert policy(tiny, lora=False).adapter_config() == ""  # workers then receive whole weights


def test_ref_logp_without_a_reference_is_refused_rather_than_scoring_the_policy(tiny):
    pol = policy(tiny, lora=False)  # full fine-tuning keeps a frozen copy only when kl_coef > 0
    _, _, batch = rollout(pol, max_new=2, n=1)
    with pytest.raises(utils.ConfigError, match=r"^ref_logp under full fine-tuning needs kl_coef > 0"):
        pol.ref_logp(batch, slice(None))


def test_ref_logp_is_the_base_model_with_the_adapter_off(tiny):
    pol = policy(tiny)
    _, _, batch = rollout(pol, max_new=8, n=1)
    rows, mask = slice(0, 4), batch.mask > 0
    assert torch.equal(pol.ref_logp(batch, rows), pol.score(batch, rows)[0].detach())  # lora_B == 0: adapter is a no-op
    randomise_adapter(pol)
    ref = pol.ref_logp(batch, rows)
    assert (ref[mask] - batch.logp[mask]).abs().max() < 1e-5  # still the model that sampled
    assert (pol.score(batch, rows)[0][mask] - ref[mask]).abs().max() > 1e-3


def test_full_finetune_trains_everything_and_keeps_a_frozen_reference_only_with_kl(tiny):
    pol = policy(tiny, lora=False)
    assert pol.ref_model is None and len(pol.trainable_state()) == len(dict(pol.model.named_parameters()))
    with pytest.warns(UserWarning, match="frozen copy of the whole model"):
        pol = policy(tiny, lora=False, kl_coef=0.1)
    _, _, batch = rollout(pol, max_new=6, n=1)
    assert torch.equal(pol.ref_logp(batch, slice(0, 4)), pol.score(batch, slice(0, 4))[0].detach())
    assert not any(p.requires_grad for p in pol.ref_model.parameters())
    with pytest.raises(utils.ConfigError, match="lora=True"):
        pol.save_adapter("unused")


def test_bf16_autocast_runs_and_keeps_trainable_params_fp32(tiny):
    pol = policy(tiny, dtype="bf16")
    randomise_adapter(pol)
    assert {p.dtype for p in pol.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in pol.parameters() if not p.requires_grad} == {torch.bfloat16}  # the frozen LoRA base
    _, samples, batch = rollout(pol, max_new=8, n=1)
    logp, entropy, _ = pol.score(batch, slice(0, 4))
    mask = batch.mask > 0
    assert logp.dtype == torch.float32 and (logp[mask] - batch.logp[mask]).abs().max() < 0.05  # bf16, not exact
    (logp * batch.mask).sum().backward()
    grads = [p.grad for p in pol.parameters() if p.requires_grad]
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_bf16_on_cpu_picks_eager_attention_and_skipping_peft_input_casts_changes_no_bit(tiny):
    assert policy(tiny).model.config._attn_implementation == "sdpa"
    pol = policy(tiny, dtype="bf16")
    assert pol.model.config._attn_implementation == "eager"  # auto: measured faster for bf16 on a CPU
    randomise_adapter(pol)
    _, _, batch = rollout(pol, max_new=8, n=1)
    lora = [m for m in pol.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert len(lora) == 14 and not any(m.cast_input_dtype_enabled for m in lora)
    fast = pol.score(batch, slice(0, 4))[0]
    for m in lora:
        m.cast_input_dtype_enabled = True  # PEFT's default: every input copied to fp32, then autocast back to bf16
    assert torch.equal(pol.score(batch, slice(0, 4))[0], fast)
    with pytest.raises(utils.ConfigError, match="--attn no_such_kernel: .*try --attn sdpa"):
        policy(tiny, attn="no_such_kernel")


# ---------------------------------------------------------------- weights in and out
def test_saved_adapter_reloads_in_peft_with_identical_logits(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pol = policy(tiny)
    randomise_adapter(pol)
    out = pol.save_adapter(str(tmp_path / "adapter"))
    assert sorted(os.listdir(out)) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 16
    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny), out)
    ids = torch.tensor([pol.encode_prompt("12+7=")])
    torch.testing.assert_close(again(input_ids=ids).logits, pol.model(input_ids=ids).logits, rtol=0, atol=1e-6)


def test_checkpoint_round_trip_restores_exactly_the_trained_tensors(tiny, tmp_path):
    pol = policy(tiny)
    randomise_adapter(pol)
    opt = torch.optim.Adam([p for p in pol.parameters() if p.requires_grad])
    ckpt = rundir.save_checkpoint(tmp_path, 3, pol, opt, {"wall_s": 0.0, "source": {}}, keep=1)
    fresh = policy(tiny)
    rundir.load_checkpoint(ckpt, fresh, torch.optim.Adam([p for p in fresh.parameters() if p.requires_grad]))
    a, b = pol.trainable_state(), fresh.trainable_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="does not match this policy"):
        fresh.load_trainable({k: v for k, v in list(a.items())[1:]})


def test_encode_prompt_plain_text_and_chat_template_with_thinking(tiny, tmp_path):
    pol = policy(tiny)
    tok = pol.tokenizer
    assert pol.encode_prompt("12") == [tok.bos_token_id] + tok.convert_tokens_to_ids(["1", "2"])
    path = tmp_path / "chat"
    shutil.copytree(tiny, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if enable_thinking %}?{% endif %}:"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert policy(str(path)).decode(policy(str(path)).encode_prompt("1+1")) == "<user>1+1:"
    assert policy(str(path), thinking=True).decode(policy(str(path), thinking=True).encode_prompt("1+1")) == "<user>1+1?:"
    assert policy(str(path), chat_template=False).encode_prompt("12") == pol.encode_prompt("12")
    # --thinking where no template reads it (SmolLM2's, none, or switched off) changed nothing, silently
    cfg["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}:"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for model, kw in ((str(path), {}), (tiny, {}), (str(path), {"chat_template": False})):
        with pytest.raises(utils.ConfigError, match="^--thinking: .* has no chat template that reads enable_thinking"):
            policy(model, thinking=True, **kw)


def test_policy_without_weights_holds_no_memory_yet_agrees_on_tokens_eos_and_adapter_names(tiny, tmp_path):
    path = variant(tiny, tmp_path, eos_token_id=[2, 7])  # a second end token only generation_config.json names
    full, light = policy(path), LLMPolicy(train.Config(model=path, vllm=True))  # what a --vllm worker builds
    assert {p.device.type for p in light.parameters()} == {"meta"}
    assert light.eos_ids == full.eos_ids == {2, 7} and light.pad_id == full.pad_id
    assert [light.encode_prompt(p) for p in PROMPTS] == [full.encode_prompt(p) for p in PROMPTS]
    assert light.wire_names() == full.wire_names()


# ---------------------------------------------------------------- GPT-2: Conv1D projections
@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A random-init GPT-2 (c_attn, c_proj, c_fc are transformers' Conv1D, not nn.Linear) with the
    character tokenizer, built here: no download."""
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    from modeldir import char_tokenizer

    path, tok = tmp_path_factory.mktemp("gpt2"), char_tokenizer(256)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=128, n_layer=2, n_head=2, **ids))
    lm.generation_config = GenerationConfig(**ids)
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("targets", ["c_attn,c_proj,c_fc", "all-linear"])
def test_gpt2_conv1d_projections_get_lora_and_sampled_logps_rescore_exactly(gpt2, targets):
    from transformers.pytorch_utils import Conv1D

    pol = policy(gpt2, lora_targets=targets, lora_rank=4)
    adapted = {n.removesuffix(".lora_A") for n, m in pol.model.named_modules() if n.endswith(".lora_A")}
    assert adapted == {f"base_model.model.transformer.h.{i}.{m}" for i in range(2)
                       for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert all(isinstance(pol.model.get_submodule(n).base_layer, Conv1D) for n in adapted)
    randomise_adapter(pol)
    _, samples, batch = rollout(pol, max_new=10, n=2)
    mask = batch.mask > 0
    assert mask.sum() == sum(len(s.ids) for s in samples) > 8
    torch.testing.assert_close(pol.score(batch, slice(None))[0].detach()[mask], batch.logp[mask], rtol=0, atol=1e-5)


def test_gpt2_grpo_update_changes_only_the_adapters(gpt2):
    pol = policy(gpt2, lora_targets="c_attn,c_proj,c_fc", lora_rank=4)
    randomise_adapter(pol)  # lora_B != 0, so lora_A gets a gradient too
    base = {k: p.detach().clone() for k, p in pol.named_parameters() if not p.requires_grad}
    before = pol.trainable_state()
    _, _, batch = rollout(pol, max_new=6, n=2)  # rewards 0..7: every group has a spread
    rewards = batch.rewards.sum(1).view(-1, 2)  # [4 prompts, 2]
    adv = ((rewards - rewards.mean(1, keepdim=True)) / rewards.std(1, keepdim=True)).view(-1, 1) * batch.mask
    logp, _, _ = pol.score(batch, slice(None))
    opt = torch.optim.Adam(pol.trained.values(), lr=1e-2)
    policy_loss(logp, batch.logp, adv, loss_weights(batch.mask), batch.mask)[0].backward()
    opt.step()
    assert all(torch.equal(p, base[k]) for k, p in pol.named_parameters() if not p.requires_grad)
    assert all(not torch.equal(p, before[k]) for k, p in pol.trained.items())  # every A and B moved


def test_gpt2_completions_and_episodes_end_where_its_learned_positions_do(gpt2, tiny):
    """Past GPT-2's n_positions (256 here) a forward raised IndexError: a long prompt plus --max-new-tokens
    crashed the run, and a multi-turn episode under --max-len 2048 too. Now completions stop at the last
    position, truncated, and rescore exactly; a prompt that fills every position is one line. Rotary
    models (the tiny Llama) have no learned positions (their context: the next test)."""
    pol = policy(gpt2)
    assert pol.positions == 256 and policy(tiny).positions is None
    prefixes = [[1] + [5] * 247, [1] + [6] * 100]  # 248 and 101 tokens: room for 8 more in one call
    torch.manual_seed(0)
    samples = pol.generate(prefixes, 40)
    assert all(len(s.ids) == 8 and s.truncated or s.ids[-1] in pol.eos_ids for s in samples)
    assert max(len(p) + len(s.ids) for p, s in zip(prefixes, samples)) <= 256
    batch = make_batch(prefixes, samples, [0.0, 0.0], pol.pad_id)
    mask = batch.mask > 0
    torch.testing.assert_close(pol.score(batch, slice(None))[0][mask], batch.logp[mask], rtol=0, atol=1e-5)
    with pytest.raises(utils.ConfigError, match="^a prompt of 256 tokens fills all 256 positions of the model's context"):
        pol.generate([[5] * 256], 4)
    with pytest.raises(utils.ConfigError, match="^a prompt of 257 tokens fills all 256"):
        pol.generate([[5] * 257], 4)
    last, = pol.generate([[5] * 255], 4)  # room for exactly one token
    assert len(last.ids) == 1 and (last.truncated or last.ids[0] in pol.eos_ids)
    for bad in (([[1, 2]], 0), ([[1, 2], []], 4)):  # validate() and the rollouts never pass these
        with pytest.raises(ValueError, match="^generate needs max_new_tokens >= 1"):
            pol.generate(*bad)
    cfg = train.Config(task="countdown_multiturn", model=gpt2, algo="grpo", batch=2, group_size=2, eval_size=1,
                       max_new_tokens=64, max_turns=4)  # max_len 2048: an episode would run past 256
    torch.manual_seed(0)
    episodes = rollouts.EnvRollouts(cfg, pol).next(0)
    assert int(episodes.attn.sum(1).max()) <= 256 and episodes.truncated.all()


def test_a_rotary_models_episodes_end_at_its_context_as_an_async_trainers_inbox_expects(tmp_path):
    """Under --max-len 2048 a multi-turn episode of a rotary model ran past its context (315 tokens on a
    300-token tiny Llama), silently, while an async trainer's inbox refused such episodes; a completion too.
    Now they end at the context, truncated; an eval problem that fills it stops the source when it is built,
    naming the context, not --max-len (it stopped the step-0 eval: "a prompt has N tokens, not fewer than ...")."""
    cfg = train.Config(task="countdown_multiturn", algo="grpo", batch=2, group_size=2, eval_size=1,
                       max_new_tokens=40, max_turns=4)  # max_len 2048
    dims = dict(layers=1, hidden=64, heads=1, intermediate=128)
    pol = policy(build_tiny_model(str(tmp_path / "300"), max_len=300, **dims))
    assert pol.model.config.max_position_embeddings == 300 and pol.positions is None
    torch.manual_seed(0)
    episodes = rollouts.EnvRollouts(cfg, pol).next(0)
    assert int(episodes.attn.sum(1).max()) == 300 and episodes.truncated.all()
    (single,) = pol.generate([[1] + [5] * 249], 100)  # a single-turn completion ends there too (it ran to 350)
    assert len(single.ids) == 50 and single.truncated or single.ids[-1] in pol.eos_ids
    short = policy(build_tiny_model(str(tmp_path / "64"), max_len=64, **dims))
    with pytest.raises(utils.ConfigError, match=r"^--task countdown_multiturn: the eval problem '.*' has no room for "
                       r"a turn: prompt of 2\d\d tokens after the chat template; the model's 64-token context less "
                       r"--max-new-tokens 40 leaves 24: the prompt alone fills the model's context$"):
        rollouts.EnvRollouts(cfg, short)


def test_a_merged_export_with_gpt2s_tied_embedding_adapted_gives_the_policys_logits(gpt2, tmp_path):
    """GPT-2's head is its wte: LoRA on wte adapts the lookup only, and merging into the shared weight
    changed the head as well (tests/test_real_model.py: the same for SmolLM2)."""
    from transformers import AutoModelForCausalLM

    pol = policy(gpt2, lora_targets="c_attn,wte", lora_rank=4)
    g = torch.Generator().manual_seed(1)
    pol.load_trainable({n: torch.randn(t.shape, generator=g) * 0.1 for n, t in pol.trainable_state().items()})
    ids = torch.tensor([pol.encode_prompt("12+7=")])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(pol.export(str(tmp_path / "merged"), merged=True))
        torch.testing.assert_close(merged(input_ids=ids).logits, pol.model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_lora_target_errors_list_what_the_model_has(gpt2):
    with pytest.raises(utils.ConfigError, match=r"--lora-targets q_proj: no layer named q_proj; this model's "
                       r"linear layers are c_attn,c_fc,c_proj \(or all-linear\); other layers LoRA can adapt "
                       r"when named: wpe,wte$"):
        policy(gpt2, lora_targets="q_proj")
    pol = policy(gpt2, lora_targets="c_attn,wte", lora_rank=4)  # an embedding, because it was named
    assert any(".wte.lora_embedding_A" in k for k in pol.trained)

    class NoProjections(torch.nn.Module):  # nothing PEFT's LoRA can adapt
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(4)

        def get_output_embeddings(self):
            return None

    with pytest.raises(utils.ConfigError, match="no layer LoRA adapts, only LayerNorm,NoProjections$"):
        add_lora(NoProjections(), train.Config(lora_targets="all-linear"))
