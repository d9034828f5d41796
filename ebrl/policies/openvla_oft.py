"""OpenVLA-OFT (Kim, Finn, Liang 2025) on OpenVLA 7B (Kim et al. 2024), laid out like its public checkpoints.

OpenVLA is a Prismatic VLM: a fused vision encoder (DINOv2 ViT-L/14 with 4 registers and LayerScale, and SigLIP
So400m/14, both timm ViTs at 224 px; each gives the patch tokens of its second-to-last block and the two are
concatenated channel-wise, 1024 + 1152 = 2176), a 3-layer GELU MLP projector into the LLM width, and Llama-2-7B.
OFT's changes, all reproduced here:
- parallel decoding: one token per action dim, H * A empty (zero) action embeddings after the prompt, decoded in ONE
  forward pass; the prompt attends causally (and never to the action tokens), the action tokens attend to the whole
  prompt and bidirectionally to each other;
- the proprio state as one input token after the image patches (ProprioProjector: Linear, GELU, Linear);
- a continuous head: per action, the final hidden states of its A tokens, concatenated, go through OFT's MLPResNet
  (L1RegressionActionHead, 2 residual blocks, hidden = LLM width) and it is trained with an L1 loss (`l1_loss`).
For RL: a Gaussian around the head's actions with a learned per-dim std (bounded in [action_std_min, action_std_max])
and a value head on the action tokens' mean final hidden state (they have seen the whole observation).

Names follow OpenVLA's HF port and OFT's modules (vision_backbone.featurizer / fused_featurizer in timm's names with
LayerScale's `scale_factor`, projector.fc1-3, language_model.model.layers.N..., language_model.lm_head,
proprio_projector.fc1-2, action_head.model...), so a checkpoint merged into one safetensors file loads by name.
A released OpenVLA-OFT folder (e.g. moojink/openvla-7b-oft-finetuned-libero-spatial, as openvla-oft's
vla-scripts/finetune.py `save_training_checkpoint` writes it) is read by `read_oft_folder`: the LoRA-merged VLA as HF
sharded safetensors (`save_pretrained`: model-0000N-of-0000M.safetensors + model.safetensors.index.json, keys of
OpenVLAForActionPrediction), and OFT's modules as separate torch files `<component>--<step>_checkpoint.pt`
(`torch.save` of the DDP-wrapped module's state_dict, so keys start with `module.`, which openvla-oft's
`load_component_state_dict` strips); `read_oft_statistics` reads its dataset_statistics.json (per-dataset action and
proprio q01/q99/mean/std/min/max, the action's normalisation mask).
What OpenVLA builds but OFT's L1 path never runs (lm_head: no token is decoded; each ViT's last block and final norm:
features come from the second-to-last block; SigLIP's attention-pool head) is built so the count and a checkpoint
match, and frozen so it gets no optimizer state.
Simplified: a byte-level tokenizer stands in for Llama-2's SentencePiece (no tokenizer file is fetched) and the
instruction goes in without OpenVLA's "In: What action should the robot take to ...? Out:" template; the state is
zero-padded to the preset's max_state_dim (OFT's projector takes the robot's proprio dims, 8 on LIBERO).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ebrl.config import ConfigError
from ebrl.envs.base import EnvSpec
from ebrl.policies import layers
from ebrl.policies.base import Policy, PolicySample, masked_mean
from ebrl.policies.layers import (
    BYTE_VOCAB,
    DECODER_PROJECTIONS,
    DecoderLayer,
    RMSNorm,
    byte_tokenize,
    call_block,
    camera_images,
    instruction_tokens,
    run_layers,
)
from ebrl.policies.weights import CheckpointError, read_weights

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # DINOv2's input normalisation


@dataclass(frozen=True)
class OpenVLAOFTDims:
    """The sizes of one preset."""

    image_size: int  # square input of both ViTs, pixels; camera images are resized to it
    patch_size: int
    dino_width: int  # DINOv2 (featurizer): class token, registers, LayerScale
    dino_depth: int
    dino_mlp: int
    dino_heads: int
    dino_registers: int
    siglip_width: int  # SigLIP (fused_featurizer): no class token, attention-pool head
    siglip_depth: int
    siglip_mlp: int
    siglip_heads: int
    width: int  # Llama-2 backbone
    depth: int
    mlp: int
    heads: int  # Llama-2-7B has no grouped-query attention: kv heads = heads
    head_dim: int
    vocab: int
    max_tokens: int  # instruction tokens, padded or truncated to this
    chunk: int  # actions per chunk; each action is action_dim tokens
    head_blocks: int  # MLPResNet blocks of the L1 head (its hidden size is the LLM width, as in OFT)
    max_state_dim: int  # the state is zero-padded to this before the proprio projector


PRESETS: dict[str, OpenVLAOFTDims] = {
    "tiny": OpenVLAOFTDims(
        image_size=32,
        patch_size=8,
        dino_width=32,
        dino_depth=2,
        dino_mlp=128,
        dino_heads=2,
        dino_registers=4,
        siglip_width=32,
        siglip_depth=2,
        siglip_mlp=120,
        siglip_heads=2,
        width=64,
        depth=2,
        mlp=172,
        heads=4,
        head_dim=16,
        vocab=BYTE_VOCAB,
        max_tokens=48,
        chunk=8,
        head_blocks=2,
        max_state_dim=128,
    ),
    "small": OpenVLAOFTDims(
        image_size=64,
        patch_size=8,
        dino_width=128,
        dino_depth=3,
        dino_mlp=512,
        dino_heads=4,
        dino_registers=4,
        siglip_width=144,
        siglip_depth=3,
        siglip_mlp=538,
        siglip_heads=4,
        width=256,
        depth=4,
        mlp=688,
        heads=4,
        head_dim=64,
        vocab=BYTE_VOCAB,
        max_tokens=64,
        chunk=8,
        head_blocks=2,
        max_state_dim=128,
    ),
    # OpenVLA 7B (openvla/openvla-7b, "dinosiglip-vit-so-224px" + Llama-2-7B): timm vit_large_patch14_reg4_dinov2
    # and vit_so400m_patch14_siglip_224 at 224 px, Llama-2-7B with its vocab padded to 32064 (32000 + <PAD>, to a
    # multiple of 64); OFT's LIBERO chunk of 8 and 2-block L1 head. 7,541,237,184 parameters before OFT's additions.
    "full": OpenVLAOFTDims(
        image_size=224,
        patch_size=14,
        dino_width=1024,
        dino_depth=24,
        dino_mlp=4096,
        dino_heads=16,
        dino_registers=4,
        siglip_width=1152,
        siglip_depth=27,
        siglip_mlp=4304,
        siglip_heads=16,
        width=4096,
        depth=32,
        mlp=11008,
        heads=32,
        head_dim=128,
        vocab=32064,
        max_tokens=64,
        chunk=8,
        head_blocks=2,
        max_state_dim=128,
    ),
}


# --- vision: timm ViTs as OpenVLA builds them ---------------------------------------------------
class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, width: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, width, patch_size, stride=patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)


class LayerScale(nn.Module):
    """DINOv2's per-channel residual scale (OpenVLA renames timm's `gamma` to `scale_factor`)."""

    def __init__(self, width: int, init: float) -> None:
        super().__init__()
        self.scale_factor = nn.Parameter(torch.full((width,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale_factor


class Attention(nn.Module):
    """timm's ViT attention: one fused qkv projection with bias, then proj."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # timm's default nn.GELU (OpenVLA overrides no activation)


class Block(layers.Block):
    """Pre-norm ViT block; LayerScale on both residual branches when `layer_scale` is given (DINOv2)."""

    def __init__(self, width: int, mlp: int, heads: int, layer_scale: float | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = Attention(width, heads)
        self.ls1: nn.Module = LayerScale(width, layer_scale) if layer_scale is not None else nn.Identity()
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = Mlp(width, mlp)
        self.ls2: nn.Module = LayerScale(width, layer_scale) if layer_scale is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class AttentionPoolLatent(nn.Module):
    """SigLIP's attention-pool ("map") head, timm's names. OpenVLA's checkpoint holds it; nothing runs it."""

    def __init__(self, width: int, mlp: int) -> None:
        super().__init__()
        self.latent = nn.Parameter(torch.zeros(1, 1, width))
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.mlp = Mlp(width, mlp)


class VisionTransformer(nn.Module):
    """timm VisionTransformer as OpenVLA calls it: (N, 3, S, S) -> the patch tokens of the second-to-last block.

    DINOv2: a class token and registers (prefix tokens, dropped from the output), learned positions on the patches
    only (timm's no_embed_class), LayerScale. SigLIP: no prefix tokens, no LayerScale, an attention-pool head.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        width: int,
        depth: int,
        mlp: int,
        heads: int,
        registers: int = 0,
        class_token: bool = False,
        layer_scale: float | None = None,
        attn_pool: bool = False,
    ) -> None:
        super().__init__()
        if depth < 2:
            raise ValueError(f"depth={depth}: OpenVLA reads the second-to-last block, so a ViT needs at least 2")
        self.embed_dim = width
        self.patch_embed = PatchEmbed(patch_size, width)
        self.num_prefix_tokens = int(class_token) + registers
        if class_token:
            self.cls_token = nn.Parameter(1e-6 * torch.randn(1, 1, width))
        if registers:
            self.reg_token = nn.Parameter(1e-6 * torch.randn(1, registers, width))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, (image_size // patch_size) ** 2, width))
        self.blocks = nn.ModuleList(Block(width, mlp, heads, layer_scale) for _ in range(depth))
        self.norm = nn.LayerNorm(width, eps=1e-6)
        if attn_pool:
            self.attn_pool = AttentionPoolLatent(width, mlp)
        # never run by OpenVLA (it stops at the second-to-last block): frozen, so no optimizer state or DDP hooks
        for unused in (self.blocks[-1], self.norm, getattr(self, "attn_pool", None)):
            if unused is not None:
                unused.requires_grad_(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images) + self.pos_embed
        prefix = [
            getattr(self, name).expand(x.shape[0], -1, -1) for name in ("cls_token", "reg_token") if hasattr(self, name)
        ]
        x = torch.cat([*prefix, x], 1)
        for block in self.blocks[:-1]:
            x = call_block(block, block, x)
        return x[:, self.num_prefix_tokens :]


class PrismaticVisionBackbone(nn.Module):
    """DINOv2 (featurizer) and SigLIP (fused_featurizer) on the same images, patch features concatenated per patch."""

    def __init__(self, d: OpenVLAOFTDims) -> None:
        super().__init__()
        self.image_size = d.image_size
        self.featurizer = VisionTransformer(
            d.image_size,
            d.patch_size,
            d.dino_width,
            d.dino_depth,
            d.dino_mlp,
            d.dino_heads,
            registers=d.dino_registers,
            class_token=True,
            layer_scale=1e-5,
        )
        self.fused_featurizer = VisionTransformer(
            d.image_size, d.patch_size, d.siglip_width, d.siglip_depth, d.siglip_mlp, d.siglip_heads, attn_pool=True
        )
        self.embed_dim = d.dino_width + d.siglip_width

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) in [-1, 1] (SigLIP's normalisation) -> (N, patches, dino_width + siglip_width)."""
        mean, std = (images.new_tensor(v).view(1, 3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
        dino_images = ((images + 1.0) / 2.0 - mean) / std
        return torch.cat([self.featurizer(dino_images), self.fused_featurizer(images)], -1)


class PrismaticProjector(nn.Module):
    """OpenVLA's projector for a fused backbone: fc1 (x4 the vision width), GELU, fc2, GELU, fc3."""

    def __init__(self, vision_dim: int, llm_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision_dim, 4 * vision_dim)
        self.fc2 = nn.Linear(4 * vision_dim, llm_dim)
        self.fc3 = nn.Linear(llm_dim, llm_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


# --- language model ------------------------------------------------------------------------------
class LlamaModel(nn.Module):
    """Llama-2 decoder (transformers' LlamaModel names): token embedding, decoder layers, final RMSNorm."""

    def __init__(self, d: OpenVLAOFTDims) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(d.vocab, d.width)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)  # Llama's initializer_range
        self.layers = nn.ModuleList(
            DecoderLayer(d.width, d.mlp, d.heads, d.heads, d.head_dim, norm="llama") for _ in range(d.depth)
        )
        self.norm = RMSNorm(d.width, eps=1e-5, offset=False)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, L, width) embeddings, positions (B, L), mask (B, L, L) True where a query may attend -> the final
        hidden states after the norm (what OFT's head reads as hidden_states[-1])."""
        (out,), _ = run_layers([(inputs_embeds, self.layers, None)], positions, mask)
        return self.norm(out)


class LlamaForCausalLM(nn.Module):
    """The decoder and its untied lm_head; OFT's L1 path decodes no token, so lm_head is built (count, checkpoint)
    but never run, and frozen."""

    def __init__(self, d: OpenVLAOFTDims) -> None:
        super().__init__()
        self.model = LlamaModel(d)
        self.lm_head = nn.Linear(d.width, d.vocab, bias=False)
        self.lm_head.requires_grad_(False)


# --- OFT's modules -------------------------------------------------------------------------------
class ProprioProjector(nn.Module):
    """OFT's proprio projector: the state as one token in the LLM's embedding space."""

    def __init__(self, proprio_dim: int, llm_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, proprio: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(proprio)))


class MLPResNetBlock(nn.Module):
    """x + ReLU(Linear(LayerNorm(x))) (OFT's pre-norm residual MLP block)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    """OFT's MLPResNet: LayerNorm, fc1, ReLU, residual blocks, LayerNorm, fc2."""

    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.mlp_resnet_blocks = nn.ModuleList(MLPResNetBlock(hidden_dim) for _ in range(num_blocks))
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """OFT's continuous head: the action_dim token states of each action, concatenated, -> its action_dim values."""

    def __init__(self, llm_dim: int, action_dim: int, num_blocks: int) -> None:
        super().__init__()
        self.action_dim = action_dim
        self.model = MLPResNet(num_blocks, input_dim=llm_dim * action_dim, hidden_dim=llm_dim, output_dim=action_dim)

    def predict_action(self, actions_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, H * action_dim, llm_dim) -> (B, H, action_dim)."""
        batch = actions_hidden_states.shape[0]
        return self.model(actions_hidden_states.reshape(batch, -1, self.action_dim * actions_hidden_states.shape[-1]))


# --- the policy ------------------------------------------------------------------------------------
class OpenVLAOFTPolicy(Policy):
    """OpenVLA-OFT: the whole chunk in one backbone pass, L1-regression actions; a Gaussian around them for RL."""

    # What the full preset is checked against. OFT's additions (L1 head 151.1M at 7 action dims, proprio projector
    # 17.3M at 128 padded state dims) and the RL value head (16.8M) come on top: +2.5% with a 7-dim action space.
    PUBLISHED_PARAMETERS = {
        "default": (
            7_541_237_184,
            "OpenVLA 7B: 7,541,237,184 parameters (Hugging Face openvla/openvla-7b model page, '7.54B params', counted "
            "from its safetensors: 15,082,474,368 bytes of bf16; the paper, Kim et al. 2024, arXiv 2406.09246, "
            "says 7B): "
            "Llama-2-7B with a 32064-token vocab and untied lm_head 6,738,939,904 + DINOv2 ViT-L/14-reg4 303,230,976 + "
            "SigLIP So400m/14 with its attention-pool head 427,680,704 + fused projector 71,385,600. OFT (Kim, Finn, "
            "Liang 2025) adds its L1 head and proprio projector, RL a value head: ~2.5% above this figure.",
        )
    }

    def __init__(
        self,
        env_spec: EnvSpec,
        preset: str = "tiny",
        chunk: int | None = None,
        action_std_init: float = 0.3,
        action_std_min: float = 0.02,
        action_std_max: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0 < action_std_min <= action_std_init <= action_std_max:
            raise ConfigError(
                f"policy.action_std_min={action_std_min}, policy.action_std_init={action_std_init} and "
                f"policy.action_std_max={action_std_max} must satisfy 0 < min <= init <= max"
            )
        d = self.dims = self.bind(PRESETS, preset, env_spec)
        if chunk is not None and chunk < 1:
            raise ConfigError(f"policy.chunk={chunk} must be a positive integer")
        self.chunk_len = chunk or d.chunk

        if self.cameras:  # a state-only env builds no vision tower
            self.vision_backbone = PrismaticVisionBackbone(d)
            self.projector = PrismaticProjector(self.vision_backbone.embed_dim, d.width)
        self.language_model = LlamaForCausalLM(d)
        self.proprio_projector = ProprioProjector(d.max_state_dim, d.width)
        # one token per action dim, so the head's input is action_dim hidden states (as OFT sizes it by ACTION_DIM)
        self.action_head = L1RegressionActionHead(d.width, self.action_dim, d.head_blocks)
        with torch.no_grad():
            self.init_head("action_head", reset=False)
        # RL heads. std = exp(log_std), log_std = log min + (log max - log min) sigmoid(logit): bounded, and smooth
        # at the bounds (a clamp would stop the gradient there)
        self.log_std_min, self.log_std_max = math.log(action_std_min), math.log(action_std_max)
        self.action_std_init = action_std_init
        self.log_std_logit = nn.Parameter(torch.empty(self.action_dim))
        with torch.no_grad():
            self.init_head("log_std_logit")
        self.value_head = nn.Sequential(nn.Linear(d.width, d.width), nn.Tanh(), nn.Linear(d.width, 1))

    def rl_heads(self) -> list[str]:
        return ["value_head", "log_std_logit"]

    def init_head(self, prefix: str, reset: bool = True) -> None:
        """As the constructor: the L1 head's last layer near zero (like a PPO actor's: the first means are ~0 and
        exploration is the std's), the std at action_std_init; `reset` first re-draws the layers' defaults."""
        name = prefix.rstrip(".")
        if name == "log_std_logit":
            span = self.log_std_max - self.log_std_min
            frac = min(max((math.log(self.action_std_init) - self.log_std_min) / span, 1e-4), 1 - 1e-4) if span else 0.5
            self.log_std_logit.fill_(math.log(frac / (1 - frac)))
            return
        if reset:
            super().init_head(prefix)
        if name == "action_head":
            self.action_head.model.fc2.weight.mul_(0.01)
            self.action_head.model.fc2.bias.zero_()

    def action_expert(self) -> list[str]:
        """OFT's own modules: the L1 head and the proprio projector."""
        return ["action_head.", "proprio_projector."]

    def lora_targets(self) -> str:
        """Llama-2's layers, as OFT fine-tunes OpenVLA (the vision backbone stays frozen)."""
        return r"language_model\.model\.layers" + DECODER_PROJECTIONS

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Byte-level: BOS, then UTF-8 bytes + 3; padded/truncated to the preset's max_tokens."""
        return byte_tokenize(texts, self.dims.max_tokens)

    # --- one backbone pass -------------------------------------------------------------------------
    def prompt(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """OpenVLA's input order: BOS, image patches (every camera), the proprio token, the rest of the instruction.
        Returns embeddings (B, Lp, width) and which tokens are real (B, Lp)."""
        embed = self.language_model.model.embed_tokens
        device, dtype = embed.weight.device, embed.weight.dtype
        state = obs["state"].to(device, dtype)
        batch = state.shape[0]
        tokens, token_mask = instruction_tokens(obs, self.tokenize, self.env_spec.instruction, batch, device)
        text = embed(tokens)
        parts = [text[:, :1]]
        if self.cameras:
            images = camera_images(obs, self.cameras, self.dims.image_size, dtype, device)
            parts.append(self.projector(self.vision_backbone(images)).reshape(batch, -1, self.dims.width))
        parts.append(self.proprio_projector(F.pad(state, (0, self.dims.max_state_dim - state.shape[-1])))[:, None])
        inserted = sum(p.shape[1] for p in parts[1:])
        parts.append(text[:, 1:])
        real = torch.cat(
            [token_mask[:, :1], torch.ones(batch, inserted, dtype=torch.bool, device=device), token_mask[:, 1:]], 1
        )
        return torch.cat(parts, 1), real

    def attention_mask(self, real: torch.Tensor, n_actions: int) -> torch.Tensor:
        """(B, Lp + n_actions, Lp + n_actions), True where a query may attend: the prompt causally (never the
        action tokens after it), the action tokens every real prompt token and each other (OFT's parallel decoding)."""
        batch, prompt_len = real.shape
        length = prompt_len + n_actions
        keys = torch.cat([real, real.new_ones(batch, n_actions)], 1)
        index = torch.arange(length, device=real.device)
        causal = index[None, :] <= index[:, None]
        among_actions = (index[:, None] >= prompt_len) & (index[None, :] >= prompt_len)
        return (causal | among_actions)[None] & keys[:, None, :]

    def encode(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """The final hidden states (B, Lp + H * action_dim, width) of one backbone pass, and Lp (the prompt length):
        OFT's empty action embeddings (zeros; rotary positions tell them apart) follow the prompt."""
        emb, real = self.prompt(obs)
        n_actions = self.chunk_len * self.action_dim
        emb = torch.cat([emb, emb.new_zeros(emb.shape[0], n_actions, emb.shape[2])], 1)
        full_real = torch.cat([real, real.new_ones(real.shape[0], n_actions)], 1)
        positions = full_real.long().cumsum(1) - 1  # padding inside the prompt takes no position
        return self.language_model.model(emb, positions, self.attention_mask(real, n_actions)), real.shape[1]

    def mean_and_value(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The L1 head's actions (B, H, action_dim) in float32 and the value (B,), from one backbone pass."""
        with self.precision():
            hidden, prompt_len = self.encode(obs)
            actions_hidden = hidden[:, prompt_len:]
            mean = self.action_head.predict_action(actions_hidden).float()
            return mean, self.value_head(actions_hidden.mean(1)).squeeze(-1).float()

    @torch.no_grad()
    def predict_action(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """OFT's deterministic action chunk (B, H, action_dim): the Gaussian's mean."""
        return self.mean_and_value(obs)[0]

    # --- the Gaussian ---------------------------------------------------------------------------
    def log_std(self) -> torch.Tensor:
        """(action_dim,) log std, in [log action_std_min, log action_std_max]."""
        span = self.log_std_max - self.log_std_min
        return self.log_std_min + span * torch.sigmoid(self.log_std_logit.float())

    def _log_density(self, actions: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    @torch.no_grad()
    def sample(self, obs: dict[str, torch.Tensor], deterministic: bool = False) -> PolicySample:
        """a = mean + std * eps for every action of the chunk; log_prob (B, H) sums the action dims.
        deterministic: the L1 head's actions themselves, as OFT acts (evaluation)."""
        mean, value = self.mean_and_value(obs)
        log_std = self.log_std()
        chunk = mean if deterministic else mean + log_std.exp() * torch.randn_like(mean)
        return PolicySample(chunk=chunk, log_prob=self._log_density(chunk, mean, log_std), value=value, extras={})

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Value head on the action tokens' mean final hidden state."""
        return self.mean_and_value(obs)[1]

    def evaluate(
        self, obs: dict[str, torch.Tensor], chunk: torch.Tensor, extras: dict[str, torch.Tensor], prefix: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Recomputes the mean from obs and scores the stored chunk; extras are not needed."""
        mean, value = self.mean_and_value(obs)
        log_std = self.log_std()
        log_prob = self._log_density(chunk.to(mean.device, mean.dtype), mean, log_std)
        entropy = (log_std + 0.5 * (1.0 + math.log(2 * math.pi))).sum().expand_as(log_prob)
        return log_prob, entropy, value

    def l1_loss(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """OFT's supervised loss: mean |predicted - target| over the chunk (B, H, action_dim), over the actions `mask`
        (B, H) keeps."""
        mean, _ = self.mean_and_value(obs)
        return masked_mean((mean.float() - actions.to(mean.device, torch.float32)).abs().mean(-1), mask)

    def supervised_loss(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """OFT's L1 regression of its action head."""
        return self.l1_loss(obs, actions, mask)

    # --- checkpoints and counts -----------------------------------------------------------------
    @classmethod
    def read_checkpoint(cls, path: str) -> dict[str, torch.Tensor]:
        """A released OFT folder: the VLA's shards and its component .pt files (`read_oft_folder`); a file as it is."""
        return read_weights(path) if Path(path).expanduser().is_file() else read_oft_folder(path)

    def import_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """A released OpenVLA-OFT checkpoint (`read_oft_folder`: OpenVLA's HF port with OFT's action_head. and
        proprio_projector. merged in), or a plain OpenVLA one, as this policy's state dict. Mapped: timm's LayerScale
        `gamma` to the HF port's `scale_factor`; a `module.` (DDP) left after a component's prefix is dropped, as are
        Llama's `rotary_emb.inv_freq` buffers (older transformers saved them; they follow from the config); the
        proprio projector's input is zero-padded to max_state_dim (OFT's is the robot's proprio, 8 dims on LIBERO);
        a state-only env drops the vision tower. A plain OpenVLA checkpoint has no OFT modules, so they may be
        missing (but not in part), as may the RL heads. One line for a diffusion checkpoint (this policy builds the
        L1 head) or an OFT module the checkpoint has only part of."""
        diffusion = [k for k in state if k.startswith(("noisy_action_projector.", "action_head.noise_predictor."))]
        if diffusion:
            raise CheckpointError(
                f"a diffusion OpenVLA-OFT checkpoint ({diffusion[0]}): this policy builds OFT's L1 "
                "regression head only; use an L1 checkpoint (use_l1_regression=True)"
            )
        mapped: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if key.endswith(".rotary_emb.inv_freq"):
                continue
            key = COMPONENT_DDP.sub(r"\1.", key)
            if key.startswith("vision_backbone.") and key.endswith((".ls1.gamma", ".ls2.gamma")):
                key = key[: -len("gamma")] + "scale_factor"
            mapped[key] = value
        own = self.state_dict().keys()
        for prefix in ("proprio_projector.", "action_head."):  # may be absent, but not in part
            if any(k.startswith(prefix) for k in mapped):
                lacking = [k for k in own if k.startswith(prefix) and k not in mapped]
                if lacking:
                    raise CheckpointError(
                        f"the checkpoint has part of {prefix.rstrip('.')}: keys {len(lacking)} "
                        f"missing (e.g. {', '.join(lacking[:3])})"
                    )
        key = "proprio_projector.fc1.weight"
        if key in mapped and mapped[key].ndim == 2 and mapped[key].shape[1] < self.dims.max_state_dim:
            mapped[key] = F.pad(mapped[key], (0, self.dims.max_state_dim - mapped[key].shape[1]))
        if not self.cameras:
            mapped = {k: v for k, v in mapped.items() if not k.startswith(("vision_backbone.", "projector."))}
        return mapped, [*self.rl_heads(), "proprio_projector.", "action_head."]

    def parameter_breakdown(self) -> dict[str, int]:
        """Parameters per component (works on the meta device)."""

        def count(module: nn.Module) -> int:
            return sum(p.numel() for p in module.parameters())

        parts = {}
        if self.cameras:
            parts["vision_backbone.featurizer (DINOv2)"] = count(self.vision_backbone.featurizer)
            parts["vision_backbone.fused_featurizer (SigLIP)"] = count(self.vision_backbone.fused_featurizer)
            parts["projector"] = count(self.projector)
        parts["language_model (Llama-2)"] = count(self.language_model)
        parts["proprio_projector (OFT)"] = count(self.proprio_projector)
        parts["action_head (OFT)"] = count(self.action_head)
        parts["value_head + log_std_logit (RL)"] = count(self.value_head) + self.log_std_logit.numel()
        return parts


# --- released checkpoint folders ------------------------------------------------------------------
# OFT's own modules, each saved by openvla-oft's vla-scripts/finetune.py (`save_training_checkpoint`) as
# torch.save(<DDP-wrapped module>.state_dict(), "<name>--<step>_checkpoint.pt") ("<name>--latest_checkpoint.pt" with
# save_latest_checkpoint_only); experiments/robot/openvla_utils.py (`load_component_state_dict`) reads them back and
# strips the "module." each key starts with. Names: action_head, proprio_projector, noisy_action_projector
# (diffusion), vision_backbone (FiLM: the whole backbone).
COMPONENT_FILE = re.compile(r"(?P<name>[A-Za-z0-9_]+)--(?P<step>\d+|latest)_checkpoint\.pt")
COMPONENT_DDP = re.compile(r"^(action_head|proprio_projector|noisy_action_projector)\.module\.")
DDP_PREFIX = "module."
STATISTICS = "dataset_statistics.json"
STAT_KEYS = ("q01", "q99", "mean", "std", "min", "max")


def oft_component_files(folder: str | Path, step: int | str | None = None) -> dict[str, Path]:
    """{component name: its `<name>--<step>_checkpoint.pt`} in `folder`; `step` (a number or "latest") picks one
    where the folder holds several. One line when a component has several and no step is given, or lacks `step`."""
    folder = Path(folder).expanduser()
    found: dict[str, dict[str, Path]] = {}
    for f in sorted(folder.iterdir()):
        match = COMPONENT_FILE.fullmatch(f.name)
        if match and f.is_file():
            found.setdefault(match["name"], {})[match["step"]] = f
    chosen = {}
    for name, by_step in found.items():
        names = ", ".join(f.name for f in by_step.values())
        if step is not None:
            if str(step) not in by_step:
                raise CheckpointError(f"{folder} has no {name}--{step}_checkpoint.pt (it has {names})")
            chosen[name] = by_step[str(step)]
        elif len(by_step) > 1:
            raise CheckpointError(f"{folder} holds {len(by_step)} {name} checkpoints ({names}); choose one with step=")
        else:
            chosen[name] = next(iter(by_step.values()))
    return chosen


def read_oft_folder(path: str | Path, step: int | str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a released OpenVLA-OFT checkpoint folder in one flat dict, under the released names: the VLA's
    safetensors (HF's shards via model.safetensors.index.json, or one model.safetensors; `read_weights`) as they are
    (vision_backbone.*, projector.*, language_model.*), and each `<name>--<step>_checkpoint.pt` under `<name>.` with
    DDP's `module.` stripped (action_head.model..., proprio_projector.fc1...). The folder's lora_adapter/ is not read
    (the shards hold the LoRA-merged model), nor its tokenizer and processor files. `OpenVLAOFTPolicy.
    import_state_dict` maps the result to the policy. One line for a folder that holds only a LoRA adapter, a FiLM
    vision backbone (not built here), an unreadable component file, or a component key the shards also hold."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(
            f"{path} is not a folder; give the OpenVLA-OFT checkpoint folder (safetensors shards, "
            "<component>--<step>_checkpoint.pt files, dataset_statistics.json)"
        )
    components = oft_component_files(folder, step)
    if "vision_backbone" in components:
        raise CheckpointError(
            f"{components['vision_backbone']} is a FiLM vision backbone (use_film=True); this "
            "policy builds OpenVLA's backbone without FiLM"
        )
    if (
        not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))
        and (folder / "lora_adapter").is_dir()
    ):
        raise CheckpointError(
            f"{folder} holds only a LoRA adapter (lora_adapter/), no merged model: merge it into "
            "the base model first (openvla-oft's vla-scripts/merge_lora_weights_and_save.py)"
        )
    state = read_weights(str(folder))
    for name, f in components.items():
        try:
            raw = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{f} is not a readable torch checkpoint ({type(e).__name__})") from None
        if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
            raise CheckpointError(f"{f} is not a state dict of tensors (openvla-oft saves module.state_dict())")
        for key, value in raw.items():
            full = f"{name}.{key[len(DDP_PREFIX) :] if key.startswith(DDP_PREFIX) else key}"
            if full in state:
                raise CheckpointError(f"{f.name} holds {key}, which the safetensors shards also hold as {full}")
            state[full] = value
    return state


def _feature_statistics(entry: object, where: str) -> dict[str, np.ndarray]:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where} is not a dict of statistics")
    out = {k: np.asarray(entry[k], dtype=np.float64) for k in STAT_KEYS if entry.get(k) is not None}
    if "q01" not in out or "q99" not in out:
        raise CheckpointError(f"{where} has no q01/q99 (it has {', '.join(entry) or 'nothing'})")
    dims = out["q01"].shape
    mask = entry.get("mask")
    out["mask"] = np.ones(dims, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    other = [f"{k} {a.shape}" for k, a in out.items() if a.shape != dims or a.ndim != 1]
    if other:
        raise CheckpointError(f"{where}: statistics of other shapes than q01 {dims} ({', '.join(other)})")
    return out


def read_oft_statistics(path: str | Path, unnorm_key: str | None = None) -> dict:
    """One dataset's normalisation statistics from an OpenVLA(-OFT) checkpoint: `path` is its dataset_statistics.json
    (openvla-oft's `save_dataset_statistics`: {dataset: {"action": {...}, "proprio": {...}, "num_transitions",
    "num_trajectories"}}), a config.json with `norm_stats` (OpenVLAConfig; the same per-dataset structure), or the
    folder (dataset_statistics.json first, as openvla-oft's `_load_dataset_stats` replaces the config's norm_stats
    with it). `unnorm_key` names the dataset; with one dataset it may be left out, and `<key>_no_noops` is taken for a
    `<key>` that is absent (openvla-oft's LIBERO eval, `check_unnorm_key`). One line when it is ambiguous or missing,
    listing the keys there are.

    Returns {"action": stats, "proprio": stats (when the file has it), "unnorm_key": the key used}, each stats a
    dict of float64 numpy arrays q01, q99 and whichever of mean, std, min, max the file has, and a bool `mask`
    (True: normalised; the file's, or all True as openvla-oft defaults it: LIBERO's actions leave the gripper out).
    OFT (BOUNDS_Q99) maps x to 2 (x - q01) / (q99 - q01 + 1e-8) - 1 where mask is True (the proprio clipped to
    [-1, 1]) and un-normalises actions as 0.5 (a + 1) (q99 - q01 + 1e-8) + q01 there."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = [p / n for n in (STATISTICS, "config.json") if (p / n).is_file()]
        if not found:
            raise CheckpointError(f"{path} holds no {STATISTICS} or config.json")
        p = found[0]
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p} is not a readable JSON file ({type(e).__name__})") from None
    if isinstance(data, dict) and ("norm_stats" in data or p.name == "config.json"):
        data = data.get("norm_stats")
        if not data:
            raise CheckpointError(f"{p} has no norm_stats; give the checkpoint's {STATISTICS}")
    if not isinstance(data, dict) or not data:
        raise CheckpointError(f"{p} holds no dataset statistics ({{dataset: {{'action': ..., 'proprio': ...}}}})")
    keys = ", ".join(data)
    if unnorm_key is None:
        if len(data) != 1:
            raise CheckpointError(f"{p} holds statistics of {len(data)} datasets; choose one with unnorm_key: {keys}")
        unnorm_key = next(iter(data))
    elif unnorm_key not in data and f"{unnorm_key}_no_noops" in data:
        unnorm_key = f"{unnorm_key}_no_noops"
    if unnorm_key not in data:
        raise CheckpointError(f"{p} has no statistics for unnorm_key={unnorm_key!r}; available: {keys}")
    entry = data[unnorm_key]
    if not isinstance(entry, dict) or "action" not in entry:
        raise CheckpointError(f"{p}: {unnorm_key} has no action statistics")
    out: dict = {"action": _feature_statistics(entry["action"], f"{p}: {unnorm_key}.action")}
    if entry.get("proprio") is not None:
        out["proprio"] = _feature_statistics(entry["proprio"], f"{p}: {unnorm_key}.proprio")
    out["unnorm_key"] = unnorm_key
    return out
