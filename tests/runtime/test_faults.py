"""Faults injected for real into run.py in a subprocess: a simulator killed (kill -9), hung or failing again and
again; SIGTERM; NaN updates; a corrupt checkpoint. Each leaves the run either going on or stopped with one line and a
checkpoint it can resume from."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from ebrl.rl.rollout import ChunkStep, RolloutStats, discard_partial_episode
from ebrl.runtime.checkpoint import load_checkpoint
from tests.conftest import REPO
from tests.runs.test_run import SMALL, metrics, run_py

ENV = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}


def start_run(*overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "run.py", *overrides],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_iterations(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    path, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"{n} iterations not logged within {timeout} s (exit code {proc.poll()})")


def simulators(proc: subprocess.Popen) -> list[psutil.Process]:
    return [
        p for p in psutil.Process(proc.pid).children(recursive=True) if "ebrl.envs.process" in " ".join(p.cmdline())
    ]


def total(rows: list[dict], key: str) -> float:
    return sum(row.get(key, 0.0) for row in rows)


def last_line(stderr: str) -> str:
    return [line for line in stderr.splitlines() if line.strip()][-1]


def test_a_failed_simulators_partial_episode_is_discarded_and_finished_ones_kept() -> None:
    # env 0: an episode ends at step 1, the next runs steps 2-3 and its simulator fails in step 4
    rec = [
        ChunkStep(
            obs={},
            chunk=torch.zeros(2, 3, 1),
            extras={},
            log_prob=torch.zeros(2, 3),
            value=torch.zeros(2),
            done=torch.tensor([d, False]),
            mask=torch.ones(2, 3, dtype=torch.bool),
        )
        for d in (False, True, False, False)
    ]
    stats = RolloutStats()
    discard_partial_episode(rec, 0, stats)
    assert [bool(r.mask[0].any()) for r in rec] == [True, True, False, False]
    assert all(r.mask[1].all() for r in rec)  # other envs untouched
    assert stats.discarded_steps == 6


def test_a_killed_simulator_is_replaced_and_the_run_goes_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_run(*SMALL, "iterations=4", f"hydra.run.dir={run_dir}")
    try:
        wait_for_iterations(run_dir, 1, proc)
        victim = simulators(proc)[1]
        victim.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert f"(pid {victim.pid})" in err and "replaced by a fresh simulator" in err
    rows = metrics(run_dir)
    assert len(rows) == 4 and total(rows, "sim/failures") == 1
    assert not victim.is_running()


@pytest.mark.parametrize("stage", ["trainer", pytest.param("generation", marks=pytest.mark.slow)])
def test_a_killed_trainer_or_generation_process_stops_the_run_with_one_line_and_nothing_left(
    tmp_path: Path, stage: str
) -> None:
    run_dir = tmp_path / "run"
    own = ["scheduler.generation=process"] if stage == "generation" else []
    proc = start_run(*SMALL, "scheduler=ebrl", *own, "iterations=50", "checkpoint_every=1", f"hydra.run.dir={run_dir}")
    try:
        wait_for_iterations(run_dir, 2, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        # the trainer process is started just before generation's (schedule.real_stages): the lower pid
        spawned = sorted(
            (p for p in children if p not in simulators(proc) and "spawn_main" in " ".join(p.cmdline())),
            key=lambda p: p.pid,
        )
        victim = spawned[0] if stage == "trainer" else spawned[1]
        victim.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err
    assert last_line(err) == (
        f"error: {stage} process (pid {victim.pid}) stopped; exit code -9; continue with resume={run_dir}"
    )  # the real folder, to copy
    time.sleep(0.5)
    assert not [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["iteration"] >= 1  # the last one written stays


def test_a_workers_failure_is_one_line_that_names_its_kept_traceback() -> None:
    """A trainer or generation process answers its exception as one line; the traceback is kept in a file it names."""
    import multiprocessing

    from ebrl.runtime.piped import report_failure

    ours, theirs = multiprocessing.Pipe()
    try:
        torch.cat([])
    except ValueError as e:
        report_failure(theirs, e)
    reason = ours.recv().reason
    assert reason.startswith("ValueError: torch.cat(): expected a non-empty list of Tensors (traceback in ")
    kept = Path(reason.rsplit("(traceback in ", 1)[1].rstrip(")"))
    assert "Traceback" in kept.read_text() and "torch.cat([])" in kept.read_text()
    kept.unlink()


@pytest.mark.slow  # (the default suite's time)
def test_a_hung_simulator_is_replaced_under_the_pipelined_schedule(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_py(
        *SMALL,
        "scheduler=ebrl",
        "iterations=3",
        "env.fault.kind=hang",
        "env.fault.env=1",
        "env.fault.chunk=3",
        "scheduler.chunk_timeout_s=3",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sim worker 1" in proc.stdout + proc.stderr and "hung" in proc.stdout + proc.stderr
    rows = metrics(run_dir)
    assert len(rows) == 3 and total(rows, "sim/failures") == 1
    assert total(rows, "sim/discarded_steps") > 0  # the hung env's episode so far, not trained on


@pytest.mark.slow  # (the default suite's time)
def test_simulators_that_keep_failing_stop_the_run_with_a_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_py(
        *SMALL,
        "scheduler=ebrl",
        "iterations=8",
        "checkpoint_every=100",
        "env.fault.kind=error",
        "env.fault.env=0",
        "env.fault.chunk=3",
        "env.fault.again=true",
        "scheduler.max_sim_failures=2",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert last_line(proc.stderr).startswith(
        "error: 3 simulator failures within 600 s, more than scheduler.max_sim_failures=2 (the last: sim worker 0"
    )
    # written on the way out: the trainer's newest weights, with the iterations they were trained on; an update done
    # but not yet handed to the loop is logged then, so the metrics end where the checkpoint is
    rows = metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert [row["iteration"] for row in rows] == list(range(1, ckpt["iteration"] + 1))
    assert ckpt["env_steps"] == (rows[-1]["env_steps"] if rows else 0)


def stopped_by_sigterm(
    run_dir: Path, *overrides: str, twice: bool = False
) -> tuple[subprocess.Popen, list[psutil.Process], str]:
    """A pipelined run of 2 simulators sent SIGTERM after 2 iterations (twice: again, while the first one's stop is
    under way); its process, the processes it had started, and its stderr."""
    proc = start_run(*SMALL, "scheduler=ebrl", "iterations=50", *overrides, f"hydra.run.dir={run_dir}")
    try:
        wait_for_iterations(run_dir, 2, proc)
        children = psutil.Process(proc.pid).children(recursive=True)  # simulators, the trainer, helpers
        assert len(simulators(proc)) == 2
        proc.send_signal(signal.SIGTERM)
        if twice:
            time.sleep(0.3)  # (two signals at once would be one)
            proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, children, err


def test_sigterm_stops_the_run_with_a_checkpoint_and_leaves_nothing_behind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    proc, children, err = stopped_by_sigterm(run_dir, "checkpoint_every=1000")
    assert proc.returncode == 130, err[-3000:]
    assert last_line(err) == f"interrupted by SIGTERM: continue with resume={run_dir}"
    # the only checkpoint is the one written on the way out: the trainer's newest weights, with the iterations they
    # were trained on; updates done but not yet handed to the loop are logged then. (One past the last line only when
    # the signal lands inside the loop's few lines between counting an iteration and logging it.)
    rows, ckpt = metrics(run_dir), load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert len(rows) >= 2 and ckpt["iteration"] in (len(rows), len(rows) + 1)
    assert [row["iteration"] for row in rows] == list(range(1, len(rows) + 1))
    assert (ckpt["env_steps"] == rows[-1]["env_steps"]) == (ckpt["iteration"] == len(rows))
    # and its totals so far, as a run that ends writes them (summary.json; the console table)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] in (rows[-1]["env_steps"], ckpt["env_steps"]) and summary["wall_s"] > 0
    time.sleep(0.5)
    assert not [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert set(os.listdir("/dev/shm")) <= shm_before
    proc = run_py(*SMALL, "scheduler=ebrl", f"resume={run_dir}", f"iterations={ckpt['iteration'] + 1}")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_second_sigterm_stops_the_run_at_once_and_leaves_nothing_behind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    proc, children, err = stopped_by_sigterm(run_dir, "checkpoint_every=1", twice=True)
    assert proc.returncode == 130 and last_line(err) == "stopped at once by a second SIGTERM", err[-3000:]
    deadline = time.monotonic() + 30  # (the resource tracker frees the shared memory once this process is gone)
    while time.monotonic() < deadline and (
        set(os.listdir("/dev/shm")) - shm_before or [p for p in children if p.is_running() and p.status() != "zombie"]
    ):
        time.sleep(0.2)
    assert not [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert set(os.listdir("/dev/shm")) <= shm_before
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["iteration"] >= 1  # the last one written whole


def test_a_second_sigterm_while_the_process_winds_down_still_ends_it_at_once_with_its_line() -> None:
    # after the first stop's line the process may still be reaping children (atexit): a second signal there ends it
    # at once, with its line and 130, not with the default action (killed by SIGTERM, no line)
    code = (
        "import atexit, os, signal, time\n"
        "from ebrl.runtime.errors import exit_cleanly\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30)))\n"
        "with exit_cleanly():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-2:] == ["interrupted by SIGTERM", "stopped at once by a second SIGTERM"]


def test_the_echo_of_a_stop_signal_is_not_a_second_one() -> None:
    # GNU timeout (`timeout -s INT 1800 python run.py ...`, as docs/results/results.md runs) sends its signal to the
    # command and again to its process group: the second SIGINT, microseconds after the first, must not turn the stop
    # (the checkpoint written on the way out) into a stop at once without it
    code = (
        "import os, signal, time\n"
        "from ebrl.runtime.errors import exit_cleanly\n"
        "with exit_cleanly():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(30)\n"
        "    except KeyboardInterrupt:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"  # (the echo)
        "        time.sleep(0.5)\n"  # (the stop under way)
        "        print('checkpoint written', flush=True)\n"
        "        raise\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and proc.stdout == "checkpoint written\n", proc.stderr[-2000:]
    assert proc.stderr.splitlines()[-1] == "interrupted by SIGINT"


def test_a_stop_inside_an_update_in_the_supervisor_ends_it_at_the_next_step_with_its_state_whole() -> None:
    # colocated trains in the supervisor: SIGTERM half-way through an update's first optimizer step (a real signal to
    # this process) lets that step finish, ends the update there, and only then stops, so the state is a checkpoint's
    from ebrl.runtime.errors import _interrupt
    from ebrl.runtime.trainer import LocalTrainer
    from tests.conftest import compose_config
    from tests.rl.test_grpo import one_episode_rollout, policy_of

    policy = policy_of("openpi")
    batch = one_episode_rollout(policy)
    algo = compose_config("algo=ppo", "algo.epochs=2", "algo.minibatches=2").algo  # 4 steps in a whole update
    posted = []
    trainer = LocalTrainer(policy, algo, torch.device("cpu"), posted.append)
    trainer.trainer.pace = lambda: os.kill(os.getpid(), signal.SIGTERM)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            trainer.train(1, batch, decoupled=False, is_clip=2.0)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert not trainer.torn
    [trained] = posted
    assert trained.metrics["train/stopped_early"] == 1.0
    steps = {float(s["step"]) for s in trainer.trainer.optimizer.state_dict()["state"].values()}
    assert steps == {1.0}  # one optimizer step of four, taken whole
    trainer.request_state()
    assert set(posted[-1].model) == set(policy.state_dict())


@pytest.fixture(scope="module")
def two_iterations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    proc = run_py(*SMALL, "iterations=2", "checkpoint_every=1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_nan_updates_are_skipped_and_stop_the_run_at_its_last_good_checkpoint(
    two_iterations: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(two_iterations, run_dir)
    proc = run_py(*SMALL, f"resume={run_dir}", "iterations=10", "algo.lr=1e30")  # the first step blows the weights up
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert (
        "3 updates in a row had NaN/inf gradients (iterations 3-5, algo.max_nonfinite_updates=3; their steps "
        "were skipped); checkpoints/last.pt is from before them" in last_line(proc.stderr)
    )
    rows = metrics(run_dir)
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(row["train/nonfinite_steps"] > 0 for row in rows[2:])
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert ckpt["iteration"] == 2 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_a_corrupt_checkpoint_is_refused_and_the_previous_one_named(two_iterations: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(two_iterations, run_dir)
    last, previous = run_dir / "checkpoints" / "last.pt", run_dir / "checkpoints" / "previous.pt"
    assert load_checkpoint(previous)["iteration"] == 1  # the one before the last, kept by the last write
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # truncated
    kept = previous.read_bytes()
    proc = run_py(*SMALL, f"resume={run_dir}", "iterations=3")
    assert proc.returncode == 2
    line = last_line(proc.stderr)
    assert line.startswith(f"error: {last} is not a readable checkpoint")
    assert f"{previous} (iteration 1) is intact: move it to {last} to start from it" in line
    assert previous.read_bytes() == kept and len(metrics(run_dir)) == 2  # nothing lost, nothing run
