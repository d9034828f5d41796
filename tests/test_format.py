"""The code is as the formatter and the import sorter leave it (pyproject.toml's [tool.ruff], 120 columns): a style
fix is `ruff format . && ruff check --fix .`, never a commit of its own."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import REPO


def ruff(*args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: `pip install -r requirements.txt` (python -m ebrl.install) installs it")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


def test_the_code_is_formatted():
    out = ruff("format", "--check", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_imports_are_sorted():
    out = ruff("check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr
