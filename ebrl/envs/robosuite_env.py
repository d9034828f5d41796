"""robosuite 1.5 tasks (MuJoCo): one arm with an OSC_POSE controller, 7-d actions (delta pose + gripper)."""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from ebrl.envs.base import ArraySpec, EnvAdapter, EnvSetupError, EnvSpec, check_reward, use_headless_gl
from ebrl.envs.robosuite_cameras import CameraGate, upright

INSTRUCTIONS = {
    "Lift": "lift the red cube",
    "Stack": "stack the red cube on top of the green cube",
    "PickPlace": "put each object into its matching bin",
    "PickPlaceSingle": "put the object into its matching bin",
    "PickPlaceCan": "pick up the can and put it in its bin",
    "PickPlaceMilk": "pick up the milk carton and put it in its bin",
    "PickPlaceBread": "pick up the bread and put it in its bin",
    "PickPlaceCereal": "pick up the cereal box and put it in its bin",
    "Door": "open the door",
    "NutAssembly": "fit each nut onto the peg of its shape",
    "NutAssemblySingle": "fit the nut onto the peg of its shape",
    "NutAssemblySquare": "fit the square nut onto the square peg",
    "NutAssemblyRound": "fit the round nut onto the round peg",
    "Wipe": "wipe the markings off the table",
    "ToolHang": "build the stand and hang the tool on it",
}

# robosuite logs these on every import and construction; they are expected with a single arm.
_NOISE = (
    "private macro file",
    "setup_macros.py",
    "robosuite_models",
    "mink-based whole-body IK",
    "but the robot does not have this component",
)

# What counts as a grasp in the shaped rewards' grasp terms (`env.grasp`): robosuite's own check, both finger pads in
# contact with the object; or that and each pad pushing on it along the line between the pads (a squeeze, within
# SQUEEZE_DEGREES), so that closed fingers pressed on the object's top, which touch it with both pads, are not one.
# Under squeeze Lift's success (the cube's centre 4 cm over the table) needs the squeeze too: a cube pressed into the
# table springs over that height for a step or two when the fingers let go (docs/use/environments.md)
GRASPS = ("contact", "squeeze")
SQUEEZE_DEGREES = 45.0


class _QuietRobosuite(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        message = record.getMessage()
        return not any(noise in message for noise in _NOISE)


def instruction_for(task: str) -> str:
    """The language instruction of a robosuite task; unknown tasks get one built from the name."""
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    words = " ".join(re.findall(r"[A-Z][a-z]*|[a-z]+|\d+", task)).lower()
    return f"complete the {words} task"


def _import_robosuite() -> Any:
    # The filter must exist before robosuite creates its logger: the first warnings come at import.
    logger = logging.getLogger("robosuite_logs")
    if not any(isinstance(f, _QuietRobosuite) for f in logger.filters):
        logger.addFilter(_QuietRobosuite())
    try:
        import robosuite
    except ImportError as e:
        raise EnvSetupError(f"env=robosuite needs the robosuite package ({e}); run `python -m ebrl.install`") from e
    return robosuite


class RobosuiteEnv(EnvAdapter):
    """A single-arm robosuite task. Obs: "state" = robot proprio + object state; "image/<camera>" when asked.
    fast_step: the control step of ebrl/envs/fast_step.py where it covers the env (`fast_step_off` says why not)."""

    gl = "egl"  # MuJoCo's offscreen EGL context renders the cameras (EnvAdapter.software_renderer)

    def __init__(
        self,
        task: str,
        max_episode_steps: int = 100,
        cameras: list[str] | tuple[str, ...] = (),
        image_size: int = 128,
        reward: str = "dense",
        terminate_on_success: bool = True,
        robot: str = "Panda",
        control_freq: int = 20,
        fast_step: bool = True,
        grasp: str = "contact",
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        cameras = list(cameras)
        check_reward(reward)
        if grasp not in GRASPS:
            raise EnvSetupError(f"env.grasp={grasp!r} is not a grasp check; choose one of: {', '.join(GRASPS)}")
        if cameras:
            use_headless_gl()
        robosuite = _import_robosuite()
        from robosuite.controllers import load_composite_controller_config
        from robosuite.environments.base import REGISTERED_ENVS

        from ebrl.envs.fast_step import fast_or_stock

        single_arm = sorted(name for name in REGISTERED_ENVS if not name.startswith("TwoArm"))
        if task not in single_arm:
            what = "a two-arm task" if task in REGISTERED_ENVS else "not a robosuite task"
            raise EnvSetupError(f"env.task={task!r} is {what}; choose one of: {', '.join(single_arm)}")
        if robot not in robosuite.ALL_ROBOTS:
            raise EnvSetupError(
                f"env.robot={robot!r} is not a robosuite robot; choose one of: "
                f"{', '.join(sorted(robosuite.ALL_ROBOTS))}"
            )

        self.task = task
        self.reward_mode = reward
        self.terminate_on_success = terminate_on_success
        self.cameras = cameras
        controller = load_composite_controller_config(controller="BASIC", robot=robot)
        try:
            self.env = robosuite.make(
                task,
                robots=robot,
                controller_configs=controller,
                has_renderer=False,
                has_offscreen_renderer=bool(cameras),
                use_camera_obs=bool(cameras),
                use_object_obs=True,
                camera_names=cameras or "agentview",
                camera_heights=image_size,
                camera_widths=image_size,
                reward_shaping=reward == "dense",
                control_freq=control_freq,
                horizon=max_episode_steps,
                ignore_done=True,  # our max_episode_steps truncates, in EnvAdapter.run_chunk
                hard_reset=False,  # a hard reset reloads the model; with cameras it grows memory each time
                seed=int(seed),
            )
        except Exception as e:
            if not cameras:
                raise
            raise EnvSetupError(_camera_error(robosuite, task, robot, controller, cameras, e)) from e

        if grasp == "squeeze":  # (instance attributes: the tasks' rewards, and step, call self._check_grasp/_success)
            self.env._check_grasp = squeeze_check(self.env)
            if task == "Lift":
                self.env._check_success = held_success(self.env)
        self.gate = CameraGate(self, cameras)
        self.gate.install(self.env)
        self._step, self.fast_step_off = fast_or_stock(self.env, fast_step)
        obs = self.env.reset()
        state = self._state(obs)
        spec_obs = {"state": ArraySpec(state.shape, "float32")}
        for cam in cameras:
            spec_obs[f"image/{cam}"] = ArraySpec((image_size, image_size, 3), "uint8")
        low, high = self.env.action_spec
        self.spec = EnvSpec(
            obs=spec_obs,
            action_dim=int(self.env.action_dim),
            instruction=instruction_for(task),
            max_episode_steps=int(max_episode_steps),
            action_low=float(np.min(low)),
            action_high=float(np.max(high)),
        )

    def _state(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        parts = [obs["robot0_proprio-state"]]
        if "object-state" in obs:
            parts.append(obs["object-state"])
        return np.concatenate(parts).astype(np.float32)

    def _obs(self, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        obs = {"state": self._state(raw)}
        for cam in self.cameras:
            obs[f"image/{cam}"] = upright(raw[f"{cam}_image"])
        return obs

    def render_now(self) -> dict[str, np.ndarray]:
        return self.gate.render_now(self.env)

    def reset(self, seed: int | None = None) -> dict[str, np.ndarray]:
        if seed is not None:
            # robosuite draws object placements and joint noise from env.rng, which its samplers
            # share by reference: re-seed that generator in place.
            self.env.rng.bit_generator.state = np.random.default_rng(seed).bit_generator.state
        return self._obs(self.env.reset())

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        raw, reward, _, _ = self._step(np.asarray(action, np.float64))
        success = bool(self.env._check_success())
        if self.reward_mode == "sparse":
            reward = 1.0 if success else 0.0
        terminated = success and self.terminate_on_success
        return self._obs(raw), float(reward), terminated, False, {"success": success}


def pad_contacts(env: Any, gripper: Any, object_geoms: Any) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """The line from the right finger pad to the left one (a unit vector) and, per pad (left, right), the normals of
    its contacts with `object_geoms` (a robosuite model, or geom names) at this state. `gripper`: a GripperModel."""
    sim = env.sim
    names = object_geoms.contact_geoms if hasattr(object_geoms, "contact_geoms") else object_geoms
    objects = {sim.model.geom_name2id(n) for n in ([names] if isinstance(names, str) else names)}
    pads = [
        [sim.model.geom_name2id(n) for n in gripper.important_geoms[side]]
        for side in ("left_fingerpad", "right_fingerpad")
    ]
    axis = sim.data.geom_xpos[pads[0][0]] - sim.data.geom_xpos[pads[1][0]]
    axis = axis / max(float(np.linalg.norm(axis)), 1e-9)
    pad_sets = [set(pad) for pad in pads]
    normals: list[list[np.ndarray]] = [[], []]
    for contact in sim.data.contact[: sim.data.ncon]:
        pair = {contact.geom1, contact.geom2}
        if not pair & objects:
            continue
        for side, pad in enumerate(pad_sets):
            if pair & pad:
                normals[side].append(np.array(contact.frame[:3]))
    return axis, normals


def squeeze_check(env: Any) -> Any:
    """`env._check_grasp` with a squeeze required of a gripper model's grasp (GRASPS): each pad has a contact with the
    object whose normal is within SQUEEZE_DEGREES of the line between the pads. Other forms of `gripper` (a dict of
    arms, geom names) go to robosuite's check, which calls this one back per arm."""
    stock = type(env)._check_grasp.__get__(env)
    cos = np.cos(np.radians(SQUEEZE_DEGREES))

    def check(gripper: Any, object_geoms: Any) -> bool:
        if not stock(gripper, object_geoms):
            return False
        if not hasattr(gripper, "important_geoms"):
            return True  # (a dict: robosuite's check asked this one per arm; geom names: its own test)
        axis, normals = pad_contacts(env, gripper, object_geoms)
        return all(any(abs(float(n @ axis)) >= cos for n in side) for side in normals)

    return check


def held_success(env: Any) -> Any:
    """Lift's `_check_success` with the cube held: over robosuite's height and squeezed by the pads (GRASPS)."""
    stock, squeeze = type(env)._check_success.__get__(env), squeeze_check(env)
    gripper = env.robots[0].gripper

    def check() -> bool:
        return bool(stock()) and bool(squeeze(gripper, env.cube))

    return check


def _camera_error(robosuite: Any, task: str, robot: str, controller: dict, cameras: list[str], error: Exception) -> str:
    """One line for a camera env that failed to build: a wrong camera name, or no offscreen GL."""
    try:  # on this failure path only: build the task without cameras to list the ones it has
        plain = robosuite.make(
            task,
            robots=robot,
            controller_configs=controller,
            has_renderer=False,
            has_offscreen_renderer=False,
            use_camera_obs=False,
        )
        available = list(plain.sim.model.camera_names)
        plain.close()
    except Exception:
        available = []
    unknown = [cam for cam in cameras if available and cam not in available]
    if unknown:
        return f"env.cameras={cameras}: {task} has no camera {', '.join(unknown)}; choose from: {', '.join(available)}"
    text = str(error).splitlines()[0] if str(error) else ""
    return (
        f"env.cameras={cameras}: offscreen rendering failed ({type(error).__name__}: {text}); "
        "run `python -m ebrl.install` (EGL/OSMesa packages) or set MUJOCO_GL=egl|osmesa"
    )
