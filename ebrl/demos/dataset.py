"""Demonstrations in robomimic's HDF5 layout, the one robosuite's and LIBERO's datasets come in
(docs/internals/design.md, "Demonstrations, SFT, RL").

    data                 attrs: total (steps), env_args (JSON: env_name, env_kwargs), problem_info (JSON:
                         language_instruction, as LIBERO writes it), ebrl (JSON: how the file was recorded)
    data/demo_<i>        attrs: num_samples, seed (the reset seed that replays it), success
        actions          (T, action_dim) float32
        rewards, dones   (T,)
        obs/<key>        (T, ...): our recorder writes `state` (the adapter's state vector) and `<camera>_image`
    mask/train, mask/valid   the demo names of each split (bytes)

The recorder's default over LeRobot's parquet layout (lerobot.py, read and written too) because its episodes are
whole arrays per demo (a sample is a slice, no decoding), images stay uint8 without a video codec, and h5py is the
only dependency; the robosuite and LIBERO files users hold read as they are, their state assembled from the obs
datasets `demos.state_keys` names. `read_demos` reads either format, or a folder of both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ebrl.demos.episodes import Demos, DemosError, DemoSet, Episode, episode_obs, held_out, statistics

__all__ = ["Demos", "DemosError", "Episode", "demo_sources", "read_demos", "statistics", "write_demos"]

STATE_KEYS = ("state",)  # the state our recorder writes


def _names(group: Any) -> list[str]:
    """A group's demo names in their numeric order (demo_2 before demo_10)."""
    return sorted(group, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def write_demos(
    path: str | Path,
    episodes: Sequence[Episode],
    instruction: str,
    env_args: dict[str, Any],
    valid: Sequence[int] = (),
    info: dict[str, Any] | None = None,
) -> Path:
    """Write `episodes` to the .hdf5 file `path`; the episodes at indices `valid` form mask/valid."""
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    held = set(valid)
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["total"] = sum(len(e) for e in episodes)
        data.attrs["env_args"] = json.dumps(env_args)
        data.attrs["problem_info"] = json.dumps({"language_instruction": instruction})
        data.attrs["ebrl"] = json.dumps(info or {})
        for i, e in enumerate(episodes):
            demo = data.create_group(f"demo_{i}")
            demo.attrs["num_samples"] = len(e)
            demo.attrs["success"] = bool(e.success)
            if e.seed is not None:
                demo.attrs["seed"] = int(e.seed)
            demo.create_dataset("actions", data=np.asarray(e.actions, np.float32))
            demo.create_dataset("rewards", data=np.asarray(e.rewards, np.float32))
            dones = np.zeros(len(e), np.int64)
            dones[-1] = 1
            demo.create_dataset("dones", data=dones)
            for key, value in e.obs.items():
                name = f"{key[len('image/') :]}_image" if key.startswith("image/") else key
                demo.create_dataset(f"obs/{name}", data=value, compression="gzip" if value.dtype == np.uint8 else None)
        mask = f.create_group("mask")
        mask.create_dataset("train", data=np.array([f"demo_{i}" for i in range(len(episodes)) if i not in held], "S"))
        mask.create_dataset("valid", data=np.array([f"demo_{i}" for i in sorted(held)], "S"))
    return path


def demo_sources(path: str | Path) -> list[Path]:
    """What `demos.path` names: an .hdf5 file, a LeRobot dataset folder (meta/info.json), or a folder holding either
    below it (a LeRobot dataset's folder reads as that dataset alone)."""
    from ebrl.demos.lerobot import is_lerobot_dataset

    p = Path(path).expanduser()
    if not p.exists():
        raise DemosError(
            f"demos.path={path} does not exist; give an .hdf5 file, a LeRobot dataset folder or a folder "
            "of them (python -m ebrl.demos record writes either)"
        )
    if p.is_file() or is_lerobot_dataset(p):
        return [p]
    roots = sorted(q.parent.parent for q in p.rglob("info.json") if is_lerobot_dataset(q.parent.parent))
    files = [q for q in p.rglob("*") if q.suffix in (".hdf5", ".h5") and not any(r in q.parents for r in roots)]
    if not roots and not files:
        raise DemosError(
            f"demos.path={path} is neither a LeRobot dataset (meta/info.json) nor holds .hdf5 files or "
            "LeRobot datasets; record some with python -m ebrl.demos record"
        )
    return sorted(roots + files)


def _obs_key(demo: Any, key: str, file: Path, what: str) -> np.ndarray:
    if key not in demo["obs"]:
        raise DemosError(f"demos: {file} has no obs/{key} ({what}); its obs are: {', '.join(sorted(demo['obs']))}")
    return np.asarray(demo["obs"][key])


def _read_file(
    file: Path, state_keys: Sequence[str] | None, image_keys: dict[str, str], cameras: Sequence[str]
) -> DemoSet:
    """The episodes of one robomimic file, their state from `state_keys` (None: `state`, what our recorder writes)."""
    import h5py

    state_keys = list(STATE_KEYS if state_keys is None else state_keys)
    try:
        f = h5py.File(file, "r")
    except OSError as e:
        raise DemosError(f"demos: {file} is not an HDF5 file ({' '.join(str(e).split())})") from None
    with f:
        if "data" not in f or not any(n.startswith("demo") for n in f["data"]):
            raise DemosError(f"demos: {file} is not in robomimic's layout (a data group of demo_<i> groups)")
        data = f["data"]
        attrs = dict(data.attrs)
        info = json.loads(attrs["ebrl"]) if "ebrl" in attrs else {}
        problem = json.loads(attrs["problem_info"]) if "problem_info" in attrs else {}
        info["instruction"] = problem.get("language_instruction")
        names = [n for n in _names(data) if n.startswith("demo")]
        episodes = []
        for name in names:
            demo = data[name]
            actions = np.asarray(demo["actions"], np.float32)
            obs = episode_obs(
                lambda key, what: _obs_key(demo, key, file, what),
                len(actions),
                state_keys,
                image_keys,
                cameras,
                lambda cam: f"{cam}_image",
            )
            rewards = np.asarray(demo["rewards"], np.float32) if "rewards" in demo else np.zeros(len(actions))
            seed = int(demo.attrs["seed"]) if "seed" in demo.attrs else None
            episodes.append(
                Episode(obs, actions, rewards, bool(demo.attrs.get("success", True)), seed, info["instruction"])
            )
        held = None
        if "mask" in f and "valid" in f["mask"]:
            held = {n.decode() if isinstance(n, bytes) else str(n) for n in np.asarray(f["mask"]["valid"])}
    return DemoSet(episodes, names, held, info)


def read_demos(
    path: str | Path,
    state_keys: Sequence[str] | None = None,
    image_keys: dict[str, str] | None = None,
    cameras: Sequence[str] = (),
    valid_share: float = 0.2,
) -> Demos:
    """Every episode under `path`, with `cameras`' images; the state is `state_keys` side by side (None: the format's
    own, `state` in HDF5, `observation.state` in LeRobot's). Held out: a file's mask/valid (a LeRobot dataset's
    `valid` split), else the last `valid_share` of its episodes (at least one where the share is above 0 and it has
    two or more)."""
    from ebrl.demos.lerobot import is_lerobot_dataset, read_lerobot

    episodes: list[Episode] = []
    train: list[int] = []
    valid: list[int] = []
    sources = demo_sources(path)
    instruction, first = None, {}
    for source in sources:
        read = read_lerobot if is_lerobot_dataset(source) else _read_file
        found = read(source, state_keys, dict(image_keys or {}), list(cameras))
        held = found.held
        if held is None:
            k = held_out(valid_share, len(found.names))
            held = set(found.names[len(found.names) - k :]) if k else set()
        for name, episode in zip(found.names, found.episodes):
            (valid if name in held else train).append(len(episodes))
            episodes.append(episode)
        instruction = instruction or found.info.get("instruction")
        first = first or found.info
    dims = {e.obs["state"].shape[1] for e in episodes}
    if len(dims) > 1:
        raise DemosError(f"demos.path={path}: its files' states differ in size ({sorted(dims)}); give files of one env")
    return Demos(episodes, train, valid, [str(f) for f in sources], instruction, first)
