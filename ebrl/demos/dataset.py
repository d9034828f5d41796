"""Demonstrations in robomimic's HDF5 layout, the one robosuite's and LIBERO's datasets come in (docs/design.md,
"Demonstrations, SFT, RL").

    data                 attrs: total (steps), env_args (JSON: env_name, env_kwargs), problem_info (JSON:
                         language_instruction, as LIBERO writes it), ebrl (JSON: how the file was recorded)
    data/demo_<i>        attrs: num_samples, seed (the reset seed that replays it), success
        actions          (T, action_dim) float32
        rewards, dones   (T,)
        obs/<key>        (T, ...): our recorder writes `state` (the adapter's state vector) and `<camera>_image`
    mask/train, mask/valid   the demo names of each split (bytes)

Chosen over LeRobot's parquet layout because its episodes are whole arrays per demo (a sample is a slice, no
decoding), images stay uint8 without a video codec, and h5py is the only dependency; the robosuite and LIBERO files
users hold read as they are, their state assembled from the obs datasets `demos.state_keys` names.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ebrl.errors import BadInput


class DemosError(BadInput, ValueError):
    """A demonstration file or folder that cannot be read as asked; the message is one line."""


@dataclass
class Episode:
    """One demonstration: the observation before each action, the actions, the rewards."""

    obs: dict[str, np.ndarray]  # "state" (T, D) float32; "image/<camera>" (T, H, W, 3) uint8
    actions: np.ndarray  # (T, action_dim) float32
    rewards: np.ndarray  # (T,) float32
    success: bool = True
    seed: int | None = None  # the reset seed that replays it (recorded episodes)

    def __len__(self) -> int:
        return len(self.actions)


@dataclass
class Demos:
    """The episodes of one or more files, split into training and held-out episodes (indices into `episodes`)."""

    episodes: list[Episode]
    train: list[int]
    valid: list[int]
    files: list[str]
    instruction: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # the first file's `ebrl` record, where it has one

    @property
    def steps(self) -> int:
        return sum(len(e) for e in self.episodes)


def _names(group: Any) -> list[str]:
    """A group's demo names in their numeric order (demo_2 before demo_10)."""
    return sorted(group, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def held_out(share: float, episodes: int) -> int:
    """How many of a file's `episodes` a held-out `share` keeps back: at least one where the share is above 0 and
    there are two or more."""
    return max(1, round(share * episodes)) if share > 0 and episodes > 1 else 0


def write_demos(path: str | Path, episodes: Sequence[Episode], instruction: str, env_args: dict[str, Any],
                valid: Sequence[int] = (), info: dict[str, Any] | None = None) -> Path:
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
                name = f"{key[len('image/'):]}_image" if key.startswith("image/") else key
                demo.create_dataset(f"obs/{name}", data=value, compression="gzip" if value.dtype == np.uint8 else None)
        mask = f.create_group("mask")
        mask.create_dataset("train", data=np.array([f"demo_{i}" for i in range(len(episodes)) if i not in held], "S"))
        mask.create_dataset("valid", data=np.array([f"demo_{i}" for i in sorted(held)], "S"))
    return path


def demo_files(path: str | Path) -> list[Path]:
    """The .hdf5 files `demos.path` names: the file itself, or those in the folder and its subfolders."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DemosError(f"demos.path={path} does not exist; give an .hdf5 file or a folder of them "
                         "(python -m ebrl.demos record writes one)")
    files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.suffix in (".hdf5", ".h5"))
    if not files:
        raise DemosError(f"demos.path={path} holds no .hdf5 files; record some with python -m ebrl.demos record")
    return files


def _obs_key(demo: Any, key: str, file: Path, what: str) -> np.ndarray:
    if key not in demo["obs"]:
        raise DemosError(f"demos: {file} has no obs/{key} ({what}); its obs are: {', '.join(sorted(demo['obs']))}")
    return np.asarray(demo["obs"][key])


def _read_file(file: Path, state_keys: Sequence[str], image_keys: dict[str, str], cameras: Sequence[str]
               ) -> tuple[list[Episode], list[str], set[str] | None, dict[str, Any]]:
    import h5py

    try:
        f = h5py.File(file, "r")
    except OSError as e:
        raise DemosError(f"demos: {file} is not an HDF5 file ({' '.join(str(e).split())})") from None
    with f:
        if "data" not in f or not any(n.startswith("demo") for n in f["data"]):
            raise DemosError(f"demos: {file} is not in robomimic's layout (a data group of demo_<i> groups)")
        data = f["data"]
        names = [n for n in _names(data) if n.startswith("demo")]
        episodes = []
        for name in names:
            demo = data[name]
            actions = np.asarray(demo["actions"], np.float32)
            parts = [_obs_key(demo, k, file, "demos.state_keys").reshape(len(actions), -1) for k in state_keys]
            obs = {"state": np.concatenate(parts, axis=1).astype(np.float32)}
            for cam in cameras:
                key = image_keys.get(cam, f"{cam}_image")
                obs[f"image/{cam}"] = _obs_key(demo, key, file, f"env camera {cam}; demos.image_keys maps cameras "
                                                                 "to datasets").astype(np.uint8)
            rewards = np.asarray(demo["rewards"], np.float32) if "rewards" in demo else np.zeros(len(actions))
            seed = int(demo.attrs["seed"]) if "seed" in demo.attrs else None
            episodes.append(Episode(obs, actions, rewards, bool(demo.attrs.get("success", True)), seed))
        held = None
        if "mask" in f and "valid" in f["mask"]:
            held = {n.decode() if isinstance(n, bytes) else str(n) for n in np.asarray(f["mask"]["valid"])}
        attrs = dict(data.attrs)
        info = json.loads(attrs["ebrl"]) if "ebrl" in attrs else {}
        problem = json.loads(attrs["problem_info"]) if "problem_info" in attrs else {}
        info["instruction"] = problem.get("language_instruction")
    return episodes, names, held, info


def read_demos(path: str | Path, state_keys: Sequence[str] = ("state",), image_keys: dict[str, str] | None = None,
               cameras: Sequence[str] = (), valid_share: float = 0.2) -> Demos:
    """Every episode under `path`, with `cameras`' images; held out: a file's mask/valid, else the last
    `valid_share` of its episodes (at least one where the share is above 0 and the file has two or more)."""
    episodes: list[Episode] = []
    train: list[int] = []
    valid: list[int] = []
    files = demo_files(path)
    instruction, first = None, {}
    for file in files:
        found, names, held, info = _read_file(file, list(state_keys), dict(image_keys or {}), list(cameras))
        if held is None:
            k = held_out(valid_share, len(found))
            held = set(names[len(names) - k:]) if k else set()
        for name, episode in zip(names, found):
            (valid if name in held else train).append(len(episodes))
            episodes.append(episode)
        instruction = instruction or info.get("instruction")
        first = first or info
    dims = {e.obs["state"].shape[1] for e in episodes}
    if len(dims) > 1:
        raise DemosError(f"demos.path={path}: its files' states differ in size ({sorted(dims)}); give files of one env")
    return Demos(episodes, train, valid, [str(f) for f in files], instruction, first)


def _stats(x: np.ndarray) -> dict[str, list[float]]:
    return {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(),
            "q01": np.quantile(x, 0.01, axis=0).tolist(), "q99": np.quantile(x, 0.99, axis=0).tolist()}


def statistics(demos: Demos, episodes: Sequence[int]) -> dict[str, Any]:
    """The state's and actions' statistics over `episodes`, in openpi's norm_stats.json layout."""
    state = np.concatenate([demos.episodes[i].obs["state"] for i in episodes])
    actions = np.concatenate([demos.episodes[i].actions for i in episodes])
    return {"norm_stats": {"state": _stats(state), "actions": _stats(actions)}}
