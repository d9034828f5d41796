"""Benchmarks that are not available yet fail with one line saying what is missing."""
import pytest

from ebrl.envs.base import EnvSetupError
from ebrl.envs.robocasa_env import RoboCasaEnv


@pytest.mark.parametrize("cls, name", [(RoboCasaEnv, "robocasa")])
def test_adapter_says_what_is_missing(cls, name):
    with pytest.raises(EnvSetupError) as info:
        cls(task="PnPCounterToCab", seed=0)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"env={name} needs")
    assert "not available in this version" in message
