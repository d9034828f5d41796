"""Demonstrations in LeRobot's dataset layout (lerobot's `LeRobotDataset`): codebase versions v2.1 and v3.0 read into
our `Episode`s, v3.0 written by `python -m ebrl.demos record format=lerobot` (docs/use/demos.md).

    meta/info.json   codebase_version, fps, features ({key: {dtype, shape, names}}: float32 vectors, `image`, `video`),
                     data_path and video_path (format strings), chunks_size, splits ({"train": "0:N"})
    v3.0  meta/tasks.parquet                  task_index, the task (pandas' index column)
          meta/episodes/chunk-C/file-F.parquet  an episode a row: episode_index, tasks, length, data/chunk_index,
                                              data/file_index, dataset_from_index, dataset_to_index,
                                              videos/<key>/{chunk_index, file_index, from_timestamp, to_timestamp}
          data/chunk-C/file-F.parquet         the frames of many episodes
          videos/<key>/chunk-C/file-F.mp4     many episodes one after another, each from its from_timestamp
    v2.1  meta/tasks.jsonl, meta/episodes.jsonl ({episode_index, tasks, length})
          data/chunk-C/episode_E.parquet, videos/chunk-C/<key>/episode_E.mp4   one episode each, C = E // chunks_size
    a frame (a parquet row): its features, timestamp, frame_index, episode_index, index, task_index; an `image`
    feature is a struct {bytes: PNG, path}; a `video` feature's frame is the one at from_timestamp + timestamp.

The state is the `demos.state_keys` features side by side (default observation.state), the actions `action`, a
camera's images the feature `demos.image_keys` maps it to (default observation.images.<camera>), the instruction the
episode's task; rewards and success come from next.reward and next.success where the dataset has them.
pyarrow reads the parquet files; PyAV decodes the videos (AV1, lerobot's default codec, through dav1d; h264; hevc).
"""

from __future__ import annotations

import io
import json
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ebrl.demos.episodes import DemosError, DemoSet, Episode, episode_obs, moments

VERSIONS = ("v2.1", "v3.0")
STATE_KEYS = ("observation.state",)
ACTION = "action"
TOLERANCE_S = 1e-4  # lerobot's tolerance_s: a video frame further than this from a frame's timestamp is an error
CHUNKS_SIZE = 1000  # lerobot's defaults: files per chunk folder, MB per data file
DATA_FILE_MB = 100
STAT_QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # the quantiles lerobot 0.4 keeps in meta/stats.json


def is_lerobot_dataset(path: Path) -> bool:
    """A folder with meta/info.json: LeRobot's dataset layout."""
    return (path / "meta" / "info.json").is_file()


def camera_key(camera: str) -> str:
    """The feature an env camera's images are stored under (lerobot's naming)."""
    return f"observation.images.{camera}"


@dataclass
class _EpisodeEntry:
    """Where one episode's frames and video frames are."""

    index: int
    length: int
    data: Path
    videos: dict[str, tuple[Path, float]] = field(default_factory=dict)  # feature -> (mp4, from_timestamp)
    seed: int | None = None


def _load_json(path: Path, root: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DemosError(
            f"demos: {root} is not a readable LeRobot dataset: {path.relative_to(root)} ({' '.join(str(e).split())})"
        ) from None


def _jsonl(path: Path, root: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DemosError(f"demos: {root} (LeRobot v2.1) has no {path.relative_to(root)}")
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except ValueError as e:
        raise DemosError(f"demos: {root}'s {path.relative_to(root)} is not JSON lines ({e})") from None


def _tasks(root: Path, version: str) -> dict[int, str]:
    """task_index -> task: meta/tasks.jsonl (v2.1), or meta/tasks.parquet, whose task is pandas' index (v3.0)."""
    if version == "v2.1":
        return {int(t["task_index"]): t["task"] for t in _jsonl(root / "meta" / "tasks.jsonl", root)}
    import pyarrow.parquet as pq

    path = root / "meta" / "tasks.parquet"
    if not path.is_file():
        raise DemosError(f"demos: {root} (LeRobot v3.0) has no meta/tasks.parquet")
    table = pq.read_table(path)
    pandas = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
    names = [n for n in ["task", *pandas.get("index_columns", [])] if isinstance(n, str) and n in table.column_names]
    if not names:
        raise DemosError(
            f"demos: {root}'s meta/tasks.parquet has no task column; its columns: {', '.join(table.column_names)}"
        )
    return dict(zip(table.column("task_index").to_pylist(), table.column(names[0]).to_pylist()))


def _entries(root: Path, info: dict[str, Any], version: str, videos: Sequence[str]) -> list[_EpisodeEntry]:
    """Every episode of the dataset, in episode_index order, with the files its frames and `videos` are in."""
    entries = []
    if version == "v2.1":
        chunks = int(info.get("chunks_size", CHUNKS_SIZE))
        for ep in sorted(_jsonl(root / "meta" / "episodes.jsonl", root), key=lambda e: e["episode_index"]):
            i, chunk = int(ep["episode_index"]), int(ep["episode_index"]) // chunks
            where = {
                k: (root / info["video_path"].format(episode_chunk=chunk, video_key=k, episode_index=i), 0.0)
                for k in videos
            }
            entries.append(
                _EpisodeEntry(
                    i,
                    int(ep["length"]),
                    root / info["data_path"].format(episode_chunk=chunk, episode_index=i),
                    where,
                    ep.get("seed"),
                )
            )
        return entries
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    if not files:
        raise DemosError(f"demos: {root} (LeRobot v3.0) has no meta/episodes/chunk-*/file-*.parquet")
    # the per-episode statistics (stats/...) are most of these files and are not needed here
    tables = [
        pq.read_table(f, columns=[c for c in pq.read_schema(f).names if not c.startswith("stats/")]) for f in files
    ]
    table = pa.concat_tables(tables, promote_options="default")
    for key in videos:
        if f"videos/{key}/from_timestamp" not in table.column_names:
            raise DemosError(
                f"demos: {root}'s meta/episodes does not say where the {key} video of an episode is "
                f"(no videos/{key}/... columns)"
            )
    for ep in sorted(table.to_pylist(), key=lambda e: e["episode_index"]):
        where = {
            k: (
                root
                / info["video_path"].format(
                    video_key=k, chunk_index=ep[f"videos/{k}/chunk_index"], file_index=ep[f"videos/{k}/file_index"]
                ),
                float(ep[f"videos/{k}/from_timestamp"]),
            )
            for k in videos
        }
        data = root / info["data_path"].format(chunk_index=ep["data/chunk_index"], file_index=ep["data/file_index"])
        entries.append(_EpisodeEntry(int(ep["episode_index"]), int(ep["length"]), data, where, ep.get("seed")))
    return entries


def _numbers(column: Any, steps: int) -> np.ndarray:
    """A parquet column of numbers or fixed-length lists of them (however nested) as a (steps, size) array."""
    import pyarrow as pa

    array = column.combine_chunks()
    while True:
        if isinstance(array, pa.ExtensionArray):  # datasets' Array2D/3D
            array = array.storage
        elif (
            pa.types.is_list(array.type)
            or pa.types.is_large_list(array.type)
            or pa.types.is_fixed_size_list(array.type)
        ):
            array = array.flatten()
        else:
            return array.to_numpy(zero_copy_only=False).reshape(steps, -1)


def _images(column: Any, root: Path, key: str) -> np.ndarray:
    """An `image` feature's column (structs of encoded bytes, or a path where the bytes are not embedded) as
    (steps, H, W, 3) uint8."""
    from PIL import Image

    frames = []
    for item in column.to_pylist():
        source = io.BytesIO(item["bytes"]) if item.get("bytes") else root / (item.get("path") or "")
        try:
            with Image.open(source) as image:
                frames.append(np.asarray(image.convert("RGB")))
        except OSError:
            raise DemosError(f"demos: {root}: a frame of {key} is neither embedded nor a file ({item.get('path')})")
    return np.stack(frames)


def _decode_videos(wanted: dict[Path, list[tuple[np.ndarray, list]]], root: Path) -> None:
    """Fill each (times, slot) of `wanted[mp4]` with that video's frames at `times`: each file is decoded once, from
    its start, and a frame goes to every time within TOLERANCE_S of it (lerobot's rule); `slot` is a one-item list
    the (T, H, W, 3) array is put in."""
    import av

    for path, asks in wanted.items():
        if not path.is_file():
            raise DemosError(f"demos: {root} is missing the video {path.relative_to(root)}")
        times = np.concatenate([t for t, _ in asks])
        owner = np.concatenate([np.full(len(t), i) for i, (t, _) in enumerate(asks)])
        row = np.concatenate([np.arange(len(t)) for t, _ in asks])
        order = np.argsort(times, kind="stable")
        times, owner, row = times[order], owner[order], row[order]
        filled = np.zeros(len(times), bool)
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in container.decode(stream):
                if frame.time is None:  # (no timestamp: no frame time can ask for it)
                    continue
                t = float(frame.time)
                lo, hi = np.searchsorted(times, [t - TOLERANCE_S, t + TOLERANCE_S])
                if hi > lo:
                    image = frame.to_ndarray(format="rgb24")
                    for j in range(lo, hi):
                        slot = asks[owner[j]][1]
                        if not slot:
                            slot.append(np.empty((len(asks[owner[j]][0]), *image.shape), np.uint8))
                        slot[0][row[j]] = image
                    filled[lo:hi] = True
                if t > times[-1] + TOLERANCE_S:
                    break
        if not filled.all():
            t = times[np.flatnonzero(~filled)[0]]
            raise DemosError(
                f"demos: {path.relative_to(root)} has no frame within {TOLERANCE_S} s of {t:.4f} s "
                "(a frame's from_timestamp + timestamp); lerobot's reader refuses it too"
            )


def read_lerobot(
    root: Path, state_keys: Sequence[str] | None, image_keys: dict[str, str], cameras: Sequence[str]
) -> DemoSet:
    """Every episode of the LeRobot dataset at `root` (v2.1 or v3.0), its state from `state_keys` (None: observation.
    state) and `cameras`' images; held out: its `valid` split where it has one (our recorder writes it)."""
    import pyarrow.parquet as pq

    info = _load_json(root / "meta" / "info.json", root)
    version = info.get("codebase_version")
    if version not in VERSIONS:
        raise DemosError(
            f"demos: {root} is a LeRobot dataset of codebase_version {version!r}; this reader reads "
            f"{' and '.join(VERSIONS)} (lerobot's convert_dataset scripts bring older ones forward)"
        )
    features: dict[str, Any] = info.get("features", {})
    state_keys = list(STATE_KEYS if state_keys is None else state_keys)
    cams = {cam: image_keys.get(cam, camera_key(cam)) for cam in cameras}
    for key, what in [
        *((k, "demos.state_keys") for k in state_keys),
        (ACTION, "the actions"),
        *((k, f"env camera {c}; demos.image_keys maps cameras to them") for c, k in cams.items()),
    ]:
        if key not in features:  # (checked before any file is read)
            raise DemosError(
                f"demos: {root} has no feature {key} ({what}); its features are: {', '.join(sorted(features))}"
            )
    for cam, key in cams.items():
        if features[key].get("dtype") not in ("image", "video"):
            raise DemosError(
                f"demos: {root}'s feature {key} (env camera {cam}) is {features[key].get('dtype')}, "
                "not an image or video feature; name one in demos.image_keys"
            )
    videos = sorted({k for k in cams.values() if features[k]["dtype"] == "video"})
    tasks = _tasks(root, version)
    entries = _entries(root, info, version, videos)
    extra = [k for k in ("next.reward", "next.success") if k in features]
    columns = [
        "episode_index",
        "frame_index",
        "timestamp",
        "task_index",
        *state_keys,
        ACTION,
        *extra,
        *sorted({k for k in cams.values() if k not in videos}),
    ]
    by_file: dict[Path, list[_EpisodeEntry]] = defaultdict(list)
    for entry in entries:
        by_file[entry.data].append(entry)
    frames: dict[int, dict[str, np.ndarray]] = {}
    wanted: dict[Path, list[tuple[np.ndarray, list]]] = defaultdict(list)
    for path, here in by_file.items():
        if not path.is_file():
            raise DemosError(
                f"demos: {root} is missing {path.relative_to(root)} (the frames of episode {here[0].index})"
            )
        table = pq.read_table(path, columns=columns)
        episode_of = table.column("episode_index").to_numpy()
        frame_of = table.column("frame_index").to_numpy()
        for entry in here:
            rows = np.flatnonzero(episode_of == entry.index)
            rows = rows[np.argsort(frame_of[rows], kind="stable")]
            if len(rows) != entry.length:
                raise DemosError(
                    f"demos: {path.relative_to(root)} holds {len(rows)} frames of episode "
                    f"{entry.index}; its meta says {entry.length}"
                )
            part, steps = table.take(rows), len(rows)
            arrays = {k: _numbers(part.column(k), steps) for k in [*state_keys, ACTION, *extra]}
            arrays.update({k: _images(part.column(k), root, k) for k in set(cams.values()) - set(videos)})
            arrays["task_index"] = part.column("task_index").to_numpy()
            timestamps = part.column("timestamp").to_numpy().astype(np.float64)
            for key in videos:
                mp4, start = entry.videos[key]
                slot: list = []
                wanted[mp4].append((start + timestamps, slot))
                arrays[key] = slot  # filled by _decode_videos
            frames[entry.index] = arrays
    _decode_videos(wanted, root)
    episodes, names = [], []
    for entry in entries:
        arrays = frames[entry.index]
        for key in videos:
            arrays[key] = arrays[key][0]
        obs = episode_obs(lambda key, what: arrays[key], entry.length, state_keys, image_keys, cameras, camera_key)
        rewards = arrays["next.reward"].reshape(-1) if "next.reward" in arrays else np.zeros(entry.length)
        success = bool(arrays["next.success"].reshape(-1)[-1]) if "next.success" in arrays else True
        task = tasks.get(int(arrays["task_index"][0]))
        episodes.append(
            Episode(obs, arrays[ACTION].astype(np.float32), rewards.astype(np.float32), success, entry.seed, task)
        )
        names.append(f"episode_{entry.index:06d}")
    held = None
    split = (info.get("splits") or {}).get("valid")
    if isinstance(split, str) and ":" in split:
        start, stop = (int(x) for x in split.split(":"))
        held = {f"episode_{i:06d}" for i in range(start, stop)}
    record = dict(info.get("ebrl") or {})
    record["instruction"] = episodes[0].instruction if episodes else None
    return DemoSet(episodes, names, held, record)


def _png(frame: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG", compress_level=6)  # (lerobot's level for image features)
    return out.getvalue()


def _feature_stats(x: np.ndarray, image: bool) -> dict[str, Any]:
    """meta/stats.json's entry for a feature, as lerobot computes it: per dimension, or per channel in [0, 1] with
    shape (3, 1, 1) for images (over a pixel subsample)."""
    count = len(x)  # (frames, for images too)
    if image:
        step = max(1, x.shape[1] // 32)
        x = x[:, ::step, ::step].reshape(-1, x.shape[-1]).astype(np.float64) / 255.0
    stats = {**moments(x, STAT_QUANTILES), "min": x.min(0).tolist(), "max": x.max(0).tolist(), "count": [count]}
    if image:
        return {k: v if k == "count" else [[[c]] for c in v] for k, v in stats.items()}
    return stats


def _vector(values: np.ndarray, dtype: Any) -> Any:
    """(T, D) values as a parquet column of fixed-size lists (datasets' Sequence(length=D), as lerobot writes)."""
    import pyarrow as pa

    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), dtype), values.shape[1])


def write_lerobot(
    root: str | Path,
    episodes: Sequence[Episode],
    instruction: str,
    fps: int,
    valid: int = 0,
    info: dict[str, Any] | None = None,
    robot_type: str | None = None,
) -> Path:
    """Write `episodes` as a LeRobot v3.0 dataset at `root` (its meta, data and videos folders replaced), images as
    PNG inside the parquet files; the last `valid` episodes form the `valid` split. Returns `root`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    if is_lerobot_dataset(root):
        for part in ("meta", "data", "videos", "images"):
            shutil.rmtree(root / part, ignore_errors=True)
    elif (root / "meta").exists() or (root / "data").exists():
        raise DemosError(f"out={root} has a meta/ or data/ folder that is not a LeRobot dataset's; choose another out")
    cameras = sorted(k[len("image/") :] for k in episodes[0].obs if k.startswith("image/"))
    first = episodes[0]
    features: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": [first.obs["state"].shape[1]], "names": None},
        **{
            camera_key(c): {
                "dtype": "image",
                "shape": list(first.obs[f"image/{c}"].shape[1:]),
                "names": ["height", "width", "channel"],
            }
            for c in cameras
        },
        ACTION: {"dtype": "float32", "shape": [first.actions.shape[1]], "names": None},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.done": {"dtype": "bool", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
        # lerobot's own columns of every frame
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    tasks = list(dict.fromkeys(e.instruction or instruction for e in episodes))
    chunk, file, size, total = 0, 0, 0.0, 0
    rows: list[dict[str, Any]] = []
    pending: list[Any] = []

    def flush() -> None:
        path = root / "data" / f"chunk-{chunk:03d}" / f"file-{file:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(pending), path, compression="snappy")
        pending.clear()

    for i, e in enumerate(episodes):
        steps = len(e)
        task = tasks.index(e.instruction or instruction)
        done = np.zeros(steps, bool)
        done[-1] = True
        columns = {
            "observation.state": _vector(e.obs["state"], pa.float32()),
            **{
                camera_key(c): pa.StructArray.from_arrays(
                    [
                        pa.array([_png(f) for f in e.obs[f"image/{c}"]], pa.binary()),
                        pa.array([f"frame-{j:06d}.png" for j in range(steps)], pa.string()),
                    ],
                    ["bytes", "path"],
                )
                for c in cameras
            },
            ACTION: _vector(e.actions, pa.float32()),
            "next.reward": pa.array(np.asarray(e.rewards, np.float32)),
            "next.done": pa.array(done),
            "next.success": pa.array(done & e.success),
            "timestamp": pa.array((np.arange(steps) / fps).astype(np.float32)),
            "frame_index": pa.array(np.arange(steps, dtype=np.int64)),
            "episode_index": pa.array(np.full(steps, i, np.int64)),
            "index": pa.array(np.arange(total, total + steps, dtype=np.int64)),
            "task_index": pa.array(np.full(steps, task, np.int64)),
        }
        table = pa.table(columns)
        if pending and size + table.nbytes / 2**20 >= DATA_FILE_MB:  # a new file, as lerobot rolls them
            flush()
            chunk, file = (chunk + 1, 0) if file == CHUNKS_SIZE - 1 else (chunk, file + 1)
            size = 0.0
        pending.append(table)
        size += table.nbytes / 2**20
        rows.append(
            {
                "episode_index": i,
                "tasks": [tasks[task]],
                "length": steps,
                "data/chunk_index": chunk,
                "data/file_index": file,
                "dataset_from_index": total,
                "dataset_to_index": total + steps,
                "meta/episodes/chunk_index": 0,
                "meta/episodes/file_index": 0,
                "seed": e.seed,
            }
        )
        total += steps
    flush()
    meta = root / "meta"
    (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(
            rows,
            schema=pa.schema(
                [
                    ("episode_index", pa.int64()),
                    ("tasks", pa.list_(pa.string())),
                    ("length", pa.int64()),
                    ("data/chunk_index", pa.int64()),
                    ("data/file_index", pa.int64()),
                    ("dataset_from_index", pa.int64()),
                    ("dataset_to_index", pa.int64()),
                    ("meta/episodes/chunk_index", pa.int64()),
                    ("meta/episodes/file_index", pa.int64()),
                    ("seed", pa.int64()),
                ]
            ),
        ),
        meta / "episodes" / "chunk-000" / "file-000.parquet",
        compression="snappy",
    )
    # tasks.parquet as pandas writes lerobot's DataFrame: the task is the (unnamed) index column
    index = "__index_level_0__"
    pandas = {
        "index_columns": [index],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {"name": None, "field_name": index, "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
    }
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), index: pa.array(tasks, pa.string())})
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas)}), meta / "tasks.parquet")
    stats = {
        "observation.state": _feature_stats(np.concatenate([e.obs["state"] for e in episodes]), False),
        ACTION: _feature_stats(np.concatenate([e.actions for e in episodes]), False),
        "next.reward": _feature_stats(np.concatenate([e.rewards for e in episodes]).reshape(-1, 1), False),
        **{
            camera_key(c): _feature_stats(np.concatenate([e.obs[f"image/{c}"] for e in episodes]), True)
            for c in cameras
        },
    }
    (meta / "stats.json").write_text(json.dumps(stats, indent=4))
    n = len(episodes)
    splits = {"train": f"0:{n - valid}", **({"valid": f"{n - valid}:{n}"} if valid else {})}
    (meta / "info.json").write_text(
        json.dumps(
            {
                "codebase_version": "v3.0",
                "robot_type": robot_type,
                "total_episodes": n,
                "total_frames": total,
                "total_tasks": len(tasks),
                "chunks_size": CHUNKS_SIZE,
                "data_files_size_in_mb": DATA_FILE_MB,
                "video_files_size_in_mb": 200,
                "fps": int(fps),
                "splits": splits,
                "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
                "video_path": None,
                "features": features,
                "ebrl": info or {},
            },
            indent=4,
        )
    )
    return root
