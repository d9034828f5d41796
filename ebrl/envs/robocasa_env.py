"""RoboCasa kitchens (robosuite 1.5): comes with the RoboCasa issue; for now it says so in one line."""
from __future__ import annotations

from typing import Any

from ebrl.envs.base import EnvAdapter, EnvSetupError


class RoboCasaEnv(EnvAdapter):
    """Placeholder that fails with what is missing: the robocasa package and its ~10 GB of kitchen assets."""

    def __init__(self, seed: int = 0, **options: Any) -> None:
        super().__init__(seed)
        raise EnvSetupError(
            "env=robocasa needs the robocasa package and its kitchen assets (~10 GB, a separate download); "
            "their setup command comes with the RoboCasa issue: not available in this version"
        )
