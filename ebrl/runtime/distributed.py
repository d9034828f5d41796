"""Several ranks on torch.distributed (docs/internals/design.md, "Processes and what crosses between them"): one rank
per GPU (per node on CPU), each with its own rollout runtime (simulators, generation) feeding its own trainer; the
trainers are data-parallel (DDP).

Launch with torchrun, one process per rank: `torchrun --nnodes N --nproc-per-node G run.py hw=...`. torchrun sets
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a plain `python run.py` is one rank.

Two process groups per rank, on the one store torchrun gives:
- the supervisors' (gloo, this module's `init_supervisors`): the run folder, the first weights, each iteration's
  metrics (gathered to rank 0, which logs the run's totals and checks that the replicas agree);
- the trainers' (gloo on CPU, NCCL on GPU, `join_trainers`): DDP's gradient all-reduce. In a pipelined schedule the
  trainer is its own process, so it joins under a prefix of the store; colocated trains in the supervisor, on its
  group (plus an NCCL group on GPUs).
After update k every trainer holds the same weights and publishes them to its own node's generation as version k.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ebrl.errors import StageFailed
from ebrl.node import Ranks, visible_gpu
from ebrl.policies.training import is_sharded
from ebrl.telemetry.metrics import wilson_interval

# Rates and counts add up over ranks; the iteration's wall time is the slowest rank's; episode figures are averaged
# over episodes, everything else over ranks.
SUMMED = (
    "perf/env_steps_per_s",
    "perf/rollout_only_steps_per_s",
    "perf/iteration_env_steps",
    "env/episodes",
    "env/successes",
)
SLOWEST = ("time/iteration_s",)
EPISODE_MEANS = ("env/return", "env/episode_length", "env/success_rate")  # weighted by each rank's env/episodes
TASK_MEANS = ("success", "return")  # env/<task>/<figure> of a multi-task run: weighted by env/<task>/episodes
# Keys every rank must agree on after an update: the weights' version and their fingerprint.
AGREED = ("sched/weights_version", "dist/weights_sum")
PER_RANK = ("perf/env_steps_per_s", "env/return", "dist/weights_sum")  # also logged per rank, as ranks/<r>/<key>
# A rank's own GPU's figure under its node's number (GpuMonitor.read): GPU 0 of one node is not GPU 0 of another, so
# these are logged per rank, as ranks/<r>/gpu<i>_<figure>, and the run's are taken over every rank's GPUs
GPU_FIGURE = re.compile(r"perf/gpu(\d+)_(\w+)")


class DistributedError(StageFailed):
    """Another rank stopped or failed, or the replicas disagree; the message is one line."""


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def pin_gpu(ranks: Ranks) -> None:
    """Show a rank of several only its node's GPU local_rank (of those it was given), as its cuda:0: its
    generation, trainer and MPS daemon then treat it as a one-GPU node. Before CUDA initialises."""
    if not ranks.distributed:
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpu(ranks.local_rank)


def init_supervisors(ranks: Ranks, timeout_s: float) -> None:
    """The supervisors' gloo group, from torchrun's environment."""
    if ranks.distributed and not dist.is_initialized():
        dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=_timeout(timeout_s))


def join_trainers(ranks: Ranks, backend: str, timeout_s: float) -> None:
    """The trainer processes' group (a pipelined schedule's trainer is a child of the supervisor and inherits its
    environment): on the store the supervisors' group already serves, under a prefix of its own."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=_timeout(timeout_s)
    )
    prefix = f"ebrl-trainers/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=ranks.rank,
        world_size=ranks.world,
        timeout=_timeout(timeout_s),
    )


def trainer_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _collective(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except (RuntimeError, dist.DistBackendError) as e:  # gloo: "Connection closed by peer", a timeout, ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(f"{what} failed: another rank stopped or failed ({reason})") from None


def broadcast_object(obj: Any, ranks: Ranks) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ranks.distributed:
        return obj
    box = [obj if ranks.leader else None]
    _collective("broadcast from rank 0", dist.broadcast_object_list, box, 0)
    return box[0]


def broadcast_module(module: torch.nn.Module, ranks: Ranks) -> None:
    """Rank 0's parameters and buffers into every rank's `module` (the first weights of a run are rank 0's)."""
    if not ranks.distributed:
        return
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point() or tensor.dtype in (torch.int64, torch.int32, torch.bool, torch.uint8):
                host = tensor.detach().to("cpu").contiguous()
                _collective("weight broadcast", dist.broadcast, host, 0)
                tensor.copy_(host)


def gather_metrics(metrics: dict[str, Any], ranks: Ranks) -> list[dict[str, Any]]:
    """Every rank's metrics of this iteration, in rank order (on every rank)."""
    if not ranks.distributed:
        return [metrics]
    out: list[Any] = [None] * ranks.world
    _collective("gathering the iteration's metrics", dist.all_gather_object, out, metrics)
    return out


def episode_count(key: str) -> str | None:
    """The count an episode figure is averaged over the ranks with: env/episodes for the run's (EPISODE_MEANS),
    env/<task>/episodes for a task's (TASK_MEANS); None for any other key."""
    if key in EPISODE_MEANS:
        return "env/episodes"
    head, _, figure = key.rpartition("/")
    if key.startswith("env/") and figure in TASK_MEANS and head != "env":
        return f"{head}/episodes"
    return None


def combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One iteration's run-wide metrics from the ranks' own (see SUMMED, SLOWEST); ranks/<r>/<key> for PER_RANK and
    for each rank's own GPUs' figures (GPU_FIGURE).

    Raises DistributedError when the ranks disagree on a key of AGREED (their weights after the same update)."""
    first = per_rank[0]
    for key in AGREED:
        values = [m.get(key) for m in per_rank]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise DistributedError(
                f"the ranks' {key} differ after iteration {first.get('iteration')} ({shown}); "
                "their weights are no longer the same"
            )
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):  # every key, in first-seen order
        if GPU_FIGURE.fullmatch(key):
            continue
        values = [m[key] for m in per_rank if key in m]
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) != len(values) or not numbers:
            if key in first:
                out[key] = first[key]  # text (an allocator decision): rank 0's
            continue
        weight_key = episode_count(key)
        if key in SUMMED or (key.startswith("env/") and key.endswith("/episodes")):  # (a task's episodes too)
            out[key] = sum(numbers)
        elif key in SLOWEST:
            out[key] = max(numbers)
        elif key in AGREED or key in ("iteration", "env_steps"):
            out[key] = first[key]
        elif weight_key is not None:  # over the episodes that finished, wherever they ran
            pairs = [(float(m[key]), float(m.get(weight_key, 0))) for m in per_rank if key in m]
            weight = sum(w for _, w in pairs)
            out[key] = sum(v * w for v, w in pairs) / weight if weight else float("nan")
        else:
            finite = [v for v in numbers if not math.isnan(v)]
            out[key] = sum(finite) / len(finite) if finite else float("nan")
    gpus: dict[str, list[float]] = {}
    for r, m in enumerate(per_rank):
        for key in PER_RANK:
            if key in m:
                out[f"ranks/{r}/{key.split('/')[-1]}"] = m[key]
        for key, value in m.items():
            match = GPU_FIGURE.fullmatch(key)
            if match:
                out[f"ranks/{r}/gpu{match[1]}_{match[2]}"] = value
                gpus.setdefault(match[2], []).append(float(value))
    for figure, values in gpus.items():  # over every rank's GPUs: the mean utilisation, the largest memory peak
        out[f"perf/gpu_{figure}"] = max(values) if figure == "mem_gb" else sum(values) / len(values)
    if (
        out.get("env/episodes") and "env/successes" in out
    ):  # the interval of the run's success rate, over every rank's episodes
        out["env/success_low"], out["env/success_high"] = wilson_interval(
            round(out["env/successes"]), round(out["env/episodes"])
        )
    out["dist/ranks"] = len(per_rank)
    return out


def shard(policy: torch.nn.Module) -> None:
    """FSDP (distributed.strategy=fsdp): shard the policy's parameters, gradients and Adam moments over the ranks, as
    one unit that `evaluate` (and `value`, for a decoupled update's bootstrap values, and `prefix`, a frozen prefix's
    once per update) gathers whole for its pass. (Units per block would gather less at once, but our policies
    call their blocks' attention through methods other than forward, which FSDP does not see; measured: every family
    fails that way, and trains as one unit.)"""
    import warnings

    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    fully_shard(policy)
    register_fsdp_forward_method(policy, "evaluate")
    register_fsdp_forward_method(policy, "value")
    register_fsdp_forward_method(policy, "prefix")  # (a frozen prefix, computed once per update: PPOTrainer.prefixes)
    # evaluate returns views (of the log-prob and value heads' outputs); the trainer only uses them out of place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


class Gathered:
    """A module's state dict whose sharded tensors (FSDP's) a reader gathers whole one at a time (`whole`), so that no
    rank holds the whole state at once beside its shards (a collective: every rank reads the same tensors in the same
    order); with `fingerprint`, the tensors are summed as they pass, so `weights_sum` gathers nothing again."""

    def __init__(self, module: torch.nn.Module, fingerprint: bool = False) -> None:
        self.state = module.state_dict()
        self.sharded = is_sharded(module)
        floating = (v for v in self.state.values() if v.is_floating_point())
        self._position = {id(v): i for i, v in enumerate(floating)} if fingerprint else {}
        self._terms: dict[int, torch.Tensor] = {}

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (one of `state`'s) whole: gathered where it is a shard, itself otherwise."""
        from torch.distributed.tensor import DTensor

        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        i = self._position.get(id(tensor))
        if i is not None and i not in self._terms:
            self._terms[i] = _fingerprint_term(i, full)
        return full

    def weights_sum(self) -> float:
        """`weights_sum` of the whole state (its floating-point tensors not read yet are read now)."""
        for value in self.state.values():
            if id(value) in self._position:
                self.whole(value)
        return _fingerprint([self._terms[i] for i in sorted(self._terms)])


def _fingerprint_term(position: int, tensor: torch.Tensor) -> torch.Tensor:
    return (position + 1) * tensor.detach().double().sum()


def _fingerprint(terms: list[torch.Tensor]) -> float:
    return float(torch.stack(terms).sum()) if terms else 0.0  # (one device sync, not one per tensor)


@torch.no_grad()
def weights_sum(state: Mapping[str, torch.Tensor]) -> float:
    """A fingerprint of a state dict: the float64 sum of its floating-point tensors, each scaled by its position (so
    swapped tensors change it). Replicas with the same weights give exactly the same number; so does a checkpoint
    of them, and `Gathered.weights_sum` of a sharded module's."""
    floating = (v for v in state.values() if v.is_floating_point())
    return _fingerprint([_fingerprint_term(i, t) for i, t in enumerate(floating)])
