"""A user's own env, policy and node, from a folder outside the package: docs/extend/own-classes.md's example as written
there, and one line for a class that breaks its contract or a field its constructor does not take."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from ebrl.checks import validate
from ebrl.config import ConfigError, register_configs
from ebrl.envs.base import AdapterContractError, EnvSetupError
from ebrl.envs.process import build_adapter
from ebrl.envs.worker import SimWorker

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```(?:python|yaml)\n# (my_robot/[^\n]+)\n(.*?)```", re.S)
BAD = """
from reacher_env import ReacherEnv
from mlp_policy import MLPPolicy
from ebrl.envs.base import EnvAdapter
from ebrl.policies.base import Policy


class FourValues(ReacherEnv):
    def step(self, action):
        return super().step(action)[:4]


class GymReset(ReacherEnv):
    def reset(self, seed=None):
        return super().reset(seed), {}


class NoStep(ReacherEnv):
    step = EnvAdapter.step


class NoSpec(ReacherEnv):
    def __init__(self, seed: int = 0):
        EnvAdapter.__init__(self, seed)


class NeedsArm(ReacherEnv):
    def __init__(self, arm: str, task: str = "Reacher-v5", max_episode_steps: int = 50, goal_radius: float = 0.02,
                 seed: int = 0):
        super().__init__(task, max_episode_steps, goal_radius, seed)


class NoEvaluate(MLPPolicy):
    evaluate = Policy.evaluate
"""


@pytest.fixture(scope="module")
def my_robot(tmp_path_factory) -> Path:
    """docs/extend/own-classes.md's example files, written where a user would keep them, and a module of broken
    variants."""
    root = tmp_path_factory.mktemp("user")
    section = (REPO / "docs" / "extend" / "own-classes.md").read_text()
    blocks = BLOCK.findall(section)
    assert {name for name, _ in blocks} >= {
        "my_robot/reacher_env.py",
        "my_robot/mlp_policy.py",
        "my_robot/conf/env/reacher.yaml",
        "my_robot/conf/policy/mlp.yaml",
        "my_robot/conf/hw/laptop.yaml",
    }
    for name, text in blocks:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "my_robot" / "bad.py").write_text(BAD)
    command = re.search(r"cd my_robot && python ~/ebrl/run.py ([^\n]+)", section)
    assert command
    (root / "command").write_text(command.group(1))
    return root / "my_robot"


def test_the_documented_example_trains_under_ebrl_from_its_own_folder(my_robot):
    args = (my_robot.parent / "command").read_text().split()
    # (the allocator calibrates from the first iteration from the second on in which every stage measured a rate;
    # on a loaded machine an update can land outside iteration 2's window, so one iteration more)
    out = subprocess.run(
        [sys.executable, str(REPO / "run.py"), *args, "iterations=4", "progress=false"],
        cwd=my_robot,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "plan simulate" in out.stdout + out.stderr  # the ebrl schedule's allocator planned the stages
    metrics = next((my_robot / "runs").rglob("metrics.jsonl")).read_text().splitlines()
    assert len([line for line in metrics if '"train/' in line or '"losses/' in line]) >= 2  # it trained


@pytest.fixture()
def composed(my_robot, monkeypatch):
    monkeypatch.syspath_prepend(str(my_robot))
    register_configs()

    def make(*overrides: str):
        with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
            cfg = compose(
                "config",
                [
                    f"hydra.searchpath=[file://{my_robot / 'conf'}]",
                    "env=reacher",
                    "policy=mlp",
                    "hw=laptop",
                    *overrides,
                ],
            )
        validate(cfg)
        return cfg

    return make


def test_fields_come_from_the_constructor(composed):
    cfg = composed("env.max_episode_steps=30")
    assert cfg.env.goal_radius == 0.05 and cfg.env.max_episode_steps == 30 and cfg.policy.chunk == 5
    assert cfg.policy.hidden == 64  # the constructor's default
    assert cfg.hw.cpu_cores == 2


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "+env.goal_raduis=0.1",
            "env.goal_raduis is not a field of env reacher_env.ReacherEnv: its constructor takes "
            "task, max_episode_steps, goal_radius;",
        ),
        ("env.goal_radius=abc", "env: Value 'abc' of type 'str' could not be converted to Float"),
        (
            "env.cameras=[agentview]",
            "env.cameras=['agentview'] has no effect: reacher_env.ReacherEnv's constructor takes no cameras",
        ),
        ("env._target_=bad.NeedsArm", "env.arm is not set; bad.NeedsArm needs it (no default in its constructor)"),
        ("policy.train=lora", "policy._target_='mlp_policy.MLPPolicy' does not implement rl_heads, which the runtime"),
        ("env._target_=bad.NoStep", "env._target_='bad.NoStep' does not implement step: an adapter implements"),
        (
            "policy._target_=bad.NoEvaluate",
            "policy._target_='bad.NoEvaluate' does not implement evaluate, which the runtime calls",
        ),
        ("policy._target_=bad.Nothing", "policy._target_='bad.Nothing' cannot be imported (AttributeError"),
    ],
)
def test_a_field_or_class_that_breaks_the_contract_is_one_line(composed, override, line):
    with pytest.raises((ConfigError, TypeError)) as info:
        composed(override)
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_an_adapter_that_sets_no_spec_is_one_line(my_robot, monkeypatch):
    monkeypatch.syspath_prepend(str(my_robot))
    with pytest.raises(EnvSetupError, match=r"^env._target_='bad.NoSpec' set no self.spec \(an ebrl.envs.base.Env"):
        build_adapter({"_target_": "bad.NoSpec"}, seed=0)


def test_a_step_or_reset_that_breaks_the_contract_stops_at_once_in_a_real_worker(my_robot, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(my_robot))
    cfg = {"_target_": "bad.FourValues", "name": "reacher", "task": "Reacher-v5", "max_episode_steps": 50}
    worker = SimWorker(cfg, seed=0, execute=4)
    try:
        worker.start()
        worker.reset()
        worker.actions[:4] = np.zeros((4, 2), np.float32)
        worker.submit(4)
        with pytest.raises(AdapterContractError, match=r"^FourValues.step returned 4 values \(dict, float, bool, "):
            worker.wait(60)  # not a SimFailure: no fresh simulator would do better
    finally:
        worker.close()
    worker = SimWorker({**cfg, "_target_": "bad.GymReset"}, seed=0, execute=4)
    try:
        worker.start()
        with pytest.raises(AdapterContractError, match=r"^GymReset.reset returned 2 values \(dict, dict\), not the"):
            worker.reset()
    finally:
        worker.close()
