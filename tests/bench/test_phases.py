"""The Lift phases benchmark on the real simulator: the scripted expert goes through every phase, the shipped SFT
policy is measured through the checkpoint path mode=eval takes, and a task it cannot read is one line."""

from __future__ import annotations

import pytest

from ebrl.bench.phases import PHASES, TRACES, main
from ebrl.runs.init import SHIPPED

SFT = next(iter(SHIPPED.values()))


@pytest.mark.slow  # (the default suite's time: 12 s)
def test_the_expert_passes_every_phase_and_a_checkpoint_is_measured_as_it_acts(capsys):
    expert = main(["--expert", "--episodes", "2", "--envs", "2"])
    assert expert["phases"] == dict.fromkeys(PHASES, 2)
    assert expert["steps"][-1] == 40 and all(len(v) == len(expert["steps"]) for v in expert["traces"].values())
    assert expert["traces"]["rise"][-1] > 0.1 and expert["traces"]["squeezing"][-1] == 1.0

    sft = main([f"checkpoint={SFT}", "--episodes", "2", "--envs", "2", "--stochastic"])
    assert sft["episodes"] == 2 and set(sft["traces"]) == set(TRACES)
    assert sft["steps"][:2] == [1, 9]  # a decision every policy.execute (the tiny chunk's 8) steps
    counts = [sft["phases"][k] for k in ("squeezed", "touched")]
    assert counts[0] <= counts[1]  # a squeeze is a touch
    assert sft["phases"]["lifted"] <= min(sft["phases"]["succeeded"], sft["phases"]["squeezed"])
    assert "| reached | touched | squeezed | raised | succeeded | lifted |" in capsys.readouterr().out


def test_a_task_other_than_lift_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--expert", "env.task=Stack"])
    assert stop.value.code == 2
    assert "the phases benchmark reads robosuite Lift's state; env=robosuite env.task=Stack" in capsys.readouterr().err
