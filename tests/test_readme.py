"""The README's examples are tests: each ```python block after a `readme-test` marker runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from .gpu import requires_gpu

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"<!-- readme-test: (cpu|gpu) -->\s*```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_examples():
    assert {kind for kind, _ in BLOCKS} == {"cpu", "gpu"}


@pytest.mark.parametrize("code", [c for k, c in BLOCKS if k == "cpu"])
def test_cpu_example_runs(code, capsys):
    exec(compile(code, "README.md", "exec"), {})
    assert "kernel 0" in capsys.readouterr().out


@pytest.mark.parametrize("code", [pytest.param(c, marks=requires_gpu) for k, c in BLOCKS if k == "gpu"])
def test_gpu_example_runs(code):
    exec(compile(code, "README.md", "exec"), {})
