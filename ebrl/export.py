"""`python -m ebrl.export <run folder> [--to lerobot|openpi] [--out DIR] [--keep-heads]`: a run's trained policy
written so that the code its checkpoint came from loads it (docs/use/export.md).

A run that started from `policy.checkpoint` is written in that folder's layout, or in the one --to names:
- lerobot, pi0 / pi0.5: lerobot's save_pretrained folder: config.json, model.safetensors (keys under "model."), the
  pre- and post-processors with their normaliser state files;
- openpi, pi0 / pi0.5: model.safetensors under openpi's names, the converter's config.json record and
  assets/<asset_id>/norm_stats.json;
- lerobot, GR00T: lerobot's groot folder (config.json naming the base model, model.safetensors under
  `_groot_model.`), the source's processors carried as they were.
The weights are checkpoints/last.pt's "model" with its LoRA adapters folded in (W + s B A), each cast to the dtype it
had in the source file, under the source file's names (`Family.prefixes`); the source's tensors the run did not hold
(text heads, a vision tower a state-only run did not build) are carried over from it. The RL heads are left out, or
written beside as rl_heads.safetensors (our names) with --keep-heads. The statistics are the ones the policy
normalised with (the checkpoint's, else policy.norm_stats, else the source folder's), written for the layout's own
formulas (`in_convention`); `policy.execute` becomes lerobot's n_action_steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ebrl.checks import POLICY_RUNTIME_KEYS
from ebrl.classes import constructor_kwargs, load_class
from ebrl.envs.base import one_line
from ebrl.errors import BadInput
from ebrl.policies import gr00t, openpi
from ebrl.policies.base import Policy, preset_dims
from ebrl.policies.build import checkpoint_kwargs
from ebrl.policies.normalize import (
    NormStats,
    in_convention,
    lerobot_tensors,
    norm_modes,
    openpi_stats,
    openpi_table,
    read_norm_stats,
)
from ebrl.policies.tokenizer import MAX_TOKENS, MODEL_NAMES
from ebrl.policies.training import merge_lora
from ebrl.policies.weights import SINGLE, checkpoint_folder, weight_files
from ebrl.runtime.checkpoint import checkpoint_file, load_checkpoint
from ebrl.runtime.errors import exit_cleanly

HEADS = "rl_heads.safetensors"
PRE, POST = "policy_preprocessor.json", "policy_postprocessor.json"
NORMALIZERS = ("normalizer_processor", "unnormalizer_processor")
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class ExportError(BadInput, ValueError):
    """A run that cannot be written as asked; the message is one line."""


@dataclass(frozen=True)
class Family:
    """How a family's checkpoint files name its tensors: the prefix of each layout it is written in (the first is
    written for a source in `bare`, which has none), whether its published model ties the embedding to lm_head, and
    the layouts whose loader refuses the tied pair's second name."""

    policy: type[Policy]
    presets: dict[str, Any]
    prefixes: dict[str, str]
    bare: str
    # openpi's and lerobot <= 0.5's PaliGemma tie them, so lm_head is written as the embedding whatever the file held
    # (lerobot 0.6 unties them and saves both: each name gets the embedding, and every version acts alike)
    tied_in_model: bool
    head_alone: tuple[str, ...] = ()  # openpi's safetensors.load_model (strict) takes lm_head alone of a tied pair


FAMILIES = (
    Family(
        openpi.OpenPIPolicy,
        openpi.PRESETS,
        {"lerobot": openpi.OpenPIPolicy.LEROBOT_PREFIX, "openpi": ""},
        "openpi",
        True,
        head_alone=("openpi",),
    ),
    Family(gr00t.GR00TPolicy, gr00t.PRESETS, {"lerobot": gr00t.GR00TPolicy.LEROBOT_PREFIX}, "nvidia", False),
)


@dataclass
class Source:
    """The checkpoint a run was loaded from: its folder, layout and config.json, and where each of its tensors is
    (our name -> file, the file's name, its dtype)."""

    folder: Path
    layout: str
    config: dict
    tensors: dict[str, tuple[Path, str, torch.dtype]]

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path, key, _ = self.tensors[name]
        with safe_open(str(path), "pt") as handle:
            return handle.get_tensor(key)


def read_source(family: Family, path: str) -> Source:
    """The run's policy.checkpoint as it is now; one line when it is gone or a file of it cannot be read."""
    from safetensors import SafetensorError, safe_open

    if checkpoint_folder(path) is None:
        raise ExportError(
            f"policy.checkpoint={path}, which the run was loaded from, is not there any more: the export "
            "takes the layout, config and the tensors the run did not train from it"
        )
    files: dict[str, tuple[Path, torch.dtype]] = {}
    for f in weight_files(path):
        try:
            with safe_open(str(f), "pt") as handle:
                files.update({k: (f, DTYPES[handle.get_slice(k).get_dtype()]) for k in handle.keys()})
        except (OSError, SafetensorError, KeyError) as e:
            raise ExportError(
                f"{f}, a file of policy.checkpoint={path}, is not a safetensors file of a dtype the "
                f"export writes ({one_line(e)})"
            ) from None
    layout = next(
        (name for name, prefix in family.prefixes.items() if prefix and all(k.startswith(prefix) for k in files)),
        family.bare,
    )
    folder = checkpoint_folder(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    names = family.policy.published_names({k: k for k in files})
    return Source(folder, layout, config, {ours: (files[k][0], k, files[k][1]) for ours, k in names.items()})


def model_tensors(
    family: Family, ours: dict[str, torch.Tensor], source: Source, heads: list[str], layout: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the model file's tensors under our names, the RL heads) in `layout`: every tensor the source had, ours where
    we hold it, and the embedding's tied lm_head. pi0's PaliGemma ties them in openpi's and lerobot <= 0.5's model:
    lm_head alone, our embedding, as save_model leaves it; lerobot 0.6 saves both names, and a source of its layout
    gets our embedding under both, but openpi's layout lm_head alone. GR00T's Qwen3 is tied in N1.5's config, but
    lerobot's GR00TN15.from_pretrained unties them and its strict load then wants both: our embedding under both
    names, unless the source held an lm_head of its own beside the embedding (untied), which is carried. Names that
    share a tensor are written as copies (`save`)."""
    embed, head = family.policy.TIED
    out = {}
    for name, (_, _, dtype) in source.tensors.items():
        value = ours.get(name)
        if name == head and embed in ours and (family.tied_in_model or embed not in source.tensors):
            value = ours[embed]
        out[name] = (source.read(name) if value is None else value).to(dtype)
    if embed in ours and head not in out:  # (NVIDIA's release: transformers left the tied lm_head out)
        out[head] = ours[embed].to(out[embed].dtype)
    if embed in ours and embed not in out and not family.tied_in_model:  # (a tied lerobot groot file: lm_head alone)
        out[embed] = out[head]
    if layout in family.head_alone and head in out:  # (a lerobot 0.6 source's embedding, written for openpi)
        out.pop(embed, None)
    left = {k: v for k, v in ours.items() if k not in out and not (k == embed and head in out)}
    unplaced = [k for k in left if not k.startswith(tuple(heads))]
    if unplaced:
        raise ExportError(
            f"the run's {', '.join(unplaced[:3])} ({len(unplaced)} tensors) have no place in "
            f"{source.folder}'s files: was the run built at that checkpoint's sizes?"
        )
    return out, left


def export(run: Path, to: str | None = None, out: Path | None = None, keep_heads: bool = False) -> Path:
    """Write the policy of `run`'s checkpoints/last.pt in layout `to` (default: its policy.checkpoint's) to `out`
    (default: <run>/export/<layout>); returns the folder. One line (ExportError, CheckpointError) when it cannot."""
    path = checkpoint_file(run)
    if not path.is_file():
        raise ExportError(f"{run} holds no checkpoint ({path}): give a run folder of ours that wrote one")
    record = load_checkpoint(path)
    conf = record["config"]
    policy_cfg = conf["policy"]
    cls = load_class(policy_cfg["_target_"], "policy._target_")
    family = next((f for f in FAMILIES if issubclass(cls, f.policy)), None)
    if family is None:
        raise ExportError(
            f"policy.name={policy_cfg.get('name')} cannot be exported; export writes "
            f"{', '.join(f.policy.__name__ for f in FAMILIES)} policies"
        )
    if not policy_cfg.get("checkpoint"):
        raise ExportError(
            f"{run} trained from no published checkpoint (policy.checkpoint is unset), so it has no "
            "layout that another code base reads; export writes runs that started from one"
        )
    source = read_source(family, policy_cfg["checkpoint"])
    layout = to or (source.layout if source.layout in family.prefixes else next(iter(family.prefixes)))
    if layout not in family.prefixes:
        raise ExportError(f"--to {layout}: a {cls.__name__} is written in {' or '.join(family.prefixes)} layout")
    out = Path(out).expanduser() if out is not None else (run if run.is_dir() else path.parent) / "export" / layout
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not empty; give a new or empty folder")
    kwargs = checkpoint_kwargs(cls, policy_cfg["checkpoint"], constructor_kwargs(cls, policy_cfg, POLICY_RUNTIME_KEYS))
    state = merge_lora(record["model"], record.get("lora"), record.get("lora_scaling"))
    tensors, heads = model_tensors(family, state, source, cls.heads_of(kwargs.get("logprob") or "flow_noise"), layout)
    run_shape = RunShape(
        kwargs,
        preset_dims(family.presets, kwargs.get("preset") or "tiny", kwargs.get("dims")),
        conf,
        policy_cfg.get("execute"),
    )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    except OSError as e:
        raise ExportError(f"--out {out} cannot be made there ({one_line(e)}); give a folder you can write") from None
    try:
        save(tensors, family.prefixes[layout], tmp / SINGLE)
        if issubclass(cls, gr00t.GR00TPolicy):
            write_groot(tmp, source, run_shape)
        else:
            stats = trained_stats(record, kwargs)
            variant = kwargs["variant"]
            modes = norm_modes(stats, kwargs.get("norm_mode"), openpi.NORM_MODES[variant]) if stats else None
            if layout == "lerobot":
                write_lerobot_openpi(tmp, source, run_shape, stats, modes)
            else:
                write_openpi(tmp, source, run_shape, stats, modes, tensors)
            tokenizer = kwargs.get("tokenizer")
            if tokenizer and Path(tokenizer).expanduser().is_file():  # (our loader finds it in the folder)
                name = Path(tokenizer).name if Path(tokenizer).name in MODEL_NAMES else MODEL_NAMES[-1]
                shutil.copy(Path(tokenizer).expanduser(), tmp / name)
        if keep_heads and heads:
            save(heads, "", tmp / HEADS)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save(tensors: dict[str, torch.Tensor], prefix: str, path: Path) -> None:
    """A safetensors file of `tensors` under `prefix` + their names; two names of one tensor (a tied pair a layout
    holds both of) are written as two copies, since safetensors refuses names that share memory."""
    from safetensors.torch import save_file

    written, storages = {}, set()
    for name, value in tensors.items():
        value = value.detach().cpu().contiguous()
        if value.untyped_storage().data_ptr() in storages:
            value = value.clone()
        storages.add(value.untyped_storage().data_ptr())
        written[prefix + name] = value
    save_file(written, str(path))


@dataclass
class RunShape:
    """What a written config says of the run: its constructor arguments as the checkpoint completed them, the
    preset's sizes, its resolved config and policy.execute."""

    kwargs: dict[str, Any]
    dims: Any
    conf: dict[str, Any]
    execute: int | None

    @property
    def chunk(self) -> int:
        return int(self.kwargs.get("chunk") or self.dims.chunk)

    @property
    def denoise_steps(self) -> int:
        return int(self.kwargs.get("denoise_steps") or self.dims.denoise_steps)

    def action_steps(self, config: dict) -> int:
        """lerobot's n_action_steps: policy.execute, else what the source folder said, at most the chunk."""
        return min(int(self.execute or config.get("n_action_steps") or self.chunk), self.chunk)

    def env_cameras(self) -> list[str]:
        """The run's env cameras, sorted as the policies take them."""
        return sorted(self.conf.get("env", {}).get("cameras") or [])


def trained_stats(record: dict[str, Any], kwargs: dict[str, Any]) -> NormStats | None:
    """The statistics the policy normalised with: those its checkpoint carries (an SFT run's, adopted ones), else
    policy.norm_stats or the checkpoint folder's (as `checkpoint_defaults` found them)."""
    if record.get("norm_stats"):
        return openpi_stats(record["norm_stats"], "the run's checkpoint")
    return read_norm_stats(kwargs["norm_stats"]) if kwargs.get("norm_stats") else None


def feature(shape: list[int], kind: str) -> dict[str, Any]:
    """A lerobot config's feature entry."""
    return {"type": kind, "shape": list(shape)}


def write_lerobot_openpi(
    folder: Path, source: Source, run: RunShape, stats: NormStats | None, modes: tuple[str, str] | None
) -> None:
    """lerobot's pi0 / pi0.5 config.json and processors: a lerobot 0.4 source's, with what the run changed, else
    written as lerobot 0.4.4's make_pi0(5)_pre_post_processors save them."""
    variant, d = run.kwargs["variant"], run.dims
    processors = source.layout == "lerobot" and (source.folder / PRE).is_file() and (source.folder / POST).is_file()
    base = source.config if processors else {}  # (an older lerobot's config has keys 0.4 refuses)
    features = source.config.get("input_features") or {}
    state = [stats.state.dims()] if stats else features.get("observation.state", {}).get("shape")
    action = (
        [stats.action.dims()] if stats else (source.config.get("output_features") or {}).get("action", {}).get("shape")
    )
    if state is None or action is None:
        raise ExportError(
            f"policy.checkpoint={source.folder} says neither the state's nor the actions' dims and the "
            "run had no statistics that would: lerobot's config needs them"
        )
    slots = list(run.kwargs.get("cameras") or {}) or run.env_cameras()
    images = {
        f"observation.images.{s}": features.get(f"observation.images.{s}")
        or feature([3, d.image_size, d.image_size], "VISUAL")
        for s in slots
    }
    norm_map = {
        "VISUAL": "IDENTITY",
        "STATE": modes[0].upper() if modes else "IDENTITY",
        "ACTION": modes[1].upper() if modes else "IDENTITY",
    }
    config = {
        **base,
        "type": variant,
        "n_obs_steps": 1,
        "input_features": {"observation.state": feature(state, "STATE"), **images},
        "output_features": {"action": feature(action, "ACTION")},
        "paligemma_variant": source.config.get("paligemma_variant", "gemma_2b"),
        "action_expert_variant": source.config.get("action_expert_variant", "gemma_300m"),
        "chunk_size": run.chunk,
        "n_action_steps": run.action_steps(base),
        "num_inference_steps": run.denoise_steps,
        "max_state_dim": d.max_state_dim,
        "max_action_dim": d.max_action_dim,
        "normalization_mapping": norm_map,
        "tokenizer_max_length": (run.kwargs.get("dims") or {}).get("max_tokens") or MAX_TOKENS[variant],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    for name, steps in ((PRE, None), (POST, None)) if processors else lerobot_processors(variant, config):
        pipeline = json.loads((source.folder / name).read_text()) if steps is None else steps
        for i, step in enumerate(pipeline["steps"]):
            if step["registry_name"] not in NORMALIZERS:
                continue
            eps = float(step.get("config", {}).get("eps", 1e-8))
            all_features = {**config["input_features"], **config["output_features"]}
            step["config"] = {
                **step.get("config", {}),
                "eps": eps,
                "norm_map": norm_map,
                "features": {
                    k: v for k, v in all_features.items() if step["registry_name"] == NORMALIZERS[0] or k == "action"
                },
            }
            step.pop("state_file", None)
            if stats is not None:
                from safetensors.torch import save_file

                step["state_file"] = f"{pipeline['name']}_step_{i}_{step['registry_name']}.safetensors"
                save_file(lerobot_tensors(in_convention(stats, "lerobot", eps)), str(folder / step["state_file"]))
        (folder / name).write_text(json.dumps(pipeline, indent=2))


def lerobot_processors(variant: str, config: dict) -> list[tuple[str, dict]]:
    """lerobot 0.4.4's pi0 / pi0.5 processor files as its make_pi0(5)_pre_post_processors save them (the normaliser
    steps' statistics filled in by the caller): (file name, pipeline)."""
    tokenizer = {
        "registry_name": "tokenizer_processor",
        "config": {
            "max_length": config["tokenizer_max_length"],
            "task_key": "task",
            "padding_side": "right",
            "padding": "max_length",
            "truncation": True,
            "tokenizer_name": "google/paligemma-3b-pt-224",
        },
    }
    device = {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    normalizer = {"registry_name": NORMALIZERS[0], "config": {}}
    head = [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
    ]
    if variant == "pi0":
        pre = [*head, {"registry_name": "pi0_new_line_processor", "config": {}}, tokenizer, device, normalizer]
    else:  # pi0.5 writes the normalised state into its prompt
        pre = [
            *head,
            normalizer,
            {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
            tokenizer,
            device,
        ]
    post = [{"registry_name": NORMALIZERS[1], "config": {}}, device]
    return [
        (PRE, {"name": PRE.removesuffix(".json"), "steps": pre}),
        (POST, {"name": POST.removesuffix(".json"), "steps": post}),
    ]


def write_openpi(
    folder: Path,
    source: Source,
    run: RunShape,
    stats: NormStats | None,
    modes: tuple[str, str] | None,
    tensors: dict[str, torch.Tensor],
) -> None:
    """openpi's converter record (config.json) and assets/<asset_id>/norm_stats.json, openpi's normalisation
    formulas (the variant decides the mode: openpi's files do not say it)."""
    variant, d = run.kwargs["variant"], run.dims
    if modes is not None and set(modes) != {openpi.NORM_MODES[variant]}:
        raise ExportError(
            f"the run normalised with {'/'.join(modes)} (state/actions), which openpi's layout cannot "
            f"say (openpi's {variant} uses {openpi.NORM_MODES[variant]}): export --to lerobot"
        )
    base = source.config if source.layout == "openpi" else {}
    precision = "bfloat16" if any(v.dtype == torch.bfloat16 for v in tensors.values()) else "float32"
    config = {
        **base,
        "action_dim": d.max_action_dim,
        "action_horizon": run.chunk,
        "paligemma_variant": source.config.get("paligemma_variant", "gemma_2b"),
        "action_expert_variant": source.config.get("action_expert_variant", "gemma_300m"),
        "precision": base.get("precision", precision),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if stats is not None:
        asset = next(
            (p.parent.name for p in sorted(source.folder.glob("assets/*/norm_stats.json"))),
            run.conf.get("env", {}).get("name") or "ebrl",
        )
        (folder / "assets" / asset).mkdir(parents=True)
        (folder / "assets" / asset / "norm_stats.json").write_text(
            json.dumps(openpi_table(in_convention(stats, "openpi")), indent=2)
        )


def write_groot(folder: Path, source: Source, run: RunShape) -> None:
    """lerobot's groot config.json (a lerobot source's, with what the run changed, else one naming the NVIDIA folder
    as the base model) and the source's processor files as they were (our GR00T does not normalise)."""
    d = run.dims
    embodiment = gr00t.run_embodiment(d, run.kwargs.get("embodiment_id"))
    tag = next((t for t, i in gr00t.EMBODIMENT_TAGS.items() if i == embodiment), None)
    if tag is None:
        raise ExportError(
            f"the run's embodiment slot {embodiment} (policy.embodiment_id) has no tag in lerobot's "
            "groot (it names "
            f"{', '.join(f'{t}={i}' for t, i in gr00t.EMBODIMENT_TAGS.items())})"
        )
    base = (
        source.config
        if source.layout == "lerobot"
        else {
            "type": "groot",
            "n_obs_steps": 1,
            "input_features": {
                f"observation.images.{c}": feature([3, d.image_size, d.image_size], "VISUAL") for c in run.env_cameras()
            },
            "output_features": {},
            "base_model_path": str(source.folder.resolve()),
            "use_bf16": False,
        }
    )
    config = {
        **base,
        "chunk_size": run.chunk,
        "n_action_steps": run.action_steps(base),
        "max_state_dim": d.max_state_dim,
        "max_action_dim": d.max_action_dim,
        "image_size": [d.image_size, d.image_size],
        "embodiment_tag": tag,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=4))
    if source.layout == "lerobot":
        for f in source.folder.glob("policy_*processor*"):
            shutil.copy(f, folder / f.name)


def main(argv: list[str] | None = None) -> None:
    """The command line; bad input is one line and exit 2, any other failure one line and exit 1."""
    parser = argparse.ArgumentParser(
        prog="python -m ebrl.export",
        description="A run's trained policy written "
        "so that the code its checkpoint came from loads it (docs/use/export.md).",
    )
    parser.add_argument("run", help="a run folder (its checkpoints/last.pt) or a checkpoint file of ours")
    parser.add_argument("--to", choices=("lerobot", "openpi"), help="the layout (default: the policy.checkpoint's)")
    parser.add_argument("--out", help="the folder to write (default: <run>/export/<layout>); new or empty")
    parser.add_argument("--keep-heads", action="store_true", help="write the RL heads to rl_heads.safetensors")
    args = parser.parse_args(argv)
    with exit_cleanly("the export"):  # any other failure: one line too, exit 1, its traceback kept in a file
        out = export(Path(args.run).expanduser(), args.to, Path(args.out) if args.out else None, args.keep_heads)
    print(f"exported {args.run} to {out}")


if __name__ == "__main__":
    main()
