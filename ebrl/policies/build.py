"""A policy as a run builds it (docs/internals/design.md, "Policies and simulators"): in `policy.dtype`, on its device,
its weights initialised by the family or left for the caller to load, its blocks checkpointed, and, for the trainer,
what `policy.train` trains held in float32.

With weights to come (a checkpoint, the published weights, a predecessor's state), the policy is built on the meta
device and allocated once, in its dtype, without initialisation: no random init of billions of weights and no fit of
the first policy that the loaded weights would overwrite. A published checkpoint that lacks the RL heads gets them
initialised as the constructor would.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ebrl.checks import POLICY_CONTRACT, POLICY_RUNTIME_KEYS, policy_dtype_name
from ebrl.classes import ContractError, constructor_kwargs, load_class
from ebrl.config import ConfigError
from ebrl.envs.base import EnvSpec
from ebrl.policies.base import Policy
from ebrl.policies.capture import capture_on
from ebrl.policies.layers import Block
from ebrl.policies.training import prepare_training
from ebrl.policies.weights import CheckpointError, checkpoint_config, checkpoint_folder, load_weights, weight_files
from ebrl.recipes import recipe_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def family_kwargs(policy_cfg: dict[str, Any]) -> dict[str, Any]:
    """The family constructor's arguments in a resolved `policy` config."""
    return {k: v for k, v in policy_cfg.items() if k not in POLICY_RUNTIME_KEYS}


def policy_dtype(policy_cfg: dict[str, Any], device: torch.device | str) -> torch.dtype:
    """policy.dtype, or bfloat16 for the full preset and for CUDA, float32 otherwise (tiny and small on CPU)."""
    return DTYPES[policy_dtype_name(policy_cfg, torch.device(device).type == "cuda")]


def grad_checkpointing(policy_cfg: dict[str, Any]) -> bool:
    """policy.grad_checkpoint, or on for the full preset."""
    on = policy_cfg.get("grad_checkpoint")
    return policy_cfg.get("preset") == "full" if on is None else bool(on)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters a constructor creates are in `dtype` (and initialised in it: one allocation, no cast)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def materialize(module: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> None:
    """Allocate a meta-device module's parameters and buffers on `device`, floating-point ones in `dtype`, without
    initialising them (the caller loads them)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                kind = dtype if p.is_floating_point() else p.dtype
                sub._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=kind, device=device), requires_grad=p.requires_grad
                )
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = torch.empty(
                    b.shape, dtype=dtype if b.is_floating_point() else b.dtype, device=device
                )


def checkpoint_kwargs(cls: type, checkpoint: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The family's arguments completed from the checkpoint's folder (`Policy.checkpoint_defaults`): its config.json,
    tensor names (read from the files' headers, not their data) and the files beside them."""
    from safetensors import safe_open

    keys: list[str] = []
    for f in weight_files(checkpoint):
        try:
            with safe_open(str(f), "pt") as handle:
                keys.extend(handle.keys())
        except Exception as e:
            raise CheckpointError(
                f"policy.checkpoint={checkpoint}: {f.name} is not a readable safetensors file ({type(e).__name__})"
            ) from None
    return cls.checkpoint_defaults(checkpoint_folder(checkpoint), checkpoint_config(checkpoint), keys, dict(kwargs))


def settle_execute(cfg: Any, trained: dict[str, Any] | None = None) -> str:
    """Set `policy.execute` in the composed config `cfg` where it is null, and say where the number came from: the
    run's recipe at full size (RLinf's num_action_chunks), else the checkpoint folder's lerobot n_action_steps, else
    the whole chunk (null stays: `executed_actions`). mode=eval takes the evaluated run's own setting (`trained`: its
    policy config) and then the folder's before the recipe's, so a published checkpoint is measured as its folder
    says it acts. Part of a run's completion: called once per config, by the run kinds (and the benchmarks that
    compose one) before anything reads it or copies it to another process."""
    p = cfg.policy
    if p.get("execute") is not None:
        return "policy.execute"
    recipe, source = recipe_for(p.name, p.get("variant"), p.preset, cfg.env.name, cfg.algo.name)
    found = [(recipe.execute, f"the recipe: {source}")]
    if p.get("checkpoint"):
        folder = checkpoint_config(str(p.checkpoint)).get("n_action_steps")
        found.append((folder, f"n_action_steps of policy.checkpoint={p.checkpoint}"))
    if cfg.get("mode") == "eval":
        found.reverse()
        found.insert(0, ((trained or {}).get("execute"), f"what checkpoint={cfg.get('checkpoint')} trained with"))
    for value, why in found:
        if value is not None:
            p.execute = int(value)
            return why
    return "the whole chunk"


def executed_actions(policy_cfg: dict[str, Any], chunk_len: int) -> int:
    """The actions of each chunk of `chunk_len` (H) the env executes: the settled `policy.execute` (settle_execute),
    or the whole chunk where it is null. The one check of its range, against H as the built policy resolves it (its
    preset's, policy.chunk or a checkpoint folder's): one line where it is not in 1..H."""
    execute = policy_cfg.get("execute")
    if execute is None:
        return chunk_len
    if not 1 <= int(execute) <= chunk_len:
        raise ConfigError(
            f"policy.execute={execute} must be in 1..{chunk_len}, the policy's chunk of {chunk_len} actions"
        )
    return int(execute)


def executed_line(policy: Policy, source: str) -> str | None:
    """The console line of a run whose env executes part of each chunk (None when it executes the whole chunk)."""
    if policy.execute == policy.chunk_len:
        return None
    return (
        f"policy.execute={policy.execute}: {policy.execute} of each chunk's {policy.chunk_len} actions run before "
        f"the next chunk is sampled ({source})"
    )


def tokenizer_warning(policy_cfg: dict[str, Any], policy: Policy) -> str | None:
    """The line a full-size run prints when a family that can load a real tokenizer (`policy.tokenizer`) was given
    none: its prompts are not the ones a published checkpoint was trained on."""
    if policy_cfg.get("preset") == "full" and getattr(policy, "tokenizer", False) is None:
        return (
            f"policy={policy_cfg.get('name')} preset=full tokenizes with a byte-level stand-in: give "
            "policy.tokenizer=<paligemma_tokenizer.model> for the prompts the checkpoint was trained on"
        )
    return None


def build_policy(
    policy_cfg: dict[str, Any],
    spec: EnvSpec,
    device: torch.device | str = "cpu",
    *,
    train: bool = False,
    weights: str = "init",
) -> Policy:
    """The policy `policy_cfg` (a resolved `policy` config) names, for this env, on `device`, in eval mode.

    weights: "init" -> the family's initialisation, or `policy.checkpoint`'s file (with the RL heads it lacks
    initialised); "given" -> allocated only, for the caller to load every weight (a run's checkpoint, the published
    weights). train: the trainer's copy: what `policy.train` trains in float32 master weights (LoRA adapters
    added), the rest frozen in policy.dtype, and the blocks checkpointed if `policy.grad_checkpoint`.
    """
    dtype = policy_dtype(policy_cfg, device)
    if torch.device(device).type == "cuda":  # float32 matmuls in TF32 (a float32 policy's, a bfloat16 one's rest)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    cls = load_class(policy_cfg["_target_"], "policy._target_")
    kwargs = constructor_kwargs(cls, policy_cfg, POLICY_RUNTIME_KEYS)  # a user's class need not take every shared key
    if policy_cfg.get("checkpoint"):  # what the checkpoint folder says (a run's own checkpoint too: the same file)
        kwargs = checkpoint_kwargs(cls, policy_cfg["checkpoint"], kwargs)
    checkpoint = policy_cfg.get("checkpoint") if weights == "init" else None
    if weights == "given" or checkpoint:
        with torch.device("meta"):
            policy = cls(env_spec=spec, **kwargs)
        materialize(policy, device, dtype)
        if checkpoint:
            for prefix in load_weights(policy, checkpoint):  # what the file lacked: the constructor's init
                with torch.no_grad():
                    policy.init_head(prefix)
    elif dtype == torch.float32 and torch.device(device).type == "cpu":  # (tiny and small: as they always were)
        policy = cls(env_spec=spec, **kwargs)
    else:
        with torch.device(device), default_dtype(dtype):
            policy = cls(env_spec=spec, **kwargs)
    missing = [name for name in ("chunk_len", "action_dim") if not isinstance(getattr(policy, name, None), int)]
    if missing:
        raise ContractError(
            f"policy._target_={policy_cfg['_target_']!r} set no self.{missing[0]} (an int) in its "
            f"constructor: a policy implements {POLICY_CONTRACT}"
        )
    policy.compute_dtype = dtype
    policy.execute = executed_actions(policy_cfg, policy.chunk_len)  # (policy.execute as the config settled it)
    if policy_cfg.get("capture") is not None:  # the flow families' denoising loop (ebrl/policies/capture.py)
        capture_on(policy_cfg["capture"], torch.device(device))  # one line for a setting this device cannot run
        policy.capture = policy_cfg["capture"]
    if train:
        prepare_training(policy, policy_cfg)
        for module in policy.modules():
            if isinstance(module, Block):
                module.grad_checkpoint = grad_checkpointing(policy_cfg)
    return policy.eval()
