"""The Lift phases benchmark on the real simulator: the scripted expert goes through every phase, the shipped SFT
policy is loaded as mode=eval loads it and its episodes are mode=eval's step for step, and a task it cannot read is
one line."""

from __future__ import annotations

import tempfile

import pytest
from omegaconf import OmegaConf

from ebrl.bench.memory import compose
from ebrl.bench.phases import PHASES, TRACES, main, policy_actor, run_episodes
from ebrl.envs.process import build_adapter
from ebrl.runs.evaluation import Evaluation, episode_seed
from ebrl.runs.init import SHIPPED

SFT = next(iter(SHIPPED.values()))


@pytest.mark.slow  # (the default suite's time: 25 s)
def test_the_expert_passes_every_phase_and_a_checkpoint_is_measured_as_it_acts(capsys):
    expert = main(["--expert", "--episodes", "2", "--envs", "2"])
    assert expert["phases"] == dict.fromkeys(PHASES, 2)
    assert expert["steps"][-1] == 40 and all(len(v) == len(expert["steps"]) for v in expert["traces"].values())
    assert expert["traces"]["rise"][-1] > 0.1 and expert["traces"]["squeezing"][-1] == 1.0

    sft = main([f"checkpoint={SFT}", "--episodes", "2", "--envs", "2", "--stochastic"])
    assert sft["episodes"] == 2 and set(sft["traces"]) == set(TRACES)
    assert sft["steps"][:2] == [1, 9]  # a decision every policy.execute (the tiny chunk's 8) steps
    assert "| reached | touched | squeezed | raised | succeeded | lifted |" in capsys.readouterr().out

    # the episodes are mode=eval's (deterministic), step for step: each succeeds at the step it ends at there
    cfg = compose(f"checkpoint={SFT}", "mode=eval", "eval.episodes=4", "eval.videos=0", "env.num_envs=4")
    with tempfile.TemporaryDirectory() as folder:
        evaluated = Evaluation.from_config(cfg, folder).run().per_episode
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    adapters = [build_adapter(env_cfg, seed=i) for i in range(4)]
    try:
        act, execute = policy_actor(cfg, adapters[0].spec.instruction, 4, stochastic=False)
        traces = run_episodes(adapters, act, 4, [episode_seed(0, j) for j in range(4)], 40, execute)
    finally:
        for a in adapters:
            a.close()
    first = [next((k + 1 for k, r in enumerate(t) if r["success"]), None) for t in traces]
    assert first == [e["length"] if e["success"] else None for e in evaluated]
    assert any(first)  # (the shipped policy lifts in some of them)


def test_a_task_other_than_lift_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--expert", "env.task=Stack"])
    assert stop.value.code == 2
    assert "the phases benchmark reads robosuite Lift's state; env=robosuite env.task=Stack" in capsys.readouterr().err
