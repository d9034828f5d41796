"""Where a run's first weights come from (`init=`, docs/internals/design.md, "Demonstrations, SFT, RL").

- a run folder (its checkpoints/last.pt) or a .pt file: an earlier run's weights, typically an `algo=sft` run's;
  training starts from them with a fresh optimizer at iteration 0. The policy must be built alike (family, preset,
  variant, chunk, denoising steps, exploration head); what is trained (policy.train) may differ. With
  policy.checkpoint too only where that run was made from the same checkpoint: its folder describes the model
  (config, tokenizer, cameras), the run gives the weights and statistics;
- `auto` (the default): the SFT checkpoint this repository ships for this policy and env, where there is one
  (`SHIPPED`), so that the default run fine-tunes a policy that already succeeds sometimes; otherwise as null;
- null: the family's own initialisation, or `policy.checkpoint`'s published weights.

A resumed run (`resume=`) continues from its own checkpoint and ignores `init`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ebrl.checks import cfg_get
from ebrl.config import REPO, ConfigError
from ebrl.runtime.checkpoint import checkpoint_file, load_checkpoint, policy_identity

# (policy.name, policy.preset, policy.variant, env.name, env.task) -> the SFT checkpoint the repository ships, made by
# docs/use/demos.md's commands ("Learning from demonstrations": record, then algo=sft)
SHIPPED: dict[tuple[str, str, str | None, str, str], str] = {
    ("openpi", "tiny", "pi0", "robosuite", "Lift"): "ebrl/assets/openpi-tiny_robosuite-Lift_sft.pt",
}
ENV_IDENTITY = ("name", "task", "cameras", "image_size")  # what the shipped weights' observations depend on


def init_file(cfg: Any) -> Path | None:
    """The checkpoint file this run starts from (see the module docstring), or None; one line for an `init` that
    names nothing readable, or that competes with policy.checkpoint."""
    init = cfg_get(cfg, "init", None)
    if init is None or cfg_get(cfg, "resume", None):
        return None
    if init == "auto":
        return shipped_for(cfg)
    path = checkpoint_file(init)
    checkpoint = cfg.policy.get("checkpoint")
    if checkpoint and (not path.is_file() or made_from(path) != str(checkpoint)):
        raise ConfigError(
            f"init={init} and policy.checkpoint={checkpoint} both give the first weights; keep one "
            "(init: a run of ours, policy.checkpoint: a published checkpoint), or both where the init "
            "run was made from that checkpoint (the folder then describes the model, init gives the "
            "weights)"
        )
    if not path.is_file():
        raise ConfigError(
            f"init={init} is neither a run folder with checkpoints/last.pt nor a checkpoint file; give "
            "one (e.g. an algo=sft run's folder), init=auto or init=null"
        )
    return path


def made_from(path: Path) -> str | None:
    """The policy.checkpoint the run that wrote checkpoint `path` was built from, as its run folder's config.yaml
    says (read without loading the weights); None where it had none or the folder says nothing."""
    from omegaconf import OmegaConf

    config = path.parent.parent / "config.yaml"
    try:
        return OmegaConf.load(config).policy.get("checkpoint") if config.is_file() else None
    except Exception:  # noqa: BLE001  (a config.yaml that does not parse says nothing)
        return None


def shipped_for(cfg: Any) -> Path | None:
    """The shipped SFT checkpoint for this run's policy and env, if one exists and was made for the same policy
    build and observations; RL only (an SFT run, or one starting from policy.checkpoint, starts from neither), and one
    task only (env.tasks)."""
    if cfg.algo.name == "sft" or cfg.policy.get("checkpoint"):
        return None
    if cfg_get(cfg, "env.tasks", None) is not None:  # a multi-task run: no shipped checkpoint was made for its tasks
        return None
    p = cfg.policy
    name = SHIPPED.get((p.name, p.preset, p.get("variant"), cfg.env.name, cfg.env.task))
    if name is None or not (REPO / name).is_file():
        return None
    path = REPO / name
    record = load_checkpoint(path)
    conf = _plain(cfg)
    want = {k: v for k, v in policy_identity(conf["policy"]).items() if k != "train"}
    have = {k: v for k, v in record["policy"].items() if k != "train"}
    env, trained_on = conf["env"], record["config"]["env"]
    if want != have or any(env.get(k) != trained_on.get(k) for k in ENV_IDENTITY):
        return None
    return path


def describe(path: Path, record: dict[str, Any]) -> str:
    """The console line of a run that starts from `path`."""
    conf = record.get("config", {})
    env, algo = conf.get("env", {}), conf.get("algo", {}).get("name")
    shipped = path.resolve().is_relative_to(REPO) and str(path.resolve().relative_to(REPO)) in SHIPPED.values()
    what = "the shipped SFT checkpoint" if shipped else f"the {algo} run's weights" if algo else "the weights"
    demos = conf.get("demos", {}).get("path")
    source = f", trained on {demos}" if algo == "sft" and demos else ""
    return (
        f"init: {what} {path} ({record.get('iteration', 0)} iterations of {algo} on {env.get('name')} "
        f"{env.get('task')}{source}); init=null starts from scratch"
    )


def _plain(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
