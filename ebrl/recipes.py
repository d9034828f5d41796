"""Where the training defaults come from: a published recipe for a full-size policy on its benchmark, this
repository's own tuning for the tiny and small presets.

Each default the recipe sets is an interpolation in the schema (`algo.lr: ${recipe:lr}`), resolved when it is read
from the composed config's policy (family, variant, preset), env and algo; a value given on the command line or in a
yaml replaces it. The full-size recipes are RLinf's configs for these models (RLinf commit a3816b5,
examples/embodiment/config/), which are also the released configs of piRL (Chen et al. 2025, "piRL: Online RL
Fine-tuning for Flow-based Vision-Language-Action Models", arXiv:2510.25889), the pi0 and pi0.5 LIBERO and ManiSkill
results (57.6% -> 97.6% for few-shot pi0 on LIBERO).

What they set and we follow: the actor's and the critic's learning rates (RLinf's `value_lr` is the value head's
AdamW group), AdamW's betas, eps and weight decay, the ratio clip (low and high) and its dual clip, the value clip with
a Huber loss and the critic loss at weight 1, the entropy bonus, epochs per rollout, the gradient clip, the batch per
optimizer step and per forward pass, the log-prob a ratio is taken over (a chunk's executed actions), the actions of
each chunk executed before the next is sampled, the critic reading detached features, the critic's warm-up, and the
flow families' exploration: the chain's noise, where it enters and which steps enter the log-prob, and the denoising
steps in RL. docs/use/recipes.md lists every key of those files with ours beside it, or why there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

RLINF = "RLinf a3816b5 examples/embodiment/config/"


@dataclass(frozen=True)
class Recipe:
    """The defaults one recipe gives; `source` names the file they were read from."""

    source: str
    lr: float
    critic_lr: float
    epochs: int
    clip: float = 0.2
    clip_high: Optional[float] = None  # null: clip (a symmetric clip)
    value_clip: Optional[float] = 0.2
    huber_delta: Optional[float] = 10.0
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    weight_decay: float = 0.01  # RLinf's AdamW default where a config sets none
    logprob: str = "flow_sde"
    sde_noise_level: float = 0.5
    noise_std_min: float = 0.08  # RLinf's OpenPi0Config noise_logvar_range (Flow-Noise's std bounds)
    noise_std_max: float = 0.16
    # RLinf's non-joint Flow-SDE: noise enters one random denoising step per chunk, whose density is the log-prob
    # (joint_logprob False); its joint Flow-Noise: every step, the log-prob their mean with x_0's (True)
    chain_logprob: str = "one_step"
    denoise_steps: Optional[int] = 4  # num_steps in RL (and RLinf's evaluation); null: the checkpoint's
    execute: Optional[int] = 5  # num_action_chunks: actions of each chunk the env executes; null: the whole chunk
    logprob_level: str = "chunk"  # logprob_type: a ratio per chunk (its executed actions' log-probs summed)
    detach_critic_input: bool = True  # the value head's input carries no gradient into the model
    value_coef: float = 1.0  # RLinf adds the critic loss to the actor's
    dual_clip: Optional[float] = 3.0  # clip_ratio_c: a negative advantage's ratio counts at most this much
    global_batch: Optional[int] = 2048  # global_batch_size: chunk steps per optimizer step, over all ranks
    micro_batch: Optional[int] = 128  # micro_batch_size: rows per forward/backward pass
    critic_warmup: int = 0  # critic_warmup_steps


# tiny and small: this repository's tuning on CPU (the learning figures of docs/results/results.md); 3e-4 gave approx
# KL > 1 per update on tiny, 1e-4 learns
OWN = Recipe(
    source="ebrl's tuning of the tiny preset (docs/results/results.md)",
    lr=1e-4,
    critic_lr=1e-4,
    epochs=4,
    value_clip=None,
    huber_delta=None,
    adam_betas=(0.9, 0.999),
    adam_eps=1e-5,
    weight_decay=0.0,
    logprob="flow_noise",
    noise_std_min=0.1,
    noise_std_max=0.5,
    chain_logprob="sum",
    denoise_steps=None,
    execute=None,
    logprob_level="action",
    detach_critic_input=False,
    value_coef=0.5,
    dual_clip=None,
    global_batch=None,
    micro_batch=None,
    critic_warmup=2,
)

_PI0_LIBERO = dict(lr=5e-6, critic_lr=1e-4)  # pi0 and pi0.5 on LIBERO, GR00T on LIBERO, pi0 on RoboCasa
# pi0.5's LIBERO configs: 3 denoising steps, its value head after the VLM with detach_critic_input unset (model/pi0_5)
_PI05_LIBERO = dict(_PI0_LIBERO, denoise_steps=3, detach_critic_input=False)
_MANISKILL = dict(
    lr=7.91e-6,
    critic_lr=1.55e-4,
    entropy_coef=0.005,
    logprob="flow_noise",
    chain_logprob="mean",
    global_batch=5120,
    micro_batch=32,
)
_OFT = dict(clip_high=0.28, adam_betas=(0.9, 0.999))

# (model, env, algo) -> the recipe; model is pi0 | pi05 | gr00t | openvla_oft
RECIPES: dict[tuple[str, str, str], Recipe] = {
    ("pi0", "libero", "ppo"): Recipe(RLINF + "libero_spatial_ppo_openpi.yaml", epochs=4, **_PI0_LIBERO),
    ("pi0", "libero", "grpo"): Recipe(RLINF + "libero_spatial_grpo_openpi.yaml", epochs=2, **_PI0_LIBERO),
    ("pi05", "libero", "ppo"): Recipe(RLINF + "libero_spatial_ppo_openpi_pi05.yaml", epochs=1, **_PI05_LIBERO),
    ("pi05", "libero", "grpo"): Recipe(RLINF + "libero_spatial_grpo_openpi_pi05.yaml", epochs=1, **_PI05_LIBERO),
    # pi0 on ManiSkill takes a ratio per action dim (logprob_type token_level), which ours do not give: per action
    ("pi0", "maniskill", "ppo"): Recipe(
        RLINF + "maniskill_ppo_openpi.yaml", epochs=4, logprob_level="action", **_MANISKILL
    ),
    ("pi05", "maniskill", "ppo"): Recipe(
        RLINF + "maniskill_ppo_openpi_pi05.yaml", epochs=5, detach_critic_input=False, **_MANISKILL
    ),
    ("pi0", "robocasa", "ppo"): Recipe(
        RLINF + "robocasa_closedrawer_ppo_openpi.yaml", epochs=4, denoise_steps=5, **_PI0_LIBERO
    ),
    ("gr00t", "libero", "ppo"): Recipe(
        RLINF + "libero_spatial_ppo_gr00t.yaml", epochs=4, global_batch=1024, **_PI0_LIBERO
    ),
    # RLinf's OFT samples discrete action tokens at a temperature, ours a Gaussian around its L1 head: the optimiser
    # and clip settings carry over; update_epoch is unset there (RLinf's default, 1)
    # and a ratio per action token (token_level), ours per action; OFT executes its whole 8-action chunk
    ("openvla_oft", "libero", "grpo"): Recipe(
        RLINF + "libero_spatial_grpo_openvlaoft.yaml",
        lr=2e-5,
        critic_lr=3e-3,
        epochs=1,
        execute=None,
        logprob_level="action",
        global_batch=16384,
        micro_batch=32,
        **_OFT,
    ),
    ("openvla_oft", "maniskill", "ppo"): Recipe(
        RLINF + "maniskill_ppo_openvlaoft.yaml",
        lr=1e-4,
        critic_lr=3e-3,
        epochs=1,
        max_grad_norm=10.0,
        execute=None,
        logprob_level="action",
        global_batch=640,
        micro_batch=40,
        **_OFT,
    ),
}

# where no recipe is published: the nearest that is, and why
NEAREST_ENV = {"robosuite": "libero"}  # LIBERO is robosuite's Panda with the same OSC delta-pose control
NEAREST_MODEL = {"wam": "pi0"}  # a flow-matching action head on a video-language backbone, as pi0's


def recipe_for(policy: str, variant: Optional[str], preset: str, env: str, algo: str) -> tuple[Recipe, str]:
    """The recipe of a run and a line saying which it is (and what stood in for what it lacks)."""
    if preset != "full":
        return OWN, f"{OWN.source} (policy.preset={preset})"
    model = (variant or "pi0") if policy == "openpi" else policy
    notes = []
    if model in NEAREST_MODEL:
        notes.append(f"{model} has none published: {NEAREST_MODEL[model]}'s")
        model = NEAREST_MODEL[model]
    if env in NEAREST_ENV:
        notes.append(f"{env} has none published: {NEAREST_ENV[env]}'s")
        env = NEAREST_ENV[env]
    key = (model, env, algo)
    if key not in RECIPES:
        near = [k for k in RECIPES if k[:2] == (model, env)] or [
            k for k in RECIPES if k[0] == model and k[1] == "libero"
        ]
        if not near:  # (every model has a LIBERO recipe; a policy family added later may not)
            return OWN, f"{OWN.source} (no published recipe for {policy} at full size)"
        notes.append(f"no {algo} recipe for {model} on {env}: {near[0][2]}'s on {near[0][1]}")
        key = near[0]
    recipe = RECIPES[key]
    return recipe, recipe.source + (f" ({'; '.join(notes)})" if notes else "")


def resolve_recipe(key: str, _root_: Any) -> Any:
    """The `${recipe:KEY}` resolver: KEY's value in the recipe of the composed config it is read from."""
    p, algo = _root_.policy, _root_.algo.name
    recipe, _ = recipe_for(p.name, p.get("variant"), p.preset, _root_.env.name, algo)
    value = getattr(recipe, key)
    return list(value) if isinstance(value, tuple) else value


def recipe_line(cfg: Any) -> str:
    """One line for the console: the recipe behind this run's defaults and the values it resolved to."""
    p, a = cfg.policy, cfg.algo
    _, source = recipe_for(p.name, p.get("variant"), p.preset, cfg.env.name, a.name)
    clip = f"{a.clip:g}" if a.clip_high in (None, a.clip) else f"{a.clip:g}/{a.clip_high:g}"
    critic = "critic_lr" in a  # (PPO's; GRPO has no critic)
    parts = [
        f"lr {a.lr:g}",
        *([f"critic_lr {a.critic_lr:g}"] if critic else []),
        f"clip {clip}",
        f"epochs {a.epochs}",
        f"AdamW betas ({a.adam_betas[0]:g}, {a.adam_betas[1]:g}) eps {a.adam_eps:g} wd {a.weight_decay:g}",
    ]
    if critic and a.value_clip is not None:
        parts.append(f"value clip {a.value_clip:g}")
    if a.get("dual_clip") is not None:
        parts.append(f"dual clip {a.dual_clip:g}")
    parts.append(
        f"value coef {a.value_coef:g}, a ratio per {a.logprob_level}" if critic else f"a ratio per {a.logprob_level}"
    )
    if a.get("global_batch") is not None:
        parts.append(f"{a.global_batch} chunk steps per optimizer step")
    if a.get("micro_batch") is not None:
        parts.append(f"{a.micro_batch} per pass")
    if "logprob" in p:
        steps = f", {p.denoise_steps} denoising steps" if p.get("denoise_steps") is not None else ""
        detach = ", critic input detached" if p.get("detach_critic_input") else ""
        parts.append(f"logprob {p.logprob} ({p.chain_logprob}{steps}{detach})")
    return f"algo: defaults from {source}: {', '.join(parts)} (a value you set wins)"
