"""Typed schemas for every config group, registered in Hydra's ConfigStore.

A misspelled key or a wrong type fails at composition with Hydra's own message; values that
compose but make no sense are rejected by `validate` with one line naming the key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, ValidationError

from ebrl.envs.base import REWARDS
from ebrl.envs.libero_env import SUITE_STEPS
from ebrl.errors import BadInput
from ebrl.node import PARTITIONS, Ranks, cuda_device_count, share_of_node
from ebrl.recipes import resolve_recipe

REPO = Path(__file__).resolve().parents[1]  # the checkout: relative paths the repository ships are read from it
CONF_DIR = REPO / "conf"
GENERATION_PLACES = ("supervisor", "process")
TRAINER_PLACES = ("process", "local")
CORE_ORDERS = ("longest", "readiness")


class ConfigError(BadInput, ValueError):
    """A config value that composes but cannot work; the message is one line."""


# --- env ---------------------------------------------------------------------------------
@dataclass
class FaultConfig:
    """Tests only: make one simulator fail (`env.fault.kind=hang env.fault.env=1 env.fault.chunk=3`)."""

    kind: Optional[str] = None  # hang (sleeps past any timeout) | error (raises in the chunk) | exit (dies); null: none
    env: int = 0  # which env's simulator
    chunk: int = 1  # at its k-th chunk
    again: bool = False  # its replacements fail the same way


@dataclass
class EnvConfig:
    _target_: str = MISSING  # the adapter class (ebrl.envs.base.EnvAdapter subclass)
    name: str = MISSING
    task: str = MISSING
    num_envs: int = 8  # simulator processes (one environment each)
    max_episode_steps: int = 100  # env steps before truncation
    cameras: list[str] = field(default_factory=list)  # empty: state observations only
    image_size: int = 128  # square camera images, pixels
    # false: cameras render at a chunk's last step and at a reset, the frames the policy reads; true: at every step
    # (the control of the camera benchmark)
    render_every_step: bool = False
    reward: str = "dense"  # dense (the task's shaped reward) | sparse (1 on success)
    terminate_on_success: bool = True
    # robosuite family: a control step's substeps without robosuite's Python around the physics, bit for bit the
    # stock trajectories (ebrl/envs/fast_step.py); false: the stock step (the control)
    fast_step: bool = True
    python: Optional[str] = None  # interpreter the simulator workers run under; null: this one
    # many tasks of this benchmark in one run: a list ([Lift,Stack]) or all (a LIBERO suite's); null: env.task alone.
    # Envs (GRPO: groups) go to tasks round-robin, or in proportion to task_weights (ebrl/envs/tasks.py)
    tasks: Any = None
    task_weights: Optional[List[float]] = None
    fault: FaultConfig = field(default_factory=lambda: FaultConfig())  # tests only


@dataclass
class RobosuiteEnvConfig(EnvConfig):
    _target_: str = "ebrl.envs.robosuite_env.RobosuiteEnv"
    name: str = "robosuite"
    task: str = "Lift"
    robot: str = "Panda"
    control_freq: int = 20


@dataclass
class ManiSkillEnvConfig(EnvConfig):
    _target_: str = "ebrl.envs.maniskill_env.ManiSkillEnv"
    name: str = "maniskill"
    task: str = "PickCube-v1"
    control_mode: str = "pd_ee_delta_pose"
    sim_backend: str = "cpu"


@dataclass
class LiberoEnvConfig(EnvConfig):
    _target_: str = "ebrl.envs.libero_env.LiberoEnv"
    name: str = "libero"
    task: str = "0"  # index or name within the suite
    suite: str = "libero_spatial"


@dataclass
class RoboCasaEnvConfig(EnvConfig):
    _target_: str = "ebrl.envs.robocasa_env.RoboCasaEnv"
    name: str = "robocasa"
    task: str = "PickPlaceCounterToCabinet"  # RoboCasa 1.0's name for v0.x's PnPCounterToCab
    assets_dir: Optional[str] = None  # where the kitchen assets are; null: the package's own folder
    robot: str = "PandaOmron"  # RoboCasa's mobile manipulator


ENV_SCHEMAS = {"robosuite": RobosuiteEnvConfig, "maniskill": ManiSkillEnvConfig, "libero": LiberoEnvConfig,
               "robocasa": RoboCasaEnvConfig}
# what every task of a run observes alike (the policy's batch): a task of another benchmark takes the run's
SHARED_OBSERVATION = ("cameras", "image_size", "render_every_step")


# --- policy ------------------------------------------------------------------------------
@dataclass
class PolicyConfig:
    _target_: str = MISSING
    name: str = MISSING
    preset: str = "tiny"  # tiny (CPU tests, <1M params) | small (CPU benchmark, a few M) | full (published shapes)
    chunk: Optional[int] = None  # actions per chunk; null: the preset's
    # Actions of each sampled chunk the env executes before the next chunk is sampled from the observation after them
    # (openpi's replan_steps, lerobot's n_action_steps, RLinf's num_action_chunks); null: the recipe's at full size
    # (5), else the checkpoint folder's n_action_steps, else the whole chunk. mode=eval: the evaluated run's, before the
    # recipe's (ebrl/policies/build.py, settle_execute)
    execute: Optional[int] = None
    # a checkpoint to start from: a folder as its writer saved it (lerobot save_pretrained, openpi PyTorch or
    # converted, HF sharded) or a .safetensors file
    checkpoint: Optional[str] = None
    # Weights and compute: float32 | bfloat16; null: bfloat16 for the full preset or a CUDA run, else float32. The
    # trainer keeps float32 master weights of what it trains and runs under autocast; log-densities stay float32
    dtype: Optional[str] = None
    # What RL trains: all | action_expert (the vision-language backbone frozen) | lora (the backbone's attention and
    # MLP through LoRA adapters, the action expert and RL heads whole); frozen weights carry no gradient and no
    # optimizer state
    train: str = "all"
    lora_rank: int = 16  # policy.train=lora: rank of the adapters
    lora_alpha: float = 16.0  # policy.train=lora: the adapters' update is scaled by lora_alpha / lora_rank
    grad_checkpoint: Optional[bool] = None  # recompute each transformer block in the backward pass; null: on for full


@dataclass
class FlowPolicyConfig(PolicyConfig):
    # Euler steps per chunk, in RL and evaluation alike; null: the recipe's (RLinf's RL num_steps at full size), else
    # the checkpoint's, else the preset's
    denoise_steps: Optional[int] = II("recipe:denoise_steps")
    # How the chain explores; defaults from the run's recipe (ebrl/recipes.py): flow_noise for tiny/small,
    # RLinf's at full (flow_sde on LIBERO, flow_noise on ManiSkill)
    logprob: str = II("recipe:logprob")  # flow_noise (learned per-step noise std) | flow_sde (Flow-GRPO's reverse SDE)
    noise_std_min: float = II("recipe:noise_std_min")  # bounds of the learned per-step noise std (flow_noise)
    noise_std_max: float = II("recipe:noise_std_max")
    sde_noise_level: float = II("recipe:sde_noise_level")  # a in sigma_t = a sqrt(t / (1 - t)) (flow_sde)
    # Where the noise enters and what the log-prob is: sum (every step stochastic, the log-prob their sum) | mean
    # (every step, the log-prob the mean of the steps' and x_0's: RLinf's joint_logprob) | one_step (one random step
    # per chunk stochastic, the rest plain Euler, the log-prob that step's: RLinf's Flow-SDE)
    chain_logprob: str = II("recipe:chain_logprob")
    detach_critic_input: bool = II("recipe:detach_critic_input")  # the value head's input carries no gradient


@dataclass
class OpenPIPolicyConfig(FlowPolicyConfig):
    _target_: str = "ebrl.policies.openpi.OpenPIPolicy"
    name: str = "openpi"
    # pi0 (state token, time mixed into the action tokens) | pi05 (adaRMS time, discrete state); null: pi0, or the
    # checkpoint's
    variant: Optional[str] = None
    # What a published checkpoint was trained with; a checkpoint folder fills what is left null (its tokenizer.model,
    # statistics, config.json). tokenizer: PaliGemma's SentencePiece model file (null: byte-level stand-in)
    tokenizer: Optional[str] = None
    norm_stats: Optional[str] = None  # openpi norm_stats.json | lerobot policy_preprocessor.json | a folder with one
    norm_mode: Optional[str] = None  # mean_std | quantiles; null: the checkpoint's (pi0 mean_std, pi05 quantiles)
    # checkpoint camera slot -> env camera (null masks the slot), in the checkpoint's order, e.g.
    # {base_0_rgb: agentview, left_wrist_0_rgb: robot0_eye_in_hand, right_wrist_0_rgb: null}; null: the env's cameras.
    # (Mappings are typed Any and checked in `validate`: OmegaConf cannot merge a command line's dict into a null
    # Optional[Dict] node, nor add keys to an empty one under Hydra's struct flag)
    cameras: Any = None
    action_dims: Optional[List[int]] = None  # the checkpoint action dim behind each env action dim; null: 0..A-1
    state_dims: Optional[List[int]] = None  # the env state dims the checkpoint reads, in its order; null: all
    action_scale: Optional[List[float]] = None  # a factor per env action dim (e.g. -1 flips a gripper's sign)
    # whose processors made the prompts it was trained on: openpi | lerobot; null: lerobot for a lerobot policy
    # folder, else openpi (ebrl/policies/tokenizer.py)
    prompt_style: Optional[str] = None
    dims: Any = None  # {size: int}: sizes that replace the preset's (a checkpoint at sizes of its own)


@dataclass
class OpenVLAOFTPolicyConfig(PolicyConfig):
    _target_: str = "ebrl.policies.openvla_oft.OpenVLAOFTPolicy"
    name: str = "openvla_oft"
    action_std_init: float = 0.3  # initial std of the Gaussian around the L1 head's actions (learned per action dim)
    action_std_min: float = 0.02  # bounds of that std
    action_std_max: float = 1.0


@dataclass
class GR00TPolicyConfig(FlowPolicyConfig):
    _target_: str = "ebrl.policies.gr00t.GR00TPolicy"
    name: str = "gr00t"
    # the per-embodiment projectors' slot the policy runs: GR00T's EMBODIMENT_TAG_MAPPING (lerobot's groot processor
    # the same): new_embodiment 31 (what fine-tunes train), gr1 24, agibot_genie1 26, oxe_droid 17, so100 2,
    # unitree_g1 3; null: new_embodiment (31 at full; tiny/small have one slot, 0)
    embodiment_id: Optional[int] = None


@dataclass
class WAMPolicyConfig(FlowPolicyConfig):
    _target_: str = "ebrl.policies.wam.WAMPolicy"
    name: str = "wam"


# --- hardware ----------------------------------------------------------------------------
@dataclass
class HwConfig:
    name: str = MISSING
    cpu_cores: Optional[int] = None  # cores EBRL may use on this node; null: all this process may use
    gpus: int = 0
    gpu_name: str = ""
    gpu_memory_gb: float = 0.0  # per GPU
    sm_count: int = 0  # streaming multiprocessors per GPU
    mps: bool = False  # a pipelined run starts one MPS control daemon per GPU of its own
    nodes: int = 1  # machines the run spans, each like this one (torchrun --nnodes); one rank per GPU (CPU: per node)
    sm_partition: Optional[str] = None  # mps | green | none: how SM shares are enforced; null: mps if hw.mps else none


# --- scheduler, allocator, algorithm, logger ----------------------------------------------
@dataclass
class SchedulerConfig:
    name: str = MISSING
    torch_threads: Optional[int] = None  # threads for generation (and colocated training); null: hw cores
    # Every schedule is these switches of one runtime; see ebrl/runtime/schedule.py
    overlap: bool = False  # train on iteration i-1 while rollout i collects
    groups: int = 1  # env groups; generation serves whichever is ready while others simulate
    core_rebinding: bool = False  # an env runs only while it holds a sim core, handed out by core_order
    # which ready env a freed sim core goes to: longest (the longest estimated step of any group) | readiness (the
    # group closest to its chunk boundary first, then the longest step within it; measured a tie: docs/schedules.md,
    # "Measured choices")
    core_order: str = "longest"
    # where the trainer runs: process (its own; a new MPS share is a successor process) | local (the supervisor, on
    # the policy generation samples with, between two rollouts: colocated)
    trainer: str = "process"
    # with overlap: iterations the rollout may run ahead of the last finished update, so its chunks are at most this
    # many weight versions old (1: rollout i collects while update i-1 trains)
    max_ahead: int = 1
    # chunks more than this many versions old are dropped from the loss; by default max_ahead (none is dropped): set
    # max_ahead above it to let the rollout run further and drop what got too stale
    max_staleness: int = II(".max_ahead")
    queue_size: Optional[int] = None  # groups that may wait for generation at once; null: all of them
    train_share: Optional[float] = None  # share of the cores (GPUs: the second GPU) for training alone; null: shared
    decoupled: bool = True  # with overlap: decoupled PPO; false: plain PPO clipped around the (stale) behaviour policy
    is_clip: float = 2.0  # decoupled PPO: truncation of the importance weight to the behaviour policy
    train_threads: Optional[int] = None  # torch threads of the trainer process; null: its cores
    sim_nice: int = 10  # nice of the simulator processes (0..19): generation and training get a shared core first
    # a plan's shares are priorities, not fences: the simulators also run, niced, on the cores the allocator gave the
    # policy's stages whenever those leave them idle (with core rebinding: lent to an env when every sim core is
    # taken); false: only on their own share
    work_conserving: bool = True
    # every stage in this process, one after another, for debugging (breakpoint() works in an adapter or a policy):
    # the simulators answered in one thread of the supervisor by the code a simulator process runs, no chunk timeout;
    # with a local trainer (scheduler=colocated)
    serial: bool = False
    # where generation runs: supervisor (no process boundary on the hot path) | process (its own, mapping the
    # published weights; a new MPS share is a respawn); null: process under MPS, else supervisor
    generation: Optional[str] = None
    # A simulator that dies, fails in a chunk, or sends no result for chunk_timeout_s is replaced by a fresh one;
    # more than max_sim_failures replacements within sim_failure_window_s stop the run (with a checkpoint)
    chunk_timeout_s: Optional[float] = 120.0  # null: wait for ever
    max_sim_failures: int = 5
    sim_failure_window_s: float = 600.0


@dataclass
class AllocatorConfig:
    name: str = MISSING  # static: plan once | elastic: re-plan when stage rates drift (ebrl/alloc)
    # Stage profile: null looks for <profiles_dir>/<policy>-<preset>_<env>-<task>_<hw>.yaml (sweep.py writes it);
    # without one the plan starts from a calibration: the stages' costs measured in iteration 2
    profile: Optional[str] = None
    profiles_dir: str = "profiles"  # relative to the repository (absolute paths as given)
    window: int = 3  # elastic: iterations an imbalance must last before a re-plan
    min_gain: float = 0.1  # elastic: re-plan only for at least this predicted throughput gain
    cooldown: int = 2  # elastic: iterations between re-plans
    ema: float = 0.5  # elastic: weight of the latest measurement in each stage's correction of the profile, (0, 1]
    # Pinned amounts (a sweep trial sets them; null: planned): simulate in cores (a fraction shares a core),
    # generate and train in cores on CPU or SM share of one GPU
    simulate: Optional[float] = None
    generate: Optional[float] = None
    train: Optional[float] = None


@dataclass
class AlgoConfig:
    name: str = MISSING  # ppo | grpo
    rollout_chunks: int = 10  # chunks each env collects per iteration (ppo; grpo runs one whole episode per env)
    group_size: int = 4  # grpo: K envs that start from the same seeded reset form a group (ignored by ppo)
    # The keys set to ${recipe:...} default to the run's recipe (ebrl/recipes.py): this repository's tuning for
    # the tiny and small presets, RLinf's / piRL's published configs for the model and benchmark at full size
    lr: float = II("recipe:lr")  # AdamW's for the policy
    critic_lr: float = II("recipe:critic_lr")  # AdamW's for the value head
    adam_betas: List[float] = II("recipe:adam_betas")
    adam_eps: float = II("recipe:adam_eps")
    weight_decay: float = II("recipe:weight_decay")  # AdamW's decoupled decay
    gamma: float = 0.99  # discount per chunk (ppo; grpo's return is the undiscounted episode return)
    gae_lambda: float = 0.95
    # ppo: an episode cut off by env.max_episode_steps is bootstrapped from the value of its last observation (the
    # limit is the env's, the task would go on); false: it ends there with nothing more to come (the task is to
    # succeed within the limit: a failure's return is 0). By default true with env.reward=dense, false with sparse
    bootstrap_truncated: bool = II("equals:${env.reward},dense")
    reward_scale: float = 1.0  # ppo: rewards are multiplied by it before GAE (the critic's targets keep a scale near 1)
    epochs: int = II("recipe:epochs")
    minibatches: int = 4
    clip: float = II("recipe:clip")  # the ratio's clip below 1 (and above, unless clip_high)
    clip_high: Optional[float] = II("recipe:clip_high")  # the clip above 1 (DAPO's clip-higher); null: clip
    # ppo: the value moves at most this far from the rollout's per update (PPO2's value clip); null: unclipped
    value_clip: Optional[float] = II("recipe:value_clip")
    huber_delta: Optional[float] = II("recipe:huber_delta")  # ppo: the value loss is Huber at this delta; null: squared
    value_coef: float = II("recipe:value_coef")  # ppo; grpo has no critic
    entropy_coef: float = II("recipe:entropy_coef")
    max_grad_norm: float = II("recipe:max_grad_norm")
    # rows per forward/backward pass; their gradients accumulate to the minibatch, which stays one optimizer step
    # (also the rows of the trainer's proximal pass); null: the whole minibatch in one pass
    micro_batch: Optional[int] = II("recipe:micro_batch")
    # chunk steps per optimizer step over all ranks (RLinf's global_batch_size), in place of algo.minibatches; a
    # rollout smaller than it is one step; null: the rollout batch / algo.minibatches
    global_batch: Optional[int] = II("recipe:global_batch")
    # what one ratio is taken over: action (each executed action's log-prob) | chunk (their sum over a chunk's
    # executed actions: RLinf's chunk_level)
    logprob_level: str = II("recipe:logprob_level")
    # a negative advantage's ratio counts at most this much (dual-clip PPO, RLinf's clip_ratio_c; > 1); null: no cap
    dual_clip: Optional[float] = II("recipe:dual_clip")
    optimizer_dtype: str = "float32"  # Adam's moments: float32 | bfloat16 (half their memory)
    normalize_advantages: bool = True
    target_kl: Optional[float] = None  # stop the epochs of an update once approx KL per action exceeds it
    # A step whose gradient holds NaN/inf is skipped and counted (train/nonfinite_steps); after this many updates in a
    # row with such steps the run stops, its checkpoint the last one written before them
    max_nonfinite_updates: int = 3
    # ppo from `init` (an SFT checkpoint, whose value head never learned): the first critic_warmup updates train the
    # value head alone on the rollouts, the policy loss counts from the next; 0: from the first. Ignored from scratch
    critic_warmup: int = II("recipe:critic_warmup")
    # sft (algo=sft, on demos.path): (observation, action chunk) samples per optimizer step, and the steps of one
    # iteration (the held-out loss is measured after each)
    batch_size: int = 64
    steps_per_iteration: int = 100


@dataclass
class LoggerConfig:
    name: str = MISSING
    project: str = "ebrl"
    entity: Optional[str] = None
    group: Optional[str] = None
    mode: Optional[str] = None  # offline | online; null: online when WANDB_API_KEY is set


@dataclass
class SweepConfig:
    """One trial of `python sweep.py -m`: the share of the node each stage gets (the trial pins the allocator's
    amounts to them; hydra.sweeper.params searches them)."""

    name: str = MISSING
    simulate: float = 0.75  # share of the CPU cores
    generate: float = 0.25  # share of the CPU cores, or of one GPU's SMs
    train: float = 0.25  # share of the CPU cores, or of one GPU's SMs


# --- the whole experiment ------------------------------------------------------------------
@dataclass
class EvalConfig:
    """`mode=eval`: how many episodes the loaded policy runs (ebrl/runtime/evaluation.py)."""

    episodes: int = 20  # complete episodes; success rate with a 95% Wilson interval over them
    videos: int = 2  # episodes saved as mp4 (the first ones; needs env.cameras)
    # flow families: plain Euler steps over the velocity, no injected noise (how openpi and lerobot sample); false:
    # the stochastic chain RL rolls out with
    deterministic: bool = True


@dataclass
class DistributedConfig:
    """Runs of several ranks under torchrun (ebrl/runtime/distributed.py)."""

    timeout_s: float = 1800.0  # how long a rank waits for the others at a collective before the run stops
    # ddp: every rank's trainer holds the whole policy and Adam state | fsdp: they are sharded over the ranks (for
    # policies whose training state does not fit one GPU; pipelined schedules, whose trainer has a process of its own)
    strategy: str = "ddp"


@dataclass
class DemosConfig:
    """algo=sft: the demonstrations it trains on, in robomimic's HDF5 layout or LeRobot's (docs/demos.md)."""

    # an .hdf5 file, a LeRobot dataset folder (v2.1, v3.0), or a folder of either (`python -m ebrl.demos record`)
    path: Optional[str] = None
    # obs datasets (HDF5) or features (LeRobot) concatenated into the state; null: [state], LeRobot [observation.state]
    state_keys: Optional[List[str]] = None
    # env camera -> its obs dataset or feature; null: <camera>_image, LeRobot observation.images.<camera> (Any:
    # see policy.cameras)
    image_keys: Any = None
    valid: float = 0.2  # share of a file's episodes held out for the validation loss, where it has no mask/valid


@dataclass
class RecordConfig:
    """`python -m ebrl.demos record`: a scripted expert's successful episodes (ebrl/demos/record.py)."""

    env: EnvConfig = MISSING
    episodes: int = 20  # successful episodes to keep
    out: str = "demos/${env.name}-${env.task}"  # the folder demo.hdf5 is written to, or the LeRobot dataset's
    format: str = "hdf5"  # hdf5 (robomimic's layout) | lerobot (LeRobot's v3.0, images as PNG in the parquet)
    fps: int = II("oc.select:env.control_freq,20")  # format=lerobot: its frame rate (the env's control rate)
    valid: float = 0.2  # share of them held out (the file's mask/valid; a LeRobot dataset's valid split)
    seed: int = 0
    max_attempts: int = II("int_mul:${episodes},3")  # episodes tried before the recorder gives up
    progress: bool = True


@dataclass
class Config:
    # Any, not EnvConfig / PolicyConfig: a user's yaml names their own class with fields of its own
    # (`complete_user_classes`); ours carry their schemas in their defaults
    env: Any = MISSING
    policy: Any = MISSING
    hw: HwConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    allocator: AllocatorConfig = MISSING
    sweep: Optional[SweepConfig] = None  # set by sweep=stages (sweep.py)
    algo: AlgoConfig = MISSING
    logger: LoggerConfig = MISSING
    seed: int = 0
    iterations: int = 30
    checkpoint_every: int = 5  # iterations between checkpoints (the last is always written)
    resume: Optional[str] = None  # a run folder to continue
    device: str = "auto"  # auto (cuda when hw has GPUs) | cpu | cuda
    progress: bool = True  # progress bar on the console
    mode: str = "train"  # train | eval (run the policy of `checkpoint` for eval.episodes, no training)
    checkpoint: Optional[str] = None  # mode=eval: a run folder (its checkpoints/last.pt) or a .pt file
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # the weights training starts from: a run folder (its checkpoints/last.pt, e.g. an algo=sft run's) or a .pt file;
    # auto: the SFT checkpoint this repository ships for the policy and env, if it has one (SHIPPED in
    # ebrl/runtime/init.py), else none; null: the family's initialisation (or policy.checkpoint's weights)
    init: Optional[str] = "auto"
    demos: DemosConfig = field(default_factory=DemosConfig)


def register_configs() -> None:
    """Make the schemas known to Hydra; each group's yaml files name theirs in their defaults
    (`- /schema/<group>/<name>@_here_`). They live in groups of their own so that a group's options are its yaml
    files only: `scheduler=scheduler_schema` is no choice."""
    OmegaConf.register_new_resolver("recipe", resolve_recipe, replace=True)
    OmegaConf.register_new_resolver("int_mul", lambda a, b: int(a) * int(b), replace=True)
    OmegaConf.register_new_resolver("equals", lambda a, b: str(a) == str(b), replace=True)
    # (an unknown suite gets the adapter's one-line error, not the resolver's traceback)
    OmegaConf.register_new_resolver("libero_steps", lambda suite: SUITE_STEPS.get(suite, 240), replace=True)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(name="record_schema", node=RecordConfig)
    for name, node in ENV_SCHEMAS.items():
        cs.store(group="schema/env", name=f"{name}_schema", node=node)
    # a user's own env or policy yaml starts from these: the shared keys, open to fields of its class's own
    cs.store(group="schema/env", name="shared", node=OmegaConf.to_container(OmegaConf.structured(EnvConfig)))
    cs.store(group="schema/policy", name="shared", node=OmegaConf.to_container(OmegaConf.structured(PolicyConfig)))
    for name, node in [
        ("openpi_schema", OpenPIPolicyConfig),
        ("openvla_oft_schema", OpenVLAOFTPolicyConfig),
        ("gr00t_schema", GR00TPolicyConfig),
        ("wam_schema", WAMPolicyConfig),
    ]:
        cs.store(group="schema/policy", name=name, node=node)
    cs.store(group="schema/hw", name="hw_schema", node=HwConfig)
    cs.store(group="schema/scheduler", name="scheduler_schema", node=SchedulerConfig)
    cs.store(group="schema/allocator", name="allocator_schema", node=AllocatorConfig)
    cs.store(group="schema/algo", name="algo_schema", node=AlgoConfig)
    cs.store(group="schema/logger", name="logger_schema", node=LoggerConfig)


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
ALGOS = ("ppo", "grpo", "sft")
LOGGERS = ("none", "wandb")
LOGPROBS = ("flow_noise", "flow_sde")
CHAIN_LOGPROBS = ("sum", "mean", "one_step")
LOGPROB_LEVELS = ("action", "chunk")
PRESETS = ("tiny", "small", "full")
VARIANTS = ("pi0", "pi05")
DTYPES = ("float32", "bfloat16")
TRAIN_OPTIONS = ("all", "action_expert", "lora")


def _one_of(cfg: DictConfig, key: str, accepted: tuple[str, ...]) -> None:
    value = cfg_get(cfg, key)
    if value not in accepted:
        raise ConfigError(f"{key}={value!r} is not available; accepted: {', '.join(accepted)}")


def available_cpu_cores() -> int:
    return len(os.sched_getaffinity(0))


def rank_cores(cfg: Any) -> list[int]:
    """The CPU cores this rank may use: its share (ranks of one node split them) of the node's hw.cpu_cores, taken
    from those this process may run on (all of them when null). One rank, as `python run.py` is: all of them."""
    return share_of_node(sorted(os.sched_getaffinity(0))[: cfg.hw.cpu_cores or available_cpu_cores()], Ranks.from_env())





def _check_groups(cfg: DictConfig) -> None:
    """algo=grpo: the envs split into groups of algo.group_size, and the minibatches split the envs."""
    n, k, m = cfg.env.num_envs, cfg.algo.group_size, cfg.algo.minibatches
    if k < 2:
        raise ConfigError(f"algo.group_size={k} must be at least 2: a group compares its episodes' returns")
    if n % k:
        raise ConfigError(
            f"env.num_envs={n} is not a multiple of algo.group_size={k}; with algo=grpo use "
            f"env.num_envs={k}, {2 * k}, {3 * k}, ... or a group size that divides {n}"
        )
    if n % m:  # the rollout batch is env.num_envs x the chunks of one episode
        raise ConfigError(f"algo.minibatches={m} does not divide env.num_envs={n} (algo=grpo batches whole episodes)")


def complete_user_classes(cfg: DictConfig) -> None:
    """A user's env or policy yaml (one that names no schema of ours) merged onto a schema made from the shared
    EnvConfig / PolicyConfig and its class's constructor (ebrl/classes.py), its class checked against the contract;
    ours are left as they are. Idempotent: a completed node is typed."""
    from ebrl.classes import ContractError, base_named, complete, load_class, missing_methods

    if OmegaConf.get_type(cfg, "env") is dict:
        from ebrl.envs.process import NOT_ADAPTER_ARGS, load_adapter_class

        target = cfg_get(cfg, "env._target_", None)
        if not target:
            raise ConfigError("env has no _target_: name your adapter class (_target_: my_module.MyEnv) in your env "
                              "yaml, or pick one of ours (env=robosuite, maniskill, libero, robocasa)")
        try:
            cls = load_adapter_class(target)
        except BadInput as e:
            raise ConfigError(str(e)) from None
        cfg.env = complete(cfg.env, cls, EnvConfig, "env", ("seed",), NOT_ADAPTER_ARGS)
    if OmegaConf.get_type(cfg, "policy") is dict:
        target = cfg_get(cfg, "policy._target_", None)
        if not target:
            raise ConfigError("policy has no _target_: name your policy class (_target_: my_module.MyPolicy) in your "
                              "policy yaml, or pick one of ours (policy=openpi, openvla_oft, gr00t, wam)")
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
            raise ContractError(f"policy._target_={target!r} does not implement {method}, which "
                                f"{'algo=sft' if method == 'supervised_loss' else 'the runtime'} calls: a policy "
                                f"implements {POLICY_CONTRACT}")
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
            raise ConfigError(f"env.tasks entry {OmegaConf.to_container(entry)} must name a benchmark as env: one of "
                              f"{', '.join(ENV_SCHEMAS)} (with its task: {{env: libero, task: '0'}})")
        own = OmegaConf.load(CONF_DIR / "env" / f"{option}.yaml")
        own.pop("defaults", None)
        keys = {k: v for k, v in entry.items() if k != "env"}
        shared = {k: cfg.env[k] for k in SHARED_OBSERVATION}
        schema = OmegaConf.structured(ENV_SCHEMAS[option])
        try:
            node = OmegaConf.merge(schema, own, shared, keys)
        except ConfigKeyError as e:
            raise ConfigError(f"env.tasks entry of env={option}: {e.key} is not one of its keys ("
                              f"{', '.join(k for k in schema if k != 'fault')})") from None
        except ValidationError as e:
            raise ConfigError(f"env.tasks entry of env={option}: {str(e).splitlines()[0]}") from None
        done.append(OmegaConf.to_container(node, resolve=True))
    with open_dict(cfg.env):
        cfg.env.tasks = done


# policy.* keys the runtime applies (ebrl/policies/build.py); the rest are the family constructor's arguments
POLICY_RUNTIME_KEYS = ("_target_", "name", "checkpoint", "dtype", "train", "lora_rank", "lora_alpha",
                       "grad_checkpoint", "execute")
POLICY_CONTRACT = ("__init__(env_spec, ...) setting chunk_len, sample(obs) -> PolicySample, evaluate(obs, chunk, "
                   "extras) -> (log_prob, entropy, value), value(obs) -> (B,), tokenize(texts) -> (tokens, mask)")


def validate(cfg: DictConfig) -> None:
    """Reject values that compose but cannot work, with one line; checks what this machine can satisfy."""
    complete_user_classes(cfg)
    complete_benchmark_tasks(cfg)
    _check_mappings(cfg)
    for key in ("env.num_envs", "env.max_episode_steps", "env.image_size", "iterations", "checkpoint_every",
                "algo.rollout_chunks", "algo.epochs", "algo.minibatches", "algo.lr", "algo.max_nonfinite_updates"):
        _positive(cfg, key)
    if cfg_get(cfg, "algo.critic_warmup", 0) < 0:
        raise ConfigError(f"algo.critic_warmup={cfg.algo.critic_warmup} must be >= 0 (updates that train the value "
                          "head alone after init; 0: none)")
    for key in ("policy.chunk", "policy.execute", "policy.denoise_steps", "scheduler.torch_threads", "hw.cpu_cores"):
        if cfg_get(cfg, key, None) is not None:
            _positive(cfg, key)
    _one_of(cfg, "scheduler.name", SCHEDULERS)
    _one_of(cfg, "allocator.name", ALLOCATORS)
    _one_of(cfg, "algo.name", ALGOS)
    _one_of(cfg, "logger.name", LOGGERS)
    _one_of(cfg, "policy.preset", PRESETS)
    _one_of(cfg, "algo.logprob_level", LOGPROB_LEVELS)
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
    _check_tasks(cfg)
    _check_numbers(cfg)
    _check_failures(cfg)
    _one_of(cfg, "device", ("auto", "cpu", "cuda"))
    training = cfg_get(cfg, "mode", "train") != "eval"  # mode=eval runs no update, so the algorithm's batch is moot
    if training and cfg.algo.name == "grpo":
        _check_groups(cfg)
    elif training and cfg.algo.name == "sft":
        for key in ("algo.batch_size", "algo.steps_per_iteration"):
            _positive(cfg, key)
        if not 0 <= cfg.demos.valid < 1:
            raise ConfigError(f"demos.valid={cfg.demos.valid} must be in [0, 1) (the share of episodes held out)")
    elif training:
        batch = cfg.env.num_envs * cfg.algo.rollout_chunks
        if cfg.algo.global_batch is not None:
            world = Ranks.from_env().world  # (each rank collects its own rollout)
            total = batch * world
            if total > cfg.algo.global_batch and total % cfg.algo.global_batch:
                raise ConfigError(
                    f"algo.global_batch={cfg.algo.global_batch} does not divide the rollout batch of {total} chunk "
                    f"steps (env.num_envs x algo.rollout_chunks x {world} rank(s)): give a divisor, or null to split "
                    "by algo.minibatches")
        elif batch % cfg.algo.minibatches:
            raise ConfigError(
                f"algo.minibatches={cfg.algo.minibatches} does not divide the rollout batch "
                f"env.num_envs x algo.rollout_chunks = {batch}"
            )
    if cfg.hw.gpus > 0 or cfg.device == "cuda":
        have = cuda_device_count()
        need = max(cfg.hw.gpus, 1)
        if have == 0 and cfg.hw.gpus == 0:
            raise ConfigError("device=cuda needs a CUDA GPU and this machine has none; use device=auto or device=cpu")
        if have < need:
            have_text = "none" if have == 0 else str(have)
            raise ConfigError(f"hw={cfg.hw.name} needs {need} CUDA GPU{'s' if need > 1 else ''} and this machine has {have_text}")
    cores = available_cpu_cores()
    if cfg.hw.cpu_cores is not None and cfg.hw.cpu_cores > cores:
        raise ConfigError(f"hw.cpu_cores={cfg.hw.cpu_cores} (hw={cfg.hw.name}) is more than the {cores} CPU cores this "
                          f"machine gives; use hw.cpu_cores={cores} or fewer, or null for all of them")
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
    grpo = cfg_get(cfg, "algo.name", "") == "grpo" and cfg_get(cfg, "mode", "train") != "eval"
    try:
        assign_tasks(env, cfg.env.num_envs, cfg.algo.group_size if grpo else 1)
    except BadInput as e:
        raise ConfigError(str(e)) from None


def _check_launch(cfg: DictConfig) -> int:
    """The ranks torchrun started against the nodes and GPUs hw describes; the cores each rank gets."""
    ranks, hw = Ranks.from_env(), cfg.hw
    _positive(cfg, "hw.nodes")
    _one_of(cfg, "distributed.strategy", ("ddp", "fsdp"))
    per_node = hw.gpus or ranks.local_world  # one rank per GPU; on CPU as many as were started
    command = f"torchrun --nnodes {hw.nodes} --nproc-per-node {per_node} run.py hw={hw.name} ..."
    if hw.nodes > 1 and not ranks.distributed:
        raise ConfigError(f"hw={hw.name} spans {hw.nodes} nodes and this is one process; launch one per node: {command}")
    if ranks.distributed:
        if ranks.nodes != hw.nodes or (hw.gpus and ranks.local_world != hw.gpus):
            raise ConfigError(f"torchrun started {ranks.nodes} node(s) x {ranks.local_world} rank(s) and hw={hw.name} "
                              f"describes {hw.nodes} node(s) x {per_node} (one rank per GPU); launch {command}")
        if cfg.distributed.strategy == "fsdp" and cfg.scheduler.trainer == "local":
            raise ConfigError(f"distributed.strategy=fsdp shards the trainer process's weights and "
                              f"scheduler={cfg.scheduler.name} trains in the process that generates "
                              "(scheduler.trainer=local); use scheduler=ebrl (or async, hybrid, disaggregated) or "
                              "distributed.strategy=ddp")
        if cfg_get(cfg, "mode", "train") == "eval":
            raise ConfigError("mode=eval runs as one process: python run.py mode=eval checkpoint=<run folder> ...")
        if cfg.device == "cuda" and not hw.gpus:
            raise ConfigError(f"device=cuda with several ranks needs hw with GPUs (one rank per GPU); hw={hw.name} has none")
    cores = len(rank_cores(cfg))
    if cores == 0:
        node = cfg.hw.cpu_cores or available_cpu_cores()
        raise ConfigError(f"{ranks.local_world} ranks on one node share its {node} CPU cores: at most {node} ranks per "
                          "node (torchrun --nproc-per-node)")
    return cores


def _check_numbers(cfg: DictConfig) -> None:
    """Numbers with a range that compose (they have the right type) but mean nothing outside it."""
    a = cfg.algo
    checks = [
        ("seed", cfg.seed, 0 <= cfg.seed < 2**32, "between 0 and 2**32 - 1"),
        ("hw.gpus", cfg.hw.gpus, cfg.hw.gpus >= 0, ">= 0"),
        ("algo.clip", a.clip, a.clip > 0, "> 0 (0.2 is usual)"),
        ("algo.clip_high", a.clip_high, a.clip_high is None or a.clip_high > 0, "> 0 (0.28 in DAPO), or null (clip)"),
        ("algo.value_clip", a.value_clip, a.value_clip is None or a.value_clip > 0, "> 0, or null (no value clip)"),
        ("algo.huber_delta", a.huber_delta, a.huber_delta is None or a.huber_delta > 0,
         "> 0, or null (a squared-error value loss)"),
        ("algo.critic_lr", a.critic_lr, a.critic_lr > 0, "> 0 (the value head's learning rate)"),
        ("algo.adam_betas", list(a.adam_betas), len(a.adam_betas) == 2 and all(0 <= b < 1 for b in a.adam_betas),
         "two numbers in [0, 1), e.g. [0.9, 0.999]"),
        ("algo.adam_eps", a.adam_eps, a.adam_eps > 0, "> 0"),
        ("algo.weight_decay", a.weight_decay, a.weight_decay >= 0, ">= 0 (AdamW's decoupled decay; 0: Adam)"),
        ("algo.gamma", a.gamma, 0 < a.gamma <= 1, "in (0, 1]"),
        ("algo.gae_lambda", a.gae_lambda, 0 <= a.gae_lambda <= 1, "in [0, 1]"),
        ("algo.max_grad_norm", a.max_grad_norm, a.max_grad_norm > 0, "> 0 (the gradient norm it clips to)"),
        ("algo.target_kl", a.target_kl, a.target_kl is None or a.target_kl > 0, "> 0, or null (no early stop)"),
        ("algo.dual_clip", a.dual_clip, a.dual_clip is None or a.dual_clip > 1,
         "> 1 (3.0 in RLinf's recipes), or null (no cap)"),
        ("algo.global_batch", a.global_batch, a.global_batch is None or a.global_batch > 0,
         "> 0 (chunk steps per optimizer step), or null (algo.minibatches)"),
        ("distributed.timeout_s", cfg.distributed.timeout_s, cfg.distributed.timeout_s > 0,
         "> 0 (seconds a rank waits for the others at a collective)"),
    ]
    for key, value, ok, want in checks:
        if not ok:
            raise ConfigError(f"{key}={value} must be {want}")


# the keys that hold a mapping (typed Any, see PolicyConfig.cameras): key, its values' type, null values allowed, e.g.
MAPPINGS = (("policy.cameras", str, True, "{base_0_rgb: agentview, right_wrist_0_rgb: null}"),
            ("policy.dims", int, False, "{width: 1024, depth: 18}"),
            ("demos.image_keys", str, False, "{agentview: agentview_image}"))


def _check_mappings(cfg: DictConfig) -> None:
    """The mapping keys: null, or a mapping of names to values of their type."""
    for key, kind, nullable, example in MAPPINGS:
        value = cfg_get(cfg, key, None)
        if value is None:
            continue
        fits = isinstance(value, DictConfig) and all(
            isinstance(k, str) and ((isinstance(v, kind) and not isinstance(v, bool)) or (nullable and v is None))
            for k, v in value.items())
        if not fits:
            shown = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value
            raise ConfigError(f"{key}={shown} must be a mapping of names to {kind.__name__}s"
                              f"{' or null' if nullable else ''}, e.g. \"{key}={example}\", or null")


def _check_precision(cfg: DictConfig) -> None:
    """policy.dtype, what is trained, and how the trainer batches and stores its optimizer state."""
    if cfg.policy.dtype is not None:
        _one_of(cfg, "policy.dtype", DTYPES)
    _one_of(cfg, "policy.train", TRAIN_OPTIONS)
    _one_of(cfg, "algo.optimizer_dtype", DTYPES)
    if cfg.policy.train == "lora":
        for key in ("policy.lora_rank", "policy.lora_alpha"):
            _positive(cfg, key)
    if cfg.algo.micro_batch is not None:
        _positive(cfg, "algo.micro_batch")


FAULTS = ("hang", "error", "exit")


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
        raise ConfigError(f"env.fault.env={fault.env} must be in 0..{cfg.env.num_envs - 1} and env.fault.chunk="
                          f"{fault.chunk} >= 1")


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
        raise ConfigError(f"hw.sm_partition={partition} shares the SMs of a GPU and hw={hw.name} has none; "
                          "use hw.sm_partition=none (and hw.mps=false)")
    if partition == "green":  # (torch's contexts also all start at the first SMs: ResourcePool's GreenPartition)
        raise ConfigError("hw.sm_partition=green splits SMs between the streams of one process, and a run generates "
                          "and trains in two (colocated: one after the other), which without MPS take turns on the "
                          "GPU; use hw.sm_partition=mps (or none)")
    if a.name == "elastic" and cfg.scheduler.trainer == "local":
        raise ConfigError("allocator=elastic moves resources between the stages' processes and scheduler=colocated "
                          "runs every stage in one; use scheduler=ebrl (or async)")
    if a.name == "elastic" and cfg.scheduler.train_share is not None:
        share = cfg.scheduler.train_share
        raise ConfigError(f"allocator=elastic would move the cores that scheduler.train_share={share} fixes (the "
                          "split that defines disaggregated); use scheduler=ebrl or async")
    if a.name == "elastic" and not cfg.scheduler.overlap:
        raise ConfigError(f"allocator=elastic moves resources between stages that run side by side and "
                          f"scheduler={cfg.scheduler.name} runs rollout and training one after the other, each on "
                          "every core; use scheduler=ebrl or async")
    for key, low in (("window", 1), ("cooldown", 0)):
        if a[key] < low:
            raise ConfigError(f"allocator.{key}={a[key]} must be >= {low}")
    if a.min_gain < 0:
        raise ConfigError(f"allocator.min_gain={a.min_gain} must be >= 0 (a relative throughput gain; 0.1 is 10%)")
    if not 0 < a.ema <= 1:
        raise ConfigError(f"allocator.ema={a.ema} must be in (0, 1] (the latest measurement's weight; 1 trusts it alone)")
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
    for key, value, why in (("overlap", s.overlap, "overlaps training with the rollout, which needs a trainer of its "
                             "own"), ("train_share", s.train_share, "gives training cores of its own"),
                            ("generation", s.generation if s.generation == "process" else None,
                             "generates in a process of its own, and a local trainer trains the supervisor's policy")):
        if value:
            raise ConfigError(f"scheduler.trainer=local trains in the supervisor between two rollouts and "
                              f"scheduler.{key}={value} {why}; use scheduler.trainer=process (or scheduler=ebrl)")


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
    if cfg.algo.name == "grpo" and s.groups > cfg.env.num_envs // cfg.algo.group_size:
        units = cfg.env.num_envs // cfg.algo.group_size
        raise ConfigError(f"scheduler.groups={s.groups} must be between 1 and {units} with algo=grpo: a group of "
                          f"the schedule holds whole GRPO groups (env.num_envs={cfg.env.num_envs} / "
                          f"algo.group_size={cfg.algo.group_size})")
    if s.serial and (s.trainer != "local" or s.core_rebinding):
        why = "trains in a process of its own" if s.trainer != "local" else "pins each simulator process to a core"
        raise ConfigError(f"scheduler.serial=true runs every stage in this process, one after another, and "
                          f"scheduler={name} {why}; use scheduler=colocated scheduler.serial=true")
    if s.trainer == "local":
        _check_local_trainer(cfg)
        return
    if s.max_ahead < 1:
        raise ConfigError(f"scheduler.max_ahead={s.max_ahead} must be >= 1 (iterations the rollout may run ahead of "
                          "training; scheduler.overlap=false runs none ahead)")
    if s.max_staleness < 0:
        raise ConfigError(f"scheduler.max_staleness={s.max_staleness} must be >= 0 (0: only data of the current weights)")
    if not 0 <= s.sim_nice <= 19:
        raise ConfigError(f"scheduler.sim_nice={s.sim_nice} must be a nice value from 0 (none) to 19")
    if s.generation is not None:
        _one_of(cfg, "scheduler.generation", GENERATION_PLACES)
    if s.is_clip <= 0:
        raise ConfigError(f"scheduler.is_clip={s.is_clip} must be > 0 (2.0 is usual)")
    for key in ("queue_size", "train_threads"):
        if s[key] is not None and s[key] < 1:
            raise ConfigError(f"scheduler.{key}={s[key]} must be >= 1 or null")
    if cores < 2 and s.train_share is None:  # the allocator's smallest plan: 1 core to simulate, a share for the rest
        ranks = Ranks.from_env()
        where = f" (this node's cores split over its {ranks.local_world} ranks)" if ranks.local_world > 1 else ""
        raise ConfigError(f"scheduler={name} simulates, generates and trains side by side and needs at least 2 CPU "
                          f"cores; this rank has {cores}{where}; use scheduler=colocated, or fewer ranks per node")
    if s.train_share is not None:
        if cfg.hw.gpus == 1:
            raise ConfigError(f"scheduler={name} trains on a device of its own and hw={cfg.hw.name} has one GPU; "
                              "use hw with 2+ GPUs or scheduler=hybrid")
        if not 0 < s.train_share < 1 or not 1 <= train_core_count(s.train_share, cores) < cores:
            low, high = f"{1 / cores:.2f}", f"{1 - 1 / cores:.2f}"
            allowed = f"on {cores} cores: {low}" if low == high else f"between {low} and {high}"
            raise ConfigError(f"scheduler.train_share={s.train_share} must give training at least one of the {cores} "
                              f"CPU cores and leave rollout at least one ({allowed})")
