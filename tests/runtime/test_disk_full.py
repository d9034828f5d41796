"""A full disk under a run says so in one line and keeps the newest intact checkpoint, on a real small tmpfs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ebrl.errors import DiskFull
from ebrl.runtime.checkpoint import atomic_save
from tests.conftest import REPO
from tests.runs.test_run import SMALL


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of `request.param` MiB (mounting needs root: skipped where it is not allowed)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    size = getattr(request, "param", 1)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)  # (lazy: a file a failed test left open)


def test_a_checkpoint_the_disk_has_no_room_for_is_refused_before_it_is_written(small_disk):
    path = small_disk / "checkpoints" / "last.pt"
    atomic_save({"iteration": 1, "w": torch.zeros(1000)}, path)
    with pytest.raises(DiskFull) as e:
        atomic_save({"iteration": 2, "w": torch.zeros(2 * 2**18)}, path)  # 2 MiB on a 1 MiB disk
    message = str(e.value)
    assert message.startswith(f"the disk is full at {path.parent}: the checkpoint needs 2.0 MiB and ")
    assert message.endswith(f"{path} (iteration 1) is intact")
    assert torch.load(path)["iteration"] == 1 and [p.name for p in path.parent.iterdir()] == ["last.pt"]


def test_a_write_the_disk_runs_out_under_says_so_and_leaves_no_temp_file(small_disk):
    path = small_disk / "last.pt"
    with pytest.raises(DiskFull) as e:  # (bytes are not counted ahead: the write itself fails)
        atomic_save({"iteration": 3, "w": torch.zeros(2**16), "blob": b"x" * 2**21}, path)
    assert str(e.value).startswith(
        f"the disk filled up at {small_disk} while the checkpoint was written (about 0.2 MiB; "
    )
    assert str(e.value).endswith("no checkpoint was written before")
    assert list(small_disk.iterdir()) == []


@pytest.mark.parametrize("small_disk", [3], indirect=True)
def test_a_run_on_a_full_disk_stops_in_one_line_with_its_last_checkpoint(small_disk):
    run_dir = small_disk / "run"
    proc = subprocess.run(
        [sys.executable, "run.py", *SMALL, "iterations=6", "checkpoint_every=1", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith(f"warning: 3.0 MiB free at {run_dir / 'checkpoints'}, less than two checkpoints")
    last = run_dir / "checkpoints" / "last.pt"
    assert lines[-1].startswith(f"error: the disk is full at {run_dir / 'checkpoints'}: the checkpoint needs ")
    assert lines[-1].endswith(f"{last} (iteration 1) is intact; continue with resume={run_dir}")
    assert torch.load(last, weights_only=False)["iteration"] == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.pt"]


def fill(folder: Path) -> None:
    """Write until the disk refuses: what is left free is less than a block."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_metrics_on_a_full_disk_stop_the_run_saying_so_and_the_trace_gives_up_with_a_warning(small_disk, capsys):
    from ebrl.telemetry.metrics import MetricsLog
    from ebrl.telemetry.trace import Trace

    log = MetricsLog(small_disk, {"name": "none"}, {})
    trace = Trace()
    trace.stream_to(small_disk / "trace.json")
    fill(small_disk)
    with pytest.raises(
        DiskFull,
        match=rf"^the disk is full at {small_disk}: metrics.jsonl could not take "
        r"iteration 7's line \(\d+ bytes; 0.0 MiB free\)$",
    ):
        log.log({"iteration": 7, "blob": "x" * 8192})
    for k in range(2000):  # (its buffer fills, and the write fails)
        trace.add("simulate/env0", "chunk", k, k + 0.5, steps=8)
    trace.write(small_disk / "trace.json")
    assert trace.gave_up and trace.file is None
    err = capsys.readouterr().err
    trace_file = small_disk / "trace.json"
    assert f"warning: {trace_file} could not be written (No space left on device); the run goes on" in err
