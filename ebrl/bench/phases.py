"""How far a policy's robosuite Lift episodes get: reach, touch, squeeze, raise, success, lift.
`python -m ebrl.bench.phases`.

Success says which episodes lifted the cube; this says where the others stopped, read from the simulator's state at
every step (privileged: what the policy sees only through its observation). An episode
- reached: its end effector came within REACH_M of the cube's centre (closed fingers resting on the cube's top stop
  about 2.5 cm above it, fingers around it reach it);
- touched: robosuite's grasp check held at some step (both finger pads in contact with the cube): what the grasp
  term of Lift's shaped reward pays for (`env.grasp=contact`);
- squeezed: a squeeze held at some step (each pad pushing on the cube along the line between the pads:
  `env.grasp=squeeze`, ebrl/envs/robosuite_env.py);
- raised: the cube rose RAISED_M above where it rested after the first step (success: its centre 4 cm over the
  table, 2 cm over where it rests);
- succeeded: robosuite's success at some step (the cube's centre 4 cm over the table), whatever env.grasp says;
- lifted: that success while squeezed (`env.grasp=squeeze`'s success on Lift): a cube pressed into the table springs
  over the height for a step or two when the fingers let go, which robosuite's success counts.
Then per decision (every `policy.execute` steps; the expert's every 8, as the tiny preset's chunk; and the last step)
the means over the episodes: the end effector's distance to the cube, the finger pads' separation, the cube's rise,
and the shares touching and squeezing.

    python -m ebrl.bench.phases checkpoint=<run folder> [overrides ...] [--episodes 64] [--stochastic]
    python -m ebrl.bench.phases --expert [overrides ...]

The overrides are the run's (`experiment=lift_scratch_ppo_32envs`): they give the env and the policy as mode=eval
builds them, which loads the checkpoint. The episodes run in this process, `--envs` envs at a time with one batched
generation per decision, from evaluation's reset seeds (`episode_seed`), for `env.max_episode_steps` steps each
(success does not cut them short here). The policy acts deterministically, as mode=eval does, unless `--stochastic`
(the chain RL samples in its rollouts). `--expert`: the scripted expert the demonstrations are recorded with
(ebrl/envs/experts.py), an episode that lifts, for reference.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any, Callable, Sequence

import numpy as np

REACH_M = 0.02
RAISED_M = 0.015  # above a cube tipped onto its edge (0.8 cm) or bounced off the table, below success (2 cm)
PHASES = ("reached", "touched", "squeezed", "raised", "succeeded", "lifted")
TRACES = ("distance", "pad_separation", "rise", "touching", "squeezing")


class LiftProbe:
    """Reads one robosuite Lift adapter's state after each step: the figures PHASES and TRACES are made of."""

    def __init__(self, adapter: Any) -> None:
        from ebrl.envs.robosuite_env import squeeze_check

        env = adapter.env
        self.adapter, self.env = adapter, env
        self.gripper = env.robots[0].gripper["right"]
        self.contact = type(env)._check_grasp.__get__(env)  # robosuite's own, whatever env.grasp installed
        self.squeeze = squeeze_check(env)
        self.success = type(env)._check_success.__get__(env)  # robosuite's own, whatever env.grasp installed
        self.pads = [
            env.sim.model.geom_name2id(self.gripper.important_geoms[s][0])
            for s in ("left_fingerpad", "right_fingerpad")
        ]
        self.start_height: float | None = None

    def begin(self) -> None:
        self.start_height = None  # (the cube settles onto the table in the first step: the rise counts from there)

    def read(self) -> dict[str, float]:
        env, data = self.env, self.env.sim.data
        cube = data.body_xpos[env.cube_body_id]
        eef = data.site_xpos[env.robots[0].eef_site_id["right"]]
        if self.start_height is None:
            self.start_height = float(cube[2])
        return {
            "distance": float(np.linalg.norm(cube - eef)),
            "pad_separation": float(np.linalg.norm(data.geom_xpos[self.pads[0]] - data.geom_xpos[self.pads[1]])),
            "rise": float(cube[2]) - self.start_height,
            "touching": float(self.contact(self.gripper, env.cube)),
            "squeezing": float(self.squeeze(self.gripper, env.cube)),
            "success": float(self.success()),
        }


def phases_of(trace: list[dict[str, float]]) -> dict[str, bool]:
    """Which PHASES one episode's per-step readings reached."""
    return {
        "reached": min(r["distance"] for r in trace) < REACH_M,
        "touched": any(r["touching"] for r in trace),
        "squeezed": any(r["squeezing"] for r in trace),
        "raised": max(r["rise"] for r in trace) > RAISED_M,
        "succeeded": any(r["success"] for r in trace),
        "lifted": any(r["success"] and r["squeezing"] for r in trace),
    }


def run_episodes(
    adapters: list[Any],
    act: Callable[[list[dict[str, np.ndarray]], bool], np.ndarray],
    episodes: int,
    seeds: Sequence[int],
    steps: int,
    execute: int,
) -> list[list[dict[str, float]]]:
    """`episodes` episodes of `steps` steps on the adapters, len(adapters) at a time; `act(observations, first)`
    gives the first n adapters' next `execute` actions (an (n, >= execute, action_dim) array; `first`: at their
    episodes' start). Each episode's per-step readings."""
    probes = [LiftProbe(a) for a in adapters]
    traces: list[list[dict[str, float]]] = []
    for first in range(0, episodes, len(adapters)):
        batch = probes[: min(len(adapters), episodes - first)]
        obs = [p.adapter.reset(seed=seeds[first + i]) for i, p in enumerate(batch)]
        for p in batch:
            p.begin()
        round_traces: list[list[dict[str, float]]] = [[] for _ in batch]
        for t in range(0, steps, execute):
            actions = act(obs, t == 0)
            for j in range(min(execute, steps - t)):
                for i, p in enumerate(batch):
                    obs[i] = p.adapter.step(actions[i, j])[0]
                    round_traces[i].append(p.read())
        traces += round_traces
    return traces


def summary(traces: list[list[dict[str, float]]], every: int) -> dict[str, Any]:
    """The episodes reaching each phase, and the means of TRACES every `every` steps and at the last."""
    phases = [phases_of(t) for t in traces]
    steps = len(traces[0])
    at = sorted({*range(0, steps, every), steps - 1})
    return {
        "episodes": len(traces),
        "phases": {k: int(sum(p[k] for p in phases)) for k in PHASES},
        "steps": [s + 1 for s in at],
        "traces": {k: [float(np.mean([t[s][k] for t in traces])) for s in at] for k in TRACES},
    }


def policy_actor(cfg: Any, instruction: str, rows: int, stochastic: bool) -> tuple[Callable, int]:
    """The checkpoint's policy as mode=eval builds and loads it from `cfg` (composed with mode=eval), as
    act(observations, first) for `run_episodes` on up to `rows` envs, and the actions it executes per chunk."""
    import torch

    from ebrl.rl.rollout import batch_obs
    from ebrl.runs.evaluation import Evaluation

    # (evaluation starts one simulator, whose spec shapes the policy; the episodes here read the simulator's state,
    # so they run in this process. Its folder holds only the statistics the policy read as it was built.)
    with tempfile.TemporaryDirectory(prefix="ebrl-phases-") as folder:
        evaluation = Evaluation.from_config(cfg, folder)
        evaluation.close()
    policy, device = evaluation.policy, evaluation.device
    tokens, mask = (torch.from_numpy(a) for a in policy.tokenize([instruction] * rows))

    def act(observations: list[dict[str, np.ndarray]], first: bool) -> np.ndarray:
        envs = list(range(len(observations)))
        batch = batch_obs(observations, tokens[envs], mask[envs], envs)
        out = policy.sample({k: v.to(device) for k, v in batch.items()}, deterministic=not stochastic)
        return out.chunk.float().cpu().numpy()

    return act, int(policy.execute)


def expert_actor(adapters: list[Any]) -> Callable:
    """The scripted expert of each adapter (it reads the state), one action per call, as act(observations, first)."""
    from ebrl.envs.experts import make_expert

    experts = [make_expert("robosuite", "Lift", a) for a in adapters]

    def act(observations: list[dict[str, np.ndarray]], first: bool) -> np.ndarray:
        out = []
        for e in experts[: len(observations)]:
            if first:
                e.reset()
            out.append(e.act()[None])
        return np.stack(out)

    return act


def print_summary(label: str, s: dict[str, Any]) -> None:
    n = s["episodes"]
    print(f"{label}: {n} episodes")
    print("| " + " | ".join(PHASES) + " |")
    print("|" + "---|" * len(PHASES))
    print("| " + " | ".join(f"{s['phases'][k]} ({100 * s['phases'][k] / n:.0f}%)" for k in PHASES) + " |")
    print("| step | " + " | ".join(TRACES) + " |")
    print("|" + "---|" * (len(TRACES) + 1))
    for i, step in enumerate(s["steps"]):
        print(f"| {step} | " + " | ".join(f"{s['traces'][k][i]:.3f}" for k in TRACES) + " |")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--envs", type=int, default=16, help="envs stepped at once in this process")
    parser.add_argument("--stochastic", action="store_true", help="sample the chain as rollouts do")
    parser.add_argument("--expert", action="store_true", help="the scripted expert instead of a checkpoint")
    parser.add_argument("--json", help="also write the summary here")
    parser.add_argument("overrides", nargs="*", help="the run's Hydra overrides, checkpoint=<run folder> among them")
    args = parser.parse_args(argv)
    from ebrl.envs.process import build_adapter
    from ebrl.runs.evaluation import episode_seed
    from ebrl.runtime.errors import exit_cleanly

    with exit_cleanly("the benchmark phases"):
        from omegaconf import OmegaConf

        from ebrl.bench.memory import compose
        from ebrl.config import ConfigError

        if args.episodes < 1 or args.envs < 1:
            raise ConfigError(f"--episodes {args.episodes} and --envs {args.envs} must both be at least 1")
        evaluates = [] if args.expert else ["mode=eval", "eval.episodes=1", "eval.videos=0", "env.num_envs=1"]
        cfg = compose(*args.overrides, *evaluates)
        if (cfg.env.name, cfg.env.task) != ("robosuite", "Lift"):
            raise ConfigError(
                f"the phases benchmark reads robosuite Lift's state; env={cfg.env.name} env.task={cfg.env.task} "
                "is not it (use env=robosuite env.task=Lift)"
            )
        env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
        adapters = [build_adapter(env_cfg, seed=i) for i in range(min(args.envs, args.episodes))]
        try:
            if args.expert:
                act, execute = expert_actor(adapters), 1
            else:
                act, execute = policy_actor(cfg, adapters[0].spec.instruction, len(adapters), args.stochastic)
            seeds = [episode_seed(int(cfg.seed), j) for j in range(args.episodes)]
            traces = run_episodes(adapters, act, args.episodes, seeds, int(env_cfg["max_episode_steps"]), execute)
        finally:
            for a in adapters:
                a.close()
        s = summary(traces, execute if execute > 1 else 8)
        label = "the scripted expert" if args.expert else " ".join(args.overrides)
        print_summary(f"{label}{' (stochastic)' if args.stochastic else ''}", s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=2)
    return s


if __name__ == "__main__":
    main()
