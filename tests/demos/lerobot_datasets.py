"""The LeRobot side of tests/demos/test_lerobot.py: runs under lerobot's own interpreter, never imported by ours.
lerobot 0.4.4 (`python -m ebrl.envs.setup lerobot`) writes codebase v3.0, lerobot 0.3.3 (`python -m ebrl.envs.setup
lerobot-v21`) v2.1.

    python lerobot_datasets.py <job.json>

job.json: {"inputs": <.npz>, "fps": <int>, "tasks": [a task per episode], "out": <.npz>,
           "write": [{"root": <folder>, "images": <npz prefix>, "dtype": "image" | "video", "vcodec": <codec>,
                      optional "file_mb" and "chunks_size": lerobot's data and video file size limits}],
           "read": [<folder>]}
Each `write` is a dataset of the npz's episodes (state_<i>, action_<i>, reward_<i>, <images>_<i>) made by
`LeRobotDataset.create`, `add_frame`, `save_episode` (and `finalize`, 0.4); its camera is observation.images.front.
Each `read` is a dataset read through `LeRobotDataset(root=...)`, every frame, saved into `out` as
read<k>_<state|action|image|episode> (images as lerobot gives them: float32 CHW in [0, 1]) and read<k>_task.
"""

from __future__ import annotations

import json
import sys

import torch

for _op in ("nms", "qnms"):  # (PyPI's torchvision links CUDA; its C ops do not load on a CPU torch, none is called)
    torch.library.define(f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

import numpy as np  # noqa: E402
from lerobot.datasets.lerobot_dataset import CODEBASE_VERSION, LeRobotDataset  # noqa: E402

CAMERA = "observation.images.front"


def write(spec: dict, inputs: dict, tasks: list[str], fps: int) -> None:
    first = inputs[f"{spec['images']}_0"]
    features = {
        "observation.state": {"dtype": "float32", "shape": (inputs["state_0"].shape[1],), "names": None},
        "action": {"dtype": "float32", "shape": (inputs["action_0"].shape[1],), "names": None},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
        CAMERA: {"dtype": spec["dtype"], "shape": first.shape[1:], "names": ["height", "width", "channel"]},
    }
    options = {} if CODEBASE_VERSION == "v2.1" else {"vcodec": spec["vcodec"]}  # (0.3 encodes libsvtav1 only)
    if "file_mb" in spec:
        options["metadata_buffer_size"] = 1  # (each episode's meta written at once, so that its file can roll too)
    ds = LeRobotDataset.create("ebrl/test", fps=fps, features=features, root=spec["root"], use_videos=True, **options)
    if "file_mb" in spec:  # (0.4) files this small hold an episode each, and chunks_size files a chunk folder
        ds.meta.update_chunk_settings(
            chunks_size=spec["chunks_size"],
            data_files_size_in_mb=spec["file_mb"],
            video_files_size_in_mb=spec["file_mb"],
        )
    for i, task in enumerate(tasks):
        for t in range(len(inputs[f"state_{i}"])):
            frame = {
                "observation.state": inputs[f"state_{i}"][t],
                "action": inputs[f"action_{i}"][t],
                "next.reward": inputs[f"reward_{i}"][t : t + 1],
                CAMERA: inputs[f"{spec['images']}_{i}"][t],
            }
            if CODEBASE_VERSION == "v2.1":
                ds.add_frame(frame, task=task)
            else:
                ds.add_frame({**frame, "task": task})
        ds.save_episode()
    if hasattr(ds, "finalize"):
        ds.finalize()


def read(root: str, k: int, out: dict) -> None:
    ds = LeRobotDataset("ebrl/test", root=root)
    items = [ds[i] for i in range(len(ds))]
    out[f"read{k}_state"] = np.stack([x["observation.state"].numpy() for x in items])
    out[f"read{k}_action"] = np.stack([x["action"].numpy() for x in items])
    out[f"read{k}_episode"] = np.array([int(x["episode_index"]) for x in items])
    out[f"read{k}_task"] = np.array([x["task"] for x in items])
    cameras = ds.meta.camera_keys
    out[f"read{k}_image"] = np.stack([items_[cameras[0]].numpy() for items_ in items]) if cameras else np.zeros(0)


def main(job_file: str) -> None:
    job = json.loads(open(job_file).read())
    inputs = dict(np.load(job["inputs"]))
    for spec in job["write"]:
        write(spec, inputs, job["tasks"], job["fps"])
    out: dict = {}
    for k, root in enumerate(job["read"]):
        read(root, k, out)
    np.savez(job["out"], **out)
    print(f"lerobot {CODEBASE_VERSION}: wrote {len(job['write'])}, read {len(job['read'])}")


if __name__ == "__main__":
    main(sys.argv[1])
