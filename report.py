"""report.html: one self-contained page per run (every metric as a curve, the config, the samples in a
filterable table, the first eval beside the last), with no network at view time. train.py rewrites it
at each eval and at the end; to rebuild it from a run directory:

    python report.py runs/NAME
"""
import json
import math
import sys
import time
import warnings
from pathlib import Path

import yaml

import rundir
import utils

MAX_POINTS = 400  # a curve's evenly spaced steps and its last: 10,000 steps draw as fast as 100
HEADLINE = ("eval_return", "eval_accuracy")  # the eval that --target stops at (a task logs one of them)
REFRESH_SHARE = 0.05  # at most this share of a live run's time goes to rewriting its report
REFRESH_DUE: dict[Path, float] = {}  # run -> when refresh() may rewrite it again (report.py's own state)
TEMPLATE = utils.data_file("report.html.template")


def thin(points: list) -> list:
    kept = points[:: -(-len(points) // MAX_POINTS)]
    return kept if kept[-1] is points[-1] else kept + points[-1:]


def read_samples(run: Path, strict: bool = False) -> list[dict]:
    """samples.1.jsonl (rotated whole) then samples.jsonl; a last line cut short by a kill is left out, and
    a damaged one as read_metrics does: with a warning (a live run's report), or `strict`, a ConfigError."""
    rows = []
    for path in (run / "samples.1.jsonl", run / "samples.jsonl"):
        lines = path.read_text(errors="replace").splitlines(keepends=True) if path.exists() else []
        for n, line in enumerate(lines, 1):
            if not line.endswith("\n"):  # the last, still being written (or cut short by a kill)
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                why = f"{path}:{n}: not a JSON line ({e.msg}); repair or delete that line"
                if strict:
                    raise utils.ConfigError(why) from None
                warnings.warn(f"{why}; the report leaves it out")
    return rows


def write_report(run: Path, strict: bool = False) -> Path:
    """`strict`: a damaged line of a log stops it (report.py); else it is left out (a live run's)."""
    series = rundir.read_metrics(run / "metrics.csv", strict) if (run / "metrics.csv").exists() else {}
    data = {"run": run.name, "config": yaml.safe_load((run / "config.yaml").read_text()),
            "curves": {key: [[s, v] for s, _, v in thin(points)] for key, points in series.items()},
            "samples": read_samples(run, strict)}
    # A JavaScript literal (NaN and Infinity included) whose every "<" is \u003c: a model's text can neither
    # close the script ("</script>") nor make the browser read the rest of the page as script ("<!--<script>")
    html = TEMPLATE.read_text().replace("/*DATA*/", json.dumps(data).replace("<", "\\u003c"))
    rundir.atomic_write(run / "report.html", html.encode())  # a browser refreshing mid-run sees no half page
    return run / "report.html"


def refresh(run: Path) -> None:
    """write_report at a live run's eval, unless the last rewrite, for what it cost, was too recent: its
    cost grows with the run (10k steps, samples at their cap: 5 s and 1 GB), and with cheap steps and
    --eval-every 5 rewrites would take most of the run. The end of a run calls write_report itself."""
    if time.monotonic() < REFRESH_DUE.get(run, 0.0):
        return
    start = time.monotonic()
    write_report(run)
    REFRESH_DUE[run] = start + (time.monotonic() - start) / REFRESH_SHARE


def reached(evals: dict, target: float) -> bool:
    """--target: the headline eval is at it (0: never)."""
    return bool(target) and max(evals.get(k, -math.inf) for k in HEADLINE) >= target


def summary(run: Path, wall_s: float, export: str) -> str:
    """What a user wants to know when a run ends: how good, how long, and where everything is."""
    series = rundir.read_metrics(run / "metrics.csv")
    lines = [f"run saved to {run} ({wall_s:.1f} s of training)"]
    for key in [k for k in HEADLINE if k in series]:
        best, final = max(series[key], key=lambda p: -math.inf if math.isnan(p[2]) else p[2]), series[key][-1]
        lines.append(f"  {key}: best {best[2]:.4g} (step {best[0]}), final {final[2]:.4g} (step {final[0]})")
    ckpts = rundir.checkpoints(run)
    lines += [f"  report: {run / 'report.html'}", f"  checkpoints: {ckpts[-1] if ckpts else 'none'}"]
    return "\n".join(lines + ([f"  export: {export}"] if export else []))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        utils.stderr("usage: python report.py RUN_DIR (a run directory of train.py, with its config.yaml)")
        return 0 if argv in (["-h"], ["--help"]) else 2
    if not ((run := Path(argv[0])) / "config.yaml").exists():
        why = ("no config.yaml in it" if run.is_dir() else "not a directory" if run.exists()
               else "no such directory")
        utils.stderr(f"{argv[0]}: {why}; pass a run directory of train.py (runs/NAME)")
        return 2
    try:
        print(write_report(run, strict=True))
    except utils.ConfigError as e:  # a damaged line of metrics.csv or samples.jsonl, named
        utils.stderr(f"error: {e}")
        return 2
    except (ValueError, KeyError, TypeError, yaml.YAMLError) as e:  # a hand-edited file of the run
        why = f"{type(e).__name__}: {' '.join(str(e).split())}"
        utils.stderr(f"{argv[0]}: cannot read its config.yaml ({why}); repair it (YAML), or copy a run's")
        return 2
    except OSError as e:  # a run this user may read, not write (another's, a read-only mount)
        utils.stderr(f"{argv[0]}: cannot write its report.html ({e}); copy the run to a writable place")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
