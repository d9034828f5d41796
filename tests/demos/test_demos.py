"""The recorder's episodes replay to success from their seeds, the command works as a user types it, and a user's
own robomimic file is read by the same reader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from ebrl.demos.dataset import DemosError, read_demos
from ebrl.demos.record import record
from ebrl.envs.process import build_adapter
from tests.conftest import CONF, REPO

TASKS = [
    ("robosuite", "Lift", "LiftExpert", ()),
    ("robosuite", "Stack", "StackExpert", ("env.max_episode_steps=120",)),  # the expert takes 52-88 steps
    ("maniskill", "PickCube-v1", "PickCubeExpert", ()),
    ("maniskill", "PushCube-v1", "PushCubeExpert", ()),
]


@pytest.mark.parametrize("env,task,expert,extra", TASKS, ids=[t for _, t, _, _ in TASKS])
def test_recorded_episodes_replay_to_success(env, task, expert, extra, tmp_path):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(
            "record",
            overrides=[f"env={env}", f"env.task={task}", "episodes=2", f"out={tmp_path}", "progress=false", *extra],
        )
    path = record(cfg)
    demos = read_demos(path, valid_share=0.0)
    assert [len(demos.train), len(demos.valid)] == [1, 1]  # valid=0.2 of 2 rounds to one held out, as mask/valid
    assert demos.info["expert"] == expert
    adapter = build_adapter(demos.info["env"], demos.info["build_seed"])
    try:
        assert demos.instruction == adapter.spec.instruction
        for episode in demos.episodes:
            assert episode.success and episode.obs["state"].dtype == np.float32
            obs = adapter.begin_episode(episode.seed)
            np.testing.assert_allclose(obs["state"], episode.obs["state"][0], atol=1e-5)
            for action in episode.actions:
                obs, _, _, _, info = adapter.step(action)
            assert info["success"], f"{task}: the replay of seed {episode.seed} did not end in success"
    finally:
        adapter.close()


def run_demos(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ebrl.demos", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )


def test_the_command_as_a_user_types_it(tmp_path):
    done = run_demos("record", "env.task=Lift", "episodes=2", "progress=false", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "demos" / "robosuite-Lift" / "demo.hdf5").is_file()  # the default out
    assert "recorded 2 episodes of the LiftExpert" in done.stderr  # (the console writes to stderr)
    bad = run_demos("record", "env.task=Door", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: env=robosuite env.task=Door has no scripted expert; these have: env=robosuite env.task=Lift, "
        "env=robosuite env.task=Stack, env=maniskill env.task=PickCube-v1, env=maniskill env.task=PushCube-v1"
    ]
    usage = run_demos(cwd=tmp_path)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: python -m ebrl.demos record env=")


def write_robomimic(path: Path, episodes: int) -> None:
    """A file as robosuite's and robomimic's datasets are: obs by observable, no mask, images upside down."""
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for i in range(episodes):
            demo = f.create_group(f"data/demo_{i}")
            steps = 5 + i
            demo.attrs["num_samples"] = steps
            demo.create_dataset("actions", data=rng.uniform(-1, 1, (steps, 7)))
            demo.create_dataset("obs/robot0_eef_pos", data=np.full((steps, 3), i, np.float64))
            demo.create_dataset("obs/object", data=rng.normal(size=(steps, 10)))
            demo.create_dataset("obs/agentview_image", data=rng.integers(0, 255, (steps, 8, 8, 3), np.uint8))


def test_a_users_own_robomimic_file_reads_by_its_keys(tmp_path):
    write_robomimic(tmp_path / "image.hdf5", 11)
    demos = read_demos(tmp_path, ["robot0_eef_pos", "object"], {"agentview": "agentview_image"}, ["agentview"], 0.2)
    assert [demos.episodes[i].obs["state"][0, 0] for i in demos.valid] == [9, 10]  # the last two, in numeric order
    assert len(demos.train) == 9 and demos.steps == sum(5 + i for i in range(11))
    e = demos.episodes[3]
    assert e.obs["state"].shape == (8, 13) and e.obs["image/agentview"].shape == (8, 8, 8, 3) and len(e) == 8
    with pytest.raises(
        DemosError,
        match=r"has no obs/state \(demos.state_keys\); its obs are: agentview_image, "
        r"object, robot0_eef_pos$",
    ):
        read_demos(tmp_path / "image.hdf5")
