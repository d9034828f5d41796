"""What each stage of a run holds in memory, predicted from the policy built on the meta device
(docs/internals/design.md, "Placement"): `python -m ebrl.bench.memory` sets it against measured peaks and says what fits
which GPU.

Trainer: the weights (float32 masters of what `policy.train` trains, policy.dtype for the frozen rest), their
gradients (float32), Adam's two moments (algo.optimizer_dtype), autocast's bfloat16 copies of the float32 weights a
bfloat16 forward pass reads (held until the pass ends), the activations of one micro-batch (the tensors autograd
saves, traced on the meta device with the run's checkpointing, plus the block that backward recomputes and its
gradients), the rollout it trains on, moved to its device, and a frozen prefix's output for each of its rows (computed
once per update: docs/internals/design.md, "The frozen prefix").
Generation: the weights in policy.dtype and, per env of its batch, the prefix cache (or the family's conditioning)
and the denoising chain.
Publication: the channel's slots (two payloads in policy.dtype; on one GPU they are on the device and the host
holds one for the first weights). Shared memory: those host slots, every simulator's slot, one rollout in flight
to the trainer and, on rank 0, the model and Adam state its trainer sends for a checkpoint.
Not modelled: the allocator's fragmentation and the kernels' workspaces (they are in the measured process's
figures), and the CUDA context, taken as `CUDA_CONTEXT_BYTES` per process, and the render context a simulator holds
on the GPU (MuJoCo's EGL context for its cameras, SAPIEN's Vulkan one, which ManiSkill sets up even for state
observations: `render_contexts`), `RENDER_CONTEXT_BYTES`: estimates until measured on a GPU (ebrl.bench.gpu_check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ebrl.envs.base import EnvSpec
from ebrl.policies.build import build_policy, executed_actions, policy_dtype
from ebrl.policies.flow import FlowPolicy
from ebrl.policies.layers import Block, map_tensors

GiB = 2**30
CUDA_CONTEXT_BYTES = 512 * 2**20  # per process that touches CUDA (estimate; gpu_check measures it)
RENDER_CONTEXT_BYTES = 256 * 2**20  # per simulator holding an EGL or Vulkan context on a GPU (estimate)
MOMENT_BYTES = {"float32": 4, "bfloat16": 2}


def _bytes(tensors: Any) -> int:
    total = 0

    def add(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    map_tensors(tensors, add)
    return total


def meta_obs(policy: Any, spec: EnvSpec, rows: int) -> dict[str, torch.Tensor]:
    """A batch of `rows` observations on the meta device, shaped as the env's."""
    tokens, mask = policy.tokenize([spec.instruction] * rows)
    obs = {"tokens": torch.from_numpy(tokens).to("meta"), "token_mask": torch.from_numpy(mask).to("meta")}
    for key, array in spec.obs.items():
        obs[key] = torch.empty(
            (rows, *array.shape), dtype=torch.uint8 if array.dtype == "uint8" else torch.float32, device="meta"
        )
    return obs


def meta_extras(policy: Any, rows: int) -> dict[str, torch.Tensor]:
    if isinstance(policy, FlowPolicy):
        extras = {
            "chain": torch.empty(rows, policy.denoise_steps + 1, policy.chunk_len, policy.flow_dim, device="meta")
        }
        if policy.chain_logprob == "one_step":
            extras["denoise_index"] = torch.zeros(rows, dtype=torch.long, device="meta")
        return extras
    return {}


class MetaAutocast(TorchFunctionMode):
    """Autocast's casts on the meta device, where torch.autocast does not run: the floating-point inputs of matmuls,
    convolutions and attention become `dtype` (a weight's cast once, as autocast caches it). `weights` collects the
    storages of the weights and of their casts, which are no activations."""

    LOW = (
        F.linear,
        F.conv2d,
        F.scaled_dot_product_attention,
        torch.matmul,
        torch.bmm,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
    )

    def __init__(self, dtype: torch.dtype, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.dtype, self.params = dtype, {id(p) for p in params}
        self.weights = {p.untyped_storage()._cdata for p in params}
        self.cache: dict[int, torch.Tensor] = {}

    def cast(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == self.dtype:
            return t
        if id(t) not in self.params:
            return t.to(self.dtype)
        if id(t) not in self.cache:
            self.cache[id(t)] = t.to(self.dtype)
            self.weights.add(self.cache[id(t)].untyped_storage()._cdata)
        return self.cache[id(t)]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self.LOW and self.dtype != torch.float32:
            args = tuple(self.cast(a) for a in args)
            kwargs = {k: v if k == "attn_mask" else self.cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def saved_activations(policy: Any, spec: EnvSpec, rows: int, dtype: torch.dtype) -> int:
    """Bytes autograd saves for backward in one evaluate of `rows` rows, traced on the meta device under
    `MetaAutocast` to `dtype`: the weights and autocast's copies of them aside."""
    mode = MetaAutocast(dtype, list(policy.parameters()))
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        if t.untyped_storage()._cdata not in mode.weights:
            saved += t.numel() * t.element_size()
        return t

    obs, extras = meta_obs(policy, spec, rows), meta_extras(policy, rows)
    chunk = torch.empty(rows, policy.chunk_len, policy.action_dim, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        policy.evaluate(obs, chunk, extras)
    return saved


@dataclass
class Footprint:
    """Bytes by part; `total` adds them up."""

    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class MemoryModel:
    """One policy config's per-unit figures (see the module docstring); `trainer`, `generation`, `shared_memory`
    and `gpu` scale them to a run."""

    parameters: int
    trained: int  # parameters policy.train trains (float32 masters)
    frozen_bytes: int  # the rest, in policy.dtype
    payload_bytes: int  # one published copy of the weights, in policy.dtype
    dtype: torch.dtype
    moment_bytes: int  # per trained parameter and moment
    activations_per_row: int  # saved by one micro-batch row, with the run's checkpointing
    block_per_row: int  # one block's activations per row, without checkpointing (what backward recomputes)
    cache_per_env: int  # generation's conditioning of one observation (prefix cache), float bytes
    prefix_per_row: int  # the trainer's frozen prefix of one row, held for an update (0: none, or not cached)
    chain_per_row: int  # extras (the denoising chain) of one sampled chunk
    obs_per_row: int  # one observation as the policy batch holds it
    sim_slot: int  # one simulator's shared-memory slot
    checkpointing: bool
    execute: int  # actions of a chunk the env executes (policy.execute): a simulator slot's size

    @classmethod
    def of(
        cls,
        policy_cfg: dict[str, Any],
        spec: EnvSpec,
        optimizer_dtype: str = "float32",
        device: str = "cuda",
        trace: bool = True,
        cache_prefix: bool = True,
    ) -> "MemoryModel":
        """Build the trainer's copy of `policy_cfg` on the meta device and trace one evaluate (a few seconds at
        full size; without `trace`, no activations: the parameters' and slots' figures only); `device`: where the
        run computes (it decides policy.dtype's default); `cache_prefix`: algo.cache_prefix (a frozen prefix is held
        for every row of an update)."""
        from ebrl.envs.slots import SlotLayout

        dtype = policy_dtype(policy_cfg, device)
        policy = build_policy(
            {**policy_cfg, "dtype": str(dtype).removeprefix("torch.")}, spec, "meta", train=True, weights="given"
        )
        trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        frozen = sum(p.numel() * p.element_size() for p in policy.parameters() if not p.requires_grad)
        parameters = sum(p.numel() for p in policy.parameters())
        lora = sum(p.numel() for n, p in policy.named_parameters() if ".lora_" in n)
        checkpointing = any(getattr(m, "grad_checkpoint", False) for m in policy.modules())
        policy.compute_dtype = torch.float32  # (torch.autocast takes no meta tensors: MetaAutocast stands in)
        blocks = [m for m in policy.modules() if isinstance(m, Block)]
        activations = whole = cache = prefix = 0
        if cache_prefix and policy.frozen_prefix():  # (the trainer's, in the dtype its pass gives)
            with torch.no_grad(), MetaAutocast(dtype, list(policy.parameters())):
                prefix = _bytes(policy.prefix(meta_obs(policy, spec, 1)))
        if trace:
            activations = saved_activations(policy, spec, 1, dtype)
            for block in blocks:
                block.grad_checkpoint = False
            whole = saved_activations(policy, spec, 1, dtype)
            if isinstance(policy, FlowPolicy):
                with torch.no_grad(), MetaAutocast(dtype, list(policy.parameters())):
                    cache = _bytes(policy.encode(meta_obs(policy, spec, 1)))
        obs = sum(v.numel() * v.element_size() for v in meta_obs(policy, spec, 1).values())
        execute = executed_actions(policy_cfg, policy.chunk_len)  # (the config's, the whole chunk where it is null)
        return cls(
            parameters=parameters,
            trained=trained,
            frozen_bytes=frozen,
            payload_bytes=(parameters - lora) * dtype.itemsize,
            dtype=dtype,
            moment_bytes=MOMENT_BYTES[optimizer_dtype],
            activations_per_row=activations,
            block_per_row=math.ceil(whole / max(len(blocks), 1)),
            cache_per_env=cache,
            prefix_per_row=prefix,
            chain_per_row=_bytes(meta_extras(policy, 1)),
            obs_per_row=obs,
            sim_slot=SlotLayout.build(spec, execute).size,
            checkpointing=checkpointing,
            execute=execute,
        )

    # --- a run's stages ---------------------------------------------------------------------
    def trainer(self, micro_batch: int, rollout_rows: int = 0, shards: int = 1) -> Footprint:
        """The trainer's peak: its state, one micro-batch's activations, and a rollout of `rollout_rows` rows.
        `shards` > 1: FSDP over that many ranks (ebrl/runtime/distributed.py, `shard`): the policy is one unit, so
        a pass gathers every weight beside the rank's shard, and backward makes every gradient before the
        reduce-scatter leaves the shard; the Adam moments are the shard's alone."""
        autocast = self.trained * self.dtype.itemsize if self.dtype != torch.float32 else 0
        working = self.activations_per_row if self.checkpointing else 0
        recompute = 2 * self.block_per_row  # backward: a recomputed block and the gradients of its activations
        weights, gradients = self.trained * 4 + self.frozen_bytes, self.trained * 4
        sharded = 1 / shards if shards > 1 else 0.0  # (a shard kept beside the gathered whole)
        return Footprint(
            {
                "weights": int(weights * (1 + sharded)),
                "gradients": int(gradients * (1 + sharded)),
                "optimizer": 2 * self.trained * self.moment_bytes // shards,
                "autocast copies": autocast,
                "activations": micro_batch * (working + recompute if self.checkpointing else self.activations_per_row),
                "rollout": rollout_rows * (self.obs_per_row + self.chain_per_row),
                "prefix cache": rollout_rows * self.prefix_per_row,
            }
        )

    def generation(self, batch: int) -> Footprint:
        """Generation's weights and what a batch of `batch` envs holds while it samples."""
        return Footprint(
            {
                "weights": self.payload_bytes,
                "batch": batch * (self.cache_per_env + 2 * self.chain_per_row + self.obs_per_row),
            }
        )

    def channel(self, on_device: bool) -> Footprint:
        """The published weights' slots: on the GPU (two) and the host (one, the first weights), or two on the host."""
        return Footprint(
            {
                "device slots": 2 * self.payload_bytes if on_device else 0,
                "host slots": (1 if on_device else 2) * self.payload_bytes,
            }
        )

    def checkpoint_state(self) -> int:
        """The model and Adam state a trainer sends for a checkpoint: its weights (float32 masters, the frozen rest)
        and both moments, whole (FSDP gathers them)."""
        trainer = self.trainer(0).parts
        return trainer["weights"] + trainer["optimizer"]

    def shared_memory(self, num_envs: int, rollout_rows: int, channel_on_device: bool, checkpoint: bool = False) -> int:
        """/dev/shm a pipelined run needs: the channel's host slots, the simulators' slots, one rollout in flight
        to the trainer (torch moves a batch's tensors there to send them) and, on rank 0 (`checkpoint`), the state its
        trainer sends for a checkpoint (the other ranks' send none)."""
        rollout = rollout_rows * (self.obs_per_row + self.chain_per_row)
        state = self.checkpoint_state() if checkpoint else 0
        return self.channel(channel_on_device).parts["host slots"] + num_envs * self.sim_slot + rollout + state

    def gpu(
        self,
        micro_batch: int,
        num_envs: int,
        rollout_chunks: int,
        rendering: bool,
        shards: int = 1,
        local: bool = False,
    ) -> Footprint:
        """One GPU running a pipelined schedule: the trainer and generation processes (the published weights on the
        device between them), and the simulators' render contexts when they hold them there (`render_contexts`);
        `shards`: the trainer's FSDP ranks (1: a replica). `local`: one process trains and generates (colocated) on
        one copy of the weights: no second copy, no published slots, one CUDA context."""
        trainer = self.trainer(micro_batch, num_envs * rollout_chunks, shards)
        parts = {f"trainer {k}": v for k, v in trainer.parts.items()}
        generation = self.generation(num_envs).parts
        parts.update({f"generation {k}": v for k, v in generation.items() if not (local and k == "weights")})
        parts["published slots"] = 0 if local else self.channel(True).parts["device slots"]
        parts["CUDA contexts"] = (1 if local else 2) * CUDA_CONTEXT_BYTES
        parts["render contexts"] = num_envs * RENDER_CONTEXT_BYTES if rendering else 0
        return Footprint(parts)


def render_contexts(env: Any) -> bool:
    """Whether each simulator of this env (its config) holds a render context on the run's GPU: its cameras' (MuJoCo's
    EGL, SAPIEN's Vulkan), or ManiSkill's without cameras too, since SAPIEN sets its Vulkan renderer up for state
    observations as well."""
    from ebrl.config import ManiSkillEnvConfig

    return bool(env.get("cameras")) or env.get("_target_") == ManiSkillEnvConfig._target_


REMEDIES = (
    "train less (policy.train=lora or action_expert), keep Adam's moments in bfloat16 "
    "(algo.optimizer_dtype=bfloat16), lower algo.micro_batch or env.num_envs"
)


def budgets(
    model: MemoryModel,
    gpu_bytes: int,
    num_envs: int,
    micro_batch: int,
    rollout_chunks: int,
    rendering: bool,
    where: str,
    headroom: float = 1.25,
    shards: int = 1,
    remedies: str = REMEDIES,
    local: bool = False,
) -> dict[str, int]:
    """Each GPU stage's memory budget on one GPU of `gpu_bytes`: generation its footprint with `headroom`, the
    trainer the rest less the simulators' render contexts (`shards`: its FSDP ranks; `local`: the two are one
    process, colocated's, with no budgets of their own: {}); one line (`where` names the hw) when the model says the
    run cannot fit, naming what takes the memory and `remedies`, what would shrink it."""
    from ebrl.config import ConfigError

    need = model.gpu(micro_batch, num_envs, rollout_chunks, rendering, shards, local)
    generation = sum(v for k, v in need.parts.items() if k.startswith("generation"))
    generate = int(headroom * (generation + (0 if local else CUDA_CONTEXT_BYTES)))
    trainer = sum(v for k, v in need.parts.items() if k.startswith("trainer")) + need.parts["published slots"]
    egl = need.parts["render contexts"]
    trainer += CUDA_CONTEXT_BYTES
    train = gpu_bytes - generate - egl
    if train < trainer:
        sharded = f", its training state sharded over {shards} ranks" if shards > 1 else ""
        raise ConfigError(
            f"{where}'s GPU has {gib(gpu_bytes)} GiB and this run needs about {gib(trainer + generate + egl)} GiB"
            f"{sharded} (trainer {gib(trainer)}, generation {gib(generate)}, simulators' render contexts {gib(egl)}; "
            f"python -m ebrl.bench.memory itemises it): {remedies}"
        )
    return {} if local else {"generate": generate, "train": train}


def fitting_strategy(
    model: MemoryModel,
    gpu_bytes: int,
    num_envs: int,
    micro_batch: int,
    rollout_chunks: int,
    rendering: bool,
    where: str,
    ranks: int,
    strategy: str,
    trainer_process: bool,
) -> tuple[str, dict[str, int]]:
    """The data-parallel strategy a run of `ranks` GPU ranks takes (distributed.strategy; auto: ddp where a replica
    of the training state fits one GPU, else fsdp) and its stages' budgets (`budgets`); one line when it does not
    fit, naming what would. FSDP shards a trainer of its own process only (`trainer_process`; colocated's trains
    where it generates)."""
    from ebrl.config import ConfigError

    def fits(**how: Any) -> dict[str, int]:
        return budgets(model, gpu_bytes, num_envs, micro_batch, rollout_chunks, rendering, where, **how)

    if not trainer_process:
        try:
            return "ddp", fits(local=True)
        except ConfigError as e:
            if ranks < 2:
                raise
            try:  # (would a trainer process's shards fit? then that is the setting to name)
                fits(shards=ranks)
            except ConfigError:
                raise e from None
            raise ConfigError(
                f"{e}; or train in a process of its own, its state sharded over the {ranks} ranks: "
                "scheduler=ebrl (distributed.strategy=auto shards it where a replica does not fit)"
            ) from None
    if ranks < 2:
        return "ddp", fits()
    if strategy == "fsdp":
        return "fsdp", fits(shards=ranks)
    if strategy == "ddp":
        return "ddp", fits(
            remedies=f"shard the training state over the {ranks} ranks (distributed.strategy=auto or fsdp), {REMEDIES}"
        )
    try:
        return "ddp", fits()
    except ConfigError:
        return "fsdp", fits(shards=ranks)


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def check_shared_memory(need: int, path: str = "/dev/shm") -> None:
    """Stop before anything starts when `path` is smaller than a run needs (Docker gives 64 MB), with one line."""
    import os
    import shutil

    from ebrl.config import ConfigError

    if not os.path.isdir(path):
        return
    have = shutil.disk_usage(path).free
    if have < need:
        want = max(1, math.ceil(need * 1.25 / GiB))
        raise ConfigError(
            f"{path} has {have / 2**20:.0f} MB free and this run needs {need / 2**20:.0f} MB of shared "
            f"memory (weights, simulator slots, rollouts, a checkpoint's state); start the container "
            f"with --shm-size={want}g, or mount a larger tmpfs there "
            f"(mount -o remount,size={want}G {path})"
        )
