"""The editable install (`pip install -e ".[test]"`) is immune to a checkout folder named nvdnn:
a script run from the folder that holds the checkout imports the package, not the checkout as a
namespace package.

Simulated without a network or a new virtualenv: the project's build backend builds the
editable wheel exactly as pip asks it to (PEP 660 ``build_editable``, no config settings), the
wheel's files go into a fresh site folder whose .pth files Python processes as at start-up, and
the script runs from the checkout's parent with no other site folder processed (the dependencies'
folders are plain path entries)."""
from __future__ import annotations

import importlib.util
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = """\
import site, sys
sys.path.extend(sys.argv[2:])   # the dependencies, without their .pth files
site.addsitedir(sys.argv[1])    # the editable wheel's files, as pip installs them
import nvdnn
from nvdnn import codegen
print(nvdnn.__file__)
print(codegen.templates_dir())
print(nvdnn.Graph.__name__)
"""


def test_a_script_beside_a_checkout_named_nvdnn_imports_the_package(tmp_path):
    pytest.importorskip("setuptools")
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None:  # setuptools < 70.1 needs wheel
        pytest.importorskip("wheel", reason="this setuptools builds no wheel without the wheel package")
    checkout = tmp_path / "nvdnn"
    for name in ("pyproject.toml", "README.md"):
        (checkout / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, checkout / name)
    for name in ("nvdnn", "templates"):
        shutil.copytree(ROOT / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_editable(sys.argv[1]))", str(wheels)],
                           cwd=checkout, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-2000:]
    installed = tmp_path / "site-packages"
    with zipfile.ZipFile(wheels / build.stdout.split()[-1]) as wheel:
        wheel.extractall(installed)
    (tmp_path / "app.py").write_text(SCRIPT)
    run = subprocess.run([sys.executable, "-E", "-S", "app.py", str(installed), *site.getsitepackages()],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    module, templates, graph = run.stdout.split()
    assert Path(module) == checkout / "nvdnn" / "__init__.py"
    assert Path(templates) == checkout / "templates" and graph == "Graph"


def test_every_package_of_the_source_tree_is_listed_for_the_wheel():
    """pyproject lists the packages by name: a subpackage missing there is missing from a wheel
    (a regular `pip install .` then fails at its first import)."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 reads no TOML without a package")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "nvdnn").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
