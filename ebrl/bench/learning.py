"""Does RL raise an SFT checkpoint's success, and how fast under each schedule? `python -m ebrl.bench.learning`.

The start is an SFT checkpoint: by default the one the repository ships for the run's policy and env (made by the
docs/use/demos.md's record and `algo=sft` commands from 5 demos); `--demos N` makes one from nothing first (the
recorder's N episodes, then `--sft-iterations` of algo=sft), `--init <run folder>` takes yours. From it, every algorithm
(`--algos`), seed (`--seeds`) and mode (`--modes`, any `scheduler=` option; ABBA over the seeds, so a drift of the
machine favours none) runs `--iterations` of RL with the same seeds, so each mode sees the same env steps. Extra
arguments are Hydra overrides for every RL run (e.g. env.reward=dense). `--stragglers F` slows a fraction of the envs
(whole GRPO groups) to `--straggler-slowdown` times the physics substeps per action (ebrl.bench.stragglers), the same
task at a lower control rate, so their episodes end later in wall-clock: with `scheduler.max_staleness` below
`scheduler.max_ahead` the quick episodes are the ones that go stale.

Printed, per run: success in the rollouts (the stochastic chain RL trains) over the first and the last 5
iterations with 95% Wilson intervals; with `--eval-episodes` > 0, `mode=eval` success (deterministic sampling, as
users run a policy) of the start and of the run's last checkpoint; where the learning goes (approx KL per action,
clip fraction, the critic's explained variance, means over the run); env steps/s; and the wall-clock and env steps
until the rollout success (a moving mean over 5 iterations) first reached the start's plus each of `--gains`. The
start's success is the mean over every run's first 5 iterations (the same weights: one estimate from all their
episodes). Then per algorithm and mode the means over seeds, and ebrl's time to target over colocated's, seed by seed.
`learning.png` (in `--out`) draws success against env steps and against wall-clock, the mean over seeds per
algorithm and mode.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ebrl.bench.schedulers import compose_overrides, round_order

WINDOW = 5  # iterations of the moving mean, and of the first and last success


@dataclass
class Run:
    """One RL run from the start: its per-iteration figures and what it reached."""

    algo: str
    mode: str
    seed: int
    env_steps: list[float]  # cumulative, per iteration
    seconds: list[float]  # cumulative wall-clock, per iteration
    successes: list[int]  # per iteration
    episodes: list[int]
    approx_kl: float
    clipfrac: float
    explained_variance: float
    env_steps_per_s: float
    eval_after: dict[str, float] = field(default_factory=dict)
    dropped_chunks: float = 0.0  # chunk steps masked out as stale per iteration (max_staleness < max_ahead), mean

    def rate(self, lo: int, hi: int) -> tuple[float, float, float]:
        from ebrl.telemetry.metrics import wilson_interval

        wins, n = sum(self.successes[lo:hi]), sum(self.episodes[lo:hi])
        return (wins / n, *wilson_interval(wins, n)) if n else (math.nan, math.nan, math.nan)

    def moving(self) -> np.ndarray:
        """Success over the last WINDOW iterations' episodes, at each iteration (nan before WINDOW)."""
        s, e = np.cumsum(self.successes, dtype=float), np.cumsum(self.episodes, dtype=float)
        out = np.full(len(s), np.nan)
        for i in range(WINDOW - 1, len(s)):
            wins = s[i] - (s[i - WINDOW] if i >= WINDOW else 0.0)
            n = e[i] - (e[i - WINDOW] if i >= WINDOW else 0.0)
            out[i] = wins / n if n else np.nan
        return out

    def to_target(self, target: float) -> tuple[float, float]:
        """(seconds, env steps) until the moving success first reached `target`; nan if it never did."""
        hit = np.flatnonzero(self.moving() >= target)
        return (self.seconds[hit[0]], self.env_steps[hit[0]]) if len(hit) else (math.nan, math.nan)


def make_start(demos: int, sft_iterations: int, folder: Path, overrides: Sequence[str]) -> Path:
    """Record `demos` episodes of the expert and run algo=sft on them: docs/use/demos.md's commands, in this process,
    with the env overrides among `overrides` (all of them for SFT)."""
    from hydra import compose, initialize_config_dir

    from ebrl.bench.schedulers import CONF
    from ebrl.config import register_configs
    from ebrl.demos.record import record
    from ebrl.runs.sft import SupervisedRun

    register_configs()  # the schemas the env configs' defaults name
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        env = [o for o in overrides if o.split("=")[0] == "env" or o.startswith("env.")]
        cfg = compose("record", overrides=[*env, f"episodes={demos}", f"out={folder / 'demos'}", "progress=false"])
    record(cfg)
    sft = compose_overrides(
        [
            "algo=sft",
            f"demos.path={folder / 'demos'}",
            f"iterations={sft_iterations}",
            "progress=false",
            "logger=none",
            *overrides,
        ]
    )
    SupervisedRun.from_config(sft, run_dir=folder / "sft").train()
    return folder / "sft"


def evaluate(checkpoint: Path, episodes: int, overrides: Sequence[str]) -> dict[str, float]:
    """mode=eval of `checkpoint`: its success with the Wilson interval, deterministic sampling."""
    from ebrl.runs.evaluation import Evaluation

    cfg = compose_overrides(
        [
            "mode=eval",
            f"checkpoint={checkpoint}",
            f"eval.episodes={episodes}",
            "eval.videos=0",
            "progress=false",
            "logger=none",
            *overrides,
        ]
    )
    with tempfile.TemporaryDirectory(prefix="ebrl-eval-") as tmp:
        s = Evaluation.from_config(cfg, run_dir=Path(tmp)).run()
    return {"rate": s.success_rate, "low": s.success_ci95[0], "high": s.success_ci95[1], "episodes": s.episodes}


def run_config(
    algo: str,
    mode: str,
    seed: int,
    start: Path,
    iterations: int,
    overrides: Sequence[str],
    stragglers: tuple[float, int] = (0.0, 1),
) -> Any:
    """One RL run's config; `stragglers` (fraction of the envs, slowdown): that many envs, whole GRPO groups, take
    that many times the physics substeps per action (ebrl.bench.stragglers), so their episodes last longer."""
    from ebrl.bench.stragglers import with_stragglers
    from ebrl.checks import complete_benchmark_tasks
    from ebrl.shape import group_size

    cfg = compose_overrides(
        [
            f"algo={algo}",
            f"init={start}",
            f"seed={seed}",
            f"iterations={iterations}",
            "progress=false",
            "logger=none",
            f"checkpoint_every={iterations}",
            *overrides,
        ],
        mode,
    )
    fraction, slowdown = stragglers
    if not fraction:
        return cfg
    complete_benchmark_tasks(cfg)
    return with_stragglers(cfg, round(fraction * cfg.env.num_envs / group_size(cfg)), None, slowdown)


def run_one(
    algo: str,
    mode: str,
    seed: int,
    start: Path,
    iterations: int,
    eval_episodes: int,
    overrides: Sequence[str],
    stragglers: tuple[float, int] = (0.0, 1),
) -> Run:
    from ebrl.runs.experiment import Experiment

    cfg = run_config(algo, mode, seed, start, iterations, overrides, stragglers)
    with tempfile.TemporaryDirectory(prefix="ebrl-learning-") as tmp:
        summary = Experiment.from_config(cfg, run_dir=Path(tmp)).train()
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        after = evaluate(Path(tmp), eval_episodes, overrides) if eval_episodes else {}

    def mean(key: str) -> float:
        values = [r[key] for r in rows if key in r and not r.get("train/critic_only")]
        return float(np.mean(values)) if values else math.nan

    return Run(
        algo,
        mode,
        seed,
        env_steps=[float(r["env_steps"]) for r in rows],
        seconds=list(np.cumsum([r["time/iteration_s"] for r in rows])),
        successes=[round(r.get("env/successes", 0)) for r in rows],
        episodes=[round(r.get("env/episodes", 0)) for r in rows],
        approx_kl=mean("train/approx_kl"),
        clipfrac=mean("train/clipfrac"),
        explained_variance=mean("train/explained_variance"),
        env_steps_per_s=summary.rollout_steps_per_s,
        eval_after=after,
        dropped_chunks=float(np.mean([r.get("sched/dropped_chunks", 0.0) for r in rows])),
    )


def pct(rate: float, low: float = math.nan, high: float = math.nan) -> str:
    if rate != rate:
        return "n/a"
    return f"{rate:.0%}" + (f" ({low:.0%}-{high:.0%})" if low == low else "")


def plot(runs: list[Run], path: Path, target: float) -> Path | None:
    """Success (moving mean) against env steps and against wall-clock, the mean over seeds per algo and mode."""
    from ebrl.telemetry.plots import plot_lines

    by_steps: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    by_time: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for algo, mode in sorted({(r.algo, r.mode) for r in runs}):
        mine = [r for r in runs if (r.algo, r.mode) == (algo, mode)]
        span = slice(WINDOW - 1, min(len(r.successes) for r in mine))  # the moving mean starts at WINDOW
        y = np.nanmean([r.moving()[span] for r in mine], axis=0)
        by_steps[f"{algo} {mode}"] = (np.mean([r.env_steps[span] for r in mine], axis=0), y)
        by_time[f"{algo} {mode}"] = (np.mean([r.seconds[span] for r in mine], axis=0), y)
    first = plot_lines(
        path.with_name(path.stem + "_steps.png"),
        by_steps,
        "env steps",
        "success (rollouts)",
        f"success over {WINDOW} iterations, mean over seeds (target {target:.0%})",
        ylim=(0, 1),
    )
    plot_lines(
        path.with_name(path.stem + "_wallclock.png"),
        by_time,
        "seconds of RL",
        "success (rollouts)",
        f"success over {WINDOW} iterations, mean over seeds (target {target:.0%})",
        ylim=(0, 1),
    )
    return first


def report(runs: list[Run], gains: Sequence[float], before: dict[str, float], out: Path) -> dict[str, Any]:
    """The tables (see the module docstring); returns what learning.json holds."""
    pooled = [(sum(r.successes[:WINDOW]), sum(r.episodes[:WINDOW])) for r in runs]
    start = sum(s for s, _ in pooled) / max(1, sum(n for _, n in pooled))
    targets = [start + g for g in gains]
    print(
        f"\nstart: rollout success {start:.1%} over every run's first {WINDOW} iterations "
        f"({sum(n for _, n in pooled)} episodes); targets {', '.join(f'{t:.0%}' for t in targets)}"
        + (
            f"; mode=eval of the start (deterministic): {pct(before['rate'], before['low'], before['high'])} over "
            f"{before['episodes']} episodes"
            if before
            else ""
        )
    )
    heads = " | ".join(f"s (env steps) to +{g:.0%}" for g in gains)
    print(
        f"| algo | mode | seed | success first {WINDOW} it. | last {WINDOW} it. | eval after | approx KL | clipfrac "
        f"| expl. var | env steps/s | stale chunk steps/it. | {heads} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(gains))
    for r in runs:
        n = len(r.successes)
        after = pct(r.eval_after["rate"], r.eval_after["low"], r.eval_after["high"]) if r.eval_after else "-"
        times = " | ".join("-" if t != t else f"{t:.0f} ({k:,.0f})" for t, k in (r.to_target(x) for x in targets))
        print(
            f"| {r.algo} | {r.mode} | {r.seed} | {pct(*r.rate(0, WINDOW))} | {pct(*r.rate(n - WINDOW, n))} | "
            f"{after} | {r.approx_kl:.3f} | {r.clipfrac:.3f} | {r.explained_variance:.2f} | "
            f"{r.env_steps_per_s:.1f} | {r.dropped_chunks:.1f} | {times} |"
        )
    print()
    for algo in sorted({r.algo for r in runs}):
        for mode in sorted({r.mode for r in runs if r.algo == algo}):
            mine = [r for r in runs if (r.algo, r.mode) == (algo, mode)]
            last = [r.rate(len(r.successes) - WINDOW, len(r.successes))[0] for r in mine]
            evals = [r.eval_after["rate"] for r in mine if r.eval_after]
            reached = []
            for g, t in zip(gains, targets):
                hits = [r.to_target(t)[0] for r in mine if r.to_target(t)[0] == r.to_target(t)[0]]
                mean = f" (mean {np.mean(hits):.0f} s)" if hits else ""
                reached.append(f"+{g:.0%} in {len(hits)}/{len(mine)}{mean}")
            print(
                f"{algo} {mode}: success last {WINDOW} iterations {np.mean(last):.1%} (from {start:.1%}) over "
                f"{len(mine)} seeds"
                + (f", eval after {np.mean(evals):.1%}" if evals else "")
                + f"; reached {', '.join(reached)}"
            )
        for g, t in zip(gains, targets):
            ratios = []
            for seed in sorted({r.seed for r in runs if r.algo == algo}):
                pair = {r.mode: r.to_target(t)[0] for r in runs if (r.algo, r.seed) == (algo, seed)}
                if {"colocated", "ebrl"} <= set(pair) and all(v == v for v in (pair["colocated"], pair["ebrl"])):
                    ratios.append(pair["ebrl"] / pair["colocated"])
            if ratios:
                print(
                    f"{algo}: ebrl's wall-clock to +{g:.0%} / colocated's, the seeds where both reached it: "
                    f"{', '.join(f'{x:.2f}' for x in ratios)} (median {np.median(ratios):.2f})"
                )
    figure = plot(runs, out / "learning.png", targets[-1])
    if figure:
        print(f"plots: {figure} and {figure.with_name('learning_wallclock.png')}")
    return {"start": start, "targets": targets, "eval_before": before, "runs": [asdict(r) for r in runs]}


def earlier_runs(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return data["runs"] if isinstance(data, dict) else data


def main(argv: Sequence[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["colocated", "ebrl"])
    parser.add_argument("--algos", nargs="+", default=["ppo", "grpo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--iterations", type=int, default=300, help="of RL per run (colocated: about 12 min here)")
    parser.add_argument(
        "--gains",
        nargs="+",
        type=float,
        default=[0.1, 0.2, 0.3],
        help="success above the start whose wall-clock is measured",
    )
    parser.add_argument("--init", type=Path, default=None, help="the start (a run folder); default: the shipped one")
    parser.add_argument("--demos", type=int, default=0, help="> 0: record this many demos and run SFT first")
    parser.add_argument("--sft-iterations", type=int, default=20)
    parser.add_argument("--eval-episodes", type=int, default=50, help="mode=eval before and after; 0: none")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder of learning.json and the plots")
    parser.add_argument(
        "--add",
        type=Path,
        nargs="+",
        default=[],
        help="runs.json or learning.json of earlier runs from the same start (more seeds) to report with",
    )
    parser.add_argument(
        "--stragglers",
        type=float,
        default=0.0,
        help="fraction of the envs (whole GRPO groups) that take --straggler-slowdown times the "
        "physics substeps per action, 0..1",
    )
    parser.add_argument("--straggler-slowdown", type=int, default=4)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if not 0 <= args.stragglers <= 1:
        parser.error(f"--stragglers={args.stragglers}: a fraction of the envs, 0..1")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ebrl-start-") as tmp:
        start = make_start(args.demos, args.sft_iterations, Path(tmp), args.overrides) if args.demos else args.init
        if start is None:
            from ebrl.runs.init import shipped_for

            start = shipped_for(compose_overrides(list(args.overrides)))
            if start is None:
                parser.error("no shipped SFT checkpoint fits these overrides; give --init <run folder> or --demos N")
        before = evaluate(start, args.eval_episodes, args.overrides) if args.eval_episodes else {}
        runs = [Run(**r) for path in args.add for r in earlier_runs(path)]
        for algo in args.algos:
            for i, seed in enumerate(args.seeds):
                for mode in round_order(args.modes, i):
                    runs.append(
                        run_one(
                            algo,
                            mode,
                            seed,
                            start,
                            args.iterations,
                            args.eval_episodes,
                            args.overrides,
                            (args.stragglers, args.straggler_slowdown),
                        )
                    )
                    r, n = runs[-1], len(runs[-1].successes)
                    print(
                        f"{algo} {mode} seed {seed}: success {pct(*r.rate(0, WINDOW))} -> "
                        f"{pct(*r.rate(n - WINDOW, n))} in {r.seconds[-1]:.0f} s",
                        flush=True,
                    )
                    # what has run so far, should a later run fail
                    (args.out / "runs.json").write_text(json.dumps([asdict(x) for x in runs]))
    origin = f"SFT on {args.demos} demos" if args.demos else str(start)
    print(f"\n{args.iterations} iterations of RL per run, from {origin}")
    figures = report(runs, args.gains, before, args.out)
    (args.out / "learning.json").write_text(json.dumps(figures, indent=2))
    return runs


if __name__ == "__main__":
    from ebrl.runtime.errors import benchmark_main

    benchmark_main(main, "learning")
