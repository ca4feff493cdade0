"""distzo as an installed package: a wheel built from the tree carries the presets, the kernels'
source and the bundled data, installs (not editable) into a fresh virtual environment, and trains
from a directory outside the source tree. The new environment sees the site-packages of the
environment running the suite (a virtualenv or a bare interpreter alike) for the dependencies
(torch, transformers, ...), which keeps the test offline; distzo itself must come from the wheel,
which the test checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the source tree's files (git's view: tracked and new, not ignored), built from a
    copy, so no build/ is left in the tree and nothing stale from one gets in."""
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                           cwd=ROOT, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_symlink():  # distzo/config/presets -> ../../conf: the one copy of the presets
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(ROOT / name), src / name)
        elif (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "--wheel-dir", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (path,) = out.glob("distzo-*.whl")
    return path


def test_the_wheel_carries_what_runs_need(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("distzo/config/presets/config.yaml", "distzo/config/presets/task/mr-polarity.yaml",
                   "distzo/config/presets/model/tiny.yaml", "distzo/config/presets/hydra/help/distzo.yaml",
                   "distzo/config/presets/hydra/job_logging/worker.yaml", "distzo/native/kernels.c",
                   "distzo/__main__.py", "distzo/cli/main.py"):
        assert needed in names, needed
    assert any(n.startswith("distzo/data/assets/") for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


def test_an_installed_wheel_trains_outside_the_source_tree(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # The dependencies of the environment running the suite, after the new one's own packages. (venv's
    # --system-site-packages would reach the base interpreter's packages instead, which are not this
    # environment's when the suite runs in a virtualenv.) Directories named in a .pth file join
    # sys.path without their own .pth files running, so the tree's editable install stays out.
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    (Path(purelib) / "suite-dependencies.pth").write_text("\n".join(outer) + "\n")
    r = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    outside = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing points at the tree
    where = subprocess.run([str(python), "-c", "import distzo, pathlib; print(pathlib.Path(distzo.__file__).parent)"],
                           capture_output=True, text=True, cwd=work, timeout=300, env=outside)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr  # the wheel's, not the tree's
    r = subprocess.run([str(python), "-m", "distzo", "train", "model=tiny", "task=synthetic-cue", "steps=3",
                        "eval_every=0", "task.val_size=16", "task.test_size=16", "hydra.run.dir=run"],
                       capture_output=True, text=True, cwd=work, timeout=600,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((work / "run" / "summary.json").read_text())["steps"] == 3
    script = venv / "bin" / "distzo"  # the console script
    r = subprocess.run([str(script), "train", "--help"], capture_output=True, text=True, cwd=work, timeout=300)
    assert r.returncode == 0 and "== distzo train ==" in r.stdout, r.stderr[-2000:]
