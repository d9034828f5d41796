"""Many tasks of one benchmark in one run (`env.tasks`): which env runs which task, and one spec for all of them.

Envs are assigned to tasks by unit: a unit is one env, or under GRPO one group of `algo.group_size` envs, so that a
group never mixes tasks. Units go to tasks round-robin (`env.tasks=[Lift,Stack]`: Lift, Stack, Lift, ...), or in
proportion to `env.task_weights` (largest remainders, then interleaved so that every iteration's groups mix tasks).
`env.tasks=all` asks the adapter class for its benchmark's list (`EnvAdapter.all_tasks`: a LIBERO suite's).

Tasks of one benchmark may observe different state sizes (robosuite's object state) and act with different action
sizes; `joint_spec` is the widest of each, and a worker pads its state with zeros and reads its own action dims
(`ebrl/envs/process.py`). Each env keeps its own instruction.

A task may be of another benchmark: an entry `{env: libero, task: "3"}` that the config completes into that
benchmark's whole env config (ebrl/checks.py, `complete_benchmark_tasks`). Its envs run its adapter under its own
interpreter beside the run's; its name in metrics is "libero:3" (`task_label`), and `task_config` is an env's config.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from ebrl.classes import load_class
from ebrl.envs.base import ArraySpec, EnvSetupError, EnvSpec


def task_label(entry: Any) -> str:
    """A task's name in metrics and in the pool: its own for a task of the run's benchmark, "<env>:<task>" for an
    entry of another (a completed env config)."""
    if isinstance(entry, Mapping):
        if "_target_" not in entry:
            raise EnvSetupError(
                f"env.tasks entry {dict(entry)} is not completed into its benchmark's config (run it "
                "through ebrl.config.validate, or give a task name)"
            )
        return f"{entry['name']}:{entry['task']}"
    return str(entry)


def task_config(env_cfg: dict[str, Any], task: str) -> dict[str, Any]:
    """The env config of an env that runs `task` (a label) in a multi-task run: the run's with env.task set, or the
    config of the other benchmark's entry (the run's env.tasks, its env's fault, for tests, and its episode seeds
    kept)."""
    for entry in env_cfg["tasks"] if isinstance(env_cfg.get("tasks"), Sequence) else ():
        if isinstance(entry, Mapping) and task_label(entry) == task:
            kept = {k: env_cfg[k] for k in ("fault", "episode_seeds") if k in env_cfg}
            return {**entry, **kept, "tasks": env_cfg["tasks"]}
    return {**env_cfg, "task": task}


def task_list(env_cfg: dict[str, Any]) -> list[str] | None:
    """env.tasks as a list of task labels (env.tasks=all resolved by the adapter class), or None for one task."""
    tasks = env_cfg.get("tasks")
    if tasks is None:
        return None
    if tasks == "all":
        cls = load_class(env_cfg["_target_"], "env._target_")
        listed = getattr(cls, "all_tasks", None)
        names = listed(env_cfg) if listed is not None else None
        if not names:
            raise EnvSetupError(
                f"env.tasks=all: env={env_cfg.get('name')} has no task list of its own (LIBERO's "
                "suites have); list the tasks: env.tasks=[Lift,Stack]"
            )
        return [str(t) for t in names]
    if isinstance(tasks, str) or not isinstance(tasks, Sequence) or not tasks:
        raise EnvSetupError(f"env.tasks={tasks!r} must be a non-empty list of tasks (env.tasks=[Lift,Stack]) or all")
    return [task_label(t) for t in tasks]


def assign_tasks(env_cfg: dict[str, Any], num_envs: int, group_size: int = 1) -> list[str] | None:
    """The task of each of `num_envs` envs, a unit of `group_size` envs at a time; None without env.tasks."""
    tasks = task_list(env_cfg)
    if tasks is None:
        return None
    units = num_envs // group_size
    if units < len(tasks):
        what = f"{units} groups of algo.group_size={group_size}" if group_size > 1 else f"env.num_envs={num_envs}"
        raise EnvSetupError(
            f"env.tasks has {len(tasks)} tasks and the run has {what}: each task needs at least one; "
            f"give env.num_envs={len(tasks) * group_size} or more"
        )
    weights = env_cfg.get("task_weights")
    if weights is None:
        per_unit = [tasks[u % len(tasks)] for u in range(units)]
    else:
        per_unit = weighted_units(tasks, [float(w) for w in weights], units)
    return [per_unit[i // group_size] for i in range(num_envs)]


def weighted_units(tasks: list[str], weights: list[float], units: int) -> list[str]:
    """`units` units split over `tasks` in proportion to `weights` (each task at least one; largest remainders),
    interleaved: the task whose share is least filled so far takes the next unit."""
    if len(weights) != len(tasks) or any(w <= 0 for w in weights):
        raise EnvSetupError(
            f"env.task_weights={weights} must give one positive weight per task of env.tasks ({len(tasks)})"
        )
    total = sum(weights)
    exact = [units * w / total for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > units:  # the at-least-one floor overshot: take from the most over-served
        counts[max((t for t in range(len(tasks)) if counts[t] > 1), key=lambda t: counts[t] - exact[t])] -= 1
    for t in sorted(range(len(tasks)), key=lambda t: counts[t] - exact[t])[: units - sum(counts)]:
        counts[t] += 1
    out, given = [], [0] * len(tasks)
    for _ in range(units):
        t = min((t for t in range(len(tasks)) if given[t] < counts[t]), key=lambda t: (given[t] + 1) / counts[t])
        given[t] += 1
        out.append(tasks[t])
    return out


def joint_spec(specs: Sequence[EnvSpec]) -> EnvSpec:
    """One spec for envs of several tasks: the same observation keys, the widest state, the widest action, the
    longest episode; the first env's instruction (each env keeps its own). One line where they cannot be joined."""
    first = specs[0]
    for i, spec in enumerate(specs[1:], 1):
        if set(spec.obs) != set(first.obs):
            raise EnvSetupError(
                f"sim worker {i} observes {sorted(spec.obs)}, worker 0 {sorted(first.obs)}: the envs "
                "of one run must observe the same keys (the same env.cameras)"
            )
        for key, a in spec.obs.items():
            b = first.obs[key]
            if a.dtype != b.dtype or (key != "state" and a.shape != b.shape):
                raise EnvSetupError(
                    f"sim worker {i} gives {key} as {a}, worker 0 as {b}: only the state's size may "
                    "differ between tasks"
                )
    state = max(s.obs["state"].shape[0] for s in specs) if "state" in first.obs else None
    obs = dict(first.obs)
    if state is not None:
        obs["state"] = ArraySpec((state,), first.obs["state"].dtype)
    return replace(
        first,
        obs=obs,
        action_dim=max(s.action_dim for s in specs),
        max_episode_steps=max(s.max_episode_steps for s in specs),
        action_low=min(s.action_low for s in specs),
        action_high=max(s.action_high for s in specs),
    )
