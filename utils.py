"""Plumbing shared by the loop: config parsing and --help, whether the hub is in reach, what stops a run,
torchrun helpers."""
import argparse
import ctypes
import dataclasses
import datetime
import difflib
import errno
import functools
import importlib.metadata
import inspect
import json
import math
import os
import re
import shlex
import signal
import socket
import sys
import traceback
import urllib.parse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
# torchrun then reports a failed rank's traceback (cli() and a test's own entry point wrap main in it)
from torch.distributed.elastic.multiprocessing.errors import record

UMASK = os.umask(0o022)  # the process's umask, read the only way there is (setting it), then put back
os.umask(UMASK)
LAUNCHER = os.getppid()  # read at import, as near this process's start as it gets: die_with_launcher's check
# die_with_launcher's signal: not SIGTERM (a second SIGTERM stops at once), as a dead launcher sends several
LAUNCHER_GONE = signal.SIGUSR2


# ---------------------------------------------------------------- config
class ConfigError(ValueError):
    """A bad flag, key or combination; the message says how to fix it."""


def closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.4)
    return f"; did you mean '{match[0]}'?" if match else ""


def as_flag(name: str, value) -> str:
    """A field's value as the command line writes it: `--workers 0`, `--no-lora`, `--trainer-url ''`."""
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')} {shlex.quote(str(value))}"


def data_file(name: str) -> Path:
    """One of pyproject's data-files: next to the modules in a checkout (pip install -e .), else in this
    install's share/nanorl: where RECORD lists it (venv, --user, /usr/local) or beside us (pip --target)."""
    here = Path(__file__).parent
    dists = importlib.metadata.distributions(name="nanorl", path=[str(here)])  # the dist-info beside us
    listed = [Path(f.locate()).resolve() for dist in dists for f in dist.files or ()
              if f.as_posix().endswith(f"share/nanorl/{name}")]
    for path in [here / name, *listed, here / "share/nanorl" / name, Path(sys.prefix, "share/nanorl", name)]:
        if path.exists():
            return path
    raise ConfigError(f"{name}: neither next to {here} nor in this install's share/nanorl; reinstall nanorl "
                      "(pip install --force-reinstall --no-deps .)")


def preset_file(source) -> Path:
    """--config's file. A bare NAME or configs/NAME that is not here is this install's preset: a wheel's
    are in share/nanorl/configs, a checkout's beside train.py, wherever the user runs it from."""
    path = Path(source)
    if path.exists() or path.parent not in (Path("."), Path("configs")):
        return path
    try:
        return data_file(f"configs/{path.name}")
    except ConfigError:  # no preset of that name either: the caller names the file as given
        return path


def presets() -> list[str]:
    """The file names of this install's presets (--config NAME), beside the one every install has."""
    try:  # a wheel's RECORD lists files, not directories
        return sorted(p.name for p in data_file("configs/cartpole_reinforce.yaml").parent.glob("*.yaml"))
    except ConfigError:
        return []


def hub_out_of_reach() -> bool:
    """Whether the Hugging Face hub takes no connection (no DNS, a firewall), where its client retries each
    file it asks for ~28 s before it reads its cache: minutes for a model. HF_HUB_OFFLINE=1 reads the cache
    at once, and a proxy may reach the hub when this machine cannot: the client is left to both."""
    from huggingface_hub import constants  # transformers' and datasets' own dependency: imported with them

    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if constants.HF_HUB_OFFLINE or proxied:
        return False
    url = urllib.parse.urlsplit(constants.ENDPOINT)  # HF_ENDPOINT, a mirror, if one is set
    port = url.port or (80 if url.scheme == "http" else 443)
    return not connects(url.hostname, port, constants.HF_HUB_ETAG_TIMEOUT)


# Once a process: behind a firewall that drops packets each try waits out the whole timeout, and a student,
# its teacher and a task's hub rows each ask.
@functools.cache
def connects(host: str, port: int, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def coerce(field: dataclasses.Field, value, source: str):
    """YAML/CLI value -> the field's type, or a ConfigError naming the key. YAML's true is no number and 1 no
    bool; an int takes YAML's 3.0 (not 3.5, nor "3.0" on the CLI); a float is finite (a NaN lr would pass
    every range check)."""
    kind = field.type.__name__  # train.Config's annotations are types, not strings (no __future__ import)
    if kind == "str" and (value is None or isinstance(value, bool)):  # `tis: off` would be tis "False"
        raise ConfigError(f"{source}: '{field.name}' must be text, got {value!r}: quote it, as in 'off' "
                          "(YAML reads an unquoted off, no, yes or null as no text)")
    if kind == "str" and isinstance(value, (list, dict)):  # `out: [dir]` would write into "['dir']"
        raise ConfigError(f"{source}: '{field.name}' must be text, got {value!r}")
    try:
        if kind == "str" or isinstance(value, bool) == (kind == "bool"):
            typed = field.type(value)
            if kind == "float" and not math.isfinite(typed):
                kind = "a finite float"
            elif kind == "int" and not -2**63 <= typed < 2**63:  # torch's seeds and sizes are int64
                kind = "an int within +-2**63"
            elif kind != "int" or not isinstance(value, float) or value.is_integer():  # YAML's 3.0, not 3.5
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
            at = argv.index(bad)
            switch = argv[at - 1].removeprefix("--").removeprefix("no-") if at else ""
            if getattr(fields.get(switch.replace("-", "_")), "type", None) is bool:  # `--lora false`
                hint = f"--{switch} is a switch, without a value: --{switch} turns it on, --no-{switch} off"
            raise ConfigError(f"unexpected value '{bad}': {hint}")
        flags = ["--" + n.replace("_", "-") for n in fields] + ["--config"]
        raise ConfigError(f"unknown flag {bad}{closest(bad, flags)}")
    if sum(a.split("=")[0] == "--config" for a in argv) > 1:  # argparse would keep the last alone
        raise ConfigError("--config given twice: merge the presets into one file (flags override it)")
    values = {}
    for source in filter(None, (base, args.config)):
        try:
            preset = yaml.load(preset_file(source).read_text(), UniqueKeys) or {}
        except FileNotFoundError:
            raise ConfigError(f"--config {source}: no such file, nor a preset of that name (presets live in "
                              f"configs/){closest(Path(source).name, presets())}") from None
        except (OSError, ValueError, yaml.YAMLError) as e:  # a directory, binary bytes, broken YAML
            raise ConfigError(f"{source}: cannot read it as YAML ({' '.join(str(e).split())})") from None
        if source is base and not preset:  # a run's own never is: else the resume would take every default
            raise ConfigError(f"{source}: empty, cut short (a copy, a full disk); the run's values are in "
                              "its report.html (Config): write them back as YAML")
        if not isinstance(preset, dict):
            raise ConfigError(f"{source}: expected a mapping of config keys")
        for key, value in preset.items():
            if key not in fields:
                raise ConfigError(f"{source}: unknown key '{key}'{closest(str(key), fields)}")
            values[key] = coerce(fields[key], value, source)
    for name, f in fields.items():
        if (raw := getattr(args, name)) is not None:  # coerce reads a flag's text as int("3"), float("5e-3")
            values[name] = coerce(f, raw, "--" + name.replace("_", "-"))
    return cls(**{**defaults(values), **values})


def dump_config(cfg) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)


# ---------------------------------------------------------------- stops: refused writes, signals
def refused(e: Exception) -> str | None:
    """main()'s one line for a refused write or allocation (numpy's and Python's MemoryError, torch's
    OutOfMemoryError on a GPU, its CPU allocator's RuntimeError) or a lost rank; None: a bug."""
    if isinstance(e, RankLost):
        return str(e)
    # a disk full, over quota, past a file-size limit, read-only or failing: the checkpoints so far are intact
    disk = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)
    if isinstance(e, OSError) and e.errno in disk:
        return f"a write failed ({e}); make room, then --resume the run or run again"
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e):
        asked = re.search(r"allocate [\d.]+ ?\w+", str(e))  # "... tried to allocate 40000000000 bytes ..."
        return (f"out of memory ({asked[0] if asked else type(e).__name__}); lower --micro-batch, "
                "--gen-batch, --batch or an eval's size, then --resume the run or run again")
    return None


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Abandoned(BaseException):
    """A stop inside StopSignals' abandonable code; no `except Exception` on its way out swallows it."""


class StopSignals:
    """SIGINT / SIGTERM / SIGUSR2 until restore(). The first sets `seen` for the loop, which finishes its
    step and checkpoints (never a half-applied update). A scheduler's SIGKILL follows after a grace that a
    step or an eval can outlast, so inside `evaluate` (which need not finish) it raises Abandoned, in one
    process (under torchrun every rank must reach the eval's all-reduce); elsewhere in `evaluate` or
    `rollout`, where the weights are a finished step's, it first calls `save`, which the loop points at a
    checkpoint of that step: a SIGKILL then loses only the step in progress. A second stop (see same_stop)
    raises KeyboardInterrupt."""
    # a user's stop, kill's or a scheduler's, or die_with_launcher's (SIGUSR2 is also Slurm's usual warning)
    NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM",
             LAUNCHER_GONE: "SIGUSR2 (the launcher died, or a scheduler's)"}

    def __init__(self, evaluate, rollout):
        # unwrap: a decorator's wrapper (torch.no_grad's) has one code object for all it decorates
        self.evaluate, self.rollout = (inspect.unwrap(f).__code__ for f in (evaluate, rollout))
        self.seen, self.stopping, self.save = 0, False, lambda: None  # seen: the first signal (0: none yet)
        self.previous = {s: signal.signal(s, self.handle) for s in self.NAMES}

    def handle(self, signum: int, frame) -> None:
        death_signal(0)  # after the restore(), one more would kill this process (rank 0 writing its report)
        if self.seen and self.same_stop(signum):
            return
        if self.seen:  # e.g. a trainer waiting for workers that never come
            raise KeyboardInterrupt
        self.seen, name = signum, self.NAMES[signum]
        now = "Ctrl-C" if self.same_stop(signum) else f"{name} again"
        stderr(f"{name}: finishing this step and checkpointing; {now} stops now")
        running = {f.f_code for f, _ in traceback.walk_stack(frame)}
        if self.evaluate in running and world() == 1:
            raise Abandoned
        if {self.evaluate, self.rollout} & running:
            self.save()  # rank 0 writes it (nothing collective), then the step or the eval goes on

    def same_stop(self, signum: int) -> bool:
        """Whether `signum` after the stop's first signal is that stop again, not a second: a dead launcher's
        threads each send LAUNCHER_GONE, and under torchrun a scheduler's SIGTERM to every process (Slurm's)
        reaches a rank twice, itself and forwarded (a second Ctrl-C at torchrun: SIGTERM after SIGINT)."""
        return signum == LAUNCHER_GONE or signum == self.seen == signal.SIGTERM and world() > 1

    def agreed(self) -> bool:
        """Whether any rank saw a stop, on every rank (all ask after a step): one rank's stop stops all. Kept
        apart from `seen`, which a signal during the all-reduce sets too late for it: the next one has it."""
        self.stopping = bool(reduce_dict({"stop": bool(self.seen)})["stop"])
        return self.stopping

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- distributed
# Data parallelism the plain way: torchrun starts a process per GPU or CPU slot, each rolls out its share
# of the batch, and the only traffic is all-reduced sums (no-ops in one process; all ranks call them alike).
class RankLost(Exception):
    """A collective that another rank never joined (it died, or hung past --dist-timeout): not this rank's."""


def collective(fn):
    """fn, a collective, raising RankLost where gloo reports a peer gone or silent (a plain RuntimeError)."""
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if not (gone := re.search(r"connection \w+ by peer|timed out", str(e), re.IGNORECASE)):
                raise  # anything else is a bug here, shown whole
            why = gone[0].lower()  # a rank past --dist-timeout may be only slow: a long checkpoint or eval
            slow = " (none, if only slow: raise --dist-timeout)" if why == "timed out" else ""
            raise RankLost(f"another rank died or hung (gloo: {why}), not this one: its error or exit code "
                           f"(torchrun's summary) says why{slow}; then --resume the run") from e
    return checked


def death_signal(signum: int) -> None:
    """prctl(PR_SET_PDEATHSIG): `signum` comes when the parent dies (0: none). Linux only; elsewhere none."""
    if sys.platform.startswith("linux") and ctypes.CDLL(None, use_errno=True).prctl(1, signum) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def die_with_launcher(launcher: int = LAUNCHER, who: str = "") -> None:
    """A rank (or a trainer's --workers process: `launcher` is that trainer's pid) stops (LAUNCHER_GONE) when
    its launcher dies, a SIGKILL (the OOM killer's, a scheduler's) too, rather than stay on as an orphan."""
    # The signal comes when the launcher's thread that started this process ends: torchrun's main thread,
    # which starts (and restarts) its workers and waits for them; the trainer's, which runs its whole loop.
    # The kernel then hands the process to another of the launcher's threads, whose exit sends one more,
    # and so on, maybe after Python's handler for the last one began (it cannot turn them off in time): so
    # not SIGTERM, whose second stops at once; StopSignals (a worker: interrupt) takes them as one stop.
    signal.signal(LAUNCHER_GONE, interrupt)  # as Ctrl-C until a rank's StopSignals takes it over
    death_signal(LAUNCHER_GONE)
    if os.getppid() != launcher:  # it died before the prctl (this process's adopter is its parent): no signal
        who = who or f"rank {os.environ.get('RANK')}"
        raise SystemExit(f"error: {who}: its launcher (pid {launcher}) has exited; "
                         f"so does this {who.split()[0]}")


def interrupt(signum: int, frame) -> None:
    """SIGTERM or LAUNCHER_GONE as Ctrl-C, LAUNCHER_GONE once: a dead launcher's threads each send one, and a
    second would cut the unwinding short. One already sent finds the new handler; none is sent after."""
    signal.signal(LAUNCHER_GONE, lambda *_: None)
    death_signal(0)
    raise KeyboardInterrupt


def init_distributed(timeout_s: float) -> None:
    """Joins torchrun's group; a rank stuck in a collective for timeout_s raises rather than hangs."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return
    if timeout_s > 1e9:  # gloo's deadline, now + timeout in ns, overflows past ~9.2e9 s: it timed out at once
        raise ConfigError(f"--dist-timeout {timeout_s:g}: at most 1e9 seconds (31 years: never, in effect)")
    die_with_launcher()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # LLMPolicy's "cuda" is then this rank's GPU
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def close_distributed() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:  # torchrun's; a vLLM worker's own (of 1): vLLM's
        dist.destroy_process_group()


def cli(main) -> None:
    """train.py's entry. A warning is one line, as an error is (Python's adds the warn call's source line)."""
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


@collective
def stopped() -> int:
    """130, a shell's code for a run stopped by Ctrl-C, once every rank is here: a rank exiting first would
    have torchrun SIGTERM the others, rank 0 while it writes the report."""
    if world() > 1:
        dist.barrier()
    return 130


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@collective
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


@collective
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


@collective
def broadcast_bytes(data: bytearray | None) -> bytearray:
    """Rank 0's bytes on every rank, as a uint8 tensor, never pickled: a bytearray decode views uncopied.
    Never empty: a length of 0 is rank 0's beat(), which the others wait through."""
    if world() == 1:
        return data
    n = torch.tensor([len(data) if rank() == 0 else 0])
    dist.broadcast(n, 0)
    while not n:
        dist.broadcast(n, 0)
    buf = torch.frombuffer(data, dtype=torch.uint8) if rank() == 0 else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return data if rank() == 0 else bytearray(buf.numpy())


@collective
def gather_json(value) -> list:
    """Every rank's JSON-able `value`, in rank order; sent as JSON bytes, never pickled."""
    if world() == 1:
        return [value]
    mine = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world())]
    dist.all_gather(sizes, torch.tensor([len(mine)]))
    longest = int(max(sizes))  # all_gather takes equal sizes: each rank's bytes, padded to the longest
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(everyone, torch.cat([mine, torch.zeros(longest - len(mine), dtype=torch.uint8)]))
    return [json.loads(bytes(t[:int(n)].numpy())) for t, n in zip(everyone, sizes)]


@collective
def beat() -> None:
    """Rank 0, busy long before its next broadcast_bytes (an async trainer waiting for workers), says so every
    few seconds: the others' wait in it, one broadcast, failed at --dist-timeout ("another rank ... hung")."""
    if world() > 1:
        dist.broadcast(torch.tensor([0]), 0)


def from_rank0(path: Path) -> Path:
    """Rank 0's path on every rank: a new run's directory is the one rank 0 made, the others' only a guess."""
    return Path(os.fsdecode(bytes(broadcast_bytes(bytearray(os.fsencode(path))))))


@collective
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


@collective
def rng_states() -> torch.Tensor:
    """[W, S] uint8: every rank's torch RNG state (the CPU's, then this GPU's, which samples there)."""
    mine = torch.get_rng_state()
    if torch.cuda.is_available():
        mine = torch.cat([mine, torch.cuda.get_rng_state()])
    if world() == 1:
        return mine[None]
    everyone = [torch.empty_like(mine) for _ in range(world())]
    dist.all_gather(everyone, mine)
    return torch.stack(everyone)


def set_rng_states(states: torch.Tensor) -> None:
    """This rank's row of rng_states(), so a resumed rank samples on as it would have. From a checkpoint of
    another world size (or an older one: [S], rank 0's CPU state) rank 0's, which split_rng() then forks."""
    own = states.dim() == 2 and len(states) == world()
    row, cpu = states[rank()] if own else states.view(-1, states.shape[-1])[0], torch.get_rng_state().numel()
    torch.set_rng_state(row[:cpu].clone())
    if torch.cuda.is_available() and len(row) > cpu:
        torch.cuda.set_rng_state(row[cpu:].clone())
    if not own:
        split_rng()
