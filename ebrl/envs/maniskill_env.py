"""ManiSkill 3 tasks (SAPIEN), one environment per adapter on the CPU physics backend.

ManiSkill returns torch tensors; they are converted with `.cpu()` and numpy, and this module never
imports torch itself. SAPIEN needs a Vulkan device even for state observations (on CPU machines:
Mesa >= 25 lavapipe, installed by `python -m ebrl.install`).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from ebrl.envs.base import ArraySpec, EnvAdapter, EnvSetupError, EnvSpec, check_reward, one_line

INSTRUCTIONS = {
    "PickCube-v1": "pick up the red cube and move it to the green target",
    "PushCube-v1": "push the cube to the red and white target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PullCube-v1": "pull the cube to the red and white target",
    "PegInsertionSide-v1": "insert the peg into the hole in the box",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PokeCube-v1": "use the peg to poke the cube to the target",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "push the ball so it rolls to the target",
    "PushT-v1": "push the T-shaped block onto the T-shaped target",
    "PickSingleYCB-v1": "pick up the object and move it to the green target",
}

# Signs in SAPIEN's errors that no usable Vulkan device/driver was found.
_VULKAN_ERRORS = ("vk::", "vulkan", "rendering device", "errorincompatibledriver", "errorinitializationfailed")


class _NoCudaRenderWarning(logging.Filter):
    # ManiSkill asks for a CUDA renderer and falls back to the CPU one on machines without CUDA, saying so in every
    # simulator process: the adapter reports it instead (`software_renderer`), and the supervisor says it once
    def filter(self, record: logging.LogRecord) -> bool:
        return "CUDA device was not found" not in record.getMessage()


def instruction_for(task: str) -> str:
    """The language instruction of a ManiSkill task; unknown tasks get one built from the id."""
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    name = task.rsplit("-v", 1)[0]
    words = " ".join(re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z]*|[a-z]+|\d+", name)).lower()
    return f"complete the {words} task"


def _to_numpy(x: Any) -> np.ndarray:
    """A batch-of-one torch tensor (or array) from ManiSkill as a numpy array without the batch axis."""
    if hasattr(x, "cpu"):
        x = x.cpu().numpy()
    arr = np.asarray(x)
    return arr[0] if arr.ndim > 0 and arr.shape[0] == 1 else arr


class ManiSkillEnv(EnvAdapter):
    """A ManiSkill 3 task. Obs: "state" = agent proprio + task extras (object poses, goal); "image/<camera>" when asked.
    fast_step: the agent's action set by ebrl/envs/maniskill_fast.py where it covers the controllers (`fast_step_off`
    says why not)."""

    def __init__(
        self,
        task: str,
        max_episode_steps: int = 50,
        cameras: list[str] | tuple[str, ...] = (),
        image_size: int = 128,
        reward: str = "dense",
        terminate_on_success: bool = True,
        control_mode: str = "pd_ee_delta_pose",
        sim_backend: str = "cpu",
        fast_step: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(seed)
        cameras = list(cameras)
        check_reward(reward)
        try:
            import gymnasium as gym
            import mani_skill.envs  # noqa: F401  (registers the tasks)
            from mani_skill.utils.logging_utils import logger
            from mani_skill.utils.registration import REGISTERED_ENVS
        except ImportError as e:
            raise EnvSetupError(
                f"env=maniskill needs the mani-skill package ({e}); run `python -m ebrl.install`"
            ) from e
        if not any(isinstance(f, _NoCudaRenderWarning) for f in logger.filters):
            logger.addFilter(_NoCudaRenderWarning())
        if task not in REGISTERED_ENVS:
            raise EnvSetupError(
                f"env.task={task!r} is not a ManiSkill task; choose one of: {', '.join(sorted(REGISTERED_ENVS))}"
            )
        _check_assets(task, REGISTERED_ENVS[task])

        self.task = task
        self.reward_mode = reward
        self.terminate_on_success = terminate_on_success
        self.cameras = cameras
        kwargs: dict[str, Any] = dict(
            num_envs=1,
            obs_mode="rgb+state" if cameras else "state",  # "+state": the flat state comes along with images
            control_mode=control_mode,
            sim_backend=sim_backend,
            render_mode=None,
            reward_mode="normalized_dense",  # dense rewards in [0, 1]; sparse is computed here from success
            max_episode_steps=max_episode_steps,  # EnvAdapter.run_chunk truncates at the same step
        )
        if cameras:
            kwargs["sensor_configs"] = dict(width=image_size, height=image_size)
        try:
            self.env = gym.make(task, **kwargs)
        except Exception as e:
            if any(sign in str(e).lower() for sign in _VULKAN_ERRORS):
                raise EnvSetupError(
                    f"env=maniskill needs a Vulkan device and none works here ({one_line(e)}); "
                    "run `python -m ebrl.install` (Mesa >= 25 lavapipe on CPU machines)"
                ) from e
            if isinstance(e, (AssertionError, ValueError, NotImplementedError, KeyError)):
                raise EnvSetupError(
                    f"env={task} with control_mode={control_mode!r}, sim_backend={sim_backend!r} "
                    f"does not build: {one_line(e)}"
                ) from e
            raise
        sensors = list(getattr(self.env.unwrapped, "_sensors", {}))
        unknown = [cam for cam in cameras if cam not in sensors]
        if unknown:
            self.env.close()
            raise EnvSetupError(
                f"env.cameras={cameras}: {task} has no camera {', '.join(unknown)}; choose from: {', '.join(sensors)}"
            )

        self.frames = 0  # sensor renders made
        if cameras:
            self._gate_sensors()
        self.fast_step = fast_step
        self.fast_step_off = "env.fast_step=false"
        self._fast: Any = None
        obs, _ = self.env.reset(seed=int(seed))
        self._set_fast_action()
        obs = self._obs(obs)
        spec_obs = {key: ArraySpec(value.shape, value.dtype.name) for key, value in obs.items()}
        space = self.env.unwrapped.single_action_space
        self.spec = EnvSpec(
            obs=spec_obs,
            action_dim=int(np.prod(space.shape)),
            instruction=instruction_for(task),
            max_episode_steps=int(max_episode_steps),
            action_low=float(np.min(space.low)),
            action_high=float(np.max(space.high)),
        )

    def software_renderer(self) -> str:
        """SAPIEN's CPU renderer, when ManiSkill found no CUDA device for its renderer and fell back to it (with
        cameras: without, nothing renders)."""
        backend = getattr(self.env.unwrapped, "backend", None)  # (ManiSkill 3's BackendInfo)
        if not self.cameras or getattr(backend, "render_backend", "") != "sapien_cpu":
            return ""
        return (
            "ManiSkill found no CUDA device for SAPIEN's renderer and renders on the CPU (sapien_cpu): SAPIEN "
            "needs NVIDIA's Vulkan driver (nvidia_icd.json; in a container set NVIDIA_DRIVER_CAPABILITIES=all, or "
            "a list with graphics)"
        )

    def _obs(self, raw: Any) -> dict[str, np.ndarray]:
        if not self.cameras:
            return {"state": _to_numpy(raw).astype(np.float32).reshape(-1)}
        return {"state": _to_numpy(raw["state"]).astype(np.float32).reshape(-1), **self._images(raw["sensor_data"])}

    def _gate_sensors(self) -> None:
        """Render the sensors only while `render_this_step` is set. ManiSkill renders them in `get_obs` at the end of
        a step (`_get_obs_sensor_data`: update the render scene, capture, read); the wrapper, on this env object only,
        runs that at the steps whose observation is read and hands back the last frames otherwise (not read either).
        The state part of the obs, the reward and the physics do not pass through it."""
        env = self.env.unwrapped
        self._sensor_data = sensor_data = env._get_obs_sensor_data  # noqa: SLF001  (ManiSkill 3's one place)
        last: list[dict] = []

        def gated(*args: Any, **kwargs: Any) -> dict:
            if self.render_this_step or not last:
                self.frames += 1
                last[:] = [sensor_data(*args, **kwargs)]
            return last[0]

        env._get_obs_sensor_data = gated  # noqa: SLF001

    def render_now(self) -> dict[str, np.ndarray]:
        if not self.cameras:
            return {}
        self.frames += 1
        return self._images(self._sensor_data())

    def _images(self, sensor_data: dict) -> dict[str, np.ndarray]:
        return {
            f"image/{cam}": np.ascontiguousarray(_to_numpy(sensor_data[cam]["rgb"])[..., :3], np.uint8)
            for cam in self.cameras
        }

    def reset(self, seed: int | None = None) -> dict[str, np.ndarray]:
        obs, _ = self.env.reset(seed=seed)
        self._set_fast_action()
        return self._obs(obs)

    def _set_fast_action(self) -> None:
        """Put the fast `set_action` on the env's agent (again after a reset that rebuilt the agent)."""
        env = self.env.unwrapped
        if not self.fast_step or (self._fast is not None and self._fast.agent is env.agent):
            return
        from ebrl.envs.maniskill_fast import fast_action_for

        self._fast, self.fast_step_off = fast_action_for(env)
        if self._fast is not None:
            env.agent.set_action = self._fast

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        obs, reward, _, _, info = self.env.step(np.asarray(action, np.float32)[None])
        success = bool(_to_numpy(info["success"])) if "success" in info else False
        failed = bool(_to_numpy(info["fail"])) if "fail" in info else False
        reward = (1.0 if success else 0.0) if self.reward_mode == "sparse" else float(_to_numpy(reward))
        terminated = (success and self.terminate_on_success) or failed
        return self._obs(obs), reward, terminated, False, {"success": success}


def _check_assets(task: str, registered: Any) -> None:
    """Fail with one line, instead of ManiSkill's interactive download prompt, when task assets are missing."""
    try:
        from mani_skill.utils import assets
    except ImportError:
        return
    missing = []
    for asset_id in getattr(registered, "asset_download_ids", None) or []:
        try:
            if asset_id in assets.DATA_GROUPS:
                ids = assets.expand_data_group_into_individual_data_source_ids(asset_id)
            else:
                ids = [asset_id]
            if any(not assets.is_data_source_downloaded(i) for i in ids):
                missing.append(asset_id)
        except Exception:  # an id ManiSkill itself cannot resolve: let gym.make report it
            continue
    if missing:
        raise EnvSetupError(
            f"env.task={task!r} needs ManiSkill assets that are not downloaded ({', '.join(missing)}); "
            f"run `python -m mani_skill.utils.download_asset {' '.join(missing)}`"
        )
