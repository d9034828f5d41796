"""pi0 and pi0.5 (Physical Intelligence 2024/2025) in one file, laid out like their public PyTorch checkpoints.

A SigLIP ViT and a Gemma prefix (images, language; pi0.5 also the state as discrete tokens) whose per-layer K,V are
cached once per observation; a Gemma-300M-shaped action expert that attends to them layer by layer (mixture of
transformers); flow matching with an Euler sampler (flow.py adds the stochastic chain and log-probs for RL).
- pi0: the state is one continuous token at the head of the expert's tokens (state_proj); the flow time is mixed
  into each action token (action_time_mlp_in/out). The state token attends only to the prefix and itself, so it is
  run once per observation and its K,V join the prefix cache.
- pi0.5 (variant=pi05): the state is discretised into 256 bins, one token per dim, in the prefix; the time conditions
  every expert layer through adaptive RMSNorms with gated residuals (time_mlp_in/out -> adaRMS).
Module and parameter names follow openpi's PyTorch port (as lerobot's pi0/pi05 policies save them, with their
"model." prefix), so `policy.checkpoint=model.safetensors` loads a real checkpoint by name.
Not reproduced: the PaliGemma SentencePiece tokenizer (a byte-level one stands in; no tokenizer file is fetched) and
pi0.5's text-formatted state prompt (its state tokens are reserved ids at the top of the vocabulary instead).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ebrl.config import ConfigError
from ebrl.envs.base import EnvSpec
from ebrl.policies.flow import FlowPolicy
from ebrl.policies.layers import (
    BYTE_VOCAB,
    DECODER_PROJECTIONS,
    AdaRMSNorm,
    DecoderLayer,
    RMSNorm,
    SiglipVisionModel,
    byte_tokenize,
    camera_images,
    instruction_tokens,
    run_layers,
    time_embedding,
)

STATE_BINS = 256  # pi0.5 discretises each (normalised) state dim into 256 bins over [-1, 1]
VARIANTS = ("pi0", "pi05")


@dataclass(frozen=True)
class OpenPIDims:
    """The sizes of one preset."""

    image_size: int  # square input of the vision tower, pixels; camera images are resized to it
    patch_size: int
    vit_width: int
    vit_depth: int
    vit_mlp: int
    vit_heads: int
    width: int  # prefix (VLM) stream
    depth: int  # layers of both streams: the expert attends to the prefix at every layer
    mlp: int
    heads: int  # query heads; the expert has the same heads, kv_heads and head_dim
    kv_heads: int
    head_dim: int
    vocab: int  # its last STATE_BINS ids are pi0.5's state tokens
    max_tokens: int  # instruction tokens, padded or truncated to this
    expert_width: int
    expert_mlp: int
    chunk: int  # actions per chunk
    denoise_steps: int
    max_action_dim: int  # env actions and states are zero-padded to these
    max_state_dim: int


PRESETS: dict[str, OpenPIDims] = {
    "tiny": OpenPIDims(
        image_size=32, patch_size=8, vit_width=32, vit_depth=2, vit_mlp=64, vit_heads=2,
        width=64, depth=2, mlp=128, heads=4, kv_heads=1, head_dim=16, vocab=BYTE_VOCAB + STATE_BINS, max_tokens=48,
        expert_width=32, expert_mlp=64, chunk=8, denoise_steps=4, max_action_dim=32, max_state_dim=128,
    ),
    "small": OpenPIDims(
        image_size=64, patch_size=8, vit_width=128, vit_depth=4, vit_mlp=512, vit_heads=4,
        width=256, depth=4, mlp=1024, heads=4, kv_heads=1, head_dim=64, vocab=BYTE_VOCAB + STATE_BINS, max_tokens=48,
        expert_width=128, expert_mlp=512, chunk=10, denoise_steps=5, max_action_dim=32, max_state_dim=128,
    ),
    # openpi's pi0/pi05 configs: SigLIP So400m/14 at 224 px, Gemma 2B prefix, gemma_300m action expert, 10 steps,
    # chunk 50, 32 padded action and state dims
    "full": OpenPIDims(
        image_size=224, patch_size=14, vit_width=1152, vit_depth=27, vit_mlp=4304, vit_heads=16,
        width=2048, depth=18, mlp=16384, heads=8, kv_heads=1, head_dim=256, vocab=257152, max_tokens=48,
        expert_width=1024, expert_mlp=4096, chunk=50, denoise_steps=10, max_action_dim=32, max_state_dim=32,
    ),
}


class Projector(nn.Module):
    """PaliGemma's multi-modal projector: one linear map from ViT width to the language model's width."""

    def __init__(self, vit_width: int, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(vit_width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class GemmaModel(nn.Module):
    """A Gemma stack (transformers' GemmaModel names): optional token embedding, decoder layers, final norm."""

    def __init__(self, width: int, depth: int, mlp: int, heads: int, kv_heads: int, head_dim: int,
                 vocab: int | None = None, cond_dim: int | None = None) -> None:
        super().__init__()
        if vocab is not None:
            self.embed_tokens = nn.Embedding(vocab, width)
            nn.init.normal_(self.embed_tokens.weight, std=width ** -0.5)  # Gemma multiplies by sqrt(width) on use
        self.layers = nn.ModuleList(DecoderLayer(width, mlp, heads, kv_heads, head_dim, "gemma", cond_dim)
                                    for _ in range(depth))
        self.norm: nn.Module = AdaRMSNorm(width, cond_dim) if cond_dim is not None else RMSNorm(width)

    def final_norm(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        return self.norm(x, cond)[0] if cond is not None else self.norm(x)


class PaliGemmaModel(nn.Module):
    def __init__(self, d: OpenPIDims, cameras: bool) -> None:
        super().__init__()
        if cameras:  # a state-only env has no vision tower
            self.vision_tower = SiglipVisionModel(d.image_size, d.patch_size, d.vit_width, d.vit_depth, d.vit_mlp,
                                                  d.vit_heads)
            self.multi_modal_projector = Projector(d.vit_width, d.width)
        self.language_model = GemmaModel(d.width, d.depth, d.mlp, d.heads, d.kv_heads, d.head_dim, vocab=d.vocab)


class PaliGemma(nn.Module):
    def __init__(self, d: OpenPIDims, cameras: bool) -> None:
        super().__init__()
        self.model = PaliGemmaModel(d, cameras)


class GemmaExpert(nn.Module):
    def __init__(self, d: OpenPIDims, adaptive: bool) -> None:
        super().__init__()
        self.model = GemmaModel(d.expert_width, d.depth, d.expert_mlp, d.heads, d.kv_heads, d.head_dim,
                                cond_dim=d.expert_width if adaptive else None)


class PaliGemmaWithExpert(nn.Module):
    """The two streams, named as in openpi's `PaliGemmaWithExpertModel`."""

    def __init__(self, d: OpenPIDims, cameras: bool, adaptive: bool) -> None:
        super().__init__()
        self.paligemma = PaliGemma(d, cameras)
        self.gemma_expert = GemmaExpert(d, adaptive)


@dataclass
class PrefixCache:
    """Per-layer K,V (B, kv_heads, L, head_dim) of what every action token sees (the prefix, and pi0's state token)
    and which of those tokens are real (B, L)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor


class OpenPIPolicy(FlowPolicy):
    """pi0 / pi0.5 with a value head; sample/evaluate give the denoising chain's log-probs (see flow.py)."""

    # pi0: "3.3 billion parameters" (Black et al. 2024, "pi0: A Vision-Language-Action Flow Model for General Robot
    # Control", sec. IV: PaliGemma 3B + a 300M action expert). pi0.5 keeps the same backbone and expert (Physical
    # Intelligence 2025, "pi0.5: a VLA with Open-World Generalization", sec. IV) and adds the adaRMS modulations.
    PUBLISHED_PARAMETERS = {
        "pi0": (3.3e9, "Black et al. 2024, pi0 paper sec. IV: PaliGemma 3B + 300M action expert = 3.3B"),
        "pi05": (3.3e9, "Physical Intelligence 2025, pi0.5 paper sec. IV: the pi0 architecture (3.3B) with adaRMS"),
    }

    def __init__(self, env_spec: EnvSpec, preset: str = "tiny", variant: str = "pi0", chunk: int | None = None,
                 denoise_steps: int | None = None, logprob: str = "flow_noise", noise_std_min: float = 0.1,
                 noise_std_max: float = 0.5, sde_noise_level: float = 0.5) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ConfigError(f"policy.variant={variant!r} is not available; accepted: {', '.join(VARIANTS)}")
        d = self.dims = self.bind(PRESETS, preset, env_spec)
        self.variant = variant
        pi05 = variant == "pi05"
        w = d.expert_width
        self.paligemma_with_expert = PaliGemmaWithExpert(d, bool(self.cameras), adaptive=pi05)
        self.action_in_proj = nn.Linear(d.max_action_dim, w)
        self.action_out_proj = nn.Linear(w, d.max_action_dim)
        if pi05:
            self.time_mlp_in = nn.Linear(w, w)
            self.time_mlp_out = nn.Linear(w, w)
        else:
            self.state_proj = nn.Linear(d.max_state_dim, w)
            self.action_time_mlp_in = nn.Linear(2 * w, w)
            self.action_time_mlp_out = nn.Linear(w, w)
        self.init_flow(flow_dim=d.max_action_dim, chunk_len=chunk or d.chunk,
                       denoise_steps=denoise_steps or d.denoise_steps, feature_dim=w, time_dim=w, logprob=logprob,
                       noise_std_min=noise_std_min, noise_std_max=noise_std_max, sde_noise_level=sde_noise_level)
        value_in = d.width + (0 if pi05 else w)  # pi0's state lives in the expert: its token output joins the pool
        self.value_head = nn.Sequential(nn.Linear(value_in, d.width), nn.Tanh(), nn.Linear(d.width, 1))
        if not self.action_in_proj.weight.is_meta:
            if pi05:
                self._init_state_token_embeddings()
            self._prepare_contracting_init()
            self.init_contracting_velocity()

    @property
    def velocity_out(self) -> nn.Linear:  # type: ignore[override]
        return self.action_out_proj

    @property
    def vlm(self) -> GemmaModel:
        return self.paligemma_with_expert.paligemma.model.language_model

    @property
    def expert(self) -> GemmaModel:
        return self.paligemma_with_expert.gemma_expert.model

    def action_expert(self) -> list[str]:
        """The Gemma-300M-shaped expert and the projections into and out of it."""
        return ["paligemma_with_expert.gemma_expert.", "action_in_proj", "action_out_proj", "state_proj",
                "action_time_mlp_in", "action_time_mlp_out", "time_mlp_in", "time_mlp_out"]

    def lora_targets(self) -> str:
        """PaliGemma's Gemma layers (the vision tower stays frozen)."""
        return r"paligemma_with_expert\.paligemma\.model\.language_model\.layers" + DECODER_PROJECTIONS

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Byte-level: BOS, then UTF-8 bytes + 3; padded/truncated to the preset's max_tokens."""
        return byte_tokenize(texts, self.dims.max_tokens)

    # --- the prefix ------------------------------------------------------------------------------
    def state_tokens(self, state: torch.Tensor) -> torch.Tensor:
        """pi0.5's discrete state: each dim clipped to [-1, 1] and binned into one of the vocabulary's last 256 ids."""
        bins = ((state.clamp(-1.0, 1.0) + 1.0) * (STATE_BINS / 2)).long().clamp(max=STATE_BINS - 1)
        return self.dims.vocab - STATE_BINS + bins

    def embed_prefix(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Image, language (and pi0.5's state) tokens (B, Lp, width) and which are real (B, Lp)."""
        weight = self.action_in_proj.weight
        device, dtype, d = weight.device, weight.dtype, self.dims
        state = obs["state"].to(device, dtype)
        batch = state.shape[0]
        pali = self.paligemma_with_expert.paligemma.model
        parts, real = [], []
        if self.cameras:
            images = camera_images(obs, self.cameras, d.image_size, dtype, device)
            image_tokens = pali.multi_modal_projector(pali.vision_tower(images)).reshape(batch, -1, d.width)
            parts.append(image_tokens)
            real.append(torch.ones(batch, image_tokens.shape[1], dtype=torch.bool, device=device))
        tokens, token_mask = instruction_tokens(obs, self.tokenize, self.env_spec.instruction, batch, device)
        if self.variant == "pi05":
            tokens = torch.cat([tokens, self.state_tokens(state)], 1)
            token_mask = torch.cat([token_mask, torch.ones_like(state, dtype=torch.bool)], 1)
        parts.append(self.vlm.embed_tokens(tokens) * math.sqrt(d.width))
        real.append(token_mask)
        return torch.cat(parts, 1), torch.cat(real, 1)

    def encode(self, obs: dict[str, torch.Tensor]) -> tuple[PrefixCache, torch.Tensor]:
        """Run the prefix (and pi0's state token) once: the cache every denoising step attends to, and the features
        (B, F) of the value head: the prefix pooled over its real tokens (+ pi0's state token output)."""
        emb, mask = self.embed_prefix(obs)
        positions = mask.long().cumsum(1) - 1
        (out,), kv = run_layers([(emb, self.vlm.layers, None)], positions,
                                mask[:, None, :].expand(-1, mask.shape[1], -1))
        weights = mask[..., None].to(out.dtype)
        pooled = (self.vlm.final_norm(out) * weights).sum(1) / weights.sum(1)
        if self.variant == "pi05":
            return PrefixCache(kv, mask), pooled
        # pi0's state token attends to the prefix and itself only: once per observation, then part of the cache
        state = obs["state"].to(emb.device, emb.dtype)
        token = self.state_proj(F.pad(state, (0, self.dims.max_state_dim - state.shape[-1])))[:, None]
        ones = torch.ones(mask.shape[0], 1, dtype=torch.bool, device=mask.device)
        (state_out,), state_kv = run_layers([(token, self.expert.layers, None)], mask.sum(1, keepdim=True),
                                            torch.cat([mask, ones], 1)[:, None], past=kv)
        cache = PrefixCache([(torch.cat([k, sk], 2), torch.cat([v, sv], 2)) for (k, v), (sk, sv) in zip(kv, state_kv)],
                            torch.cat([mask, ones], 1))
        return cache, torch.cat([pooled, self.expert.final_norm(state_out)[:, 0]], -1)

    # --- the action expert ------------------------------------------------------------------------
    def embed_suffix(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Noisy action tokens x (N, H, max_action_dim) at flow time t (N,) -> the expert's action tokens, its norm
        condition (pi0.5) and the time features the noise head reads."""
        w = self.dims.expert_width
        temb = time_embedding(t, w).to(x.dtype)
        if self.variant == "pi05":
            cond = F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(temb))))
            return self.action_in_proj(x), cond, cond
        h = self.action_time_mlp_in(torch.cat([self.action_in_proj(x), temb[:, None].expand(-1, x.shape[1], -1)], -1))
        return self.action_time_mlp_out(F.silu(h)), None, temb

    def features(self, x: torch.Tensor, t: torch.Tensor, cache: PrefixCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert output of the action tokens (N, H, expert_width) after the final norm, attending to the cache (of
        the N rows, or of N / r observations whose r rows each read it as it is: `layers.attention`)."""
        emb, cond, temb = self.embed_suffix(x, t)
        n, horizon = x.shape[:2]
        real = cache.mask.repeat_interleave(n // cache.mask.shape[0], 0)  # the cache may be of N / r observations
        positions = real.sum(1, keepdim=True) + torch.arange(horizon, device=x.device)
        mask = torch.cat([real[:, None, :].expand(-1, horizon, -1),
                          torch.ones(n, horizon, horizon, dtype=torch.bool, device=x.device)], -1)
        (out,), _ = run_layers([(emb, self.expert.layers, cond)], positions, mask, past=cache.kv)
        return self.expert.final_norm(out, cond), temb

    # --- checkpoints and initialisation -------------------------------------------------------------
    def import_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """A pi0/pi0.5 PyTorch checkpoint (openpi's names, or lerobot's with a "model." prefix) as this policy's
        state dict; the text heads are dropped (tied or unused: pi0 never decodes text) and, for a state-only env,
        the vision tower too. The RL heads may be missing."""
        if state and all(k.startswith("model.") for k in state):
            state = {k[len("model."):]: v for k, v in state.items()}
        drop = ("paligemma_with_expert.paligemma.lm_head.", "paligemma_with_expert.gemma_expert.lm_head.")
        if not self.cameras:
            drop += ("paligemma_with_expert.paligemma.model.vision_tower.",
                     "paligemma_with_expert.paligemma.model.multi_modal_projector.")
        return {k: v for k, v in state.items() if not k.startswith(drop)}, self.rl_heads()

    @torch.no_grad()
    def _init_state_token_embeddings(self) -> None:
        # Real pi0.5 reads its state as pretrained number tokens; from scratch, 256 unrelated random embeddings would
        # leave nearby bins as different as far ones. So the bins start as a sinusoidal code of their value (at the
        # embedding table's scale) and any smooth function of the state is learnable from the first update.
        centers = (torch.arange(STATE_BINS, dtype=torch.float32) + 0.5) / STATE_BINS * 2 - 1
        table = self.vlm.embed_tokens.weight
        code = time_embedding(centers, table.shape[1], min_period=0.05, max_period=8.0)
        table[-STATE_BINS:] = (code * math.sqrt(2.0) * table.shape[1] ** -0.5).to(table)

    @torch.no_grad()
    def _prepare_contracting_init(self) -> None:
        # The expert's attention output (pi0) or both residual branches (pi0.5, whose adaRMS gates start at zero)
        # start closed, so the action tokens' residual stream carries action_in_proj(x) and x is linearly readable by
        # action_out_proj; like a PPO actor's near-zero last layer, the first policy is the same for every obs, and
        # the closed branches get gradients and learn to read the prefix. (Zeroing o_proj behind a zero gate as well
        # would leave both without a gradient for ever.) action_in_proj reads only the env's dims at unit gain.
        if self.variant == "pi0":
            for layer in self.expert.layers:
                layer.self_attn.o_proj.weight.zero_()
        self.action_in_proj.weight.zero_()
        self.action_in_proj.weight[:, : self.action_dim].normal_(std=self.action_dim ** -0.5)
