"""GR00T N1.5 (NVIDIA 2025, "GR00T N1: An Open Foundation Model for Generalist Humanoid Robots", arXiv 2503.14734,
and the N1.5 release: model GR00T-N1.5-3B) laid out like NVIDIA/Isaac-GR00T's modules.

- Backbone (`backbone.eagle_model`, Eagle 2.5 VLM): a SigLIP-2 ViT (27 layers, 1152 wide, 224 px / 14 px patches;
  the output of its last layer, before post_layernorm, as Eagle's vision select_layer=27 takes it), `mlp1` (one
  Linear 1152 -> 2048: N1.5's connector has no pixel shuffle, use_pixel_shuffle=false, mlp_connector_layers=1), a
  Qwen3-1.7B language model cut after select_layer=12 of its 28 layers (q/k RMSNorm per head, rope theta 1e6),
  causal over [image tokens, instruction tokens]; its final norm gives the backbone features.
- Action head (`action_head`): vlln (LayerNorm) and vl_self_attention (4 plain transformer blocks) over the VL
  features; per-embodiment state encoder, action encoder (W1, W2, W3 with a time encoding) and action decoder MLPs
  (CategorySpecific*: W (C, in, out), b (C, out), 32 embodiments at full size; the run-time slot is
  `policy.embodiment_id`, null = new_embodiment = 31, GR00T's EMBODIMENT_TAG_MAPPING); a 16-layer DiT (dit.py,
  adaLN on the time; even layers cross-attend to the VL features, odd layers self-attend; to_out.0 as diffusers
  names it; norm_out modulated by proj_out_1's (shift, scale)) over [state token, 32 learned future tokens, action
  tokens + position embedding]; 4 Euler steps, chunk 16.
- RL: a value head on the VL features pooled over their real tokens; flow.py's noise head and chain.
As lerobot 0.4.4's `groot` (GR00T N1.5) computes it, checked in float32 to ~1e-6 at a small size
(tests/policies/test_groot_parity.py): the time is GR00T's tau (0 = noise, 1 = data) discretised into 1000 buckets,
fed to diffusers' Timesteps (DiT) and the sinusoidal encoding (action encoder) as GR00T does; neither the
vl_self_attention nor the DiT's cross-attention masks anything (GR00T passes no mask: padded instruction tokens are
attended to); the action decoder's output is GR00T's velocity, data - noise. So the parameters load as NVIDIA's
release and lerobot's fine-tunes name and lay them out (`import_state_dict`).
Where FlowPolicy differs: its chain runs t = 1 noise -> t = 0 data with v = noise - a; `features` feeds the DiT
GR00T's bucket of tau = 1 - t and `velocity` negates the decoder's output, so flow.py stays the single convention
(its Euler step x - v/K is GR00T's x + v_GR00T/K). The contracting first policy (flow.py's init) is fitted in
flow.py's sign and stored negated; CategorySpecificLinear starts like nn.Linear, not GR00T's N(0, 0.02).
Simplified: the byte-level tokenizer (no Qwen3 tokenizer file is fetched) and no chat template (image tokens, then
the instruction); the backbone's attention masks padded instruction tokens (Eagle's, fed unpadded instructions, has
none to mask); no dropout; no FLARE loss; one embodiment per policy (GR00T picks one per batch row). The SigLIP
attention-pooling head, which N1.5 never runs, is not built, and Qwen3's lm_head is tied to embed_tokens (so
neither adds parameters; a file's copies of them are dropped on load, and a file that kept only the tied lm_head
gives embed_tokens from it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ebrl.config import ConfigError
from ebrl.envs.base import EnvSpec
from ebrl.policies.dit import BasicTransformerBlock, TimestepEncoder
from ebrl.policies.flow import FlowPolicy
from ebrl.policies.layers import (
    BYTE_VOCAB,
    DECODER_PROJECTIONS,
    DecoderLayer,
    RMSNorm,
    SiglipVisionModel,
    byte_tokenize,
    call_block,
    camera_images,
    instruction_tokens,
    rotary,
    run_layers,
)


@dataclass(frozen=True)
class GR00TDims:
    """The sizes of one preset."""

    image_size: int  # square input of the vision tower, pixels; camera images are resized to it
    patch_size: int
    vit_width: int
    vit_depth: int
    vit_mlp: int
    vit_heads: int
    width: int  # Qwen3 width = backbone_embedding_dim = cross_attention_dim of the DiT
    depth: int  # Qwen3 layers kept (select_layer)
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_tokens: int  # instruction tokens, padded or truncated to this
    vl_layers: int  # vl_self_attention blocks; their heads x head_dim = width
    vl_heads: int
    vl_head_dim: int
    dit_layers: int
    dit_heads: int  # DiT inner dim = dit_heads x dit_head_dim = input_embedding_dim
    dit_head_dim: int
    dit_output_dim: int
    hidden_size: int  # state encoder / action decoder hidden width
    future_tokens: int  # num_target_vision_tokens
    max_seq_len: int  # action position embeddings
    embodiments: int  # max_num_embodiments
    chunk: int  # actions per chunk (action_horizon)
    denoise_steps: int  # num_inference_timesteps
    max_action_dim: int  # env actions and states are zero-padded to these
    max_state_dim: int


PRESETS: dict[str, GR00TDims] = {
    "tiny": GR00TDims(
        image_size=32,
        patch_size=8,
        vit_width=32,
        vit_depth=1,
        vit_mlp=64,
        vit_heads=2,
        width=64,
        depth=1,
        mlp=128,
        heads=4,
        kv_heads=2,
        head_dim=16,
        vocab=BYTE_VOCAB,
        max_tokens=48,
        vl_layers=1,
        vl_heads=2,
        vl_head_dim=32,
        dit_layers=2,
        dit_heads=2,
        dit_head_dim=24,
        dit_output_dim=48,
        hidden_size=48,
        future_tokens=4,
        max_seq_len=32,
        embodiments=1,
        chunk=8,
        denoise_steps=4,
        max_action_dim=32,
        max_state_dim=128,
    ),
    "small": GR00TDims(
        image_size=64,
        patch_size=8,
        vit_width=128,
        vit_depth=3,
        vit_mlp=512,
        vit_heads=4,
        width=192,
        depth=3,
        mlp=576,
        heads=4,
        kv_heads=2,
        head_dim=48,
        vocab=BYTE_VOCAB,
        max_tokens=48,
        vl_layers=1,
        vl_heads=4,
        vl_head_dim=48,
        dit_layers=4,
        dit_heads=4,
        dit_head_dim=32,
        dit_output_dim=128,
        hidden_size=128,
        future_tokens=8,
        max_seq_len=64,
        embodiments=1,
        chunk=16,
        denoise_steps=4,
        max_action_dim=32,
        max_state_dim=128,
    ),
    # GR00T-N1.5-3B's config.json (NVIDIA/Isaac-GR00T n1.5 release): Eagle 2.5 = SigLIP-2 So400m/14 at 224 px + mlp1 +
    # Qwen3-1.7B (2048 wide, 16 heads / 8 kv heads x 128, mlp 6144, vocab 151680) cut at select_layer=12; action head:
    # vl_self_attention 4 x (32 x 64), DiT 16 x (32 heads x 48 = 1536), cross_attention_dim 2048, output_dim 1024,
    # hidden_size 1024, input_embedding_dim 1536, max_state_dim 64, action_dim 32, action_horizon 16, 4 inference
    # steps, 32 future tokens, max_seq_len 1024, max_num_embodiments 32 (the config class default).
    # Parameters: 2.40B, not the 3B of the name; see PUBLISHED_PARAMETERS.
    "full": GR00TDims(
        image_size=224,
        patch_size=14,
        vit_width=1152,
        vit_depth=27,
        vit_mlp=4304,
        vit_heads=16,
        width=2048,
        depth=12,
        mlp=6144,
        heads=16,
        kv_heads=8,
        head_dim=128,
        vocab=151680,
        max_tokens=48,
        vl_layers=4,
        vl_heads=32,
        vl_head_dim=64,
        dit_layers=16,
        dit_heads=32,
        dit_head_dim=48,
        dit_output_dim=1024,
        hidden_size=1024,
        future_tokens=32,
        max_seq_len=1024,
        embodiments=32,
        chunk=16,
        denoise_steps=4,
        max_action_dim=32,
        max_state_dim=64,
    ),
}


# --- backbone ----------------------------------------------------------------------------------
class Qwen3DecoderLayer(DecoderLayer):
    """A Llama-style decoder layer (layers.DecoderLayer, norm="llama") plus Qwen3's RMSNorm per head on q and k
    (self_attn.q_norm, self_attn.k_norm), eps 1e-6 and rope theta 1e6."""

    def __init__(
        self, width: int, mlp: int, heads: int, kv_heads: int, head_dim: int, rope_theta: float = 1e6, eps: float = 1e-6
    ) -> None:
        super().__init__(width, mlp, heads, kv_heads, head_dim, norm="llama")
        self.rope_theta = rope_theta
        self.input_layernorm.eps = self.post_attention_layernorm.eps = eps
        self.self_attn.q_norm = RMSNorm(head_dim, eps, offset=False)
        self.self_attn.k_norm = RMSNorm(head_dim, eps, offset=False)

    def qkv(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cond: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.input_layernorm(x)
        attn = self.self_attn
        q, k, v = (
            proj(h).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        q, k = attn.q_norm(q), attn.k_norm(k)
        return rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta), v


class Qwen3Model(nn.Module):
    """transformers' Qwen3Model names: embed_tokens, layers, norm (lm_head is tied to embed_tokens and unused)."""

    def __init__(self, d: GR00TDims) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(d.vocab, d.width)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(d.width, d.mlp, d.heads, d.kv_heads, d.head_dim) for _ in range(d.depth)
        )
        self.norm = RMSNorm(d.width, 1e-6, offset=False)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, d: GR00TDims) -> None:
        super().__init__()
        self.model = Qwen3Model(d)


class EagleModel(nn.Module):
    """Eagle 2.5's modules: vision_model (SigLIP), mlp1 (connector), language_model (Qwen3)."""

    def __init__(self, d: GR00TDims, cameras: bool) -> None:
        super().__init__()
        if cameras:  # a state-only env has no vision tower
            self.vision_model = SiglipVisionModel(
                d.image_size, d.patch_size, d.vit_width, d.vit_depth, d.vit_mlp, d.vit_heads
            )
            self.mlp1 = nn.Sequential(nn.Linear(d.vit_width, d.width))
        self.language_model = Qwen3ForCausalLM(d)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, S, S) in [-1, 1] -> (N, patches, width): the last ViT layer's output (Eagle's vision select_layer
        takes it before post_layernorm) through mlp1."""
        vm = self.vision_model.vision_model
        x = vm.embeddings(images)
        for layer in vm.encoder.layers:
            x = call_block(layer, layer, x)
        return self.mlp1(x)


class EagleBackbone(nn.Module):
    def __init__(self, d: GR00TDims, cameras: bool) -> None:
        super().__init__()
        self.eagle_model = EagleModel(d, cameras)


# --- action head -------------------------------------------------------------------------------
TIME_BUCKETS = 1000  # GR00T's num_timestep_buckets
NEW_EMBODIMENT = 31  # GR00T's EMBODIMENT_TAG_MAPPING["new_embodiment"] (lerobot's groot processor: the same)


# GR00T's EMBODIMENT_TAG_MAPPING as lerobot 0.4.4's groot processor names the embodiments (embodiment_tag)
EMBODIMENT_TAGS = {
    "new_embodiment": NEW_EMBODIMENT,
    "oxe_droid": 17,
    "agibot_genie1": 26,
    "gr1": 24,
    "so100": 2,
    "unitree_g1": 3,
}


def run_embodiment(d: "GR00TDims", embodiment_id: int | None) -> int:
    """The embodiment slot a policy runs: `policy.embodiment_id`, or null for "new_embodiment", GR00T's last projector
    slot, the one fine-tunes train (the last there is in a preset with fewer)."""
    if embodiment_id is None:
        return NEW_EMBODIMENT if d.embodiments > NEW_EMBODIMENT else d.embodiments - 1
    return embodiment_id


def time_buckets(t: torch.Tensor) -> torch.Tensor:
    """FlowPolicy times t (1 = noise) -> GR00T's discrete timesteps (float, integer-valued): floor(tau x 1000) of its
    time tau = 1 - t (0 = noise). GR00T's inference takes int(k / K x 1000) at step k; t = 1 - k/K in float32 can put
    (1 - t) x 1000 a hair under that integer (K = 5: 199.99998), so a 1e-3 bucket margin goes before the floor."""
    tau = 1.0 - t.double()
    return (tau * TIME_BUCKETS + 1e-3).floor().clamp(0, TIME_BUCKETS).float()


def sinusoid_encoding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """GR00T's action-encoder SinusoidalPositionalEncoding of timesteps (N,) -> (N, dim), float32 as it computes it:
    frequencies 10000^(-i / (dim/2)), [sin, cos]."""
    half = dim // 2
    exponent = -torch.arange(half, dtype=torch.float32, device=timesteps.device) * (math.log(10000.0) / half)
    angles = timesteps.float()[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], -1)


class EmbodimentLinear:
    """One embodiment's slice of a CategorySpecificLinear seen as a Linear (weight (out, in) = W[e].T, bias = b[e],
    views: writes go to W and b), for FlowPolicy's `velocity_out`. Not a module: it owns no parameters."""

    def __init__(self, layer: "CategorySpecificLinear", embodiment: int) -> None:
        self.layer, self.embodiment = layer, embodiment

    @property
    def weight(self) -> torch.Tensor:
        return self.layer.W[self.embodiment].T

    @property
    def bias(self) -> torch.Tensor:
        return self.layer.b[self.embodiment]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, self.embodiment)


class CategorySpecificLinear(nn.Module):
    """One linear map per embodiment, as GR00T keeps them: W (C, in, out), b (C, out); x @ W[e] + b[e] for the
    run-time embodiment e. Initialised like nn.Linear (uniform +-1/sqrt(in)), not GR00T's N(0, 0.02) W and zero b:
    from scratch it gives the contracting first policy a better fit (a checkpoint overwrites either)."""

    def __init__(self, num_categories: int, input_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_categories = num_categories
        self.W = nn.Parameter(torch.empty(num_categories, input_dim, hidden_dim))
        self.b = nn.Parameter(torch.empty(num_categories, hidden_dim))
        if not self.W.is_meta:
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = self.W.shape[1] ** -0.5
        nn.init.uniform_(self.W, -bound, bound)
        nn.init.uniform_(self.b, -bound, bound)

    def forward(self, x: torch.Tensor, embodiment: int) -> torch.Tensor:
        return F.linear(x, self.W[embodiment].T, self.b[embodiment])


class CategorySpecificMLP(nn.Module):
    def __init__(self, num_categories: int, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, input_dim, hidden_dim)
        self.layer2 = CategorySpecificLinear(num_categories, hidden_dim, output_dim)

    def hidden(self, x: torch.Tensor, embodiment: int) -> torch.Tensor:
        return F.relu(self.layer1(x, embodiment))

    def forward(self, x: torch.Tensor, embodiment: int) -> torch.Tensor:
        return self.layer2(self.hidden(x, embodiment), embodiment)


class MultiEmbodimentActionEncoder(nn.Module):
    """Noisy actions and GR00T's timestep bucket -> action tokens: W3(swish(W2([W1 a, sinusoid(bucket)])))."""

    def __init__(self, action_dim: int, hidden_size: int, num_embodiments: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.W1 = CategorySpecificLinear(num_embodiments, action_dim, hidden_size)
        self.W2 = CategorySpecificLinear(num_embodiments, 2 * hidden_size, hidden_size)
        self.W3 = CategorySpecificLinear(num_embodiments, hidden_size, hidden_size)

    def forward(self, actions: torch.Tensor, timesteps: torch.Tensor, embodiment: int) -> torch.Tensor:
        a = self.W1(actions, embodiment)
        tau_emb = sinusoid_encoding(timesteps, self.hidden_size).to(a.dtype)[:, None].expand_as(a)
        return self.W3(F.silu(self.W2(torch.cat([a, tau_emb], -1), embodiment)), embodiment)


class DiT(nn.Module):
    """GR00T's DiT: timestep_encoder (diffusers' Timesteps of the time bucket, then an MLP), transformer_blocks
    (adaLN on the time; attn1 cross-attends to the VL features in even blocks, self-attends in odd ones:
    interleave_self_attention), then norm_out (no affine) modulated by proj_out_1's (shift, scale) and proj_out_2."""

    def __init__(self, d: GR00TDims) -> None:
        super().__init__()
        inner = d.dit_heads * d.dit_head_dim
        self.timestep_encoder = TimestepEncoder(inner, sinusoid="diffusers")
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(
                inner,
                d.dit_heads,
                d.dit_head_dim,
                norm_type="ada_norm",
                out_list=True,
                cross_attention_dim=d.width if i % 2 == 0 else None,
                attn1_cross=i % 2 == 0,
            )
            for i in range(d.dit_layers)
        )
        self.norm_out = nn.LayerNorm(inner, eps=1e-6, elementwise_affine=False)
        self.proj_out_1 = nn.Linear(inner, 2 * inner)
        self.proj_out_2 = nn.Linear(inner, d.dit_output_dim)

    def output(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, -1)
        return self.proj_out_2(self.norm_out(h) * (1 + scale[:, None]) + shift[:, None])


class VLSelfAttention(nn.Module):
    def __init__(self, d: GR00TDims) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(d.width, d.vl_heads, d.vl_head_dim, norm_type="layer_norm", out_list=True)
            for _ in range(d.vl_layers)
        )


class FlowmatchingActionHead(nn.Module):
    def __init__(self, d: GR00TDims) -> None:
        super().__init__()
        inner = d.dit_heads * d.dit_head_dim  # = input_embedding_dim
        self.model = DiT(d)
        self.state_encoder = CategorySpecificMLP(d.embodiments, d.max_state_dim, d.hidden_size, inner)
        self.action_encoder = MultiEmbodimentActionEncoder(d.max_action_dim, inner, d.embodiments)
        # GR00T's decoder reads hidden_size features: its DiT's output_dim must be hidden_size (1024 in N1.5)
        assert d.dit_output_dim == d.hidden_size, "dit_output_dim must equal hidden_size"
        self.action_decoder = CategorySpecificMLP(d.embodiments, d.hidden_size, d.hidden_size, d.max_action_dim)
        self.future_tokens = nn.Embedding(d.future_tokens, inner)
        nn.init.normal_(self.future_tokens.weight, std=0.02)
        self.vlln = nn.LayerNorm(d.width)
        self.vl_self_attention = VLSelfAttention(d)
        self.position_embedding = nn.Embedding(d.max_seq_len, inner)
        nn.init.normal_(self.position_embedding.weight, std=0.02)


# --- the policy --------------------------------------------------------------------------------
class GR00TPolicy(FlowPolicy):
    """GR00T N1.5 with a value head; sample/evaluate give the denoising chain's log-probs (see flow.py)."""

    # No exact total is published for GR00T N1.5: "3B" is the name (nvidia/GR00T-N1.5-3B; Hugging Face shows the
    # checkpoint's size rounded to "3B params"). The shapes its config.json publishes add up to 2.40B (hand count):
    # SigLIP-2 412.4M + mlp1 2.4M + Qwen3 cut at layer 12 914.7M (embed_tokens 310.6M, 12 x 50.3M layers)
    # = VLM 1.330B; action head 1.069B = DiT 550.4M + vl_self_attention 201.4M + 32-embodiment state encoder 52.5M,
    # action encoder 228.2M, action decoder 34.6M + future tokens, position embedding, vlln 1.6M. The name is 20%
    # above that and matches no count of these modules (the untruncated 28-layer Qwen3 would give 3.2B). Counted the
    # same way, N1's VLM (SigLIP-2, its connector, SmolLM2-1.7B cut at layer 12) is ~1.33B, as the N1 paper's 1.34B
    # (arXiv 2503.14734; GR00T-N1-2B: 2.2B in all, the Hugging Face checkpoint 2.19B): N1 was named by its count.
    # The full preset adds the RL heads (value, noise std: 4.8M).
    PUBLISHED_PARAMETERS = {
        "default": (
            2.40e9,
            "GR00T-N1.5-3B config.json (huggingface.co/nvidia/GR00T-N1.5-3B, NVIDIA/Isaac-GR00T "
            "n1.5): its shapes give 2.40B = Eagle 2.5 VLM cut at LLM layer 12 (1.33B) + action head "
            "(1.07B); the '3B' of the name is 20% above and is no count of these modules",
        ),
    }

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
        embodiment_id: int | None = None,
    ) -> None:
        super().__init__()
        d = self.dims = self.bind(PRESETS, preset, env_spec)
        chunk = chunk or d.chunk
        if chunk > d.max_seq_len:
            raise ConfigError(f"policy.chunk={chunk} is more than the preset's {d.max_seq_len} action positions")
        embodiment_id = run_embodiment(d, embodiment_id)
        if not 0 <= embodiment_id < d.embodiments:
            raise ConfigError(
                f"policy.embodiment_id={embodiment_id} is not one of the preset's {d.embodiments} "
                f"embodiment slots (0..{d.embodiments - 1}); null picks new_embodiment"
            )
        self.embodiment = embodiment_id
        self._flow_sign = False  # True only while flow.py's init fits velocity_out in its own sign
        self.backbone = EagleBackbone(d, bool(self.cameras))
        self.action_head = FlowmatchingActionHead(d)
        inner = d.dit_heads * d.dit_head_dim
        self.init_flow(
            flow_dim=d.max_action_dim,
            chunk_len=chunk,
            denoise_steps=denoise_steps or d.denoise_steps,
            feature_dim=d.hidden_size,
            time_dim=inner,
            logprob=logprob,
            noise_std_min=noise_std_min,
            noise_std_max=noise_std_max,
            sde_noise_level=sde_noise_level,
            chain_logprob=chain_logprob,
            detach_critic_input=detach_critic_input,
        )
        self.value_head = nn.Sequential(nn.Linear(d.width, d.hidden_size), nn.Tanh(), nn.Linear(d.hidden_size, 1))
        if not self.action_head.future_tokens.weight.is_meta:
            self._prepare_contracting_init()
            self.init_contracting_velocity()

    @property
    def velocity_out(self) -> nn.Linear:  # type: ignore[override]
        """The run-time embodiment's last action-decoder layer (a view of layer2's W and b): its output is GR00T's
        velocity, data - noise, which `velocity` negates into FlowPolicy's noise - data."""
        return EmbodimentLinear(self.action_head.action_decoder.layer2, self.embodiment)  # type: ignore[return-value]

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FlowPolicy's velocity (t = 1 noise -> 0 data, v = noise - a): minus GR00T's action-head output at its
        time 1 - t; the noise head (flow_noise) reads the same features."""
        v, log_std = super().velocity(x, t, cond)
        return (v if self._flow_sign else -v), log_std

    @torch.no_grad()
    def init_contracting_velocity(self, *args, **kwargs) -> None:
        """flow.py's fit of velocity_out, made in FlowPolicy's sign, then stored in GR00T's (negated)."""
        self._flow_sign = True
        try:
            super().init_contracting_velocity(*args, **kwargs)
        finally:
            self._flow_sign = False
        out = self.velocity_out
        out.weight.neg_()
        out.bias.neg_()

    @property
    def language_model(self) -> Qwen3Model:
        return self.backbone.eagle_model.language_model.model

    def action_expert(self) -> list[str]:
        """The whole action head (vlln, vl_self_attention, the DiT and the per-embodiment MLPs)."""
        return ["action_head."]

    def lora_targets(self) -> str:
        """The cut Qwen3's layers (the vision tower stays frozen)."""
        return r"backbone\.eagle_model\.language_model\.model\.layers" + DECODER_PROJECTIONS

    def tokenize(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Byte-level: BOS, then UTF-8 bytes + 3; padded/truncated to the preset's max_tokens."""
        return byte_tokenize(texts, self.dims.max_tokens)

    # --- checkpoints ----------------------------------------------------------------------------------
    LEROBOT_PREFIX = "_groot_model."  # lerobot's GrootPolicy keeps GR00TN15 as this attribute
    UNUSED = (
        "backbone.eagle_model.language_model.lm_head.",  # tied to embed_tokens; N1.5 reads hidden states
        "backbone.eagle_model.vision_model.vision_model.head.",
    )  # SigLIP's pooling head, never run by N1.5

    # Qwen3's lm_head is tied to embed_tokens in N1.5's config, and a lerobot fine-tune of a tied model, written by
    # safetensors' save_model, keeps one name of the shared tensor, the first in sorted order: lm_head's
    TIED = (
        "backbone.eagle_model.language_model.model.embed_tokens.weight",
        "backbone.eagle_model.language_model.lm_head.weight",
    )

    @classmethod
    def published_names(cls, state: dict[str, Any]) -> dict[str, Any]:
        """A GR00T file's tensors under GR00TN15's own names (lerobot's `_groot_model.` prefix removed)."""
        return {key.removeprefix(cls.LEROBOT_PREFIX): value for key, value in state.items()}

    def import_state_dict(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """NVIDIA's release (GR00TN15's own names: backbone.eagle_model.*, action_head.*, as its save_pretrained
        shards them) and lerobot's fine-tunes (the same under `_groot_model.`) load as they are: our modules carry
        GR00T's names, W/b layouts and velocity sign; a file with only the tied lm_head gives embed_tokens from it.
        Dropped: what N1.5 never runs (lm_head, SigLIP's pooling head) and, in a state-only env (no vision tower
        built), the vision tower and mlp1. The RL heads may be missing."""
        state = self.published_names(state)
        embed, head = self.TIED
        if embed not in state and head in state:
            state = {**state, embed: state[head]}
        own = self.state_dict()
        vision = ("backbone.eagle_model.vision_model.", "backbone.eagle_model.mlp1.")
        out = {}
        for key, value in state.items():
            if key not in own and (key.startswith(self.UNUSED) or (not self.cameras and key.startswith(vision))):
                continue
            out[key] = value
        return out, self.rl_heads()

    # --- backbone and the per-observation part of the head ------------------------------------------
    def vl_features(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Eagle: [image tokens, instruction tokens] through the cut Qwen3, causal; (B, L, width) and real (B, L)."""
        weight = self.action_head.future_tokens.weight
        device, dtype, d = weight.device, weight.dtype, self.dims
        batch = obs["state"].shape[0]
        images = camera_images(obs, self.cameras, d.image_size, dtype, device) if self.cameras else None
        tokens, token_mask = instruction_tokens(obs, self.tokenize, self.env_spec.instruction, batch, device)
        return self.backbone_features(images, tokens, token_mask)

    def backbone_features(
        self,
        images: torch.Tensor | None,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GR00T's backbone_features (B, L, width) and real (B, L) of images (B x cameras, 3, S, S) in [-1, 1] (None:
        no cameras) and instruction tokens (B, T): Eagle's language model over [image tokens, instruction tokens],
        the hidden state after its last kept layer (select_layer) through its final norm."""
        batch, device, d = tokens.shape[0], tokens.device, self.dims
        eagle = self.backbone.eagle_model
        parts, real = [], []
        if images is not None:
            image_tokens = eagle.image_features(images).reshape(batch, -1, d.width)
            parts.append(image_tokens)
            real.append(torch.ones(batch, image_tokens.shape[1], dtype=torch.bool, device=device))
        parts.append(self.language_model.embed_tokens(tokens))
        real.append(token_mask)
        emb, mask = torch.cat(parts, 1), torch.cat(real, 1)
        length = mask.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        (out,), _ = run_layers([(emb, self.language_model.layers, None)], positions, causal & mask[:, None, :])
        return self.language_model.norm(out), mask

    PREFIX = ("backbone.",)

    def prefix(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The Eagle backbone's part of `encode`: its features (B, L, width) and real tokens (B, L)."""
        return self.vl_features(obs)

    def encode(
        self, obs: dict[str, torch.Tensor], prefix: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[dict, torch.Tensor]:
        """Once per observation: the backbone features (or `prefix`, computed before), then `encode_features`."""
        vl, mask = self.prefix(obs) if prefix is None else prefix
        return self.encode_features(vl, mask, obs["state"])

    def encode_features(self, vl: torch.Tensor, mask: torch.Tensor, state: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """GR00T's process_backbone_output and state encoding: the backbone features (B, L, width) through vlln and
        vl_self_attention (unmasked, as GR00T runs them), their keys/values for every cross-attending DiT block, and
        the state token of the env state (B, S), zero-padded to max_state_dim; the value head's features are the
        VL features pooled over the real tokens (mask (B, L))."""
        head = self.action_head
        vl = head.vlln(vl)
        for block in head.vl_self_attention.transformer_blocks:
            vl, _ = call_block(block, block, vl)
        weights = mask[..., None].to(vl.dtype)
        pooled = (vl * weights).sum(1) / weights.sum(1)
        state = state.to(vl.device, vl.dtype)
        state = F.pad(state, (0, self.dims.max_state_dim - state.shape[-1]))
        cond = {
            "state": head.state_encoder(state, self.embodiment)[:, None],
            "cross_kv": [block.cross_kv(vl) for block in head.model.transformer_blocks],
        }
        return cond, pooled

    def features(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The action decoder's hidden layer (N, H, hidden_size) for noisy chunks x at FlowPolicy times t, and the
        DiT's time embedding (N, inner). cond may be that of N / r observations, r chains each (`layers.attention`)."""
        head, dit = self.action_head, self.action_head.model
        buckets = time_buckets(t)  # GR00T's time: 0 = noise, 1000 = data (module docstring)
        temb = dit.timestep_encoder(buckets)
        horizon = x.shape[1]
        actions = head.action_encoder(x, buckets, self.embodiment) + head.position_embedding.weight[:horizon]
        future = head.future_tokens.weight.expand(x.shape[0], -1, -1)
        state = cond["state"].repeat_interleave(x.shape[0] // cond["state"].shape[0], 0)
        h = torch.cat([state.to(actions.dtype), future.to(actions.dtype), actions], 1)
        for block, kv in zip(dit.transformer_blocks, cond["cross_kv"]):
            h, _ = call_block(block, block, h, temb, context_kv=kv)  # no mask: GR00T's cross-attention has none
        h = dit.output(h[:, -horizon:], temb)
        return head.action_decoder.hidden(h, self.embodiment), temb

    # --- initialisation ----------------------------------------------------------------------------
    @torch.no_grad()
    def _prepare_contracting_init(self) -> None:
        # The DiT's attention outputs start at zero, so the action tokens' residual stream carries the action
        # encoder's output and x is readable by the decoder (init_contracting_velocity fits its last layer); like a
        # PPO actor's near-zero last layer the first policy is the same for every obs, and the attention outputs get
        # gradients and learn to read the VL features and the state. W1 reads only the env's dims, at unit gain.
        for block in self.action_head.model.transformer_blocks:
            block.attn1.to_out[0].weight.zero_()
            block.attn1.to_out[0].bias.zero_()
        w1 = self.action_head.action_encoder.W1.W[self.embodiment]  # (in, out)
        w1.zero_()
        w1[: self.action_dim].normal_(std=self.action_dim**-0.5)
