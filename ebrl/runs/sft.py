"""`algo=sft`: supervised fine-tuning on demonstrations (`demos.path`), the step before RL (docs/internals/design.md,
"Demonstrations, SFT, RL").

One simulator is started to read the env's spec (the policy is built for the env RL will run it on, and the demos
must fit it), then closed; training runs in this process on the run's device (`device`, the GPU with hw's GPUs),
with `SFTTrainer` (ebrl/rl/sft.py). A sample is the observation at one step of an episode and the `policy.chunk`
actions taken from it, padded past the episode's end and masked there. Each iteration is `algo.steps_per_iteration`
steps on random training samples, then the loss on the held-out episodes; both go to metrics.jsonl (and W&B) against
the samples seen, `sft_loss.png` draws them, and the checkpoint (checkpoints/last.pt, the format of every run) is
what `init=<run folder>` starts RL from and `mode=eval checkpoint=<run folder>` measures.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ebrl.checks import rank_cores, validate
from ebrl.config import ConfigError
from ebrl.demos.dataset import Demos, DemosError, read_demos, statistics
from ebrl.envs.base import EnvSpec
from ebrl.node import order_gpus_by_bus
from ebrl.policies.base import Policy
from ebrl.policies.build import build_policy
from ebrl.rl.sft import DemoBatch
from ebrl.rl.trainers import make_trainer
from ebrl.runs.base import Run, run_folder
from ebrl.runs.init import describe, init_file
from ebrl.runtime.checkpoint import (
    NORM_STATS,
    CheckpointWriter,
    adopt_norm_stats,
    checkpoint_record,
    detached_copy,
    load_policy_checkpoint,
    restore_weights,
)
from ebrl.telemetry.metrics import MetricsLog
from ebrl.telemetry.plots import plot_lines
from ebrl.telemetry.report import ProgressBar, console, print_table


def demo_samples(
    demos: Demos, episodes: list[int], horizon: int, tokens: torch.Tensor, token_mask: torch.Tensor
) -> DemoBatch:
    """Every step of these episodes as a sample: its observation (with the instruction's tokens) and the `horizon`
    actions from it, the last action repeated past the episode's end and masked."""
    obs: dict[str, list[np.ndarray]] = {}
    actions, mask = [], []
    for i in episodes:
        e = demos.episodes[i]
        steps = np.arange(len(e))[:, None] + np.arange(horizon)[None]  # (T, H)
        actions.append(e.actions[np.minimum(steps, len(e) - 1)])
        mask.append(steps < len(e))
        for key, value in e.obs.items():
            obs.setdefault(key, []).append(value)
    batch = {k: torch.from_numpy(np.concatenate(v)) for k, v in obs.items()}
    n = len(batch["state"])
    batch["tokens"], batch["token_mask"] = tokens.expand(n, -1), token_mask.expand(n, -1)
    return DemoBatch(batch, torch.from_numpy(np.concatenate(actions)), torch.from_numpy(np.concatenate(mask)))


def fit_demos(demos: Demos, spec: EnvSpec, env: Any, state_dims: Sequence[int] | None = None) -> None:
    """The demonstrations fitted to the env the policy is built for (in place), or one line where their state or actions
    differ. A state of the `state_dims` the policy reads (policy.state_dims; a LeRobot LIBERO dataset's 8 dims beside
    our adapter's 8 + the objects') is laid into the env's state at those dims, the rest 0, as the policy picks them."""
    state = demos.episodes[0].obs["state"].shape[1]
    want = spec.obs["state"].shape[0]
    where = f"env={env.name} env.task={env.task}"
    if state != want and state_dims is not None and state == len(state_dims):
        for episode in demos.episodes:
            full = np.zeros((len(episode), want), np.float32)
            full[:, list(state_dims)] = episode.obs["state"]
            episode.obs["state"] = full
    elif state != want:
        picked = f" or the {len(state_dims)} policy.state_dims picks" if state_dims is not None else ""
        raise DemosError(
            f"demos.path={demos.files[0]}: its state has {state} dims and {where}'s {want}{picked}; "
            "record them on this env (python -m ebrl.demos record), or name the obs that make its state "
            "in demos.state_keys"
        )
    actions = demos.episodes[0].actions.shape[1]
    if actions != spec.action_dim:
        raise DemosError(
            f"demos.path={demos.files[0]}: its actions have {actions} dims and {where}'s {spec.action_dim}"
        )
    if not demos.train:
        raise DemosError(
            f"demos.path={demos.files[0]}: every one of its {len(demos.episodes)} episodes is held out; "
            "lower demos.valid or record more"
        )


@dataclass
class SFTSummary:
    """What an SFT run reached: the held-out loss at its start and end."""

    iterations: int
    samples: int  # seen in training, over the run
    train_episodes: int
    valid_episodes: int
    first_valid_loss: float
    valid_loss: float
    wall_s: float


class SupervisedRun(Run):
    """An `algo=sft` run: the policy, its demonstration samples and the trainer (see the module docstring)."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.iteration, self.samples = 0, 0
        self.writer = CheckpointWriter()
        self.first_valid = float("nan")

    @classmethod
    def from_config(cls, cfg: DictConfig, run_dir: str | Path | None = None) -> "SupervisedRun":
        """Validate, read the demonstrations and build the policy; bad input raises one line."""
        order_gpus_by_bus()  # before anything counts or starts a GPU
        validate(cfg)
        if not cfg.demos.path:
            raise ConfigError(
                "algo=sft trains on demonstrations: give demos.path=<folder or .hdf5> (record some with "
                "`python -m ebrl.demos record env=<benchmark> env.task=<task> episodes=20`)"
            )
        run = cls(cfg, run_folder(cfg, run_dir))
        run._build()
        return run

    def _spec(self) -> EnvSpec:
        """The env's spec, from one simulator started for it (under the env's own interpreter where it has one)."""
        pool = self.start_pool(1, self.cfg.seed, process_env=None, on_gpu=False)
        try:
            return pool.spec
        finally:
            pool.close()

    def _build(self) -> None:
        cfg, conf = self.cfg, self.conf
        self.device = self.start_device()
        torch.set_num_threads(len(rank_cores(cfg)))
        spec = self._spec()
        cameras = sorted(k[len("image/") :] for k in spec.obs if k.startswith("image/"))
        d = cfg.demos
        self.demos = read_demos(
            d.path,
            list(d.state_keys) if d.state_keys is not None else None,
            dict(d.image_keys) if d.image_keys else None,
            cameras,
            float(d.valid),
        )
        state_dims = conf["policy"].get("state_dims")
        fit_demos(self.demos, spec, cfg.env, state_dims)
        if self.demos.instruction and self.demos.instruction != spec.instruction:
            console.print(
                f"note: the demos' instruction is {self.demos.instruction!r}; the policy is trained on the "
                f"env's, {spec.instruction!r}, which RL gives it too",
                soft_wrap=True,
            )
        resume = self.run_dir / "checkpoints" / "last.pt" if cfg.resume else None
        ckpt = load_policy_checkpoint(resume, conf["policy"], f"resume={cfg.resume}") if resume else None
        start = init_file(cfg) if ckpt is None else None
        record = load_policy_checkpoint(start, conf["policy"], f"init={cfg.init}", resume=False) if start else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for earlier in (ckpt, record):
            if earlier is not None:
                adopt_norm_stats(earlier, conf, self.run_dir)
        if "norm_stats" in conf["policy"] and not conf["policy"]["norm_stats"]:
            # the state and actions normalised as openpi and lerobot normalise theirs: with the data's statistics
            path = self.run_dir / NORM_STATS
            path.write_text(json.dumps(statistics(self.demos, self.demos.train, state_dims)))
            conf["policy"]["norm_stats"] = str(path)
        self.policy: Policy = build_policy(
            conf["policy"], spec, self.device, train=True, weights="given" if ckpt or record else "init"
        )
        if record is not None:
            restore_weights(self.policy, record, f"init={cfg.init}")
            console.print(describe(start, record), soft_wrap=True, markup=False)
        self.trainer = make_trainer(self.policy, OmegaConf.create(conf["algo"]), self.device)
        if ckpt is not None:
            restore_weights(self.policy, ckpt, f"resume={cfg.resume}")
            self.trainer.load_optimizer_state(ckpt["optimizer"])
            self.iteration, self.samples = int(ckpt["iteration"]), int(ckpt.get("samples", 0))
        tokens, mask = (torch.from_numpy(a) for a in self.policy.tokenize([spec.instruction]))
        self.train_set = demo_samples(self.demos, self.demos.train, self.policy.chunk_len, tokens, mask)
        self.valid_set = (
            demo_samples(self.demos, self.demos.valid, self.policy.chunk_len, tokens, mask)
            if self.demos.valid
            else None
        )
        self.generator = torch.Generator().manual_seed(int(cfg.seed) + self.iteration)
        # (docs/internals/schedules.md, "Measured choices"; after h5py and numpy have read their float info)
        torch.set_flush_denormal(True)

    def train(self) -> SFTSummary:
        """Run the remaining iterations; checkpoints every `checkpoint_every` and at the end."""
        cfg, a = self.cfg, self.cfg.algo
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(self.conf))
        log = MetricsLog(self.run_dir, self.conf["logger"], self.conf, step_metric="samples")
        bar = ProgressBar(total=cfg.iterations, done=self.iteration, enabled=cfg.progress, label="sft")
        rows, start = [], time.perf_counter()
        try:
            while self.iteration < cfg.iterations:
                t0 = time.perf_counter()
                losses = []
                for _ in range(a.steps_per_iteration):
                    index = torch.randint(len(self.train_set), (a.batch_size,), generator=self.generator)
                    losses.append(self.trainer.update(self.train_set.rows(index)))
                self.iteration += 1
                self.samples += a.steps_per_iteration * a.batch_size
                wall = time.perf_counter() - t0
                row = {
                    "iteration": self.iteration,
                    "samples": self.samples,
                    "losses/sft": float(np.mean([m["losses/sft"] for m in losses])),
                    "train/grad_norm": float(np.mean([m["train/grad_norm"] for m in losses])),
                    "time/iteration_s": wall,
                    "perf/samples_per_s": a.steps_per_iteration * a.batch_size / wall,
                }
                if self.valid_set is not None:
                    row["losses/sft_valid"] = self.trainer.validate(self.valid_set)
                    if self.first_valid != self.first_valid:
                        self.first_valid = row["losses/sft_valid"]
                log.log(row)
                rows.append(row)
                valid = f"  held-out {row['losses/sft_valid']:.4f}" if "losses/sft_valid" in row else ""
                bar.advance(f"loss {row['losses/sft']:.4f}{valid}")
                if self.iteration % cfg.checkpoint_every == 0 or self.iteration == cfg.iterations:
                    self.save_checkpoint(log.wandb_id)
            paths = self._plot(self.run_dir / "metrics.jsonl")
            log.log_images(paths, self.samples)
        finally:
            bar.close()
            self.writer.wait()
            log.close()
        summary = SFTSummary(
            self.iteration,
            self.samples,
            len(self.demos.train),
            len(self.demos.valid),
            self.first_valid,
            rows[-1].get("losses/sft_valid", float("nan")) if rows else float("nan"),
            time.perf_counter() - start,
        )
        (self.run_dir / "summary.json").write_text(json.dumps(summary.__dict__, indent=2))
        self._print(summary)
        return summary

    def save_checkpoint(self, wandb_id: str | None) -> None:
        record = checkpoint_record(
            self.conf, self.policy.state_dict(), self.trainer.optimizer_state(), self.iteration, 0, wandb_id
        )
        record["samples"] = self.samples
        self.writer.save(detached_copy(record), self.run_dir / "checkpoints" / "last.pt")

    def _plot(self, metrics: Path) -> list[Path]:
        """sft_loss.png: the training and held-out loss against the samples seen (the whole run, resumed ones too)."""
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        lines = {"train": (np.array([r["samples"] for r in rows]), np.array([r["losses/sft"] for r in rows]))}
        held = [r for r in rows if "losses/sft_valid" in r]
        if held:
            samples, losses = [r["samples"] for r in held], [r["losses/sft_valid"] for r in held]
            lines["held-out"] = (np.array(samples), np.array(losses))
        path = plot_lines(
            self.run_dir / "sft_loss.png",
            lines,
            "samples seen",
            "loss",
            f"SFT loss ({self.policy.__class__.__name__}, {len(self.demos.train)} demos)",
            log_y=True,
        )
        return [path] if path else []

    def _print(self, s: SFTSummary) -> None:
        print_table(
            "EBRL SFT summary",
            [
                (
                    "demonstrations",
                    f"{s.train_episodes} episodes to train, {s.valid_episodes} held out "
                    f"({self.demos.steps} steps, {', '.join(self.demos.files)})",
                ),
                ("samples seen", f"{s.samples:,} in {s.iterations} iterations"),
                ("held-out loss (first, last iteration)", f"{s.first_valid_loss:.4f} -> {s.valid_loss:.4f}"),
                ("wall time", f"{s.wall_s:.1f} s"),
                ("next", f"python run.py init={self.run_dir}  (RL from it); mode=eval checkpoint={self.run_dir}"),
                ("run folder", str(self.run_dir)),
            ],
        )
