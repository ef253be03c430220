"""nanorl: one training loop for REINFORCE, PPO, GRPO, RLOO and friends.

    python train.py --task cartpole --algo reinforce
    python train.py --config configs/cartpole_ppo.yaml --steps 50
    torchrun --nproc_per_node=4 train.py --config configs/arith_tiny_cpu.yaml   # data parallel, same --batch

Every step is five stages: (1) rollout: get a batch, (2) advantage: score it under the
weights that sampled it and call the algorithm's estimator, (3) update: the clipped surrogate
over inner epochs, (4) publish: hand the new weights to whoever generates, (5) log, evaluate,
checkpoint. Synchronous and asynchronous training differ only in the object that returns
batches in stage 1.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import utils
from algos import (AGGREGATIONS, ALGOS, GROUPED, IS_LEVELS, KL, LOSSES, EPS, group_baseline, importance_correction,
                   loss_weights, masked_mean, policy_loss, value_loss)
import serve
import tasks
from envs import EVAL_SEED, TEXT_ENVS, CartPole, multiturn_metrics, rollout_multiturn
from model import LLMPolicy, MLPPolicy, Sample


@dataclass
class Config:
    """nanorl training run. Every flag below is a field of train.Config."""

    task: str = "cartpole"  # cartpole is the seconds-long sanity check; LLM tasks live in tasks.py
    algo: str = "reinforce"  # one of algos.ALGOS; the rest of the loop does not care which
    seed: int = 0  # seeds torch and the training-episode stream; eval seeds never depend on it
    steps: int = 200  # optimizer steps; CartPole REINFORCE needs ~40, so this is a safe ceiling
    batch: int = 16  # episodes (or prompts) per step: 16 episodes give a low-noise gradient at ~no cost in lockstep
    group_size: int = 1  # rollouts per prompt/start state; GRPO/RLOO need >= 2 to form a baseline
    lr: float = 0.005  # CartPole REINFORCE, 8 seeds: 5e-3 solved all (median 33k env steps); 1e-2 left one at 600k
    gamma: float = 0.99  # CartPole's 500-step horizon wants a long (~100-step) credit window
    lam: float = 0.95  # GAE bias/variance trade-off; 0.95 is the PPO paper's value and rarely worth tuning
    loss: str = "ppo"  # ppo (token ratio), gspo (sequence ratio: use eps ~3e-4/4e-4) or cispo (clipped IS weight, no token loses its gradient)
    eps_low: float = 0.2  # ratio clip below 1; irrelevant while the ratio is exactly 1 (one epoch, one minibatch)
    eps_high: float = 0.2  # ratio clip above 1; DAPO's clip-higher (0.28) lets unlikely tokens grow, keeping entropy up
    dual_clip: float = 0.0  # caps a negative-advantage token's loss at c*|A| (c > 1, e.g. 3) when its ratio explodes; 0 = off
    loss_agg: str = "token_mean"  # token_mean (DAPO), seq_mean (GRPO paper: long answers weigh less) or constant (Dr. GRPO: no length bias)
    loss_agg_constant: int = 0  # the constant mode's tokens per row; 0 = max_new_tokens
    inner_epochs: int = 1  # passes over each batch; >1 makes the update off-policy (PPO uses 4)
    minibatches: int = 1  # optimizer steps per epoch; 1 keeps the first-epoch ratio exactly 1
    micro_batch: int = 0  # rows per forward/backward (0 = the whole minibatch); only memory changes
    max_grad_norm: float = 1.0  # clips rare huge-return batches that would otherwise undo learning
    ent_coef: float = 0.0  # entropy bonus; CartPole solves without it
    vf_coef: float = 0.5  # value-loss weight for PPO's critic (separate trunk, so it rarely matters)
    vf_clip: float = 0.0  # keeps new values within this distance of the pre-update ones (PPO value clipping); 0 = off
    critic_max_grad_norm: float = 0.0  # > 0 clips the critic's own parameters separately (the actor keeps max_grad_norm); 0 = one clip
    dr_grpo: bool = False  # GRPO without std scaling (Dr. GRPO): no up-weighting of near-uniform groups
    hidden: int = 64  # MLP width: CartPole needs little, and small is fast
    eval_every: int = 5  # steps between greedy evals; one 10-episode eval costs about one step
    eval_episodes: int = 10  # held-out greedy episodes per eval (the solve criterion uses 10)
    target: float = 0.0  # stop once the headline eval metric (eval_return / eval_accuracy) reaches it; 0 = never
    out: str = ""  # run directory; empty = runs/<task>-<algo>-<timestamp>
    resume: str = ""  # a run directory to continue from its newest checkpoint
    ckpt_every: int = 50  # steps between checkpoints (a final one is always written)
    keep_ckpts: int = 3  # older checkpoints are deleted; 3 survives one corrupt write with margin
    progress: bool = True  # tqdm progress bar; --no-progress for logs and CI
    # ---- language-model tasks (everything below is ignored by cartpole)
    model: str = "tiny"  # HF hub id or local dir; "tiny" builds a small Llama locally, no download
    lora: bool = True  # LoRA: ~1% of the weights train and the KL reference costs no memory
    lora_rank: int = 16  # rank 16 is where RL fine-tuning results stop improving in most reports
    lora_alpha: int = 32  # alpha = 2 x rank keeps the update scale stable when the rank changes
    lora_targets: str = "all-linear"  # every linear projection the model has, found from the model
    dtype: str = "fp32"  # bf16 on GPUs halves memory; trained parameters stay fp32 either way
    attn: str = "auto"  # sdpa, eager, flash_attention_2, ...; auto: eager for bf16 on a CPU (faster to 512 tokens; holds T x T scores), else sdpa
    temperature: float = 1.0  # applied to the logits of both sampling and scoring, so ratios stay exact
    top_p: float = 1.0  # < 1 samples from a distribution the loss does not model (warned)
    max_new_tokens: int = 256  # completion budget; a truncated completion gets no end token
    gen_batch: int = 64  # sequences per generation call; bigger is faster until memory runs out
    kl_coef: float = 0.0  # KL to the reference; RL-from-verifiable-rewards usually needs none
    kl_estimator: str = "k3"  # k1 (unbiased, can go negative), k2 (low variance, biased) or k3 (unbiased, >= 0)
    kl_in_reward: bool = False  # subtract kl_coef * KL from each token's reward before the advantage, instead of a loss term
    tis: str = "off"  # truncated IS against sampler/trainer mismatch: token or sequence ratio, capped at tis_cap
    tis_cap: float = 2.0  # the cap; 2 keeps the variance bounded while correcting typical vLLM-vs-trainer gaps
    mis: str = "off"  # masked IS: token or sequence whose sampler/trainer ratio leaves [mis_low, mis_high] is dropped
    mis_low: float = 0.5  # masked IS keeps ratios in [0.5, 2]: only tokens the two engines disagree on 2x or more go
    mis_high: float = 2.0  # the upper end, symmetric to mis_low in log space
    dynamic_sampling: bool = False  # drop groups whose rewards all agree (no GRPO/RLOO gradient) and draw more prompts (DAPO)
    max_gen_batches: int = 3  # dynamic sampling: generation rounds per step at most; a short batch trains when they run out
    prompt_reweight: float = 0.0  # share of each step's prompts replayed from recent prompts whose groups had reward spread
    mask_truncated: bool = False  # completions that hit max_new_tokens leave the loss (DAPO overlong filtering)
    chat_template: bool = True  # use the tokenizer's chat template when it has one
    thinking: bool = False  # enable_thinking for hybrid-thinking templates (Qwen3): long, slow answers
    eval_size: int = 100  # held-out problems; 100 gives a +-5% accuracy estimate
    pass_k: int = 0  # samples per eval problem for pass@k (0 = greedy accuracy only)
    data: str = ""  # local JSONL for gsm8k/math; empty = the datasets hub
    bad_rows: str = "skip"  # malformed data rows: skip (counted, reported with file:line) or error
    debug_samples: int = 0  # print this many (prompt, completion, reward breakdown) triples per eval
    sft_steps: int = 0  # supervised warm-start steps on the task's own solver's demos, before RL
    sft_lr: float = 1e-3  # warm-start learning rate (separate: supervised steps tolerate more)
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens of the budget; 0 = off
    max_turns: int = 4  # multi-turn envs: model turns per episode; each one is a chance to fix an error
    max_len: int = 2048  # multi-turn envs: an episode longer than this (tokens) ends early, cleanly
    # ---- torchrun (`torchrun --nproc_per_node=N train.py ...`: --batch stays the global batch)
    dist_timeout: float = 1800.0  # seconds a rank waits in a collective before failing: > the longest checkpoint write
    # ---- disaggregated training (serve.py): a trainer process and any number of rollout workers
    role: str = "sync"  # sync: one process; trainer + rollout: generation moves to workers that may come and go
    trainer_url: str = ""  # rollout: the trainer's url; trainer: where to listen (empty = 127.0.0.1, a free port)
    vllm: bool = False  # rollout workers generate with vLLM (LoRA only: a full model per sync would be too slow)
    max_staleness: int = 2  # steps a sample may lag the weights it trains on; 2 keeps workers busy, ratios near 1
    workers: int = 0  # rollout workers the trainer starts on its own machine (others may join)
    worker_patience: float = 60.0  # seconds a worker waits for an unreachable trainer before exiting 0


def validate(cfg: Config) -> None:
    """Rejects impossible combinations up front, naming the fix."""
    err = utils.ConfigError
    if cfg.algo not in ALGOS:
        raise err(f"unknown --algo '{cfg.algo}'{utils.closest(cfg.algo, ALGOS)} (choices: {', '.join(ALGOS)})")
    if cfg.task not in TASKS:
        raise err(f"unknown --task '{cfg.task}'{utils.closest(cfg.task, TASKS)} (choices: {', '.join(TASKS)})")
    if cfg.algo in GROUPED and cfg.group_size < 2:
        raise err(f"--algo {cfg.algo} needs --group-size >= 2 (got {cfg.group_size}); try --group-size 8")
    if cfg.batch < 1 or cfg.batch % cfg.group_size:
        raise err(f"--batch {cfg.batch} must be a positive multiple of --group-size {cfg.group_size}")
    if cfg.inner_epochs < 1 or cfg.minibatches < 1 or cfg.micro_batch < 0:
        raise err("--inner-epochs and --minibatches must be >= 1 and --micro-batch >= 0")
    if cfg.batch % cfg.minibatches:
        raise err(f"--minibatches {cfg.minibatches} must divide --batch {cfg.batch}")
    # torchrun: each rank takes batch / W rows of whole groups (an async trainer splits its queue's batch alike)
    unit = utils.world() * math.lcm(cfg.group_size, cfg.minibatches)
    if cfg.batch % unit:
        raise err(f"--batch {cfg.batch} is the global batch: {utils.world()} ranks need a multiple of {unit} (ranks x "
                  f"whole groups of --group-size x --minibatches); try --batch {unit * -(-cfg.batch // unit)}")
    if not (0 < cfg.gamma <= 1 and 0 <= cfg.lam <= 1 and cfg.lr > 0):
        raise err("need 0 < gamma <= 1, 0 <= lam <= 1 and lr > 0")
    for name, valid in {"loss": LOSSES, "loss_agg": AGGREGATIONS, "kl_estimator": KL, "tis": IS_LEVELS, "mis": IS_LEVELS}.items():
        if getattr(cfg, name) not in valid:
            value = getattr(cfg, name)
            raise err(f"unknown --{name.replace('_', '-')} '{value}'{utils.closest(value, valid)} (choices: {', '.join(valid)})")
    if not (0 < cfg.eps_low <= 1 and cfg.eps_high > 0) or 0 < cfg.dual_clip <= 1:
        raise err(f"need 0 < eps_low <= 1, eps_high > 0 and dual_clip 0 (off) or > 1 (got {cfg.eps_low}, {cfg.eps_high}, {cfg.dual_clip})")
    if cfg.tis_cap < 1 or not 0 < cfg.mis_low <= 1 <= cfg.mis_high:
        raise err("need tis_cap >= 1 and mis_low <= 1 <= mis_high, so that agreeing sampler and trainer get weight 1")
    if cfg.kl_in_reward and not cfg.kl_coef:
        raise err("--kl-in-reward needs --kl-coef > 0 (e.g. 0.01)")
    if cfg.dynamic_sampling and (cfg.algo not in GROUPED or TASKS.get(cfg.task) is not TaskRollouts or cfg.max_gen_batches < 1):
        raise err(f"--dynamic-sampling needs a grouped --algo ({', '.join(sorted(GROUPED))}), a single-turn LLM task and --max-gen-batches >= 1")
    if not 0 <= cfg.prompt_reweight <= 1 or (cfg.prompt_reweight and TASKS.get(cfg.task) is not TaskRollouts):
        raise err(f"--prompt-reweight is a share in [0, 1] for single-turn LLM tasks (got {cfg.prompt_reweight})")
    if cfg.mask_truncated and cfg.task in CONTROL:
        raise err("--mask-truncated is for LLM tasks; CartPole's time limit is already handled by bootstrapping")
    if (cfg.vf_clip or cfg.critic_max_grad_norm) and cfg.algo != "ppo":
        raise err(f"--vf-clip and --critic-max-grad-norm tune PPO's critic, and the --algo {cfg.algo} policy has none; "
                  "use --algo ppo or drop them")
    if cfg.bad_rows not in ("skip", "error"):
        raise err(f"--bad-rows must be skip or error (got {cfg.bad_rows})")
    if cfg.resume and not Path(cfg.resume).is_dir():
        raise err(f"--resume {cfg.resume}: no such run directory")
    if cfg.role != "sync" and cfg.task in CONTROL:
        raise err(f"--role {cfg.role} is for LLM tasks; {cfg.task} runs in one process (--role sync)")
    if cfg.role not in ("sync", "trainer", "rollout"):
        raise err(f"--role must be sync, trainer or rollout (got {cfg.role!r})")
    if cfg.role == "rollout" and not cfg.trainer_url:
        raise err("--role rollout needs --trainer-url http://HOST:PORT (the trainer prints it when it starts)")
    if cfg.vllm and (cfg.role != "rollout" or not cfg.lora):
        raise err("--vllm is for --role rollout with --lora: with full fine-tuning every sync would ship the whole "
                  "model; drop --vllm to let the worker generate with its own copy of the policy")
    if cfg.max_staleness < 0 or cfg.workers < 0 or cfg.worker_patience <= 0:
        raise err("need --max-staleness >= 0, --workers >= 0 and --worker-patience > 0")


# ---------------------------------------------------------------- where batches come from
class ControlRollouts:
    """Synchronous batches from a gymnasium control env. The seed position is part of the
    checkpoint so that a resumed run sees exactly the episodes it would have seen."""

    def __init__(self, cfg: Config, policy):
        self.env, self.policy, self.cfg = CartPole(), policy, cfg
        self.position = 0  # training seeds used so far, one per rank per step

    def next(self, step: int) -> dict:
        """This rank's batch / W episodes, from its own seed (rank r of W uses position + r)."""
        seed = (self.cfg.seed * 100_003 + self.position + utils.rank()) % EVAL_SEED  # always below the eval seeds
        self.position += utils.world()
        n = self.cfg.batch // utils.world()
        batch = self.env.rollout(self.policy, n, seed, self.cfg.group_size)
        batch["version"] = torch.full((n,), step)
        return batch

    def evaluate(self) -> dict:
        """Not sharded: every rank plays the same greedy episodes, cheaper than sharding them."""
        batch = self.env.rollout(self.policy, self.cfg.eval_episodes, EVAL_SEED, greedy=True)
        return {"eval_return": batch["rewards"].sum(1).mean().item()}

    def publish(self, step: int) -> None:
        """Sync mode generates with the live weights, so there is nothing to send."""

    def state(self) -> dict:
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        self.position = state["position"]


class TaskRollouts:
    """Synchronous batches from a verifiable-reward task: batch / group_size prompts, group_size
    completions each, scored by the task's reward functions."""

    def __init__(self, cfg: Config, policy):
        self.cfg, self.policy = cfg, policy
        self.task = tasks.make_task(cfg.task, seed=cfg.seed, eval_size=cfg.eval_size, data=cfg.data or None,
                                    bad_rows=cfg.bad_rows)
        if cfg.overlong_buffer:
            count = lambda text: len(policy.tokenizer.encode(text, add_special_tokens=False))
            self.task.rewards.append((tasks.overlong_penalty(cfg.max_new_tokens, cfg.overlong_buffer, count), 1.0))
        self.position = 0  # training problems drawn so far, by all ranks together
        self.spread: list = []  # recent problems whose groups had reward spread (prompt_reweight replays them)

    def draw(self, n: int) -> list:
        """This rank's share of the next n problems: indices position + r, + r + W, ... (disjoint)."""
        problems = [self.task.train_problem(self.position + i) for i in range(utils.rank(), n, utils.world())]
        self.position += n
        return problems

    def pick(self, n: int) -> list:
        """This rank's share of the next n problems, its first prompt_reweight share swapped for
        recent prompts whose groups had reward spread (oldest first). The fresh ones it replaces
        are skipped, so every rank advances the stream alike."""
        fresh = self.draw(n)
        r = min(int(self.cfg.prompt_reweight * len(fresh)), len(self.spread))
        replay, self.spread = self.spread[:r], self.spread[r:]
        return replay + fresh[r:]

    def next(self, step: int) -> dict:
        cfg, k, want = self.cfg, self.cfg.group_size, self.cfg.batch // self.cfg.group_size
        need = want // utils.world()  # this rank's groups
        kept, flat, rounds = [], [], 0  # groups of k rows (problem, prefix, sample, text, (total, parts))
        # Dynamic sampling (DAPO): a group whose rewards all agree has zero advantage under GRPO and
        # RLOO, so it is set aside and fresh prompts are generated, at most max_gen_batches rounds.
        while len(kept) < need and rounds < (cfg.max_gen_batches if cfg.dynamic_sampling else 1):
            rounds += 1
            problems = self.pick(want)
            prefixes = [self.policy.encode_prompt(p.prompt) for p in problems]
            samples = iter(self.policy.generate([x for x in prefixes for _ in range(k)], cfg.max_new_tokens, cfg.gen_batch))
            for p, x in zip(problems, prefixes):
                texts = [(s, self.policy.decode(s.ids)) for s in itertools.islice(samples, k)]
                group = [(p, x, s, t, self.task.score(p.prompt, t, p.answer)) for s, t in texts]
                spread = len({total for *_, (total, _) in group}) > 1
                self.spread += [p] if spread and cfg.prompt_reweight else []
                (kept if spread or not cfg.dynamic_sampling else flat).append(group)
        self.spread = self.spread[-cfg.batch :]  # "recent": the last batch-many prompts with spread
        # Nothing informative within the bound: train on what there is (no GRPO/RLOO gradient).
        problems, prefixes, samples, texts, scored = zip(*[row for g in kept[:need] or flat[:need] for row in g])
        batch = self.policy.make_batch(list(prefixes), list(samples), [total for total, _ in scored])
        batch["group"] = torch.arange(len(problems)) // k  # [N]
        batch["version"] = torch.full((len(problems),), step)  # [N]
        self.breakdown = {f"reward_{name}": sum(b[name] for _, b in scored) / len(scored) for name in scored[0][1]}
        if cfg.dynamic_sampling:
            self.breakdown.update(gen_rounds=rounds, gen_frac_zero_std=len(flat) / (len(flat) + len(kept)))
        if step % cfg.eval_every == 0:
            for p, t, (total, parts) in list(zip(problems, texts, scored))[: cfg.debug_samples]:
                tqdm.write(f"--- step {step} prompt: {p.prompt!r}\n    completion: {t!r}\n    answer: {p.answer!r} reward {total:.3g}: {parts}")
        return batch

    def evaluate(self) -> dict:
        """Rank r of W scores eval problems r, r + W, ...; summed over ranks, as one process would."""
        problems, cfg = self.task.eval_problems()[utils.rank() :: utils.world()], self.cfg
        prefixes = [self.policy.encode_prompt(p.prompt) for p in problems]
        greedy = [self.policy.decode(s.ids) for s in self.policy.generate(prefixes, cfg.max_new_tokens, cfg.gen_batch, greedy=True)]
        sums = {"n": len(problems), "eval_accuracy": sum(self.task.correct(p, t) for p, t in zip(problems, greedy))}
        lenient = [self.task.lenient(p, t) for p, t in zip(problems, greedy)]
        if None not in lenient:  # the right answer anywhere, any format: what is left is format
            sums["eval_accuracy_lenient"] = sum(lenient)
        if cfg.pass_k:
            samples = self.policy.generate([x for x in prefixes for _ in range(cfg.pass_k)], cfg.max_new_tokens, cfg.gen_batch)
            hits = [self.task.correct(p, self.policy.decode(s.ids)) for p, s in zip([p for p in problems for _ in range(cfg.pass_k)], samples)]
            c = [sum(hits[i * cfg.pass_k : (i + 1) * cfg.pass_k]) for i in range(len(problems))]
            sums["eval_pass@1"] = sum(c) / cfg.pass_k
            sums[f"eval_pass@{cfg.pass_k}"] = sum(tasks.pass_at_k(cfg.pass_k, ci, cfg.pass_k) for ci in c)
        sums = utils.reduce_dict(sums)
        n = sums.pop("n")
        out = {k: v / n for k, v in sums.items()}
        for p, t in list(zip(problems, greedy))[: cfg.debug_samples]:
            _, parts = self.task.score(p.prompt, t, p.answer)
            tqdm.write(f"--- eval prompt: {p.prompt!r}\n    completion: {t!r}\n    answer: {p.answer!r} rewards: {parts}")
        return out

    def publish(self, step: int) -> None:
        """Sync mode generates with the live weights, so there is nothing to send."""

    def state(self) -> dict:
        replay = {"spread": [dataclasses.astuple(p) for p in self.spread]} if self.cfg.prompt_reweight else {}
        return {"position": self.position, **replay}

    def load_state(self, state: dict) -> None:
        self.position = state["position"]
        self.spread = [tasks.Problem(*p) for p in state.get("spread", [])]  # absent: prompt_reweight was off


class EnvRollouts(TaskRollouts):
    """Multi-turn episodes: the model acts, the environment replies, up to max_turns times. One
    episode is one token sequence; only the model's own tokens are trained."""

    def __init__(self, cfg: Config, policy):
        self.cfg, self.policy, self.env = cfg, policy, TEXT_ENVS[cfg.task]
        self.task = self.env.task(seed=cfg.seed, eval_size=cfg.eval_size)
        self.position, self.spread = 0, []

    def episodes(self, problems: list, k: int, greedy: bool = False) -> dict:
        cfg = self.cfg
        return rollout_multiturn(self.policy, self.env, problems, k, cfg.max_turns, cfg.max_new_tokens, cfg.max_len, greedy)

    def next(self, step: int) -> dict:
        batch = self.episodes(self.draw(self.cfg.batch // self.cfg.group_size), self.cfg.group_size)
        batch["version"] = torch.full((len(batch["mask"]),), step)  # [N]
        self.breakdown = multiturn_metrics(batch)
        return batch

    def evaluate(self) -> dict:
        """Rank r plays eval problems r, r + W, ...; per-rank means are weighted and summed over ranks."""
        problems = self.task.eval_problems()[utils.rank() :: utils.world()]
        m = multiturn_metrics(self.episodes(problems, 1, greedy=True)) if problems else dict.fromkeys(("solved", "solved_first_turn", "turns"), 0.0)
        s = utils.reduce_dict({"n": len(problems), **{k: v * len(problems) for k, v in m.items()}})
        return {"eval_accuracy": s["solved"] / s["n"], "eval_accuracy_first_turn": s["solved_first_turn"] / s["n"], "eval_turns": s["turns"] / s["n"]}


CONTROL = {"cartpole": ControlRollouts}
TASKS = {**CONTROL, **{name: TaskRollouts for name in tasks.TASKS}, **{name: EnvRollouts for name in TEXT_ENVS}}


def build(cfg: Config):
    torch.manual_seed(cfg.seed)
    if cfg.task in CONTROL:
        # A 64-unit MLP is too small to split across threads: one thread is ~3x faster than two
        # fighting over [16, 64] matmuls, and it leaves the other core to the environment.
        torch.set_num_threads(1)
        policy = MLPPolicy(CartPole.obs_dim, CartPole.n_actions, cfg.hidden, critic=cfg.algo == "ppo")
    else:
        policy = LLMPolicy(cfg.model, lora=cfg.lora, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                           lora_targets=cfg.lora_targets, dtype=cfg.dtype, temperature=cfg.temperature,
                           top_p=cfg.top_p, chat_template=cfg.chat_template, thinking=cfg.thinking, kl_coef=cfg.kl_coef,
                           critic=cfg.algo == "ppo", weights=not cfg.vllm, attn=cfg.attn)  # a vLLM worker's weights live in vLLM
    utils.broadcast_weights(policy)  # torchrun: every rank starts from rank 0's weights
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
    source = TASKS[cfg.task](cfg, policy)
    return policy, opt, serve.AsyncRollouts(cfg, policy, source) if cfg.role == "trainer" else source


def warm_start(policy, source: TaskRollouts, cfg: Config, log: utils.Metrics) -> None:
    """Optional supervised stage before RL: cross-entropy on demonstrations written by the
    task's own solver (never by a model), so the RL gain on top can be reported separately."""
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.sft_lr)
    eos = policy.tokenizer.eos_token_id
    for i in range(cfg.sft_steps):
        problems = source.draw(cfg.batch)
        prefixes = [policy.encode_prompt(p.prompt) for p in problems]
        demos = [policy.tokenizer.encode(source.task.solve(p), add_special_tokens=False) + [eos] for p in problems]
        batch = policy.make_batch(prefixes, [Sample(d, [0.0] * len(d), False) for d in demos], [0.0] * len(demos))
        opt.zero_grad(set_to_none=True)
        loss, tokens = torch.zeros(()), utils.all_sum(batch["mask"].sum())  # every rank's demo tokens
        for rows in micro_slices(torch.arange(len(demos)), cfg.micro_batch):
            part = -(policy.score(batch, rows)[0] * batch["mask"][rows]).sum() / tokens
            part.backward()
            loss += part.detach()
        utils.sum_grads(policy)
        opt.step()
        log.log(-cfg.sft_steps + i + 1, {"sft_loss": utils.all_sum(loss).item()})


# ---------------------------------------------------------------- one step
def micro_slices(rows: torch.Tensor, size: int):
    size = size or len(rows)
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def single_pass(cfg: Config) -> bool:
    """One epoch of one minibatch, on-policy: the scoring forward doubles as the old policy."""
    return cfg.inner_epochs == 1 and cfg.minibatches == 1


def rollout_metrics(batch: dict, rewards: torch.Tensor, cfg: Config) -> dict:
    """What the batch looked like, before any update: logged every step."""
    mask = batch["mask"]
    score, length = (rewards * mask).sum(1), mask.sum(1)  # [N] task reward (before any KL penalty), [N] steps
    out = {"reward_mean": score.mean(), "reward_std": score.std(correction=0), "adv_mean": masked_mean(batch["adv"], mask),
           "adv_std": masked_mean((batch["adv"] - masked_mean(batch["adv"], mask)) ** 2, mask).sqrt(),
           "length_mean": length.mean(), "length_max": length.max()}
    if "truncated" in batch:
        out["truncated_frac"] = batch["truncated"].float().mean()
    if cfg.group_size > 1:  # a group whose rewards all agree gives GRPO/RLOO nothing to learn from
        out["frac_zero_std"] = (group_baseline(score, batch["group"])[1] < EPS).float().mean()
    return {k: float(v) for k, v in out.items()}


@torch.no_grad()
def prepare(policy, batch: dict, cfg: Config) -> dict:
    """Stage 2: old log-probs and values under the weights before this update, then advantages,
    loss weights and batch["metrics"] (floats for the log). Old log-probs are recomputed here
    rather than trusted from the sampler, with the same micro-batches the update uses, so the first
    epoch's ratio is exactly 1; the sampler's own log-probs (`sampler_logp`, else `logp`) only
    enter the mismatch corrections (tis / mis)."""
    n, mask = len(batch["mask"]), batch["mask"]
    correct = cfg.tis != "off" or cfg.mis != "off"
    if policy.has_critic or ((not single_pass(cfg) or correct) and "old_logp" not in batch):
        parts = [policy.score(batch, rows) for rows in micro_slices(torch.arange(n), cfg.micro_batch)]
        # An async source already scored each row under the version that sampled it: keep that.
        batch.setdefault("old_logp", torch.cat([p[0] for p in parts]) * mask)
        if policy.has_critic:
            batch["values"] = torch.cat([p[2] for p in parts]) * mask
            if "last_obs" in batch:
                batch["last_value"] = policy.value(batch["last_obs"])
            else:  # a completion ends with its end token or its budget: there is no next state to bootstrap
                batch["last_value"], batch["terminated"] = torch.zeros(n), torch.ones(n, dtype=torch.bool)
    if cfg.kl_coef:
        batch["ref_logp"] = torch.cat([policy.ref_logp(batch, rows) for rows in micro_slices(torch.arange(n), cfg.micro_batch)])
    rewards, metrics = batch["rewards"], {}
    if cfg.kl_in_reward:  # the penalty becomes part of the return, so every estimator sees it
        kl = KL[cfg.kl_estimator](batch.get("old_logp", batch["logp"]), batch["ref_logp"]) * mask  # [N, T]
        batch["rewards"], metrics["kl"] = rewards - cfg.kl_coef * kl, masked_mean(kl, mask).item()
    batch["adv"] = ALGOS[cfg.algo](batch, cfg)
    keep = mask * ~batch["truncated"][:, None] if cfg.mask_truncated else mask  # [N, T]
    if correct:
        sampler = batch["sampler_logp"] if "sampler_logp" in batch else batch["logp"]  # sync: the sampler is this policy
        batch["is_weight"], kept, s = importance_correction(batch["old_logp"], sampler, mask, cfg.tis, cfg.tis_cap,
                                                            cfg.mis, cfg.mis_low, cfg.mis_high)
        keep, metrics = keep * kept, {**metrics, **s}
    batch["loss_mask"] = keep
    # Global denominators: under torchrun the totals are every rank's (utils.batch_totals).
    batch["weights"] = loss_weights(keep, cfg.loss_agg, **utils.batch_totals(keep), constant=cfg.loss_agg_constant or cfg.max_new_tokens)
    # Means over ranks (equal rows per rank): exact for means and fractions, a per-rank average for std and max.
    batch["metrics"] = utils.reduce_dict({**rollout_metrics(batch, rewards, cfg), **metrics}, mean=True)
    return batch


def update(policy, opt, batch: dict, cfg: Config) -> dict:
    """Stage 3: inner epochs x minibatches of the policy loss, each minibatch accumulated over
    micro-batches whose loss weights share one global denominator."""
    n = len(batch["mask"])
    critic = list(policy.v.parameters()) if policy.has_critic and cfg.critic_max_grad_norm else []
    actor = [p for p in policy.parameters() if p.requires_grad and all(p is not c for c in critic)]
    stats, means, updates = {"loss": 0.0, "grad_norm": 0.0, "skipped": 0}, {}, 0
    unit = batch["loss_mask"] if cfg.loss_agg == "token_mean" else (batch["loss_mask"].sum(1) > 0).float()  # what a denominator counts
    for _ in range(cfg.inner_epochs):
        order = torch.randperm(n) if cfg.minibatches > 1 else torch.arange(n)
        for mb in order.chunk(cfg.minibatches):
            # A minibatch is weighted as if it were the batch: by its share of the tokens (token_mean)
            # or of the rows (seq_mean, constant), over all ranks. One minibatch keeps the weights as they are.
            share = 1.0 if cfg.minibatches == 1 else utils.all_sum(unit[mb].sum()) / utils.all_sum(unit.sum())
            tokens = utils.all_sum(batch["loss_mask"][mb].sum()).clamp(min=1)  # logged stats are token means in every mode
            opt.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for rows in micro_slices(mb, cfg.micro_batch):
                logp, entropy, values = policy.score(batch, rows)
                w = batch["weights"][rows] / share  # [n, T]
                old = batch["old_logp"][rows] if "old_logp" in batch else logp.detach()
                isw = batch["is_weight"][rows] if "is_weight" in batch else 1.0  # truncated IS, policy term only
                loss, s = policy_loss(logp, old, batch["adv"][rows], w * isw, batch["mask"][rows], cfg.loss,
                                      cfg.eps_low, cfg.eps_high, cfg.dual_clip)
                loss = loss - cfg.ent_coef * (entropy * w).sum()
                s["entropy"] = entropy.detach()
                if values is not None:
                    loss = loss + cfg.vf_coef * value_loss(values, batch["returns"][rows], w, batch["values"][rows], cfg.vf_clip)
                if cfg.kl_coef and not cfg.kl_in_reward:
                    kl = KL[cfg.kl_estimator](logp, batch["ref_logp"][rows])  # [n, T]
                    loss, s["kl"] = loss + cfg.kl_coef * (kl * w).sum(), kl.detach()
                loss.backward()
                total += loss.detach()
                for k, v in s.items():  # this rank's share of the minibatch's token means
                    means[k] = means.get(k, 0.0) + ((v * batch["loss_mask"][rows]).sum() / tokens).item()
            utils.sum_grads(policy)  # torchrun: every rank now holds the whole batch's gradient
            total = utils.all_sum(total)  # so that all ranks agree on skipping a non-finite step
            norm = torch.nn.utils.clip_grad_norm_(actor, cfg.max_grad_norm)
            # The critic may get its own clip, so that neither gradient's scale crowds out the other.
            critic_norm = torch.nn.utils.clip_grad_norm_(critic, cfg.critic_max_grad_norm) if critic else torch.zeros(())
            if not (torch.isfinite(total) and torch.isfinite(norm) and torch.isfinite(critic_norm)):
                opt.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights
                stats["skipped"] += 1
            else:
                opt.step()
            stats["loss"] += total.item()
            stats["grad_norm"] += norm.item()
            if critic:
                stats["critic_grad_norm"] = stats.get("critic_grad_norm", 0.0) + critic_norm.item()
            updates += 1
    stats.update(utils.reduce_dict(means))  # summed over ranks
    return {**{k: v / updates if k != "skipped" else v for k, v in stats.items()}, **batch["metrics"]}


# ---------------------------------------------------------------- the loop
def run_dir(cfg: Config) -> Path:
    if cfg.resume:
        return Path(cfg.resume)
    return Path(cfg.out or f"runs/{cfg.task}-{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}")


def train(cfg: Config) -> Path:
    validate(cfg)
    policy, opt, source = build(cfg)
    lead = utils.rank() == 0  # under torchrun only rank 0 writes: logs, checkpoints, the plot
    out = run_dir(cfg)
    start, wall = 0, 0.0
    if cfg.resume:  # every rank reads the checkpoint: multi-node runs need --out on shared storage
        meta = utils.load_checkpoint(utils.latest_checkpoint(out), policy, opt)
        start, wall = meta["step"], meta["wall_s"]
        source.load_state(meta["source"])
    utils.split_rng()  # after any restored RNG state: ranks must not sample identical tokens
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        utils.save_config(cfg, out / "config.yaml")
    log = utils.Metrics(out, wall_offset=wall) if lead else utils.NoMetrics()
    if cfg.sft_steps and not cfg.resume:
        log.log(-cfg.sft_steps, {f"{k}_before_sft": v for k, v in source.evaluate().items()})
        warm_start(policy, source, cfg, log)
    if start == 0:
        log.log(0, source.evaluate())  # the starting point of the RL curve

    def checkpoint(step: int) -> None:
        if lead:
            utils.save_checkpoint(out, step, policy, opt, {"wall_s": log.wall(), "source": source.state()}, cfg.keep_ckpts)

    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (cfg.progress and lead), dynamic_ncols=True)
    step, last_eval, interrupted = start, {}, []

    def on_ctrl_c(*_):  # the first finishes the step, then checkpoints: a half-applied update is never saved
        if interrupted:  # the second stops at once, e.g. a trainer waiting for workers that never come
            raise KeyboardInterrupt
        interrupted.append(True)
        utils.stderr("Ctrl-C: finishing this step, then saving a checkpoint; press Ctrl-C again to stop at once")

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        for step in bar:
            batch = source.next(step)  # 1. rollout
            batch = prepare(policy, batch, cfg)  # 2. advantage
            stats = update(policy, opt, batch, cfg)  # 3. update
            source.publish(step + 1)  # 4. publish
            rollout = {"reward": (batch["rewards"] * batch["mask"]).sum(1).mean().item(),  # 5. log
                       "steps_env": batch["mask"].sum().item() * utils.world(), **getattr(source, "breakdown", {})}
            stats.update(utils.reduce_dict(rollout, mean=True))  # equal rows per rank: mean of means = batch mean
            log.log(step + 1, stats)
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                last_eval = source.evaluate()
                log.log(step + 1, last_eval)
            bar.set_postfix(reward=f"{stats['reward']:.1f}", **{k: f"{v:.3g}" for k, v in last_eval.items()})
            solved = cfg.target and max(last_eval.get(k, -math.inf) for k in ("eval_return", "eval_accuracy")) >= cfg.target
            if utils.reduce_dict({"stop": bool(interrupted)})["stop"]:  # a Ctrl-C seen by one rank stops all at this step
                interrupted.append(True)
            if (step + 1) % cfg.ckpt_every == 0 or solved or interrupted or step + 1 == cfg.steps:
                checkpoint(step + 1)
            if solved or interrupted:
                break
        if interrupted:
            utils.stderr(f"interrupted: checkpoint saved; continue with --resume {out}")
    except KeyboardInterrupt:
        utils.stderr(f"stopped during step {step + 1}, which is not saved; the checkpoints in {out} are intact "
                     f"(--resume {out})")
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
        bar.close()
        log.close()
        if hasattr(source, "close"):  # the trainer tells its workers the run is over
            source.close()
    if lead:
        utils.plot(out, keys=("reward", "eval_return", "eval_accuracy", "eval_accuracy_lenient"))
    return out


def main(argv: list[str]) -> int:
    try:
        cfg = utils.load_config(Config, argv)
        if cfg.role == "rollout":  # a worker generates and never trains
            validate(cfg)
            return serve.run_worker(cfg, build)
        utils.init_distributed(cfg.dist_timeout)
        out = train(cfg)
        if utils.rank() == 0:
            print(f"run saved to {out}")
    except utils.ConfigError as e:
        utils.stderr(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        return 130  # the shell's code for a run stopped by Ctrl-C
    except Exception as e:
        if utils.world() > 1:  # say which rank broke before torchrun's teardown buries it
            utils.stderr(f"error: rank {utils.rank()} of {utils.world()} failed ({type(e).__name__}: {e}); torchrun stops the other ranks")
        raise
    finally:
        utils.close_distributed()
    return 0


if __name__ == "__main__":
    utils.exit_process(utils.record(main)(sys.argv[1:]))
