"""The built wheel, not only the editable install: it ships every package and the grammar,
and `meshplan` works from it outside the repository."""

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], check=True
    )
    (path,) = out.glob("meshplan-*.whl")
    return path


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "meshplan/__init__.py",
        "meshplan/main.py",
        "meshplan/grammar/plan.lark",
        "meshplan/dsl/parser.py",
        "meshplan/compiler/passes/tensor_parallel/walk.py",
        "meshplan/compiler/passes/experts/units.py",
        "meshplan/runtime/collectives.py",
        "meshplan/examples/models/llama.py",
        "meshplan/examples/tiny_dp.plan",
    ):
        assert required in names, required
    # the design's folders are mapped into `meshplan`; nothing may land at the top level
    assert not [
        n for n in names if n.split("/")[0] in ("dsl", "compiler", "runtime", "grammar", "cli", "examples")
    ]


def dependencies_of_this_environment(tmp_path: Path) -> Path:
    """A folder that shows this test environment's installed packages, meshplan's own (the
    editable install) left out: a fresh venv sees exactly what the README's install set up."""
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("meshplan", "__editable__", "_meshplan")):
            (deps / entry.name).symlink_to(entry)
    return deps


def test_wheel_installs_and_runs_outside_the_repo(wheel, tmp_path):
    """A new venv that does not see the system's packages; the wheel is installed with its
    declared dependencies resolved offline (`--no-index`) against this test environment's, so a
    dependency missing from pyproject.toml, or a package the system happens to have, cannot hide."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=False, with_pip=False)  # this pip installs into it
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "test_environment.pth").write_text(f"{dependencies_of_this_environment(tmp_path)}\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "-q", "--no-index", str(wheel)], check=True)
    plan = tmp_path / "ok.plan"
    plan.write_text("mesh dp=*, tp=2\n\nmodules {\n    layers.*.mlp.up_proj: column over tp\n}\n")
    result = subprocess.run(
        [str(python), "-m", "meshplan", "check", str(plan)], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    location = subprocess.run(
        [str(python), "-c", "import meshplan.dsl, sys; print(meshplan.dsl.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(env_dir) in location  # the wheel's copy, not the repository's
