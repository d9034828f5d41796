"""The fast control step against the stock simulator, in one process: bit for bit at every control step."""
import numpy as np
import pytest

from ebrl.envs.robosuite_env import RobosuiteEnv

ROBOSUITE_TASKS = ("Lift", "Stack", "NutAssemblySquare", "Door", "PickPlaceCan")


def trajectory(env, steps: int, seeds=(5, 6)) -> list:
    """What a run reads at every control step over two episodes (the second from a reset), and the sim's state."""
    sim = env.env.sim
    out = []
    for seed in seeds:
        out.append(env.begin_episode(seed))
        actions = np.random.default_rng(seed).uniform(-1, 1, (steps, env.spec.action_dim))
        for action in actions:
            obs, reward, terminated, truncated, info = env.step(action)
            out.append((obs, reward, terminated, truncated, info["success"],
                        np.array(sim.data.qpos), np.array(sim.data.qvel), np.array(sim.data.ctrl)))
    return out


def assert_identical(fast: list, stock: list) -> None:
    assert len(fast) == len(stock)
    for step, (a, b) in enumerate(zip(fast, stock)):
        if isinstance(a, dict):
            a, b = (a,), (b,)
        for x, y in zip(a, b):
            if isinstance(x, dict):
                assert x.keys() == y.keys()
                for key in x:
                    assert np.array_equal(x[key], y[key]), (step, key, np.abs(x[key] - y[key]).max())
            else:
                assert np.array_equal(x, y), (step, x, y)


@pytest.mark.parametrize("task", ROBOSUITE_TASKS)
def test_robosuite_fast_step_is_the_stock_step_bit_for_bit(task):
    fast = RobosuiteEnv(task, max_episode_steps=1000, seed=0)
    stock = RobosuiteEnv(task, max_episode_steps=1000, fast_step=False, seed=0)
    assert fast.fast_step_off == "" and stock.fast_step_off == "env.fast_step=false"
    assert_identical(trajectory(fast, 40), trajectory(stock, 40))
    raw = stock.env._observables  # the observables' own clocks end where the stock code leaves them
    for name, obs in fast.env._observables.items():
        assert (obs._time_since_last_sample, obs._sampled) == (raw[name]._time_since_last_sample, raw[name]._sampled)


def test_cameras_sample_where_the_stock_step_samples_them():
    make = lambda fast: RobosuiteEnv("Lift", cameras=["agentview"], image_size=32, fast_step=fast, seed=0)
    fast, stock = make(True), make(False)
    fast.render_every_step = stock.render_every_step = True
    assert_identical(trajectory(fast, 8, seeds=(2,)), trajectory(stock, 8, seeds=(2,)))
    assert fast.gate.frames == stock.gate.frames > 0


def test_what_it_does_not_cover_runs_the_stock_step_and_says_why():
    from robosuite.controllers import load_composite_controller_config

    from ebrl.envs.fast_step import fast_step_for

    env = RobosuiteEnv("Lift", seed=0)
    config = load_composite_controller_config(controller="BASIC", robot="Panda")
    config["body_parts"]["right"]["interpolation"] = "linear"
    import robosuite

    interpolated = robosuite.make("Lift", robots="Panda", controller_configs=config, has_renderer=False,
                                  has_offscreen_renderer=False, use_camera_obs=False)
    step, why = fast_step_for(interpolated)
    assert step is None and why == "right: an OSC interpolator"
    assert env.fast_step_off == ""
