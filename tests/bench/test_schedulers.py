"""The scheduler benchmark on a minimal workload: every row measured, positive, with a finite limit (no timings)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ebrl.bench.schedulers import GYM_E2E, GYM_ROLLOUT, SIM_ONLY, STAGES, limits_of, main, round_order

MINIMAL = [
    "--num-envs",
    "2",
    "--iterations",
    "2",
    "--repeats",
    "1",
    "--rollout-chunks",
    "2",
    "algo.minibatches=2",
    "algo.epochs=1",
    "scheduler.torch_threads=1",
    "env.max_episode_steps=12",
]


@pytest.mark.slow  # (the default suite's time)
def test_benchmark_reports_every_row(tmp_path, capsys):
    # (3 iterations: with 2, a fast simulator lets the pipelined mode's rollout of the measured second iteration run
    # entirely during the first one's update, and that iteration holds no simulation to share the CPU with)
    result = main(
        [
            *MINIMAL,
            "--iterations",
            "3",
            "--modes",
            "colocated",
            "ebrl[scheduler.groups=2]",
            "--json",
            str(tmp_path / "bench.json"),
            "--foreign-load",
            "1",
            "--foreign-pinned",
        ]
    )
    rows = {r["row"]: r for r in result["rows"]}
    loaded = ["colocated +1 busy pinned", "ebrl[scheduler.groups=2] +1 busy pinned"]
    assert list(rows) == ["colocated", "ebrl[scheduler.groups=2]", *loaded, SIM_ONLY, GYM_ROLLOUT, GYM_E2E]
    assert [result["under_load"][mode]["kept"] for mode in result["stages"]] == [
        rows[row]["env_steps_per_s"] / rows[mode]["env_steps_per_s"] for mode, row in zip(result["stages"], loaded)
    ]
    for r in rows.values():
        assert r["env_steps_per_s"] > 0 and len(r["per_round"]) == 1 and r["min"] == r["max"] == r["per_round"][0]
        assert math.isfinite(r["limit"]) and r["limit"] > 0 and r["achieved_over_limit"] > 0
    assert rows["colocated"]["vs_first_mode"] == 1.0
    assert all(result["cpu_s_per_env_step"][s] > 0 for s in STAGES)
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["row"] == "colocated"
    table = capsys.readouterr().out
    for name in rows:
        assert f"| {name} |" in table
    assert "CPU ms per env step" in table
    stages = result["stages"]["ebrl[scheduler.groups=2]"]  # where the pipelined mode's time went
    assert 0 < stages["cpu_share_simulate"] <= 1 and stages["cpu_share_trainer"] > 0 and stages["busy_train"] > 0


def test_a_foreign_load_is_busy_at_nice_0_where_it_is_pinned_and_gone_after():
    import os
    import time

    from ebrl.bench.load import foreign_load
    from ebrl.envs.worker import process_cpu_seconds

    core = sorted(os.sched_getaffinity(0))[-1]
    with foreign_load(2, [core]) as pids:
        time.sleep(0.5)
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == 0 and os.sched_getaffinity(pid) == {core} for pid in pids)
        assert all(process_cpu_seconds(pid) > 0.1 for pid in pids)  # (busy: two on one core, half each)
    assert all(process_cpu_seconds(pid) is None for pid in pids)


def test_rounds_alternate_the_order_of_the_modes():
    assert [round_order(["a", "b", "c"], i) for i in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_the_limit_on_a_gpu_node_shares_the_gpu_between_generation_and_training():
    # 10 ms of CPU per simulated step on 16 cores (1600 steps/s); 0.5 ms of GPU for generation and 1 ms for training
    cost = {"simulate": 0.010, "generate": 0.0005, "train": 0.001}
    assert limits_of(cost, 16, gpu=True) == pytest.approx(
        {"sim+gen+train": 1 / 0.0015, "sim": 1600.0, "sim+gen": 1600.0}
    )
    assert limits_of(cost, 16, gpu=False)["sim+gen+train"] == pytest.approx(16 / 0.0115)  # on CPU all share cores


def test_benchmark_rejects_an_unknown_mode_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--modes", "colocated", "pipelined"])
    err = capsys.readouterr().err
    assert "--modes pipelined: not a scheduler; accepted: colocated, disaggregated, hybrid, async, ebrl" in err


def test_straggler_envs_match_the_base_spec_and_step_more_substeps():
    from ebrl.bench.stragglers import StragglerEnv

    kwargs = dict(
        inner_target="ebrl.envs.robosuite_env.RobosuiteEnv",
        straggler_envs=1,
        straggler_task="Stack",
        task="Lift",
        max_episode_steps=12,
        control_freq=20,
    )
    straggler, normal = StragglerEnv(seed=0, **kwargs), StragglerEnv(seed=1, **kwargs)
    try:
        assert straggler.straggler and not normal.straggler
        assert straggler.spec == normal.spec  # one pool, one policy
        assert straggler.env.task == "Stack" and straggler.env.env.control_freq == 20 // 3
        obs, result = straggler.run_chunk(np.zeros((3, straggler.spec.action_dim), np.float32))
        assert obs["state"].shape == straggler.spec.obs["state"].shape and result.executed == 3
    finally:
        straggler.close()
        normal.close()


def test_a_straggler_may_slow_down_mid_run_at_its_next_reset():
    from ebrl.bench.stragglers import StragglerEnv

    env = StragglerEnv(
        inner_target="ebrl.envs.robosuite_env.RobosuiteEnv",
        straggler_envs=1,
        straggler_after_steps=3,
        task="Lift",
        max_episode_steps=12,
        control_freq=20,
        seed=0,
    )
    try:
        assert not env.slow and env.env.env.control_freq == 20
        env.begin_episode()
        env.run_chunk(np.zeros((3, env.spec.action_dim), np.float32))
        assert not env.slow  # within the episode nothing changes
        spec = env.spec
        env.begin_episode()
        assert env.slow and env.env.env.control_freq == 20 // 3 and env.spec == spec
    finally:
        env.close()


def test_under_grpo_a_straggler_is_a_whole_group_in_the_run_and_its_references():
    """A GRPO group's envs are built from one seed (alike); the straggler knob counts by seed, so it must count groups:
    12 envs in groups of 4 with a quarter straggling were 12 stragglers in the run and 3 in the references' pools,
    whose limit was then the wrong workload's (every schedule 'at 0.32-0.40 of its limit')."""
    from omegaconf import OmegaConf

    from ebrl.bench.schedulers import Workload, compose, group_size
    from ebrl.envs.process import build_adapter
    from ebrl.envs.worker import env_seed

    workload = Workload(num_envs=4, stragglers=0.5, straggler_slowdown=2, overrides=["algo=grpo", "algo.group_size=2"])
    cfg = compose(workload)
    assert group_size(cfg) == 2 and cfg.env.straggler_envs == 1  # one group of two
    flags = []
    for i in range(4):  # the adapter a worker of the run's pool, or of the references', builds for env i
        adapter = build_adapter(OmegaConf.to_container(cfg.env), env_seed(cfg.seed, i, group_size(cfg)))
        flags.append(adapter.straggler)
        adapter.close()
    assert flags == [True, True, False, False]
    assert compose(Workload(num_envs=4, stragglers=0.5)).env.straggler_envs == 2  # PPO: envs
    from ebrl.checks import validate

    validate(compose(Workload(num_envs=4, stragglers=0.5), "ebrl"))  # (a plain config: every policy key a known one)


def test_the_references_time_ppos_update_under_grpo_too():
    """GRPO's schema has neither a rollout length nor a critic; the yardsticks (the simulators alone for
    algo.rollout_chunks chunks, one PPO update) take the run's values over PPO's schema: what the one algo schema
    of every algorithm gave them, the value loss at GRPO's weight 0."""
    from omegaconf import OmegaConf

    from ebrl.bench.schedulers import reference_algo
    from tests.conftest import compose_config

    ppo = compose_config()
    assert reference_algo(ppo) is ppo.algo
    grpo = compose_config("algo=grpo", "algo.epochs=3")
    ref = OmegaConf.to_container(reference_algo(grpo))
    assert (ref["rollout_chunks"], ref["gamma"], ref["value_coef"], ref["epochs"]) == (10, 0.99, 0.0, 3)
    assert ref["critic_lr"] == OmegaConf.to_container(compose_config("algo=ppo").algo, resolve=True)["critic_lr"]
    assert ref["normalize_advantages"] is False  # (GRPO's own value)


def test_a_workload_the_config_refuses_is_one_line_from_the_command_line():
    """`python -m ebrl.bench.*` stops as run.py does: the config's line, exit 2 (before any simulator starts)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ebrl.bench.schedulers",
            "--num-envs",
            "15",
            "--iterations",
            "2",
            "--repeats",
            "1",
            "--modes",
            "colocated",
            "--no-gym",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: algo.minibatches=4 does not divide the rollout batch env.num_envs x algo.rollout_chunks = 150"
    ]


def test_a_benchmark_that_fails_says_so_in_one_line_and_keeps_the_traceback():
    import subprocess
    import sys

    code = "from ebrl.runtime.errors import benchmark_main\nbenchmark_main(lambda: 1 / 0, 'sim_speed')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: the benchmark sim_speed failed: ZeroDivisionError: division by zero (traceback in ")
    traceback_file = line.split("(traceback in ")[1].rstrip(")")
    assert "ZeroDivisionError" in open(traceback_file).read() and "in benchmark_main" in open(traceback_file).read()
