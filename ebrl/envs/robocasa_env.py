"""RoboCasa kitchens (robosuite 1.5.2) through `praxis-robocasa`, in their own interpreter.

RoboCasa pins numpy 2.2.5 and mujoco 3.3.1, so this adapter runs under the venv built by
`python -m ebrl.envs.setup robocasa`. Tasks are RoboCasa's registered kitchen envs (e.g.
PickPlaceCounterToCabinet), built with `robosuite.make` and the PandaOmron mobile manipulator by
default, as RoboCasa's own `create_env` does. The kitchen assets (~10 GB: textures, fixtures,
objects) are a separate download into the package folder; they are checked before anything is built.
"""

from __future__ import annotations

import logging
import sys
from contextlib import redirect_stdout
from importlib.util import find_spec
from io import StringIO
from pathlib import Path
from typing import Any

from ebrl.envs.base import ArraySpec, EnvAdapter, EnvSetupError, EnvSpec, check_reward, use_headless_gl
from ebrl.envs.robosuite_cameras import CameraGate, upright
from ebrl.envs.robosuite_env import _QuietRobosuite  # numpy only at import, like this module

SETUP_HINT = "env=robocasa needs its own interpreter: run `python -m ebrl.envs.setup robocasa`"
DOWNLOAD_MODULE = "robocasa.scripts.download_kitchen_assets"  # RoboCasa's scripts/download_kitchen_assets.py
# What the download puts under robocasa/models/assets that the wheel lacks (the wheel ships only
# scene layouts/styles, fixture registries and a few cabinet/counter meshes). One entry per part the
# default kitchen needs: textures (tex), lightwheel fixtures (fixtures_lw: sinks stand for all of
# them; every layout has a sink), objaverse and lightwheel objects (the default obj_registries).
REQUIRED_ASSETS = ("textures", "fixtures/sinks", "objects/objaverse", "objects/lightwheel")
# Parts of the download that env.assets_dir may hold, linked into the package folder when missing there.
LINKABLE_ASSETS = ("textures", "generative_textures", "objects/objaverse", "objects/aigen_objs", "objects/lightwheel")
NOT_TASKS = ("Kitchen",)  # the base class registers itself too
# Proprioception in "state", first key present of each group: base-frame end effector (what
# RoboCasa's datasets and GR00T use) for mobile robots, world-frame for fixed ones.
PROPRIO = (
    ("robot0_base_to_eef_pos", "robot0_eef_pos"),
    ("robot0_base_to_eef_quat", "robot0_eef_quat"),
    ("robot0_gripper_qpos",),
    ("robot0_base_pos",),
    ("robot0_base_quat",),
)


def package_assets_dir() -> Path | None:
    """robocasa/models/assets of this interpreter's robocasa, without importing it; None if not installed."""
    spec = find_spec("robocasa")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "models" / "assets"


def _import_robocasa() -> tuple[Any, dict[str, Any]]:
    """robosuite and RoboCasa's task registry (name -> env class), or the setup line."""
    try:
        if find_spec("robocasa") is None:
            raise ImportError("no module named 'robocasa' in this interpreter")
        # robosuite's and RoboCasa's import-time warnings (no private macro file, ...) would break
        # run.py's one-line errors: the same filter as env=robosuite, set before robosuite's logger exists
        logger = logging.getLogger("robosuite_logs")
        if not any(isinstance(f, _QuietRobosuite) for f in logger.filters):
            logger.addFilter(_QuietRobosuite())
        import robosuite

        if not robosuite.__version__.startswith("1.5"):
            raise ImportError(f"robosuite {robosuite.__version__} here, RoboCasa needs 1.5")
        with redirect_stdout(StringIO()):  # RoboCasa prints that the optional mimicgen is not installed
            import robocasa  # noqa: F401  (registers every kitchen task with robosuite)
        from robocasa.environments.kitchen.kitchen import REGISTERED_KITCHEN_ENVS
    except (ImportError, AssertionError) as e:  # robocasa asserts its numpy/mujoco/robosuite versions at import
        raise EnvSetupError(f"{SETUP_HINT} ({' '.join(str(e).split())})") from e
    tasks = {name: cls for name, cls in REGISTERED_KITCHEN_ENVS.items() if name not in NOT_TASKS}
    return robosuite, tasks


def missing_assets(root: Path) -> list[str]:
    return [part for part in REQUIRED_ASSETS if not (root / part).is_dir()]


def _link_assets(source: Path, target: Path) -> None:
    """RoboCasa reads its assets from its package folder only: link the parts env.assets_dir holds
    and the package lacks (a rebuilt venv then only loses the links, not the 10 GB)."""
    pairs = [(source / part, target / part) for part in LINKABLE_ASSETS]
    if (source / "fixtures").is_dir():
        pairs += [(child, target / "fixtures" / child.name) for child in (source / "fixtures").iterdir()]
    for src, dst in pairs:
        if src.exists() and not dst.exists() and not dst.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def check_assets(assets_dir: str | None) -> Path:
    """The folder the kitchen assets are read from; one line saying where and how to get them if missing."""
    package = package_assets_dir()
    if package is None:
        raise EnvSetupError(SETUP_HINT)
    root = package if assets_dir is None else Path(assets_dir).expanduser().resolve()
    missing = missing_assets(root)
    if missing:
        where = "RoboCasa's package folder" if assets_dir is None else "env.assets_dir"
        raise EnvSetupError(
            f"env=robocasa needs RoboCasa's kitchen assets (~10 GB), expected in {where} {root} "
            f"(missing: {', '.join(missing)}): download them with `{sys.executable} -m {DOWNLOAD_MODULE}` "
            f"(asks to confirm on stdin), or set env.assets_dir to a folder that holds them "
            f"(textures, fixtures, objects/...)"
        )
    if root != package.resolve():
        try:
            _link_assets(root, package)
        except OSError as e:
            raise EnvSetupError(
                f"env.assets_dir={assets_dir}: cannot link its assets into {package} "
                f"({type(e).__name__}: {' '.join(str(e).split())})"
            ) from e
        still = missing_assets(package)
        if still:
            raise EnvSetupError(
                f"env.assets_dir={assets_dir}: {package} still lacks {', '.join(still)} after "
                "linking; remove what is in the way there"
            )
    return root


class RoboCasaEnv(EnvAdapter):
    """One RoboCasa kitchen task. Obs: "state" = base-frame eef pos + quat, gripper qpos, base pos +
    quat, object state; "image/<camera>" when asked (RoboCasa's: robot0_agentview_left,
    robot0_agentview_right, robot0_eye_in_hand). Each reset samples a kitchen (layout, style) and
    objects from the seed; the instruction names the sampled object, so it can change per episode
    (`self.instruction`; `spec.instruction` is the first episode's)."""

    gl = "egl"  # MuJoCo's offscreen EGL context renders the cameras (EnvAdapter.software_renderer)
    recompiles_on_reset = True  # robosuite's hard reset, RoboCasa's default: a new kitchen's model each episode

    def __init__(
        self,
        task: str = "PickPlaceCounterToCabinet",
        assets_dir: str | None = None,
        max_episode_steps: int = 300,
        cameras: list[str] | tuple[str, ...] = (),
        image_size: int = 128,
        reward: str = "dense",
        terminate_on_success: bool = True,
        seed: int = 0,
        robot: str = "PandaOmron",
        fast_step: bool = True,
    ) -> None:
        super().__init__(seed)
        cameras = list(cameras)
        # RoboCasa's tasks have no shaped reward (Kitchen.reward is success as 0/1): "dense" gets that
        # sparse reward too, so env.reward's default works unchanged.
        check_reward(reward, " (both: 1 on success)")
        if cameras:
            use_headless_gl()
        import numpy as np

        robosuite, tasks = _import_robocasa()
        if task not in tasks:
            import difflib

            close = difflib.get_close_matches(task, list(tasks), n=5, cutoff=0.5) or sorted(tasks)[:5]
            raise EnvSetupError(
                f"env.task={task!r} is not a task of env=robocasa; closest of its {len(tasks)} tasks: "
                f"{', '.join(close)} (all: robocasa.environments.kitchen.kitchen.REGISTERED_KITCHEN_ENVS)"
            )
        self.assets = check_assets(assets_dir)  # before anything is built: a kitchen without assets fails deep inside
        from robosuite.controllers import load_composite_controller_config

        self.task = task
        self.cameras = cameras
        self.terminate_on_success = terminate_on_success
        self._np = np
        try:
            self.env = robosuite.make(
                env_name=task,
                robots=robot,
                controller_configs=load_composite_controller_config(controller=None, robot=robot),
                use_camera_obs=bool(cameras),
                has_renderer=False,
                has_offscreen_renderer=bool(cameras),
                camera_names=cameras or ["robot0_agentview_left"],
                camera_heights=image_size,
                camera_widths=image_size,
                camera_depths=False,
                use_object_obs=True,
                ignore_done=True,  # our max_episode_steps truncates, in EnvAdapter.run_chunk
                horizon=10**9,
                seed=int(seed),
                translucent_robot=False,
            )
        except Exception as e:
            if not cameras:
                raise
            raise EnvSetupError(
                f"env.cameras={cameras}: RoboCasa could not build them ({type(e).__name__}: "
                f"{' '.join(str(e).split())}); its cameras: robot0_agentview_left, "
                "robot0_agentview_right, robot0_eye_in_hand"
            ) from e
        self.instruction = ""
        self.gate = CameraGate(self, cameras)
        from ebrl.envs.fast_step import fast_or_stock

        # (its FastStep looks the sim and the controllers up again after each hard reset's new kitchen)
        self._step, self.fast_step_off = fast_or_stock(self.env, fast_step)
        obs = self.reset(seed)
        spec_obs = {"state": ArraySpec(obs["state"].shape, "float32")}
        for cam in cameras:
            spec_obs[f"image/{cam}"] = ArraySpec((image_size, image_size, 3), "uint8")
        low, high = self.env.action_spec
        self.spec = EnvSpec(
            obs=spec_obs,
            action_dim=int(self.env.action_dim),  # PandaOmron: eef pos 3, rot 3, gripper 1, base 4, mode 1
            instruction=self.instruction,
            max_episode_steps=int(max_episode_steps),
            action_low=float(np.min(low)),
            action_high=float(np.max(high)),
        )

    def _obs(self, raw: dict[str, Any]) -> dict[str, Any]:
        np = self._np
        state = []
        for keys in PROPRIO:
            key = next((k for k in keys if k in raw), None)
            if key is not None:
                state.append(np.asarray(raw[key]).ravel())
        if "object-state" in raw:
            state.append(np.asarray(raw["object-state"]).ravel())
        obs = {"state": np.concatenate(state).astype(np.float32)}
        for cam in self.cameras:
            obs[f"image/{cam}"] = upright(raw[f"{cam}_image"])
        return obs

    def render_now(self) -> dict[str, Any]:
        return self.gate.render_now(self.env)

    def reset(self, seed: int | None = None) -> dict[str, Any]:
        seed = self._seed if seed is None else int(seed)
        # RoboCasa samples the kitchen and objects from env.rng (robosuite 1.5), set from the seed
        self.env.rng = self._np.random.default_rng(seed)
        raw = self.env.reset()
        self.gate.install(self.env)  # a hard reset (RoboCasa's default) builds new camera sensors
        # the task's instruction for this episode (it names the sampled objects and fixtures)
        self.instruction = str(self.env.get_ep_meta().get("lang", ""))
        return self._obs(raw)

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        raw, _, _, _ = self._step(self._np.asarray(action, self._np.float64))
        success = bool(self.env._check_success())  # the task's own predicate, what env.reward returns too
        terminated = success and self.terminate_on_success
        return self._obs(raw), float(success), terminated, False, {"success": success}
