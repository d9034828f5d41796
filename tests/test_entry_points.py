"""Every entry point answers `--help` with its usage and exit status 0, and does nothing else (no install, no
compile, no run). The entry points are found in the source: run.py, sweep.py and every ebrl module with a
`__main__` block or a `__main__.py`. Each runs in this process (runpy), so the whole file costs seconds."""

from __future__ import annotations

import re
import runpy
import sys
import warnings

import pytest
from hydra.core.global_hydra import GlobalHydra

from tests.conftest import REPO

MAIN_BLOCK = re.compile(r'^if __name__ == "__main__":', re.M)


def entry_points() -> list[str]:
    """`run.py`-style scripts by file name, modules by their `python -m` name."""
    scripts = [p.name for p in sorted(REPO.glob("*.py")) if MAIN_BLOCK.search(p.read_text())]
    modules = set()
    for path in (REPO / "ebrl").rglob("*.py"):
        if path.name == "__main__.py" or MAIN_BLOCK.search(path.read_text()):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules.add(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return scripts + sorted(modules)


def test_the_entry_points_are_found():
    found = entry_points()
    assert {"run.py", "sweep.py", "ebrl.demos", "ebrl.install", "ebrl.export", "ebrl.envs.setup"} <= set(found)


@pytest.mark.parametrize("entry", entry_points())
def test_help_prints_usage_and_exits_0(entry, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [entry, "--help"])
    code = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: "found in sys.modules" for imported modules
            if entry.endswith(".py"):
                runpy.run_path(str(REPO / entry), run_name="__main__")
            else:
                runpy.run_module(entry, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    finally:
        GlobalHydra.instance().clear()  # Hydra's apps leave it set after --help
    out = capsys.readouterr()
    text = out.out + out.err
    assert code in (0, None), f"{entry} --help exited {code!r}: {text[-500:]}"
    # argparse's and our own usage lines; Hydra's app help lists the groups and keys to override
    assert "usage" in text.lower() or "== Configuration groups ==" in text, f"{entry} --help printed: {text[:500]!r}"
