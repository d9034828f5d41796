"""Generation: the policy that samples the next chunk of every ready group, and values the observations an episode
was cut off on or a segment ends on (docs/internals/design.md, "Processes and what crosses
between them").

It runs in one of two places behind one interface:
- in the supervisor (`LocalGeneration`): nothing crosses a process boundary on the hot path; with a trainer in the
  supervisor too (colocated) both are one policy;
- in a process of its own (`GenerationProcess`), which maps the trainer's published weights from shared memory
  (`WeightChannel`) and holds no other state. A process's MPS share (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) is read
  once, when its CUDA starts, so generation's new share is a new process: `respawn` starts the successor under the
  environment of the moment (the placement sets it), the old process serves until the successor says it is ready,
  and the next call switches over (make before break, `Succession`: the rollout does not wait for the start).
`scheduler.generation` picks the place; under MPS it is the process, so that an allocator's new share can apply.
"""

from __future__ import annotations

import functools
import multiprocessing.connection
import os
import signal
from typing import Any, Callable, Sequence

import torch

from ebrl.envs.base import EnvSpec
from ebrl.errors import StageFailed
from ebrl.policies.base import Policy
from ebrl.policies.build import build_policy
from ebrl.runtime.channel import SharedWeights, WeightChannel
from ebrl.runtime.messages import Ready, Release, Released, Sample, Sampled, Stop, Value, Values
from ebrl.runtime.piped import PipedProcess, report_failure, start_worker
from ebrl.runtime.placement import Placement
from ebrl.runtime.succession import Succession


class GenerationError(StageFailed):
    """The generation process failed or died; the message is its one-line reason."""


def _to(obs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in obs.items()}


def _sample(policy: Policy, obs: dict[str, torch.Tensor], device: torch.device, version: int) -> Sampled:
    out = policy.sample(_to(obs, device))
    return Sampled(
        out.chunk.cpu(),
        {k: v.cpu() for k, v in out.extras.items()},
        out.log_prob.cpu(),
        out.value.float().cpu(),
        version,
    )


def _value(policy: Policy, obs: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    return policy.value(_to(obs, device)).float().cpu()


class LocalGeneration:
    """Generation in the supervisor, on its policy: newer published weights are copied in before each sample (from
    the trainer process's channel; a trainer in the supervisor updates this very policy, `SharedWeights`)."""

    def __init__(self, policy: Policy, device: torch.device, channel: WeightChannel | SharedWeights) -> None:
        self.policy, self.device, self.channel = policy, device, channel
        self.version = 0  # of the weights the policy holds, counted by the channel

    @property
    def pid(self) -> int:
        return os.getpid()

    def sample(self, obs: dict[str, torch.Tensor]) -> Sampled:
        """Swap in newer weights (a chunk boundary), then sample a chunk per row."""
        self.version = self.channel.pull(self.policy, self.version)
        return _sample(self.policy, obs, self.device, self.version)

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) values by the weights held now (those that acted), no swap."""
        return _value(self.policy, obs, self.device)

    def release(self) -> None:
        """Let go of the trainer's device slots (it is about to be replaced); the weights held stay."""
        self.channel.release()

    def close(self) -> None:
        pass


def child_policy(
    policy_conf: dict[str, Any],
    spec: EnvSpec,
    channel: WeightChannel,
    cpus: Sequence[int],
    threads: int,
    device: str,
    seed: int,
) -> tuple[torch.nn.Module, int]:
    """A generation process's start (`start_worker`) and its policy (eval mode, policy.dtype) with the latest
    published weights; and their version."""
    start_worker(cpus, threads, seed, device)
    policy = build_policy(policy_conf, spec, device, weights="given")
    return policy, channel.pull(policy, -1)


def generation_main(
    policy_conf: dict[str, Any],
    spec: EnvSpec,
    channel: WeightChannel,
    requests: multiprocessing.connection.Connection,
    results: multiprocessing.connection.Connection,
    cpus: Sequence[int],
    threads: int,
    device: str,
    seed: int,
) -> None:
    """Body of a generation process: build the policy from the published weights, say Ready(version), then serve
    Sample -> Sampled, Value -> Values and Release -> Released until Stop or the supervisor is gone. A failure answers
    Failed(one line) and ends the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops us
    try:
        dev = torch.device(device)
        # the latest published weights (before any update, the supervisor's)
        policy, version = child_policy(policy_conf, spec, channel, cpus, threads, device, seed)
        results.send(Ready(version))
        while True:
            try:
                message = requests.recv()
            except (EOFError, OSError):  # the supervisor is gone
                return
            # no_grad, not inference_mode: the answers cross the pipe through shared memory, which inference
            # tensors cannot be moved to
            with torch.no_grad():
                if isinstance(message, Stop):
                    return
                if isinstance(message, Sample):
                    version = channel.pull(policy, version)
                    results.send(_sample(policy, message.obs, dev, version))
                elif isinstance(message, Value):
                    results.send(Values(_value(policy, message.obs, dev)))
                elif isinstance(message, Release):  # the trainer that owns the device slots is about to go
                    channel.release()
                    results.send(Released())
                else:
                    raise ValueError(f"unknown request {type(message).__name__}")
    except Exception as e:  # noqa: BLE001  (reported to the supervisor, which stops the run)
        report_failure(results, e)


class _Worker(PipedProcess):
    """One generation process and its two pipes."""

    what = "generation process"
    error = GenerationError

    def __init__(self, ctx: Any, args: tuple) -> None:
        super().__init__(ctx, generation_main, "ebrl-generation", args[:3], args[3:])


class GenerationProcess:
    """Generation in a process of its own (see the module docstring); `respawn` replaces it without a pause.

    `on_switch(old_pid, new_pid)` is called when a successor takes over (the placement moves its lease there).
    Each process seeds its sampling from `seed` plus 1000 times its place in the line of successors.
    """

    def __init__(
        self,
        policy_conf: dict[str, Any],
        spec: EnvSpec,
        channel: WeightChannel,
        cpus: Sequence[int],
        threads: int,
        device: str,
        seed: int,
        start_timeout: float = 600.0,
        on_switch: Callable[[int, int], None] | None = None,
    ) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.cpus = list(cpus)
        self.version = 0  # of the weights that sampled last, counted by the channel
        self.succession: Succession[_Worker] = Succession(
            lambda successor: _Worker(
                ctx,
                (
                    policy_conf,
                    spec,
                    channel,
                    self.cpus,
                    threads,
                    device,
                    seed + 1000 * self.succession.respawns if successor else seed,
                ),
            ),
            start_timeout,
            on_switch,
        )

    @property
    def pid(self) -> int:
        """The process serving now."""
        return self.succession.current.pid

    def sample(self, obs: dict[str, torch.Tensor]) -> Sampled:
        """The serving process swaps in newer weights, then samples a chunk per row."""
        if self.succession.successor_ready():  # (its start failing is this call's error)
            self._switch()
        out = self.succession.current.call(Sample(obs), Sampled)
        self.version = out.version
        return out

    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) values by the weights the serving process holds (those that acted), no swap."""
        return self.succession.current.call(Value(obs), Values).values

    def release(self) -> None:
        """Every process lets go of the trainer's device slots (it is about to be replaced); a successor that is
        still starting is waited for first."""
        self.wait_switch()
        self.succession.current.call(Release(), Released)

    def respawn(self, cpus: Sequence[int] | None = None, overlap: bool = True) -> None:
        """Start a successor in this process's environment of the moment (a new MPS share: set it around this call),
        on `cpus` if given; it takes over at the first call after it is ready. A successor still starting is
        replaced by this one. Without `overlap` (no room on the GPU for a second copy of the weights) the serving
        process stops first and this call waits for the successor."""
        if cpus is not None:
            self.cpus = list(cpus)
        if not overlap:
            self.succession.current.close()
        self.succession.respawn()
        if not overlap:
            self.wait_switch()

    def wait_switch(self, timeout: float | None = None) -> None:
        """Block until a started successor serves (tests, and a run that must not end with one still starting)."""
        if self.succession.successor is not None:
            self.succession.successor_ready(self.succession.start_timeout if timeout is None else timeout)
            self._switch()

    def close(self) -> None:
        self.succession.close()

    def _switch(self) -> None:
        self.succession.switch().close()


def make_generation(
    conf: dict[str, Any],
    spec: EnvSpec,
    policy: Policy,
    placement: Placement,
    weights: WeightChannel | SharedWeights,
    seed: int,
) -> LocalGeneration | GenerationProcess:
    """Generation where the placement puts it: on `policy` in the supervisor, or in a process of its own started in
    its stage's environment, on its cores, with this process's torch threads, mapping the trainer's `weights`."""
    if placement.generation != "process":
        return LocalGeneration(policy, placement.device, weights)
    with placement.spawn_env("generate"):
        return GenerationProcess(
            conf["policy"],
            spec,
            weights,
            placement.cpus("generate"),
            torch.get_num_threads(),
            str(placement.device),
            seed,
            on_switch=functools.partial(placement.switched, "generate"),
        )
