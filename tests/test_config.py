"""Every config composes; typos fail in Hydra; values that cannot work fail with one line."""

import itertools
import re

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from ebrl.checks import _check_allocator, validate
from ebrl.config import ALGO_SCHEMAS, ConfigError
from tests.conftest import CONF, compose_config, group_options

POLICIES, ENVS, HWS = group_options("policy"), group_options("env"), group_options("hw")


def test_groups_ship_what_the_design_names():
    assert {"robosuite", "maniskill", "libero", "robocasa"} <= set(ENVS)
    assert {"cpu", "a100x8", "h100x8", "h200x1"} <= set(HWS)
    assert {"openpi", "openvla_oft", "gr00t", "wam"} <= set(POLICIES)
    for group in ("scheduler", "allocator", "algo", "logger"):
        assert group_options(group), group


@pytest.mark.parametrize("policy,env,hw", list(itertools.product(POLICIES, ENVS, HWS)))
def test_every_combination_composes(policy, env, hw):
    cfg = compose_config(f"policy={policy}", f"env={env}", f"hw={hw}")
    assert cfg.policy.name == policy and cfg.env.name == env and cfg.hw.name == hw
    assert cfg.env._target_.startswith("ebrl.envs.")


def test_every_hw_states_its_node():
    for hw in HWS:
        cfg = compose_config(f"hw={hw}").hw
        if hw != "cpu":
            assert cfg.cpu_cores > 0 and cfg.gpus > 0 and cfg.gpu_memory_gb > 0 and cfg.sm_count > 0


@pytest.mark.parametrize(
    "override,error",
    [
        ("hw.gpu=8", ConfigCompositionException),  # misspelled key
        ("env.num_envs=many", ConfigCompositionException),  # wrong type
        ("policy=nope", ConfigCompositionException),  # unknown option
    ],
)
def test_composition_errors(override, error):
    with pytest.raises(error):
        compose_config(override)


@pytest.mark.parametrize(
    "algo,key",
    [
        ("grpo", "critic_lr=1e-3"),
        ("grpo", "rollout_chunks=4"),
        ("grpo", "gamma=0.9"),
        ("sft", "epochs=2"),
        ("sft", "clip=0.1"),
        ("sft", "group_size=2"),
        ("ppo", "group_size=2"),
        ("ppo", "batch_size=8"),
    ],
)
def test_a_key_of_another_algorithm_fails_at_composition_as_a_misspelled_one(algo, key):
    """Each algorithm has a schema of its own (ebrl/config.py, ALGO_SCHEMAS): GRPO has no critic nor rollout length,
    SFT no rollout at all, PPO no groups nor demonstration batches."""
    with pytest.raises(ConfigCompositionException) as e:
        compose_config(f"algo={algo}", f"algo.{key}")
    assert f"Key '{key.split('=')[0]}' not in '{ALGO_SCHEMAS[algo].__name__}'" in str(e.value.__cause__)


def test_every_algorithm_has_its_schema_and_its_check():
    from ebrl.checks import ALGO_CHECKS, ALGOS

    assert list(ALGO_SCHEMAS) == list(ALGO_CHECKS) == list(ALGOS) and set(ALGOS) == set(group_options("algo"))
    for algo, schema in ALGO_SCHEMAS.items():
        cfg = compose_config(f"algo={algo}")
        assert OmegaConf.get_type(cfg, "algo") is schema and cfg.algo.name == algo
        assert f"/schema/algo/{algo}_schema@_here_" in (CONF / "algo" / f"{algo}.yaml").read_text()
        validate(cfg)  # (the defaults: each algorithm's check passes them)


def test_schemas_are_no_options_of_their_groups():
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        loader = GlobalHydra.instance().config_loader()
        for group in ("env", "policy", "hw", "scheduler", "allocator", "algo", "logger", "experiment", "debug"):
            assert loader.get_group_options(group) == group_options(group), group  # the yaml files, no *_schema
    with pytest.raises(MissingConfigException):
        compose_config("scheduler=scheduler_schema")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["algo.rollout_chunks=-1"], "algo.rollout_chunks=-1"),
        (["scheduler=ebrl", "scheduler.sim_nice=25"], "scheduler.sim_nice=25 must be a nice value from 0 (none) to 19"),
        (["env.num_envs=3", "algo.rollout_chunks=3", "algo.minibatches=4"], "does not divide the rollout batch"),
        (["hw.cpu_cores=4096"], "hw.cpu_cores=4096 (hw=cpu) is more than the"),
        (["policy.noise_std_min=0.9"], "must satisfy 0 < min <= max"),
        (["policy.logprob=ddim"], "policy.logprob='ddim' is not available; accepted: flow_noise, flow_sde"),
        (["policy.variant=pi1"], "policy.variant='pi1' is not available; accepted: pi0, pi05"),
        (
            ["scheduler=disaggregated", "allocator=elastic"],
            "allocator=elastic would move the cores that scheduler.train_share=0.5 fixes",
        ),
        (
            ["scheduler=hybrid", "allocator=elastic"],
            "allocator=elastic moves resources between stages that run "
            "side by side and scheduler=hybrid runs rollout and training "
            "one after the other",
        ),
        (["scheduler=ebrl", "allocator.simulate=64"], "allocator.simulate=64 must be in (0, "),
        (["hw.sm_partition=green"], "hw.sm_partition=green shares the SMs of a GPU and hw=cpu has none"),
        (["hw.sm_partition=slices"], "hw.sm_partition='slices' is not available; accepted: none, mps, green"),
    ],
)
def test_values_that_cannot_work(overrides, needle):
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_defaults_validate():
    validate(compose_config())


def test_green_contexts_are_refused_for_a_run_of_two_processes():
    """Past the GPU count (this machine fails that first): green contexts split SMs only within one process."""
    for scheduler in ("ebrl", "colocated"):
        with pytest.raises(ConfigError, match="hw.sm_partition=green splits SMs between the streams of one process"):
            _check_allocator(compose_config(f"scheduler={scheduler}", "hw=h200x1", "hw.sm_partition=green"), cores=2)


def test_mapping_keys_take_a_dict_from_the_command_line_and_check_it():
    # the README's forms: OmegaConf could not merge them into a null Optional[Dict] node (a 40-line traceback)
    cfg = compose_config(
        "policy.cameras={base_0_rgb: agentview, left_wrist_0_rgb: null}",
        "policy.dims={width: 64, depth: 2}",
        "demos.image_keys={agentview: agentview_image}",
    )
    assert OmegaConf.to_container(cfg.policy.cameras) == {"base_0_rgb": "agentview", "left_wrist_0_rgb": None}
    assert OmegaConf.to_container(cfg.policy.dims) == {"width": 64, "depth": 2}
    assert OmegaConf.to_container(cfg.demos.image_keys) == {"agentview": "agentview_image"}
    for override, line in [
        ("policy.dims={width: abc}", "policy.dims={'width': 'abc'} must be a mapping of names to ints"),
        ("policy.cameras=[agentview]", "policy.cameras=['agentview'] must be a mapping of names to strs or null"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(line)):
            validate(compose_config(override))
