"""The resource pool on this CPU machine: affinity of every thread of real spawned children, lease checks, MPS client
environments that reach a spawned child, the MPS daemon's life cycle, re-quota callbacks, and the GPU paths failing
with one line where there is no GPU."""

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest

from ebrl.node import parse_cpu_list, process_affinity, set_process_affinity
from ebrl.runtime import resources
from ebrl.runtime.resources import (
    GREEN_UNAVAILABLE,
    GreenPartition,
    MpsDaemon,
    MpsDaemons,
    ResourceError,
    ResourcePool,
    apply_memory_budget,
    over_budget,
)

CORES = sorted(os.sched_getaffinity(0))
GIB = 2**30


# --- children (module level: the spawn context imports them by name) --------------------------------
def _threads_child(conn) -> None:
    """Four more threads, two spinning and two asleep, until told to stop."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))
            time.sleep(0.001)

    for target in (spin, spin, stop.wait, stop.wait):
        threading.Thread(target=target, daemon=True).start()
    conn.send(threading.active_count())
    conn.recv()
    stop.set()


def _report_env(conn, keys: list[str]) -> None:
    conn.send({k: os.environ.get(k) for k in keys})


@pytest.fixture
def child():
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_threads_child, args=(theirs,), daemon=True)
    proc.start()
    assert ours.recv() == 5  # main + 4
    yield proc
    ours.send("stop")
    proc.join(10)
    if proc.is_alive():
        proc.kill()


needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may use")


# --- affinity ----------------------------------------------------------------------------------
def test_cpu_lists_parse_like_the_kernel_writes_them():
    assert parse_cpu_list("0-3,6\n") == {0, 1, 2, 3, 6}
    assert parse_cpu_list("5") == {5}


@needs_two_cores
def test_sched_setaffinity_of_the_pid_alone_leaves_the_other_threads_where_they_were(child):
    os.sched_setaffinity(child.pid, {CORES[0]})
    masks = process_affinity(child.pid)
    assert masks[child.pid] == {CORES[0]}
    assert all(mask == set(CORES) for tid, mask in masks.items() if tid != child.pid)


@needs_two_cores
def test_every_thread_of_a_child_is_pinned_and_read_back_from_proc(child):
    set_process_affinity(child.pid, {CORES[-1]})
    masks = process_affinity(child.pid)
    assert len(masks) == 5 and all(mask == {CORES[-1]} for mask in masks.values())


@needs_two_cores
def test_resizing_a_lease_moves_every_thread_of_an_attached_child(child):
    pool = ResourcePool(CORES)
    pool.lease("simulate", [CORES[0]])
    pool.attach("simulate", child.pid)
    assert all(mask == {CORES[0]} for mask in process_affinity(child.pid).values())
    lease = pool.resize("simulate", cpus=[CORES[-1]])
    assert all(mask == {CORES[-1]} for mask in process_affinity(child.pid).values())
    assert lease.version == 1 and [x.version for _, x in pool.history] == [0, 1]


def test_a_gone_process_is_dropped_from_its_stage_on_resize():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    pool = ResourcePool(CORES)
    pool.lease("simulate", CORES)
    pool.attach("simulate", proc.pid)
    proc.wait()
    pool.resize("simulate", cpus=CORES[:1])  # no error: it has nothing left to move
    with pytest.raises(ProcessLookupError):
        set_process_affinity(proc.pid, CORES)


# --- lease checks ------------------------------------------------------------------------------
def test_cpus_outside_the_pool_are_refused_by_number():
    pool = ResourcePool([0, 1])
    with pytest.raises(ResourceError, match=r"stage simulate: cpus 5,7 are not in the pool's cores 0-1"):
        pool.lease("simulate", [1, 5, 7])
    with pytest.raises(ResourceError, match="cpus is empty"):
        pool.lease("simulate", [])
    assert pool.leases == {} and pool.history == []  # a refused lease leaves nothing behind


def test_sm_shares_of_one_gpu_may_not_sum_above_one():
    pool = ResourcePool([0], gpus=2, sm_count=132)
    pool.lease("generate", [0], gpu=0, sm_share=0.6)
    with pytest.raises(
        ResourceError,
        match=r"sm_share=0\.5 brings the SM shares of GPU 0 to 1\.1 > 1 "
        r"\(held: generate=0\.6\)",
    ):
        pool.lease("train", [0], gpu=0, sm_share=0.5)
    pool.lease("train", [0], gpu=1, sm_share=0.5)  # another GPU: fine
    pool.resize("generate", sm_share=0.5)
    assert pool.resize("train", gpu=0).gpu == 0  # now it fits
    with pytest.raises(ResourceError, match=r"sm_share=1\.5 must be in \(0, 1\]"):
        pool.lease("x", [0], gpu=1, sm_share=1.5)


def test_memory_budgets_of_one_gpu_may_not_exceed_its_memory():
    pool = ResourcePool([0], gpus=1, gpu_memory_bytes=10 * GIB)
    pool.lease("generate", [0], gpu=0, mem_bytes=6 * GIB)
    with pytest.raises(
        ResourceError, match=f"mem_bytes={5 * GIB} brings the budgets on GPU 0 to {11 * GIB} bytes, over its {10 * GIB}"
    ):
        pool.lease("train", [0], gpu=0, mem_bytes=5 * GIB)
    with pytest.raises(ResourceError, match="does not know the GPU's memory"):
        ResourcePool([0], gpus=1).lease("train", [0], gpu=0, mem_bytes=GIB)


def test_gpu_resources_need_a_gpu_in_range():
    pool = ResourcePool([0], gpus=1, sm_count=132)
    with pytest.raises(ResourceError, match=r"gpu=3 is not on this hw, which has GPUs 0\.\.0"):
        pool.lease("train", [0], gpu=3)
    with pytest.raises(ResourceError, match=r"sm_share=0\.5 and mem_bytes=None need a GPU but gpu=None"):
        pool.lease("train", [0], sm_share=0.5)


@pytest.mark.parametrize("partition", ["mps", "green"])
def test_sm_partitions_need_a_gpu(partition):
    with pytest.raises(
        ResourceError, match=f"hw.sm_partition={partition} needs a GPU; this hw has none: use hw.sm_partition=none"
    ):
        ResourcePool(CORES, partition=partition)
    with pytest.raises(ResourceError, match="hw.sm_partition='nvidia' is not one of: none, mps, green"):
        ResourcePool(CORES, gpus=1, partition="nvidia")


def test_granting_a_stage_again_resizes_it_and_unknown_changes_are_refused():
    pool = ResourcePool(CORES)
    pool.lease("train", CORES)
    assert pool.lease("train", CORES[:1]).version == 1
    with pytest.raises(ResourceError, match="resize\\('train'\\) got cores; accepted: cpus"):
        pool.resize("train", cores=[0])
    with pytest.raises(ResourceError, match="stage 'generate' holds no lease; stages with one: train"):
        pool.resize("generate", cpus=CORES)


def test_green_shares_are_rounded_down_to_whole_allocation_units(monkeypatch):
    # Hopper's rule (at least 8 SMs, a multiple of 8) without a GPU: only the rounding is under test here
    monkeypatch.setattr(resources, "green_rule", lambda device: (8, 8))
    pool = ResourcePool([0], gpus=1, sm_count=132, partition="green")
    assert pool.lease("generate", [0], gpu=0, sm_share=0.25).sm_share == 32 / 132  # 33 SMs -> 32
    assert pool.lease("probe", [0], gpu=0, sm_share=0.01).sm_share == 8 / 132  # at least one unit
    assert pool.lease("train", [0], gpu=0, sm_share=0.7).sm_share == 88 / 132  # 92.4 -> 88: 128 of 132 in all


# --- re-quota ----------------------------------------------------------------------------------
def test_an_sm_share_change_under_mps_calls_the_respawn_callback_with_the_new_lease(tmp_path):
    pool = ResourcePool([0], gpus=1, sm_count=132, gpu_memory_bytes=10 * GIB, partition="mps", run_dir=tmp_path)
    pool.lease("generate", [0], gpu=0, sm_share=0.5)
    respawned = []
    pool.on_requota("generate", respawned.append)
    pool.resize("generate", cpus=[0])  # cores only: the worker keeps running
    assert respawned == []
    new = pool.resize("generate", sm_share=0.75)
    assert respawned == [new] and new.version == 2
    assert pool.child_env("generate")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "75"  # what the respawn starts with
    capped = pool.resize("generate", mem_bytes=GIB)
    assert respawned == [new, capped]  # a memory budget is fixed for the process's life too


def test_an_sm_share_change_without_a_partition_is_only_recorded():
    pool = ResourcePool([0], gpus=1, sm_count=132)
    pool.lease("generate", [0], gpu=0, sm_share=0.5)
    called = []
    pool.on_requota("generate", called.append)
    pool.resize("generate", sm_share=0.75)
    assert called == [] and pool.leases["generate"].sm_share == 0.75


# --- child environments ------------------------------------------------------------------------
def test_child_env_of_an_mps_stage(tmp_path):
    pool = ResourcePool([0, 1], gpus=2, sm_count=132, gpu_memory_bytes=141 * 10**9, partition="mps", run_dir=tmp_path)
    pool.lease("generate", [0], gpu=1, sm_share=0.25, mem_bytes=3 * GIB + 12345)
    pool.lease("train", [1], gpu=0, sm_share=0.001)
    pool.lease("simulate", [0, 1])
    assert pool.child_env("generate") == {
        "CUDA_VISIBLE_DEVICES": "0",  # GPU 1's own daemon shows it to its clients as device 0
        "CUDA_MPS_PIPE_DIRECTORY": str(resources.mps_dirs(tmp_path, 1)[0]),  # (short, on this node: below)
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / "gpu1" / "log"),
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3072M",  # whole MiB, rounded down
    }
    assert pool.child_env("train")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"  # at least 1
    assert pool.child_env("simulate") == {}
    plain = ResourcePool([0], gpus=2)
    plain.lease("train", [0], gpu=1)
    assert plain.child_env("train") == {"CUDA_VISIBLE_DEVICES": "1"}


def test_spawn_env_reaches_a_spawned_child_and_is_restored_after(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")  # the parent's own value must come back
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    pool = ResourcePool([0], gpus=1, sm_count=132, gpu_memory_bytes=10 * GIB, partition="mps", run_dir=tmp_path)
    pool.lease("generate", [0], gpu=0, sm_share=0.25, mem_bytes=2 * GIB)
    before = dict(os.environ)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    with pool.spawn_env("generate") as env:
        proc = ctx.Process(target=_report_env, args=(theirs, sorted(env)))
        proc.start()
    assert dict(os.environ) == before
    assert ours.recv() == env and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    proc.join(10)


# --- MPS daemon (nvidia-cuda-mps-control: the stand-in of tests/conftest.py, fake_mps_control) -----------
def test_mps_daemon_without_the_binary_on_path_says_so_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    with pytest.raises(ResourceError) as err:
        MpsDaemon(0, tmp_path).start()
    assert str(err.value) == (
        "hw.mps=true but nvidia-cuda-mps-control is not on PATH: install the NVIDIA driver "
        "utilities or set hw.mps=false"
    )


def test_mps_daemon_start_stop_cycle_with_a_fake_control_binary_as_this_machine_has_no_gpu(tmp_path, fake_mps_control):
    daemon = MpsDaemon(1, tmp_path / "run")
    with daemon:
        assert daemon.control.exists() and daemon.log_dir.is_dir()
        assert (daemon.pipe_dir / "visible").read_text().strip() == "1"  # started for its GPU only
    assert not daemon.control.exists() and not daemon.pipe_dir.exists()  # (its pipes were in this node's /tmp)
    daemon.stop()  # already stopped: nothing happens


def test_mps_daemon_whose_pipe_never_appears_points_at_its_log(tmp_path, fake_mps_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_NO_PIPE", "1")
    daemon = MpsDaemon(0, tmp_path, timeout_s=0.2)
    with pytest.raises(ResourceError, match=r"did not open .*control within 0\.2 s: see .*gpu0/log/control\.log"):
        daemon.start()
    assert not daemon.running


def test_mps_daemons_stop_those_started_when_a_later_one_fails(tmp_path, fake_mps_control, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL_GPU", "1")
    daemons = MpsDaemons([0, 1, 2], tmp_path)
    with pytest.raises(ResourceError, match=r"nvidia-cuda-mps-control -d for GPU 1 exited with 1 \(no such device\)"):
        daemons.start()
    first = daemons.daemons[0]
    assert not first.running and not first.pipe_dir.exists()
    assert not daemons.daemons[2].pipe_dir.exists()  # never tried


def test_mps_pipes_are_short_and_on_this_node_whatever_the_run_folder(tmp_path, fake_mps_control):
    """AF_UNIX paths hold 107 bytes: a run folder on a long (shared-filesystem) path took a client's pipe past it, and
    the client ran without MPS. Each supervisor and run folder has pipes of its own in this node's /tmp."""
    run_dir = tmp_path / ("a-long-shared-filesystem-folder-" * 4) / "runs" / "2026-12-05" / "10-00-00_openpi_robosuite"
    pool = ResourcePool([0], gpus=1, sm_count=132, gpu_memory_bytes=10 * GIB, partition="mps", run_dir=run_dir)
    pool.lease("generate", [0], gpu=0, sm_share=0.5)
    daemons = MpsDaemons([0], run_dir)
    with daemons:
        pipe = pool.child_env("generate")["CUDA_MPS_PIPE_DIRECTORY"]
        assert pipe == str(daemons.daemons[0].pipe_dir) and daemons.daemons[0].control.exists()
        assert pipe.startswith("/tmp/ebrl-mps-") and len(str(daemons.daemons[0].control)) < 60
        assert len(str(run_dir / "mps" / "gpu0" / "pipe" / "control")) > 107  # where they were
        assert (run_dir / "mps" / "gpu0" / "log").is_dir()  # the logs stay with the run
        assert MpsDaemons([0], tmp_path / "other").daemons[0].pipe_dir != daemons.daemons[0].pipe_dir
    assert not os.path.exists(os.path.dirname(pipe))  # /tmp is left as it was


def test_a_process_that_is_not_its_daemons_client_is_said_in_one_line(tmp_path, fake_mps_control, monkeypatch):
    """The probe, against a stand-in for nvidia-cuda-mps-control (no GPU here): a client that cannot reach the daemon
    runs without MPS, and its server's client list does not hold it."""
    daemons = MpsDaemons([0], tmp_path)
    with daemons:
        clients = {"generation": (4101, 0), "the trainer": (4102, 0)}
        monkeypatch.setenv("FAKE_MPS_SERVERS", "4000")
        monkeypatch.setenv("FAKE_MPS_CLIENTS", "4101 4102")
        assert daemons.unenforced(clients) is None
        monkeypatch.setenv("FAKE_MPS_CLIENTS", "4101")
        line = daemons.unenforced(clients)
        assert line.startswith("MPS: the trainer (pid 4102) is not a client of GPU 0's daemon (/tmp/ebrl-mps-")
        assert "not held to an SM share or memory limit" in line and "\n" not in line
        monkeypatch.setenv("FAKE_MPS_SERVERS", "")  # no server: no client reached the daemon at all
        assert daemons.unenforced(clients).startswith("MPS: generation (pid 4101) and the trainer (pid 4102) are not")


def test_a_daemon_left_by_a_killed_supervisor_is_found_by_its_pid_and_stopped(tmp_path, fake_mps_control, repo):
    """gpu_check's run check: the run's supervisor (another process) started its daemon and was killed before it
    stopped it; its pipes are where mps_dirs says for that pid, and adopting the daemon stops it."""
    run_dir = tmp_path / "run"
    code = (
        "import os, sys; from pathlib import Path; from ebrl.runtime.resources import MpsDaemon; "
        "MpsDaemon(0, Path(sys.argv[1])).start(); os._exit(0)"
    )  # (os._exit: no atexit, as under SIGKILL)
    supervisor = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)], cwd=repo, stderr=subprocess.PIPE, text=True
    )
    assert supervisor.wait(60) == 0, supervisor.stderr.read()
    left = MpsDaemon(0, run_dir, pid=supervisor.pid)
    assert left.control.exists() and f"ebrl-mps-{supervisor.pid}-" in str(left.pipe_dir)
    assert MpsDaemon(0, run_dir).pipe_dir != left.pipe_dir  # (this process's own would be elsewhere)
    assert left.adopt()
    left.stop()
    assert not left.control.exists() and not left.pipe_dir.parent.exists()
    assert not left.adopt()  # none left


# --- GPU paths on this CPU machine ---------------------------------------------------------------
def test_green_contexts_on_a_machine_without_them_fail_with_one_line():
    with pytest.raises(ResourceError) as err:
        GreenPartition(0, {"generate": 0.5})
    assert str(err.value) == GREEN_UNAVAILABLE
    with pytest.raises(ResourceError, match="green contexts need a CUDA build of torch"):
        ResourcePool(CORES, gpus=1, sm_count=132, partition="green")
    with pytest.raises(ResourceError, match="needs a CUDA device and this torch has none"):
        apply_memory_budget(GIB, 0)


def test_over_budget_names_the_stage_its_use_and_its_budget():
    pool = ResourcePool([0], gpus=1, gpu_memory_bytes=10 * GIB)
    leases = {
        "generate": pool.lease("generate", [0], gpu=0, mem_bytes=2 * GIB),
        "train": pool.lease("train", [0], gpu=0, mem_bytes=4 * GIB),
    }
    lines = over_budget({"generate": 3 * GIB, "train": GIB, "simulate": GIB}, leases)
    assert lines == [
        f"stage generate uses {3 * GIB} bytes (3.00 GiB) of GPU 0, over its budget of {2 * GIB} bytes (2.00 GiB)"
    ]


def test_gpu_check_on_a_machine_without_cuda_imports_each_check_then_skips_it(tmp_path, repo):
    out = subprocess.run(
        [sys.executable, "-m", "ebrl.bench.gpu_check", "--part", "1", "--out", str(tmp_path / "figures.json")],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == (
        "no CUDA device: each check imports what it needs, then skips (run this on a GPU node)"
    )
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert list(figures) == ["basics", "egl", "mps", "memory", "green", "nvml", "full"]
    assert {f["status"] for f in figures.values()} == {"SKIP"}
    assert all(f["reason"].startswith("no CUDA device") for f in figures.values())
