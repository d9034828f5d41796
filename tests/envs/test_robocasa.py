"""RoboCasa up to its kitchen assets, for real, in its own interpreter (built by `python -m ebrl.envs.setup robocasa`).

The ~10 GB of kitchen assets cannot be downloaded here, so no kitchen is built: these tests cover
the venv, the import, RoboCasa's task registry and the one-line errors that stop a run before it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ebrl.envs.base import EnvSetupError
from ebrl.envs.robocasa_env import RoboCasaEnv
from ebrl.envs.setup import SETUP_COMMAND, benchmark_python
from tests.envs.common import run_in_interpreter

REPO = Path(__file__).resolve().parents[2]
PYTHON = benchmark_python("robocasa")
needs_venv = pytest.mark.skipif(
    PYTHON is None, reason=f"no RoboCasa venv: run `{SETUP_COMMAND.format(name='robocasa')}`"
)
DEFAULT_TASK = "PickPlaceCounterToCabinet"  # RoboCasa 1.0's name for v0.x's PnPCounterToCab

# Runs under the venv's interpreter; prints one JSON line of findings as its last line.
PRELUDE = """
import json, sys
from ebrl.envs.base import EnvSetupError
from ebrl.envs.robocasa_env import RoboCasaEnv, check_assets, missing_assets, package_assets_dir

def error_of(**kw):
    try:
        RoboCasaEnv(**kw)
    except EnvSetupError as e:
        return str(e)
    return None
"""


def run_in_venv(code: str, timeout: float = 240) -> dict:
    return run_in_interpreter(PYTHON, PRELUDE + code, timeout)


@needs_venv
def test_package_imports_and_registry_has_the_default_task():
    out = run_in_venv(
        """
import numpy, mujoco, robosuite, robocasa
from ebrl.envs.robocasa_env import _import_robocasa
_, tasks = _import_robocasa()
print(json.dumps({"robocasa": robocasa.__version__, "robosuite": robosuite.__version__, "numpy": numpy.__version__,
                  "mujoco": mujoco.__version__, "tasks": sorted(tasks), "torch": "torch" in sys.modules,
                  "made": DEFAULT in robosuite.ALL_ENVIRONMENTS}))
""".replace("DEFAULT", repr(DEFAULT_TASK))
    )
    assert out["robocasa"] == "1.0.0" and out["robosuite"].startswith("1.5")
    assert out["numpy"] == "2.2.5" and out["mujoco"] == "3.3.1"
    assert DEFAULT_TASK in out["tasks"] and out["made"]  # robosuite.make knows it too
    assert "Kitchen" not in out["tasks"] and len(out["tasks"]) > 100
    assert not out["torch"]


@needs_venv
def test_missing_assets_is_one_line_with_the_expected_path(tmp_path):
    out = run_in_venv(f"""
package = package_assets_dir()
print(json.dumps({{"package": str(package), "missing": missing_assets(package),
                  "default": error_of(task={DEFAULT_TASK!r}),
                  "elsewhere": error_of(task={DEFAULT_TASK!r}, assets_dir={str(tmp_path)!r}),
                  "python": sys.executable}}))
""")
    if not out["missing"]:
        pytest.skip(f"RoboCasa's kitchen assets are installed in {out['package']}")
    default, elsewhere = out["default"], out["elsewhere"]
    for message in (default, elsewhere):
        assert message is not None and "\n" not in message
        assert message.startswith("env=robocasa needs RoboCasa's kitchen assets (~10 GB)")
        assert f"`{out['python']} -m robocasa.scripts.download_kitchen_assets`" in message
        assert "env.assets_dir" in message
    assert out["package"].endswith("site-packages/robocasa/models/assets")
    assert f"expected in RoboCasa's package folder {out['package']} " in default
    assert f"expected in env.assets_dir {tmp_path} " in elsewhere
    assert "missing: textures, fixtures/sinks, objects/objaverse, objects/lightwheel" in elsewhere


@needs_venv
def test_download_command_exists_in_the_package():
    out = run_in_venv("""
from importlib.util import find_spec
spec = find_spec("robocasa.scripts.download_kitchen_assets")
print(json.dumps({"found": spec is not None and spec.origin.endswith("download_kitchen_assets.py")}))
""")
    assert out["found"]


@needs_venv
def test_unknown_task_names_the_closest_registered_ones():
    out = run_in_venv("""
print(json.dumps({"old_name": error_of(task="PnPCounterToCab"), "typo": error_of(task="OpenDrawr"),
                  "reward": error_of(reward="shaped")}))
""")
    for key in ("old_name", "typo"):
        message = out[key]
        assert message is not None and "\n" not in message and len(message) < 400
        assert "is not a task of env=robocasa; closest of its 373 tasks: " in message
        assert "REGISTERED_KITCHEN_ENVS" in message
    assert out["old_name"].startswith("env.task='PnPCounterToCab'")
    assert "OpenDrawer" in out["typo"]
    assert out["reward"].startswith("env.reward='shaped' is not available")


def test_main_interpreter_says_run_setup():
    """The main interpreter has robosuite 1.5.2 and no RoboCasa: one line naming the setup command."""
    code = (
        "from ebrl.envs.robocasa_env import RoboCasaEnv\n"
        "from ebrl.envs.base import EnvSetupError\n"
        f"try:\n    RoboCasaEnv(task={DEFAULT_TASK!r})\nexcept EnvSetupError as e:\n    print(e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and not lines:
        pytest.skip("this interpreter has RoboCasa and its assets installed")
    assert len(lines) == 1
    if "robocasa" in sys.modules or "kitchen assets" in lines[0]:
        pytest.skip("this interpreter has RoboCasa installed")
    assert lines[0].startswith("env=robocasa needs its own interpreter: run `python -m ebrl.envs.setup robocasa`")


def test_bad_reward_is_one_line():
    with pytest.raises(EnvSetupError, match="env.reward='shaped'"):
        RoboCasaEnv(reward="shaped")
