"""The at-scale benchmark end to end on a small workload: costs measured on real simulators and the real policy,
written and read back, and a prediction in virtual time for more envs on more cores than this machine has (no
timings asserted)."""

from __future__ import annotations

import json

import pytest

from ebrl.bench.at_scale import main


def test_costs_are_measured_saved_and_predict_a_bigger_node(tmp_path, capsys):
    small = ["--num-envs", "2", "--iterations", "2", "algo.rollout_chunks=2", "algo.minibatches=1"]
    out = main(["--modes", "colocated", *small, "--save-costs", str(tmp_path / "costs.json")])
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert len(costs["steps"]) == 2 and all(len(s) > 0 and min(s) > 0 for s in costs["steps"])
    assert costs["train_per_row"] > 0 and costs["train_decoupled_per_row"] > 0
    assert costs["generate_fit"][0] + costs["generate_fit"][1] > 0
    assert costs["init"] and costs["init"].endswith("_sft.pt")  # (the run's first weights acted)
    assert out["rows"][0]["simulated"]["env_steps_per_s"] > 0
    bigger = main(
        [
            "--modes",
            "colocated",
            "ebrl",
            *small,
            "--costs",
            str(tmp_path / "costs.json"),
            "--envs",
            "16",
            "--cores",
            "8",
        ]
    )
    for row in bigger["rows"]:
        assert row["simulated"]["envs"] == 16 and row["simulated"]["cores"] == 8
    printed = capsys.readouterr().out
    assert "simulated env steps/s" in printed and "| ebrl | 16 |" in printed


def test_a_gpu_node_without_its_simulator_steps_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["hw=a100x8", "--modes", "ebrl"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sim-step-ms MEAN P99" in err[0]


@pytest.mark.slow  # (the default suite's time)
def test_the_design_cards_command_answers_and_fits_by_default(capsys):
    # pi0 at full size on the paper's 8 A100s: RoboCasa's published steps taken as its default, the replicas' state
    # sharded where one GPU would not hold it
    out = main(
        [
            "policy=openpi",
            "policy.preset=full",
            "env=robocasa",
            "hw=a100x8",
            "--modes",
            "ebrl",
            "--envs",
            "8",
            "--iterations",
            "2",
        ]
    )
    assert "the paper's published RoboCasa steps" in out["costs"]["simulator steps"]
    assert "(FSDP)" in out["capacity"]["memory"] and out["capacity"]["memory"].endswith("it fits")
    assert out["rows"][0]["simulated"]["env_steps_per_s"] > 0
