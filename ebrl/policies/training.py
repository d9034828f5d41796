"""What the trainer trains (`policy.train`) and how its state maps to the layout everything else reads.

- all: every parameter the family trains (a family may keep modules it never runs frozen);
- action_expert: the RL heads and the family's action expert (`Policy.action_expert`); the vision-language backbone
  frozen;
- lora: that, plus LoRA adapters (peft's, injected in place) on the backbone's attention and MLP projections
  (`Policy.lora_targets`), whose base weights stay frozen.
Frozen parameters carry no gradient, so no optimizer state; they stay in policy.dtype, while what is trained is held
in float32 (the master weights autocast runs bfloat16 matmuls from).

Everything outside the trainer (generation, checkpoints loaded for evaluation, `policy.checkpoint`) reads the
family's own layout: `merged_state` folds the adapters into their base weights, `split_lora` and `load_state` keep a
checkpoint's base weights and adapters apart so that training resumes where it was.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from ebrl.policies.base import Policy

ADAPTER = "default"  # peft's adapter name
LORA_KEYS = (".lora_A.", ".lora_B.")


def prepare_training(policy: Policy, policy_cfg: dict[str, Any]) -> None:
    """Freeze what `policy.train` does not train, add the LoRA adapters, and hold what is trained in float32."""
    train = policy_cfg.get("train") or "all"
    policy.lora_scaling = lora_scaling(policy_cfg)
    if policy.lora_scaling is not None:  # (peft leaves only its adapters trainable: what else trains follows)
        from peft import LoraConfig, inject_adapter_in_model

        config = LoraConfig(
            r=int(policy_cfg["lora_rank"]),
            lora_alpha=float(policy_cfg["lora_alpha"]),
            target_modules=policy.lora_targets(),
        )
        trains = {name for name, p in policy.named_parameters() if p.requires_grad}
        inject_adapter_in_model(config, policy, adapter_name=ADAPTER)
        for name, p in policy.named_parameters():
            p.requires_grad_(name in trains or _is_lora(name))
    if train != "all":
        trained = tuple(policy.rl_heads()) + tuple(policy.action_expert())
        for name, p in policy.named_parameters():
            if not name.startswith(trained) and not _is_lora(name):
                p.requires_grad_(False)
    for p in policy.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def lora_scaling(policy_cfg: dict[str, Any]) -> float | None:
    """The adapters' scale, lora_alpha / lora_rank (peft's), with policy.train=lora; else None."""
    if (policy_cfg.get("train") or "all") != "lora":
        return None
    return float(policy_cfg["lora_alpha"]) / int(policy_cfg["lora_rank"])


def trained_parameters(policy: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: those with requires_grad."""
    return [p for p in policy.parameters() if p.requires_grad]


def _is_lora(key: str) -> bool:
    return any(part in key for part in LORA_KEYS)


def split_lora(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """A trainer's state dict as (base weights in the family's layout, the LoRA adapters or None)."""
    lora = {k: v for k, v in state.items() if _is_lora(k)}
    base = {k.replace(".base_layer.", "."): v for k, v in state.items() if not _is_lora(k)}
    return base, lora or None


def merged_state(state: dict[str, torch.Tensor], scaling: float | None) -> dict[str, torch.Tensor]:
    """A trainer's state dict in the family's layout with every adapter folded into its base weight (`folded`);
    the state itself without LoRA."""
    return merge_lora(*split_lora(state), scaling)


def merge_lora(
    base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor] | None, scaling: float | None
) -> dict[str, torch.Tensor]:
    """Base weights in the family's layout with the adapters folded in, W + s B A (float32 where adapted)."""
    if lora is None:
        return base
    return {
        k: v if ab is None else v.float() + scaling * (ab[0].float() @ ab[1].float()) for k, v, ab in folded(base, lora)
    }


def folded(
    base: dict[str, torch.Tensor],
    lora: dict[str, torch.Tensor] | None,
) -> Iterator[tuple[str, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]]:
    """(key, base weight, its adapter's (B, A) or None) in the family's layout: a publication folds one weight at a
    time into its slot (W + s B A), holding no float32 copy of the adapted layers."""
    for key, value in base.items():
        module = key.removesuffix(".weight")
        down = lora.get(f"{module}.lora_A.{ADAPTER}.weight") if lora and key.endswith(".weight") else None
        yield key, value, None if down is None else (lora[f"{module}.lora_B.{ADAPTER}.weight"], down)


def load_state(
    policy: torch.nn.Module, base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor] | None = None
) -> None:
    """Load base weights in the family's layout (and a checkpoint's adapters) into a policy, LoRA'd or not; without
    `lora` a LoRA'd policy's adapters keep what they hold (at the start: B = 0, no change to the weights)."""
    own = policy.state_dict()
    names = {k.replace(".base_layer.", "."): k for k in own if not _is_lora(k)}
    state = {names.get(k, k): v for k, v in base.items()}
    if lora is not None:
        state.update(lora)
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if lora is not None or not _is_lora(k)]
    if missing or unexpected:
        raise KeyError(f"state does not fit the policy: missing {missing[:3]}, unexpected {unexpected[:3]}")


def is_sharded(module: torch.nn.Module) -> bool:
    """The module is FSDP-sharded (ebrl.runtime.distributed.shard)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
