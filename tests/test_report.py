"""report.html of a short real run, opened in a real browser (Chromium from Debian, driven by Playwright):
curves and sample rows are drawn, and the filters change what is shown."""
import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

import report
import rundir
import train
import utils
from modeldir import build_tiny_model

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Chromium: apt-get install chromium")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The arith preset, shortened: warm-start, GRPO steps, two evals after the first; W&B on (offline)."""
    tiny = build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), layers=2, hidden=128, heads=2, intermediate=256)
    cfg = utils.load_config(train.Config, ["--config", "configs/arith_tiny_cpu.yaml", "--model", tiny, "--steps", "4",
                                           "--sft-steps", "3", "--batch", "16", "--eval-size", "12", "--eval-every", "2",
                                           "--samples", "3", "--log", "wandb", "--no-progress", "--out", str(tmp_path_factory.mktemp("r") / "run")])
    return train.train(cfg)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


def opened(browser, report_html: Path):
    """The page in a new tab, offline (any request but file: is refused); page.errors: its script's errors."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    page.goto(report_html.as_uri())
    return page


@pytest.fixture(scope="module")
def page(run, browser):
    return opened(browser, run / "report.html")


def shown(page) -> list[list[str]]:
    return page.locator("#sample-table tbody tr").evaluate_all("rows => rows.map(r => [...r.cells].map(c => c.innerText))")


def test_every_metric_is_a_curve_in_its_panel(run, page):
    keys = set(rundir.read_metrics(run / "metrics.csv"))
    drawn = page.locator(".chart polyline").evaluate_all("ls => ls.map(l => l.closest('.chart').dataset.key)")
    assert set(drawn) == keys and not page.errors
    points = page.locator('.chart[data-key="eval_accuracy"] polyline').get_attribute("points").split()
    assert len(points) == 3  # steps 0, 2 and 4
    panels = page.locator("#panels h3").all_inner_texts()
    assert panels[:3] == ["Rewards", "Eval", "Loss, clipping, KL, entropy"] and "Lengths" in panels


def test_sample_rows_are_shown_and_the_filters_change_them(run, page, tmp_path):
    samples = report.read_samples(run)
    train_rows = [r for r in samples if r["kind"] == "train"]
    # 3 a step; 12 problems at each eval: before the warm-start (step -3), after it (0), at steps 2 and 4
    assert len(train_rows) == 4 * 3 and len(samples) == len(train_rows) + 4 * 12
    docs = Path(__file__).parent.parent / "docs"  # the README's picture of a report: the curves, then the samples
    docs.mkdir(exist_ok=True)
    page.screenshot(path=str(tmp_path / "report.png"), full_page=True, clip={"x": 0, "y": 0, "width": 1280, "height": 1700})
    shutil.copy(tmp_path / "report.png", docs / "report.png")
    rows = shown(page)
    assert len(rows) == 50 and "page 1 of 2 (60 of 60 rows)" in page.locator("#page").inner_text()
    page.click("#next")
    assert len(shown(page)) == 10
    page.select_option("#f-kind", "train")
    rows = shown(page)
    assert len(rows) == 12 and {r[1] for r in rows} == {"train"}
    assert [r[2] for r in rows] == [r["prompt"] for r in train_rows]
    page.fill("#f-from", "3")
    assert {r[0] for r in shown(page)} == {"3", "4"}
    page.select_option("#f-kind", "eval")
    page.fill("#f-from", "")
    page.fill("#f-text", samples[-1]["prompt"])
    hits = shown(page)
    assert {r[2] for r in hits} == {samples[-1]["prompt"]} and len(hits) == 4  # one problem at each eval
    compare = page.locator("#compare-table tbody tr").count()
    assert compare == 12 and "step -3" in page.locator("#first-head").inner_text()
    assert page.locator("#cmp-count").inner_text() == "12 of 12 problems"
    assert "step 4" in page.locator("#last-head").inner_text()


@pytest.mark.parametrize("text", ["<!--<script>", "</script><script>document.title = 'pwned'</script>"])
def test_a_sample_that_reads_as_html_is_shown_as_text_and_the_page_still_draws(run, browser, tmp_path, text):
    """Model-written text goes into the page's script. "<!--<script>" in a sample (HTML a model wrote)
    made Chromium read the rest of the page as script data: no curve and no sample row was drawn."""
    copy = shutil.copytree(run, tmp_path / "run")
    row = {"step": 5, "kind": "train", "prompt": text, "completion": text, "reward": 1.0}
    with open(copy / "samples.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    page = opened(browser, report.write_report(copy))
    page.select_option("#f-kind", "train")
    page.fill("#f-from", "5")
    assert shown(page) == [["5", "train", text, text, "", "", "1", "", "", ""]] and not page.errors
    drawn = page.locator(".chart polyline").count()
    assert drawn == len(rundir.read_metrics(run / "metrics.csv")) and page.title() != "pwned"


def test_a_foreign_runs_sample_fields_and_an_empty_config_are_shown_as_text_and_the_page_draws(run, browser, tmp_path):
    """A sample's step, version and staleness went into the page unescaped: a run directory from elsewhere
    (or a hand-edited samples.jsonl) ran its script when report.py rebuilt it. An empty config.yaml (a
    write cut short) stopped the page's script: no curve, no sample row."""
    copy = shutil.copytree(run, tmp_path / "run")
    html = "<img src=x onerror=\"document.title='pwned'\">"
    with open(copy / "samples.jsonl", "a") as f:
        f.write(json.dumps({"step": html, "kind": "train", "prompt": "p", "version": html, "staleness": 1}) + "\n")
    (copy / "config.yaml").write_text("")
    page = opened(browser, report.write_report(copy))
    page.fill("#f-text", "p")
    page.select_option("#f-kind", "train")
    assert [html, f"{html} / 1"] in [[row[0], row[-1]] for row in shown(page)]
    assert page.title() != "pwned" and not page.errors and page.locator("#sample-table img").count() == 0
    assert page.locator(".chart polyline").count() == len(rundir.read_metrics(run / "metrics.csv"))


def test_a_long_runs_first_and_last_evals_are_compared_past_the_browsers_argument_limit(browser, tmp_path):
    """The comparison found the first and last eval steps as Math.min(...steps), one argument per eval row:
    past ~120k rows (samples at their cap hold 250k short ones) Chromium threw "Maximum call stack size
    exceeded" and the comparison stayed empty. 200 evals of 1000 problems: steps 0 to 398."""
    (tmp_path / "config.yaml").write_text("task: arith\n")
    with open(tmp_path / "samples.jsonl", "w") as f:
        f.writelines(json.dumps({"step": 2 * (i // 1000), "kind": "eval", "prompt": str(i % 1000),
                                 "reward": i // 1000 % 2}) + "\n" for i in range(200_000))
    page = opened(browser, report.write_report(tmp_path))
    assert not page.errors and page.locator("#cmp-count").inner_text() == "50 of 1000 problems"
    heads = page.locator("#first-head").inner_text(), page.locator("#last-head").inner_text()
    assert heads == ("first eval (step 0)", "last eval (step 398)")


def test_a_long_curve_is_thinned_to_evenly_spaced_steps_and_keeps_its_last():
    points = [[s, float(s)] for s in range(1001)]  # ceil(1001 / 400) = 3: steps 0, 3, ..., 999, then 1000
    assert report.thin(points) == points[::3] + [points[-1]] and len(report.thin(points)) == 335
    assert report.thin(points[:1000]) == points[:1000:3]  # step 999 is last already: not twice
    assert report.thin(points[:400]) == points[:400]


def test_the_summary_names_the_best_and_final_evals_the_newest_checkpoint_and_the_export(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,wall_s,key,value\n5,1,eval_return,100\n10,2,eval_return,480.5\n"
                                          "15,3,eval_return,300\n15,3,reward,9\n")
    for step in (10, 15):
        (tmp_path / f"ckpt-{step:07d}").mkdir()
    assert report.summary(tmp_path, 3.04, "out/adapter").splitlines() == [
        f"run saved to {tmp_path} (3.0 s of training)", "  eval_return: best 480.5 (step 10), final 300 (step 15)",
        f"  report: {tmp_path / 'report.html'}", f"  checkpoints: {tmp_path / 'ckpt-0000015'}", "  export: out/adapter"]
    for step in (10, 15):
        (tmp_path / f"ckpt-{step:07d}").rmdir()
    assert report.summary(tmp_path, 0.0, "").splitlines()[-1] == "  checkpoints: none"  # and no export line


def test_evals_of_several_checkpoints_into_one_out_are_read_in_step_order(tmp_path):
    """--eval-only of ckpt-30, then ckpt-10, then ckpt-20 into one --out logs them in that order: the curves
    drew a zigzag, and the summary called step 20's eval the final one."""
    cfg = dataclasses.replace(train.Config(), eval_only=True)
    for step, value in ((30, 300.0), (10, 100.0), (20, 200.0)):
        with contextlib.closing(rundir.Metrics(tmp_path, cfg, resumed_at=step - 1)) as log:
            log.log(step, {"eval_return": value})
    assert [(s, v) for s, _, v in rundir.read_metrics(tmp_path / "metrics.csv")["eval_return"]] == [
        (10, 100.0), (20, 200.0), (30, 300.0)]
    assert "eval_return: best 300 (step 30), final 300 (step 30)" in report.summary(tmp_path, 0.0, "")


def test_the_summarys_best_eval_is_never_a_nan_one(tmp_path):
    """max() keeps a NaN it meets first (an eval whose every sample a downed judge dropped): the summary
    named "best nan (step 0)" over the run's real best."""
    (tmp_path / "metrics.csv").write_text("step,wall_s,key,value\n0,0.1,eval_accuracy,nan\n"
                                          "2,0.2,eval_accuracy,0.5\n4,0.3,eval_accuracy,0.25\n")
    assert "eval_accuracy: best 0.5 (step 2), final 0.25 (step 4)" in report.summary(tmp_path, 1.0, "")


def test_rebuild_command_writes_the_same_page(run, tmp_path):
    before = (run / "report.html").read_text()
    assert report.main([str(run)]) == 0 and (run / "report.html").read_text() == before
    assert report.main([str(tmp_path)]) == 2  # not a run directory: one line, no traceback


def test_a_directory_that_is_no_run_is_named_not_answered_with_the_usage(tmp_path, capsys):
    """`python report.py /missing/dir` printed only its usage line."""
    (tmp_path / "metrics.csv").write_text("")
    assert report.main([str(tmp_path / "missing")]) == 2 and report.main([str(tmp_path)]) == 2
    assert report.main([str(tmp_path / "metrics.csv")]) == 2 and report.main(["--help"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"{tmp_path / 'missing'}: no such directory; pass a run directory of train.py (runs/NAME)",
        f"{tmp_path}: no config.yaml in it; pass a run directory of train.py (runs/NAME)",
        f"{tmp_path / 'metrics.csv'}: not a directory; pass a run directory of train.py (runs/NAME)",
        "usage: python report.py RUN_DIR (a run directory of train.py, with its config.yaml)"]


def test_two_processes_rewriting_a_report_and_a_line_still_being_written_both_go_through(tmp_path):
    """An eval's rewrite and `python report.py RUN` shared report.html.tmp: one os.replace moved the other's
    file away, which killed the run (FileNotFoundError); a last line half-written failed report.py."""
    (tmp_path / "config.yaml").write_text("task: cartpole\n")
    (tmp_path / "metrics.csv").write_text("step,wall_s,key,value\n1,0.5,loss,2\n2,0.7,lo")
    assert rundir.read_metrics(tmp_path / "metrics.csv") == {"loss": [(1, 0.5, 2.0)]}
    fork = multiprocessing.get_context("fork")
    writers = [fork.Process(target=lambda: [report.write_report(tmp_path) for _ in range(300)]) for _ in "ab"]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert [w.exitcode for w in writers] == [0, 0] and sorted(os.listdir(tmp_path)) == [
        "config.yaml", "metrics.csv", "report.html"]


@pytest.mark.parametrize("name, text", [("samples.jsonl", '{"step": 1}\n{"step": 2}\nnot json\n{"step": 3}\n'),
                                        ("config.yaml", "task: [cartpole\n")])
def test_a_damaged_log_is_one_line_naming_the_file_the_line_and_the_fix(tmp_path, capsys, name, text):
    """samples.jsonl's was "cannot read its config.yaml or samples.jsonl (JSONDecodeError: ... line 1 column
    1 ...)": neither the file nor the line (the decoder's line 1 is within the line)."""
    (tmp_path / "config.yaml").write_text("task: cartpole\n")
    (tmp_path / name).write_text(text)  # the damaged file (config.yaml: replaced)
    assert report.main([str(tmp_path)]) == 2 and not (tmp_path / "report.html").exists()
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path / name}:3: not a JSON line (Expecting value); repair or delete that line"
        if name == "samples.jsonl" else f"{tmp_path}: cannot read its config.yaml (ParserError: while parsing a "
        "flow sequence in \"<unicode string>\", line 1, column 7: task: [cartpole ^ expected ',' or ']', but got "
        "'<stream end>' in \"<unicode string>\", line 2, column 1: ^); repair it (YAML), or copy a run's"]
    if name == "samples.jsonl":  # a live run's report leaves it out, as a damaged metrics line
        with pytest.warns(UserWarning, match=f"{tmp_path / name}:3: not a JSON line .*; the report leaves it out"):
            assert [r["step"] for r in report.read_samples(tmp_path)] == [1, 2, 3]


FIX = "repair or delete that line (the run's checkpoints are untouched)"


@pytest.mark.parametrize("line, why", [("1,0.5,loss,abc", "value 'abc' is not a number"),
                                       ("1.5,0.5,loss,2", "step '1.5' is not a whole number"),
                                       ("1,0.5,loss", "3 fields, not 4 (step,wall_s,key,value)"),
                                       ('1,0.5,"loss,2', "3 fields, not 4 (step,wall_s,key,value)"),
                                       ("1,0.5,lo\rss,2", "it does not read as one CSV row"),
                                       ("1,0.5,loss," + "x" * 50, f"value '{'x' * 40}' is not a number")])
def test_a_damaged_metrics_line_stops_report_py_naming_the_line_and_the_fix(tmp_path, capsys, line, why):
    """Was one line naming neither the line nor what is wrong there ("TypeError: float() argument must be a
    string or a real number, not 'NoneType'"). Line 5, still being written, is skipped as before."""
    (tmp_path / "config.yaml").write_text("task: cartpole\n")
    metrics = tmp_path / "metrics.csv"
    metrics.write_bytes(f"step,wall_s,key,value\n1,0.4,loss,2\n{line}\n2,0.9,loss,4\n3,1.2,lo".encode())
    before = metrics.read_bytes()
    assert report.main([str(tmp_path)]) == 2 and not (tmp_path / "report.html").exists()
    assert capsys.readouterr().err.splitlines() == [f"error: {metrics}:3: {why}; {FIX}"]
    assert metrics.read_bytes() == before


def test_a_damaged_metrics_line_is_left_out_of_a_live_runs_report_curve_and_summary_with_a_warning(tmp_path):
    """A run writes report.html at each eval, then curve.png and the summary: a damaged line of metrics.csv
    (a hand edit of a live run, a resume from one) killed the run with a ValueError traceback mid-training."""
    (tmp_path / "config.yaml").write_text("task: cartpole\n")
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,wall_s,key,value\n2,1,eval_return,300\n4,2,eval_return,abc\n\n"
                       "6,3,eval_return,200\n\r\n")  # a blank line (an editor's "\r" too): nothing to warn of
    with pytest.warns(UserWarning) as caught:
        html = report.write_report(tmp_path).read_text()
        rundir.plot(tmp_path, keys=("eval_return",))
        summary = report.summary(tmp_path, 3.0, "").splitlines()
    why = f"{metrics}:3: value 'abc' is not a number; {FIX}; the report and curve leave it out"
    assert [str(w.message) for w in caught] == [why] * 3  # one a read (pytest records every one)
    assert '"curves": {"eval_return": [[2, 300.0], [6, 200.0]]}' in html and (tmp_path / "curve.png").exists()
    assert summary[1] == "  eval_return: best 300 (step 2), final 200 (step 6)"


def test_a_report_that_cannot_be_written_is_one_line_naming_why_and_the_run_is_untouched(
        tmp_path, capsys, monkeypatch):
    (tmp_path / "config.yaml").write_text("task: cartpole\n")
    (tmp_path / "report.html").mkdir()  # in report.html's way as a read-only mount is (to root, too)
    assert report.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{tmp_path}: cannot write its report.html (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "report.html"]  # no .tmp left
    (tmp_path / "report.html").rmdir()

    def read_only(path, mode):  # a read-only mount refuses the file itself: there is no .tmp to remove
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(rundir, "open", read_only, raising=False)  # atomic_write's open(), not report.py's
    assert report.main([str(tmp_path)]) == 1
    tmp = tmp_path / f"report.html.{os.getpid()}.tmp"
    assert capsys.readouterr().err.splitlines() == [
        f"{tmp_path}: cannot write its report.html ([Errno 30] Read-only file system: '{tmp}'); copy the run "
        "to a writable place"]


def test_samples_reach_wandb_as_one_table_per_eval(run):
    from test_run import wandb_records

    [log] = (run / "wandb").glob("offline-run-*/run-*.wandb")
    tables = [(r["step"], r["samples/nrows"]) for kind, r in wandb_records(log) if kind == "history" and "samples/nrows" in r]
    assert tables == [(-3, 12), (0, 12), (2, 2 * 3 + 12), (4, 2 * 3 + 12)]  # each eval, with the train rows since the last


def test_a_live_runs_report_rewrites_take_at_most_their_share_of_its_time(monkeypatch, tmp_path):
    """Each eval rewrote report.html whole, from all of metrics.csv and the samples: at 10k steps with the
    samples at their cap that is 5 s, and at --eval-every 5 of cheap steps most of the run. refresh() now
    skips an eval until the last rewrite is at most REFRESH_SHARE (5%) of the time since it began."""
    now, calls = [0.0], []

    def write(run):  # a rewrite that costs 1 s of the clock
        calls.append((run.name, now[0]))
        now[0] += 1.0

    monkeypatch.setattr(report, "write_report", write)
    monkeypatch.setattr(report.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(report, "REFRESH_DUE", {})
    for t in range(0, 100, 5):  # an eval every 5 s
        now[0] = float(t)
        report.refresh(tmp_path / "a")
    assert calls == [("a", t) for t in (0.0, 20.0, 40.0, 60.0, 80.0)]  # 1 s in each 20: 5%
    now[0] = 85.0
    report.refresh(tmp_path / "b")  # another run's first eval is its own
    assert calls[-1] == ("b", 85.0)


def test_a_curve_with_nothing_to_plot_is_drawn_without_a_warning(tmp_path, recwarn):
    """A run stopped before it logged a point: matplotlib's "No artists with labels found to put in legend"
    reached the user as a warning at the end of the run."""
    (tmp_path / "metrics.csv").write_text("step,wall_s,key,value\n")
    fig = rundir.plot(tmp_path, keys=("eval_return",))
    assert [str(w.message) for w in recwarn] == [] and [ax.get_legend() for ax in fig.axes] == [None, None]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curve_png_plots_each_key_by_step_and_wall_time_from_before_the_warm_start_which_it_shades(tmp_path):
    """curve.png: by step (left) and by wall seconds (right), each key from its eval before the warm-start
    (step -sft_steps) on; the warm-start's span shaded in both; keys the run did not log are left out."""
    (tmp_path / "metrics.csv").write_text(  # a run of --sft-steps 3, as train.py logs it
        "step,wall_s,key,value\n-3,0.5,eval_return_before_sft,10\n-2,1.0,sft_loss,2.0\n-1,1.5,sft_loss,1.8\n"
        "0,2.0,sft_loss,1.5\n0,3.0,eval_return,20\n2,5.0,eval_return,30\n2,5.0,loss,0.3\n")
    fig = rundir.plot(tmp_path, keys=("eval_return", "eval_accuracy"))
    by_step, by_time = fig.axes
    for ax, xs, label, span in ((by_step, [-3, 0, 2], "step", (-3, 0)),
                                (by_time, [0.5, 3, 5], "wall seconds", (0, 2))):
        [line] = ax.lines
        assert (line.get_label(), list(line.get_xdata())) == ("eval_return", xs)
        assert list(line.get_ydata()) == [10, 20, 30]
        [shade] = ax.patches
        assert (shade.get_x(), shade.get_x() + shade.get_width()) == span and ax.get_xlabel() == label
        assert 0 < shade.get_alpha() < 1 and all(0 < g.get_alpha() < 1 for g in ax.get_xgridlines())  # seen
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["eval_return", "supervised warm-start"]
    png = (tmp_path / "curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    size = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert size == (1000, 350)  # 10 x 3.5 inches at 100 dpi
