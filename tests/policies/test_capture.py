"""`policy.capture`: generation's denoising loop replayed from CUDA graphs or compiled gives what the loop as it is
gives, on the same draws, for each flow family at the tiny preset, and still does after new weights are copied in
(ebrl/policies/capture.py)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from omegaconf import OmegaConf

from ebrl.config import ConfigError
from ebrl.policies.base import PolicySample
from ebrl.policies.build import build_policy
from ebrl.policies.flow import FlowPolicy
from ebrl.runtime.channel import WeightChannel
from tests.conftest import compose_config
from tests.policies.test_families import make_obs, make_spec

# each flow family, and the chains whose loops differ: every step stochastic (Flow-Noise's learned std), one random
# step (Flow-SDE, the index a tensor), and plain Euler steps (evaluation)
FAMILIES = [("openpi", ()), ("openpi", ("policy.variant=pi05",)), ("gr00t", ()), ("wam", ())]
CHAINS = [
    (("policy.logprob=flow_noise", "policy.chain_logprob=sum"), False),
    (("policy.logprob=flow_sde", "policy.chain_logprob=one_step"), False),
    (("policy.logprob=flow_sde", "policy.chain_logprob=mean"), True),
]
CASES = [(name, extra + chain, deterministic) for name, extra in FAMILIES for chain, deterministic in CHAINS]
IDS = [
    " ".join((name, *extra, "deterministic" if deterministic else "")).strip() for name, extra, deterministic in CASES
]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's compiles count from zero: dynamo's recompile limit is per code object (FlowPolicy.walk)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def built(name: str, extra: tuple[str, ...], capture: str, device: str = "cpu", seed: int = 0) -> FlowPolicy:
    """The policy `run.py policy=<name> <extra> policy.capture=<capture>` builds, its weights from `seed`."""
    cfg = OmegaConf.to_container(
        compose_config(f"policy={name}", *extra, f"policy.capture={capture}").policy, resolve=True
    )
    torch.manual_seed(seed)
    return build_policy(cfg, make_spec(), device)


def sampled(policy: FlowPolicy, obs: dict[str, torch.Tensor], deterministic: bool, seed: int) -> PolicySample:
    """sample on draws fixed by `seed` (x_0, each step's noise and one_step's index alike)."""
    torch.manual_seed(seed)
    return policy.sample({k: v.to(policy.velocity_out.weight.device) for k, v in obs.items()}, deterministic)


def assert_same(got: PolicySample, want: PolicySample, atol: float) -> None:
    assert got.extras.keys() == want.extras.keys()
    pairs = [(got.chunk, want.chunk), (got.log_prob, want.log_prob), (got.value, want.value)]
    pairs += [(got.extras[k], want.extras[k]) for k in want.extras]
    for a, b in pairs:
        assert a.shape == b.shape and torch.allclose(a.float().cpu(), b.float().cpu(), atol=atol, rtol=atol), float(
            (a.float().cpu() - b.float().cpu()).abs().max()
        )


def publish_new_weights(policies: list[FlowPolicy], seed: int) -> None:
    """Other weights through a real weight channel (the trainer's publish), pulled into each of `policies` as
    generation pulls them at a chunk boundary: copied into the tensors they hold."""
    torch.manual_seed(seed)
    other = {k: v.cpu() + 0.05 * torch.randn_like(v.cpu()) for k, v in policies[0].state_dict().items()}
    channel = WeightChannel(other, multiprocessing.get_context("spawn"), torch.float32)
    channel.publish(other)
    for policy in policies:
        pointers = [p.data_ptr() for p in policy.parameters()]
        assert channel.pull(policy, 0) == 1
        assert pointers == [p.data_ptr() for p in policy.parameters()]


def test_the_loop_traces_as_one_graph() -> None:
    """The loop has no graph break (no branch on a tensor, no host sync, no draw), which a CUDA graph needs: dynamo
    traces each family's whole loop, the one_step chain's index included, and its graph gives the loop's numbers."""
    for name, extra in FAMILIES:
        policy = built(name, extra + CHAINS[1][0], "off")
        obs = make_obs(policy, 3, seed=1)
        with torch.no_grad():
            cond, _ = policy.encode(obs)
            start = torch.randn(3, policy.chunk_len, policy.flow_dim)
            inputs = (cond, start, torch.randn(1, *start.shape), torch.tensor(2))
            state = torch.get_rng_state()
            traced = torch.compile(policy.walk, backend="eager", fullgraph=True)("one_step", *inputs)
            assert torch.equal(torch.get_rng_state(), state)  # it drew nothing
            for a, b in zip(traced, policy.walk("one_step", *inputs)):
                assert torch.equal(a, b), name


def test_a_capture_the_device_cannot_run_stops_at_build() -> None:
    with pytest.raises(ConfigError, match=r"policy.capture=graph needs a CUDA device"):
        built("openpi", (), "graph")
    policy = built("gr00t", (), "auto")
    assert policy.capture == "auto"
    with pytest.raises(ConfigError, match=r"policy.capture='always' is not available; accepted: auto, off, graph"):
        policy.capture = "always"


def equal_before_and_after_new_weights(
    name: str, extra: tuple[str, ...], deterministic: bool, capture: str, device: str, atol: float
) -> None:
    """`capture` against off on `device`: the same samples, at two batch sizes, and again after new weights."""
    plain, captured = built(name, extra, "off", device), built(name, extra, capture, device)
    for batch in (3, 5, 3):  # the second 3 replays what the first captured
        obs = make_obs(plain, batch, seed=batch)
        assert_same(sampled(captured, obs, deterministic, batch), sampled(plain, obs, deterministic, batch), atol)
    before = sampled(captured, obs, deterministic, 7)
    publish_new_weights([plain, captured], seed=1)
    after = sampled(captured, obs, deterministic, 7)
    assert_same(after, sampled(plain, obs, deterministic, 7), atol)
    assert not torch.allclose(after.chunk, before.chunk, atol=1e-3)  # the capture saw the new weights


@pytest.mark.slow
@pytest.mark.parametrize("name,extra,deterministic", CASES, ids=IDS)
def test_compiled_loop_samples_what_the_loop_samples(name: str, extra: tuple[str, ...], deterministic: bool) -> None:
    equal_before_and_after_new_weights(name, extra, deterministic, "compile", "cpu", atol=1e-5)


@CUDA
@pytest.mark.parametrize("name,extra,deterministic", CASES, ids=IDS)
def test_graphed_loop_samples_what_the_loop_samples(name: str, extra: tuple[str, ...], deterministic: bool) -> None:
    # the same kernels replayed: float32 (policy.dtype's default on CUDA is bfloat16; gpu_check measures that)
    equal_before_and_after_new_weights(
        name, extra + ("policy.dtype=float32",), deterministic, "graph", "cuda", atol=1e-5
    )
