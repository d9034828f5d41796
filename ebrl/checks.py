"""The checks a composed config passes before anything starts (`validate`), and what it completes from the machine and
the benchmark: every value that composes but makes no sense is rejected with one line naming the key and what would be
right (`ConfigError`, ebrl/config.py's schemas hold the types).
"""

from __future__ import annotations

import os
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, ValidationError

from ebrl.config import (
    ALGO_SCHEMAS,
    CONF_DIR,
    CORE_ORDERS,
    ENV_SCHEMAS,
    GENERATION_PLACES,
    SHAPED_DENSE,
    SHARED_OBSERVATION,
    TRAINER_PLACES,
    ConfigError,
    EnvConfig,
    PolicyConfig,
)
from ebrl.envs.base import REWARDS
from ebrl.envs.robosuite_env import GRASPS
from ebrl.errors import BadInput
from ebrl.node import PARTITIONS, Ranks, cuda_device_count, share_of_node
from ebrl.shape import RolloutShape


def _positive(cfg: DictConfig, key: str) -> None:
    value = cfg_get(cfg, key)
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value} must be a positive number")


def cfg_get(cfg: Any, dotted: str, default: Any = MISSING) -> Any:
    """cfg["a"]["b"] for "a.b"; `default` where a key is absent (without one, absence raises KeyError)."""
    node = cfg
    for part in dotted.split("."):
        if default is not MISSING and part not in node:
            return default
        node = node[part]
    return node


SCHEDULERS = ("colocated", "disaggregated", "hybrid", "async", "ebrl")
ALLOCATORS = ("static", "elastic")
ALGOS = tuple(ALGO_SCHEMAS)  # ppo, grpo, sft: conf/algo, each checked by its ALGO_CHECKS entry
LOGGERS = ("none", "wandb")
LOGPROBS = ("flow_noise", "flow_sde")
CHAIN_LOGPROBS = ("sum", "mean", "one_step")
LOGPROB_LEVELS = ("action", "chunk", "chain")  # algo.logprob_level: what one PPO ratio is over (rl/ppo.py)
PROXIMAL = ("stale", "all")  # algo.proximal: which rows a decoupled update's proximal pass values
PRESETS = ("tiny", "small", "full")
VARIANTS = ("pi0", "pi05")
DTYPES = ("float32", "bfloat16")
TRAIN_OPTIONS = ("all", "action_expert", "lora")


def _one_of(cfg: DictConfig, key: str, accepted: tuple[str, ...]) -> None:
    value = cfg_get(cfg, key)
    if value not in accepted:
        raise ConfigError(f"{key}={value!r} is not available; accepted: {', '.join(accepted)}")


def runs_on_cuda(cfg: Any) -> bool:
    """Whether the policy runs on a GPU: device=cuda, or device=auto on hw with GPUs."""
    return cfg.device == "cuda" or (cfg.device == "auto" and cfg.hw.gpus > 0)


def policy_dtype_name(policy: Any, cuda: bool) -> str:
    """policy.dtype, or bfloat16 for the full preset and for CUDA, float32 otherwise (tiny and small on CPU)."""
    name = policy.get("dtype")
    if name is None:
        name = "bfloat16" if policy.get("preset") == "full" or cuda else "float32"
    return name


def available_cpu_cores() -> int:
    return len(os.sched_getaffinity(0))


def rank_cores(cfg: Any) -> list[int]:
    """The CPU cores this rank may use: its share (ranks of one node split them) of the node's hw.cpu_cores, taken
    from those this process may run on (all of them when null). One rank, as `python run.py` is: all of them."""
    return share_of_node(sorted(os.sched_getaffinity(0))[: cfg.hw.cpu_cores or available_cpu_cores()], Ranks.from_env())


def complete_user_classes(cfg: DictConfig) -> None:
    """A user's env or policy yaml (one that names no schema of ours) merged onto a schema made from the shared
    EnvConfig / PolicyConfig and its class's constructor (ebrl/classes.py), its class checked against the contract;
    ours are left as they are. Idempotent: a completed node is typed."""
    from ebrl.classes import ContractError, base_named, complete, load_class, missing_methods

    if OmegaConf.get_type(cfg, "env") is dict:
        from ebrl.envs.process import NOT_ADAPTER_ARGS, load_adapter_class

        target = cfg_get(cfg, "env._target_", None)
        if not target:
            raise ConfigError(
                "env has no _target_: name your adapter class (_target_: my_module.MyEnv) in your env "
                "yaml, or pick one of ours (env=robosuite, maniskill, libero, robocasa)"
            )
        try:
            cls = load_adapter_class(target)
        except BadInput as e:
            raise ConfigError(str(e)) from None
        cfg.env = complete(cfg.env, cls, EnvConfig, "env", ("seed",), NOT_ADAPTER_ARGS)
    if OmegaConf.get_type(cfg, "policy") is dict:
        target = cfg_get(cfg, "policy._target_", None)
        if not target:
            raise ConfigError(
                "policy has no _target_: name your policy class (_target_: my_module.MyPolicy) in your "
                "policy yaml, or pick one of ours (policy=openpi, openvla_oft, gr00t, wam)"
            )
        cls = load_class(target, "policy._target_")
        base = base_named(cls, "ebrl.policies.base.Policy")  # by name: this layer does not import the policies
        if base is None:
            raise ContractError(f"policy._target_={target!r} is not an ebrl.policies.base.Policy subclass")
        needed = ["sample", "evaluate", "value", "tokenize"]
        train = cfg_get(cfg, "policy.train", "all")
        needed += {"action_expert": ["rl_heads", "action_expert"], "lora": ["rl_heads", "lora_targets"]}.get(train, [])
        if cfg_get(cfg, "algo.name", "") == "sft":
            needed.append("supervised_loss")
        for method in missing_methods(cls, base, needed):
            raise ContractError(
                f"policy._target_={target!r} does not implement {method}, which "
                f"{'algo=sft' if method == 'supervised_loss' else 'the runtime'} calls: a policy "
                f"implements {POLICY_CONTRACT}"
            )
        cfg.policy = complete(cfg.policy, cls, PolicyConfig, "policy", ("env_spec",), POLICY_RUNTIME_KEYS)


def complete_benchmark_tasks(cfg: DictConfig) -> None:
    """env.tasks entries of another benchmark (`{env: libero, task: "3"}`, with any of its keys: `suite`) become that
    benchmark's whole env config: its schema, its conf/env yaml, the run's SHARED_OBSERVATION keys, the entry's own
    (ebrl/envs/tasks.py runs each under its interpreter). Idempotent: a completed entry names its _target_."""
    tasks = cfg_get(cfg, "env.tasks", None)
    if not isinstance(tasks, ListConfig):
        return
    done = []
    for entry in tasks:
        if not isinstance(entry, DictConfig) or "_target_" in entry:
            done.append(entry)
            continue
        option = entry.get("env")
        if option not in ENV_SCHEMAS:
            raise ConfigError(
                f"env.tasks entry {OmegaConf.to_container(entry)} must name a benchmark as env: one of "
                f"{', '.join(ENV_SCHEMAS)} (with its task: {{env: libero, task: '0'}})"
            )
        own = OmegaConf.load(CONF_DIR / "env" / f"{option}.yaml")
        own.pop("defaults", None)
        keys = {k: v for k, v in entry.items() if k != "env"}
        shared = {k: cfg.env[k] for k in SHARED_OBSERVATION}
        schema = OmegaConf.structured(ENV_SCHEMAS[option])
        try:
            node = OmegaConf.merge(schema, own, shared, keys)
        except ConfigKeyError as e:
            raise ConfigError(
                f"env.tasks entry of env={option}: {e.key} is not one of its keys ("
                f"{', '.join(k for k in schema if k != 'fault')})"
            ) from None
        except ValidationError as e:
            raise ConfigError(f"env.tasks entry of env={option}: {str(e).splitlines()[0]}") from None
        done.append(OmegaConf.to_container(node, resolve=True))
    with open_dict(cfg.env):
        cfg.env.tasks = done


# policy.* keys the runtime applies (ebrl/policies/build.py); the rest are the family constructor's arguments
POLICY_RUNTIME_KEYS = (
    "_target_",
    "name",
    "checkpoint",
    "dtype",
    "train",
    "lora_rank",
    "lora_alpha",
    "grad_checkpoint",
    "execute",
    "capture",
)
POLICY_CONTRACT = (
    "__init__(env_spec, ...) setting chunk_len, sample(obs) -> PolicySample, evaluate(obs, chunk, "
    "extras) -> (log_prob, entropy, value), value(obs) -> (B,), tokenize(texts) -> (tokens, mask)"
)


def validate(cfg: DictConfig) -> None:
    """Reject values that compose but cannot work, with one line; checks what this machine can satisfy."""
    complete_user_classes(cfg)
    complete_benchmark_tasks(cfg)
    _check_mappings(cfg)
    for key in ("env.num_envs", "env.max_episode_steps", "env.image_size", "iterations", "checkpoint_every"):
        _positive(cfg, key)
    # (policy.execute: checked once against the policy's chunk, as it is built: ebrl/policies/build.py)
    for key in ("policy.chunk", "policy.denoise_steps", "scheduler.torch_threads", "hw.cpu_cores"):
        if cfg_get(cfg, key, None) is not None:
            _positive(cfg, key)
    _one_of(cfg, "scheduler.name", SCHEDULERS)
    _one_of(cfg, "allocator.name", ALLOCATORS)
    _one_of(cfg, "algo.name", ALGOS)
    _one_of(cfg, "logger.name", LOGGERS)
    _one_of(cfg, "policy.preset", PRESETS)
    if "logprob" in cfg.policy:  # the flow families
        _one_of(cfg, "policy.logprob", LOGPROBS)
        _one_of(cfg, "policy.chain_logprob", CHAIN_LOGPROBS)
        if not 0 < cfg.policy.noise_std_min <= cfg.policy.noise_std_max:
            raise ConfigError(
                f"policy.noise_std_min={cfg.policy.noise_std_min} and policy.noise_std_max={cfg.policy.noise_std_max} "
                "must satisfy 0 < min <= max"
            )
    if "variant" in cfg.policy:
        _one_of(cfg, "policy.variant", VARIANTS)
    _check_precision(cfg)
    _one_of(cfg, "env.reward", REWARDS)
    if "grasp" in cfg.env:  # (robosuite's)
        _one_of(cfg, "env.grasp", GRASPS)
    if cfg.env.name in SHAPED_DENSE and cfg.env.reward == "dense" and cfg_get(cfg, "env.terminate_on_success", False):
        raise ConfigError(
            f"env.terminate_on_success=True with env.reward=dense: {cfg.env.name}'s shaped reward pays "
            "before success too, so an episode that ends at success is worth less than one that hovers "
            "short of it; use env.terminate_on_success=false (the default under dense) or "
            "env.reward=sparse"
        )
    _check_tasks(cfg)
    _check_numbers(cfg)
    _check_failures(cfg)
    _one_of(cfg, "device", ("auto", "cpu", "cuda"))
    if cfg_get(cfg, "sweep", None) is not None and cfg.iterations < 3:
        raise ConfigError(
            f"iterations={cfg.iterations}: a sweep trial measures its stages between its first iteration (warm-up) "
            "and its last (which simulates nothing ahead), so it needs 3 or more; the sweep's default is 4"
        )
    # mode=eval runs no update, so the algorithm's batch is moot
    ALGO_CHECKS[cfg.algo.name](cfg, training=cfg_get(cfg, "mode", "train") != "eval")
    if cfg.hw.gpus > 0 or cfg.device == "cuda":
        have = cuda_device_count()
        need = max(cfg.hw.gpus, 1)
        if have == 0 and cfg.hw.gpus == 0:
            raise ConfigError("device=cuda needs a CUDA GPU and this machine has none; use device=auto or device=cpu")
        if have < need:
            have_text = "none" if have == 0 else str(have)
            raise ConfigError(
                f"hw={cfg.hw.name} needs {need} CUDA GPU{'s' if need > 1 else ''} and this machine has {have_text}"
            )
    cores = available_cpu_cores()
    if cfg.hw.cpu_cores is not None and cfg.hw.cpu_cores > cores:
        raise ConfigError(
            f"hw.cpu_cores={cfg.hw.cpu_cores} (hw={cfg.hw.name}) is more than the {cores} CPU cores this "
            f"machine gives; use hw.cpu_cores={cores} or fewer, or null for all of them"
        )
    cores = _check_launch(cfg)
    _check_schedule(cfg, cores)
    _check_allocator(cfg, cores)


def _check_tasks(cfg: DictConfig) -> None:
    """env.tasks: a list or all, as many envs (GRPO: groups) as tasks at least, env.task_weights one per task."""
    if cfg_get(cfg, "env.tasks", None) is None:
        if cfg_get(cfg, "env.task_weights", None) is not None:
            raise ConfigError("env.task_weights is set without env.tasks: give the tasks it weighs (env.tasks=[...])")
        return
    from ebrl.envs.tasks import assign_tasks

    env = OmegaConf.to_container(cfg.env, resolve=True)
    shape = RolloutShape.of(cfg)
    training = cfg_get(cfg, "mode", "train") != "eval"  # (mode=eval runs no GRPO groups)
    try:
        assign_tasks(env, shape.envs, shape.group_size if training else 1)
    except BadInput as e:
        raise ConfigError(str(e)) from None


def _check_launch(cfg: DictConfig) -> int:
    """The ranks torchrun started against the nodes and GPUs hw describes; the cores each rank gets."""
    ranks, hw = Ranks.from_env(), cfg.hw
    _positive(cfg, "hw.nodes")
    _one_of(cfg, "distributed.strategy", ("auto", "ddp", "fsdp"))
    per_node = hw.gpus or ranks.local_world  # one rank per GPU; on CPU as many as were started
    command = f"torchrun --nnodes {hw.nodes} --nproc-per-node {per_node} run.py hw={hw.name} ..."
    if hw.nodes > 1 and not ranks.distributed:
        raise ConfigError(
            f"hw={hw.name} spans {hw.nodes} nodes and this is one process; launch one per node: {command}"
        )
    if ranks.distributed:
        if ranks.nodes != hw.nodes or (hw.gpus and ranks.local_world != hw.gpus):
            raise ConfigError(
                f"torchrun started {ranks.nodes} node(s) x {ranks.local_world} rank(s) and hw={hw.name} "
                f"describes {hw.nodes} node(s) x {per_node} (one rank per GPU); launch {command}"
            )
        if cfg.distributed.strategy == "fsdp" and cfg.scheduler.trainer == "local":
            raise ConfigError(
                f"distributed.strategy=fsdp shards the trainer process's weights and "
                f"scheduler={cfg.scheduler.name} trains in the process that generates "
                "(scheduler.trainer=local); use scheduler=ebrl (or async, hybrid, disaggregated) or "
                "distributed.strategy=ddp"
            )
        if cfg_get(cfg, "mode", "train") == "eval":
            raise ConfigError("mode=eval runs as one process: python run.py mode=eval checkpoint=<run folder> ...")
        if cfg.device == "cuda" and not hw.gpus:
            raise ConfigError(
                f"device=cuda with several ranks needs hw with GPUs (one rank per GPU); hw={hw.name} has none"
            )
    cores = len(rank_cores(cfg))
    if cores == 0:
        node = cfg.hw.cpu_cores or available_cpu_cores()
        raise ConfigError(
            f"{ranks.local_world} ranks on one node share its {node} CPU cores: at most {node} ranks per "
            "node (torchrun --nproc-per-node)"
        )
    return cores


def _check_numbers(cfg: DictConfig) -> None:
    """Numbers with a range that compose (they have the right type) but mean nothing outside it."""
    _check_ranges(
        [
            ("seed", cfg.seed, 0 <= cfg.seed < 2**32, "between 0 and 2**32 - 1"),
            ("hw.gpus", cfg.hw.gpus, cfg.hw.gpus >= 0, ">= 0"),
            (
                "distributed.timeout_s",
                cfg.distributed.timeout_s,
                cfg.distributed.timeout_s > 0,
                "> 0 (seconds a rank waits for the others at a collective)",
            ),
        ]
    )


def _check_ranges(checks: list[tuple[str, Any, bool, str]]) -> None:
    """(key, value, whether it is in range, what it must be): the first out of range raises its line."""
    for key, value, ok, want in checks:
        if not ok:
            raise ConfigError(f"{key}={value} must be {want}")


# the keys that hold a mapping (typed Any, see PolicyConfig.cameras): key, its values' type, null values allowed, e.g.
MAPPINGS = (
    ("policy.cameras", str, True, "{base_0_rgb: agentview, right_wrist_0_rgb: null}"),
    ("policy.dims", int, False, "{width: 1024, depth: 18}"),
    ("demos.image_keys", str, False, "{agentview: agentview_image}"),
)


def _check_mappings(cfg: DictConfig) -> None:
    """The mapping keys: null, or a mapping of names to values of their type."""
    for key, kind, nullable, example in MAPPINGS:
        value = cfg_get(cfg, key, None)
        if value is None:
            continue
        fits = isinstance(value, DictConfig) and all(
            isinstance(k, str) and ((isinstance(v, kind) and not isinstance(v, bool)) or (nullable and v is None))
            for k, v in value.items()
        )
        if not fits:
            shown = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
            raise ConfigError(
                f"{key}={shown} must be a mapping of names to {kind.__name__}s"
                f'{" or null" if nullable else ""}, e.g. "{key}={example}", or null'
            )


def _check_precision(cfg: DictConfig) -> None:
    """policy.dtype and what is trained (how the trainer batches and stores its optimizer state: _check_optimizer)."""
    if cfg.policy.dtype is not None:
        _one_of(cfg, "policy.dtype", DTYPES)
    _one_of(cfg, "policy.train", TRAIN_OPTIONS)
    if cfg.policy.train == "lora":
        for key in ("policy.lora_rank", "policy.lora_alpha"):
            _positive(cfg, key)


# --- the algorithms: a check per schema of ebrl/config.py (ALGO_SCHEMAS), each over the keys that schema has -------
def _check_optimizer(cfg: DictConfig) -> None:
    """AlgoConfig's keys, which every algorithm has: AdamW, its gradient clip, the trainer's batches."""
    a = cfg.algo
    _positive(cfg, "algo.lr")
    _one_of(cfg, "algo.optimizer_dtype", DTYPES)
    if a.micro_batch is not None:
        _positive(cfg, "algo.micro_batch")
    _check_ranges(
        [
            (
                "algo.adam_betas",
                list(a.adam_betas),
                len(a.adam_betas) == 2 and all(0 <= b < 1 for b in a.adam_betas),
                "two numbers in [0, 1), e.g. [0.9, 0.999]",
            ),
            ("algo.adam_eps", a.adam_eps, a.adam_eps > 0, "> 0"),
            ("algo.weight_decay", a.weight_decay, a.weight_decay >= 0, ">= 0 (AdamW's decoupled decay; 0: Adam)"),
            ("algo.max_grad_norm", a.max_grad_norm, a.max_grad_norm > 0, "> 0 (the gradient norm it clips to)"),
        ]
    )


def _check_rl(cfg: DictConfig) -> None:
    """RLAlgoConfig's keys, PPO's and GRPO's: the clipped loss, its epochs and minibatches."""
    a = cfg.algo
    _check_optimizer(cfg)
    for key in ("algo.epochs", "algo.minibatches", "algo.max_nonfinite_updates"):
        _positive(cfg, key)
    _one_of(cfg, "algo.logprob_level", LOGPROB_LEVELS)
    _one_of(cfg, "algo.proximal", PROXIMAL)
    _check_ranges(
        [
            ("algo.clip", a.clip, a.clip > 0, "> 0 (0.2 is usual)"),
            (
                "algo.clip_high",
                a.clip_high,
                a.clip_high is None or a.clip_high > 0,
                "> 0 (0.28 in DAPO), or null (clip)",
            ),
            ("algo.target_kl", a.target_kl, a.target_kl is None or a.target_kl > 0, "> 0, or null (no early stop)"),
            (
                "algo.dual_clip",
                a.dual_clip,
                a.dual_clip is None or a.dual_clip > 1,
                "> 1 (3.0 in RLinf's recipes), or null (no cap)",
            ),
            (
                "algo.global_batch",
                a.global_batch,
                a.global_batch is None or a.global_batch > 0,
                "> 0 (chunk steps per optimizer step), or null (algo.minibatches)",
            ),
        ]
    )


def check_ppo(cfg: DictConfig, training: bool = True) -> None:
    """PPOConfig: the rollout's length, the critic and GAE; training: the minibatches (or algo.global_batch) split the
    rollout batch."""
    a = cfg.algo
    _check_rl(cfg)
    _positive(cfg, "algo.rollout_chunks")
    if a.critic_warmup < 0:
        raise ConfigError(
            f"algo.critic_warmup={a.critic_warmup} must be >= 0 (updates that train the value head alone "
            "after init; 0: none)"
        )
    _check_ranges(
        [
            ("algo.value_clip", a.value_clip, a.value_clip is None or a.value_clip > 0, "> 0, or null (no value clip)"),
            (
                "algo.huber_delta",
                a.huber_delta,
                a.huber_delta is None or a.huber_delta > 0,
                "> 0, or null (a squared-error value loss)",
            ),
            ("algo.critic_lr", a.critic_lr, a.critic_lr > 0, "> 0 (the value head's learning rate)"),
            ("algo.gamma", a.gamma, 0 < a.gamma <= 1, "in (0, 1]"),
            ("algo.gae_lambda", a.gae_lambda, 0 <= a.gae_lambda <= 1, "in [0, 1]"),
        ]
    )
    if not training:
        return
    shape = RolloutShape.of(cfg, Ranks.from_env().world)
    batch = shape.rows
    if a.global_batch is not None:
        world = shape.ranks  # (each rank collects its own rollout)
        total = batch * world
        if total > a.global_batch and total % a.global_batch:
            raise ConfigError(
                f"algo.global_batch={a.global_batch} does not divide the rollout batch of {total} chunk steps "
                f"(env.num_envs x algo.rollout_chunks x {world} rank(s)): give a divisor, or null to split by "
                "algo.minibatches"
            )
    elif batch % a.minibatches:
        raise ConfigError(
            f"algo.minibatches={a.minibatches} does not divide the rollout batch "
            f"env.num_envs x algo.rollout_chunks = {batch}"
        )


def check_grpo(cfg: DictConfig, training: bool = True) -> None:
    """GRPOConfig; training: the envs split into groups of algo.group_size, and the minibatches split the envs."""
    _check_rl(cfg)
    if not training:
        return
    shape = RolloutShape.of(cfg)
    n, k, m = shape.envs, shape.group_size, cfg.algo.minibatches
    if k < 2:
        raise ConfigError(f"algo.group_size={k} must be at least 2: a group compares its episodes' returns")
    if n % k:
        raise ConfigError(
            f"env.num_envs={n} is not a multiple of algo.group_size={k}; with algo=grpo use "
            f"env.num_envs={k}, {2 * k}, {3 * k}, ... or a group size that divides {n}"
        )
    if n % m:  # the rollout batch is env.num_envs x the chunks of one episode
        raise ConfigError(f"algo.minibatches={m} does not divide env.num_envs={n} (algo=grpo batches whole episodes)")


def check_sft(cfg: DictConfig, training: bool = True) -> None:
    """SFTConfig; training: its batches, and the share of the demonstrations held out."""
    _check_optimizer(cfg)
    if not training:
        return
    for key in ("algo.batch_size", "algo.steps_per_iteration"):
        _positive(cfg, key)
    if not 0 <= cfg.demos.valid < 1:
        raise ConfigError(f"demos.valid={cfg.demos.valid} must be in [0, 1) (the share of episodes held out)")


ALGO_CHECKS = {"ppo": check_ppo, "grpo": check_grpo, "sft": check_sft}  # by algo.name, as ALGO_SCHEMAS


FAULTS = ("hang", "error", "exit", "slow")


def _check_failures(cfg: DictConfig) -> None:
    """How simulator failures are met (scheduler.*) and the test-only env.fault."""
    s = cfg.scheduler
    if s.chunk_timeout_s is not None and s.chunk_timeout_s <= 0:
        raise ConfigError(f"scheduler.chunk_timeout_s={s.chunk_timeout_s} must be > 0 seconds, or null (no timeout)")
    if s.max_sim_failures < 0:
        raise ConfigError(f"scheduler.max_sim_failures={s.max_sim_failures} must be >= 0 (0: the first failure stops)")
    if s.sim_failure_window_s <= 0:
        raise ConfigError(f"scheduler.sim_failure_window_s={s.sim_failure_window_s} must be > 0 seconds")
    fault = cfg_get(cfg, "env.fault", None)
    if fault is None or fault.kind is None:
        return
    _one_of(cfg, "env.fault.kind", FAULTS)
    if not 0 <= fault.env < cfg.env.num_envs or fault.chunk < 1:
        raise ConfigError(
            f"env.fault.env={fault.env} must be in 0..{cfg.env.num_envs - 1} and env.fault.chunk={fault.chunk} >= 1"
        )


def generation_place(cfg: Any) -> str:
    """Where a pipelined run generates: its scheduler.generation, or its own process under MPS (whose share is fixed
    for a process's life, so an allocator's new share is a respawn), else the supervisor."""
    return cfg.scheduler.generation or ("process" if sm_partition(cfg.hw) == "mps" else "supervisor")


def sm_partition(hw: Any) -> str:
    """How SM shares are enforced on this hw: its sm_partition, or MPS where it runs MPS daemons, else none."""
    return hw.sm_partition or ("mps" if hw.mps else "none")


def _check_allocator(cfg: DictConfig, cores: int) -> None:
    a, hw = cfg.allocator, cfg.hw
    if hw.sm_partition is not None:
        _one_of(cfg, "hw.sm_partition", PARTITIONS)
    partition = sm_partition(hw)
    if partition != "none" and hw.gpus == 0:
        raise ConfigError(
            f"hw.sm_partition={partition} shares the SMs of a GPU and hw={hw.name} has none; "
            "use hw.sm_partition=none (and hw.mps=false)"
        )
    if partition == "green":  # (torch's contexts also all start at the first SMs: ResourcePool's GreenPartition)
        raise ConfigError(
            "hw.sm_partition=green splits SMs between the streams of one process, and a run generates "
            "and trains in two (colocated: one after the other), which without MPS take turns on the "
            "GPU; use hw.sm_partition=mps (or none)"
        )
    if a.name == "elastic" and cfg.scheduler.trainer == "local":
        raise ConfigError(
            "allocator=elastic moves resources between the stages' processes and scheduler=colocated "
            "runs every stage in one; use scheduler=ebrl (or async)"
        )
    if a.name == "elastic" and cfg.scheduler.train_share is not None:
        share = cfg.scheduler.train_share
        raise ConfigError(
            f"allocator=elastic would move the cores that scheduler.train_share={share} fixes (the "
            "split that defines disaggregated); use scheduler=ebrl or async"
        )
    if a.name == "elastic" and not cfg.scheduler.overlap:
        raise ConfigError(
            f"allocator=elastic moves resources between stages that run side by side and "
            f"scheduler={cfg.scheduler.name} runs rollout and training one after the other, each on "
            "every core; use scheduler=ebrl or async"
        )
    for key, low in (("window", 1), ("cooldown", 0)):
        if a[key] < low:
            raise ConfigError(f"allocator.{key}={a[key]} must be >= {low}")
    if a.min_gain < 0:
        raise ConfigError(f"allocator.min_gain={a.min_gain} must be >= 0 (a relative throughput gain; 0.1 is 10%)")
    if not 0 < a.ema <= 1:
        raise ConfigError(
            f"allocator.ema={a.ema} must be in (0, 1] (the latest measurement's weight; 1 trusts it alone)"
        )
    for stage in ("simulate", "generate", "train"):
        amount = a[stage]
        if amount is None:
            continue
        top = 1.0 if hw.gpus and stage != "simulate" else cores
        unit = "of one GPU's SMs" if hw.gpus and stage != "simulate" else "CPU cores"
        if not 0 < amount <= top:
            raise ConfigError(f"allocator.{stage}={amount:g} must be in (0, {top:g}] ({unit} on hw={hw.name})")


def _check_local_trainer(cfg: DictConfig) -> None:
    """scheduler.trainer=local trains in the supervisor between two rollouts, on the policy it generates with."""
    s = cfg.scheduler
    for key, value, why in (
        ("overlap", s.overlap, "overlaps training with the rollout, which needs a trainer of its own"),
        ("train_share", s.train_share, "gives training cores of its own"),
        (
            "generation",
            s.generation if s.generation == "process" else None,
            "generates in a process of its own, and a local trainer trains the supervisor's policy",
        ),
    ):
        if value:
            raise ConfigError(
                f"scheduler.trainer=local trains in the supervisor between two rollouts and "
                f"scheduler.{key}={value} {why}; use scheduler.trainer=process (or scheduler=ebrl)"
            )


def train_core_count(share: float, cores: int) -> int:
    """Cores a schedule with `scheduler.train_share` gives training alone (the rest roll out)."""
    return round(share * cores)


def _check_schedule(cfg: DictConfig, cores: int) -> None:
    """The schedule's switches against each other, the envs, the cores and the GPUs hw gives."""
    s, name = cfg.scheduler, cfg.scheduler.name
    _one_of(cfg, "scheduler.trainer", TRAINER_PLACES)
    _one_of(cfg, "scheduler.core_order", CORE_ORDERS)
    if not 1 <= s.groups <= cfg.env.num_envs:
        raise ConfigError(f"scheduler.groups={s.groups} must be between 1 and env.num_envs={cfg.env.num_envs}")
    shape = RolloutShape.of(cfg)
    if cfg.algo.name == "grpo" and s.groups > shape.units:
        raise ConfigError(
            f"scheduler.groups={s.groups} must be between 1 and {shape.units} with algo=grpo: a group of "
            f"the schedule holds whole GRPO groups (env.num_envs={cfg.env.num_envs} / "
            f"algo.group_size={cfg.algo.group_size})"
        )
    if s.serial and (s.trainer != "local" or s.core_rebinding):
        why = "trains in a process of its own" if s.trainer != "local" else "pins each simulator process to a core"
        raise ConfigError(
            f"scheduler.serial=true runs every stage in this process, one after another, and "
            f"scheduler={name} {why}; use scheduler=colocated scheduler.serial=true"
        )
    if s.trainer == "local":
        _check_local_trainer(cfg)
        return
    if s.max_ahead < 1:
        raise ConfigError(
            f"scheduler.max_ahead={s.max_ahead} must be >= 1 (iterations the rollout may run ahead of "
            "training; scheduler.overlap=false runs none ahead)"
        )
    if s.max_staleness < 0:
        raise ConfigError(
            f"scheduler.max_staleness={s.max_staleness} must be >= 0 (0: only data of the current weights)"
        )
    if cfg.algo.name == "grpo" and s.overlap and s.max_staleness < s.max_ahead:
        # the stale steps are those of the quick episodes, mostly successes, which still count in their group's
        # baseline: the loss learns from the slow failures (docs/results/results.md, "After the objective's fixes")
        raise ConfigError(
            f"scheduler.max_staleness={s.max_staleness} below scheduler.max_ahead={s.max_ahead} drops "
            "the quick episodes' steps from GRPO's loss while their group's baseline counts them; with "
            "algo=grpo keep scheduler.max_staleness at scheduler.max_ahead (the default)"
        )
    if not 0 <= s.sim_nice <= 19:
        raise ConfigError(f"scheduler.sim_nice={s.sim_nice} must be a nice value from 0 (none) to 19")
    if s.generation is not None:
        _one_of(cfg, "scheduler.generation", GENERATION_PLACES)
    if s.is_clip <= 0:
        raise ConfigError(f"scheduler.is_clip={s.is_clip} must be > 0 (2.0 is usual)")
    if s.overlap and not s.decoupled and policy_dtype_name(cfg.policy, runs_on_cuda(cfg)) == "bfloat16":
        # the stale rows' behaviour log-probs exist only as generation's bfloat16 numbers, which differ from any
        # trainer pass by about 0.1 per action: the plain ratio would start off 1 on every row
        why = "policy.dtype=bfloat16" if cfg.policy.dtype else "policy.dtype=null: bfloat16 on a GPU or the full preset"
        raise ConfigError(
            f"scheduler.decoupled={s.decoupled} with scheduler.overlap={s.overlap} clips around the "
            f"stale behaviour policy, and a bfloat16 policy ({why}) has no exact log-probs of it; use "
            "scheduler.decoupled=true or policy.dtype=float32"
        )
    for key in ("queue_size", "train_threads"):
        if s[key] is not None and s[key] < 1:
            raise ConfigError(f"scheduler.{key}={s[key]} must be >= 1 or null")
    if cores < 2 and s.train_share is None:  # the allocator's smallest plan: 1 core to simulate, a share for the rest
        ranks = Ranks.from_env()
        where = f" (this node's cores split over its {ranks.local_world} ranks)" if ranks.local_world > 1 else ""
        raise ConfigError(
            f"scheduler={name} simulates, generates and trains side by side and needs at least 2 CPU "
            f"cores; this rank has {cores}{where}; use scheduler=colocated, or fewer ranks per node"
        )
    if s.train_share is not None:
        if cfg.hw.gpus == 1:
            raise ConfigError(
                f"scheduler={name} trains on a device of its own and hw={cfg.hw.name} has one GPU; "
                "use hw with 2+ GPUs or scheduler=hybrid"
            )
        if not 0 < s.train_share < 1 or not 1 <= train_core_count(s.train_share, cores) < cores:
            low, high = f"{1 / cores:.2f}", f"{1 - 1 / cores:.2f}"
            allowed = f"on {cores} cores: {low}" if low == high else f"between {low} and {high}"
            raise ConfigError(
                f"scheduler.train_share={s.train_share} must give training at least one of the {cores} "
                f"CPU cores and leave rollout at least one ({allowed})"
            )
