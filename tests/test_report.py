"""report.html of a short real run, opened in a real browser (Chromium from Debian, driven by Playwright):
curves and sample rows are drawn, and the filters change what is shown."""
import shutil
from pathlib import Path

import pytest

import report
import train
import utils
from model import build_tiny_model

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs Chromium: apt-get install chromium")]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The arith preset, shortened: warm-start, GRPO steps, two evals after the first."""
    tiny = build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), layers=2, hidden=128, heads=2, intermediate=256)
    cfg = utils.load_config(train.Config, ["--config", "configs/arith_tiny_cpu.yaml", "--model", tiny, "--steps", "4",
                                           "--sft-steps", "3", "--batch", "16", "--eval-size", "12", "--eval-every", "2",
                                           "--samples", "3", "--no-progress", "--out", str(tmp_path_factory.mktemp("r") / "run")])
    return train.train(cfg)


@pytest.fixture(scope="module")
def page(run):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
        page.goto((run / "report.html").as_uri())
        page.errors = errors
        yield page
        browser.close()


def shown(page) -> list[list[str]]:
    return page.locator("#sample-table tbody tr").evaluate_all("rows => rows.map(r => [...r.cells].map(c => c.innerText))")


def test_every_metric_is_a_curve_in_its_panel(run, page):
    keys = set(utils.read_metrics(run / "metrics.csv"))
    drawn = page.locator(".chart polyline").evaluate_all("ls => ls.map(l => l.closest('.chart').dataset.key)")
    assert set(drawn) == keys and not page.errors
    points = page.locator('.chart[data-key="eval_accuracy"] polyline').get_attribute("points").split()
    assert len(points) == 3  # steps 0, 2 and 4
    panels = page.locator("#panels h3").all_inner_texts()
    assert panels[:3] == ["Rewards", "Eval", "Loss, clipping, KL, entropy"] and "Lengths" in panels


def test_sample_rows_are_shown_and_the_filters_change_them(run, page, tmp_path):
    samples = report.read_samples(run)
    train_rows = [r for r in samples if r["kind"] == "train"]
    assert len(train_rows) == 4 * 3 and len(samples) == len(train_rows) + 3 * 12  # 3/step; 12 problems x 3 evals
    rows = shown(page)
    assert len(rows) == 50 and "page 1 of 2" in page.locator("#page").inner_text()  # 48 rows: paginated
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
    assert {r[2] for r in hits} == {samples[-1]["prompt"]} and len(hits) == 3  # one problem at each eval
    compare = page.locator("#compare-table tbody tr").count()
    assert compare == 12 and "step 0" in page.locator("#first-head").inner_text()
    page.screenshot(path=str(tmp_path / "report.png"))
    shutil.copy(tmp_path / "report.png", Path(__file__).parent.parent / "docs" / "report.png")


def test_rebuild_command_writes_the_same_page(run, tmp_path):
    before = (run / "report.html").read_text()
    assert report.main([str(run)]) == 0 and (run / "report.html").read_text() == before
    assert report.main([str(tmp_path)]) == 2  # not a run directory: one line, no traceback
