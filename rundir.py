"""What a run leaves on disk and how it comes back: metrics.csv, samples.jsonl and the TensorBoard / W&B
loggers, the curve, atomic checkpoints (saved, resumed, set aside), run and export directories."""
import contextlib
import csv
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import os
import pickle  # only for its exception: torch.load(weights_only=True) raises it on foreign bytes
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import utils  # for utils.rank(), looked up at each call (tests replace it)
from utils import UMASK, ConfigError, dump_config, rng_states, set_rng_states, stderr


# ---------------------------------------------------------------- metrics
class Metrics:
    """config.yaml, metrics.csv in long format (step, wall_s, key, value: any tool reads any metric) and
    samples.jsonl, then cfg.log's loggers. A resumed run first drops the lines after its checkpoint's step,
    which it writes again. Without `out`, and on any rank but 0 (it logs all-reduced numbers), nothing."""
    SAMPLES_MAX_BYTES = 32 << 20  # ~100k short completions: report.html opens them in about a second

    def __init__(self, out: Path | None = None, cfg=None, wall_offset: float = 0.0, resumed_at=None):
        self.t0, self.loggers = time.perf_counter() - wall_offset, []
        self.out = out if utils.rank() == 0 else None
        if not self.out:
            return
        try:  # a run of another user's, a read-only mount
            out.mkdir(parents=True, exist_ok=True)
            self.lock = open(out / ".lock", "w")  # held while this process lives: a kill, too, lets it go
        except OSError as e:
            raise ConfigError(f"{out}: cannot write the run there ({e.strerror}); pick another --out (to "
                              "resume: copy the run to a place you can write)") from None
        try:  # two runs in one directory would interleave their steps and overwrite each other's checkpoints
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{out}: another run is still writing there; stop it first (a new run can "
                              "take another --out)") from None
        if resumed_at is not None:  # an --eval-only's directory may collect evals: only its step's go
            keep = (lambda s: s != resumed_at + 1) if cfg.eval_only else (lambda s: s <= resumed_at)
            set_aside(out, resumed_at)
            for name in LOGS:
                truncate_log(out / name, keep)
        saved = cfg if cfg.eval_only else dataclasses.replace(cfg, resume="")  # as a --config: a new run
        atomic_write(out / "config.yaml", dump_config(saved).encode())  # a refused write keeps the run's own
        self.csv_file = open(out / "metrics.csv", "a", newline="")
        # "\n", not csv's "\r\n": truncate_log rewrites a resumed run's lines with "\n": one ending a file
        self.writer = csv.writer(self.csv_file, lineterminator="\n")
        if self.csv_file.tell() == 0:  # a new file
            self.writer.writerow(["step", "wall_s", "key", "value"])
        self.samples_file = open(out / "samples.jsonl", "a")
        names = dict.fromkeys(filter(None, cfg.log.split(",")))  # --log tensorboard,tensorboard: one
        self.loggers = [LOGGERS[name](out, cfg, resumed_at) for name in names]

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.out:
            wall = round(self.wall(), 3)
            self.writer.writerows([step, wall, key, f"{float(value):.6g}"] for key, value in values.items())
            self.csv_file.flush()
        for logger in self.loggers:
            logger.log(step, values)

    def logged(self, step: int, prefix: str) -> bool:
        """Whether metrics.csv has a key starting with `prefix` at `step`: rank 0's answer, on every rank."""
        mine = bool(self.out) and any(k.startswith(prefix) and any(s == step for s, _, _ in points)
                                      for k, points in read_metrics(self.out / "metrics.csv").items())
        return bool(utils.reduce_dict({"logged": mine})["logged"])

    def samples(self, step: int, rows: list[dict]) -> None:
        """Past SAMPLES_MAX_BYTES samples.jsonl becomes samples.1.jsonl (replacing it): at most 2x that."""
        if self.out:
            self.samples_file.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
            self.samples_file.flush()
            if self.samples_file.tell() > self.SAMPLES_MAX_BYTES:
                self.samples_file.close()
                os.replace(self.out / "samples.jsonl", self.out / "samples.1.jsonl")
                self.samples_file = open(self.out / "samples.jsonl", "a")
        for logger in self.loggers:
            logger.samples(step, rows)

    def close(self) -> None:
        if self.out:
            self.csv_file.close()
            self.samples_file.close()
            self.lock.close()
        for logger in self.loggers:
            logger.close()


LOGS = ("metrics.csv", "samples.jsonl", "samples.1.jsonl")


def truncate_log(path: Path, keep) -> None:
    """Keeps metrics.csv's / samples.jsonl's lines of the steps `keep` takes, less a last line cut short."""
    if not path.exists():
        return
    # surrogateescape: a byte that is no UTF-8 (a disk error's) fails only its own line, or is kept as it was
    lines = path.read_text(errors="surrogateescape").splitlines(keepends=True)
    csv_file = path.suffix == ".csv"
    step = (lambda x: float(x.split(",", 1)[0])) if csv_file else (lambda x: json.loads(x)["step"])
    kept = [h for h in lines[:1] if h.endswith("\n")] if csv_file else []  # a header cut short: written anew
    for n, line in enumerate(lines[len(kept):], len(kept) + 1):
        try:
            if line.endswith("\n") and keep(step(line)):
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a hand edit: the run must not drop what it cannot read
            raise ConfigError(f"{path}:{n}: cannot read the line {line[:40]!r}; fix or delete it") from None
    atomic_write(path, "".join(kept).encode(errors="surrogateescape"))


def set_aside(run: Path, step: float) -> None:
    """Moves the checkpoints after `step`, with a copy of the logs, to RUN/replaced-<time>: else rotation
    would delete the resumed run's new checkpoints before those, and a later --resume would load theirs."""
    if later := [c for c in checkpoints(run) if int(c.name[5:]) > step]:
        aside = fresh_dir(str(run / "replaced"))
        for name in ("config.yaml", *LOGS):  # their lines after `step` are about to go. First: a full disk
            if (run / name).exists():  # at a copy must leave the checkpoints, for a retry to set aside
                shutil.copy2(run / name, aside / name)
        for ckpt in later:
            os.replace(ckpt, aside / ckpt.name)
        stderr(f"moved the checkpoints after step {step:g} to {aside}, with a copy of the logs")


class TensorBoard:
    """--log tensorboard: events under RUN/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, out: Path, cfg, resumed_at: float | None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: only --log tensorboard needs it
        except ImportError:
            raise ConfigError("--log tensorboard needs tensorboard: pip install tensorboard") from None
        # purge_step hides the events a killed run wrote past its checkpoint, as truncate_log does in the CSV.
        # Not an --eval-only's: its directory may hold evals of later steps (a rerun's step: same numbers).
        purge = None if resumed_at is None or cfg.eval_only else int(resumed_at) + 1
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=purge)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        """samples.jsonl and the report show them; TensorBoard's text view would only repeat them."""

    def close(self) -> None:
        self.writer.close()


class WandB:
    """--log wandb: offline unless WANDB_MODE says otherwise (`wandb sync RUN/wandb/offline-run-*` uploads).
    Every key is plotted against the "step" key, so warm-start steps (negative) and resumed steps fit."""

    def __init__(self, out: Path, cfg, resumed_at: float | None):
        os.environ.setdefault("WANDB_MODE", "offline")  # training must not wait on, or need, the network
        try:
            import wandb  # optional: only --log wandb needs it
        except ImportError:
            raise ConfigError("--log wandb needs the wandb package: pip install wandb") from None
        # the id names the directory, as resumes of it find it again, and no other one (runs/a/eval-0000030);
        # its name part cut at 64: a table's artifact, "run-<id>-samples", may not pass 128 characters
        where = hashlib.sha256(os.fsencode(out.resolve())).hexdigest()[:8]
        ident = re.sub(r"[^\w-]", "_", f"{out.name[:64]}-{where}")
        self.wandb, self.run = wandb, wandb.init(dir=str(out), name=out.name, config=dataclasses.asdict(cfg),
                                                  resume="allow", id=ident)
        self.run.define_metric("*", step_metric="step")
        self.pending: list[dict] = []

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def samples(self, step: int, rows: list[dict]) -> None:
        """A table per eval, with the training rows since the last (a table a step: 10,000 artifacts)."""
        self.pending += [{"step": step, **row} for row in rows]
        if rows and rows[0]["kind"] == "eval":
            self.flush()

    def flush(self) -> None:
        columns = sorted({k for row in self.pending for k in row})
        cell = lambda v: json.dumps(v) if isinstance(v, dict) else v  # a reward breakdown: one text cell
        data = [[cell(r.get(c)) for c in columns] for r in self.pending]
        table = self.wandb.Table(columns=columns, data=data)
        self.run.log({"step": self.pending[-1]["step"], "samples": table})
        self.pending = []

    def close(self) -> None:
        if self.pending:  # the training rows since the last eval (a stopped run's; its resume goes on)
            self.flush()
        self.run.finish()


LOGGERS = {"tensorboard": TensorBoard, "wandb": WandB}


def read_metrics(path: Path, strict: bool = False) -> dict[str, list[tuple[int, float, float]]]:
    """metrics.csv's series by key, less a last line still being written (report.py beside a live run). A
    damaged line (a hand edit, a disk error) is left out with a warning: a live run's report, curve and
    summary must not stop the run. `strict` (report.py) raises a ConfigError naming it instead."""
    series: dict[str, list] = {}
    # Lines as an editor numbers them (read_text would end one at a stray "\r" too); bytes a disk error
    # left fail their own line below
    lines = path.read_bytes().decode(errors="replace").split("\n")[:-1]
    for n, line in enumerate(lines[1:], 2):  # line 1: the header
        if line in ("", "\r"):  # blank: nothing to lose
            continue
        try:
            key, point = metrics_point(line)
        except ValueError as e:
            why = f"{path}:{n}: {e}; repair or delete that line (the run's checkpoints are untouched)"
            if strict:
                raise ConfigError(why) from None
            warnings.warn(f"{why}; the report and curve leave it out")
            continue
        series.setdefault(key, []).append(point)
    return {k: sorted(v, key=lambda p: p[0]) for k, v in series.items()}  # --eval-only's: in the order run


def metrics_point(line: str) -> tuple[str, tuple[int, float, float]]:
    """A metrics.csv line's key and (step, wall_s, value); a ValueError says what is wrong with it."""
    try:  # a reader a line: one over the file would read a stray quote's next lines as part of its field
        [row] = csv.reader([line])
    except csv.Error:  # a carriage return inside a field, a field past csv's 128 KiB: a disk error's bytes
        raise ValueError("it does not read as one CSV row") from None
    if len(row) != 4:
        raise ValueError(f"{len(row)} fields, not 4 (step,wall_s,key,value)")
    step, wall, key, value = row
    point = []  # each field parsed once: a report reads every line of a long run's file
    for name, text, kind in (("step", step, int), ("wall_s", wall, float), ("value", value, float)):
        try:
            point.append(kind(text))
        except ValueError:
            raise ValueError(f"{name} {text[:40]!r} is not a {'whole ' * (kind is int)}number") from None
    return key, tuple(point)


def plot(out: Path, keys: tuple[str, ...]) -> "Figure":
    from matplotlib.figure import Figure  # lazily: only the end-of-run plot needs it (no pyplot: no GUI)

    series = read_metrics(out / "metrics.csv")
    fig = Figure(figsize=(10, 3.5))
    axes = fig.subplots(1, 2)
    for key in [k for k in keys if k in series]:  # an eval before a warm-start is step -sft_steps
        steps, walls, values = zip(*series.get(f"{key}_before_sft", []) + series[key])
        axes[0].plot(steps, values, label=key)
        axes[1].plot(walls, values, label=key)
    if sft := series.get("sft_loss"):
        axes[0].axvspan(sft[0][0] - 1, 0, color="grey", alpha=0.15, label="supervised warm-start")
        axes[1].axvspan(0, sft[-1][1], color="grey", alpha=0.15, label="supervised warm-start")
    for ax, label in zip(axes, ("step", "wall seconds")):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        if ax.has_data():  # a run stopped before its first point: a legend of nothing warned
            ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=100)
    return fig


# ---------------------------------------------------------------- checkpoints
@contextlib.contextmanager
def atomic_dir(final: Path):
    """A fresh directory beside `final`, renamed to `final` (replacing it) once the block has filled it:
    a reader never sees half of it. An empty `final` (an --export DIR: a mount point, or in a directory
    this user cannot write, where no rename can replace it) is filled from a fresh directory inside it."""
    in_place = final.is_dir() and not any(final.iterdir())
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final if in_place else final.parent))
    tmp.chmod(0o777 & ~UMASK)  # as mkdir would: mkdtemp's 0700 hid exports and caches from other users
    try:
        yield tmp
        for path in tmp.rglob("*"):  # as open() and mkdir would: safetensors writes its files 0600
            path.chmod((0o777 if path.is_dir() else 0o666) & ~UMASK)
        for path in tmp.iterdir() if in_place else ():
            os.replace(path, final / path.name)
        if not in_place:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    except (SafetensorError, RuntimeError) as e:  # how safetensors and torch.save report a failed write
        free = shutil.disk_usage(tmp).free >> 20  # the cause (a full disk, say) is only in their message
        raise OSError(errno.EIO, f"{e}; {free} MiB free there", str(final)) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_blocker(path: Path, run: Path | None = None) -> str | None:
    """Why an export cannot be written to `path` (None: it can). It never replaces a file: an --export
    of `.`, of a run's or a model's directory would have deleted them; nor holds the `run` (to be)."""
    if any(p.is_file() for p in (path, *path.parents)):
        return "a file is in the way of that directory"
    if path.is_dir() and any(path.iterdir()):
        return "that directory is not empty"
    inside = run and path.resolve() in (run.resolve(), *run.resolve().parents)
    return "the run's directory is in it" if inside else None


def fresh_dir(prefix: str) -> Path:
    """<prefix>-<time>, or <prefix>-<time>-2, -3, ...: mkdir is atomic, so a sweep's runs never share one."""
    base = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    if utils.rank() > 0:
        return Path(base)  # the other ranks never write there: they name it in messages only
    for n in itertools.count(1):
        path = Path(base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(f"cannot create the run directory {path} ({e}); pass --out DIR") from None


def where(cfg) -> Path:
    """A run's directory (train.Config's): --resume's, the run of a --resume ckpt-*, --out, or a new one."""
    if not cfg.resume:
        return Path(cfg.out) if cfg.out else fresh_dir(f"runs/{cfg.task}-{cfg.algo}")
    ckpt = Path(cfg.resume)
    if not ckpt.name.startswith("ckpt-"):
        return ckpt
    if not ckpt.is_dir() and (ckpt.parent / "config.yaml").exists():  # a run, and a step it has not kept
        have = ", ".join(c.name for c in checkpoints(ckpt.parent)) or "no checkpoint"
        raise ConfigError(f"--resume {ckpt}: no such checkpoint; {ckpt.parent} has {have}")
    return ckpt.parent


def atomic_write(path: Path, data: bytes) -> None:
    """`data` as the file's new content, fsync'd beside it and renamed over it: never half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # report.py may rewrite a live run's report.html
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk's half file would hold what room it found
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(out: Path, step: int, policy: torch.nn.Module, opt: torch.optim.Optimizer, meta: dict,
                    keep: int, rng: torch.Tensor | None = None) -> Path | None:
    """ckpt-<step>/ by atomic_dir: weights as safetensors, optimizer and RNG states a tensors-only torch.save
    (read back weights_only=True), the rest JSON; the newest `keep` stay. Rank 0 alone writes: others None."""
    if utils.rank() > 0:
        return None
    final = out / f"ckpt-{step:07d}"
    with atomic_dir(final) as tmp:
        weights = {n: p.detach().contiguous() for n, p in policy.named_parameters() if p.requires_grad}
        save_file(weights, str(tmp / "weights.safetensors"))
        rng = rng_states() if rng is None else rng  # one process: else every rank gathers them
        torch.save({"optimizer": opt.state_dict(), "torch_rng": rng}, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1))
        for path in tmp.iterdir():  # on disk before the rename publishes them
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old)
    for stale in out.glob(".tmp-ckpt-*"):  # a write that a kill (preemption, OOM) cut short: GBs of nothing
        shutil.rmtree(stale, ignore_errors=True)
    return final


def checkpoints(run: Path) -> list[Path]:
    """Oldest first, by step (warm-start checkpoints have negative steps); a ckpt-0000001.bak is a copy."""
    found = [p for p in run.glob("ckpt-*") if re.fullmatch(r"ckpt--?\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def out_blocker(run: Path, eval_only: bool = False) -> str | None:
    """Why a new run cannot go in `run` (None: it can): a checkpoint or a logged metric it would mix with (a
    failed start may leave none), or files of the names a run writes that no run made (no .lock). An
    --eval-only may log into another's directory (config.yaml's line), each eval at its checkpoint's step."""
    metrics, config = run / "metrics.csv", run / "config.yaml"
    # errors="replace": a byte that is no UTF-8 (a user's own file, a disk error's) is no "eval_only: true"
    text = config.read_text(errors="replace") if eval_only and config.is_file() else ""
    evals = "eval_only: true" in text.splitlines()
    if checkpoints(run) or not evals and metrics.exists() and metrics.read_bytes().count(b"\n") > 1:
        return f"holds a run: --resume {run} continues it, or pick another --out"
    ours = [n for n in (*LOGS, "config.yaml", "report.html", "curve.png") if (run / n).exists()]
    if ours and not (run / ".lock").exists():
        return f"holds {', '.join(ours)}, not a run's, which a run would overwrite; pick another --out"
    return None


def load_checkpoint(ckpt: Path, policy: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Reads and checks every file before changing anything: a damaged checkpoint leaves policy and opt as
    they were. Adam's hyperparameters stay this run's (its --lr: a resume may change it), its moments load."""
    weights = load_file(str(ckpt / "weights.safetensors"))
    state = torch.load(ckpt / "state.pt", weights_only=True)
    meta = json.loads((ckpt / "meta.json").read_text())
    trained = {n: p.shape for n, p in policy.named_parameters() if p.requires_grad}
    if {n: w.shape for n, w in weights.items()} != trained:
        raise ConfigError(f"{ckpt}: its tensors do not match this policy (model, LoRA, --hidden or PPO "
                          f"critic unlike the run's); --resume {ckpt.parent} alone restores the run's own")
    groups = check_restorable(meta, state, opt)
    policy.load_state_dict(weights, strict=False)
    own = opt.state_dict()["param_groups"]
    opt.load_state_dict({"state": state["optimizer"]["state"],
                         "param_groups": [{**g, "params": ids} for g, ids in zip(own, groups)]})
    set_rng_states(state["torch_rng"])
    return meta


def check_restorable(meta, state, opt: torch.optim.Optimizer) -> list[list]:
    """The saved optimizer's parameter ids by group, once meta.json and state.pt are checked to hold what
    load_checkpoint restores; else a KeyError (a foreign or crafted file: skipped, as a damaged one is), not
    a half-loaded run or a traceback steps later. RNG states are tried on a generator of their own."""
    def adam(moments: dict, shape) -> bool:  # one parameter's step, exp_avg and exp_avg_sq
        return {"step", "exp_avg", "exp_avg_sq"} <= moments.keys() and all(
            torch.is_tensor(t) and t.is_floating_point() and t.shape in (shape, ()) for t in moments.values())

    cpu = torch.get_rng_state().numel()
    try:
        groups, rng = [g["params"] for g in state["optimizer"]["param_groups"]], state["torch_rng"]
        shapes = {i: p.shape for ids, g in zip(groups, opt.param_groups) for i, p in zip(ids, g["params"])}
        ok = (type(meta["step"]) is int and type(meta["wall_s"]) in (int, float)
              and isinstance(meta["source"], dict)
              and all(type(v) in (int, float) for v in meta.get("last_eval", {}).values())
              and [len(ids) for ids in groups] == [len(g["params"]) for g in opt.param_groups]
              and all(adam(moments, shapes[i]) for i, moments in state["optimizer"]["state"].items())
              and rng.dtype == torch.uint8 and rng.dim() in (1, 2) and rng.shape[-1] >= cpu)
        for row in rng.view(-1, rng.shape[-1]) if ok else ():
            torch.Generator().set_state(row[:cpu].clone())  # a RuntimeError: no mt19937 state
    except (TypeError, KeyError, AttributeError, RuntimeError):
        ok = False
    if not ok:
        raise KeyError("meta.json or state.pt lacks what a nanorl checkpoint of this policy holds")
    return groups


def resume_checkpoint(run: Path, policy: torch.nn.Module, opt: torch.optim.Optimizer,
                      required: bool = False) -> dict | None:
    """The newest checkpoint of a run that loads (None: none does), or the one named, which must load, as
    must one when `required` (--eval-only): else the untrained model would stand in. Names each skipped."""
    named, others = run.name.startswith("ckpt-"), []  # others: checkpoints of another policy, newest first
    for ckpt in [run] if named else reversed(checkpoints(run)):
        try:
            meta = load_checkpoint(ckpt, policy, opt)
        except ConfigError as e:  # copied in from another run, or flags that change the policy (all are then)
            others.append((ckpt, e))
            continue
        # a copy or a full disk cut it short, a disk error garbled it (no UTF-8); torch.load raises the last 3
        # on an empty or a foreign state.pt
        except (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, KeyError, OSError, RuntimeError,
                EOFError, pickle.UnpicklingError) as e:
            stderr(f"skipping {ckpt}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'}")
            continue
        for other, _ in others:  # an older one is this policy's: those are another run's
            stderr(f"skipping {other}: its tensors are another policy's (copied from another run?)")
        return meta
    if others:
        raise others[0][1]
    if named or required:  # (an --eval-only's directory, RUN/eval-STEP, holds none)
        why = "no checkpoint of it loads (above)" if named or checkpoints(run) else "it holds no checkpoint"
        raise ConfigError(f"--resume {run}: {why}; resume another run or ckpt-*")
    stderr(f"--resume {run}: no checkpoint loads; the run starts over")
    return None
