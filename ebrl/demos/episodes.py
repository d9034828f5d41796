"""What every demonstration format reads into: `Episode`s of one file or dataset folder (`DemoSet`), gathered into
the `Demos` SFT trains on (docs/use/demos.md). The formats' readers (robomimic's HDF5 in dataset.py, LeRobot's layout
in lerobot.py) share the key mapping (`episode_obs`), the held-out rule (`held_out`) and the statistics here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

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
    instruction: str | None = None  # its task in words (a LeRobot dataset's episodes may each have their own)

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


@dataclass
class DemoSet:
    """What a reader gives for one file or dataset folder: its episodes in order, their names, the names it holds out
    itself (None: it has no split of its own) and how it was recorded (its `ebrl` record and instruction)."""

    episodes: list[Episode]
    names: list[str]
    held: set[str] | None
    info: dict[str, Any]


def held_out(share: float, episodes: int) -> int:
    """How many of a file's `episodes` a held-out `share` keeps back: at least one where the share is above 0 and
    there are two or more."""
    return max(1, round(share * episodes)) if share > 0 and episodes > 1 else 0


def episode_obs(
    read: Callable[[str, str], np.ndarray],
    steps: int,
    state_keys: Sequence[str],
    image_keys: dict[str, str],
    cameras: Sequence[str],
    image_key: Callable[[str], str],
) -> dict[str, Any]:
    """An episode's observations from the arrays its format holds: the state is the `state_keys` side by side
    (float32), each camera's images (uint8) the array `image_keys` maps it to, else the format's `image_key(camera)`.
    `read(key, what)` gives the array or raises the format's one line naming `what` asked for it."""
    parts = [read(k, "demos.state_keys").reshape(steps, -1) for k in state_keys]
    obs = {"state": np.concatenate(parts, axis=1).astype(np.float32)}
    for cam in cameras:
        obs[f"image/{cam}"] = read(
            image_keys.get(cam, image_key(cam)), f"env camera {cam}; demos.image_keys maps cameras to them"
        ).astype(np.uint8)
    return obs


def moments(x: np.ndarray, quantiles: Sequence[float] = (0.01, 0.99)) -> dict[str, list[float]]:
    """Per-dimension mean, std and quantiles (q01, q99, ...) of the rows of `x`, as lists."""
    out = {"mean": x.mean(0).tolist(), "std": x.std(0).tolist()}
    for q in quantiles:
        out[f"q{round(q * 100):02d}"] = np.quantile(x, q, axis=0).tolist()
    return out


def statistics(demos: Demos, episodes: Sequence[int], state_dims: Sequence[int] | None = None) -> dict[str, Any]:
    """The state's (the `state_dims` a policy reads, where it picks some) and actions' statistics over `episodes`, in
    openpi's norm_stats.json layout."""
    state = np.concatenate([demos.episodes[i].obs["state"] for i in episodes])
    if state_dims is not None:
        state = state[:, list(state_dims)]
    actions = np.concatenate([demos.episodes[i].actions for i in episodes])
    return {"norm_stats": {"state": moments(state), "actions": moments(actions)}}
