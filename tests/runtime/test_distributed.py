"""Several ranks under torchrun on this machine, for real (gloo): one policy trained data-parallel, each rank on its
own simulators; a killed rank stops the run with its checkpoint; a run of two ranks resumes on one."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ebrl.checks import rank_cores, validate
from ebrl.config import ConfigError
from ebrl.node import Ranks, share_of_node
from ebrl.runtime.checkpoint import load_checkpoint
from ebrl.runtime.distributed import DistributedError, combine, weights_sum
from ebrl.telemetry.metrics import wilson_interval
from tests.conftest import REPO, compose_config
from tests.runs.test_run import SMALL, metrics, run_py

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BF16 = ["algo.optimizer_dtype=bfloat16"]
CORES = sorted(os.sched_getaffinity(0))


def torchrun(launch: list[str], *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*TORCHRUN, *launch, "run.py", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(run_dir: Path, *overrides: str, timeout: int = 300) -> None:
    """Two torchrun agents on localhost, a node of one rank each (every rank has the machine's cores: a pipelined
    schedule needs 2), running `overrides` on hw.nodes=2 into `run_dir`; both must succeed."""
    port = free_port()
    launch = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "ebrl-test",
    ]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [*TORCHRUN, *launch, "run.py", *SMALL, "hw.nodes=2", *overrides, f"hydra.run.dir={run_dir}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-2000:] for out in outputs)


def as_ranks(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, local_world: int) -> None:
    """This process as torchrun would start rank `rank` of `world`, `local_world` of them on its node."""
    for key, value in (
        ("RANK", rank),
        ("WORLD_SIZE", world),
        ("LOCAL_RANK", rank % local_world),
        ("LOCAL_WORLD_SIZE", local_world),
    ):
        monkeypatch.setenv(key, str(value))


# --- the pieces ------------------------------------------------------------------------------
def test_an_iterations_metrics_combine_over_the_ranks() -> None:
    per_rank = [
        {
            "iteration": 3,
            "perf/env_steps_per_s": 60.0,
            "perf/iteration_env_steps": 64,
            "env/episodes": 1.0,
            "env/successes": 1.0,
            "env/return": 1.0,
            "losses/policy": 0.2,
            "time/iteration_s": 1.0,
            "dist/weights_sum": 5.5,
            "alloc/decision": "moved a core",
            "env/Lift/success": 1.0,
            "env/Lift/return": 1.0,
            "env/Lift/episodes": 1.0,
        },
        {
            "iteration": 3,
            "perf/env_steps_per_s": 40.0,
            "perf/iteration_env_steps": 64,
            "env/episodes": 3.0,
            "env/successes": 1.0,
            "env/return": 3.0,
            "losses/policy": 0.4,
            "time/iteration_s": 1.5,
            "dist/weights_sum": 5.5,
            "env/Lift/success": 0.0,
            "env/Lift/return": 2.0,
            "env/Lift/episodes": 2.0,
            "env/Stack/success": 1.0,
            "env/Stack/return": 4.0,
            "env/Stack/episodes": 1.0,
        },
    ]
    out = combine(per_rank)
    assert out["perf/env_steps_per_s"] == 100.0 and out["perf/iteration_env_steps"] == 128
    assert out["env/episodes"] == 4.0
    assert out["env/return"] == pytest.approx((1.0 * 1 + 3.0 * 3) / 4)  # over episodes, not ranks
    assert out["losses/policy"] == pytest.approx(0.3)
    assert out["time/iteration_s"] == 1.5
    assert out["iteration"] == 3 and out["alloc/decision"] == "moved a core" and out["dist/ranks"] == 2
    assert (out["ranks/0/return"], out["ranks/1/return"]) == (1.0, 3.0)
    assert out["ranks/1/env_steps_per_s"] == 40.0
    assert (out["env/success_low"], out["env/success_high"]) == wilson_interval(2, 4)  # over all 4 episodes
    # a multi-task run's figures per task: over that task's episodes on every rank
    assert out["env/Lift/episodes"] == 3.0 and out["env/Lift/success"] == pytest.approx(1 / 3)
    assert out["env/Lift/return"] == pytest.approx((1.0 + 2 * 2.0) / 3)
    assert (out["env/Stack/episodes"], out["env/Stack/success"], out["env/Stack/return"]) == (1.0, 1.0, 4.0)


def test_each_ranks_gpus_are_its_own_and_two_nodes_gpus_are_not_averaged_together() -> None:
    """GpuMonitor reports a rank's own GPUs under their node's numbers (tests/telemetry/test_monitor.py): GPU 0 of
    node 0 and GPU 0 of node 1 stay apart, per rank; the run's figure is taken over every GPU."""
    per_rank = [
        {"iteration": 1, "perf/gpu0_util": 90.0, "perf/gpu0_sm_util": 70.0, "perf/gpu0_mem_gb": 30.0},
        {"iteration": 1, "perf/gpu0_util": 10.0, "perf/gpu0_mem_gb": 50.0},  # another node's GPU 0
        {"iteration": 1, "perf/gpu1_util": 50.0, "perf/gpu1_mem_gb": 40.0},
    ]  # node 1's GPU 1
    out = combine(per_rank)
    assert not any(key.startswith("perf/gpu0") or key.startswith("perf/gpu1") for key in out)
    assert (out["ranks/0/gpu0_util"], out["ranks/1/gpu0_util"], out["ranks/2/gpu1_util"]) == (90.0, 10.0, 50.0)
    assert out["ranks/0/gpu0_sm_util"] == 70.0 and out["ranks/1/gpu0_mem_gb"] == 50.0
    assert (out["perf/gpu_util"], out["perf/gpu_sm_util"], out["perf/gpu_mem_gb"]) == (50.0, 70.0, 50.0)


def test_ranks_whose_weights_differ_stop_the_run() -> None:
    per_rank = [{"iteration": 2, "dist/weights_sum": 5.5}, {"iteration": 2, "dist/weights_sum": 5.25}]
    with pytest.raises(DistributedError, match="dist/weights_sum differ after iteration 2"):
        combine(per_rank)
    with pytest.raises(DistributedError, match="sched/weights_version"):
        combine([{"sched/weights_version": 3.0}, {"sched/weights_version": 2.0}])


def test_a_weights_fingerprint_sees_any_change_and_the_order() -> None:
    import torch

    a = {"w": torch.ones(3), "b": torch.zeros(2), "steps": torch.tensor(4)}
    assert weights_sum(a) == weights_sum({k: v.clone() for k, v in a.items()})
    assert weights_sum({**a, "b": torch.tensor([0.0, 1e-6])}) != weights_sum(a)
    assert weights_sum({"b": a["b"], "w": a["w"]}) != weights_sum({"w": a["w"], "b": a["b"]})


def test_the_ranks_of_a_node_split_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = list(range(8))
    assert share_of_node(cores, Ranks()) == cores
    assert [share_of_node(cores, Ranks(r, 6, r % 3, 3)) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    as_ranks(monkeypatch, 1, 2, 2)
    assert Ranks.from_env() == Ranks(1, 2, 1, 2) and Ranks.from_env().nodes == 1
    cfg = compose_config("hw.cpu_cores=2")
    assert rank_cores(cfg) == sorted(os.sched_getaffinity(0))[1:2]


@pytest.mark.parametrize(
    "launch, overrides, message",
    [
        (
            None,
            ["hw.nodes=2"],
            "hw=cpu spans 2 nodes and this is one process; launch one per node: torchrun --nnodes 2",
        ),
        ((0, 4, 2), [], "torchrun started 2 node(s) x 2 rank(s) and hw=cpu describes 1 node(s)"),
        (
            (0, 2, 2),
            ["hw.cpu_cores=2", "scheduler=ebrl"],
            "needs at least 2 CPU cores; this rank has 1 (this node's cores split over its 2 ranks)",
        ),
        ((0, 2, 2), ["hw.nodes=0"], "hw.nodes=0 must be a positive number"),
        (
            (0, 2, 2),
            ["distributed.strategy=fsdp"],
            "distributed.strategy=fsdp shards the trainer process's weights and "
            "scheduler=colocated trains in the process that generates",
        ),
        (
            (0, 2, 2),
            ["distributed.strategy=zero3"],
            "distributed.strategy='zero3' is not available; accepted: auto, ddp, fsdp",
        ),
    ],
)
def test_a_launch_the_hw_cannot_have_is_refused_with_one_line(
    monkeypatch: pytest.MonkeyPatch, launch, overrides, message
) -> None:
    if launch is not None:
        as_ranks(monkeypatch, *launch)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        validate(compose_config(*overrides))
    assert "\n" not in str(e.value)


# --- two trainer processes, for real (gloo): what a checkpoint and a publication hold --------------------------
def _rank_environment(rank: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_at_a_checkpoint_only_rank_0s_trainer_sends_its_state(strategy: str) -> None:
    """Two ranks' trainer processes (trainer_main, as a pipelined run starts them) with a checkpoint due after
    update 1: every trainer sent its whole model and Adam state through shared memory, and only rank 0's was kept.
    Now rank 1's sends none (FSDP: it takes part in the gathering), and rank 0's is the weights both published."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from ebrl.policies.build import build_policy
    from ebrl.runtime.channel import WeightChannel
    from ebrl.runtime.messages import Ready, State, Train, Trained
    from ebrl.runtime.resources import environment
    from ebrl.runtime.trainer import TrainerProcess, TrainerThreads
    from tests.rl.test_grpo import LIFT_SPEC, one_episode_rollout

    # fsdp: the action expert alone, so that the frozen prefix is computed through the sharded policy, and decoupled
    # updates whose proximal pass values rank 0's rows (sampled by older weights) and none of rank 1's: rank 1 runs
    # passes to keep pace with rank 0's gathers
    sharded = strategy == "fsdp"
    conf = OmegaConf.to_container(
        compose_config(
            *SMALL,
            "scheduler=ebrl",
            f"distributed.strategy={strategy}",
            "algo.epochs=1",
            *(["policy.train=action_expert"] if sharded else []),
        ),
        resolve=True,
    )
    policy = build_policy(conf["policy"], LIFT_SPEC, "cpu")
    batch = one_episode_rollout(policy, chunks=2, num_envs=2)
    batches = [dataclasses.replace(batch, version=torch.full(batch.reward.shape, rank - 1)) for rank in range(2)]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # (torchrun's, for the ranks)
    ctx = torch.multiprocessing.get_context("spawn")
    channels = [WeightChannel(policy.state_dict(), ctx, policy.compute_dtype) for _ in range(2)]
    trainers = []
    try:
        for rank in range(2):
            with environment(_rank_environment(rank, port)):
                trainers.append(
                    TrainerProcess(
                        conf, LIFT_SPEC, channels[rank], [CORES[rank % len(CORES)]], TrainerThreads(ctx, 1), "cpu"
                    )
                )
        for trainer in trainers:
            trainer.expect(Ready, 300)
        for iteration, gather in ((0, True), (1, False)):  # a checkpoint due after the first update only
            for trainer, own in zip(trainers, batches):
                trainer.send(Train(iteration, own, decoupled=sharded, is_clip=2.0, gather=gather, version=iteration))
        # what each sent, in order: a State from rank 1 would come before its second Trained
        received = [[trainer.receive() for _ in range(3 - rank)] for rank, trainer in enumerate(trainers)]
    finally:
        for trainer in trainers:
            trainer.close()
        del store
    assert [type(m) for m in received[0]] == [Trained, State, Trained]
    assert [type(m) for m in received[1]] == [Trained, Trained]
    first, state = received[0][0], received[0][1]
    assert state.gathered_after == 0 and weights_sum(state.model) == first.metrics["dist/weights_sum"]
    assert received[1][0].metrics["dist/weights_sum"] == first.metrics["dist/weights_sum"]
    assert isinstance(next(iter(state.optimizer["state"])), str if strategy == "fsdp" else int)  # (FSDP: by name)
    if sharded:  # (rank 0's rows are older than either update's weights; rank 1's of version 0, the first's)
        assert [m.metrics["train/proximal_rows"] for m in (received[0][0], received[0][2])] == [4.0, 4.0]
        assert [m.metrics["train/proximal_rows"] for m in received[1]] == [0.0, 4.0]
        assert all(m.metrics["train/cached_prefix"] == 1.0 for m in (*received[1], received[0][0]))
    # both published the same weights (FSDP: gathered a tensor at a time as they were written)
    assert all(channel.version == 2 for channel in channels)
    assert all(torch.equal(a, b) for a, b in zip(channels[0].state().values(), channels[1].state().values()))


def _publishing_rank(rank: int, port: int, answers: Any) -> None:
    """One rank of `test_a_sharded_publication_gathers_one_tensor_at_a_time`: the peak of its resident memory while
    it publishes, against the size of the whole state."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ebrl.runtime.channel import WeightChannel
    from ebrl.runtime.trainer import publish

    torch.set_num_threads(1)
    os.environ.update(_rank_environment(rank, port))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    module = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)))  # 64 MiB, float32
    whole = {k: v.clone() for k, v in module.state_dict().items()}
    channel = WeightChannel(whole, torch.multiprocessing.get_context("spawn"), torch.float32)
    fully_shard(module)  # (as ebrl.runtime.distributed.shard does a policy)
    publish(module, channel)  # (the first write of the second slot's pages is not what is measured)
    status = Path("/proc/self/status")
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from now
    before = int(re.search(r"VmRSS:\s+(\d+)", status.read_text()).group(1))
    version, fingerprint = publish(module, channel, fingerprint=True)
    peak = int(re.search(r"VmHWM:\s+(\d+)", status.read_text()).group(1))
    same = all(torch.equal(channel.state()[k], v) for k, v in whole.items())
    answers.put(
        (
            rank,
            (peak - before) * 1024,
            sum(v.nbytes for v in whole.values()),
            version,
            same,
            fingerprint == weights_sum(whole),
        )
    )
    dist.destroy_process_group()


def test_a_sharded_publication_gathers_one_tensor_at_a_time() -> None:
    """FSDP's publication after every update gathered the whole state dict on every rank (full_state) before writing
    it; now each tensor is gathered as it is written, so a rank holds one whole tensor beside its shards (here 4 of
    64 MiB), and the channel gets the same weights and fingerprint."""
    import multiprocessing

    from ebrl.runtime.resources import environment

    ctx = multiprocessing.get_context("spawn")
    answers, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=_publishing_rank, args=(rank, port, answers)) for rank in range(2)]
    # every allocation past 64 KiB its own mapping, given back when freed: the resident size is what is held
    with environment({"MALLOC_MMAP_THRESHOLD_": "65536"}):
        for p in ranks:
            p.start()
    results: dict[int, list] = {}
    try:
        deadline = time.monotonic() + 180
        while len(results) < 2 and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in ranks):  # (the other rank would wait for it)
                break
            if not answers.empty():
                rank, *answer = answers.get()
                results[rank] = answer
            time.sleep(0.1)
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert sorted(results) == [0, 1], f"exit codes {[p.exitcode for p in ranks]}"
    for rank, (grew, whole, version, same, fingerprint) in results.items():
        assert version == 2 and same and fingerprint, rank
        assert grew < whole / 3, f"rank {rank} grew by {grew / 2**20:.0f} MiB of a {whole / 2**20:.0f} MiB state"


# --- two ranks, for real -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ranks") / "run"
    # the shaped reward: the ranks' returns tell their episodes apart (sparse ones are all 0 from scratch); bfloat16
    # moments: their stochastic rounding must draw alike on both ranks, while generation draws from each rank's own
    proc = torchrun(
        ["--standalone", "--nproc-per-node", "2"],
        *SMALL,
        *BF16,
        "env.reward=dense",
        "iterations=3",
        "checkpoint_every=1",
        f"hydra.run.dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_two_ranks_train_one_policy_on_both_ranks_data(two_ranks: Path) -> None:
    rows, rank1 = metrics(two_ranks), metrics(two_ranks / "rank1")
    assert len(rows) == len(rank1) == 3
    sums = [row["dist/weights_sum"] for row in rows]
    for row, own in zip(rows, rank1):
        assert row["dist/ranks"] == 2
        # the same weights after every update, on both ranks ...
        assert row["ranks/0/weights_sum"] == row["ranks/1/weights_sum"] == own["dist/weights_sum"]
        # ... made from both ranks' env steps
        assert row["perf/iteration_env_steps"] == 2 * own["perf/iteration_env_steps"] > 0
    assert len(set(sums)) == 3  # every update moved them
    assert rows[-1]["env_steps"] == sum(row["perf/iteration_env_steps"] for row in rows)
    # the ranks ran other episodes (seeds of their own)
    assert any(row["ranks/0/return"] != row["ranks/1/return"] for row in rows)
    ckpt = load_checkpoint(two_ranks / "checkpoints" / "last.pt")  # written once, by rank 0
    assert not (two_ranks / "rank1" / "checkpoints").exists()
    assert (ckpt["iteration"], ckpt["env_steps"]) == (3, rows[-1]["env_steps"])
    assert weights_sum(ckpt["model"]) == sums[-1]
    summary = json.loads((two_ranks / "summary.json").read_text())
    assert summary["env_steps"] == rows[-1]["env_steps"]
    assert summary["rollout_steps_per_s"] > 0


def test_a_run_of_two_ranks_resumes_on_one(two_ranks: Path) -> None:
    before = metrics(two_ranks)
    proc = run_py(*SMALL, *BF16, f"resume={two_ranks}", "iterations=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(two_ranks)
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
    one_rank = metrics(two_ranks / "rank1")[-1]["perf/iteration_env_steps"]  # a rank's steps per iteration
    assert rows[-1]["env_steps"] == before[-1]["env_steps"] + one_rank
    assert "dist/ranks" not in rows[-1]
    assert load_checkpoint(two_ranks / "checkpoints" / "last.pt")["iteration"] == 4


# slow-marked (the default suite's time): the two-rank tests above run one process per rank, and the sharded
# publication's test checks fsdp's gather
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_pipelined_trainers_on_two_nodes_publish_the_same_versions(tmp_path: Path, strategy: str) -> None:
    """Two torchrun agents on localhost, a node each: scheduler=ebrl trains in a process of its own per rank, and
    those trainers form their own group beside the supervisors', data-parallel (ddp) or sharded (fsdp)."""
    run_dir = tmp_path / "run"
    two_nodes(run_dir, "scheduler=ebrl", "iterations=3", "checkpoint_every=2", f"distributed.strategy={strategy}")
    rows = metrics(run_dir)
    assert [row["sched/weights_version"] for row in rows] == [1.0, 2.0, 3.0]
    assert all(row["ranks/0/weights_sum"] == row["ranks/1/weights_sum"] for row in rows)
    assert [row["sched/weights_version"] for row in metrics(run_dir / "rank1")] == [1.0, 2.0, 3.0]
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert ckpt["iteration"] == 3 and weights_sum(ckpt["model"]) == rows[-1]["dist/weights_sum"]
    # the one before, written while the next update was under way, holds its own iteration's weights exactly
    before = load_checkpoint(run_dir / "checkpoints" / "previous.pt")
    assert before["iteration"] == 2 and weights_sum(before["model"]) == rows[1]["dist/weights_sum"]
    if strategy == "fsdp":  # the sharded Adam state, gathered whole by parameter name: it resumes on one rank
        assert all(isinstance(key, str) for key in ckpt["optimizer"]["state"])
        proc = run_py(*SMALL, "scheduler=ebrl", f"resume={run_dir}", "iterations=4")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert metrics(run_dir)[-1]["iteration"] == 4


# the default suite runs colocated with bfloat16 moments (two_ranks above), the schedule whose rounding drew from
# generation's generator; every schedule trains alike with either moments
@pytest.mark.slow
@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
@pytest.mark.parametrize("schedule", ["colocated", "disaggregated", "hybrid", "async", "ebrl"])
def test_every_schedules_replicas_hold_the_same_weights(tmp_path: Path, schedule: str, moments: str) -> None:
    run_dir = tmp_path / "run"
    two_nodes(run_dir, f"scheduler={schedule}", f"algo.optimizer_dtype={moments}", "iterations=2")
    rows, rank1 = metrics(run_dir), metrics(run_dir / "rank1")
    assert (
        [row["ranks/0/weights_sum"] for row in rows]
        == [row["ranks/1/weights_sum"] for row in rows]
        == [row["dist/weights_sum"] for row in rank1]
    )
    assert len(rows) == 2 and rows[0]["dist/weights_sum"] != rows[1]["dist/weights_sum"]


@pytest.mark.slow  # (the default suite's time)
def test_a_killed_rank_stops_the_run_and_its_checkpoint_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "last.pt"
    shm_before = set(os.listdir("/dev/shm"))
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen(
        [
            *TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            "2",
            "run.py",
            *SMALL,
            "iterations=200",
            "checkpoint_every=1",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not ckpt.exists() and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ckpt.exists(), "no checkpoint within 180 s"
        launcher = psutil.Process(agent.pid)
        processes = launcher.children(recursive=True)  # both ranks, their simulators, their helpers
        rank1 = next(p for p in launcher.children() if p.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGKILL)
        output = agent.communicate(timeout=120)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode != 0
    assert f"interrupted by SIGTERM: continue with resume={run_dir}" in output  # rank 0, stopped by torchrun
    time.sleep(1.0)
    alive = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"
    assert set(os.listdir("/dev/shm")) <= shm_before  # the dead rank's shared memory is gone too
    done = load_checkpoint(ckpt)["iteration"]
    assert done >= 1
    proc = run_py(*SMALL, f"resume={run_dir}", f"iterations={done + 1}")  # on one rank
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_checkpoint(ckpt)["iteration"] == done + 1
    assert not math.isnan(metrics(run_dir)[-1]["env/return"])
