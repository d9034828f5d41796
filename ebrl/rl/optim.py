"""The trainer's optimizer: AdamW over the parameters `policy.train` trains, its moments in `algo.optimizer_dtype`.

float32 moments are torch's AdamW. bfloat16 moments halve the optimizer's memory (for pi0 at full size, 26 GB of
moments become 13 GB): each step computes in float32 and stores the moments back with stochastic rounding, since
bfloat16's 8-bit mantissa would otherwise round away Adam's small per-step changes (v <- 0.999 v + 0.001 g^2 moves v
by less than half a bfloat16 step, so round-to-nearest would freeze it). The rounding draws from a generator of the
optimizer's own, seeded alike on every rank: replicas (DDP) must round alike, and the global generator is seeded per
rank and drawn from by generation. Its state travels in the optimizer's state dict, so a resumed run rounds on (FSDP's
state gathered by parameter name leaves it out: a shard has no replica to agree with, and its generator restarts).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch.distributed.tensor import DTensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHUNK = 1 << 24  # elements per slice of a step
ROUNDING_SEED = 0  # the stochastic rounding's, on every rank


def make_optimizer(
    params: Iterable[torch.nn.Parameter] | Sequence[dict[str, Any]],
    lr: float,
    moments: str = "float32",
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-5,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW at `lr` (a group's own "lr" wins) with its moments in `moments` (float32 | bfloat16); weight_decay 0 is
    Adam."""
    betas = (float(betas[0]), float(betas[1]))
    if DTYPES[moments] == torch.float32:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return LowPrecisionAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, state_dtype=DTYPES[moments])


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bfloat16, rounding up with the probability of the dropped fraction (unbiased in expectation); the
    noise from `generator` (None: torch's global one)."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # (exact: the low bits are zero)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (in place: the same storage); any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class LowPrecisionAdam(torch.optim.Optimizer):
    """AdamW (Loshchilov and Hutter 2019: Adam with decoupled weight decay, as torch's AdamW) with its moments held in
    `state_dtype` (see the module docstring); the parameters keep their own dtype (the trainer's float32 masters)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Sequence[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-5,
        weight_decay: float = 0.0,
        state_dtype: torch.dtype = torch.bfloat16,
        seed: int = ROUNDING_SEED,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        device = _local(self.param_groups[0]["params"][0]).device  # (a generator draws on its own device only)
        self.generator = torch.Generator(device).manual_seed(seed)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state, and the rounding generator's."""
        return {**super().state_dict(), "rounding_rng": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's optimizer state, the moments kept in `state_dtype`, and the rounding generator's where it was saved
        by one on this device type (a checkpoint from before it had one, or a GPU run's resumed on the CPU, leaves it
        where it is)."""
        state_dict = dict(state_dict)
        rng = state_dict.pop("rounding_rng", None)
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch casts them to the parameter's dtype: twice the memory, and `step`'s
            for key in ("exp_avg", "exp_avg_sq"):  # .float() would then alias them
                state[key] = state[key].to(self.state_dtype)
        if rng is not None and rng.numel() == self.generator.get_state().numel():
            self.generator.set_state(rng)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                step = float(state["step"])
                lr1, c2 = group["lr"] / (1 - beta1**step), 1 - beta2**step
                # in slices, so that the float32 temporaries stay small beside a 0.5B-parameter embedding table; a
                # sharded (FSDP) parameter's, its rank's shard
                flat = [_local(t).view(-1) for t in (p.data, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                for start in range(0, p.numel(), CHUNK):
                    param, grad, m, v = (t[start : start + CHUNK] for t in flat)
                    if group["weight_decay"]:
                        param.mul_(1 - group["lr"] * group["weight_decay"])
                    g = grad.float()
                    m32 = m.float().lerp_(g, 1 - beta1)
                    v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    m.copy_(stochastic_round(m32, self.generator))
                    v.copy_(stochastic_round(v32, self.generator))
                    param.add_(m32.div_(v32.div_(c2).sqrt_().add_(group["eps"])).mul_(-lr1).to(param.dtype))
