"""Camera frames on demand for robosuite's family: 1.5, 1.4 (LIBERO's) and RoboCasa's fork.

A robosuite camera is an observable: it samples on its own clock (its sampling rate, at the substep that clock
picks) and its sensor renders when it samples. `CameraGate` wraps the sensor, not the observable, so the clock runs
exactly as before; at a sample the sensor renders only while the adapter's `render_this_step` flag is set, and hands
back a black frame of the same shape otherwise (one that no one reads: `EnvAdapter.run_chunk` sets the flag for a
chunk's last step and at a reset). The frames the policy reads are then those rendering at every step gives, bit for
bit, and so are the physics and the rewards, which rendering never touched (tests/envs/test_render_gate.py).

This module imports numpy and, when a gate is built, robosuite: it runs under LIBERO's interpreter too.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


class CameraGate:
    """The camera sensors of one robosuite env, gated by `adapter.render_this_step`; `frames` counts the renders."""

    def __init__(self, adapter: Any, cameras: list[str]) -> None:
        self.adapter, self.cameras = adapter, list(cameras)
        self.frames = 0
        self.renderers: dict[str, Callable[[dict], np.ndarray]] = {}

    def install(self, env: Any) -> None:
        """Wrap each camera's sensor in `env` (robosuite's own env object); again after a hard reset, which builds
        new sensors. Sensors already wrapped are left as they are."""
        from robosuite.utils.observables import sensor

        for cam in self.cameras:
            observable = env._observables[f"{cam}_image"]  # noqa: SLF001  (robosuite keeps no public accessor)
            render = observable._sensor  # noqa: SLF001
            if getattr(render, "gated", False):
                continue
            blank = np.zeros(observable._data_shape, np.uint8)  # noqa: SLF001  (the shape robosuite measured)

            @sensor(modality=observable.modality)
            def gated(obs_cache: dict, render: Callable = render, blank: np.ndarray = blank) -> np.ndarray:
                if not self.adapter.render_this_step:
                    return blank
                self.frames += 1
                return render(obs_cache)

            gated.gated = True
            asked, self.adapter.render_this_step = self.adapter.render_this_step, False
            try:  # set_sensor calls it once to read its shape: the blank frame has it, no render needed
                observable.set_sensor(gated)
            finally:
                self.adapter.render_this_step = asked
            self.renderers[cam] = render

    def render_now(self, env: Any) -> dict[str, np.ndarray]:
        """Every camera's frame of the current state, rendered now, right side up as the adapters give them."""
        self.frames += len(self.cameras)
        return {f"image/{cam}": upright(self.renderers[cam](env._obs_cache)) for cam in self.cameras}  # noqa: SLF001


def upright(image: np.ndarray) -> np.ndarray:
    """MuJoCo renders in OpenGL's convention (bottom row first): the frame right side up, as uint8."""
    return np.ascontiguousarray(image[::-1], dtype=np.uint8)
