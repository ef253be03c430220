"""Plumbing shared by the loop: config parsing, run directory, metrics, plots, checkpoints, torchrun
helpers, and the payload codec (tensors <-> safetensors bytes with a SHA-256, never pickled)."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import difflib
import hashlib
import json
import math
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: F401 (train.py: torchrun then reports a failed rank's traceback)
from safetensors.torch import load_file, save_file


# ---------------------------------------------------------------- config
class ConfigError(ValueError):
    """A bad flag, key or combination; the message says how to fix it."""


def closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.4)
    return f"; did you mean '{match[0]}'?" if match else ""


def coerce(field: dataclasses.Field, value, source: str):
    """YAML/CLI value -> the field's declared type, or a ConfigError naming the key."""
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            raise ValueError
        if kind == "int" and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind == "float" and not isinstance(value, bool):
            return float(value)
        if kind == "str":
            return str(value)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{source}: '{field.name}' must be {kind}, got {value!r}")


def load_config(cls, argv: list[str]):
    """Defaults <- --config YAML <- command-line flags. Unknown keys stop the run."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    parser = argparse.ArgumentParser(description=cls.__doc__, allow_abbrev=False)
    parser.add_argument("--config", help="YAML preset in configs/; flags override it")
    for f in fields.values():
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, default=None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        bad = unknown[0].split("=")[0]
        flags = ["--" + n.replace("_", "-") for n in fields] + ["--config"]
        raise ConfigError(f"unknown flag {bad}{closest(bad, flags)}")
    values = {}
    if args.config:
        try:
            preset = yaml.safe_load(Path(args.config).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"--config {args.config}: no such file; presets live in configs/") from None
        if not isinstance(preset, dict):
            raise ConfigError(f"{args.config}: expected a mapping of config keys")
        for key, value in preset.items():
            if key not in fields:
                raise ConfigError(f"{args.config}: unknown key '{key}'{closest(key, fields)}")
            values[key] = coerce(fields[key], value, args.config)
    for name, f in fields.items():
        raw = getattr(args, name)
        if raw is not None:
            values[name] = raw if isinstance(raw, bool) else coerce_cli(f, raw)
    return cls(**values)


def coerce_cli(f: dataclasses.Field, raw: str):
    return coerce(f, yaml.safe_load(raw) if f.type not in ("str", str) else raw, "--" + f.name.replace("_", "-"))


def save_config(cfg, path: Path) -> None:
    path.write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))


# ---------------------------------------------------------------- metrics
class Metrics:
    """metrics.csv in long format (step, wall_s, key, value): any tool can read any metric."""

    def __init__(self, out: Path, wall_offset: float = 0.0):
        self.path = out / "metrics.csv"
        new = not self.path.exists()
        self.file = open(self.path, "a", newline="")
        self.writer = csv.writer(self.file)
        if new:
            self.writer.writerow(["step", "wall_s", "key", "value"])
        self.t0 = time.perf_counter() - wall_offset

    def wall(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, step: int, values: dict[str, float]) -> None:
        wall = round(self.wall(), 3)
        for key, value in values.items():
            self.writer.writerow([step, wall, key, f"{float(value):.6g}"])
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(path: Path) -> dict[str, list[tuple[int, float, float]]]:
    series: dict[str, list] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            series.setdefault(row["key"], []).append((int(row["step"]), float(row["wall_s"]), float(row["value"])))
    return series


def plot(out: Path, keys=("reward", "eval_return")) -> Path:
    import matplotlib  # imported here: only the end-of-run plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_metrics(out / "metrics.csv")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for key in keys:
        if key in series:  # an eval before a supervised warm-start is the curve's first point (step -sft_steps)
            steps, walls, values = zip(*series.get(f"{key}_before_sft", []) + series[key])
            axes[0].plot(steps, values, label=key)
            axes[1].plot(walls, values, label=key)
    if sft := series.get("sft_loss"):
        axes[0].axvspan(sft[0][0] - 1, 0, color="grey", alpha=0.15, label="supervised warm-start")
        axes[1].axvspan(0, sft[-1][1], color="grey", alpha=0.15, label="supervised warm-start")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall seconds")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "curve.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- checkpoints
def fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(out: Path, step: int, policy: torch.nn.Module, opt: torch.optim.Optimizer, meta: dict, keep: int) -> Path:
    """Writes ckpt-<step>/ atomically: a temp directory, fsync'd files, then one os.replace.
    Weights are safetensors, optimizer and RNG state a tensors-only torch.save read back with
    weights_only=True, everything else JSON. Keeps the newest `keep` checkpoints."""
    final = out / f"ckpt-{step:07d}"
    tmp = out / f".tmp-ckpt-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {n: p.detach().contiguous() for n, p in policy.named_parameters() if p.requires_grad}
    save_file(weights, str(tmp / "weights.safetensors"))
    state = {"optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state()}
    torch.save(state, tmp / "state.pt")
    fsync_write(tmp / "meta.json", json.dumps({"step": step, **meta}, indent=1).encode())
    for name in ("weights.safetensors", "state.pt"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(out.glob("ckpt-*"))[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run: Path) -> Path:
    ckpts = sorted(run.glob("ckpt-*"))
    if not ckpts:
        raise FileNotFoundError(f"--resume {run}: no ckpt-* directory inside; pass a run directory written by train.py")
    return ckpts[-1]


def load_checkpoint(ckpt: Path, policy: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    weights = load_file(str(ckpt / "weights.safetensors"))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    if set(weights) != trainable:
        raise ValueError(f"{ckpt}: checkpoint tensors do not match this policy (different model or LoRA settings?)")
    policy.load_state_dict(weights, strict=False)
    state = torch.load(ckpt / "state.pt", weights_only=True)
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return json.loads((ckpt / "meta.json").read_text())


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- distributed
# Data parallelism the plain way: torchrun starts one process per GPU (or CPU slot), each rank
# rolls out its own share of the batch, and the only traffic is all-reduced sums (gradients, loss
# denominators, statistics). In a plain `python train.py` every helper below is a no-op; under
# torchrun every one is a collective, so all ranks must call it, in the same order.
def init_distributed(timeout_s: float) -> None:
    """Joins the group torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK: CUDA tensors over NCCL,
    CPU ones over gloo. A rank stuck in a collective for timeout_s raises rather than hangs."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # LLMPolicy's "cuda" is then this rank's GPU
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """Ends the process with `code`. Under torchrun it skips interpreter finalization, where gloo's
    threads now and then abort a rank that finished cleanly ("terminate called without an active
    exception", about 1 run in 20 on a loaded machine): everything is written and closed by then."""
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


def batch_totals(mask: torch.Tensor) -> dict[str, float]:
    """The whole batch's token and row counts for loss_weights: with one global denominator on every
    rank, the sum of the ranks' gradients is the gradient of one backward on the whole batch."""
    kept = (mask.sum(1) > 0).sum().item()  # a row masked out entirely (truncated, masked IS) is not counted
    tokens, rows = all_sum(torch.tensor([mask.sum().item(), kept], dtype=torch.float64)).tolist()
    return {"total_tokens": tokens, "total_rows": rows}


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
    """Rank 0's bytes on every rank, sent as a uint8 tensor: never pickled (receivers decode them
    as they would network bytes). A bytearray, which decode views without a copy."""
    if world() == 1:
        return data
    n = torch.tensor([len(data) if rank() == 0 else 0])
    dist.broadcast(n, 0)
    buf = torch.frombuffer(data, dtype=torch.uint8) if rank() == 0 else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return data if rank() == 0 else bytearray(buf.numpy())


@torch.no_grad()
def broadcast_weights(module: torch.nn.Module) -> None:
    """Rank 0's weights everywhere. Ranks then stay identical with no further syncing: they apply
    the same summed gradients with the same optimizer."""
    if world() > 1:
        for t in module.state_dict().values():
            dist.broadcast(t, 0)


def split_rng() -> None:
    """Rank r > 0 forks its own torch RNG stream off the shared one, so ranks sample different
    actions and tokens; rank 0 keeps the stream a single process would have."""
    if rank():
        torch.manual_seed(int(torch.randint(2**62, ())) + rank())


class NoMetrics:
    """What ranks other than 0 log to: rank 0 alone writes the (all-reduced) numbers."""
    def log(self, step: int, values: dict) -> None: pass  # noqa: E301,E704
    def wall(self) -> float: return 0.0  # noqa: E301,E704
    def close(self) -> None: pass  # noqa: E301,E704


# ---------------------------------------------------------------- payloads: tensors <-> bytes, never pickled
DTYPES = {  # safetensors name -> torch dtype; anything else on the wire is refused
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
NAMES = {t: n for n, t in DTYPES.items()}
MAX_HEADER, MAX_NDIM = 16 << 20, 8  # a LoRA state dict header is tens of KB; these bound the header we parse
FORMAT = "nanorl/1"


class PayloadError(ValueError):
    """A payload is malformed, tampered with, or uses something this format does not allow."""


def _digest(entries: dict, data) -> str:
    """SHA-256 of the tensor directory (names, dtypes, shapes, offsets) and the data bytes."""
    h = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    h.update(data)
    return h.hexdigest()


def encode(tensors: dict[str, torch.Tensor], meta: dict) -> bytearray:
    """Tensors + a JSON-able `meta` dict as a safetensors blob (PEFT and vLLM read it as
    adapter_model.safetensors), written by hand: one copy of the tensor bytes, one hash over them."""
    if not isinstance(meta, dict):
        raise PayloadError(f"meta must be a JSON-able dict, got {type(meta).__name__}")
    entries, flat, offset = {}, {}, 0
    for k, t in sorted(tensors.items()):
        if not (isinstance(k, str) and isinstance(t, torch.Tensor) and t.dtype in NAMES):
            raise PayloadError(f"encode needs dict[str, Tensor] with dtypes {sorted(map(str, NAMES))}; "
                               f"got {k!r} -> {getattr(t, 'dtype', type(t).__name__)}")
        flat[k] = t.detach().reshape(-1).view(torch.uint8)  # reshape(-1): a 0-dim tensor has no byte view
        entries[k] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(flat[k])]}
        offset += len(flat[k])
    # The digest goes in the header, before the data it covers: a placeholder of its length first,
    # so the tensors are copied once, straight into place (and off the GPU), then hashed there.
    head = json.dumps({"sha256": "0" * 64, "format": FORMAT, "meta": meta})
    header = json.dumps({"__metadata__": {"nanorl": head}, **entries}).encode()
    header += b" " * (-len(header) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    out, start = bytearray(8 + len(header) + offset), 8 + len(header)
    out[:start] = struct.pack("<Q", len(header)) + header
    body = torch.frombuffer(out, dtype=torch.uint8)[start:]
    for k, b in flat.items():
        body[entries[k]["data_offsets"][0] : entries[k]["data_offsets"][1]] = b
    at = 8 + header.index(b"0" * 64)  # the first run of 64 zeros: the placeholder opens the header
    out[at : at + 64] = _digest(entries, memoryview(out)[start:]).encode()
    return out


def _check_header(data: bytearray) -> tuple[object, dict, int]:
    """Validate the safetensors JSON header ourselves: every tensor's bytes lie inside the body,
    back to back in order and covering it exactly (the layout safetensors itself writes).
    Returns (__metadata__, name -> {dtype, shape, data_offsets}, where the data starts)."""
    if len(data) < 8:
        raise PayloadError(f"payload is {len(data)} bytes; a safetensors blob has at least 8")
    if (n := struct.unpack("<Q", data[:8])[0]) > min(MAX_HEADER, len(data) - 8):
        raise PayloadError(f"header length {n} exceeds the payload ({len(data) - 8} bytes) or {MAX_HEADER}")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise PayloadError(f"safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise PayloadError("safetensors header is not a JSON object")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise PayloadError(f"tensor {name!r}: dtype {dtype!r} not allowed; allowed: {sorted(DTYPES)}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
            raise PayloadError(f"tensor {name!r}: shape {shape!r} is not a list of <= {MAX_NDIM} sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and offs[1] - offs[0] == math.prod(shape) * DTYPES[dtype].itemsize):
            raise PayloadError(f"tensor {name!r}: shape {shape} {dtype} does not match data_offsets {offs!r}")
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": offs}
    end = 0
    for name, e in sorted(entries.items(), key=lambda item: item[1]["data_offsets"]):
        if (a := e["data_offsets"][0]) != end:
            raise PayloadError(f"tensor {name!r} starts at byte {a}, not {end}: tensors must be back to back")
        end = e["data_offsets"][1]
    if end != len(data) - 8 - n:
        raise PayloadError(f"the tensors cover {end} bytes but the body holds {len(data) - 8 - n}")
    return header.get("__metadata__", {}), entries, 8 + n


def _tensors(data: bytearray, entries: dict, start: int) -> dict[str, torch.Tensor]:
    """Tensors that view `data` (no copy), after _check_header vouched for every offset."""
    flat, out = torch.frombuffer(data, dtype=torch.uint8), {}
    for name, e in entries.items():
        dtype, (a, b) = DTYPES[e["dtype"]], e["data_offsets"]
        x = flat[start + a:start + b]
        x = x.clone() if (start + a) % dtype.itemsize else x  # a view must be aligned to its element size
        out[name] = x.view(dtype).reshape(e["shape"])
    return out


def decode(data: bytes | bytearray) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of `encode`. Raises only PayloadError, whatever the bytes are."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"decode needs bytes, got {type(data).__name__}")
    data = data if isinstance(data, bytearray) else bytearray(data)  # writable: tensors view it in place
    meta_s, entries, start = _check_header(data)
    if not isinstance(meta_s, dict) or not isinstance(meta_s.get("nanorl"), str):
        raise PayloadError("not a nanorl payload: safetensors metadata has no 'nanorl' header")
    try:
        head = json.loads(meta_s["nanorl"])
    except (ValueError, RecursionError) as e:
        raise PayloadError(f"nanorl header is not valid JSON: {e}") from None
    if not (isinstance(head, dict) and head.get("format") == FORMAT and isinstance(head.get("sha256"), str)
            and isinstance(head.get("meta"), dict)):
        raise PayloadError(f"nanorl header must be an object with format={FORMAT!r}, sha256 and meta")
    if _digest(entries, memoryview(data)[start:]) != head["sha256"]:  # integrity, not a secret: == is fine
        raise PayloadError("sha256 mismatch: tensor bytes were corrupted or tampered with in transit")
    tensors = _tensors(data, entries, start)
    for k, t in tensors.items():  # a bool byte other than 0/1 is undefined behaviour in torch
        if t.dtype == torch.bool and t.numel() and t.view(torch.uint8).max() > 1:
            raise PayloadError(f"bool tensor {k!r} holds bytes other than 0 and 1")
    return tensors, head["meta"]


def views(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a payload this process encoded itself, viewed in place (its own bytes: no hash check)."""
    return _tensors(data, *_check_header(data)[1:])
