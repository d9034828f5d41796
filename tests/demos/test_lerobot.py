"""LeRobot datasets for SFT (ebrl/demos/lerobot.py): those lerobot's own `LeRobotDataset` writer makes read into the
very episodes written, ours read back through lerobot's reader, and the recorder's format=lerobot gives the episodes
its HDF5 does.

The v3.0 datasets are written by lerobot 0.4.4 (`python -m ebrl.envs.setup lerobot`), the v2.1 ones by lerobot 0.3.3,
the last release that writes v2.1 (`python -m ebrl.envs.setup lerobot-v21`): lerobot_datasets.py runs under each, once
per module (v2.1's and the recorder's runs are marked slow). States, actions, rewards and images stored in the parquet
(PNG) must come back bit for bit; video frames within a mean absolute error of VIDEO_MAE grey levels of what was
written, for AV1 (libsvtav1, lerobot's default codec, at its crf 30, decoded by dav1d) and h264 (measured here: 1.3
and 1.9 at most): the images are smooth gradients whose level steps by FRAME_STEP a frame, so a frame read from the
wrong time is off by more. SVT-AV1 does not encode frames under 32 pixels (it dies of SIGFPE), so its datasets are
32x32.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from ebrl.demos.dataset import read_demos, write_demos
from ebrl.demos.episodes import Demos, DemosError, Episode
from ebrl.demos.lerobot import write_lerobot
from ebrl.demos.record import record
from ebrl.envs.setup import SETUP_COMMAND, benchmark_python
from tests.conftest import CONF

SCRIPT = Path(__file__).with_name("lerobot_datasets.py")
LENGTHS = (10, 11, 12)
TASKS = ["lift the cube", "stack the cube", "lift the cube"]
FPS = 10
FRAME_STEP = 6  # grey levels between consecutive frames
VIDEO_MAE = 3.0  # mean absolute error, grey levels, of a decoded frame against the one written
KEYS = dict(
    state_keys=["observation.state"], image_keys={"agentview": "observation.images.front"}, cameras=["agentview"]
)


def gradient(size: int, frame: int, episode: int) -> np.ndarray:
    """A smooth (size, size, 3) uint8 image whose level rises by FRAME_STEP a frame."""
    y, x = np.mgrid[0:size, 0:size] * (32 // size)
    level = 20 + x + y // 2 + FRAME_STEP * frame + 4 * episode
    return np.stack([level, level + 30, level + 60], axis=-1).clip(0, 255).astype(np.uint8)


def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i, n in enumerate(LENGTHS):
        out[f"state_{i}"] = rng.normal(size=(n, 6)).astype(np.float32)
        out[f"action_{i}"] = rng.uniform(-1, 1, (n, 7)).astype(np.float32)
        out[f"reward_{i}"] = rng.uniform(0, 1, n).astype(np.float32)
        for size in (16, 32):
            out[f"image{size}_{i}"] = np.stack([gradient(size, t, i) for t in range(n)])
    return out


def lerobot_job(name: str, folder: Path, write: list[dict], read: list[str]) -> dict[str, np.ndarray]:
    """Run lerobot_datasets.py under the reference interpreter `name` (skipping where it is not set up)."""
    python = benchmark_python(name)
    if python is None:
        pytest.skip(f"no {name} interpreter: {SETUP_COMMAND.format(name=name)}")
    np.savez(folder / "inputs.npz", **inputs())
    job = {
        "inputs": str(folder / "inputs.npz"),
        "fps": FPS,
        "tasks": TASKS,
        "out": str(folder / "read.npz"),
        "write": [{**w, "root": str(folder / w["root"])} for w in write],
        "read": read,
    }
    (folder / "job.json").write_text(json.dumps(job))
    done = subprocess.run(
        [str(python), str(SCRIPT), str(folder / "job.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(folder / "read.npz"))


def our_episodes() -> list[Episode]:
    data = inputs()
    return [
        Episode(
            {"state": data[f"state_{i}"], "image/agentview": data[f"image16_{i}"]},
            data[f"action_{i}"],
            data[f"reward_{i}"],
            True,
            100 + i,
            TASKS[i],
        )
        for i in range(len(LENGTHS))
    ]


@pytest.fixture(scope="module")
def v30(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """lerobot 0.4.4's datasets (images in the parquet, AV1 and h264 video) and what its reader makes of ours."""
    folder = tmp_path_factory.mktemp("lerobot_v30")
    write_lerobot(folder / "ours", our_episodes(), "lift the cube", FPS, valid=1, info={"expert": "test"})
    read = lerobot_job(
        "lerobot",
        folder,
        [
            {"root": "image", "images": "image16", "dtype": "image", "vcodec": "libsvtav1"},
            {"root": "av1", "images": "image32", "dtype": "video", "vcodec": "libsvtav1"},
            {"root": "h264", "images": "image16", "dtype": "video", "vcodec": "h264"},
            {
                "root": "files",
                "images": "image32",
                "dtype": "video",
                "vcodec": "libsvtav1",
                "file_mb": 1e-4,
                "chunks_size": 2,
            },
        ],
        [str(folder / "ours")],
    )
    return folder, read


@pytest.fixture(scope="module")
def v21(tmp_path_factory) -> Path:
    """lerobot 0.3.3's datasets: images in the parquet and AV1 video."""
    folder = tmp_path_factory.mktemp("lerobot_v21")
    lerobot_job(
        "lerobot-v21",
        folder,
        [
            {"root": "image", "images": "image16", "dtype": "image", "vcodec": "libsvtav1"},
            {"root": "av1", "images": "image32", "dtype": "video", "vcodec": "libsvtav1"},
        ],
        [],
    )
    return folder


def assert_written(root: Path, images: str, exact: bool) -> None:
    """The dataset at `root` reads into the episodes lerobot_datasets.py wrote from inputs()."""
    demos = read_demos(root, valid_share=0.2, **KEYS)
    data = inputs()
    assert [len(e) for e in demos.episodes] == list(LENGTHS)
    assert (demos.train, demos.valid) == ([0, 1], [2])  # the last 0.2 of 3 episodes: one
    assert [e.instruction for e in demos.episodes] == TASKS and demos.instruction == TASKS[0]
    for i, e in enumerate(demos.episodes):
        assert e.obs["state"].dtype == np.float32 and e.actions.dtype == np.float32
        np.testing.assert_array_equal(e.obs["state"], data[f"state_{i}"])
        np.testing.assert_array_equal(e.actions, data[f"action_{i}"])
        np.testing.assert_array_equal(e.rewards, data[f"reward_{i}"])
        frames, written = e.obs["image/agentview"], data[f"{images}_{i}"]
        assert frames.dtype == np.uint8 and frames.shape == written.shape
        if exact:
            np.testing.assert_array_equal(frames, written)
        else:
            error = np.abs(frames.astype(float) - written).mean(axis=(1, 2, 3))
            assert error.max() < VIDEO_MAE < FRAME_STEP, error


def test_lerobot_v30_images_in_the_parquet_read_bit_for_bit(v30):
    assert_written(v30[0] / "image", "image16", exact=True)


@pytest.mark.parametrize("codec,images", [("av1", "image32"), ("h264", "image16")])
def test_lerobot_v30_video_frames_read_within_the_codecs_error(v30, codec, images):
    assert_written(v30[0] / codec, images, exact=False)


def test_lerobot_v30_episodes_across_files_and_chunks(v30):
    root = v30[0] / "files"
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("data/*/*.parquet")) == [
        "data/chunk-000/file-000.parquet",
        "data/chunk-000/file-001.parquet",
        "data/chunk-001/file-000.parquet",
    ]
    assert len(list(root.glob("videos/*/chunk-001/*.mp4"))) == 1 and len(list(root.glob("meta/episodes/*/*"))) > 1
    assert_written(root, "image32", exact=False)


@pytest.mark.slow  # (a second lerobot interpreter, 3 s)
def test_lerobot_v21_reads_like_v30(v21):
    assert_written(v21 / "image", "image16", exact=True)
    assert_written(v21 / "av1", "image32", exact=False)


def test_our_writer_reads_back_through_ours_and_lerobots(v30):
    folder, read = v30
    written = our_episodes()
    demos = read_demos(folder / "ours", cameras=["agentview"])  # (the default keys: observation.*)
    assert (demos.train, demos.valid) == ([0, 1], [2])  # its valid split
    assert demos.info == {"expert": "test", "instruction": "lift the cube"}
    for a, b in zip(written, demos.episodes):
        for key in ("state", "image/agentview"):
            np.testing.assert_array_equal(a.obs[key], b.obs[key])
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.rewards, b.rewards)
        assert (b.seed, b.success, b.instruction) == (a.seed, a.success, a.instruction)
    # lerobot's LeRobotDataset: every frame, in order, with its task; its images float CHW in [0, 1]
    np.testing.assert_array_equal(read["read0_episode"], np.repeat(np.arange(3), LENGTHS))
    np.testing.assert_array_equal(read["read0_state"], np.concatenate([e.obs["state"] for e in written]))
    np.testing.assert_array_equal(read["read0_action"], np.concatenate([e.actions for e in written]))
    images = np.concatenate([e.obs["image/agentview"] for e in written]).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(np.round(read["read0_image"] * 255).astype(np.uint8), images)
    assert list(read["read0_task"]) == [t for t, n in zip(TASKS, LENGTHS) for _ in range(n)]


def test_a_missing_video_is_one_line(v30, tmp_path):
    shutil.copytree(v30[0] / "av1", tmp_path / "av1")
    (tmp_path / "av1" / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4").unlink()
    with pytest.raises(
        DemosError,
        match=r"av1 is missing the video videos/observation.images.front/chunk-000/"
        r"file-000.mp4$",
    ):
        read_demos(tmp_path / "av1", **KEYS)


def test_bad_input_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DemosError, match=r"is neither a LeRobot dataset \(meta/info.json\) nor holds .hdf5 files"):
        read_demos(tmp_path / "empty")
    root = write_lerobot(tmp_path / "ours", our_episodes(), "lift the cube", FPS)
    with pytest.raises(
        DemosError,
        match=r"has no feature state \(demos.state_keys\); its features are: action, "
        r"episode_index, frame_index, index, next.done, next.reward, next.success, "
        r"observation.images.agentview, observation.state, task_index, timestamp$",
    ):
        read_demos(root, state_keys=["state"])
    with pytest.raises(DemosError, match=r"has no feature observation.images.wrist \(env camera wrist; "):
        read_demos(root, cameras=["wrist"])
    info = json.loads((root / "meta" / "info.json").read_text())
    (root / "meta" / "info.json").write_text(json.dumps({**info, "codebase_version": "v2.0"}))
    with pytest.raises(
        DemosError,
        match=r"is a LeRobot dataset of codebase_version 'v2.0'; this reader reads v2.1 "
        r"and v3.0",
    ):
        read_demos(root)


def test_both_writers_give_the_same_demos(tmp_path):
    episodes = [Episode(e.obs, e.actions, e.rewards, e.success, e.seed) for e in our_episodes()]
    lerobot = read_demos(
        write_lerobot(tmp_path / "lerobot", episodes, "lift the cube", FPS, valid=1), cameras=["agentview"]
    )
    hdf5 = read_demos(write_demos(tmp_path / "demo.hdf5", episodes, "lift the cube", {}, [2]), cameras=["agentview"])
    assert_same(hdf5, lerobot)


def assert_same(a: Demos, b: Demos) -> None:
    """Demos read from two formats hold the same episodes, split and record."""
    assert (a.train, a.valid, a.instruction, a.info) == (b.train, b.valid, b.instruction, b.info)
    for x, y in zip(a.episodes, b.episodes, strict=True):
        assert x.obs.keys() == y.obs.keys()
        for key in x.obs:
            np.testing.assert_array_equal(x.obs[key], y.obs[key])
        np.testing.assert_array_equal(x.actions, y.actions)
        np.testing.assert_array_equal(x.rewards, y.rewards)
        assert (x.seed, x.success, x.instruction) == (y.seed, y.success, y.instruction)


@pytest.mark.slow  # (two recordings in robosuite, 3 s)
def test_record_format_lerobot_gives_the_hdf5_episodes(tmp_path):
    demos = {}
    for fmt in ("hdf5", "lerobot"):
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            cfg = compose(
                "record", overrides=["episodes=2", f"out={tmp_path / fmt}", "progress=false", f"format={fmt}"]
            )
        demos[fmt] = read_demos(record(cfg))
    assert_same(demos["hdf5"], demos["lerobot"])
    assert demos["lerobot"].valid == [1]  # valid=0.2 of 2: the recorder's valid split
