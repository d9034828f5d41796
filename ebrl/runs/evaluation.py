"""`mode=eval`: run the policy of a checkpoint for `eval.episodes` complete episodes, without training.

The checkpoint is a run's (`checkpoint=<run folder>`), or a published one as `policy.checkpoint` names it (then
nothing else is needed: the weights are the folder's). The policy acts deterministically by default
(`eval.deterministic`) and executes `policy.execute` actions of each chunk, as the run it evaluates trained, or as
the checkpoint folder says (lerobot's n_action_steps). The episodes run on the simulator workers training uses, in
lockstep with one batched generation per decision; success is the env's own success flag of each episode
(env/success_rate in training). Env i of the pool runs episodes i, i + n, i + 2n, ...: a fixed share whatever the
outcomes, since keeping the first episodes to finish would favour the short ones, which on tasks that end at success
are the successes. Episode j starts from reset seed `episode_seed(seed, j)` whatever the number of envs: with
seed=0, LIBERO's episode j starts from its task's init state j, as LIBERO's own evaluation (and openpi's, RLinf's)
runs its trials.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from ebrl.checks import rank_cores, validate
from ebrl.config import ConfigError
from ebrl.envs.worker import SimWorkerPool
from ebrl.node import order_gpus_by_bus
from ebrl.policies.build import build_policy, executed_line, settle_execute
from ebrl.rl.rollout import batch_obs
from ebrl.runs.base import Run, run_folder
from ebrl.runtime.checkpoint import adopt_norm_stats, checkpoint_file, load_policy_checkpoint, restore_weights
from ebrl.telemetry.metrics import wilson_interval
from ebrl.telemetry.report import ProgressBar, console, print_eval

MODES = ("train", "eval")
VIDEO_FPS = 20  # robosuite's (and LIBERO's, ManiSkill's) default control rate: videos play in real time


def check_mode(cfg: DictConfig) -> None:
    """mode=, and the keys mode=eval reads (checkpoint=, eval.*): one line for values that cannot work."""
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode!r} is not available; accepted: {', '.join(MODES)}")
    if cfg.mode == "train":
        if cfg.checkpoint:
            raise ConfigError(
                f"checkpoint={cfg.checkpoint} is read by mode=eval only; to continue a run use "
                "resume=<run folder>, to start from weights policy.checkpoint=<file.safetensors>"
            )
        return
    if not cfg.checkpoint and not cfg.policy.get("checkpoint"):
        raise ConfigError(
            "mode=eval needs checkpoint=<run folder or its checkpoints/last.pt>, or "
            "policy.checkpoint=<a published checkpoint folder> to evaluate that one"
        )
    if cfg.checkpoint and not Path(cfg.checkpoint).expanduser().exists():
        raise ConfigError(f"checkpoint={cfg.checkpoint} does not exist; give a run folder or its checkpoints/last.pt")
    if cfg.eval.episodes < 1:
        raise ConfigError(f"eval.episodes={cfg.eval.episodes} must be at least 1")
    if cfg.eval.videos < 0:
        raise ConfigError(f"eval.videos={cfg.eval.videos} must be >= 0 (0: no videos)")


@dataclass
class EvalSummary:
    """What an evaluation measured; eval.json holds it, the console table shows it."""

    checkpoint: str  # the file the weights came from
    iteration: int  # training iterations behind it
    env_steps: int  # and env steps
    episodes: int
    successes: int
    success_rate: float
    success_ci95: tuple[float, float]  # Wilson score interval
    mean_return: float
    mean_length: float
    wall_s: float
    videos: list[str] = field(default_factory=list)  # mp4 files, relative to the run folder
    per_episode: list[dict[str, float]] = field(default_factory=list)  # env, seed, return, length, success (, task)
    # env.tasks: each task's episodes, successes, success_rate, success_ci95, mean_return
    per_task: dict[str, dict[str, Any]] = field(default_factory=dict)


def episode_seed(seed: int, episode: int) -> int:
    """The reset seed of an evaluation's episode `episode` (LIBERO: init state `seed * 3 + episode` mod 50)."""
    return seed * 100_003 + episode


def per_task(episodes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A multi-task evaluation's figures per task (episodes carry "task" when env.tasks is set), in task order."""
    out: dict[str, dict[str, Any]] = {}
    for task in dict.fromkeys(e["task"] for e in episodes if "task" in e):
        mine = [e for e in episodes if e.get("task") == task]
        wins = int(sum(e["success"] for e in mine))
        out[task] = {
            "episodes": len(mine),
            "successes": wins,
            "success_rate": wins / len(mine),
            "success_ci95": wilson_interval(wins, len(mine)),
            "mean_return": float(np.mean([e["return"] for e in mine])),
        }
    return out


class Evaluation(Run):
    """The policy of a checkpoint on a pool of simulator workers, for a fixed number of complete episodes."""

    def __init__(self, cfg: DictConfig, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.pool: SimWorkerPool | None = None

    @classmethod
    def from_config(cls, cfg: DictConfig, run_dir: str | Path | None = None) -> "Evaluation":
        """Validate, load the checkpoint, start the simulators; bad input raises a one-line error."""
        order_gpus_by_bus()  # before anything counts or starts a GPU
        check_mode(cfg)
        validate(cfg)
        # a run's checkpoint; none: the published weights of policy.checkpoint
        path = checkpoint_file(cfg.checkpoint) if cfg.checkpoint else Path(cfg.policy.checkpoint).expanduser()
        ckpt = (
            load_policy_checkpoint(
                path, OmegaConf.to_container(cfg.policy, resolve=True), f"checkpoint={cfg.checkpoint}", resume=False
            )
            if cfg.checkpoint
            else None
        )
        # (before the config is copied: the evaluated run's own policy.execute, else the folder's or the recipe's)
        executes = settle_execute(cfg, ckpt["config"]["policy"] if ckpt else None)
        evaluation = cls(cfg, run_folder(cfg, run_dir, resumes=False))
        evaluation._build(path, ckpt, executes)
        return evaluation

    def _build(self, path: Path, ckpt: dict[str, Any] | None, executes: str) -> None:
        """The simulators and the policy, its weights from `ckpt` (a run's checkpoint, read from `path`; None: the
        published weights of policy.checkpoint, `path`); `executes`: where policy.execute came from."""
        cfg, conf = self.cfg, self.conf
        self.ckpt_path, self.ckpt = path, ckpt
        if ckpt is not None:
            adopt_norm_stats(self.ckpt, conf, self.run_dir)  # (the statistics its weights were trained with)
            trained_on = self.ckpt["config"]["env"]
            if (trained_on["name"], trained_on["task"]) != (cfg.env.name, cfg.env.task):
                console.print(
                    f"note: the checkpoint was trained on env={trained_on['name']} env.task="
                    f"{trained_on['task']}; evaluating on env={cfg.env.name} env.task={cfg.env.task}",
                    soft_wrap=True,
                )
        self.device = self.start_device()
        torch.set_num_threads(len(rank_cores(cfg)))  # generation alone: the simulators wait for it
        num_envs = min(cfg.env.num_envs, cfg.eval.episodes)  # no simulator without an episode to run
        self.pool = self.start_pool(num_envs, cfg.seed, episode_seeds=episode_seed(cfg.seed, 0))
        try:
            self.policy = build_policy(
                conf["policy"], self.pool.spec, self.device, weights="given" if self.ckpt else "init"
            )
            if self.ckpt:
                restore_weights(self.policy, self.ckpt, f"checkpoint={cfg.checkpoint}")
            self.policy.eval()  # as generation runs in training (PPOTrainer.update leaves it so)
            line = executed_line(self.policy, executes)
            if line:
                console.print(line, soft_wrap=True, markup=False)
            self.pool.attach(self.policy.execute)
            self.pool.reset_all()  # (env i's episodes from episode i's seed on: episode_seeds)
        except BaseException:
            self.close()
            raise

    def run(self) -> EvalSummary:
        """Run the episodes, write eval.json (and the videos), print the table; always closes the simulators."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            episodes, videos = self._episodes()
        finally:
            self.close()
        n = len(episodes)
        successes = int(sum(e["success"] for e in episodes))
        summary = EvalSummary(
            checkpoint=str(self.ckpt_path),
            iteration=int(self.ckpt["iteration"]) if self.ckpt else 0,
            env_steps=int(self.ckpt["env_steps"]) if self.ckpt else 0,
            episodes=n,
            successes=successes,
            success_rate=successes / n,
            success_ci95=wilson_interval(successes, n),
            mean_return=float(np.mean([e["return"] for e in episodes])),
            mean_length=float(np.mean([e["length"] for e in episodes])),
            wall_s=time.perf_counter() - start,
            videos=videos,
            per_episode=episodes,
            per_task=per_task(episodes),
        )
        (self.run_dir / "eval.json").write_text(json.dumps(asdict(summary), indent=2))
        print_eval(summary, self.run_dir)
        return summary

    def _episodes(self) -> tuple[list[dict[str, float]], list[str]]:
        """eval.episodes complete episodes (env i runs episodes i, i + n, ...), in episode order, and the videos
        written. An env recording a video steps one action at a time, so that every step gives a frame."""
        pool, policy, cfg = self.pool, self.policy, self.cfg
        workers, n, k, total = pool.workers, len(pool.workers), policy.execute, cfg.eval.episodes
        tokens, token_mask = (torch.from_numpy(a) for a in policy.tokenize([w.spec.instruction for w in workers]))
        cameras = sorted(key for key in pool.spec.obs if key.startswith("image/"))
        if cfg.eval.videos and not cameras:
            console.print(
                "no videos saved: env.cameras is empty (e.g. env.cameras=[agentview] records them)",
                soft_wrap=True,
                markup=False,
            )  # (markup would take [agentview] for a style)
        quota = [len(range(i, total, n)) for i in range(n)]
        finished = [0] * n
        results: list[dict[str, float]] = [{} for _ in range(total)]
        videos: list[str] = []

        def frame(obs: dict[str, np.ndarray]) -> np.ndarray:
            return np.concatenate([obs[key] for key in cameras], axis=1)  # the cameras side by side

        def recorded(i: int) -> bool:  # the episode env i runs now is one of the first eval.videos
            return bool(cameras) and finished[i] < quota[i] and i + finished[i] * n < cfg.eval.videos

        frames = {i: [frame(workers[i].obs)] for i in range(n) if recorded(i)}
        bar = ProgressBar(total=total, enabled=cfg.progress, label="eval")
        try:
            while any(done < want for done, want in zip(finished, quota)):
                envs = [i for i in range(n) if finished[i] < quota[i]]
                obs = batch_obs([workers[i].obs for i in envs], tokens, token_mask, envs)
                batch = {key: v.to(self.device) for key, v in obs.items()}
                out = policy.sample(batch, deterministic=True) if cfg.eval.deterministic else policy.sample(batch)
                chunks = out.chunk[:, :k].float().cpu().numpy()
                chunk_of = {i: chunks[row] for row, i in enumerate(envs)}
                pos = dict.fromkeys(envs, 0)  # actions of its chunk each env has executed
                while pos:
                    steps = [0] * n
                    for i, p in pos.items():
                        steps[i] = 1 if i in frames else k - p
                        workers[i].actions[: steps[i]] = chunk_of[i][p : p + steps[i]]
                    pool.submit_all(steps)
                    reports = pool.wait_all()
                    for i in list(pos):
                        r = reports[i]
                        pos[i] += r.executed
                        if i in frames:  # the obs an episode ended on, not the next one's first
                            frames[i].append(frame(r.final_obs if r.done else workers[i].obs))
                        if r.done:  # the rest of the chunk belongs to no episode: the next one decides afresh
                            index = i + finished[i] * n
                            results[index] = {"env": i, "seed": episode_seed(cfg.seed, index), **r.episode}
                            if i in frames:
                                videos += self._write_video(index, r.episode["success"], frames.pop(i))
                            finished[i] += 1
                            if recorded(i):  # (the simulator reset itself, from its next episode's seed)
                                frames[i] = [frame(workers[i].obs)]
                            done = sum(finished)
                            rate = sum(e.get("success", 0.0) for e in results) / done
                            bar.advance(f"success {rate:.0%} of {done}")
                            del pos[i]
                        elif pos[i] == k:
                            del pos[i]
        finally:
            bar.close()
        return results, videos

    def _write_video(self, index: int, success: float, frames: list[np.ndarray]) -> list[str]:
        """videos/episode<index>_<success|failure>.mp4 (H.264), as a path relative to the run folder; [] and one
        console line when it cannot be written (the evaluation goes on)."""
        name = f"videos/episode{index:03d}_{'success' if success else 'failure'}.mp4"
        path = self.run_dir / name
        fps = self.conf["env"].get("control_freq", VIDEO_FPS)
        try:
            import imageio_ffmpeg

            path.parent.mkdir(parents=True, exist_ok=True)
            height, width = frames[0].shape[:2]
            # macro_block_size 2: H.264's 4:2:0 needs even sides only; 16 would rescale e.g. 84 px images
            writer = imageio_ffmpeg.write_frames(
                str(path), (width, height), fps=fps, macro_block_size=2, ffmpeg_log_level="error"
            )
            writer.send(None)  # start ffmpeg
            for f in frames:
                writer.send(np.ascontiguousarray(f))
            writer.close()
        except Exception as e:  # noqa: BLE001  (ImportError, ffmpeg failing: the episode's figures still count)
            reason = " ".join(str(e).split())[:200]
            console.print(f"{name} not written: {type(e).__name__}: {reason}", soft_wrap=True, markup=False)
            return []
        return [name]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
