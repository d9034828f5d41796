"""Checkpoints round-trip exactly, are written atomically, and refuse what does not fit."""

import pytest
import torch
from safetensors.torch import save_file

from ebrl.envs.base import ArraySpec, EnvSpec
from ebrl.policies.openpi import OpenPIPolicy
from ebrl.policies.weights import load_weights
from ebrl.runtime.checkpoint import CHECKPOINT_FORMAT, CheckpointError, atomic_save, detached_copy, load_checkpoint

SPEC = EnvSpec(
    obs={"state": ArraySpec((12,), "float32")}, action_dim=7, instruction="lift the red cube", max_episode_steps=40
)


def policy(seed: int, **kwargs) -> OpenPIPolicy:
    torch.manual_seed(seed)
    return OpenPIPolicy(SPEC, **kwargs)


def same_sample(a: OpenPIPolicy, b: OpenPIPolicy) -> bool:
    obs = {"state": torch.randn(3, 12)}
    torch.manual_seed(7)
    x = a.sample(obs)
    torch.manual_seed(7)
    y = b.sample(obs)
    return torch.equal(x.chunk, y.chunk) and torch.equal(x.log_prob, y.log_prob) and torch.equal(x.value, y.value)


def test_round_trip_gives_identical_actions(tmp_path):
    a, b = policy(0), policy(1)
    assert not same_sample(a, b)
    path = tmp_path / "checkpoints" / "last.pt"
    atomic_save({"format": CHECKPOINT_FORMAT, "model": a.state_dict()}, path)
    b.load_state_dict(load_checkpoint(path)["model"])
    assert same_sample(a, b)
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temp file left behind


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    atomic_save({"format": CHECKPOINT_FORMAT, "iteration": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        atomic_save({"format": CHECKPOINT_FORMAT, "bad": Unpicklable()}, path)
    assert load_checkpoint(path)["iteration"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_truncated_checkpoint_is_one_line(tmp_path):
    path = tmp_path / "last.pt"
    atomic_save({"format": CHECKPOINT_FORMAT, "model": policy(0).state_dict()}, path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert "is not a readable checkpoint" in str(e.value) and "\n" not in str(e.value)


def test_safetensors_start_loads_and_mismatch_names_keys(tmp_path):
    a, b = policy(0), policy(1)
    good = tmp_path / "good.safetensors"
    save_file({k: v.contiguous() for k, v in a.state_dict().items()}, str(good))
    load_weights(b, str(good))
    assert same_sample(a, b)
    other = tmp_path / "other.safetensors"
    save_file(
        {
            k: v.contiguous()
            for k, v in policy(0, preset="small").state_dict().items()
            if not k.startswith("action_out_proj")
        },
        str(other),
    )
    with pytest.raises(CheckpointError) as e:
        load_weights(b, str(other))
    message = str(e.value)
    assert "2 missing (e.g. action_out_proj.weight" in message and "with other shapes" in message
    assert "\n" not in message
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(b, str(tmp_path / "nope.safetensors"))


def test_the_trainers_state_message_is_a_copy_the_next_update_leaves_alone():
    # tensors sent over a pipe share storage with the sender; Adam updates its moments in place
    weight = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.Adam([weight])
    weight.grad = torch.ones(3)
    adam.step()
    sent = detached_copy({"model": {"weight": weight}, "optimizer": adam.state_dict()}, shared=True)
    kept = [sent["model"]["weight"].clone(), sent["optimizer"]["state"][0]["exp_avg"].clone()]
    # made in shared memory: the pipe passes handles, not a further copy of each tensor into a new segment
    assert sent["model"]["weight"].is_shared() and sent["optimizer"]["state"][0]["exp_avg"].is_shared()
    weight.grad = torch.full((3,), 5.0)
    adam.step()
    assert torch.equal(sent["model"]["weight"], kept[0])
    assert torch.equal(sent["optimizer"]["state"][0]["exp_avg"], kept[1])
    assert sent["optimizer"]["param_groups"][0]["lr"] == adam.param_groups[0]["lr"]
