"""Plumbing shared by the loop: config parsing, metrics and their loggers, checkpoints, torchrun helpers."""
import argparse
import contextlib
import csv
import dataclasses
import datetime
import difflib
import errno
import fcntl
import inspect
import itertools
import json
import math
import os
import pickle  # only for its exception: torch.load(weights_only=True) raises it on foreign bytes
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
# torchrun then reports a failed rank's traceback (cli() and a test's own entry point wrap main in it)
from torch.distributed.elastic.multiprocessing.errors import record

UMASK = os.umask(0o022)  # the process's umask, read the only way there is (setting it), then put back
os.umask(UMASK)


# ---------------------------------------------------------------- config
class ConfigError(ValueError):
    """A bad flag, key or combination; the message says how to fix it."""


def closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.4)
    return f"; did you mean '{match[0]}'?" if match else ""


def coerce(field: dataclasses.Field, value, source: str):
    """YAML/CLI value -> the field's type, or a ConfigError naming the key. YAML's true is no number and 1 no
    bool; an int takes YAML's 3.0 (not 3.5, nor "3.0" on the CLI); a float is finite (a NaN lr would pass
    every range check)."""
    kind = field.type.__name__  # train.Config's annotations are types, not strings (no __future__ import)
    if kind == "str" and (value is None or isinstance(value, bool)):  # `tis: off` would be tis "False"
        raise ConfigError(f"{source}: '{field.name}' must be text, got {value!r}: quote it, as in 'off' "
                          "(YAML reads an unquoted off, no, yes or null as no text)")
    try:
        if kind == "str" or isinstance(value, bool) == (kind == "bool"):
            typed = field.type(value)
            if kind == "float" and not math.isfinite(typed):
                kind = "a finite float"
            elif kind != "int" or typed == float(value):
                return typed
    except (TypeError, ValueError, OverflowError):  # Overflow: int(inf)
        pass
    raise ConfigError(f"{source}: '{field.name}' must be {kind}, got {value!r}")


def field_docs(cls) -> dict[str, tuple[str, str]]:
    """Field -> (section, comment), read from the class source: the comments are the documentation."""
    docs, section, above = {}, "run", ""
    for line in inspect.getsource(cls).splitlines():
        if m := re.match(r"\s*# ---- (.*)", line):
            section = m[1]
        elif m := re.match(r"\s*# (.*)", line):  # a comment too long for its field's line sits above it
            above = m[1]
        elif m := re.match(r"\s*(\w+): [\w\[\], |]+ = (?:.*?  # (.*))?", line):
            docs[m[1]], above = (section, m[2] or above), ""
    return docs


class UniqueKeys(yaml.SafeLoader):
    """safe_load's YAML, but a key given twice is an error: PyYAML keeps the later value silently, so an
    `lr:` added at the end of a preset would override the one a reader sees at its top."""

    def construct_mapping(self, node, deep=False):
        seen = []  # a list: super() refuses an unhashable key itself
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            if (key := self.construct_object(key_node, deep=deep)) in seen:
                line = key_node.start_mark.line + 1
                raise yaml.YAMLError(f"'{key}' is given twice (again on line {line}); keep one")
            seen.append(key)
        return super().construct_mapping(node, deep)


def load_config(cls, argv: list[str], choices: dict | None = None, base: Path | None = None,
                defaults=lambda given: {}):
    """Defaults <- defaults(what the rest gave) <- `base` (a resumed run's config.yaml) <- --config YAML
    <- flags; an unknown key stops the run. --help: each field's comment, default and choices, by section."""
    fields, docs, groups = {f.name: f for f in dataclasses.fields(cls)}, field_docs(cls), {}
    parser = argparse.ArgumentParser(description=cls.__doc__, allow_abbrev=False,
                                     usage="%(prog)s [--config YAML] [--FLAG VALUE ...]")
    parser.add_argument("--config", help="YAML preset in configs/; flags override it")
    for f in fields.values():
        section, comment = docs.get(f.name, ("run", ""))
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        listed = f"choices: {', '.join(choices[f.name])}; " if f.name in (choices or {}) else ""
        text = f"{comment} ({listed}default: {f.default!r})".replace("%", "%%")
        switch = f.type is bool  # --lora / --no-lora
        how = {"action": argparse.BooleanOptionalAction} if switch else {"metavar": f.type.__name__.upper()}
        group.add_argument("--" + f.name.replace("_", "-"), default=None, help=text, **how)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        bad = unknown[0].split("=")[0]
        if not bad.startswith("-"):  # a value without its flag: `train.py arith`, `--lora false`
            owner = [f"--{n.replace('_', '-')} {bad}" for n, valid in (choices or {}).items() if bad in valid]
            hint = f"did you mean '{owner[0]}'?" if owner else "a flag takes a value, a switch (--lora) none"
            raise ConfigError(f"unexpected value '{bad}': {hint}")
        flags = ["--" + n.replace("_", "-") for n in fields] + ["--config"]
        raise ConfigError(f"unknown flag {bad}{closest(bad, flags)}")
    values = {}
    for source in filter(None, (base, args.config)):
        try:
            preset = yaml.load(Path(source).read_text(), UniqueKeys) or {}
        except FileNotFoundError:
            raise ConfigError(f"--config {source}: no such file; presets live in configs/") from None
        except (OSError, ValueError, yaml.YAMLError) as e:  # a directory, binary bytes, broken YAML
            raise ConfigError(f"{source}: cannot read it as YAML ({' '.join(str(e).split())})") from None
        if not isinstance(preset, dict):
            raise ConfigError(f"{source}: expected a mapping of config keys")
        for key, value in preset.items():
            if key not in fields:
                raise ConfigError(f"{source}: unknown key '{key}'{closest(key, fields)}")
            values[key] = coerce(fields[key], value, source)
    for name, f in fields.items():
        if (raw := getattr(args, name)) is not None:  # coerce reads a flag's text as int("3"), float("5e-3")
            values[name] = coerce(f, raw, "--" + name.replace("_", "-"))
    return cls(**{**defaults(values), **values})


def dump_config(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


# ---------------------------------------------------------------- metrics
class Metrics:
    """The loop's numbers and samples, written to the run's files, then to cfg.log's loggers: config.yaml,
    metrics.csv in long format (step, wall_s, key, value: any tool reads any metric) and samples.jsonl. A
    resumed run first drops the lines after its checkpoint's step, which it writes again. Without `out`, and
    on ranks other than 0 (rank 0 logs the all-reduced numbers), nothing is written."""
    SAMPLES_MAX_BYTES = 32 << 20  # ~100k short completions: report.html opens them in about a second

    def __init__(self, out: Path | None = None, cfg=None, wall_offset: float = 0.0, resumed_at=None):
        self.t0, self.out, self.loggers = time.perf_counter() - wall_offset, out if rank() == 0 else None, []
        if not self.out:
            return
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot create the run directory ({e}); pick another") from None
        self.lock = open(out / ".lock", "w")  # held while this process lives: a kill, too, lets it go
        try:  # two runs in one directory would interleave their steps and overwrite each other's checkpoints
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{out}: another run is still writing there; stop it first (a new run can "
                              "take another --out)") from None
        (out / "config.yaml").write_text(dump_config(cfg))
        if resumed_at is not None:
            for name in ("metrics.csv", "samples.jsonl", "samples.1.jsonl"):
                truncate_log(out / name, resumed_at)
        self.csv_file = open(out / "metrics.csv", "a", newline="")
        # "\n", not csv's "\r\n": truncate_log rewrites a resumed run's lines with "\n": one ending a file
        self.writer = csv.writer(self.csv_file, lineterminator="\n")
        if self.csv_file.tell() == 0:  # a new file
            self.writer.writerow(["step", "wall_s", "key", "value"])
        self.samples_file = open(out / "samples.jsonl", "a")
        self.loggers = [LOGGERS[name](out, cfg, resumed_at) for name in filter(None, cfg.log.split(","))]

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.out:
            wall = round(self.wall(), 3)
            self.writer.writerows([step, wall, key, f"{float(value):.6g}"] for key, value in values.items())
            self.csv_file.flush()
        for logger in self.loggers:
            logger.log(step, values)

    def samples(self, step: int, rows: list[dict]) -> None:
        """One JSON line per rollout. Past SAMPLES_MAX_BYTES the file becomes samples.1.jsonl (replacing
        the one before), so a long run keeps at most about twice that on disk."""
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


def truncate_log(path: Path, last_step: float) -> None:
    """Keeps metrics.csv's / samples.jsonl's lines up to last_step, less a last line cut short by a kill."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    csv_file = path.suffix == ".csv"
    step = (lambda x: float(x.split(",", 1)[0])) if csv_file else (lambda x: json.loads(x)["step"])
    kept = lines[:1] if csv_file else []  # the header
    kept += [line for line in lines[len(kept):] if line.endswith("\n") and step(line) <= last_step]
    atomic_write(path, "".join(kept).encode())


class TensorBoard:
    """--log tensorboard: events under RUN/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, out: Path, cfg, resumed_at: float | None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: only --log tensorboard needs it
        except ImportError:
            raise ConfigError("--log tensorboard needs tensorboard: pip install tensorboard") from None
        # purge_step hides the events a killed run wrote past its checkpoint, as truncate_log does in the CSV
        purge = None if resumed_at is None else int(resumed_at) + 1
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
        self.wandb, self.run = wandb, wandb.init(dir=str(out), name=out.name, config=dataclasses.asdict(cfg),
                                                  resume="allow", id=re.sub(r"[^\w-]", "_", out.name))
        self.run.define_metric("*", step_metric="step")
        self.pending: list[dict] = []

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def samples(self, step: int, rows: list[dict]) -> None:
        """A table per eval, with the training rows since the last (a table a step: 10,000 artifacts)."""
        self.pending += [{"step": step, **row} for row in rows]
        if rows and rows[0]["kind"] == "eval":
            columns = sorted({k for row in self.pending for k in row})
            cell = lambda v: json.dumps(v) if isinstance(v, dict) else v  # a reward breakdown: one text cell
            data = [[cell(r.get(c)) for c in columns] for r in self.pending]
            self.run.log({"step": step, "samples": self.wandb.Table(columns=columns, data=data)})
            self.pending = []

    def close(self) -> None:
        self.run.finish()


LOGGERS = {"tensorboard": TensorBoard, "wandb": WandB}


def read_metrics(path: Path) -> dict[str, list[tuple[int, float, float]]]:
    series: dict[str, list] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            point = int(row["step"]), float(row["wall_s"]), float(row["value"])
            series.setdefault(row["key"], []).append(point)
    return series


def plot(out: Path, keys: tuple[str, ...]) -> None:
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
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=100)


# ---------------------------------------------------------------- checkpoints
# Writes the disk refused (full, over quota, past a file-size limit, read-only, failing): main() says so
# in one line, as the checkpoints written so far are intact.
DISK_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


def refused(e: Exception) -> str | None:
    """main()'s one line for a write the disk refused or an allocation memory refused (numpy's and Python's
    MemoryError, torch's OutOfMemoryError on a GPU, its CPU allocator's RuntimeError); None: a bug."""
    if isinstance(e, OSError) and e.errno in DISK_REFUSED:
        return f"a write failed ({e}); make room, then --resume the run or run again"
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e):
        asked = re.search(r"allocate [\d.]+ ?\w+", str(e))  # "... tried to allocate 40000000000 bytes ..."
        return (f"out of memory ({asked[0] if asked else type(e).__name__}); lower --micro-batch, "
                "--gen-batch, --batch or an eval's size, then --resume the run or run again")
    return None


@contextlib.contextmanager
def atomic_dir(final: Path):
    """A fresh directory beside `final`, renamed to `final` (replacing it) once the block has filled it:
    a reader never sees half of it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    tmp.chmod(0o777 & ~UMASK)  # as mkdir would: mkdtemp's 0700 hid exports and caches from other users
    try:
        yield tmp
        for path in tmp.rglob("*"):  # as open() and mkdir would: safetensors writes its files 0600
            path.chmod((0o777 if path.is_dir() else 0o666) & ~UMASK)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except (SafetensorError, RuntimeError) as e:  # how safetensors and torch.save report a failed write
        free = shutil.disk_usage(tmp).free >> 20  # the cause (a full disk, say) is only in their message
        raise OSError(errno.EIO, f"{e}; {free} MiB free there", str(final)) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_blocker(path: Path) -> str | None:
    """Why an export cannot be written to `path` (None: it can). It never replaces a file: an --export
    of `.`, of a run's or a model's directory would have deleted them."""
    if any(p.is_file() for p in (path, *path.parents)):
        return "a file is in the way of that directory"
    return "that directory is not empty" if path.is_dir() and any(path.iterdir()) else None


def fresh_dir(prefix: str) -> Path:
    """A new directory <prefix>-<time>, or <prefix>-<time>-2, -3, ... where taken: mkdir is atomic, so runs
    started in the same second (a sweep's) never share one. Made by rank 0, which alone writes there."""
    base = f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    if rank() > 0:
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


def atomic_write(path: Path, data: bytes) -> None:
    """`data` as the file's new content, fsync'd beside it and renamed over it: never half a file."""
    tmp = path.with_name(path.name + ".tmp")
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
    """ckpt-<step>/ by atomic_dir, its files fsync'd: weights as safetensors, optimizer and RNG state (`rng`,
    else the current) a tensors-only torch.save (read back weights_only=True), the rest JSON. Keeps the
    newest `keep`. Under torchrun rank 0 alone writes (ranks hold the same weights); others return None."""
    if rank() > 0:
        return None
    final = out / f"ckpt-{step:07d}"
    with atomic_dir(final) as tmp:
        weights = {n: p.detach().contiguous() for n, p in policy.named_parameters() if p.requires_grad}
        save_file(weights, str(tmp / "weights.safetensors"))
        rng = torch.get_rng_state() if rng is None else rng
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


def holds_run(run: Path) -> bool:
    """A checkpoint or a logged metric, which a new run would mix with (a failed start may leave none)."""
    metrics = run / "metrics.csv"
    return bool(checkpoints(run)) or (metrics.exists() and metrics.read_bytes().count(b"\n") > 1)


def load_checkpoint(ckpt: Path, policy: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Reads every file before changing anything: a damaged checkpoint leaves policy and opt as they were."""
    weights = load_file(str(ckpt / "weights.safetensors"))
    state = torch.load(ckpt / "state.pt", weights_only=True)
    meta = json.loads((ckpt / "meta.json").read_text())
    if not (isinstance(meta, dict) and {"step", "wall_s", "source"} <= meta.keys() and isinstance(state, dict)
            and {"optimizer", "torch_rng"} <= state.keys()):
        raise KeyError("meta.json or state.pt lacks what a nanorl checkpoint holds")
    trained = {n: p.shape for n, p in policy.named_parameters() if p.requires_grad}
    if {n: w.shape for n, w in weights.items()} != trained:
        raise ConfigError(f"{ckpt}: its tensors do not match this policy (model, LoRA, --hidden or PPO "
                          f"critic unlike the run's); --resume {ckpt.parent} alone restores the run's own")
    policy.load_state_dict(weights, strict=False)
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return meta


def resume_checkpoint(run: Path, policy: torch.nn.Module, opt: torch.optim.Optimizer,
                      required: bool = False) -> dict | None:
    """The newest checkpoint of a run that loads (None: none does), or the one named, which must load, as
    must one when `required` (--eval-only): else the untrained model would stand in. Names each skipped."""
    named = run.name.startswith("ckpt-")
    for ckpt in [run] if named else reversed(checkpoints(run)):
        try:
            return load_checkpoint(ckpt, policy, opt)
        # a copy or a full disk cut it short; torch.load raises the last 3 on an empty or a foreign state.pt
        except (SafetensorError, json.JSONDecodeError, KeyError, OSError, RuntimeError, EOFError,
                pickle.UnpicklingError) as e:
            stderr(f"skipping {ckpt}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'empty'}")
    if named or required:
        raise ConfigError(f"--resume {run}: no checkpoint of it loads (above); resume another run or ckpt-*")
    stderr(f"--resume {run}: no checkpoint loads; the run starts over")
    return None


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Abandoned(BaseException):
    """A stop inside StopSignals' abandonable code; no `except Exception` on its way out swallows it."""


class StopSignals:
    """SIGINT / SIGTERM until restore(). The first sets `seen` for the loop, which finishes its step and
    checkpoints (never a half-applied update). A scheduler's SIGKILL follows after a grace that a step or an
    eval can outlast, so inside `evaluate` (which need not finish) it raises Abandoned, in one process (under
    torchrun every rank must reach the eval's all-reduce); elsewhere in `evaluate` or `rollout`, where the
    weights are a finished step's, it first calls `save`, which the loop points at a checkpoint of that step:
    a SIGKILL then loses only the step in progress. The second signal raises KeyboardInterrupt at once."""
    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}  # a user's stop, or kill's and a scheduler's

    def __init__(self, evaluate, rollout):
        # unwrap: a decorator's wrapper (torch.no_grad's) has one code object for all it decorates
        self.evaluate, self.rollout = (inspect.unwrap(f).__code__ for f in (evaluate, rollout))
        self.seen, self.save = False, lambda: None  # no step finished yet: nothing to save
        self.previous = {s: signal.signal(s, self.handle) for s in self.NAMES}

    def handle(self, signum: int, frame) -> None:
        if self.seen:  # e.g. a trainer waiting for workers that never come
            raise KeyboardInterrupt
        self.seen, name = True, self.NAMES[signum]
        stderr(f"{name}: finishing this step and checkpointing; {name} again stops now")
        running = {f.f_code for f, _ in traceback.walk_stack(frame)}
        if self.evaluate in running and world() == 1:
            raise Abandoned
        if {self.evaluate, self.rollout} & running:
            self.save()  # rank 0 writes it (nothing collective), then the step or the eval goes on

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- distributed
# Data parallelism the plain way: torchrun starts a process per GPU or CPU slot, each rolls out its share
# of the batch, and the only traffic is all-reduced sums (no-ops in one process; all ranks call them alike).
def init_distributed(timeout_s: float) -> None:
    """Joins torchrun's group; a rank stuck in a collective for timeout_s raises rather than hangs."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # LLMPolicy's "cuda" is then this rank's GPU
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def close_distributed() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:  # torchrun's; a vLLM worker's own (of 1): vLLM's
        dist.destroy_process_group()


def cli(main) -> None:
    """train.py's entry: main(argv) under torchrun's @record, then exit_process. A warning is one line, as an
    error is: Python's format added the source line of the warnings.warn call, cut mid-sentence."""
    warnings.formatwarning = lambda message, category, *_: f"warning: {message}\n"
    exit_process(record(main)(sys.argv[1:]))


def exit_process(code: int) -> None:
    """Ends the process with `code`; under torchrun without interpreter finalization, where gloo's threads
    abort about 1 clean rank in 20 ("terminate called without an active exception"): all is closed by then."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over ranks, as a new tensor without grad (x itself in a single process)."""
    if world() == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x)
    return x


def reduce_dict(values: dict[str, float], mean: bool = False) -> dict[str, float]:
    """Sums (or averages) numbers over ranks; every rank must pass the same keys."""
    total = all_sum(torch.tensor(list(values.values()), dtype=torch.float64))
    return dict(zip(values, (total / world() if mean else total).tolist()))


def sum_grads(module: torch.nn.Module) -> None:
    """Every rank's .grad becomes the sum over ranks. All reduces are queued before the first wait,
    so hundreds of small LoRA tensors cost about one round trip, and no flat copy is needed."""
    if world() > 1:
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a parameter this rank's micro-batches never reached still joins the sum
                p.grad = torch.zeros_like(p)
        for work in [dist.all_reduce(p.grad, async_op=True) for p in params]:
            work.wait()


def broadcast_bytes(data: bytearray | None) -> bytearray:
    """Rank 0's bytes on every rank, as a uint8 tensor, never pickled: a bytearray decode views uncopied."""
    if world() == 1:
        return data
    n = torch.tensor([len(data) if rank() == 0 else 0])
    dist.broadcast(n, 0)
    buf = torch.frombuffer(data, dtype=torch.uint8) if rank() == 0 else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return data if rank() == 0 else bytearray(buf.numpy())


@torch.no_grad()
def broadcast_weights(module: torch.nn.Module) -> None:
    """Rank 0's weights everywhere; ranks then stay identical: same summed gradients, same optimizer."""
    if world() > 1:
        for t in module.state_dict().values():
            dist.broadcast(t, 0)


def split_rng() -> None:
    """Rank r > 0 forks its own torch RNG stream off the shared one (rank 0 keeps a single process's)."""
    if rank():
        torch.manual_seed(int(torch.randint(2**62, ())) + rank())
