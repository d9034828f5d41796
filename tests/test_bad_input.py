"""Every bad input in one table: the override, and the one line that stops the run before anything starts.

Most are rejected in-process, as run.py does first: Hydra at composition (a group option that does not exist, with
Hydra's own message), then `check_mode` and `validate` (ConfigError, one line). The rest are rejected while run.py
builds the run (the env in its workers, the resume folder, the allocator's stage profile): those go through run.py.
`python -m tests.test_bad_input` prints the table with the real messages as markdown.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from ebrl.checks import validate
from ebrl.config import ConfigError
from ebrl.node import cuda_device_count
from ebrl.runs.evaluation import check_mode
from tests.conftest import compose_config
from tests.runs.test_run import run_py

MORE_CORES = (os.cpu_count() or 1) + 1
OTHER_POLICY = "openvla_oft"  # the run's is the default, openpi
OTHER_POLICY_PROFILE = f"{{tmp}}/{OTHER_POLICY}-tiny_robosuite-Lift_cpu.yaml"
on_cpu = pytest.mark.skipif(cuda_device_count() > 0, reason="this machine has CUDA GPUs")


# (overrides, a distinctive part of the message); {tmp} is a fresh folder (the test's tmp_path)
BAD_INPUTS: list = [
    # counts that must be positive
    (("env.num_envs=0",), "env.num_envs=0 must be a positive number"),
    (("env.num_envs=-2",), "env.num_envs=-2 must be a positive number"),
    (("env.max_episode_steps=0",), "env.max_episode_steps=0 must be a positive number"),
    (("iterations=0",), "iterations=0 must be a positive number"),
    (("checkpoint_every=0",), "checkpoint_every=0 must be a positive number"),
    (("algo.epochs=0",), "algo.epochs=0 must be a positive number"),
    (("algo.minibatches=0",), "algo.minibatches=0 must be a positive number"),
    (("algo.rollout_chunks=0",), "algo.rollout_chunks=0 must be a positive number"),
    (("policy.chunk=0",), "policy.chunk=0 must be a positive number"),
    (("hw.cpu_cores=-1",), "hw.cpu_cores=-1 must be a positive number"),
    (("hw.nodes=0",), "hw.nodes=0 must be a positive number"),
    (("scheduler=ebrl", "scheduler.groups=0"), "scheduler.groups=0 must be between 1 and env.num_envs=8"),
    (("scheduler=ebrl", "scheduler.queue_size=0"), "scheduler.queue_size=0 must be >= 1 or null"),
    (
        ("scheduler=ebrl", "scheduler.generation=gpu"),
        "scheduler.generation='gpu' is not available; accepted: supervisor, process",
    ),
    (("mode=eval", "checkpoint={tmp}", "eval.episodes=0"), "eval.episodes=0 must be at least 1"),
    (("hw.gpus=-1",), "hw.gpus=-1 must be >= 0"),
    (("algo.max_nonfinite_updates=0",), "algo.max_nonfinite_updates=0 must be a positive number"),
    (("scheduler.max_sim_failures=-1",), "scheduler.max_sim_failures=-1 must be >= 0"),
    (("scheduler.chunk_timeout_s=0",), "scheduler.chunk_timeout_s=0.0 must be > 0 seconds, or null"),
    (("env.fault.kind=boom",), "env.fault.kind='boom' is not available; accepted: hang, error, exit"),
    # more than this machine has
    ((f"hw.cpu_cores={MORE_CORES}",), f"hw.cpu_cores={MORE_CORES} (hw=cpu) is more than the"),
    pytest.param(("hw=a100x8",), "hw=a100x8 needs 8 CUDA GPUs and this machine has none", marks=on_cpu),
    pytest.param(("hw=h200x1",), "hw=h200x1 needs 1 CUDA GPU and this machine has none", marks=on_cpu),
    pytest.param(
        ("device=cuda",),
        "device=cuda needs a CUDA GPU and this machine has none; use device=auto or device=cpu",
        marks=on_cpu,
    ),
    (
        ("hw.cpu_cores=1", "scheduler=ebrl"),
        "scheduler=ebrl simulates, generates and trains side by side and needs at least 2 CPU cores; this rank has 1",
    ),
    (("hw.nodes=2",), "hw=cpu spans 2 nodes and this is one process; launch one per node: torchrun --nnodes 2"),
    # staleness and the pipelined schedules
    (("scheduler=ebrl", "scheduler.max_staleness=-1"), "scheduler.max_staleness=-1 must be >= 0"),
    (("scheduler=ebrl", "scheduler.max_ahead=0"), "scheduler.max_ahead=0 must be >= 1"),
    (
        ("scheduler=ebrl", "algo=grpo", "scheduler.max_ahead=2", "scheduler.max_staleness=1"),
        "scheduler.max_staleness=1 below scheduler.max_ahead=2 drops the quick episodes' steps from GRPO's loss",
    ),
    (("sweep=stages", "iterations=2"), "iterations=2: a sweep trial measures its stages between its first iteration"),
    (("scheduler=ebrl", "scheduler.sim_nice=-1"), "scheduler.sim_nice=-1 must be a nice value from 0 (none) to 19"),
    (
        ("scheduler=ebrl", "algo=grpo", "scheduler.groups=3"),
        "scheduler.groups=3 must be between 1 and 2 with algo=grpo: a group of the schedule holds whole GRPO groups",
    ),
    (
        ("scheduler=colocated", "scheduler.overlap=true"),
        "scheduler.trainer=local trains in the supervisor between two "
        "rollouts and scheduler.overlap=True overlaps training",
    ),
    (
        ("scheduler=ebrl", "scheduler.decoupled=false", "policy.dtype=bfloat16"),
        "scheduler.decoupled=False with scheduler.overlap=True clips around the stale behaviour policy, and a bfloat16 "
        "policy (policy.dtype=bfloat16) has no exact log-probs of it; use scheduler.decoupled=true or "
        "policy.dtype=float32",
    ),
    (
        ("scheduler=ebrl", "scheduler.decoupled=false", "policy.preset=full"),
        "a bfloat16 policy (policy.dtype=null: bfloat16 on a GPU or the full preset) has no exact log-probs of it",
    ),
    (("scheduler=ebrl", "scheduler.trainer=gpu"), "scheduler.trainer='gpu' is not available; accepted: process, local"),
    (
        ("scheduler=ebrl", "scheduler.core_order=random"),
        "scheduler.core_order='random' is not available; accepted: longest, readiness",
    ),
    (
        ("scheduler=disaggregated", "scheduler.train_share=1.5"),
        "scheduler.train_share=1.5 must give training at least one of the",
    ),
    # batch sizes that cannot divide
    (
        ("algo.minibatches=3",),
        "algo.minibatches=3 does not divide the rollout batch env.num_envs x algo.rollout_chunks = 80",
    ),
    (
        ("algo=grpo", "env.num_envs=6", "algo.group_size=4"),
        "env.num_envs=6 is not a multiple of algo.group_size=4; with algo=grpo use env.num_envs=4, 8, 12",
    ),
    (("algo=grpo", "algo.minibatches=3"), "algo.minibatches=3 does not divide env.num_envs=8"),
    (("algo=grpo", "algo.group_size=1"), "algo.group_size=1 must be at least 2"),
    # options that do not exist: a group's (Hydra's own message, at composition) or a value's
    (("scheduler=pipelined",), "Could not find 'scheduler/pipelined'"),
    (("algo=a2c",), "Could not find 'algo/a2c'"),
    (
        ("scheduler.name=pipelined",),
        "scheduler.name='pipelined' is not available; accepted: colocated, disaggregated, hybrid, async, ebrl",
    ),
    (("algo.name=a2c",), "algo.name='a2c' is not available; accepted: ppo, grpo, sft"),
    (("policy.preset=huge",), "policy.preset='huge' is not available; accepted: tiny, small, full"),
    (("policy.dtype=float16",), "policy.dtype='float16' is not available; accepted: float32, bfloat16"),
    (("policy.train=vision",), "policy.train='vision' is not available; accepted: all, action_expert, lora"),
    (("policy.train=lora", "policy.lora_rank=0"), "policy.lora_rank=0 must be a positive number"),
    (("algo.optimizer_dtype=int8",), "algo.optimizer_dtype='int8' is not available; accepted: float32, bfloat16"),
    (("algo.micro_batch=0",), "algo.micro_batch=0 must be a positive number"),
    (("device=tpu",), "device='tpu' is not available; accepted: auto, cpu, cuda"),
    (("env.reward=shaped",), "env.reward='shaped' is not available; accepted: dense, sparse"),
    (("env.grasp=held",), "env.grasp='held' is not available; accepted: contact, squeeze"),
    (
        ("env.reward=dense", "env.terminate_on_success=true"),
        "env.terminate_on_success=True with env.reward=dense: robosuite's shaped reward pays before success too",
    ),
    (("mode=test",), "mode='test' is not available; accepted: train, eval"),
    # the allocator
    (("allocator.ema=0",), "allocator.ema=0.0 must be in (0, 1]"),
    (("scheduler=ebrl", "allocator.window=0"), "allocator.window=0 must be >= 1"),
    (("allocator.min_gain=-0.1",), "allocator.min_gain=-0.1 must be >= 0"),
    (
        ("allocator=elastic",),
        "allocator=elastic moves resources between the stages' processes and "
        "scheduler=colocated runs every stage in one; use scheduler=ebrl",
    ),
    # checkpoints
    (("mode=eval",), "mode=eval needs checkpoint=<run folder or its checkpoints/last.pt>"),
    (("mode=eval", "checkpoint={tmp}/no-such-run"), "checkpoint={tmp}/no-such-run does not exist; give a run folder"),
    (("checkpoint={tmp}",), "checkpoint={tmp} is read by mode=eval only; to continue a run use resume=<run folder>"),
    # numbers outside their range
    (("seed=-1",), "seed=-1 must be between 0 and 2**32 - 1"),
    (("algo.clip=-0.2",), "algo.clip=-0.2 must be > 0"),
    (("algo.clip_high=0",), "algo.clip_high=0.0 must be > 0 (0.28 in DAPO), or null (clip)"),
    (("algo.value_clip=-1",), "algo.value_clip=-1.0 must be > 0, or null (no value clip)"),
    (("algo.adam_betas=[0.9]",), "algo.adam_betas=[0.9] must be two numbers in [0, 1), e.g. [0.9, 0.999]"),
    (("algo.weight_decay=-0.01",), "algo.weight_decay=-0.01 must be >= 0 (AdamW's decoupled decay; 0: Adam)"),
    (("algo.gamma=1.5",), "algo.gamma=1.5 must be in (0, 1]"),
    (("algo.gae_lambda=-0.5",), "algo.gae_lambda=-0.5 must be in [0, 1]"),
    (("algo.max_grad_norm=0.0",), "algo.max_grad_norm=0.0 must be > 0"),
    (("algo.target_kl=-0.01",), "algo.target_kl=-0.01 must be > 0, or null"),
    (("distributed.timeout_s=0.0",), "distributed.timeout_s=0.0 must be > 0"),
    # demonstrations, SFT and where the first weights come from
    (("algo=sft", "algo.batch_size=0"), "algo.batch_size=0 must be a positive number"),
    (("algo=sft", "demos.valid=1.0"), "demos.valid=1.0 must be in [0, 1) (the share of episodes held out)"),
    (("algo.critic_warmup=-1",), "algo.critic_warmup=-1 must be >= 0"),
]

# Rejected while run.py builds the run, after validate: checked through run.py
AT_RUN = [
    (("env.task=NoSuchTask",), "env.task='NoSuchTask' is not a robosuite task; choose one of: Door, Lift"),
    (("resume={tmp}/no-such-run",), "resume={tmp}/no-such-run is not a run folder"),
    (
        ("scheduler=ebrl", f"allocator.profile={OTHER_POLICY_PROFILE}"),
        f"was measured for policy={OTHER_POLICY}, and this run has policy=openpi; run python sweep.py -m",
    ),
    (
        ("scheduler=ebrl", "allocator.profile={tmp}/no-such-profile.yaml"),
        "allocator.profile={tmp}/no-such-profile.yaml: no such file; give a stage profile written by sweep.py",
    ),
    (("algo=sft",), "algo=sft trains on demonstrations: give demos.path=<folder or .hdf5>"),
    (("algo=sft", "demos.path={tmp}/no-demos"), "demos.path={tmp}/no-demos does not exist; give an .hdf5 file"),
    (
        ("init={tmp}/no-such-run",),
        "init={tmp}/no-such-run is neither a run folder with checkpoints/last.pt nor a checkpoint file",
    ),
    (("init={tmp}", "policy.checkpoint={tmp}"), "init={tmp} and policy.checkpoint={tmp} both give the first weights"),
]
BAD_INPUTS += AT_RUN


def row_values(row: object) -> tuple[tuple[str, ...], str]:
    return tuple(row.values) if hasattr(row, "values") else row  # pytest.param or a plain tuple


RUN_PY_ROWS = {row_values(r)[0] for r in AT_RUN}


def in_folder(tmp: Path, overrides: tuple[str, ...], needle: str) -> tuple[list[str], str]:
    """The row with {tmp} filled in (and the stage profile of another policy written there if it names it)."""
    if OTHER_POLICY_PROFILE in " ".join(overrides):
        from ebrl.alloc.allocator import profile_key
        from ebrl.alloc.profile import linear_profile

        key = profile_key(compose_config("scheduler=ebrl", f"policy={OTHER_POLICY}"))  # this run's key, another policy
        linear_profile(
            {"simulate": 0.015, "generate": 0.001, "train": 0.002},
            [4],
            {"simulate": "cores", "generate": "core_share", "train": "core_share"},
            key,
            {"simulate": 2.0, "generate": 2.0, "train": 2.0},
        ).save(OTHER_POLICY_PROFILE.format(tmp=tmp))
    return [o.format(tmp=tmp) for o in overrides], needle.format(tmp=tmp)


def rejection(overrides: list[str]) -> tuple[str, Exception | None]:
    """What stops these overrides in-process, and where, in run.py's order: composition, check_mode, validate."""
    try:
        cfg = compose_config(*overrides)
    except ConfigCompositionException as e:
        return "Hydra", e
    for stage, check in (("check_mode", check_mode), ("validate", validate)):
        try:
            check(cfg)
        except ConfigError as e:
            return stage, e
    return "nothing", None


def run_rejection(overrides: list[str], tmp: Path) -> tuple[int, str, bool]:
    """run.py's exit code and stderr for these overrides, and whether it left its run folder behind."""
    run_dir = tmp / "never"
    proc = run_py(*overrides, f"hydra.run.dir={run_dir}", timeout=120)
    return proc.returncode, proc.stderr, run_dir.exists()


@pytest.mark.parametrize("overrides,needle", BAD_INPUTS, ids=[" ".join(row_values(r)[0]) for r in BAD_INPUTS])
def test_bad_input_is_one_line_before_anything_starts(tmp_path, overrides, needle):
    at_run = overrides in RUN_PY_ROWS
    overrides, needle = in_folder(tmp_path, overrides, needle)
    if at_run:
        code, stderr, left = run_rejection(overrides, tmp_path)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2, stderr[-2000:]
        assert "Traceback" not in stderr, stderr[-2000:]
        assert lines[-1].startswith("error: ") and needle in lines[-1], stderr[-2000:]
        assert not left, "run.py left its run folder behind"
        return
    stage, error = rejection(overrides)
    assert error is not None, f"accepted: {' '.join(overrides)}"
    if stage == "Hydra":  # Hydra's own message: the missing option on its first line, then the available ones
        assert needle in str(error).splitlines()[0]
    else:
        assert "\n" not in str(error), str(error)
        assert needle in str(error), str(error)


def markdown_table() -> str:
    """The table with the messages the code gives now (the run.py rows run it)."""
    out = ["| overrides | rejected by | message |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for row in BAD_INPUTS:
            template, _ = row_values(row)
            overrides, _ = in_folder(tmp, template, "")
            if template in RUN_PY_ROWS:
                code, stderr, _ = run_rejection(overrides, tmp)
                lines = [line for line in stderr.splitlines() if line.strip()]
                stage, message = f"run.py (exit {code})", lines[-1] if lines else "(nothing on stderr)"
            else:
                stage, error = rejection(overrides)
                message = "(accepted)" if error is None else str(error).splitlines()[0]
            message = message.replace(str(tmp), "<tmp>")
            shown = " ".join(template).replace("{tmp}", "<tmp>")
            escaped = message.replace("|", r"\|")
            out.append(f"| `{shown}` | {stage} | {escaped} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
