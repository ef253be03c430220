"""Where batches come from: the typed Batch, what a batch source promises the loop (stage 1 `next(step)
-> Batch`, stage 4 `publish`) and the three rollouts (control, single-turn, multi-turn). Async rollout
workers (`--role rollout`) run these very sources, so every option behaves alike in sync and async runs."""
import contextlib
import hashlib
import math
import numbers
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, field, fields

import torch
from torch import Tensor
from tqdm import tqdm

import tasks
import utils
from envs import EVAL_SEED, TEXT_ENVS, CartPole, TextEnv
from judge import JudgeUnavailable
from model import Sample
from tasks import Problem


@dataclass
class Batch:
    """One step's rows. N rows; T steps (control) or prompt + completion tokens (LLM), right-padded.
    Stage 1 (a source) fills every field above the line, with the neutral value where it has
    nothing; stage 2 (train.prepare) fills the rest."""

    tokens: Tensor  # [N, T] int64: prompt + completion ids (LLM); the action taken at each step (control)
    attn: Tensor  # [N, T] float32: 1 on real positions (prompt and completion); control: the mask
    obs: Tensor  # [N, T, D] float32: the state before each step (control); LLM: [N, 0, 0]
    last_value: Tensor  # [N] float32: the critic's value of the episode's final state (control PPO); else 0
    mask: Tensor  # [N, T] float32: 1 on the policy's own steps (never prompt or environment tokens)
    logp: Tensor  # [N, T] float32: the sampler's log-prob of each masked step, 0 elsewhere
    rewards: Tensor  # [N, T] float32: per-step reward; a completion's sits on its last sampled token
    truncated: Tensor  # [N] bool: cut by the token budget or the time limit, not ended by policy or env
    group: Tensor  # [N] int64: rows with one id share a prompt (or start state): GRPO/RLOO's groups
    version: Tensor  # [N] int64: the weights version that sampled the row (sync: the step)
    stats: dict[str, Tensor]  # [N] float32 each, logged as batch means: reward_<fn> per reward, solved, turns
    texts: list[tuple[str, str, str]]  # [N] (prompt, completion, answer) as text; control: ("", "", "")
    # ---- stage 2 (train.prepare)
    old_logp: Tensor | None = None  # [N, T] under the weights that sampled each row; None if train.on_policy
    values: Tensor | None = None  # [N, T] the critic's, before the update (PPO only)
    ref_logp: Tensor | None = None  # [N, T] under the KL reference (kl_coef > 0 only)
    teacher_logp: Tensor | None = None  # [N, T] under --teacher (--algo opd only)
    adv: Tensor | None = None  # [N, T] ALGOS[cfg.algo]
    returns: Tensor | None = None  # [N, T] the critic's targets (PPO only)
    is_weight: Tensor | None = None  # [N, T] truncated-IS weight on the policy term; 1 when off
    loss_mask: Tensor | None = None  # [N, T] mask minus truncated rows and masked-IS tokens
    weights: Tensor | None = None  # [N, T] loss weights with the whole batch's denominator
    metrics: dict[str, float] = field(default_factory=dict)  # what the batch looked like, for the log

    def __len__(self) -> int:
        return len(self.mask)

    def select(self, rows: slice) -> "Batch":
        """Rows `rows` of the stage-1 fields, e.g. one rank's share."""
        t = [getattr(self, f.name)[rows] for f in fields(self)[:10]]  # tokens .. version
        return Batch(*t, {k: v[rows] for k, v in self.stats.items()}, self.texts[rows])

    def wire(self) -> dict[str, Tensor]:
        """An LLM batch's rows as named tensors for transport.encode (stats under their own names)."""
        return {n: getattr(self, n) for n in WIRE} | self.stats


# What a rollout worker sends of a Batch (the fields above), as serve.Inbox.check checks it: name ->
# (dims, dtype), with dims 2 for [N, T] and 1 for [N]; the stats go along as [N] float32.
WIRE = {"tokens": (2, torch.int64), "attn": (2, torch.float32), "mask": (2, torch.float32),
        "logp": (2, torch.float32), "rewards": (2, torch.float32), "truncated": (1, torch.bool),
        "group": (1, torch.int64), "version": (1, torch.int64)}


def from_wire(t: dict[str, Tensor], texts: list[tuple[str, str, str]]) -> Batch:
    """The inverse of Batch.wire, for rows already checked (serve.Inbox.check)."""
    n = len(t["tokens"])
    return Batch(**{k: t[k] for k in WIRE}, obs=torch.zeros(n, 0, 0), last_value=torch.zeros(n),
                 stats={k: v.float() for k, v in t.items() if k not in WIRE}, texts=texts)


def make_batch(prefixes: list[list[int]], samples: list, rewards: list[float], pad_id: int,
               loss_mask: list[list[int]] | None = None, *, group_size: int = 1, version: int = 0,
               stats: dict | None = None, texts: list | None = None) -> Batch:
    """(prefix, completion) rows as a Batch, each `group_size` consecutive rows a group. `loss_mask`
    (0/1 per completion token) masks what the policy did not sample; a row's reward sits on its last 1."""
    N, L = len(prefixes), max(len(p) + len(s.ids) for p, s in zip(prefixes, samples))
    tokens, attn = torch.full((N, L), pad_id, dtype=torch.long), torch.zeros(N, L)  # [N, L] each
    mask, logp, reward = torch.zeros(N, L), torch.zeros(N, L), torch.zeros(N, L)  # [N, L] each
    for r, (p, s) in enumerate(zip(prefixes, samples)):
        a, e = len(p), len(p) + len(s.ids)
        m = torch.tensor(loss_mask[r] if loss_mask else [1] * len(s.ids), dtype=torch.float)
        if len(m) != len(s.ids):
            raise ValueError(f"row {r}: loss_mask has {len(m)} entries for {len(s.ids)} completion tokens")
        tokens[r, :e], attn[r, :e], mask[r, a:e] = torch.tensor(p + s.ids), 1.0, m
        logp[r, a:e] = torch.tensor(s.logps) * m
        reward[r, a + int(m.nonzero().max()) if m.any() else e - 1] = rewards[r]
    truncated = torch.tensor([s.truncated for s in samples], dtype=torch.bool)  # [N]
    return Batch(tokens, attn, torch.zeros(N, 0, 0), torch.zeros(N), mask, logp, reward, truncated,
                 torch.arange(N) // group_size, torch.full((N,), version), stats or {},
                 texts or [("", "", "")] * N)


# ================================================================ the three rollouts
def rollout_control(env: CartPole, policy, n: int, seed: int, group_size: int = 1,
                    greedy: bool = False, version: int = 0) -> Batch:
    """n episodes in lockstep from `seed` (a group of `group_size` from one start state), one policy
    forward per time step for all. The time limit truncates (PPO bootstraps from the critic's value of
    the final state: PPO runs sync, so these are stage 2's weights); a fallen pole terminates."""
    vec = env.reset(n, seed, group_size)
    obs = vec.state.T.astype("float32")
    alive, truncated = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
    steps, last_obs = [], torch.zeros(n, env.obs_dim)  # steps: (obs, action, logp, alive) per time step
    while alive.any():  # the time limit ends every episode within env.max_steps
        actions, logp = policy.act(torch.from_numpy(obs), greedy=greedy)
        steps.append((torch.tensor(obs), actions, logp, alive.float()))
        obs, _, term, trunc, _ = vec.step(actions.numpy())
        ended = alive & torch.from_numpy(term | trunc)
        truncated |= ended & ~torch.from_numpy(term)
        last_obs[ended] = torch.from_numpy(obs)[ended]  # the state after the final step, for bootstrapping
        alive &= ~ended
    states, actions, logp, mask = (torch.stack(x, 1) for x in zip(*steps))  # [N, T, D], then [N, T] each
    leader = torch.arange(n) // group_size * group_size  # [N]
    bootstrap = policy.last_value(last_obs) if policy.has_critic else torch.zeros(n)  # [N]
    return Batch(actions, mask, states, bootstrap, mask, logp * mask, mask.clone(), truncated,  # reward: +1
                 leader, torch.full((n,), version), {}, [("", "", "")] * n)


@dataclass
class Episode:
    """One rollout as ONE token sequence after the prompt: a single-turn completion, or a conversation's
    model turns and environment replies in order. Has the `ids`, `logps` and `truncated` make_batch reads."""

    problem: Problem
    prompt: list[int]
    env: TextEnv | None = None  # multi-turn only
    ids: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)  # 0.0 on environment tokens
    mask: list[int] = field(default_factory=list)  # 1 on the model's own tokens
    reward: float = 0.0  # the task's weighted total, or the sum of the per-turn rewards
    parts: dict[str, float] = field(default_factory=dict)  # single-turn: each reward fn's unweighted value
    turns: int = 0
    solved_at_turn: int = 0  # 0: never
    truncated: bool = False  # a turn hit its token budget, or max_len ended the episode
    done: bool = False
    text: str = ""  # the completion; multi-turn: model turns and replies, as the model saw them


def rollout_single(policy, task: tasks.Task, problems: list[Problem], group_size: int, cfg,
                   greedy: bool = False) -> list[list[Episode]]:
    """group_size completions per problem, a group each, scored by the task's reward functions all at
    once, `concurrency` at a time, so a judge's round trips overlap (--judge-down drop: Task.score)."""
    prefixes = [policy.encode_prompt(p.prompt) for p in problems]
    rows = [(p, x) for p, x in zip(problems, prefixes) for _ in range(group_size)]
    samples = policy.generate([x for _, x in rows], cfg.max_new_tokens, cfg.gen_batch, greedy=greedy)
    texts = [policy.decode(s.ids) for s in samples]
    width = max(getattr(fn, "concurrency", 1) for fn, _ in task.rewards)  # only a judge scores in parallel
    drop, failed = cfg.judge_down == "drop", None
    try:
        with ThreadPoolExecutor(width) as pool:
            scores = list(pool.map(lambda r, t: task.score(r[0].prompt, t, r[0].answer, drop), rows, texts))
        for (total, _), text in zip(scores, texts):  # each reward is within float32's range, but their sum?
            if abs(total) > tasks.FLOAT32_MAX:  # (NaN, a judge's missing score, is not)
                raise tasks.RewardError(f"{task.name}'s weighted total {total:.3g} for the completion "
                                        f"{text[:60]!r} is past float32's range; scale its rewards or "
                                        "weights")
    except (JudgeUnavailable, tasks.RewardError) as e:
        failed = e
    # torchrun: one rank's failure stops all here, and rank 0 saves the last step (it met the rank's absence)
    fails = utils.reduce_dict({"judge": isinstance(failed, JudgeUnavailable), "any": failed is not None})
    if fails["any"]:  # this rank's, summed with the others
        raise failed or (JudgeUnavailable if fails["judge"] else tasks.RewardError)(
            "another rank's rewards failed: its error says why")
    out = [Episode(p, x, None, s.ids, s.logps, [1] * len(s.ids), *score, truncated=s.truncated, text=t)
           for (p, x), s, t, score in zip(rows, samples, texts, scores)]
    return [out[i : i + group_size] for i in range(0, len(out), group_size)]


def collate(groups: list[list[Episode]], pad_id: int, version: int, drop: bool = False, **stats) -> Batch:
    eps = [e for g in groups for e in g]
    # A group with an unscored sample (reward NaN: --judge-down drop) keeps its rows, masked out: no
    # advantage, no loss, no tokens. NaN stays in the logged parts, whose means skip it.
    lost = [math.isnan(sum(e.reward for e in g)) for g in groups for _ in g]
    stats |= {f"reward_{n}": torch.tensor([e.parts[n] for e in eps]) for n in eps[0].parts}
    if drop:
        stats["judge_dropped_frac"] = torch.tensor(lost, dtype=torch.float)
    return make_batch([e.prompt for e in eps], eps, [0.0 if x else e.reward for x, e in zip(lost, eps)],
                      pad_id, [[0] * len(e.ids) if x else e.mask for x, e in zip(lost, eps)],
                      group_size=len(groups[0]), version=version, stats=stats,
                      texts=[(e.problem.prompt, e.text, e.problem.answer) for e in eps])


def _chat(policy, messages: list[dict]) -> str:
    return policy.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=policy.thinking)


def encode_reply(policy, messages: list[dict], eos_id: int) -> list[int]:
    """Tokens that follow a model turn which ended with `eos_id`, when the environment answers
    `messages` and the model speaks next. Only this delta is tokenized: re-rendering the whole
    chat would let templates that rewrite history (Qwen3 drops earlier <think> blocks) change
    tokens the model already sampled, and the mask would no longer cover what was sampled."""
    if not policy.use_template:
        text = "\n" + "\n\n".join(m["content"] for m in messages) + "\n"
    else:  # render after a stand-in turn, and keep what follows that turn's end token
        mark, eos = "NANORL-TURN-MARK", policy.tokenizer.decode([eos_id])
        stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}]
        after = _chat(policy, stand_in + messages).split(mark, 1)[1]
        text = after.split(eos, 1)[-1]  # all of it if the template writes no end token there
    return policy.tokenizer.encode(text, add_special_tokens=False)


def _checked(env: TextEnv, method: str, arg) -> tuple:
    """env.reset(problem) or env.step(completion), the shape of its result checked: a wrong one failed deep
    in the rollout ("not enough values to unpack", "string indices must be integers")."""
    out, step = getattr(env, method)(arg), method == "step"
    chat = lambda x: isinstance(x, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in x)
    if isinstance(out, tuple) and len(out) == (4 if step else 2) and isinstance(out[-1], dict) and (
            chat(out[0]) and (out[0] or step) or step and out[0] is None):  # a reset's [] is no prompt
        return out
    given = f"the completion {arg[:60]!r}" if step else f"the problem {arg.key!r}"
    want = "(reply messages or None, reward, done, info)" if step else "(messages, info)"
    raise tasks.RewardError(f"{type(env).__name__}.{method} returned {out!r:.80} for {given}; it returns "
                            f"{want}, messages a list of {{'role': text, 'content': text}} dicts")


def _start(policy, env_factory, problem: Problem, max_turns: int) -> Episode:
    env = env_factory()
    env.max_turns = max_turns  # the run's, not the class's default; so an env's __init__ need not take it
    messages, _ = _checked(env, "reset", problem)
    if len(messages) == 1 or not policy.use_template:  # as single-turn tasks encode their prompts
        return Episode(problem, policy.encode_prompt("\n\n".join(m["content"] for m in messages)), env)
    return Episode(problem, policy.tokenizer.encode(_chat(policy, messages), add_special_tokens=False), env)


def rollout_multiturn(policy, env_factory, problems: list[Problem], group_size: int, max_turns: int,
                      max_new_tokens: int, max_len: int, greedy: bool = False, version: int = 0,
                      gen_batch: int = 64) -> Batch:
    """group_size episodes per problem, up to max_turns model turns each, with one policy.generate call
    per turn for all live episodes; env steps run in 8 threads (the sandbox and SQLite release the GIL).
    Only the model's tokens have mask 1. An episode whose next turn would pass max_len ends, truncated."""
    eps = [_start(policy, env_factory, p, max_turns) for p in problems for _ in range(group_size)]
    wide = max(map(len, policy.tokenizer.get_vocab()))  # no token covers more characters than its entry has
    # the model's context ends an episode too: GPT-2's positions; a rotary model's (its inbox refused those)
    max_len = min(max_len, policy.context or max_len)
    if (longest := max(len(e.prompt) for e in eps)) >= max_len:  # EnvRollouts draws none (too_long)
        raise utils.ConfigError(f"a prompt has {longest} tokens, not fewer than max_len or context {max_len}")
    with ThreadPoolExecutor(8) as pool:
        while live := [e for e in eps if not e.done]:  # each ends by max_turns at the latest
            room = [min(max_new_tokens, max_len - len(e.prompt) - len(e.ids)) for e in live]
            prefixes = [e.prompt + e.ids for e in live]
            samples = policy.generate(prefixes, max(room), gen_batch=gen_batch, greedy=greedy)
            for e, s, r in zip(live, samples, room):  # a smaller budget cuts the sample: still token-exact
                e.ids, e.logps = e.ids + s.ids[:r], e.logps + s.logps[:r]
                e.mask += [1] * len(s.ids[:r])
                e.truncated = s.truncated or len(s.ids) > r
            texts = [policy.decode(s.ids[:r]) for s, r in zip(samples, room)]
            steps = pool.map(lambda e, t: _checked(e.env, "step", t), live, texts)
            for e, t, (obs, reward, done, info) in zip(live, texts, steps):
                e.reward += tasks.checked(reward, f"{type(e.env).__name__}.step", t)
                e.turns += 1
                e.solved_at_turn = info.get("solved_at_turn", 0)
                if type(e.solved_at_turn) is not int or not 0 <= e.solved_at_turn <= e.turns:
                    raise tasks.RewardError(f"{type(e.env).__name__}.step's info['solved_at_turn'] is "
                                            f"{e.solved_at_turn!r:.40}: the turn that solved, from 1, or 0")
                e.text += t
                # A turn cut off mid-way ends the episode: a reply must follow its end token (a None ends it)
                e.done = done or obs is None or e.truncated or e.turns == max_turns
                if not e.done:
                    left = max_len - len(e.prompt) - len(e.ids)
                    # A huge reply (a dumped file) would be tokenized whole, for seconds and GBs, only to end
                    # the episode. Cut past (left + 1) * wide characters, it still needs over `left` tokens.
                    cut = [m | {"content": m["content"][: (left + 1) * wide]} for m in obs]
                    reply = encode_reply(policy, cut, e.ids[-1])
                    if len(reply) >= left:
                        e.done = e.truncated = True
                    else:
                        e.ids, e.logps = e.ids + reply, e.logps + [0.0] * len(reply)
                        e.mask += [0] * len(reply)
                        e.text += policy.decode(reply)
    at = torch.tensor([float(e.solved_at_turn) for e in eps])  # [N], 0 = never
    groups = [eps[i : i + group_size] for i in range(0, len(eps), group_size)]
    return collate(groups, policy.pad_id, version, solved=(at > 0).float(),
                   solved_first_turn=(at == 1).float(), turns=torch.tensor([float(e.turns) for e in eps]))


# ================================================================ batch sources
class BatchSource:
    """What the loop asks of wherever batches come from. Sync sources generate with the live
    policy, so `weights` and `publish` have nothing to do there."""

    position = 0  # seeds or problems drawn so far: what a checkpoint holds by default
    last: dict[str, float] = {}  # about the last next(), to log (same keys on every rank); next() replaces it
    eval_batch: Batch | None = None  # the last evaluate()'s rows, for samples.jsonl (none for control tasks)

    def next(self, step: int) -> Batch:
        """Stage 1: this rank's rows for `step`."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy metrics with the live weights, summed or averaged over ranks."""
        raise NotImplementedError

    def weights(self, version: int) -> contextlib.AbstractContextManager:
        """A context in which the policy holds the weights that sampled `version`, for stage 2."""
        return contextlib.nullcontext()

    def publish(self, step: int) -> None:
        """Stage 4: hand the weights of version `step` to whoever generates."""

    def state(self) -> dict:
        """What a checkpoint must hold so a resumed run sees the data it would have seen."""
        return {"position": self.position}

    def load_state(self, state: dict) -> None:
        """Once, before the first step: a checkpoint's state(), or {} for a fresh start."""
        self.position = state.get("position", 0)  # older async trainers' checkpoints have none

    def close(self) -> None:
        pass


class ControlRollouts(BatchSource):
    """CartPole episodes. The seed position is part of the checkpoint."""

    def __init__(self, cfg, policy):
        self.env, self.policy, self.cfg = CartPole(), policy, cfg  # position: one seed per rank per step

    def next(self, step: int) -> Batch:
        """This rank's batch / W episodes, from its own seed below EVAL_SEED (rank r of W: position + r)."""
        seed = (self.cfg.seed * 100_003 + self.position + utils.rank()) % EVAL_SEED
        self.position += utils.world()
        n = self.cfg.batch // utils.world()
        return rollout_control(self.env, self.policy, n, seed, self.cfg.group_size, version=step)

    def evaluate(self) -> dict:
        """Not sharded: every rank plays the same greedy episodes, cheaper than sharding them."""
        batch = rollout_control(self.env, self.policy, self.cfg.eval_episodes, EVAL_SEED, greedy=True)
        return {"eval_return": batch.rewards.sum(1).mean().item()}


# All that TaskRollouts.next puts in `last` (--dynamic-sampling), and all an async trainer takes of a
# worker's `last` (serve.Inbox): a key not named here is logged in sync runs but dropped in async ones.
METRICS = ("gen_rounds", "gen_frac_zero_std")


class TaskRollouts(BatchSource):
    """Single-turn verifiable-reward tasks: batch / group_size prompts, group_size completions
    each. Optional dynamic sampling (drop groups whose rewards all agree) and prompt replay."""

    def __init__(self, cfg, policy):
        self.cfg, self.policy = cfg, policy
        try:
            self.task = self.make_task(cfg)
        except (utils.ConfigError, OSError) as e:  # bad --data, too small a split; not a bug's ValueError
            raise utils.ConfigError(f"--task {cfg.task}: {e}") from None
        if cfg.sft_steps and isinstance(self.task, tasks.DatasetTask) and (rows := self.task.unanswered()):
            shown = ", ".join(rows[:3]) + ", ..." * (len(rows) > 3)  # now, not when the warm-start draws one
            raise utils.ConfigError(f"--sft-steps: {cfg.task} has {len(rows)} rows without an answer to "
                                    f"imitate ({shown}); add answers to its rows, or --sft-steps 0")
        self.spread: list = []  # recent problems whose groups had reward spread: prompt_reweight replays them
        keys = "\n".join(p.key for p in self.task.eval_problems())  # a resume compares them (load_state)
        self.held_out = hashlib.sha256(keys.encode()).hexdigest()[:16]

    def make_task(self, cfg) -> tasks.Task:
        context = None if not self.policy or self.policy.positions else self.policy.context  # GPT-2's: cut
        if context and cfg.max_new_tokens >= context:  # no prompt fits: a rotary model ran past it, silently
            raise utils.ConfigError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in "
                                    f"the model's {context:,}-token context; lower it")
        task = tasks.make_task(cfg.task, seed=cfg.seed, eval_size=cfg.eval_size, data=cfg.data or None,
                               bad_rows=cfg.bad_rows, too_long=self.too_long if self.policy else None)
        if cfg.overlong_buffer:
            count = lambda text: len(self.policy.tokenizer.encode(text, add_special_tokens=False))
            task.rewards.append((tasks.overlong_penalty(cfg.max_new_tokens, cfg.overlong_buffer, count), 1.0))
        # what Task.score reads: a NaN weight made every sample look unscored (nothing trained, silently), a
        # string or a bare function failed mid-step naming nothing
        pair = lambda r: isinstance(r, (tuple, list)) and len(r) == 2 and callable(r[0]) and isinstance(
            r[1], numbers.Real) and math.isfinite(r[1])
        if not task.rewards or not all(map(pair, task.rewards)):
            raise utils.ConfigError(f"{type(task).__name__}.rewards is {task.rewards!r:.100}: list "
                                    "(function, weight) pairs, at least one, each weight a finite number")
        return task

    def too_long(self, problem: Problem) -> str | None:
        """Why a data row's prompt cannot be sampled (None: it fits): with --max-new-tokens it would pass the
        model's context. Unchecked, a rotary model ran past it silently and a huge row ran out of memory."""
        if not (context := self.policy.context):  # a config that names no context: nothing to compare with
            return None
        return self.overflow(len(self.policy.encode_prompt(problem.prompt)), context)

    def overflow(self, n: int, limit: int, fix: str = "shorten the question or delete the row") -> str | None:
        """too_long's verdict on a prompt of n tokens, which must leave --max-new-tokens of `limit` (the
        model's context or --max-len)."""
        context, room = self.policy.context, limit - self.cfg.max_new_tokens
        if n <= room:
            return None
        where = f"the model's {context:,}-token context" if limit == context else f"--max-len {limit}"
        return (f"prompt of {n:,} tokens after the chat template; {where} less --max-new-tokens "
                f"{self.cfg.max_new_tokens} leaves {room:,}: {fix}")

    def draw(self, n: int) -> list[Problem]:
        """This rank's share of the next n problems (indices position + r, + r + W, ...: disjoint), its
        first prompt_reweight share swapped for recent prompts whose groups had reward spread (oldest
        first). The fresh ones it replaces are skipped, so every rank advances the stream alike."""
        indices = range(self.position + utils.rank(), self.position + n, utils.world())
        fresh = [self.train_problem(i) for i in indices]
        self.position += n
        r = min(int(self.cfg.prompt_reweight * len(fresh)), len(self.spread))
        replay, self.spread = self.spread[:r], self.spread[r:]
        return replay + fresh[r:]

    def train_problem(self, index: int) -> Problem:  # EnvRollouts redraws one it cannot play
        return self.task.train_problem(index)

    def next(self, step: int) -> Batch:
        cfg, want = self.cfg, self.cfg.batch // self.cfg.group_size
        need = want // utils.world()  # this rank's groups
        kept, flat, rounds = [], [], 0
        # Dynamic sampling (DAPO): a group whose rewards all agree has zero advantage under GRPO and
        # RLOO, so it is set aside and fresh prompts are generated, at most max_gen_batches rounds: on all
        # ranks while any is short (by their own counts they drew apart from the one position checkpointed).
        limit = cfg.max_gen_batches if cfg.dynamic_sampling else 1
        while rounds < limit and (not rounds or utils.reduce_dict({"short": len(kept) < need})["short"]):
            rounds += 1
            for group in rollout_single(self.policy, self.task, self.draw(want), cfg.group_size, cfg):
                rewards = {r.reward for r in group}  # NaN: a judge gave no score, the group is masked out
                spread = len(rewards) > 1 and not math.isnan(sum(rewards))
                self.spread += [group[0].problem] if spread and cfg.prompt_reweight else []
                (kept if spread or not cfg.dynamic_sampling else flat).append(group)
        self.spread = self.spread[-cfg.batch :]  # "recent": the last batch-many prompts with spread
        if cfg.dynamic_sampling:
            self.last = {"gen_rounds": rounds, "gen_frac_zero_std": len(flat) / (len(flat) + len(kept))}
        # Nothing informative within the bound: train on what there is (no GRPO/RLOO gradient).
        return collate(kept[:need] or flat[:need], self.policy.pad_id, step, cfg.judge_down == "drop")

    def evaluate(self) -> dict:
        """Rank r of W scores eval problems r, r + W, ...; summed over ranks, as one process would."""
        problems, cfg, task = self.task.eval_problems()[utils.rank() :: utils.world()], self.cfg, self.task
        greedy = rollout_single(self.policy, task, problems, 1, cfg, greedy=True)  # judged: rewards[0] counts
        sums = {"n": len(problems), "eval_accuracy": sum(task.correct(g[0].problem, g[0].text, g[0].parts)
                                                         for g in greedy)}
        if type(task).lenient is not tasks.Task.lenient:  # by type: a rank without problems has the key too
            sums["eval_accuracy_lenient"] = sum(task.lenient(g[0].problem, g[0].text) for g in greedy)
        if k := cfg.pass_k:
            groups = rollout_single(self.policy, task, problems, k, cfg)
            c = [sum(task.correct(r.problem, r.text, r.parts) for r in g) for g in groups]
            sums |= {"eval_pass@1": sum(c) / k, f"eval_pass@{k}": sum(tasks.pass_at_k(k, ci, k) for ci in c)}
        sums = utils.reduce_dict(sums)
        self.eval_batch = collate(greedy, self.policy.pad_id, 0) if greedy else None
        if cfg.debug_samples and greedy:
            show_samples(self.eval_batch, "eval", cfg.debug_samples)
        return {k: v / sums["n"] for k, v in sums.items() if k != "n"}

    def demonstrations(self, n: int) -> Batch:
        """n solver-written (prompt, answer) rows for the supervised warm-start (--sft-steps)."""
        problems, tok = self.draw(n), self.policy.tokenizer
        texts = [self.task.solve(p) for p in problems]
        if bad := [t for t in texts if not isinstance(t, str) or not t]:
            raise utils.ConfigError(f"--sft-steps: {type(self.task).__name__}.solve() gave {bad[0]!r:.60}, "
                                    "not an answer's text to imitate (a judged task's rows may have none); "
                                    "make it return one, or --sft-steps 0")
        ids = [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in texts]
        demos = [Sample(d, [0.0] * len(d), False) for d in ids]
        return make_batch([self.prompt_ids(p) for p in problems], demos, [0.0] * n, self.policy.pad_id)

    def prompt_ids(self, problem: Problem) -> list[int]:  # what the warm-start imitates after
        return self.policy.encode_prompt(problem.prompt)

    def state(self) -> dict:  # spreads: every rank's own (rank 0's alone had a resumed rank 1 replay its)
        spreads = utils.gather_json([astuple(p) for p in self.spread]) if self.cfg.prompt_reweight else []
        return super().state() | {"held_out": self.held_out} | ({"spreads": spreads} if any(spreads) else {})

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        spreads = state.get("spreads", [state.get("spread", [])])  # none: no replay; older: rank 0's
        r, w = utils.rank(), utils.world()  # another world size: all ranks' dealt out anew
        own = spreads[r] if len(spreads) == w else [p for s in spreads for p in s][r::w]
        self.spread = [Problem(*p) for p in own]
        if state.get("held_out", self.held_out) != self.held_out:  # an older checkpoint has none
            utils.stderr("warning: the eval problems are not the run's (its --data rows, --seed or "
                         "--eval-size changed): evals from here on measure others, some perhaps trained on")


class EnvRollouts(TaskRollouts):
    """Multi-turn episodes: the model acts, the environment replies, up to max_turns times. One
    episode is one token sequence; only the model's own tokens are trained."""

    def make_task(self, cfg) -> tasks.Task:
        env = TEXT_ENVS[cfg.task]
        if not (isinstance(env.task, type) and issubclass(env.task, tasks.Task)):
            raise utils.ConfigError(f"{env.__name__}.task is {env.task!r}: set it to the tasks.Task "
                                    "class it plays")
        self.env = env
        rows = issubclass(env.task, tasks.DatasetTask)  # reads --data's rows (else the hub's), as single-turn
        data = {"data": cfg.data or None, "bad_rows": cfg.bad_rows,  # a row too long is malformed: drawn, it
                "too_long": self.too_long if self.policy else None} if rows else {}  # stopped the run
        task = env.task(seed=cfg.seed, eval_size=cfg.eval_size, **data)
        top = self.policy and max(task.eval_problems(), key=lambda p: len(self.prompt_ids(p)), default=None)
        if top and (why := self.too_long(top)):  # a procedural split's longest: now, not in an eval
            raise utils.ConfigError(f"the eval problem {top.key!r} has no room for a turn: {why}")
        return task

    def too_long(self, problem: Problem) -> str | None:
        """As a single-turn row's, for the env's opening (its reset may reword the row), within --max-len
        too: the prompt must leave one whole turn of --max-new-tokens, as a single-turn prompt leaves its
        completion's. With less, the first turn is cut short, truncated, whatever the model would say."""
        try:
            n = len(self.prompt_ids(problem))
        except tasks.RewardError:  # a wrong reset (a ValueError: to the loader a malformed row, every row):
            return None  # the first rollout stops on it, in one line naming the env
        need, context = n + self.cfg.max_new_tokens, self.policy.context or math.inf
        if n < (limit := min(self.cfg.max_len, context)) and not issubclass(self.env.task, tasks.DatasetTask):
            return None  # generated: a shorter first turn (refused, sql's longest db left the defaults)
        fix = f"raise --max-len to {need}" if need <= context else f"lower --max-new-tokens to {context - n}"
        fix = fix if n < context else "the prompt alone fills the model's context"
        return self.overflow(n, limit, fix)

    def train_problem(self, index: int) -> Problem:
        """A procedural draw too_long refuses is named and redrawn (it stopped the run, on --resume too)."""
        if not (self.policy and isinstance(self.task, tasks.ProceduralTask)):  # a dataset's: refused at load
            return super().train_problem(index)
        for tries, problem in zip(range(100), self.task.draws(index)):
            if not (why := self.too_long(problem)):
                return problem
            utils.stderr(f"warning: training problem {index} draw {tries + 1} {problem.key!r} redrawn: {why}")
        raise utils.ConfigError(f"100 draws in a row have no room for a turn, the last a {why}")

    def prompt_ids(self, problem: Problem) -> list[int]:  # the env's reset messages, which may reword it
        return _start(self.policy, self.env, problem, self.cfg.max_turns).prompt

    def episodes(self, problems: list[Problem], k: int, greedy: bool = False, version: int = 0) -> Batch:
        cfg = self.cfg
        return rollout_multiturn(self.policy, self.env, problems, k, cfg.max_turns, cfg.max_new_tokens,
                                 cfg.max_len, greedy, version, cfg.gen_batch)

    def next(self, step: int) -> Batch:
        k = self.cfg.group_size
        return self.episodes(self.draw(self.cfg.batch // k), k, version=step)

    def evaluate(self) -> dict:
        """As for single-turn tasks: rank r plays eval problems r, r + W, ..., greedy (and --pass-k)."""
        problems, k = self.task.eval_problems()[utils.rank() :: utils.world()], self.cfg.pass_k
        self.eval_batch = self.episodes(problems, 1, greedy=True) if problems else None
        if self.cfg.debug_samples and problems:
            show_samples(self.eval_batch, "eval", self.cfg.debug_samples)
        names = {"solved": "eval_accuracy", "solved_first_turn": "eval_accuracy_first_turn",
                 "turns": "eval_turns"}
        sums = {name: float(self.eval_batch.stats[s].sum()) if problems else 0.0 for s, name in names.items()}
        if k:  # c[i]: how many of problem i's k sampled episodes solved it
            solved = self.episodes(problems, k).stats["solved"] if problems else torch.zeros(0)
            c = solved.view(-1, k).sum(1).int().tolist()
            sums |= {"eval_pass@1": sum(c) / k, f"eval_pass@{k}": sum(tasks.pass_at_k(k, ci, k) for ci in c)}
        sums = utils.reduce_dict({"n": len(problems), **sums})
        return {name: v / sums["n"] for name, v in sums.items() if name != "n"}


def sample_rows(batch: Batch, n: int, kind: str, step: int) -> list[dict]:
    """The first n rows as samples.jsonl records: the texts (a multi-turn episode's whole transcript, tool
    calls and replies included), length, how it ended, reward and its parts, advantage, sampling version."""
    rows = []
    for r, (prompt, completion, answer) in enumerate(batch.texts[:n]):
        mask, version = batch.mask[r] > 0, int(batch.version[r])  # version: train rows (eval: the step's)
        rows.append({"kind": kind, "prompt": prompt, "completion": completion, "answer": answer,
                     "tokens": int(mask.sum()), "finish": "budget" if batch.truncated[r] else "end",
                     "reward": json_number(batch.rewards[r].sum() if mask.any() else math.nan),  # unscored
                     "adv": None if batch.adv is None else json_number(batch.adv[r][mask].mean()),
                     "rewards": {k.removeprefix("reward_"): json_number(v[r]) for k, v in batch.stats.items()
                                 if k.startswith("reward_")},
                     **({"version": version, "staleness": step - 1 - version} if kind == "train" else {})})
    return rows


def json_number(x) -> float | None:
    """NaN (a part no judge scored; the advantage of a row masked out for it) as null: strict JSON
    readers (jq, most databases) refuse the whole file at a NaN."""
    return None if math.isnan(x := float(x)) else x


def show_samples(batch: Batch, label: str, n: int) -> None:
    """Prints the first n rows' prompt, completion, answer and reward breakdown (--debug-samples): rank 0's
    under torchrun, as train.py's own rows are (each rank printed its share of an eval's, n each)."""
    if utils.rank() > 0:
        return
    for r, (prompt, completion, answer) in enumerate(batch.texts[:n]):
        parts = {k.removeprefix("reward_"): round(float(v[r]), 4) for k, v in batch.stats.items()}
        tqdm.write(f"--- {label} prompt: {prompt!r}\n    completion: {completion!r}\n"
                   f"    answer: {answer!r} reward {float(batch.rewards[r].sum()):.3g}: {parts}")


CONTROL = {"cartpole": ControlRollouts}


def sources() -> dict[str, type[BatchSource]]:
    """--task name -> its source; read at call time, so a task or env registered after import counts."""
    for where, (registry, base) in {"tasks.TASKS": (tasks.TASKS, tasks.Task),
                                    "envs.TEXT_ENVS": (TEXT_ENVS, TextEnv)}.items():
        for name, entry in registry.items():  # a slip in an edit: one line naming it, not a traceback
            if not (isinstance(entry, type) and issubclass(entry, base)):
                raise utils.ConfigError(f"{where}[{name!r}] is {entry!r:.80}, not a {base.__name__} "
                                        "subclass: register the class itself, not an instance or a function")
    return {**CONTROL, **dict.fromkeys(tasks.TASKS, TaskRollouts), **dict.fromkeys(TEXT_ENVS, EnvRollouts)}
