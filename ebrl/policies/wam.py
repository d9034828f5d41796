"""A world-action model: one DiT jointly denoises latent future frames and the action chunk (docs/internals/design.md,
"Policies and simulators"), at the shapes of Cosmos Policy's video model (Kim et al. 2026, "Cosmos Policy:
Fine-Tuning Video Models for Visuomotor Control and Planning", arXiv 2601.16163), Cosmos-Predict2-2B (NVIDIA 2025,
nvidia-cosmos/cosmos-predict2).

Why Cosmos Policy: it is a world-action model with no extra action head (actions and future frames are latent
frames of one video DiT, denoised together), and both the DiT's configuration (cosmos-predict2's
PREDICT2_VIDEO2WORLD_NET_2B) and its parameter count (2B, NVIDIA's model matrix) are published, so the full preset
can be checked. For UVA, Unified World Models and Genie Envisioner no configuration with a matching published count
was found in the reference sources at hand.

Layout:
- frames: a small conv autoencoder (`frame_codec`: camera image -> latent grid with 8x downsampling, as Cosmos'
  Wan2.1 VAE, 16 channels -> pixels) and 2x2 latent patches as tokens (`x_embedder`, with Cosmos' condition-mask
  channel: 1 on the current frames); learned patch and camera embeddings stand in for Cosmos' 3D RoPE.
- the DiT (dit.py, norm_type="ada_norm_zero"): Cosmos-Predict2 blocks (self-attention with q/k RMSNorm,
  cross-attention to the instruction, GELU MLP; shift/scale/gate per sublayer through AdaLN-LoRA plus a term shared
  by all blocks, `t_embedder`), one time per token group (Cosmos conditions per latent frame), `final_layer`.
- tokens: [state token, current frame tokens] at t = 0 (the clean conditioning frames of Cosmos' video2world), then
  the noisy groups: future frame tokens (one future frame per camera: the one at the chunk's end) and action tokens
  (`action_in_proj`, one per chunk step); two velocity outputs, `final_layer.linear` for frame latents and
  `action_out_proj` for actions. The instruction is cross-attended (`embed_tokens` has T5's vocabulary and width;
  Cosmos runs the T5-11B encoder outside the DiT, which the byte-level table stands in for).
- the conditioning tokens attend only to each other (pi0's prefix): they run once per observation, their keys and
  values are cached for every denoising step, and the value head reads them pooled. Cosmos lets every token attend
  to every other token.
Action-only path (rollouts, the FlowPolicy chain): the future-frame tokens are dropped, so a denoising step costs the
action tokens only. Training makes this the same function the joint model computes with its frames hidden:
`world_model_loss` draws frame and action times independently and, in a random half of the rows, masks the future
frame tokens out of every attention (keys), which is exactly what dropping them computes, because everything else
in a block acts per token. As in Unified World Models, which marginalises a modality by holding it at pure noise
(t = 1: it then carries no information), the action head learns p(actions | obs) without the future; dropping the
tokens instead of feeding noise is what makes the rollout cheaper. `imagine` runs the joint chain (frames and
actions) when future frames are wanted. State-only envs have no frame tokens and no codec: the model is an action
DiT over [state token, action tokens].
Flow time: t = 1 is noise and t = 0 data (x_t = t noise + (1 - t) x), FlowPolicy's convention, for both outputs.
Simplified against Cosmos Policy: actions and state are tokens with their own projections (Cosmos Policy tiles them
into whole latent frames), no value or future-proprioception frames (the value head is the RL one), no padding-mask
input channel, a small conv codec trained here instead of the Wan2.1 VAE, byte-level text instead of T5, no dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ebrl.envs.base import EnvSpec
from ebrl.policies.dit import AdaLayerNorm, BasicTransformerBlock, TimestepEncoder
from ebrl.policies.flow import FlowPolicy, sample_flow_time
from ebrl.policies.layers import (
    BYTE_VOCAB,
    RMSNorm,
    byte_tokenize,
    call_block,
    camera_images,
    instruction_tokens,
)


@dataclass(frozen=True)
class WAMDims:
    """The sizes of one preset."""

    image_size: int  # square frames the codec sees; camera images are resized to it
    codec_channels: tuple[int, ...]  # conv widths of the autoencoder, one stride-2 stage each
    latent_channels: int
    patch_size: int  # latent patch per frame token
    width: int  # DiT model_channels
    depth: int  # blocks
    heads: int
    lora_dim: int  # AdaLN-LoRA rank
    text_width: int  # crossattn_emb_channels
    vocab: int
    max_tokens: int  # instruction tokens, padded or truncated to this
    chunk: int  # actions per chunk
    denoise_steps: int
    max_action_dim: int  # env actions and states are zero-padded to these
    max_state_dim: int


PRESETS: dict[str, WAMDims] = {
    "tiny": WAMDims(
        image_size=32,
        codec_channels=(8, 16),
        latent_channels=4,
        patch_size=2,
        width=64,
        depth=2,
        heads=4,
        lora_dim=16,
        text_width=32,
        vocab=BYTE_VOCAB,
        max_tokens=48,
        chunk=8,
        denoise_steps=4,
        max_action_dim=32,
        max_state_dim=128,
    ),
    "small": WAMDims(
        image_size=64,
        codec_channels=(32, 64, 128),
        latent_channels=8,
        patch_size=2,
        width=256,
        depth=4,
        heads=4,
        lora_dim=64,
        text_width=128,
        vocab=BYTE_VOCAB,
        max_tokens=48,
        chunk=16,
        denoise_steps=5,
        max_action_dim=32,
        max_state_dim=128,
    ),
    # Cosmos-Predict2-2B (cosmos-predict2 PREDICT2_VIDEO2WORLD_NET_2B): model_channels 2048, 28 blocks, 16 heads,
    # mlp_ratio 4, crossattn_emb_channels 1024 (T5-11B, vocabulary 32128), AdaLN-LoRA rank 256, 16 latent channels,
    # 2x2 patches, 8x spatial compression (Wan2.1 VAE). Chunk 16 and 5 steps are this repo's choice.
    "full": WAMDims(
        image_size=224,
        codec_channels=(64, 128, 256),
        latent_channels=16,
        patch_size=2,
        width=2048,
        depth=28,
        heads=16,
        lora_dim=256,
        text_width=1024,
        vocab=32128,
        max_tokens=48,
        chunk=16,
        denoise_steps=5,
        max_action_dim=32,
        max_state_dim=64,
    ),
}


class FrameCodec(nn.Module):
    """Conv autoencoder: frames (N, 3, S, S) in [-1, 1] -> latents (N, C, S/f, S/f), f = 2^stages -> frames."""

    def __init__(self, channels: tuple[int, ...], latent_channels: int) -> None:
        super().__init__()
        encoder: list[nn.Module] = []
        c_in = 3
        for c in channels:
            encoder += [nn.Conv2d(c_in, c, 4, stride=2, padding=1), nn.SiLU()]
            c_in = c
        encoder.append(nn.Conv2d(c_in, latent_channels, 3, padding=1))
        self.encoder = nn.Sequential(*encoder)
        decoder: list[nn.Module] = [nn.Conv2d(latent_channels, channels[-1], 3, padding=1), nn.SiLU()]
        outs = list(reversed(channels[:-1])) + [3]
        for c_in, c in zip(reversed(channels), outs):
            decoder += [nn.ConvTranspose2d(c_in, c, 4, stride=2, padding=1), nn.SiLU()]
        decoder[-1] = nn.Tanh()
        self.decoder = nn.Sequential(*decoder)

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        return self.encoder(frames)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(latents)


class FinalLayer(nn.Module):
    """Cosmos' final layer: adaLN-modulated LayerNorm, then `linear` to the frame patches (the action velocity is
    the policy's action_out_proj on the same normalised tokens)."""

    def __init__(self, d: WAMDims, frames: bool) -> None:
        super().__init__()
        self.norm = AdaLayerNorm(d.width, d.width, lora_dim=d.lora_dim, bias=False, eps=1e-6)
        if frames:
            self.linear = nn.Linear(d.width, d.patch_size**2 * d.latent_channels, bias=False)


class WAMPolicy(FlowPolicy):
    """World-action model with a value head; sample/evaluate run the action-only path (see the module docstring)."""

    # The DiT at Cosmos-Predict2-2B's shapes is 1.956B (hand count: 28 blocks x 69.2M + time embedder 16.8M + final
    # layer 1.7M + patch embedding; the bf16 2B checkpoint, 3.91 GB, agrees). The full preset adds the byte-level
    # T5-vocabulary text table (32.9M: the T5 encoder itself is outside Cosmos' 2B), the conv codec (1.4M: Cosmos
    # uses the Wan2.1 VAE, also outside the 2B), patch/camera/action/state embeddings (0.8M) and the RL heads (12.7M).
    PUBLISHED_PARAMETERS = {
        "default": (
            2.0e9,
            "Cosmos-Predict2-2B-Video2World, 'Diffusion-based video and text to visual world "
            "generation (2 billion parameters)', NVIDIA Cosmos docs, Predict2 model matrix; the "
            "video DiT only (text encoder and VAE excluded), the model Cosmos Policy fine-tunes",
        ),
    }
    FRAME_DROP = 0.5  # share of world_model_loss rows whose future frames are hidden: trains the action-only path

    def __init__(
        self,
        env_spec: EnvSpec,
        preset: str = "tiny",
        chunk: int | None = None,
        denoise_steps: int | None = None,
        logprob: str = "flow_noise",
        noise_std_min: float = 0.1,
        noise_std_max: float = 0.5,
        sde_noise_level: float = 0.5,
        chain_logprob: str = "sum",
        detach_critic_input: bool = False,
    ) -> None:
        super().__init__()
        d = self.dims = self.bind(PRESETS, preset, env_spec)
        chunk = chunk or d.chunk
        w = d.width
        self.latent_size = d.image_size // 2 ** len(d.codec_channels)
        self.frame_patches = (self.latent_size // d.patch_size) ** 2  # tokens per camera and frame
        if self.cameras:  # a state-only env has no frames: the model is an action DiT
            self.frame_codec = FrameCodec(d.codec_channels, d.latent_channels)
            self.x_embedder = nn.Linear((d.latent_channels + 1) * d.patch_size**2, w, bias=False)
            self.pos_embed = nn.Parameter(0.02 * torch.randn(self.frame_patches, w))
            self.camera_embed = nn.Embedding(len(self.cameras), w)
            nn.init.normal_(self.camera_embed.weight, std=0.02)
        self.state_proj = nn.Linear(d.max_state_dim, w)
        self.embed_tokens = nn.Embedding(d.vocab, d.text_width)
        self.text_position = nn.Embedding(d.max_tokens, d.text_width)
        for table in (self.embed_tokens, self.text_position):
            nn.init.normal_(table.weight, std=0.02)
        # Cosmos' t_embedder: sinusoid -> linear_1 -> SiLU -> linear_2 = the AdaLN-LoRA term shared by all blocks;
        # the modulations themselves read the RMS-normalised sinusoid
        self.t_embedder = TimestepEncoder(w, freq_dim=w, out_dim=3 * w, bias=False)
        self.t_embedding_norm = RMSNorm(w, 1e-6, offset=False)
        self.blocks = nn.ModuleList(
            BasicTransformerBlock(
                w,
                d.heads,
                w // d.heads,
                norm_type="ada_norm_zero",
                cond_dim=w,
                cross_attention_dim=d.text_width,
                bias=False,
                qk_norm=True,
                lora_dim=d.lora_dim,
                norm_eps=1e-6,
            )
            for _ in range(d.depth)
        )
        self.final_layer = FinalLayer(d, bool(self.cameras))
        self.action_in_proj = nn.Linear(d.max_action_dim, w)
        self.action_position = nn.Embedding(chunk, w)
        nn.init.normal_(self.action_position.weight, std=0.02)
        self.action_out_proj = nn.Linear(w, d.max_action_dim)
        self.init_flow(
            flow_dim=d.max_action_dim,
            chunk_len=chunk,
            denoise_steps=denoise_steps or d.denoise_steps,
            feature_dim=w,
            time_dim=w,
            logprob=logprob,
            noise_std_min=noise_std_min,
            noise_std_max=noise_std_max,
            sde_noise_level=sde_noise_level,
            chain_logprob=chain_logprob,
            detach_critic_input=detach_critic_input,
        )
        self.frame_steps = self.denoise_steps  # Euler steps of `imagine`'s joint chain; rollouts never use it
        self.value_head = nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 1))
        if not self.action_in_proj.weight.is_meta:
            self._prepare_contracting_init()
            self.init_contracting_velocity()

    @property
    def velocity_out(self) -> nn.Linear:  # type: ignore[override]
        return self.action_out_proj

    def action_expert(self) -> list[str]:
        """The action-specific projections; the DiT itself is shared by frames and actions, so it is the backbone
        here (policy.train=lora adapts it)."""
        return ["action_in_proj", "action_position", "action_out_proj", "state_proj"]

    def lora_targets(self) -> str:
        """The DiT blocks' attention and MLP projections."""
        return r"blocks\.\d+\.(attn[12]\.to_(q|k|v|out)|ff\.net\.(0\.proj|2))"

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Byte-level: BOS, then UTF-8 bytes + 3; padded/truncated to the preset's max_tokens."""
        return byte_tokenize(texts, self.dims.max_tokens)

    # --- frames ------------------------------------------------------------------------------------
    def frames(self, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """The cameras' uint8 (B, H, W, 3) frames as one (B * cameras, 3, S, S) batch in [-1, 1]."""
        weight = self.action_in_proj.weight
        return camera_images(images, self.cameras, self.dims.image_size, weight.dtype, weight.device)

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B * cameras, C, h, w) latents -> (B, cameras * patches, C p p) frame tokens, camera-major."""
        p = self.dims.patch_size
        n, c, h, w = latents.shape
        x = latents.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, c * p * p)
        return x.reshape(n // len(self.cameras), -1, c * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """Inverse of `patchify`."""
        p, c, g = self.dims.patch_size, self.dims.latent_channels, self.latent_size // self.dims.patch_size
        x = tokens.reshape(-1, g, g, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(-1, c, g * p, g * p)

    def encode_frames(self, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """Camera frames -> latent patches (B, cameras * patches, C p p)."""
        return self.patchify(self.frame_codec.encode(self.frames(images)))

    def decode_frames(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Latent patches (B, cameras * patches, C p p) -> {camera: (B, H, W, 3) uint8} at the env's frame size."""
        pixels = self.frame_codec.decode(self.unpatchify(tokens))
        pixels = pixels.unflatten(0, (tokens.shape[0], len(self.cameras)))
        out = {}
        for i, cam in enumerate(self.cameras):
            height, width = self.env_spec.obs[cam].shape[:2]
            frame = pixels[:, i]
            if frame.shape[-2:] != (height, width):
                frame = F.interpolate(frame, size=(height, width), mode="bilinear", align_corners=False)
            out[cam] = ((frame + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
        return out

    def embed_frames(self, latent_tokens: torch.Tensor, current: bool) -> torch.Tensor:
        """Latent patches -> DiT tokens (B, cameras * patches, width); Cosmos' condition-mask channel marks the
        current (conditioning) frames."""
        flag = latent_tokens.new_full((*latent_tokens.shape[:2], self.dims.patch_size**2), float(current))
        x = self.x_embedder(torch.cat([latent_tokens, flag], -1))
        position = self.pos_embed.repeat(len(self.cameras), 1)
        camera = self.camera_embed.weight.repeat_interleave(self.frame_patches, 0)
        return x + position + camera

    # --- the DiT ----------------------------------------------------------------------------------
    def time_conditions(self, times: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-group flow times [(N,), ...] -> the modulations' input (N, G, width) and the shared AdaLN-LoRA term
        (N, G, 3 width)."""
        sinusoid = self.t_embedder.project(torch.stack(times, 1)).to(self.action_in_proj.weight.dtype)
        return self.t_embedding_norm(sinusoid), self.t_embedder.timestep_embedder(sinusoid)

    def encode(self, obs: dict[str, torch.Tensor], prefix: Any = None) -> tuple[dict, torch.Tensor]:
        """Once per observation: the instruction's keys/values for every block's cross-attention, and the
        conditioning tokens [state, current frames] at t = 0 through the DiT, whose keys/values every denoising step
        attends to; the value head reads those tokens pooled."""
        weight = self.action_in_proj.weight
        device, dtype, d = weight.device, weight.dtype, self.dims
        state = obs["state"].to(device, dtype)
        batch = state.shape[0]
        tokens, text_mask = instruction_tokens(obs, self.tokenize, self.env_spec.instruction, batch, device)
        text = self.embed_tokens(tokens) + self.text_position.weight[: tokens.shape[1]]
        h = self.state_proj(F.pad(state, (0, d.max_state_dim - state.shape[-1])))[:, None]
        if self.cameras:
            h = torch.cat([h, self.embed_frames(self.encode_frames(obs), current=True)], 1)
        temb, shared = self.time_conditions([torch.zeros(batch, device=device)])
        groups = torch.zeros(h.shape[1], dtype=torch.long, device=device)
        text_kv, past = [], []
        for block in self.blocks:
            text_kv.append(block.cross_kv(text))
            h, kv = call_block(
                block, block, h, temb, context_kv=text_kv[-1], context_mask=text_mask, groups=groups, shared=shared
            )
            past.append(kv)
        pooled = self.final_layer.norm.norm(h).mean(1)
        return {"text_kv": text_kv, "text_mask": text_mask, "past": past}, pooled

    def denoise(
        self,
        cond: dict,
        x: torch.Tensor,
        t: torch.Tensor,
        frames: torch.Tensor | None = None,
        t_frames: torch.Tensor | None = None,
        frames_visible: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One DiT pass over the noisy tokens: action chunks x (N, H, max_action_dim) at times t (N,) and, for the
        joint model, noisy future frame latents (N, cameras * patches, C p p) at t_frames (N,). frames_visible (N,)
        bool hides a row's frame tokens from every attention, which is what dropping them computes.
        Returns the action features (N, H, width), the frame velocity (or None) and the actions' time features."""
        horizon = x.shape[1]
        h = self.action_in_proj(x) + self.action_position.weight[:horizon]
        times, sizes = [t], [horizon]
        if frames is not None:
            h = torch.cat([self.embed_frames(frames, current=False), h], 1)
            times, sizes = [t_frames, t], [frames.shape[1], horizon]
        temb, shared = self.time_conditions(times)
        groups = torch.repeat_interleave(
            torch.arange(len(sizes), device=x.device), torch.tensor(sizes, device=x.device), output_size=sum(sizes)
        )
        mask = None
        if frames is not None and frames_visible is not None:
            n, past = x.shape[0], cond["past"][0][0].shape[2]
            keys = torch.cat(
                [
                    torch.ones(n, past, dtype=torch.bool, device=x.device),
                    frames_visible[:, None].expand(-1, sizes[0]),
                    torch.ones(n, horizon, dtype=torch.bool, device=x.device),
                ],
                1,
            )
            mask = keys[:, None, :].expand(-1, h.shape[1], -1)
        for block, text_kv, past_kv in zip(self.blocks, cond["text_kv"], cond["past"]):
            h, _ = call_block(
                block,
                block,
                h,
                temb,
                context_kv=text_kv,
                context_mask=cond["text_mask"],
                past_kv=past_kv,
                attention_mask=mask,
                groups=groups,
                shared=shared,
            )
        h, _ = self.final_layer.norm(h, temb, groups, shared)
        frame_velocity = self.final_layer.linear(h[:, : sizes[0]]) if frames is not None else None
        return h[:, -horizon:], frame_velocity, temb[:, -1]

    def features(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The action-only path the flow chain samples and evaluates: no future-frame tokens at all."""
        h, _, temb = self.denoise(cond, x, t)
        return h, temb

    # --- world model ------------------------------------------------------------------------------
    def world_model_loss(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor, future_images: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Joint flow matching: {"action": action velocity MSE, "frame": frame-latent velocity MSE (rows whose
        frames are visible), "reconstruction": the codec's pixel MSE on current and future frames}; sum them to train.

        Frame and action times are independent; a FRAME_DROP share of rows hides the future frames, so the
        action-only path of rollouts is trained (module docstring). future_images: {camera: (B, H, W, 3) uint8},
        the frames at the chunk's end; a state-only env passes {} and gets zero frame terms.
        """
        with self.precision():
            cond, _ = self.encode(obs)
            weight = self.action_in_proj.weight
            a = F.pad(actions.to(weight.device, weight.dtype), (0, self.flow_dim - actions.shape[-1]))
            batch = a.shape[0]
            noise = torch.randn_like(a)
            t = sample_flow_time(batch, a)
            x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * a
            zero = a.new_zeros(())
            if not self.cameras:
                h, _, _ = self.denoise(cond, x_t, t)
                action = F.mse_loss(self.velocity_out(h)[..., : self.action_dim], (noise - a)[..., : self.action_dim])
                return {"action": action, "frame": zero, "reconstruction": zero}
            current, future = self.frames(obs), self.frames(future_images)
            codec = self.frame_codec
            target = self.patchify(codec.encode(future)).detach()  # the codec learns from reconstruction only
            frame_noise = torch.randn_like(target)
            t_frames = torch.rand(batch, device=a.device, dtype=a.dtype)
            z_t = t_frames[:, None, None] * frame_noise + (1 - t_frames[:, None, None]) * target
            visible = torch.rand(batch, device=a.device) >= self.FRAME_DROP
            h, frame_velocity, _ = self.denoise(cond, x_t, t, z_t, t_frames, visible)
            action = F.mse_loss(self.velocity_out(h)[..., : self.action_dim], (noise - a)[..., : self.action_dim])
            per_row = (frame_velocity - (frame_noise - target)).pow(2).mean((1, 2))
            frame = (per_row * visible).sum() / visible.sum().clamp(min=1)
            pixels = torch.cat([current, future])
            reconstruction = F.mse_loss(codec.decode(codec.encode(pixels)), pixels)
            return {"action": action, "frame": frame, "reconstruction": reconstruction}

    @torch.no_grad()
    def imagine(self, obs: dict[str, torch.Tensor]) -> dict:
        """The joint chain: future frames and actions denoised together from noise by `frame_steps` deterministic
        Euler steps. Returns {"chunk": (B, H, action_dim), "frames": {camera: (B, H, W, 3) uint8} (empty without
        cameras), "latents": (B, cameras * patches, C p p) or None}."""
        cond, pooled = self.encode(obs)
        batch, steps = pooled.shape[0], self.frame_steps
        x = torch.randn(batch, self.chunk_len, self.flow_dim, device=pooled.device, dtype=pooled.dtype)
        z = None
        if self.cameras:
            patch = self.dims.latent_channels * self.dims.patch_size**2
            z = torch.randn(batch, len(self.cameras) * self.frame_patches, patch, device=x.device, dtype=x.dtype)
        for t in self.times(steps, x.device):
            times = t.expand(batch)
            h, frame_velocity, _ = self.denoise(cond, x, times, z, times if z is not None else None)
            x = x - self.velocity_out(h) / steps
            if z is not None:
                z = z - frame_velocity / steps
        return {
            "chunk": x[..., : self.action_dim],
            "frames": self.decode_frames(z) if z is not None else {},
            "latents": z,
        }

    # --- initialisation ----------------------------------------------------------------------------
    @torch.no_grad()
    def _prepare_contracting_init(self) -> None:
        # The self-attention outputs start at zero, so the action tokens' residual stream carries action_in_proj(x)
        # and x is readable by action_out_proj (init_contracting_velocity fits it); the first policy reads only the
        # instruction, and the attention outputs get gradients and learn to read the frames and the state.
        # action_in_proj reads only the env's dims, at unit gain.
        for block in self.blocks:
            block.attn1.to_out.weight.zero_()
        self.action_in_proj.weight.zero_()
        self.action_in_proj.weight[:, : self.action_dim].normal_(std=self.action_dim**-0.5)
