"""StageProfile: interpolation on the measured grid, the extrapolation rules, YAML round-trip, file names."""

from __future__ import annotations

import pytest

from ebrl.alloc.profile import Point, ProfileError, StageProfile, linear_profile, profile_path

KEY = {"policy": "openpi", "preset": "tiny", "env": "robosuite", "task": "Lift", "hw": "cpu8", "num_envs": 8}
RESOURCE = {"simulate": "cores", "generate": "core_share", "train": "core_share"}


def grid_profile() -> StageProfile:
    """simulate: sublinear in cores; generate: two batches, the larger one faster and measured at fewer shares."""
    points = [
        Point("simulate", 1, 8, 100.0),
        Point("simulate", 2, 8, 180.0),
        Point("simulate", 4, 8, 300.0),
        Point("generate", 0.5, 4, 50.0),
        Point("generate", 1.0, 4, 90.0),
        Point("generate", 2.0, 4, 120.0),
        Point("generate", 1.0, 16, 200.0),
        Point("generate", 2.0, 16, 440.0),
        Point("train", 1.0, 8, 70.0),
    ]
    return StageProfile(points, KEY, RESOURCE)


def test_rate_is_exact_at_measured_points():
    profile = grid_profile()
    for p in profile.points:
        assert profile.rate(p.stage, p.x, p.batch) == p.rate


def test_rate_is_linear_between_points_and_proportional_below():
    profile = grid_profile()
    assert profile.rate("simulate", 1.5, 8) == pytest.approx(140.0)
    assert profile.rate("simulate", 3, 8) == pytest.approx(240.0)
    assert profile.rate("simulate", 0.5, 8) == pytest.approx(50.0)  # 100 * 0.5 / 1
    assert profile.rate("generate", 0.25, 4) == pytest.approx(25.0)
    assert profile.rate("simulate", 0, 8) == 0.0


def test_rate_above_the_range_continues_the_last_segments_efficiency():
    profile = grid_profile()
    # simulate 2 -> 4 cores: rate x1.667 for x2, efficiency 0.833; at 8 cores the extra 4 yield 0.833 * 300
    assert profile.rate("simulate", 8, 8) == pytest.approx(300 * (1 + (300 / 180) / 2 * 1))
    # generate at batch 16, 1 -> 2 shares: rate x2.2 for x2 is superlinear, capped to proportional
    assert profile.rate("generate", 4.0, 16) == pytest.approx(880.0)
    # a single point: train (not simulate) gets efficiency 0.5, simulate 1
    assert profile.rate("train", 3.0, 8) == pytest.approx(70 * (1 + 0.5 * 2))
    single_sim = StageProfile([Point("simulate", 2, 8, 100.0)])
    assert single_sim.rate("simulate", 6, 8) == pytest.approx(300.0)


def test_rate_is_linear_in_batch_between_measured_batches_and_clamped_outside():
    profile = grid_profile()
    assert profile.rate("generate", 1.0, 10) == pytest.approx(90 + (200 - 90) * 6 / 12)
    # batch 4 has x = 2 but batch 16 is interpolated from its own points at 1.5
    assert profile.rate("generate", 1.5, 8) == pytest.approx(105 + (320 - 105) * 4 / 12)
    # batch 16 never measured x = 0.5: proportional below its least x, then bilinear with batch 4's 50
    assert profile.rate("generate", 0.5, 10) == pytest.approx(50 + (100 - 50) * 6 / 12)
    assert profile.rate("generate", 1.0, 1) == profile.rate("generate", 1.0, 4) == 90.0
    assert profile.rate("generate", 1.0, 64) == profile.rate("generate", 1.0, 16) == 200.0
    assert profile.rate("simulate", 2, 32) == 180.0  # simulate measured at one batch: the same at every batch


def test_unknown_stage_names_the_stage_and_the_stages_it_has():
    profile = StageProfile([Point("simulate", 1, 8, 100.0)])
    with pytest.raises(ProfileError, match="no points for stage 'train'; it has: simulate$"):
        profile.rate("train", 1.0, 8)
    with pytest.raises(ProfileError, match="'generate'"):
        profile.batches("generate")


def test_bad_points_are_rejected():
    with pytest.raises(ProfileError, match="rate > 0"):
        StageProfile([Point("simulate", 1, 8, 0.0)])
    with pytest.raises(ProfileError, match="two points for simulate at x=1, batch=8"):
        StageProfile([Point("simulate", 1, 8, 1.0), Point("simulate", 1.0, 8, 2.0)])
    with pytest.raises(ProfileError, match="resource\\['generate'\\]='gpu': expected one of cores, sm, core_share"):
        StageProfile([], resource={"generate": "gpu"})


def test_corrected_scales_each_stages_rates():
    profile = grid_profile()
    corrected = profile.corrected({"simulate": 0.5, "train": 2.0})
    assert corrected.rate("simulate", 3, 8) == pytest.approx(120.0)
    assert corrected.rate("train", 1.0, 8) == pytest.approx(140.0)
    assert corrected.rate("generate", 1.0, 16) == 200.0
    assert corrected.key == KEY and corrected.resource == RESOURCE
    assert profile.rate("simulate", 3, 8) == pytest.approx(240.0)  # the original is untouched


def test_save_load_round_trip(tmp_path):
    profile = grid_profile()
    path = profile.save(tmp_path / "profiles" / "p.yaml")
    loaded = StageProfile.load(path)
    assert loaded.points == profile.points
    assert loaded.key == KEY and loaded.resource == RESOURCE
    assert loaded.rate("generate", 1.5, 10) == profile.rate("generate", 1.5, 10)
    assert "version: 1" in path.read_text()


@pytest.mark.parametrize(
    "text, problem",
    [
        ("- just\n- a list\n", "not a stage profile"),
        ("version: 2\nkey: {}\nresource: {}\npoints: {}\n", "version 2, expected 1"),
        ("version: 1\nkey: {}\npoints: {}\n", "missing or not a mapping: resource"),
        ("version: 1\nkey: {}\nresource: {}\npoints: {simulate: [{x: 1, rate: 3}]}\n", "malformed point"),
        ("version: 1\nkey: {}\nresource: {}\npoints: {simulate: [{x: 1, batch: 8, rate: -3}]}\n", "rate > 0"),
        ("version: 1\nkey: [unclosed\n", "not YAML"),
    ],
)
def test_load_of_a_broken_file_names_the_file_and_the_problem(tmp_path, text, problem):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        StageProfile.load(path)
    message = str(info.value)
    assert str(path) in message and problem in message and "\n" not in message


def test_profile_path_sanitizes_the_key(tmp_path):
    key = {**KEY, "policy": "openvla/oft", "task": "Pick Place:Can", "hw": "h200.mps-1"}
    assert profile_path(tmp_path, key) == tmp_path / "openvla_oft-tiny_robosuite-Pick_Place_Can_h200.mps-1.yaml"
    with pytest.raises(ProfileError, match="lacks hw"):
        profile_path(tmp_path, {k: v for k, v in KEY.items() if k != "hw"})


def test_matches_lists_the_differing_fields():
    profile = grid_profile()
    assert profile.matches(KEY) == []
    assert profile.matches({"policy": "openpi", "num_envs": "8"}) == []  # compared as text, as YAML may type them
    assert profile.matches({"hw": "h200", "num_envs": 16, "seed": 1}) == ["hw", "num_envs", "seed"]


def test_linear_profile_rate_is_amount_over_cost():
    costs = {"simulate": 0.010, "generate": 0.002, "train": 0.003}
    profile = linear_profile(costs, [4, 8], RESOURCE, KEY, {"simulate": 8, "generate": 8.0, "train": 8.0})
    assert sorted({p.x for p in profile.points if p.stage == "simulate"}) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert sorted({p.x for p in profile.points if p.stage == "train"}) == [1, 2, 3, 4, 5, 6, 7, 8]
    for stage, cost in costs.items():
        assert profile.batches(stage) == [4, 8]
        for x in (0.5, 1, 2.5, 8, 12):
            for batch in (2, 4, 6, 8):
                assert profile.rate(stage, x, batch) == pytest.approx(x / cost)
    with pytest.raises(ProfileError, match="costs\\['train'\\]=0"):
        linear_profile({"train": 0}, [8], RESOURCE, KEY, {"train": 1.0})
