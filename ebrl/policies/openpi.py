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
"model." prefix), so `policy.checkpoint=<folder>` loads a real checkpoint by name (`import_state_dict`,
`checkpoint_defaults`).

A checkpoint acts as it was trained (the parity tests compare it with lerobot 0.4.4's PI0Policy / PI05Policy):
- the prompt is openpi's, through PaliGemma's SentencePiece model (`policy.tokenizer`, ebrl/policies/tokenizer.py),
  pi0.5's with its discretised state written into the text; without a tokenizer file (the tiny and small presets) a
  byte-level stand-in tokenizes, and pi0.5's state is then one reserved id per dim at the top of the vocabulary;
- the state is normalised and the actions un-normalised with the checkpoint's statistics (`policy.norm_stats`,
  ebrl/policies/normalize.py): the chain, its log-probs and RL's updates live in the normalised space, the env gets
  the un-normalised actions, mapped to its dims by `policy.action_dims` / `policy.action_scale`;
- images are resized with padding to 224 (openpi's resize_with_pad) in [-1, 1]; `policy.cameras` maps the
  checkpoint's camera slots (base_0_rgb, left_wrist_0_rgb, right_wrist_0_rgb) to env cameras, and a slot no env
  camera fills is masked as openpi masks it (its tokens are attended by nothing and take no position, so they are
  left out of the sequence: the same outputs, less work);
- `sample(obs, deterministic=True)` integrates the flow with plain Euler steps over every dim, as openpi samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from ebrl.policies.normalize import Normalizer, find_norm_stats, norm_modes, read_norm_stats
from ebrl.policies.tokenizer import MAX_TOKENS, PaligemmaTokenizer, clean, find_tokenizer

STATE_BINS = 256  # pi0.5 discretises each (normalised) state dim into 256 bins over [-1, 1]
VARIANTS = ("pi0", "pi05")
# openpi's camera slots, in the order its models take them (pi0_config: IMAGE_KEYS)
OPENPI_SLOTS = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
# the Gemma sizes openpi names (gemma.get_config), as the full preset builds them
GEMMA_VARIANTS = ("gemma_2b", "gemma_300m")
NORM_MODES = {"pi0": "mean_std", "pi05": "quantiles"}  # lerobot's normalization_mapping, openpi's use_quantile_norm


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
        image_size=32,
        patch_size=8,
        vit_width=32,
        vit_depth=2,
        vit_mlp=64,
        vit_heads=2,
        width=64,
        depth=2,
        mlp=128,
        heads=4,
        kv_heads=1,
        head_dim=16,
        vocab=BYTE_VOCAB + STATE_BINS,
        max_tokens=48,
        expert_width=32,
        expert_mlp=64,
        chunk=8,
        denoise_steps=4,
        max_action_dim=32,
        max_state_dim=128,
    ),
    "small": OpenPIDims(
        image_size=64,
        patch_size=8,
        vit_width=128,
        vit_depth=4,
        vit_mlp=512,
        vit_heads=4,
        width=256,
        depth=4,
        mlp=1024,
        heads=4,
        kv_heads=1,
        head_dim=64,
        vocab=BYTE_VOCAB + STATE_BINS,
        max_tokens=48,
        expert_width=128,
        expert_mlp=512,
        chunk=10,
        denoise_steps=5,
        max_action_dim=32,
        max_state_dim=128,
    ),
    # openpi's pi0/pi05 configs: SigLIP So400m/14 at 224 px, Gemma 2B prefix, gemma_300m action expert, 10 steps,
    # chunk 50, 32 padded action and state dims
    "full": OpenPIDims(
        image_size=224,
        patch_size=14,
        vit_width=1152,
        vit_depth=27,
        vit_mlp=4304,
        vit_heads=16,
        width=2048,
        depth=18,
        mlp=16384,
        heads=8,
        kv_heads=1,
        head_dim=256,
        vocab=257152,
        max_tokens=48,
        expert_width=1024,
        expert_mlp=4096,
        chunk=50,
        denoise_steps=10,
        max_action_dim=32,
        max_state_dim=32,
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

    def __init__(
        self,
        width: int,
        depth: int,
        mlp: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        vocab: int | None = None,
        cond_dim: int | None = None,
    ) -> None:
        super().__init__()
        if vocab is not None:
            self.embed_tokens = nn.Embedding(vocab, width)
            nn.init.normal_(self.embed_tokens.weight, std=width**-0.5)  # Gemma multiplies by sqrt(width) on use
        self.layers = nn.ModuleList(
            DecoderLayer(width, mlp, heads, kv_heads, head_dim, "gemma", cond_dim) for _ in range(depth)
        )
        self.norm: nn.Module = AdaRMSNorm(width, cond_dim) if cond_dim is not None else RMSNorm(width)

    def final_norm(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        return self.norm(x, cond)[0] if cond is not None else self.norm(x)


class PaliGemmaModel(nn.Module):
    def __init__(self, d: OpenPIDims, cameras: bool) -> None:
        super().__init__()
        if cameras:  # a state-only env has no vision tower
            self.vision_tower = SiglipVisionModel(
                d.image_size, d.patch_size, d.vit_width, d.vit_depth, d.vit_mlp, d.vit_heads
            )
            self.multi_modal_projector = Projector(d.vit_width, d.width)
        self.language_model = GemmaModel(d.width, d.depth, d.mlp, d.heads, d.kv_heads, d.head_dim, vocab=d.vocab)


class PaliGemma(nn.Module):
    def __init__(self, d: OpenPIDims, cameras: bool) -> None:
        super().__init__()
        self.model = PaliGemmaModel(d, cameras)


class GemmaExpert(nn.Module):
    def __init__(self, d: OpenPIDims, adaptive: bool) -> None:
        super().__init__()
        self.model = GemmaModel(
            d.expert_width,
            d.depth,
            d.expert_mlp,
            d.heads,
            d.kv_heads,
            d.head_dim,
            cond_dim=d.expert_width if adaptive else None,
        )


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

    def __init__(
        self,
        env_spec: EnvSpec,
        preset: str = "tiny",
        variant: str | None = None,
        chunk: int | None = None,
        denoise_steps: int | None = None,
        logprob: str = "flow_noise",
        noise_std_min: float = 0.1,
        noise_std_max: float = 0.5,
        sde_noise_level: float = 0.5,
        chain_logprob: str = "sum",
        detach_critic_input: bool = False,
        dims: dict[str, int] | None = None,
        tokenizer: str | None = None,
        norm_stats: str | None = None,
        norm_mode: str | None = None,
        cameras: dict[str, str | None] | None = None,
        action_dims: list[int] | None = None,
        action_scale: list[float] | None = None,
        prompt_style: str | None = None,
        state_dims: list[int] | None = None,
    ) -> None:
        super().__init__()
        variant = variant or "pi0"
        if variant not in VARIANTS:
            raise ConfigError(f"policy.variant={variant!r} is not available; accepted: {', '.join(VARIANTS)}")
        d = self.dims = self.bind(PRESETS, preset, env_spec, dims, state_dims)
        self.state_dims = None if state_dims is None else list(state_dims)
        self.variant = variant
        pi05 = variant == "pi05"
        self.bind_cameras(cameras)
        self.tokenizer, self._decoded = None, {}  # (pi0.5: instruction ids -> their text)
        if tokenizer:
            self.tokenizer = PaligemmaTokenizer(
                tokenizer, (dims or {}).get("max_tokens") or MAX_TOKENS[variant], prompt_style or "openpi"
            )
            if self.tokenizer.vocab_size > d.vocab:
                raise ConfigError(
                    f"policy.tokenizer={tokenizer} has {self.tokenizer.vocab_size} pieces, more than "
                    f"the preset's vocabulary of {d.vocab}"
                )
        self.normalizer = None
        if norm_stats:
            stats = read_norm_stats(norm_stats)
            self.normalizer = Normalizer(stats, *norm_modes(stats, norm_mode, NORM_MODES[variant]))
        elif norm_mode:
            raise ConfigError(
                f"policy.norm_mode={norm_mode} needs statistics: give policy.norm_stats=<file> or a "
                "checkpoint folder that has them"
            )
        self.bind_actions(
            action_dims, action_scale, self.normalizer.dims("action") if self.normalizer else None, d.max_action_dim
        )
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
        self.init_flow(
            flow_dim=d.max_action_dim,
            chunk_len=chunk or d.chunk,
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
        return [
            "paligemma_with_expert.gemma_expert.",
            "action_in_proj",
            "action_out_proj",
            "state_proj",
            "action_time_mlp_in",
            "action_time_mlp_out",
            "time_mlp_in",
            "time_mlp_out",
        ]

    def lora_targets(self) -> str:
        """PaliGemma's Gemma layers (the vision tower stays frozen)."""
        return r"paligemma_with_expert\.paligemma\.model\.language_model\.layers" + DECODER_PROJECTIONS

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The instruction's tokens: pi0's whole prompt with PaliGemma's tokenizer; for pi0.5, whose prompt holds the
        state, the cleaned instruction alone (no BOS), which `embed_prefix` decodes and writes into the prompt with
        each row's state. Without a tokenizer file, byte-level: BOS, then UTF-8 bytes + 3, to the preset's
        max_tokens."""
        if self.tokenizer is None:
            return byte_tokenize(texts, self.dims.max_tokens)
        if self.variant == "pi0":
            return self.tokenizer.tokenize(texts)
        return self.tokenizer.pad([self.tokenizer.processor.Encode(clean(t)) for t in texts])

    def state_prompt_tokens(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """pi0.5's prompt for each row: its instruction (decoded from `tokenize`'s ids) and its normalised state."""
        assert self.tokenizer is not None
        rows = [tuple(r[m].tolist()) for r, m in zip(tokens.cpu(), mask.cpu())]
        texts = [self._decoded.get(r) or self._decoded.setdefault(r, self.tokenizer.decode(list(r))) for r in rows]
        values = state.float()
        if self.tokenizer.style == "lerobot":  # (lerobot digitises the zero-padded state)
            values = F.pad(values, (0, self.dims.max_state_dim - values.shape[-1]))
        out, out_mask = self.tokenizer.tokenize(texts, values.cpu().numpy())
        return torch.from_numpy(out).to(tokens.device), torch.from_numpy(out_mask).to(tokens.device)

    # --- cameras, state and actions as the checkpoint has them ------------------------------------
    def bind_cameras(self, cameras: dict[str, str | None] | None) -> None:
        """The camera slots in the checkpoint's order and the env image each reads (None: masked). Without a
        mapping, every env camera in sorted order. One line for a slot mapped to a camera the env lacks."""
        env_cameras = self.cameras  # (bind: the env's image keys, sorted)
        if not cameras:
            self.camera_slots, self.camera_sources = [c[len("image/") :] for c in env_cameras], list(env_cameras)
            return
        have = [c[len("image/") :] for c in env_cameras]
        for slot, cam in cameras.items():
            if cam is not None and f"image/{cam}" not in env_cameras:
                raise ConfigError(
                    f"policy.cameras maps the checkpoint's camera {slot} to env camera {cam!r}, which "
                    f"the env lacks (env.cameras: {have or 'none'}); add it to env.cameras or map the "
                    f"slot to null to mask it"
                )
        self.camera_slots = list(cameras)
        self.camera_sources = [None if cam is None else f"image/{cam}" for cam in cameras.values()]
        self.cameras = [c for c in self.camera_sources if c is not None]

    def bind_actions(
        self,
        action_dims: list[int] | None,
        action_scale: list[float] | None,
        stats_dims: int | None,
        max_action_dim: int,
    ) -> None:
        """Which of the model's action dims drive which env dims, with what factor (e.g. -1 for a gripper whose sign
        convention differs): `model_action_dim` real dims (the statistics', else the highest mapped + 1, else the
        env's), the rest padding. One line for a mapping that does not fit."""
        env_dim = self.env_spec.action_dim
        if action_dims is None:
            action_dims = list(range(env_dim))
            if stats_dims is not None and stats_dims < env_dim:
                raise ConfigError(
                    f"the checkpoint's actions have {stats_dims} dims, the env's {env_dim}: give "
                    f"policy.action_dims (a checkpoint dim for each env dim)"
                )
        if len(action_dims) != env_dim:
            raise ConfigError(
                f"policy.action_dims has {len(action_dims)} entries, the env's actions {env_dim} dims: "
                "give one checkpoint action dim per env dim"
            )
        model_dim = stats_dims if stats_dims is not None else max(max(action_dims) + 1, env_dim)
        bad = [i for i in action_dims if not 0 <= i < model_dim]
        if bad or model_dim > max_action_dim:
            raise ConfigError(
                f"policy.action_dims={list(action_dims)} names dims outside the checkpoint's "
                f"{min(model_dim, max_action_dim)} action dims (0..{min(model_dim, max_action_dim) - 1})"
            )
        scale = [1.0] * env_dim if action_scale is None else [float(x) for x in action_scale]
        if len(scale) != env_dim or 0.0 in scale:
            raise ConfigError(
                f"policy.action_scale={action_scale} must give one non-zero factor per env action dim ({env_dim})"
            )
        self.model_action_dim = model_dim
        identity = list(action_dims) == list(range(env_dim)) and model_dim == env_dim and set(scale) == {1.0}
        self._action_map = None if identity else (list(action_dims), scale)

    def normalize_state(self, state: torch.Tensor) -> torch.Tensor:
        """The env's state as the checkpoint reads it: the dims `policy.state_dims` picks, normalised."""
        if self.state_dims is not None:
            state = state[..., self.state_dims]
        return state if self.normalizer is None else self.normalizer.normalize("state", state).to(state.dtype)

    def to_env(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, model_action_dim) normalised actions -> (B, H, env action dims) as the env takes them."""
        if self.normalizer is not None:
            x = self.normalizer.unnormalize("action", x)
        if self._action_map is None:
            return x
        dims, scale = self._action_map
        return x[..., dims] * torch.tensor(scale, dtype=x.dtype, device=x.device)

    def from_env(self, actions: torch.Tensor) -> torch.Tensor:
        """Env actions (B, H, env dims) -> the model's normalised (B, H, model_action_dim); dims no env dim maps
        to are 0 (in the normalised space)."""
        a = actions.float()
        if self._action_map is not None:
            dims, scale = self._action_map
            out = a.new_zeros(*a.shape[:-1], self.model_action_dim)
            out[..., dims] = a / torch.tensor(scale, dtype=a.dtype, device=a.device)
            a = out
        if self.normalizer is None:
            return a
        z = self.normalizer.normalize("action", a)
        if self._action_map is not None:  # unmapped dims: 0 after normalisation too
            mapped = torch.zeros(self.model_action_dim, dtype=torch.bool, device=a.device)
            mapped[self._action_map[0]] = True
            z = torch.where(mapped, z, torch.zeros_like(z))
        return z

    @classmethod
    def checkpoint_defaults(cls, folder: Path, config: dict, keys: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The policy keys the user left unset, from the checkpoint folder: its tokenizer and statistics, the variant,
        chunk, steps and sizes its config.json records (lerobot's policy config, openpi's converter record), and the
        camera slots it was trained with. One line where the folder and an explicit setting disagree."""
        out = dict(kwargs)
        kind = config.get("type")
        variant = {"pi0": "pi0", "pi05": "pi05"}.get(kind) if kind else None
        if variant is None:  # openpi's converter does not record the variant: pi0.5 is the one with time_mlp_in
            variant = (
                "pi05" if any(k == "time_mlp_in.weight" or k.endswith(".time_mlp_in.weight") for k in keys) else "pi0"
            )
        if out.get("variant") not in (None, variant):
            raise ConfigError(
                f"policy.checkpoint={folder} is a {variant} checkpoint, policy.variant={out['variant']}: "
                f"drop policy.variant or set it to {variant}"
            )
        out["variant"] = variant
        if out.get("tokenizer") is None and find_tokenizer(folder) is not None:
            out["tokenizer"] = str(find_tokenizer(folder))
        if out.get("norm_stats") is None and find_norm_stats(folder) is not None:
            out["norm_stats"] = str(find_norm_stats(folder))
        if kind in ("pi0", "pi05") and out.get("prompt_style") is None:
            out["prompt_style"] = "lerobot"  # a lerobot policy folder: trained on lerobot's processors' prompts
        for ours, theirs in (
            ("chunk", "chunk_size"),
            ("chunk", "action_horizon"),
            ("denoise_steps", "num_inference_steps"),
        ):
            if out.get(ours) is None and config.get(theirs) is not None:
                out[ours] = int(config[theirs])
        dims = dict(out.get("dims") or {})
        for ours, theirs in (
            ("max_state_dim", "max_state_dim"),
            ("max_action_dim", "max_action_dim"),
            ("max_action_dim", "action_dim"),
            ("max_tokens", "tokenizer_max_length"),
        ):
            if theirs in config and ours not in dims:
                dims[ours] = int(config[theirs])
        for key in ("paligemma_variant", "action_expert_variant"):  # (policy.dims, when given, says the sizes)
            name = config.get(key)
            if name is not None and not out.get("dims") and (name not in GEMMA_VARIANTS or out.get("preset") != "full"):
                raise ConfigError(
                    f"policy.checkpoint={folder} has {key}={name}: build it with policy.preset=full"
                    if name in GEMMA_VARIANTS
                    else f"{folder}/config.json: {key}={name} is not a size openpi names "
                    f"({', '.join(GEMMA_VARIANTS)}); give its sizes in policy.dims"
                )
        out["dims"] = dims or None
        features = config.get("input_features") or {}
        slots = [k[len("observation.images.") :] for k in features if k.startswith("observation.images.")]
        if slots and not out.get("cameras"):
            raise ConfigError(
                f"policy.checkpoint={folder} was trained on cameras {', '.join(slots)}: map them to env "
                f"cameras, e.g. policy.cameras='{{{slots[0]}: agentview}}' (a slot mapped to null, or "
                "left out, is masked)"
            )
        if slots and out.get("cameras"):
            unknown = [s for s in out["cameras"] if s not in slots]
            if unknown:
                raise ConfigError(
                    f"policy.cameras names {', '.join(unknown)}, which the checkpoint has no slot for "
                    f"(its cameras: {', '.join(slots)})"
                )
            out["cameras"] = {s: out["cameras"].get(s) for s in slots}
        return out

    # --- the prefix ------------------------------------------------------------------------------
    def state_tokens(self, state: torch.Tensor) -> torch.Tensor:
        """pi0.5's discrete state: each dim clipped to [-1, 1] and binned into one of the vocabulary's last 256 ids."""
        bins = ((state.clamp(-1.0, 1.0) + 1.0) * (STATE_BINS / 2)).long().clamp(max=STATE_BINS - 1)
        return self.dims.vocab - STATE_BINS + bins

    def embed_prefix(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Image, language (and pi0.5's state) tokens (B, Lp, width) and which are real (B, Lp)."""
        weight = self.action_in_proj.weight
        device, dtype, d = weight.device, weight.dtype, self.dims
        state = self.normalize_state(obs["state"].to(device, torch.float32)).to(dtype)
        batch = state.shape[0]
        pali = self.paligemma_with_expert.paligemma.model
        parts, real = [], []
        if self.cameras:  # the slots an env camera fills; masked ones are left out (module docstring)
            images = camera_images(obs, self.cameras, d.image_size, dtype, device, pad=True)
            image_tokens = pali.multi_modal_projector(pali.vision_tower(images)).reshape(batch, -1, d.width)
            parts.append(image_tokens)
            real.append(torch.ones(batch, image_tokens.shape[1], dtype=torch.bool, device=device))
        tokens, token_mask = instruction_tokens(obs, self.tokenize, self.env_spec.instruction, batch, device)
        if self.variant == "pi05" and self.tokenizer is not None:
            tokens, token_mask = self.state_prompt_tokens(tokens, token_mask, state)
        elif self.variant == "pi05":
            tokens = torch.cat([tokens, self.state_tokens(state)], 1)
            token_mask = torch.cat([token_mask, torch.ones_like(state, dtype=torch.bool)], 1)
        parts.append(self.vlm.embed_tokens(tokens) * math.sqrt(d.width))
        real.append(token_mask)
        return torch.cat(parts, 1), torch.cat(real, 1)

    PREFIX = ("paligemma_with_expert.paligemma.",)

    def prefix(self, obs: dict[str, torch.Tensor]) -> tuple[PrefixCache, torch.Tensor]:
        """PaliGemma's part of `encode`: the prefix's per-layer K,V and real tokens, and its features pooled over
        them (B, width)."""
        emb, mask = self.embed_prefix(obs)
        positions = mask.long().cumsum(1) - 1
        (out,), kv = run_layers(
            [(emb, self.vlm.layers, None)], positions, mask[:, None, :].expand(-1, mask.shape[1], -1)
        )
        weights = mask[..., None].to(out.dtype)
        return PrefixCache(kv, mask), (self.vlm.final_norm(out) * weights).sum(1) / weights.sum(1)

    def encode(
        self, obs: dict[str, torch.Tensor], prefix: tuple[PrefixCache, torch.Tensor] | None = None
    ) -> tuple[PrefixCache, torch.Tensor]:
        """Run the prefix (or take it: `prefix`) and pi0's state token once: the cache every denoising step attends
        to, and the features (B, F) of the value head: the prefix pooled over its real tokens (+ pi0's state token
        output)."""
        cache, pooled = self.prefix(obs) if prefix is None else prefix
        if self.variant == "pi05":
            return cache, pooled
        # pi0's state token attends to the prefix and itself only: once per observation, then part of the cache
        kv, mask = cache.kv, cache.mask
        state = self.normalize_state(obs["state"].to(mask.device, torch.float32)).to(kv[0][0].dtype)
        token = self.state_proj(F.pad(state, (0, self.dims.max_state_dim - state.shape[-1])))[:, None]
        ones = torch.ones(mask.shape[0], 1, dtype=torch.bool, device=mask.device)
        (state_out,), state_kv = run_layers(
            [(token, self.expert.layers, None)], mask.sum(1, keepdim=True), torch.cat([mask, ones], 1)[:, None], past=kv
        )
        cache = PrefixCache(
            [(torch.cat([k, sk], 2), torch.cat([v, sv], 2)) for (k, v), (sk, sv) in zip(kv, state_kv)],
            torch.cat([mask, ones], 1),
        )
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
        mask = torch.cat(
            [
                real[:, None, :].expand(-1, horizon, -1),
                torch.ones(n, horizon, horizon, dtype=torch.bool, device=x.device),
            ],
            -1,
        )
        (out,), _ = run_layers([(emb, self.expert.layers, cond)], positions, mask, past=cache.kv)
        return self.expert.final_norm(out, cond), temb

    # --- checkpoints and initialisation -------------------------------------------------------------
    # lerobot's PI0Policy / PI05Policy keep openpi's PI0Pytorch as `model`
    LEROBOT_PREFIX = "model."
    # PaliGemma ties lm_head to embed_tokens, and safetensors' save_model (openpi's converter and trainer, lerobot's
    # save_pretrained) keeps one name of a shared tensor, the first in sorted order: lm_head's
    TIED = (
        "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight",
        "paligemma_with_expert.paligemma.lm_head.weight",
    )
    # transformers < 4.52 named PaliGemma's parts without the inner `model` (the lerobot/pi0 files of February 2025,
    # lerobot <= 0.3 fine-tunes); transformers' PaliGemmaForConditionalGeneration._checkpoint_conversion_mapping
    # renames them on load as these do, under openpi's `paligemma_with_expert.paligemma.`
    OLD_PALIGEMMA = tuple(
        (f"paligemma_with_expert.paligemma.{old}", f"paligemma_with_expert.paligemma.{new}")
        for old, new in (
            ("language_model.model.", "model.language_model."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
            ("language_model.lm_head.", "lm_head."),
        )
    )

    @classmethod
    def published_names(cls, state: dict[str, Any]) -> dict[str, Any]:
        """A pi0/pi0.5 file's tensors under openpi's PyTorch names (this policy's): lerobot's "model." prefix removed
        and transformers < 4.52's PaliGemma names renamed; nothing dropped or added."""
        if state and all(k.startswith(cls.LEROBOT_PREFIX) for k in state):
            state = {k[len(cls.LEROBOT_PREFIX) :]: v for k, v in state.items()}
        out = {}
        for key, value in state.items():
            old = next((pair for pair in cls.OLD_PALIGEMMA if key.startswith(pair[0])), None)
            out[key if old is None else old[1] + key[len(old[0]) :]] = value
        return out

    def import_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """A pi0/pi0.5 PyTorch checkpoint (openpi's names, lerobot's with a "model." prefix, or lerobot's first
        layout with transformers < 4.52's PaliGemma names: `published_names`) as this policy's state dict; the text
        heads are dropped (tied or unused: pi0 never decodes text) and, for a state-only env, the vision tower too.
        The RL heads may be missing."""
        state = self.published_names(state)
        embed, head = self.TIED
        if embed not in state and head in state:
            state = {**state, embed: state[head]}
        drop = ("paligemma_with_expert.paligemma.lm_head.", "paligemma_with_expert.gemma_expert.lm_head.")
        if not self.cameras:
            drop += (
                "paligemma_with_expert.paligemma.model.vision_tower.",
                "paligemma_with_expert.paligemma.model.multi_modal_projector.",
            )
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
        self.action_in_proj.weight[:, : self.model_action_dim].normal_(std=self.model_action_dim**-0.5)
