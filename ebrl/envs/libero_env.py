"""LIBERO (robosuite 1.4 benchmark suites): comes with the LIBERO issue; for now it says so in one line."""
from __future__ import annotations

from typing import Any

from ebrl.envs.base import EnvAdapter, EnvSetupError


class LiberoEnv(EnvAdapter):
    """Placeholder that fails with what is missing: LIBERO needs its own interpreter, set up in a later version."""

    def __init__(self, seed: int = 0, **options: Any) -> None:
        super().__init__(seed)
        raise EnvSetupError(
            "env=libero needs the LIBERO benchmark in its own interpreter (it pins robosuite 1.4); its setup "
            "command comes with the LIBERO issue: not available in this version"
        )
