"""What a policy's GPU stages cost, from its operations and a GPU's published peaks (a roofline per operation): the
at-scale benchmark's GPU side (docs/internals/at-scale.md), where no GPU has been measured.

The policy is built on the meta device, as the memory model builds it (ebrl/alloc/memory.py), and one call is traced
operation by operation (`count_ops`): each ATen operation's FLOPs (torch's own formulas, `flop_counter`) and the bytes
it reads and writes (its tensors' sizes; views move nothing). Attention is counted as one fused kernel (FlashAttention
reads q, k, v and writes the output once; the meta device would decompose it into a materialised score matrix).

An operation's time on the GPU at SM share s is the roofline's, max(FLOPs / peak, bytes / bandwidth) / s (an MPS
client's SMs bound both its arithmetic and its memory traffic: an assumption, the simplest one), and never less than
the host's time to issue it (`host_s`: eager PyTorch dispatches every operation from Python): a call costs the sum
of max(host, GPU) over its operations. The GPU is busy for the roofline part only; the rest is the launch gap the
paper's "below 20% SM occupancy" is made of.

Training: an update's forward pass is traced (operations are linear in the rows); backward costs twice the forward's
FLOPs and bytes (the usual 2:1, Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1) for the
operations whose inputs require gradients (with policy.train=action_expert the frozen VLM's run forward only), and
gradient checkpointing runs those forwards once more. AdamW reads and writes the float32 masters, reads
their gradients and reads and writes both moments once per optimizer step; several ranks add a ring all-reduce of the
gradients over NVLink per optimizer step. Every constant below names its source.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ebrl.envs.base import EnvSpec
from ebrl.shape import RolloutShape, micro_rows, minibatch_rows


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's published peaks: dense bfloat16 tensor-core FLOP/s, HBM bytes/s, NVLink bytes/s per GPU (both
    directions), SMs, memory, and the network link its node gives each GPU to other nodes (bytes/s each way, the
    vendor's reference node: DGX); `source`: where the figures are published."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    sm_count: int
    memory_gb: float
    source: str
    node_link_bytes_per_s: float = 0.0


# keyed by hw.gpu_name (conf/hw)
GPUS = {
    "A100-SXM4-80GB": GpuSpec(
        "A100-SXM4-80GB",
        312e12,
        2.039e12,
        600e9,
        108,
        80,
        "NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e "
        "(80GB SXM), NVLink 600 GB/s; DGX A100 user guide: a 200 Gb/s HDR InfiniBand port per "
        "GPU",
        node_link_bytes_per_s=25e9,
    ),
    "H100-SXM5-80GB": GpuSpec(
        "H100-SXM5-80GB",
        989e12,
        3.35e12,
        900e9,
        132,
        80,
        "NVIDIA H100 Tensor Core GPU datasheet (2023): 989 TFLOPS BF16 dense (1,979 with "
        "sparsity), 3.35 TB/s HBM3 (SXM), NVLink 900 GB/s; DGX H100 user guide: a 400 Gb/s NDR "
        "InfiniBand port per GPU",
        node_link_bytes_per_s=50e9,
    ),
    "H200": GpuSpec(
        "H200",
        989e12,
        4.8e12,
        900e9,
        132,
        141,
        "NVIDIA H200 Tensor Core GPU datasheet (2024): 989 TFLOPS BF16 dense (1,979 with sparsity), "
        "4.8 TB/s HBM3e (SXM), NVLink 900 GB/s; DGX H200 user guide: a 400 Gb/s NDR InfiniBand port "
        "per GPU",
        node_link_bytes_per_s=50e9,
    ),
}
BACKWARD_OVER_FORWARD = 2.0  # Kaplan et al. 2020, section 2.1: a backward pass costs about twice the forward


def gpu_spec(name: str) -> GpuSpec:
    from ebrl.config import ConfigError

    if name not in GPUS:
        raise ConfigError(
            f"hw.gpu_name={name!r} has no published peaks here; known: {', '.join(GPUS)} "
            "(ebrl/forecast/gpu_cost.py, GPUS)"
        )
    return GPUS[name]


# --- counting --------------------------------------------------------------------------------
class _Fused(TorchFunctionMode):
    """Above autograd: marks the operations of a call whose inputs require gradients (backward runs for them), and
    counts attention as one kernel: its FLOPs (4 x batch x heads x queries x keys x head dim) and q, k, v and the
    output once; what the meta device runs for it underneath is not counted."""

    def __init__(self, tally: "OpTally") -> None:
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        outer = self.tally.grad
        self.tally.grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))
        )
        try:
            if func is not F.scaled_dot_product_attention:
                return func(*args, **kwargs)
            return self._attention(func, args, kwargs)
        finally:
            self.tally.grad = outer

    def _attention(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.tally.hidden += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.tally.hidden -= 1
        q, k, v = args[:3]
        flops = 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
        self.tally.add(flops, sum(t.numel() * t.element_size() for t in (q, k, v, out)))
        return out


class OpTally(TorchDispatchMode):
    """Each ATen operation run under it, as (FLOPs, bytes read and written); views and detaches are free."""

    FREE = {torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default}

    def __init__(self) -> None:
        super().__init__()
        self.flops: list[float] = []
        self.bytes: list[float] = []
        self.grads: list[bool] = []  # backward runs for it
        self.hidden = 0  # inside a fused operation
        self.grad = False  # the running call's inputs require gradients

    def add(self, flops: float, nbytes: float) -> None:
        self.flops.append(float(flops))
        self.bytes.append(float(nbytes))
        self.grads.append(self.grad)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.hidden or func.is_view or func in self.FREE:
            return out
        flops = (
            flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            if func.overloadpacket in flop_registry
            else 0
        )
        nbytes = sum(
            t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)
        )
        self.add(flops, nbytes)
        return out


def count_ops(call: Callable[[], Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(FLOPs, bytes, whether backward runs for it) of each operation `call` runs (on the meta device)."""
    tally = OpTally()
    with _Fused(tally), tally:
        call()
    return np.asarray(tally.flops), np.asarray(tally.bytes), np.asarray(tally.grads, bool)


@dataclass
class Ops:
    """A call's operations at two rows and at three: any batch's by linear interpolation (each operation's FLOPs and
    bytes are an intercept, the weights, plus a slope, the rows; at one row a few operations fold away, so the
    counts are taken above it)."""

    flops: tuple[np.ndarray, np.ndarray]
    bytes: tuple[np.ndarray, np.ndarray]
    grad: np.ndarray  # backward runs for it (its inputs require gradients)

    @classmethod
    def of(cls, call: Callable[[int], Any]) -> "Ops":
        (f2, b2, g2), (f3, b3, _) = count_ops(lambda: call(2)), count_ops(lambda: call(3))
        if len(f2) != len(f3):
            raise ValueError(f"a call runs {len(f2)} operations at two rows and {len(f3)} at three: not linear in rows")
        return cls((f2, f3), (b2, b3), g2)

    def at(self, rows: float) -> tuple[np.ndarray, np.ndarray]:
        (f2, f3), (b2, b3) = self.flops, self.bytes
        return np.maximum(f2 + (f3 - f2) * (rows - 2), 0), np.maximum(b2 + (b3 - b2) * (rows - 2), 0)

    @property
    def count(self) -> int:
        return len(self.flops[0])


@dataclass
class PolicyOps:
    """A full-size policy's operations: sampling, valuing, one training forward pass; and the figures an update's
    optimizer and all-reduce need."""

    sample: Ops
    value: Ops
    forward: Ops  # the trainer's evaluate, at its dtype (float32 masters cast by autocast)
    trained: int  # parameters the optimizer steps
    checkpointing: bool
    parameters: int
    chunk_len: int
    action_dim: int
    # a frozen prefix (Policy.frozen_prefix): the trainer's `prefix` alone, and evaluate given it; None: none
    prefix: Ops | None = None
    cached: Ops | None = None

    @classmethod
    def of(cls, policy_cfg: dict[str, Any], spec: EnvSpec, device: str = "cuda") -> "PolicyOps":
        from ebrl.alloc.memory import MetaAutocast, meta_extras, meta_obs
        from ebrl.policies.build import build_policy, policy_dtype

        dtype = policy_dtype(policy_cfg, device)
        conf = {**policy_cfg, "dtype": str(dtype).removeprefix("torch.")}
        gen = build_policy(conf, spec, "meta", train=False, weights="given")
        gen.compute_dtype = torch.float32  # (torch.autocast takes no meta tensors: MetaAutocast stands in)
        # (a fresh cast per call: autocast casts a float32 weight once per pass, and again in the next)

        def sampled(rows: int) -> None:
            with torch.no_grad(), MetaAutocast(dtype, list(gen.parameters())):
                gen.sample(meta_obs(gen, spec, rows))

        def valued(rows: int) -> None:
            with torch.no_grad(), MetaAutocast(dtype, list(gen.parameters())):
                gen.value(meta_obs(gen, spec, rows))

        sample, value = Ops.of(sampled), Ops.of(valued)
        chunk_len, action_dim = gen.chunk_len, gen.action_dim
        trainer = build_policy(conf, spec, "meta", train=True, weights="given")
        trainer.compute_dtype = torch.float32
        checkpointing = any(getattr(m, "grad_checkpoint", False) for m in trainer.modules())
        for m in trainer.modules():  # (the forward's operations; recomputation is counted as one more forward)
            if hasattr(m, "grad_checkpoint"):
                m.grad_checkpoint = False

        def evaluated(rows: int, prefix: Any = None) -> None:
            chunk = torch.empty(rows, trainer.chunk_len, trainer.action_dim, device="meta")
            with MetaAutocast(dtype, list(trainer.parameters())):
                trainer.evaluate(meta_obs(trainer, spec, rows), chunk, meta_extras(trainer, rows), prefix=prefix)

        def prefixed(rows: int) -> Any:
            with torch.no_grad(), MetaAutocast(dtype, list(trainer.parameters())):
                return trainer.prefix(meta_obs(trainer, spec, rows))

        prefix = cached = None
        if trainer.frozen_prefix():  # (the prefix computed outside the traced call: it is given)
            prefixes = {rows: prefixed(rows) for rows in (2, 3)}
            prefix, cached = Ops.of(prefixed), Ops.of(lambda rows: evaluated(rows, prefixes[rows]))
        return cls(
            sample=sample,
            value=value,
            forward=Ops.of(evaluated),
            prefix=prefix,
            cached=cached,
            trained=sum(p.numel() for p in trainer.parameters() if p.requires_grad),
            checkpointing=checkpointing,
            parameters=sum(p.numel() for p in trainer.parameters()),
            chunk_len=chunk_len,
            action_dim=action_dim,
        )


# --- time ------------------------------------------------------------------------------------
@dataclass
class GpuTime:
    """A call's seconds on the GPU at an SM share, and the share of the GPU its kernels kept busy over them."""

    seconds: float
    sm_busy: float  # SM-seconds / (seconds x the whole GPU's SMs)


def roofline(
    ops: Ops, rows: float, gpu: GpuSpec, share: float, host_s: float, only_grad: bool = False, factor: float = 1.0
) -> GpuTime:
    """Σ max(host_s, factor x roofline / share) over the operations (see the module docstring); `only_grad`: those
    backward runs for."""
    flops, nbytes = ops.at(rows)
    kernel = factor * np.maximum(flops / gpu.bf16_flops, nbytes / gpu.hbm_bytes_per_s) / share
    if only_grad:
        kernel = kernel[ops.grad]
    seconds = float(np.maximum(kernel, host_s).sum())
    return GpuTime(seconds, float(kernel.sum()) * share / seconds if seconds > 0 else 0.0)


@dataclass
class UpdateShape:
    """How an update walks its rollout: the run's algo config (epochs, rows per optimizer step and per forward
    pass, Adam's moments' dtype) and the data-parallel ranks (each holds its share of the rows)."""

    algo: Any
    ranks: int = 1
    nodes: int = 1  # the ranks' machines: a ring over several crosses their network links
    sharded: bool = False  # FSDP over the ranks (distributed.strategy), else replicas (DDP)


def _split(total: int, size: int) -> list[int]:
    return [size] * (total // size) + ([total % size] if total % size else [])


def train_time(
    ops: PolicyOps, rows: int, shape: UpdateShape, gpu: GpuSpec, share: float, host_s: float, proximal: int = 0
) -> GpuTime:
    """One rank's update on `rows` rows (its own share of the rollout), as PPOTrainer.update runs it: a frozen
    prefix once per row (algo.cache_prefix), a forward pass for the proximal policy over `proximal` rows (the
    stale rows of an overlapped schedule's decoupled PPO, every row of a bfloat16 colocated one: ppo.proximal_rows),
    micro-batches' forward and backward (and a recomputed forward with checkpointing), AdamW per optimizer step, the
    gradients' ring all-reduce over ranks."""
    from ebrl.alloc.memory import MOMENT_BYTES

    algo = shape.algo
    per_step = minibatch_rows(algo, rows, shape.ranks)
    micro = micro_rows(algo, per_step)
    minibatches = _split(rows, per_step)
    passes = Counter(size for mb in minibatches for size in _split(mb, micro))  # (the last of each smaller)
    steps = algo.epochs * len(minibatches)
    cached = ops.cached is not None and algo.get("cache_prefix", True)
    forward = ops.cached if cached else ops.forward
    compute = busy = 0.0
    once = [(ops.prefix, size) for size in _split(rows, micro)] if cached else []  # forward only, micro at a time
    once += [(forward, size) for size in _split(proximal, micro)]  # the proximal pass (PPOTrainer.proximal)
    for call, size in once:
        part = roofline(call, size, gpu, share, host_s)
        compute, busy = compute + part.seconds, busy + part.seconds * part.sm_busy
    for size, count in passes.items():
        # a pass: the forward, the backward of the operations that need one (twice their forward), and with
        # checkpointing those forwards again
        parts = [
            roofline(forward, size, gpu, share, host_s),
            roofline(forward, size, gpu, share, host_s, only_grad=True, factor=BACKWARD_OVER_FORWARD),
        ]
        if ops.checkpointing:
            parts.append(roofline(forward, size, gpu, share, host_s, only_grad=True))
        compute += algo.epochs * count * sum(p.seconds for p in parts)
        busy += algo.epochs * count * sum(p.seconds * p.sm_busy for p in parts)
    # AdamW: masters (4 B) and both moments read and written, gradients (4 B) read; memory-bound (a shard's alone)
    adam_bytes = ops.trained * (2 * 4 + 4 + 2 * 2 * MOMENT_BYTES[algo.get("optimizer_dtype", "float32")])
    sharded = shape.sharded and shape.ranks > 1
    adam = adam_bytes / gpu.hbm_bytes_per_s / share / (shape.ranks if sharded else 1)
    # rings at the pace of the slowest link (NVLink within a node, the network between nodes): each GPU sends and
    # receives (n-1)/n of what is gathered or reduce-scattered, twice that for an all-reduce
    link = gpu.nvlink_bytes_per_s / 2 if shape.nodes == 1 else gpu.node_link_bytes_per_s
    ring = (shape.ranks - 1) / shape.ranks / link
    per_step = per_pass = per_forward = 0.0
    if sharded:  # FSDP, the policy one unit: every pass gathers the weights (a training pass again for backward,
        # then reduce-scatters the float32 gradients); no all-reduce
        weights = ops.trained * 4 + (ops.parameters - ops.trained) * 2
        per_forward, per_pass = ring * weights, ring * (2 * weights + 4 * ops.trained)
    elif shape.ranks > 1:  # DDP: the float32 gradients all-reduced once per optimizer step
        per_step = 2 * ring * ops.trained * 4
    training_passes = algo.epochs * sum(passes.values())
    seconds = compute + steps * (adam + per_step) + training_passes * per_pass + len(once) * per_forward
    return GpuTime(seconds, (busy + steps * adam * share) / seconds)


def kernel_shares(
    ops: PolicyOps,
    batch: int,
    rows: int,
    shape: UpdateShape,
    gpu: GpuSpec,
    host_s: float,
) -> dict[str, float]:
    """Of each GPU stage's time on the whole GPU, the share its kernels keep the SMs busy (the rest is the host
    issuing them, which a smaller SM share does not stretch): generation's sample at its `batch`, an update of
    `rows`. The allocator sizes the stages' SM shares by it (ebrl/alloc/allocator.py)."""
    return {
        "generate": roofline(ops.sample, batch, gpu, 1.0, host_s).sm_busy,
        "train": train_time(ops, rows, shape, gpu, 1.0, host_s).sm_busy,
    }


def roofline_shares(
    cfg: Any,
    spec: EnvSpec,
    rollout: RolloutShape,
    sharded: bool,
    device_type: str,
) -> tuple[dict[str, float], str] | None:
    """`kernel_shares` for a run's config and its rollout's shape (generation's batch, the update's rows over the
    ranks) on hw.gpu_name's published peaks, and where they come from; a GPU without them: None. The run hands it
    to its placement (`Placement.check_memory`), whose calibrating allocator sizes the stages' SM shares by it
    before it has measured any."""
    if cfg.hw.gpu_name not in GPUS:
        return None
    ops = PolicyOps.of(OmegaConf.to_container(cfg.policy, resolve=True), spec, device_type)
    shape = UpdateShape(cfg.algo, rollout.ranks, int(cfg.hw.nodes), sharded=sharded)
    shares = kernel_shares(
        ops, rollout.envs_per_group, rollout.rows, shape, GPUS[cfg.hw.gpu_name], host_seconds_per_op()[0]
    )
    return shares, f"the roofline's on {cfg.hw.gpu_name}'s published peaks"


def host_seconds_per_op() -> tuple[float, str]:
    """Eager PyTorch's host time per operation, measured here: the tiny openpi's `sample` at batch 1 on one thread,
    over the operations it runs (its own small kernels included: an upper bound of the dispatch alone)."""
    import time

    from ebrl.envs.base import ArraySpec
    from ebrl.policies.build import build_policy

    spec = EnvSpec(
        obs={"state": ArraySpec((8,), "float32")}, action_dim=7, instruction="pick up the cube", max_episode_steps=100
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            policy = build_policy(
                {"_target_": "ebrl.policies.openpi.OpenPIPolicy", "name": "openpi", "preset": "tiny"},
                spec,
                torch.device("cpu"),
                train=False,
                weights="init",
            )
            tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([spec.instruction]))
            obs = {"state": torch.zeros(1, 8), "tokens": tokens, "token_mask": mask}
            ops = len(count_ops(lambda: policy.sample(obs))[0])
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                policy.sample(obs)
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    per_op = float(np.median(times[5:])) / ops
    return per_op, (
        f"measured here {time.strftime('%Y-%m-%d')}: the tiny openpi's sample at batch 1, one thread, "
        f"{1e6 * per_op:.1f} us per operation over {ops}"
    )
