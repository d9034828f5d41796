"""Transformer parts every policy family is built from, named like their Hugging Face counterparts.

Module and parameter names follow transformers' Gemma/Llama decoder layers (self_attn.q_proj, mlp.gate_proj,
input_layernorm, ...) and SigLIP's vision model (embeddings.patch_embedding, encoder.layers.N.self_attn.out_proj,
...), so a family whose public checkpoints use those modules (pi0's PyTorch port, OpenVLA, GR00T) loads them by name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ACTIVATIONS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class RMSNorm(nn.Module):
    """RMSNorm; Gemma scales by (1 + weight) with weight starting at 0 (`offset=True`), Llama by weight from 1."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = True) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.weight.float() + (1.0 if self.offset else 0.0))).to(x.dtype)


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: a condition c gives scale, shift and a gate for the residual it feeds.

    `dense` starts at zero, so the layer starts as a plain (weightless) RMSNorm whose residual branch is closed.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, L, dim), cond (N, cond_dim) or (N, L, cond_dim) -> normalised x and the gate (N, L or 1, dim)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.modulation(cond)
        return (xf * (1.0 + scale.float()) + shift.float()).to(x.dtype), gate

    def modulation(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """scale, shift and gate, each (N, L or 1, dim)."""
        modulation = self.dense(cond)
        return (modulation[:, None] if modulation.dim() == 2 else modulation).chunk(3, -1)


class Block(nn.Module):
    """A transformer block whose activations `call_block` may recompute in the backward pass instead of storing them
    (`policy.grad_checkpoint`, set on every block by ebrl/policies/build.py)."""

    grad_checkpoint = False


def call_block(block: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), one block's work; with the block's grad_checkpoint on and gradients wanted, only its
    inputs are kept and the rest is recomputed when the backward pass reaches it."""
    if getattr(block, "grad_checkpoint", False) and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return fn(*args, **kwargs)


def attention(
    q: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor],
    own: tuple[torch.Tensor, torch.Tensor] | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of q (N, heads, Lq, d) over `shared` keys and values (rows, kv heads, Ls, d)
    followed by `own` ones (N rows, Lo), grouped-query where kv heads are fewer. mask: True where a query may
    attend, (N, Lq, Ls + Lo), or (N or shared rows, Ls + Lo) for every query alike; None: everything.

    `shared` may hold B = N / r rows, query row b*r + j belonging to shared row b (evaluate's r denoising steps of one
    observation): the r rows of an observation then become one sequence of r*Lq queries that reads its shared keys
    once (a broadcast, not r copies of a prefix cache) and each row its own keys only. That costs r*Lq x r*Lo scores
    for the own part, so where r*Lo would outgrow Ls the shared keys are repeated instead.
    """
    n, b, ls = q.shape[0], shared[0].shape[0], shared[0].shape[2]
    r, lq, lo = n // b, q.shape[2], 0 if own is None else own[0].shape[2]
    if mask is not None and mask.shape[0] != n:  # one row per observation
        mask = mask.repeat_interleave(n // mask.shape[0], 0)
    gqa = shared[0].shape[1] != q.shape[1]
    if r == 1 or r * lo > ls:
        if r > 1:
            shared = (shared[0].repeat_interleave(r, 0), shared[1].repeat_interleave(r, 0))
        k, v = shared if own is None else (torch.cat([shared[0], own[0]], 2), torch.cat([shared[1], own[1]], 2))
        if mask is not None:
            mask = mask[:, None] if mask.dim() == 3 else mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def fold(t: torch.Tensor) -> torch.Tensor:  # (b*r, h, L, d) -> (b, h, r*L, d)
        return t.unflatten(0, (b, r)).transpose(1, 2).flatten(2, 3)

    k, v = shared
    if own is not None:
        k, v = torch.cat([k, fold(own[0])], 2), torch.cat([v, fold(own[1])], 2)
    if mask is not None and mask.dim() == 2 and own is None:  # every query alike: one row per observation
        mask = mask[::r, None, None, :]
    elif mask is not None or own is not None:
        if mask is None:
            mask = q.new_ones(n, lq, ls + lo, dtype=torch.bool)
        elif mask.dim() == 2:
            mask = mask[:, None, :].expand(-1, lq, -1)
        rows = mask.unflatten(0, (b, r))  # (b, r, Lq, Ls + Lo)
        parts = [rows[..., :ls].flatten(1, 2)]
        if own is not None:  # row j's queries see row j's own keys only: a block diagonal
            same = torch.eye(r, dtype=torch.bool, device=q.device)[None, :, None, :, None]
            parts.append((rows[..., None, ls:] & same).flatten(3, 4).flatten(1, 2))
        mask = torch.cat(parts, -1)[:, None]
    out = F.scaled_dot_product_attention(fold(q), k, v, attn_mask=mask, enable_gqa=gqa)
    return out.unflatten(2, (r, lq)).transpose(1, 2).flatten(0, 1)


def rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10_000.0) -> torch.Tensor:
    """Rotary position embedding (rotate-half form) of x (B, heads, L, head_dim) at positions (B, L)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None, :, None].float() * inv_freq
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def time_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """pi0's sinusoidal embedding of a flow time t (N,) -> (N, dim); also used for diffusion timesteps."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** fraction
    angles = (2 * math.pi / period)[None, :] * t[:, None].double()
    return torch.cat([angles.sin(), angles.cos()], -1).float()


class SelfAttention(nn.Module):
    """Grouped-query attention projections (transformers' GemmaAttention / LlamaAttention names)."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=bias)


class GatedMLP(nn.Module):
    """act(gate_proj x) * up_proj x -> down_proj: GeGLU for Gemma, SwiGLU for Llama/Qwen."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# module names of a decoder layer's attention and MLP projections, under its layers' ModuleList: what LoRA adapts
DECODER_PROJECTIONS = r"\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"


class DecoderLayer(Block):
    """Pre-norm decoder layer (GQA, rotary, gated MLP), split at attention so several streams can share one attention.

    norm="gemma": RMSNorm(1 + w), GeGLU; norm="llama": RMSNorm(w), SwiGLU; cond_dim: pi0.5's adaptive norms with
    gated residuals, conditioned on a vector given to `qkv` and `finish`.
    """

    def __init__(
        self,
        width: int,
        mlp: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        norm: str = "gemma",
        cond_dim: int | None = None,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.adaptive = cond_dim is not None
        if self.adaptive:
            self.input_layernorm: nn.Module = AdaRMSNorm(width, cond_dim)
            self.post_attention_layernorm: nn.Module = AdaRMSNorm(width, cond_dim)
        else:
            eps = 1e-6 if norm == "gemma" else 1e-5
            self.input_layernorm = RMSNorm(width, eps, offset=norm == "gemma")
            self.post_attention_layernorm = RMSNorm(width, eps, offset=norm == "gemma")
        self.self_attn = SelfAttention(width, heads, kv_heads, head_dim, bias=qkv_bias)
        if qkv_bias:  # Qwen-style: biases on q, k, v only
            self.self_attn.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.mlp = GatedMLP(width, mlp, "gelu_tanh" if norm == "gemma" else "silu")

    def _norm(self, norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        return norm(x, cond) if self.adaptive else (norm(x), None)

    def qkv(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cond: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated) and values, each (B, heads or kv_heads, L, head_dim)."""
        h, _ = self._norm(self.input_layernorm, x, cond)
        attn = self.self_attn
        q, k, v = (
            proj(h).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        return rotary(q, positions), rotary(k, positions), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        """Residual update from the attention output (B, heads, L, head_dim), then the MLP."""
        out = self.self_attn.o_proj(attn.transpose(1, 2).flatten(2))
        if self.adaptive:
            x = x + self.input_layernorm.modulation(cond)[2] * out  # the gate of the norm that fed this branch
            h, gate = self.post_attention_layernorm(x, cond)
            return x + gate * self.mlp(h)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x))


def run_layers(
    streams: Sequence[tuple[torch.Tensor, Sequence[DecoderLayer], torch.Tensor | None]],
    positions: torch.Tensor,
    mask: torch.Tensor,
    past: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each stream (x, its layers, its norm condition) through its own layers, with one attention over all streams per
    layer: a mixture of transformers (pi0) or, with one stream, a plain decoder.

    positions (N, L) cover the concatenated streams; mask (N, L, Lpast + L) is True where a query may attend; past holds
    per-layer (k, v) put before the streams' keys, for the N rows or for N / r observations (`attention`). Returns
    the streams' outputs and this call's per-layer (k, v).
    """
    xs = [x for x, _, _ in streams]
    sizes = [x.shape[1] for x in xs]
    stream_positions = positions.split(sizes, 1)

    def layer(i: int, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        q, k, v = (
            torch.cat(parts, 2)
            for parts in zip(*(layers[i].qkv(x, p, c) for x, (_, layers, c), p in zip(xs, streams, stream_positions)))
        )
        out = attention(q, (k, v), mask=mask) if past is None else attention(q, past[i], (k, v), mask)
        return [layers[i].finish(x, o, c) for x, (_, layers, c), o in zip(xs, streams, out.split(sizes, 2))], (k, v)

    kvs = []
    for i in range(len(streams[0][1])):
        xs, kv = call_block(streams[0][1][i], layer, i, xs)
        kvs.append(kv)
    return xs, kvs


# --- vision ------------------------------------------------------------------------------------
class VisionAttention(nn.Module):
    """Multi-head attention with biases (SigLIP/ViT names: q_proj, k_proj, v_proj, out_proj)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            p(x).unflatten(-1, (self.heads, -1)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class VisionMLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionLayer(Block):
    """Pre-norm ViT block (SigLIP: LayerNorm, attention with biases, GELU MLP)."""

    def __init__(self, width: int, mlp: int, heads: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(width, eps=1e-6)
        self.self_attn = VisionAttention(width, heads)
        self.layer_norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = VisionMLP(width, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, image_size: int, patch_size: int, width: int) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, width, patch_size, stride=patch_size)
        self.position_embedding = nn.Embedding((image_size // patch_size) ** 2, width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(images).flatten(2).transpose(1, 2) + self.position_embedding.weight


class VisionEncoder(nn.Module):
    def __init__(self, width: int, depth: int, mlp: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(width, mlp, heads) for _ in range(depth))


class VisionTransformer(nn.Module):
    def __init__(self, image_size: int, patch_size: int, width: int, depth: int, mlp: int, heads: int) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(image_size, patch_size, width)
        self.encoder = VisionEncoder(width, depth, mlp, heads)
        self.post_layernorm = nn.LayerNorm(width, eps=1e-6)


class SiglipVisionModel(nn.Module):
    """SigLIP-style ViT without the pooling head (as PaliGemma, OpenVLA and GR00T use it): (N, 3, S, S) -> patches."""

    def __init__(self, image_size: int, patch_size: int, width: int, depth: int, mlp: int, heads: int) -> None:
        super().__init__()
        self.image_size = image_size
        self.vision_model = VisionTransformer(image_size, patch_size, width, depth, mlp, heads)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) in [-1, 1] -> (N, patches, width)."""
        vm = self.vision_model
        x = vm.embeddings(images)
        for layer in vm.encoder.layers:
            x = call_block(layer, layer, x)
        return vm.post_layernorm(x)


def resize_with_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """openpi's resize_with_pad (shared/image_tools.py, the PyTorch version lerobot's pi0 also runs) on float
    (N, 3, H, W) images in [-1, 1]: bilinear (no antialiasing) to the largest size of the same aspect ratio that
    fits, clipped to [-1, 1], centred on black (-1) padding, the odd pixel at the bottom / right."""
    cur_h, cur_w = images.shape[-2:]
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    out = F.interpolate(images, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    return F.pad(out, (left, width - new_w - left, top, height - new_h - top), value=-1.0)


def camera_images(
    obs: dict[str, torch.Tensor],
    cameras: Sequence[str],
    size: int,
    dtype: torch.dtype,
    device: torch.device,
    pad: bool = False,
) -> torch.Tensor:
    """The cameras' uint8 (B, H, W, 3) images, each resized to size x size, as one (B * cameras, 3, size, size)
    float batch in [-1, 1], camera-major within each row (row b's cameras are b*C .. b*C+C-1). pad: openpi's
    resize-with-pad (`resize_with_pad`) instead of an antialiased stretch."""
    per_camera = []
    for cam in cameras:  # (resized in float32: antialiased resizing has no bfloat16 kernel on CPU)
        image = obs[cam].to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        if image.shape[-2:] != (size, size) and pad:
            image = resize_with_pad(image, size, size)
        elif image.shape[-2:] != (size, size):  # cameras may differ in size: each is resized on its own
            image = F.interpolate(image, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        per_camera.append(image.to(dtype))
    return torch.stack(per_camera, 1).flatten(0, 1)


# --- language ----------------------------------------------------------------------------------
PAD, BOS, BYTE_OFFSET = 0, 1, 3  # byte-level tokenizer: ids 0..2 are specials, UTF-8 byte b is b + 3
BYTE_VOCAB = 256 + BYTE_OFFSET


def byte_tokenize(texts: list[str], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level tokens: BOS, then UTF-8 bytes + 3; padded/truncated to max_tokens. Returns (tokens, mask)."""
    tokens = np.full((len(texts), max_tokens), PAD, np.int64)
    for i, text in enumerate(texts):
        ids = ([BOS] + [b + BYTE_OFFSET for b in text.encode("utf-8")])[:max_tokens]
        tokens[i, : len(ids)] = ids
    return tokens, tokens != PAD


def instruction_tokens(
    obs: dict[str, torch.Tensor], tokenize: Any, instruction: str, batch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's tokens and mask: the runtime passes them; a bare obs gets the env's own instruction."""
    if "tokens" in obs:
        return obs["tokens"].to(device), obs["token_mask"].to(device).bool()
    tokens, mask = (torch.from_numpy(a).to(device).expand(batch, -1) for a in tokenize([instruction]))
    return tokens, mask


def map_tensors(tree: Any, fn: Any) -> Any:
    """fn applied to every tensor in a nested list/tuple/dict/dataclass, the structure kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(
            tree, **{f.name: map_tensors(getattr(tree, f.name), fn) for f in dataclasses.fields(tree)}
        )
    return tree


def repeat_rows(tree: Any, n: int) -> Any:
    """Every tensor of a nested structure with each batch row repeated n times in a row (b -> b*n .. b*n+n-1)."""
    return map_tensors(tree, lambda t: t.repeat_interleave(n, 0))


def cat_rows(trees: list[Any]) -> Any:
    """Nested structures of the same shape, each of some rows, as one: every tensor concatenated along its rows."""
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(trees)
    if isinstance(first, dict):
        return {k: cat_rows([t[k] for t in trees]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(cat_rows(list(parts)) for parts in zip(*trees))
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(
            first, **{f.name: cat_rows([getattr(t, f.name) for t in trees]) for f in dataclasses.fields(first)}
        )
    return first


def expand_rows(tree: Any, n: int) -> Any:
    """A batch-1 nested structure of tensors as n rows of views (no copy)."""
    return map_tensors(tree, lambda t: t.expand(n, *t.shape[1:]))
