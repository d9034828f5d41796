"""Diffusion-transformer parts shared by the gr00t and wam families, named like diffusers' DiT modules.

One block covers the three layouts the families need (diffusers' BasicTransformerBlock, as GR00T's action head and
Cosmos' MiniTrainDIT use it):
- norm_type="layer_norm": plain pre-norm block (affine LayerNorms, no time): GR00T's vl_self_attention;
- norm_type="ada_norm": norm1 is an adaptive LayerNorm (scale, shift from the timestep embedding), the others are
  LayerNorms without affine, no gates: GR00T's DiT, whose attn1 attends to the VL features (attn1_cross) in every
  other block and to the tokens themselves in the rest;
- norm_type="ada_norm_zero": every sublayer's norm gives scale, shift and a gate for its residual branch, optionally
  through a low-rank (LoRA) modulation plus a term shared by all blocks: Cosmos-Predict2's Block (self-attention,
  cross-attention to the text as attn2, MLP; q/k RMSNorm per head, no biases).
Parameter names follow diffusers (norm1.linear, attn1.to_q/to_k/to_v/to_out, ff.net.0.proj, ff.net.2,
timestep_embedder.linear_1/linear_2); with out_list=True attn1's output is diffusers' to_out.0, so GR00T's
checkpoints load as they are (with TimestepEncoder(sinusoid="diffusers"), GR00T's DiT computes as lerobot's); Cosmos'
names map one to one (self_attn -> attn1, cross_attn -> attn2, mlp.layer1/2 -> ff.net.0.proj/ff.net.2,
adaln_modulation_* -> norm*).
Dropout is left out (RL fine-tuning runs without it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ebrl.policies.layers import Block, RMSNorm, attention, time_embedding

NORM_TYPES = ("layer_norm", "ada_norm", "ada_norm_zero")
KV = tuple[torch.Tensor, torch.Tensor]


class TimestepEmbedding(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding)."""

    def __init__(self, in_channels: int, time_embed_dim: int, out_dim: int | None = None, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim, bias=bias)
        self.linear_2 = nn.Linear(time_embed_dim, out_dim or time_embed_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def diffusers_timesteps(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """diffusers' Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=1) of timesteps t (N,) -> (N, dim),
    float32 as diffusers computes it: frequencies max_period^(-i / (dim/2 - 1)), [cos, sin]."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - 1)
    angles = t[:, None].float() * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], -1)


class TimestepEncoder(nn.Module):
    """Time t (any shape) -> sinusoidal features -> MLP, (*t.shape, out_dim).

    sinusoid="pi0": layers.time_embedding of a flow time in [0, 1] (Cosmos' stand-in); "diffusers": diffusers'
    Timesteps (flip_sin_to_cos, downscale_freq_shift=1) of a timestep, as GR00T feeds it its 1000 time buckets.
    """

    def __init__(
        self,
        embedding_dim: int,
        freq_dim: int = 256,
        out_dim: int | None = None,
        bias: bool = True,
        sinusoid: str = "pi0",
    ) -> None:
        super().__init__()
        if sinusoid not in ("pi0", "diffusers"):
            raise ValueError(f"sinusoid={sinusoid!r}; accepted: pi0, diffusers")
        self.freq_dim, self.sinusoid = freq_dim, sinusoid
        self.timestep_embedder = TimestepEmbedding(freq_dim, embedding_dim, out_dim, bias)

    def project(self, t: torch.Tensor) -> torch.Tensor:
        """The sinusoidal features alone (Cosmos feeds them, RMS-normalised, to every modulation)."""
        embed = diffusers_timesteps if self.sinusoid == "diffusers" else time_embedding
        return embed(t.reshape(-1), self.freq_dim).view(*t.shape, self.freq_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        weight = self.timestep_embedder.linear_1.weight
        return self.timestep_embedder(self.project(t).to(weight.device, weight.dtype))


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine, modulated by a condition: x * (1 + scale) + shift, and a gate for the residual branch
    it feeds when `gate` (adaLN-Zero). `lora_dim` makes the modulation low rank (Cosmos' AdaLN-LoRA); a `shared`
    term (N, [G,] k*dim) computed once from the time can be added to it."""

    def __init__(
        self,
        dim: int,
        cond_dim: int,
        gate: bool = False,
        lora_dim: int | None = None,
        bias: bool = True,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.dim, self.chunks = dim, 3 if gate else 2
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        if lora_dim:
            self.linear: nn.Module = nn.Sequential(
                nn.Linear(cond_dim, lora_dim, bias=False), nn.Linear(lora_dim, self.chunks * dim, bias=False)
            )
        else:
            self.linear = nn.Linear(cond_dim, self.chunks * dim, bias=bias)

    def modulation(
        self, temb: torch.Tensor, groups: torch.Tensor | None = None, shared: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """scale, shift (and gate), each (N, L or 1, dim). temb is (N, cond_dim), or (N, G, cond_dim) with `groups`
        (L,) saying which of the G conditions each token takes (tokens at different flow times)."""
        mod = self.linear(F.silu(temb))
        if shared is not None:
            mod = mod + shared[..., : self.chunks * self.dim]
        mod = mod[:, None] if mod.dim() == 2 else mod[:, groups]
        return mod.chunk(self.chunks, -1)

    def forward(
        self,
        x: torch.Tensor,
        temb: torch.Tensor,
        groups: torch.Tensor | None = None,
        shared: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        scale, shift, *gate = self.modulation(temb, groups, shared)
        return self.norm(x) * (1 + scale) + shift, (gate[0] if gate else None)


class Attention(nn.Module):
    """Multi-head attention (diffusers' Attention names: to_q, to_k, to_v, to_out); keys and values come from the
    tokens or, for cross-attention, from a context of `context_dim`. qk_norm: RMSNorm per head on q and k (norm_q,
    norm_k), as Cosmos and Qwen3 do. out_list: to_out is diffusers' list (to_out.0; its dropout is left out)."""

    def __init__(
        self,
        query_dim: int,
        heads: int,
        head_dim: int,
        context_dim: int | None = None,
        bias: bool = True,
        out_bias: bool = True,
        qk_norm: bool = False,
        out_list: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(query_dim, inner, bias=bias)
        self.to_k = nn.Linear(context_dim or query_dim, inner, bias=bias)
        self.to_v = nn.Linear(context_dim or query_dim, inner, bias=bias)
        out = nn.Linear(inner, query_dim, bias=out_bias)
        # out_list: diffusers' own layout, to_out = [Linear, Dropout] (keys to_out.0.*; GR00T's checkpoints have it)
        self.to_out: nn.Module = nn.Sequential(out) if out_list else out
        self.norm_q = RMSNorm(head_dim, 1e-6, offset=False) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(head_dim, 1e-6, offset=False) if qk_norm else nn.Identity()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def key_value(self, source: torch.Tensor) -> KV:
        """Keys and values (N, heads, L, head_dim) of the tokens or context `source` (N, L, dim); a family computes a
        fixed context's once per observation and passes them to every denoising step."""
        return self.norm_k(self._heads(self.to_k(source))), self._heads(self.to_v(source))

    def forward(
        self,
        x: torch.Tensor,
        kv: KV,
        mask: torch.Tensor | None = None,
        past: KV | None = None,
    ) -> torch.Tensor:
        """x (N, Lq, dim) attends to [past, kv]; mask: True where a query may attend, (N, Lk) for all queries alike
        or (N, Lq, Lk). A fixed context's kv (cross-attention) or the past may hold one row per observation for
        several rows of x each (`layers.attention`)."""
        q = self.norm_q(self._heads(self.to_q(x)))
        out = attention(q, kv, mask=mask) if past is None else attention(q, past, kv, mask)
        return self.to_out(out.transpose(1, 2).flatten(2))


class GELU(nn.Module):
    """Linear then tanh-approximated GELU (diffusers' GELU, approximate="tanh": proj)."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """dim -> inner -> dim MLP with GELU (diffusers' FeedForward: net.0.proj, net.2)."""

    def __init__(self, dim: int, inner_dim: int, bias: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(GELU(dim, inner_dim, bias), nn.Identity(), nn.Linear(inner_dim, dim, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class BasicTransformerBlock(Block):
    """Pre-norm DiT block: attn1 (self-attention, or cross-attention to the context when attn1_cross), optional attn2
    (cross-attention to the context), feed-forward; how the norms use the timestep embedding is `norm_type` (see the
    module docstring).

    Self-attention can prepend cached keys/values (`past_kv`: tokens that ran earlier, e.g. a clean prefix) and
    returns this call's, so a family runs its conditioning tokens once per observation.
    """

    def __init__(
        self,
        dim: int,
        num_attention_heads: int,
        attention_head_dim: int,
        *,
        norm_type: str = "ada_norm",
        cond_dim: int | None = None,
        cross_attention_dim: int | None = None,
        attn1_cross: bool = False,
        ff_inner_dim: int | None = None,
        bias: bool = True,
        qk_norm: bool = False,
        lora_dim: int | None = None,
        norm_eps: float = 1e-5,
        out_list: bool = False,
    ) -> None:
        super().__init__()
        if norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type={norm_type!r}; accepted: {', '.join(NORM_TYPES)}")
        if attn1_cross and cross_attention_dim is None:
            raise ValueError("attn1_cross needs a cross_attention_dim")
        self.norm_type, self.attn1_cross = norm_type, attn1_cross
        heads, head_dim = num_attention_heads, attention_head_dim

        def norm(first: bool) -> nn.Module:
            if norm_type == "layer_norm":
                return nn.LayerNorm(dim, eps=norm_eps)
            if norm_type == "ada_norm_zero" or first:
                return AdaLayerNorm(
                    dim, cond_dim or dim, gate=norm_type == "ada_norm_zero", lora_dim=lora_dim, bias=bias, eps=norm_eps
                )
            return nn.LayerNorm(dim, eps=norm_eps, elementwise_affine=False)

        self.norm1 = norm(True)
        self.attn1 = Attention(
            dim, heads, head_dim, cross_attention_dim if attn1_cross else None, bias, bias, qk_norm, out_list
        )
        self.attn2: Attention | None = None
        if cross_attention_dim is not None and not attn1_cross:
            self.norm2 = norm(False)
            self.attn2 = Attention(dim, heads, head_dim, cross_attention_dim, bias, bias, qk_norm, out_list)
        self.norm3 = norm(False)
        self.ff = FeedForward(dim, ff_inner_dim or 4 * dim, bias)

    @property
    def cross_attention(self) -> Attention | None:
        """The sublayer that attends to the context, if any."""
        return self.attn1 if self.attn1_cross else self.attn2

    def cross_kv(self, context: torch.Tensor) -> KV | None:
        """Keys and values of a context (N, Lc, cross_attention_dim) for this block's cross-attention (None if it has
        none): fixed for a whole denoising chain, so computed once per observation."""
        attn = self.cross_attention
        return None if attn is None else attn.key_value(context)

    def _norm(
        self,
        norm: nn.Module,
        x: torch.Tensor,
        temb: torch.Tensor | None,
        groups: torch.Tensor | None,
        shared: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(norm, AdaLayerNorm):
            return norm(x, temb, groups, shared)
        return norm(x), None

    @staticmethod
    def _residual(x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return x + (out if gate is None else gate * out)

    def forward(
        self,
        hidden_states: torch.Tensor,
        temb: torch.Tensor | None = None,
        *,
        context_kv: KV | None = None,
        context_mask: torch.Tensor | None = None,
        past_kv: KV | None = None,
        attention_mask: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        shared: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV | None]:
        """hidden_states (N, L, dim); temb (N, cond_dim) or (N, G, cond_dim) with groups (L,); context_kv from
        `cross_kv` with context_mask (N, Lc); attention_mask (N, L, Lpast + L) for self-attention over past_kv and the
        tokens. Returns the tokens and this call's self-attention keys/values (None when attn1 is cross-attention)."""
        x = hidden_states
        h, gate = self._norm(self.norm1, x, temb, groups, shared)
        if self.attn1_cross:
            new_kv = None
            x = self._residual(x, self.attn1(h, context_kv, context_mask), gate)
        else:
            new_kv = self.attn1.key_value(h)
            x = self._residual(x, self.attn1(h, new_kv, attention_mask, past_kv), gate)
        if self.attn2 is not None:
            h, gate = self._norm(self.norm2, x, temb, groups, shared)
            x = self._residual(x, self.attn2(h, context_kv, context_mask), gate)
        h, gate = self._norm(self.norm3, x, temb, groups, shared)
        return self._residual(x, self.ff(h), gate), new_kv
