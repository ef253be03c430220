"""nanorl: one training loop for REINFORCE, PPO, GRPO, RLOO and friends.

    python train.py --task cartpole --algo reinforce
    python train.py --config configs/cartpole_ppo.yaml --steps 50
    torchrun --nproc_per_node=4 train.py --config configs/arith_tiny_cpu.yaml   # data parallel, same --batch

Every step is five stages (train()'s numbered lines): rollout a rollouts.Batch, score it under the
weights that sampled it and estimate advantages, update (the clipped surrogate), publish the new weights,
log / evaluate / checkpoint. Sync and async differ only in the batch source, never in the loop.
"""
import contextlib
import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

import report
import rundir
import sandbox
import serve
import tasks
import transport
import utils
from algos import (AGGREGATIONS, ALGOS, EPS, GROUPED, IS_LEVELS, KL, LOSSES, group_baseline,
                   importance_correction, loss_weights, masked_mean, policy_loss, value_loss)
from envs import TEXT_ENVS, CartPole, PythonToolEnv
from judge import JudgeUnavailable
from model import DTYPES, LLMPolicy, MLPPolicy
from rollouts import CONTROL, Batch, BatchSource, TaskRollouts, sample_rows, show_samples, sources


@dataclasses.dataclass
class Config:
    """nanorl training run; every flag is a field of train.Config. LLM tasks: their own task_defaults."""

    task: str = "cartpole"  # cartpole is the seconds-long sanity check; LLM tasks live in tasks.py
    algo: str = "reinforce"  # one of algos.ALGOS; the rest of the loop does not care which
    seed: int = 0  # seeds torch and the training-episode stream; eval seeds never depend on it
    steps: int = 200  # optimizer steps; CartPole REINFORCE needs ~40, so this is a safe ceiling
    batch: int = 16  # episodes (or prompts) per step: 16 give a low-noise gradient at ~no cost in lockstep
    group_size: int = 1  # rollouts per prompt/start state; GRPO/RLOO need >= 2 for a baseline (they get 8)
    lr: float = 0.005  # CartPole REINFORCE, 8 seeds: 5e-3 solved all (median 33k env steps); 1e-2 left one
    gamma: float = 0.99  # CartPole's 500-step horizon wants a long (~100-step) credit window
    lam: float = 0.95  # GAE bias/variance trade-off; 0.95 is the PPO paper's value and rarely worth tuning
    loss: str = "ppo"  # gspo: sequence ratio (eps ~3e-4); cispo: clipped IS weight, every token learns
    eps_low: float = 0.2  # ratio clip below 1; moot while the ratio is exactly 1 (one epoch, minibatch)
    eps_high: float = 0.2  # ratio clip above 1; DAPO's clip-higher (0.28) lets unlikely tokens grow
    dual_clip: float = 0.0  # caps a negative-advantage token's loss at c*|A| (c > 1, e.g. 3); 0 = off
    loss_agg: str = "token_mean"  # DAPO; seq_mean (GRPO paper): long answers weigh less; constant: Dr. GRPO
    loss_agg_constant: int = 0  # the constant mode's tokens per row; 0 = max_new_tokens
    inner_epochs: int = 1  # passes over each batch; >1 makes the update off-policy (PPO uses 4)
    minibatches: int = 1  # optimizer steps per epoch; 1 keeps the first-epoch ratio exactly 1
    micro_batch: int = 0  # rows per forward/backward (0: the minibatch): memory and speed, never the gradient
    max_grad_norm: float = 1.0  # clips rare huge-return batches that would otherwise undo learning; 0 = off
    ent_coef: float = 0.0  # entropy bonus; CartPole solves without it
    vf_coef: float = 0.5  # value-loss weight for PPO's critic (separate trunk, so it rarely matters)
    vf_clip: float = 0.0  # keeps new values within this distance of the pre-update ones (PPO); 0 = off
    critic_max_grad_norm: float = 0.0  # > 0 clips the critic's gradient on its own (actor: max_grad_norm)
    dr_grpo: bool = False  # GRPO without std scaling (Dr. GRPO): no up-weighting of near-uniform groups
    eval_every: int = 5  # steps between greedy evals; one 10-episode eval costs about one step
    target: float = 475.0  # stop at this eval score: 475 solves CartPole; LLM accuracy e.g. 0.9; 0 = never
    out: str = ""  # run directory; empty = runs/<task>-<algo>-<timestamp>
    resume: str = ""  # a run directory (its config.yaml, newest checkpoint that loads) or a ckpt-* in one
    eval_only: bool = False  # evaluate --resume's checkpoint (into RUN/eval-STEP or --out) or a bare --model
    ckpt_every: int = 50  # steps between checkpoints (a final one is always written)
    keep_ckpts: int = 3  # older checkpoints are deleted; 3 survives one corrupt write with margin
    progress: bool = True  # tqdm progress bar; --no-progress for logs and CI
    log: str = ""  # loggers besides metrics.csv, comma-separated: tensorboard, wandb (offline by default)
    samples: int = 4  # training rollouts a step written to samples.jsonl (every eval problem always is)
    # ---- cartpole (LLM tasks refuse these)
    hidden: int = 64  # MLP width: CartPole needs little, and small is fast
    eval_episodes: int = 10  # held-out greedy episodes per eval (the solve criterion uses 10)
    # ---- LLM tasks (cartpole refuses these)
    model: str = "tiny"  # HF hub id or local dir; "tiny" builds a small Llama locally, no download
    export: str = ""  # at the end, the model goes here: a PEFT adapter (LoRA; vLLM --enable-lora), else full
    export_merged: bool = False  # LoRA: export the adapter merged into a full Hugging Face model instead
    lora: bool = True  # LoRA: ~1% of the weights train and the KL reference costs no memory
    lora_rank: int = 16  # rank 16 is where RL fine-tuning results stop improving in most reports
    lora_alpha: int = 32  # alpha = 2 x rank keeps the update scale stable when the rank changes
    lora_targets: str = "all-linear"  # every linear projection the model has, found from the model
    dtype: str = "fp32"  # bf16 on GPUs halves memory; trained parameters stay fp32 either way
    attn: str = "auto"  # eager for bf16 on a CPU (faster up to 512 tokens), else sdpa; or flash_attention_2
    temperature: float = 1.0  # applied to the logits of both sampling and scoring, so ratios stay exact
    top_p: float = 1.0  # < 1 samples from a distribution the loss does not model (warned)
    max_new_tokens: int = 256  # completion budget; a truncated completion gets no end token
    gen_batch: int = 64  # sequences per generation call; bigger is faster until memory runs out
    teacher: str = ""  # --algo opd: the model (as --model) whose log-probs the student learns; same tokens
    opd_reward_coef: float = 0.0  # --algo opd: weight of the task's return in the advantage; 0 = pure OPD
    kl_coef: float = 0.0  # KL to the reference; RL-from-verifiable-rewards usually needs none
    kl_estimator: str = "k3"  # a loss: k3 (GRPO's) or k2; with --kl-in-reward k1 (as a loss: no gradient)
    kl_in_reward: bool = False  # kl_coef * KL comes off each token's reward, instead of a loss term
    tis: str = "off"  # truncated IS against sampler/trainer mismatch: token or sequence ratio, capped
    tis_cap: float = 2.0  # 2 keeps the variance bounded while correcting typical vLLM-vs-trainer gaps
    mis: str = "off"  # masked IS: a token or sequence whose ratio leaves [mis_low, mis_high] is dropped
    mis_low: float = 0.5  # masked IS keeps [0.5, 2]: only tokens the engines disagree on 2x or more go
    mis_high: float = 2.0  # the upper end, symmetric to mis_low in log space
    dynamic_sampling: bool = False  # drop groups whose rewards all agree (no gradient), draw more (DAPO)
    max_gen_batches: int = 3  # dynamic sampling: generation rounds per step at most; then a short batch
    prompt_reweight: float = 0.0  # share of a step's prompts replayed from recent ones with reward spread
    mask_truncated: bool = False  # completions that hit max_new_tokens leave the loss (DAPO overlong filter)
    chat_template: bool = True  # use the tokenizer's chat template when it has one
    thinking: bool = False  # enable_thinking for hybrid-thinking templates (Qwen3): long, slow answers
    eval_size: int = 100  # held-out problems; 100 gives a +-5% accuracy estimate
    pass_k: int = 0  # samples per eval problem for pass@k (0 = greedy accuracy only)
    data: str = ""  # local JSONL for gsm8k/math; empty = the datasets hub
    bad_rows: str = "skip"  # malformed data rows: skip (counted, reported with file:line) or error
    judge_down: str = "fail"  # a judge without a score: fail (stop, one line) or drop (mask its group, count)
    debug_samples: int = 0  # print this many (prompt, completion, reward breakdown) triples per eval
    sft_steps: int = 0  # supervised warm-start steps on the task's own solver's demos, before RL (tiny: 200)
    sft_lr: float = 1e-3  # warm-start learning rate (separate: supervised steps tolerate more)
    overlong_buffer: int = 0  # DAPO soft overlong penalty over the last N tokens of the budget; 0 = off
    # ---- multi-turn LLM tasks: envs.TEXT_ENVS (cartpole and single-turn tasks refuse these)
    max_turns: int = 4  # turns per episode, unless the env sets its own; each may fix an error
    max_len: int = 2048  # an episode past this or the model's context (tokens) ends there, truncated
    sandbox: str = "strict"  # code tool envs: strict refuses where code is not isolated; weak: rlimits only
    # ---- torchrun (`torchrun --nproc_per_node=N train.py ...`: --batch stays the global batch)
    dist_timeout: float = 1800.0  # seconds a rank waits in a collective before failing: > any checkpoint
    # ---- LLM tasks: disaggregated training (serve.py), a trainer and any number of rollout workers
    role: str = "sync"  # sync: one process; trainer + rollout: generation moves to workers that come and go
    trainer_url: str = ""  # rollout: the trainer's url; trainer: where to listen (empty: a free port)
    vllm: bool = False  # rollout workers generate with vLLM (LoRA only: a full model per sync is too slow)
    max_staleness: int = 2  # steps a sample may lag the weights it trains; 2 keeps workers busy, ratio ~1
    workers: int = 0  # rollout workers the trainer starts on its own machine (others may join)
    worker_patience: float = 60.0  # seconds a worker retries a lost trainer, then exit 0 (2 if never reached)


def task_defaults(given: dict) -> dict:
    """An LLM task's defaults, under what a preset or flag gives (`given`). lr: GRPO on SmolLM2-135M
    (countdown, 16 x 24 tokens, LoRA r=16), entropy at steps 1-4: 5e-3 2.1 3.5 0.9 1.4; 5e-4 2.1 2.7 2.9 2.5;
    1e-4 2.1 2.6 2.8 2.4 (in noise: the faster). Full fine-tuning: the tiny preset's 5e-5 (1e-4 stalled)."""
    task = given.get("task", Config.task)
    kind = tasks.TASKS.get(task) or getattr(TEXT_ENVS.get(task), "task", None)
    if kind is None:  # CartPole (GRPO, RLOO: its presets' 4 start states x 8), or a name validate() rejects
        return {"group_size": 8, "batch": 32} if given.get("algo", Config.algo) in GROUPED else {}
    tiny = given.get("model", Config.model) == "tiny"  # random init: every reward 0 (no gradient) until SFT
    # a random-init model has nothing worth freezing, unless --lora-rank (-alpha, -targets) asks for LoRA
    lora = given.get("lora", Config.lora and (not tiny or any(k.startswith("lora_") for k in given)))
    longest = ("max_len", Config.max_len) if task in TEXT_ENVS else ("max_new_tokens", kind.max_new_tokens)
    return {"algo": "grpo", "group_size": 8, "batch": 64,  # 8 prompts x 8: a spread at 10-90% accuracy
            "lora": lora, "lr": 5e-4 if lora else 5e-5,  # a low-rank update: ~10x the rate
            "sft_steps": 200 if tiny else 0,  # arith_chain: 32 s to 15% held-out; sql: ~39 min (2 cores)
            "max_new_tokens": kind.max_new_tokens,  # the task's own budget ("12+7=" needs 8, GSM8K 512)
            "max_turns": getattr(TEXT_ENVS.get(task), "max_turns", Config.max_turns),  # a text env's own
            "gamma": 1.0,  # per token, 0.99 gave a 300-token answer's first token 5% of its reward
            "micro_batch": 0 if tiny else max(1, 2048 // given.get(*longest))}  # 2048 tokens: bench/memory.py


def choices() -> dict:
    """Fields with a fixed set of values: validate() checks them first, and --help lists them."""
    return {"task": sources(), "algo": ALGOS, "loss": LOSSES, "loss_agg": AGGREGATIONS, "kl_estimator": KL,
            "tis": IS_LEVELS, "mis": IS_LEVELS, "bad_rows": ("skip", "error"), "dtype": tuple(DTYPES),
            "role": ("sync", "trainer", "rollout"), "judge_down": ("fail", "drop"), "sandbox": sandbox.MODES}


def validate(cfg: Config) -> None:
    """Rejects impossible combinations up front, naming the fix (parse() makes a resumed run's --out "")."""
    err = utils.ConfigError
    for name, valid in choices().items():
        if (value := getattr(cfg, name)) not in valid:
            raise err(f"unknown --{name.replace('_', '-')} '{value}'{utils.closest(value, valid)} "
                      f"(choices: {', '.join(valid)})")
    for names, ok, want in (("steps sft_steps micro_batch max_staleness workers pass_k debug_samples samples "
                             "loss_agg_constant vf_coef vf_clip max_grad_norm critic_max_grad_norm kl_coef "
                             "target", lambda v: v >= 0, "{} >= 0"),
                            ("batch group_size eval_every eval_episodes eval_size gen_batch max_new_tokens "
                             "inner_epochs minibatches ckpt_every keep_ckpts max_turns max_gen_batches "
                             "max_len hidden lora_rank lora_alpha dist_timeout tis_cap mis_high",
                             lambda v: v >= 1, "{} >= 1"),
                            ("gamma eps_low mis_low lr sft_lr", lambda v: 0 < v <= 1, "0 < {} <= 1"),
                            ("lam prompt_reweight", lambda v: 0 <= v <= 1, "0 <= {} <= 1"),
                            ("worker_patience eps_high", lambda v: v > 0, "{} > 0"),
                            ("dual_clip", lambda v: v == 0 or v > 1, "{} 0 (off) or > 1")):
        for name in names.split():
            if not ok(value := getattr(cfg, name)):
                raise err(f"need {want.format('--' + name.replace('_', '-'))} (got {value})")
    if cfg.algo in GROUPED and cfg.group_size < 2:
        raise err(f"--algo {cfg.algo} needs --group-size >= 2 (got {cfg.group_size}); try --group-size 8")
    # torchrun: each rank takes batch / W rows of whole groups (an async trainer splits its batch alike)
    unit = utils.world() * math.lcm(cfg.group_size, cfg.minibatches)
    if cfg.batch % unit:
        raise err(f"--batch {cfg.batch} is the global batch: {utils.world()} rank(s) need a multiple of "
                  f"{unit}, whole groups of --group-size {cfg.group_size} in --minibatches {cfg.minibatches} "
                  f"each; try --batch {unit * -(-cfg.batch // unit)}")
    if cfg.eval_only and (utils.world() > 1 or cfg.role != "sync"):
        raise err("--eval-only runs in one process: drop torchrun and --role")
    if set(filter(None, cfg.log.split(","))) - set(rundir.LOGGERS):
        raise err(f"--log {cfg.log}: choose from {', '.join(rundir.LOGGERS)} (metrics.csv is always written)")
    if cfg.resume and not Path(cfg.resume).is_dir():
        raise err(f"--resume {cfg.resume}: no such run directory or checkpoint")
    if cfg.out and cfg.role != "rollout" and (why := rundir.out_blocker(Path(cfg.out), cfg.eval_only)):
        raise err(f"{cfg.out} {why}")
    if cfg.export and (why := rundir.export_blocker(Path(cfg.export), Path(cfg.out or cfg.resume or "runs"))):
        raise err(f"--export {cfg.export}: {why}; pick a new or empty directory")
    validate_modes(cfg)


def validate_modes(cfg: Config) -> None:
    """Options that only some kinds of task, or only disaggregated training (serve.py), have."""
    err, single = utils.ConfigError, sources()[cfg.task] is TaskRollouts
    rewarded = cfg.algo != "opd" or cfg.opd_reward_coef  # pure OPD learns the teacher's log-probs alone
    if not 0 <= cfg.overlong_buffer <= cfg.max_new_tokens:
        raise err(f"need --overlong-buffer 0 (off) or in 1..--max-new-tokens (got {cfg.overlong_buffer})")
    if (cfg.algo == "opd") != bool(cfg.teacher):  # CartPole refuses --teacher below, as other LLM options
        raise err("--algo opd and --teacher MODEL go together, and only on LLM tasks")
    if issubclass(TEXT_ENVS.get(cfg.task, object), PythonToolEnv) or cfg.sandbox != Config.sandbox:
        sandbox.use(cfg.sandbox)  # model code runs isolated, or weakly by name; else one line (main())
    own = {"cartpole"} if cfg.task in CONTROL else {"LLM"} if single else {"LLM", "multi-turn"}
    for name, (section, _) in utils.field_docs(Config).items():  # others' options: a forgotten --task
        kind = section.split()[0]
        if kind in {"cartpole", "LLM", "multi-turn"} - own and getattr(cfg, name) != getattr(Config, name):
            raise err(f"--{name.replace('_', '-')} is for {kind} tasks, not {cfg.task}: drop it or "
                      "pick another --task")
    if why := tasks.data_problem(cfg.task, cfg.data, cfg.bad_rows, TEXT_ENVS.get(cfg.task)):
        raise err(f"--task {cfg.task}: {why}")  # here, before a model loads (minutes)
    tunes = (("prompt_reweight overlong_buffer judge_down", single, "a single-turn --task (arith, gsm8k)"),
             ("kl_estimator kl_in_reward", cfg.kl_coef, "--kl-coef > 0 (e.g. 0.01)"),
             ("tis_cap", cfg.tis != "off", "--tis token or sequence"),
             ("mis_low mis_high", cfg.mis != "off", "--mis token or sequence"),
             ("vf_coef vf_clip lam critic_max_grad_norm", cfg.algo == "ppo", "--algo ppo (the only critic)"),
             ("dr_grpo", cfg.algo == "grpo", "--algo grpo (RLOO never divides by its groups' std)"),
             ("lora_rank lora_alpha lora_targets", cfg.lora, "--lora (full fine-tuning has no adapter)"),
             ("dual_clip", cfg.loss != "cispo", "--loss ppo or gspo (cispo's loss is unclipped)"),
             ("loss_agg_constant", cfg.loss_agg == "constant", "--loss-agg constant"),
             ("dynamic_sampling", cfg.algo in GROUPED and single, "a grouped --algo on a single-turn task"),
             ("max_gen_batches", cfg.dynamic_sampling, "--dynamic-sampling"),
             ("opd_reward_coef", cfg.algo == "opd", "--algo opd"),
             ("kl_in_reward overlong_buffer", rewarded, "--opd-reward-coef > 0 (pure OPD ignores rewards)"),
             ("sft_lr", cfg.sft_steps, "--sft-steps N (a warm-start)"),
             ("export_merged", cfg.export and cfg.lora, "--export DIR and --lora (an adapter to merge)"),
             ("role", cfg.algo != "ppo", "a critic-free --algo (grpo, rloo, ...): workers lack PPO's critic"),
             ("workers", cfg.role == "trainer", "--role trainer"),
             ("trainer_url max_staleness worker_patience", cfg.role != "sync", "--role trainer or rollout"),
             ("vllm", cfg.role == "rollout" and cfg.lora, "--role rollout and --lora (syncs send adapters)"))
    for names, on, needs in tunes:  # an option tuning another that is off would do nothing
        for name in names.split():
            if not on and getattr(cfg, name) != (default := getattr(Config, name)):  # resumed: config.yaml's
                undo = f"pass {utils.as_flag(name, default)}" if cfg.resume else "drop it"
                raise err(f"--{name.replace('_', '-')} needs {needs}; add that or {undo}")
    if cfg.role == "rollout" and not cfg.trainer_url:
        raise err("--role rollout needs --trainer-url http://HOST:PORT (the trainer prints it at start)")
    if cfg.role != "sync":  # before a model loads: the url's form, and a trainer's token for where it listens
        host, _ = transport.split_url(cfg.trainer_url or "http://127.0.0.1")
        if cfg.role == "trainer":  # and whether a worker could join at all
            transport.serving_token(host, workers=cfg.workers)


def build(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer, BatchSource]:
    torch.manual_seed(cfg.seed)
    if cfg.task in CONTROL:
        torch.set_num_threads(1)  # a 64-unit MLP: ~3x faster than 2 threads on [16, 64]; the env gets a core
        policy = MLPPolicy(CartPole.obs_dim, CartPole.n_actions, cfg.hidden, critic=cfg.algo == "ppo")
    else:
        policy = LLMPolicy(cfg)
    utils.broadcast_weights(policy)  # torchrun: every rank starts from rank 0's weights
    utils.split_rng()  # but samples its own tokens (a checkpoint restores each rank's own stream)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr)
    source = sources()[cfg.task](cfg, policy)
    return policy, opt, serve.AsyncRollouts(cfg, policy, source) if cfg.role == "trainer" else source


def load_teacher(cfg: Config, student):
    """--algo opd: the frozen teacher, after checking that it reads the student's token ids alike."""
    try:
        teacher = LLMPolicy(dataclasses.replace(cfg, model=cfg.teacher, lora=False, kl_coef=0.0))
    except utils.ConfigError as e:  # a model's messages name the flag they usually serve
        raise utils.ConfigError(str(e).replace("--model", "--teacher", 1)) from None
    a, b = student.tokenizer, teacher.tokenizer
    if a.get_vocab() != b.get_vocab() or student.eos_ids != teacher.eos_ids:
        raise utils.ConfigError(f"--teacher {cfg.teacher}: its tokenizer differs from the student's ({len(b)}"
                                f" vs {len(a)} tokens, or other ids); pick a teacher of the student's family")
    return teacher.freeze(DTYPES[cfg.dtype])  # --dtype bf16 halves its memory


def warm_start(policy, opt, source: BatchSource, cfg: Config, log, first: int, stop) -> bool:
    """Supervised steps first..-1 (logged at first+1..0) on the task's solver's demos, so RL's gain shows
    apart; the RL Adam at sft_lr (a checkpoint holds all a resume needs), then reset. True: a stop (STOP)."""
    opt.param_groups[0]["lr"] = cfg.sft_lr  # build() gives Adam one group
    for step in tqdm(range(first, 0), "warm-start", disable=not cfg.progress or utils.rank() > 0):  # minutes
        batch = source.demonstrations(cfg.batch)
        opt.zero_grad(set_to_none=True)
        loss, tokens = torch.zeros(()), utils.all_sum(batch.mask.sum())  # every rank's demo tokens
        for rows in micro_slices(torch.arange(len(batch)), cfg.micro_batch):
            part = -(policy.score(batch, rows)[0] * batch.mask[rows]).sum() / tokens
            part.backward()
            loss += part.detach()
        utils.sum_grads(policy)
        opt.step()
        log.log(step + 1, {"sft_loss": utils.all_sum(loss).item()})
        if step + 1 < 0 and stop(step + 1, log):
            return True
    opt.state.clear()
    opt.param_groups[0]["lr"] = cfg.lr
    return stop(0, log)  # after the reset: a resume at step 0 starts RL with RL's Adam


def micro_slices(rows: torch.Tensor, size: int):
    return rows.split(size or len(rows))


def on_policy(policy, cfg: Config) -> bool:
    """The update's forward is the old policy (ratio 1: the plain policy gradient); stage 2 skips one."""
    return (cfg.role == "sync" and cfg.inner_epochs == 1 and cfg.minibatches == 1 and not policy.has_critic
            and cfg.tis == "off" and cfg.mis == "off" and cfg.algo != "opd")


def old_scores(policy, batch: Batch, cfg: Config, weights) -> tuple[torch.Tensor, torch.Tensor | None]:
    """old_logp and values [N, T], each row under the weights of the version that sampled it (`weights`:
    live or a snapshot), in update()'s micro-batches: live rows get exactly the update's first forward."""
    logp, values = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask)  # [N, T]
    for rows in micro_slices(torch.arange(len(batch)), cfg.micro_batch):
        for v in batch.version[rows].unique().tolist():
            with weights(v):
                lp, _, val = policy.score(batch, rows)
            keep = batch.version[rows] == v  # [rows]
            logp[rows[keep]] = lp[keep]
            if val is not None:  # a critic's
                values[rows[keep]] = val[keep]
    return logp * batch.mask, values * batch.mask if policy.has_critic else None


def rollout_metrics(batch: Batch, rewards: torch.Tensor, cfg: Config) -> dict:
    """The batch as sampled, logged every step; reward (= reward_mean) is before any --kl-in-reward."""
    score, length = (rewards * batch.mask).sum(1, dtype=torch.float64), batch.mask.sum(1)  # [N] return, steps
    scored = lambda x: masked_mean(x, (length > 0).float(), math.nan)  # every rank's scored rows (stats: NaN)
    mean, adv_mean = scored(score), masked_mean(batch.adv, batch.mask)  # an unscored row: no reward, not 0
    out = {"reward": mean, "reward_mean": mean, "reward_std": scored((score - mean).square()).sqrt(),
           "adv_mean": adv_mean, "length_mean": scored(length), "length_max": length.max(),
           "adv_std": masked_mean((batch.adv.double() - adv_mean) ** 2, batch.mask).sqrt(),
           "truncated_frac": batch.truncated.float().mean(), "steps_env": length.sum() * utils.world(),
           **{k: masked_mean(v.nan_to_num(), (~v.isnan()).float(), math.nan) for k, v in batch.stats.items()}}
    if cfg.group_size > 1:  # a group whose rewards all agree gives GRPO/RLOO nothing to learn from
        out["frac_zero_std"] = scored((group_baseline(score, batch.group)[1] < EPS).float())
    return {k: float(v) for k, v in out.items()}


@torch.no_grad()
def prepare(policy, batch: Batch, cfg: Config, weights=contextlib.nullcontext, teacher=None) -> Batch:
    """Stage 2: old log-probs and values, advantages, loss weights, batch.metrics. The sampler's own
    log-probs (batch.logp) are never the old ones: only tis / mis and the logged logp_gap read them."""
    mask, metrics, rows = batch.mask, {}, micro_slices(torch.arange(len(batch)), cfg.micro_batch)
    if not on_policy(policy, cfg):
        batch.old_logp, batch.values = old_scores(policy, batch, cfg, weights)
        metrics["logp_gap"] = masked_mean((batch.old_logp - batch.logp).abs(), mask).item()
    if cfg.kl_coef:
        batch.ref_logp = torch.cat([policy.ref_logp(batch, r) for r in rows])
    if teacher is not None:  # on-policy distillation: the teacher scores the student's tokens
        batch.teacher_logp = torch.cat([teacher.score(batch, r)[0] for r in rows])
        metrics["opd_reverse_kl"] = masked_mean(batch.old_logp - batch.teacher_logp, mask).item()  # per token
    rewards = batch.rewards
    if cfg.kl_in_reward:  # the penalty becomes part of the return, so every estimator sees it
        old = batch.logp if on_policy(policy, cfg) else batch.old_logp  # on-policy: the sampler is the policy
        kl = KL[cfg.kl_estimator](old, batch.ref_logp) * mask  # [N, T]
        batch.rewards, metrics["kl"] = rewards - cfg.kl_coef * kl, masked_mean(kl, mask).item()
    batch.adv = ALGOS[cfg.algo](batch, cfg)
    keep = mask * ~batch.truncated[:, None] if cfg.mask_truncated else mask  # [N, T]
    batch.is_weight, batch.loss_mask = torch.ones_like(mask), keep
    if cfg.tis != "off" or cfg.mis != "off":
        batch.is_weight, kept, s = importance_correction(batch.old_logp, batch.logp, mask, cfg.tis,
                                                         cfg.tis_cap, cfg.mis, cfg.mis_low, cfg.mis_high)
        batch.loss_mask, metrics = keep * kept, {**metrics, **s}
    batch.weights = loss_weights(batch.loss_mask, cfg.loss_agg,
                                 constant=cfg.loss_agg_constant or cfg.max_new_tokens)
    # Averaged over ranks (equal rows each): exact for means and fractions; a max: the ranks' average
    batch.metrics = utils.reduce_dict({**rollout_metrics(batch, rewards, cfg), **metrics}, mean=True)
    return batch


def update(policy, opt, batch: Batch, cfg: Config) -> dict:
    """Stage 3: inner epochs x minibatches of the loss, each summed over micro-batches (one denominator)."""
    n, fresh = len(batch), on_policy(policy, cfg)
    critic = list(policy.v.parameters()) if cfg.critic_max_grad_norm else []  # validate(): PPO's only
    actor = [p for p in policy.parameters() if p.requires_grad and all(p is not c for c in critic)]
    stats, means, updates, skipped = defaultdict(float), defaultdict(float), 0, 0
    unit = batch.loss_mask if cfg.loss_agg == "token_mean" else (batch.loss_mask.sum(1) > 0).float()
    for _ in range(cfg.inner_epochs):
        for mb in torch.randperm(n).chunk(cfg.minibatches) if cfg.minibatches > 1 else [torch.arange(n)]:
            # Its share of all ranks' tokens (token_mean) or rows (the others); none: weights 0 (no NaN)
            share = utils.all_sum(unit[mb].sum()).clamp(min=1) / utils.all_sum(unit.sum())  # one minibatch: 1
            tokens = utils.all_sum(batch.loss_mask[mb].sum())  # logged stats are token means
            opt.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for rows in micro_slices(mb, cfg.micro_batch):
                loss, s = micro_loss(policy, batch, rows, share, fresh, cfg)
                loss.backward()
                total += loss.detach()
                for k, v in s.items():  # this rank's share of the minibatch's token means
                    means[k] += ((v * batch.loss_mask[rows]).sum() / tokens.clamp(min=1)).item()
            utils.sum_grads(policy)  # torchrun: every rank now holds the whole batch's gradient
            total = utils.all_sum(total)  # so that all ranks agree on skipping a non-finite step
            norms = {"grad_norm": torch.nn.utils.clip_grad_norm_(actor, cfg.max_grad_norm or math.inf)}
            if critic:  # a clip of its own, so that neither gradient's scale crowds out the other
                norms["critic_grad_norm"] = torch.nn.utils.clip_grad_norm_(critic, cfg.critic_max_grad_norm)
            # No NaN/inf reaches the weights, nor a step without tokens (Adam's momentum would move them)
            if torch.isfinite(torch.stack([total, *norms.values()])).all() and tokens:
                opt.step()
            else:
                skipped += 1
            for k, v in {"loss": total, **norms}.items():
                stats[k] += v.item()
            updates += bool(tokens)  # a minibatch without tokens is in no mean: it did not train
    stats.update(utils.reduce_dict(means))  # summed over ranks
    return {**{k: v / max(updates, 1) for k, v in stats.items()}, "skipped": skipped, **batch.metrics}


def micro_loss(policy, batch: Batch, rows: torch.Tensor, share, fresh: bool, cfg: Config):
    """One micro-batch's share of the minibatch loss, and its per-token stats [n, T]."""
    logp, entropy, values = policy.score(batch, rows)
    w = batch.weights[rows] / share  # [n, T]
    old = logp.detach() if fresh else batch.old_logp[rows]  # on-policy: the ratio is exactly 1
    loss, s = policy_loss(logp, old, batch.adv[rows], w * batch.is_weight[rows], batch.mask[rows], cfg.loss,
                          cfg.eps_low, cfg.eps_high, cfg.dual_clip)  # IS weights scale the policy term only
    loss, s["entropy"] = loss - cfg.ent_coef * (entropy * w).sum(), entropy.detach()
    if values is not None:
        loss += cfg.vf_coef * value_loss(values, batch.returns[rows], w, batch.values[rows], cfg.vf_clip)
    if cfg.kl_coef and not cfg.kl_in_reward:
        kl = KL[cfg.kl_estimator](logp, batch.ref_logp[rows])  # [n, T]
        loss, s["kl"] = loss + cfg.kl_coef * (kl * w).sum(), kl.detach()
    return loss, s


def train(cfg: Config) -> Path | None:
    validate(cfg)
    policy, opt, source = build(cfg)
    meta = resume(cfg, policy, opt, source)
    if cfg.eval_only:
        return evaluate_only(cfg, policy, source, meta["step"] if meta else 0)
    teacher = load_teacher(cfg, policy) if cfg.teacher else None
    out = utils.from_rank0(rundir.where(cfg))  # under torchrun, rank 0 alone makes a new run's directory
    log, step, last_eval = rundir.Metrics(), (meta or {"step": 0})["step"], (meta or {}).get("last_eval", {})
    def stop(step: int, log, evals: dict | None = None) -> bool:  # after a step; evals: start_run's, of it
        last_eval.update(evals if step > 0 and evals else {})  # step 0's is no --target's, as in one run
        state = dict(wall_s=log.wall(), source=source.state(), last_eval=dict(last_eval))
        rng = utils.rng_states()  # StopSignals may save them later. A failed save keeps the rest.
        signals.save = lambda: rundir.save_checkpoint(out, step, policy, opt, state, cfg.keep_ckpts, rng)
        if signals.agreed():
            signals.save()
            utils.stderr(f"interrupted: checkpoint saved; continue with --resume {out}")
        return signals.stopping
    signals = utils.StopSignals(type(source).evaluate, type(source).next)  # before the warm-start, too
    try:
        log, step = start_run(cfg, out, policy, opt, source, meta, stop)
        bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, dynamic_ncols=True,
                   disable=not cfg.progress or utils.rank() > 0)
        for step in bar if not (signals.stopping or report.reached(last_eval, cfg.target)) else ():
            batch = source.next(step)  # 1. rollout
            batch = prepare(policy, batch, cfg, source.weights, teacher)  # 2. advantage
            stats = update(policy, opt, batch, cfg)  # 3. update
            source.publish(step + 1)  # 4. publish
            stats.update(utils.reduce_dict(source.last, mean=True))  # 5. log, evaluate, checkpoint
            log.log(step + 1, stats)
            log.samples(step + 1, sample_rows(batch, cfg.samples, "train", step + 1))
            if step % cfg.eval_every == 0 and cfg.debug_samples:
                show_samples(batch, f"step {step}", cfg.debug_samples)
            if stop(step + 1, log):  # a stop during the step skips the eval (one during it abandons it)
                break
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                last_eval = evaluate(source, log, step + 1, out)
            bar.set_postfix(reward=f"{stats['reward']:.1f}", **{k: f"{v:.3g}" for k, v in last_eval.items()})
            if stop(step + 1, log) or report.reached(last_eval, cfg.target):
                break
            if (step + 1) % cfg.ckpt_every == 0 and step + 1 < cfg.steps:
                signals.save()  # step + 1's checkpoint, as stop() just captured it (the last one: below)
        if not signals.stopping:  # the last step's checkpoint; with --steps 0, the warm-start's or the base's
            signals.save()
        bar.close()
    except (utils.ConfigError, JudgeUnavailable, tasks.RewardError) as e:  # one to fix, mid-run (a judge
        if saved := signals.save():  # down, an async trainer's --workers all died): keep the last step
            e.args = (f"{e.args[0]}; {saved.name} is saved: once fixed, --resume {out}", *e.args[1:])
        raise
    except (KeyboardInterrupt, OSError, utils.RankLost):  # Ctrl-C twice, a full disk, another rank gone
        utils.stderr(f"stopped during step {step + 1} (not saved); checkpoints so far: --resume {out}")
        raise
    finally:
        signals.restore()
        source.close()  # an async trainer tells its workers the run is over (before a full disk fails close)
        log.close()
    if utils.rank() == 0:  # under torchrun only rank 0 writes: logs, samples, checkpoints, the report
        rundir.plot(out, keys=("reward", *report.HEADLINE, "eval_accuracy_lenient"))
        finish(dataclasses.replace(cfg, export="") if signals.stopping else cfg, policy, out, log.wall())
    return None if signals.stopping else out  # None: a stop cut it short (its checkpoint saved, no export)


def resume(cfg: Config, policy, opt, source: BatchSource) -> dict | None:
    """--resume: the newest checkpoint that loads, into policy, optimizer and source (None: none does)."""
    meta = rundir.resume_checkpoint(Path(cfg.resume), policy, opt, cfg.eval_only) if cfg.resume else None
    source.load_state(meta["source"] if meta else {})  # every rank reads it: multi-node needs a shared --out
    reached = meta and report.reached(meta.get("last_eval", {}), cfg.target)  # --target: train() stops
    if meta and (meta["step"] >= cfg.steps or reached) and not cfg.eval_only:  # nothing trains: the summary
        at = f"of --steps {cfg.steps}" if meta["step"] >= cfg.steps else f"at its --target {cfg.target}"
        utils.stderr(f"warning: the run is at step {meta['step']} {at}; raise it to go on")
    return meta


def start_run(cfg: Config, out: Path, policy, opt, source: BatchSource, meta: dict | None, stop):
    """The run's log, then what precedes RL's first step (evaluations, warm-start): (log, that step)."""
    start = meta["step"] if meta else -cfg.sft_steps  # < 0: (in) the warm-start
    resumed_at = (start if meta else start - 1) if cfg.resume else None  # logs after its step are rewritten
    log = rundir.Metrics(out, cfg, meta["wall_s"] if meta else 0.0, resumed_at)  # rank 0 alone writes
    if cfg.sft_steps and not meta:
        evaluate(source, log, -cfg.sft_steps, out, "_before_sft")
    stopped = start < 0 and warm_start(policy, opt, source, cfg, log, start, stop)
    at = max(start, 0)  # its eval: step 0's, the RL curve's start, or the one a stop skipped or abandoned
    if (at % cfg.eval_every == 0 or at == cfg.steps) and not stopped and not log.logged(at, "eval_"):
        stop(at, log, evaluate(source, log, at, out))  # a stop in it ({}: abandoned) saves the step
    return log, at


def evaluate(source: BatchSource, log, step: int, out: Path, suffix: str = "") -> dict:
    """Held-out metrics and each eval problem's sample (rank 0's share under torchrun), logged at `step`."""
    try:  # on a fork of the RNGs (this GPU's too): --pass-k's samples and --eval-every leave training alike
        with torch.random.fork_rng([torch.cuda.current_device()] if torch.cuda.is_available() else []):
            metrics = source.evaluate()
    except utils.Abandoned:  # a stop: the step's checkpoint does not wait for the eval
        utils.stderr(f"the eval at step {step} is abandoned (not logged)")
        return {}
    log.log(step, {k + suffix: v for k, v in metrics.items()})
    if source.eval_batch is not None:
        log.samples(step, sample_rows(source.eval_batch, len(source.eval_batch), "eval", step))
    if utils.rank() == 0:
        report.refresh(out)
    return metrics


def finish(cfg: Config, policy, out: Path, wall_s: float) -> None:
    report.write_report(out)
    if cfg.export:
        try:
            policy.export(cfg.export, cfg.export_merged)
        except OSError as e:  # e.g. a full disk: the trained weights are in the checkpoints
            raise utils.ConfigError(f"--export {cfg.export}: {e}; the run's checkpoints are intact: "
                                    "--resume RUN --eval-only --export DIR exports one") from None
    print(report.summary(out, wall_s, cfg.export))


def evaluate_only(cfg: Config, policy, source: BatchSource, step: int) -> Path:
    """--eval-only: one eval of the loaded weights, logged at their step in a run directory of its own."""
    out = Path(cfg.out) if cfg.out else rundir.where(cfg) / (f"eval-{step:07d}" if cfg.resume else "")
    with contextlib.closing(rundir.Metrics(out, cfg, resumed_at=step - 1)) as log:  # a rerun replaces it
        evaluate(source, log, step, out)
    finish(cfg, policy, out, 0.0)
    return out


def parse(argv: list[str]) -> Config:
    """The flags; with --resume, over the run's own config.yaml, warning of flags that change what trains."""
    given = utils.load_config(Config, argv, choices(), defaults=task_defaults)
    if not given.resume:
        return given
    saved = rundir.where(given) / "config.yaml"
    if not saved.exists():
        raise utils.ConfigError(f"--resume {given.resume}: no config.yaml in {saved.parent}: not a run")
    old, cfg = (utils.load_config(Config, f, choices(), saved, task_defaults) for f in ([], argv))
    own = cfg.out in ("", old.out) or Path(cfg.out).resolve() == rundir.where(cfg).resolve()  # names the run
    if not (own or cfg.eval_only):  # only an eval may go elsewhere (a read-only run's must)
        raise utils.ConfigError(f"--out {cfg.out}: a resumed run goes on in {rundir.where(cfg)}; drop --out")
    if (cfg.task in CONTROL) != (old.task in CONTROL):  # an MLP's checkpoint never loads into an LM, nor back
        raise utils.ConfigError(f"--task {cfg.task}: the run trained {old.task}, another policy; drop --task")
    for name in "task data model lora lora_alpha lora_targets algo loss teacher opd_reward_coef".split():
        if getattr(cfg, name) != getattr(old, name):
            utils.stderr(f"warning: {name} {getattr(cfg, name)!r} replaces the run's {getattr(old, name)!r}")
    if cfg.sft_steps != old.sft_steps and not cfg.eval_only:  # its warm-start is history, as its steps are
        raise utils.ConfigError(f"--sft-steps {cfg.sft_steps}: its warm-start was {old.sft_steps}; drop it")
    # The run's --export is written at its end: a resume inherits it while unwritten (an --eval-only never)
    if cfg.export == old.export and (cfg.eval_only or rundir.export_blocker(Path(cfg.export))):
        cfg = dataclasses.replace(cfg, export=given.export, export_merged=given.export_merged)
    serving = ("role", "workers", "trainer_url", "max_staleness", "worker_patience")  # a role's own flags
    sync = {k: vars(given)[k] for k in serving if cfg.eval_only or cfg.role != old.role}  # eval: one process
    return dataclasses.replace(cfg, out="" if own else cfg.out, **sync)  # "": the run's own, or RUN/eval-STEP


def main(argv: list[str]) -> int:
    try:
        cfg = parse(argv)
        validate(cfg)
        if cfg.role == "rollout":  # a worker generates and never trains
            return serve.run_worker(cfg)
        utils.init_distributed(cfg.dist_timeout)
        return 0 if train(cfg) else utils.stopped()  # None: stopped, not finished (130, as after Ctrl-C)
    except (utils.ConfigError, JudgeUnavailable, sandbox.SandboxUnavailable, tasks.RewardError) as e:  # fixes
        utils.stderr(f"error: {e}")
        return 1 if isinstance(e, JudgeUnavailable) else 2  # 1: a judge down (--judge-down fail), run saved
    except KeyboardInterrupt:
        return 130  # the shell's code for a run stopped by Ctrl-C
    except Exception as e:
        where = f"rank {utils.rank()} of {utils.world()}" if utils.world() > 1 else ""  # torchrun: which one
        if why := utils.refused(e):  # a full disk, no memory left; other errors are bugs': shown whole
            utils.stderr(f"error: {where + ': ' if where else ''}{why}")
            return 1
        if where:  # say which rank broke before torchrun's teardown buries it
            utils.stderr(f"error: {where} failed ({type(e).__name__}: {e}); torchrun stops the other ranks")
        raise
    finally:
        utils.close_distributed()


if __name__ == "__main__":
    utils.cli(main)
