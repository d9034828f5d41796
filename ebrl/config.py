"""Typed schemas for every config group, registered in Hydra's ConfigStore.

A misspelled key or a wrong type fails at composition with Hydra's own message; values that
compose but make no sense are rejected by `ebrl.checks.validate` with one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf

from ebrl.envs.libero_env import SUITE_STEPS
from ebrl.errors import BadInput
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

    # hang (sleeps past any timeout) | error (raises in the chunk) | exit (dies) | slow (spends `seconds` of CPU
    # before the chunk, then runs it); null: none
    kind: Optional[str] = None
    env: int = 0  # which env's simulator
    chunk: int = 1  # at its k-th chunk
    again: bool = False  # its replacements fail the same way
    seconds: float = 1.0  # slow's CPU time


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
    terminate_on_success: bool = True  # success ends the episode (SHAPED_DENSE: under the sparse reward only)
    # robosuite family: a control step's substeps without robosuite's Python around the physics, bit for bit the
    # stock trajectories (ebrl/envs/fast_step.py); false: the stock step (the control)
    fast_step: bool = True
    python: Optional[str] = None  # interpreter the simulator workers run under; null: this one
    # many tasks of this benchmark in one run: a list ([Lift,Stack]) or all (a LIBERO suite's); null: env.task alone.
    # Envs (GRPO: groups) go to tasks round-robin, or in proportion to task_weights (ebrl/envs/tasks.py)
    tasks: Any = None
    task_weights: Optional[List[float]] = None
    fault: FaultConfig = field(default_factory=lambda: FaultConfig())  # tests only


# Benchmarks whose env.reward=dense is a shaped reward that pays before success too (LIBERO's and RoboCasa's dense is
# their success reward). An episode that ended at success would be worth less than one that hovers short of it to the
# step limit, so there success ends the episode under the sparse reward only, as in the simulators' own RL baselines
# (docs/use/environments.md, "Dense reward and success"); checks.py refuses the other way
SHAPED_DENSE = ("robosuite", "maniskill")
ENDS_AT_SUCCESS = II("equals:${.reward},sparse")  # their env.terminate_on_success


@dataclass
class RobosuiteEnvConfig(EnvConfig):
    _target_: str = "ebrl.envs.robosuite_env.RobosuiteEnv"
    name: str = "robosuite"
    task: str = "Lift"
    terminate_on_success: bool = ENDS_AT_SUCCESS
    robot: str = "Panda"
    control_freq: int = 20
    # what the shaped reward counts as a grasp: contact (robosuite's check: both finger pads touch the object) |
    # squeeze (and they push on it along the line between them: closed fingers pressed on its top are no grasp; on
    # Lift success needs the squeeze too); ebrl/envs/robosuite_env.py, GRASPS; docs/use/environments.md
    grasp: str = "contact"


@dataclass
class ManiSkillEnvConfig(EnvConfig):
    _target_: str = "ebrl.envs.maniskill_env.ManiSkillEnv"
    name: str = "maniskill"
    task: str = "PickCube-v1"
    terminate_on_success: bool = ENDS_AT_SUCCESS
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


ENV_SCHEMAS = {
    "robosuite": RobosuiteEnvConfig,
    "maniskill": ManiSkillEnvConfig,
    "libero": LiberoEnvConfig,
    "robocasa": RoboCasaEnvConfig,
}
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
    # How generation runs a flow family's denoising loop after the prefix (ebrl/policies/capture.py): graph (CUDA
    # graphs, one per generation batch size) | compile (torch.compile, a compile per batch size) | off | auto: graph on
    # a GPU, off on a CPU, where compiling takes longer than a run saves (docs/use/policies.md, "Capture")
    capture: str = "auto"


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


# --- scheduler, allocator ----------------------------------------------------------------
@dataclass
class SchedulerConfig:
    name: str = MISSING
    torch_threads: Optional[int] = None  # threads for generation (and colocated training); null: hw cores
    # Every schedule is these switches of one runtime; see ebrl/runtime/schedule.py
    overlap: bool = False  # train on iteration i-1 while rollout i collects
    groups: int = 1  # env groups; generation serves whichever is ready while others simulate
    core_rebinding: bool = False  # an env runs only while it holds a sim core, handed out by core_order
    # which ready env a freed sim core goes to: longest (the longest estimated step of any group) | readiness (the
    # group closest to its chunk boundary first, then the longest step within it; measured a tie:
    # docs/internals/schedules.md, "Measured choices")
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
    # with overlap: decoupled PPO; false: plain PPO clipped around the (stale) behaviour policy, float32 policies only
    # (a bfloat16 one has no exact log-probs of the behaviour policy: refused)
    decoupled: bool = True
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
    # A simulator that dies, fails in a chunk, or hangs in one (its process's CPU time stands still for
    # chunk_timeout_s, or the chunk takes that much CPU: a slow simulator on a loaded machine is waited for) is
    # replaced by a fresh one; more than max_sim_failures replacements within sim_failure_window_s stop the run
    # (with a checkpoint)
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


# --- algorithm: a schema per algorithm (conf/algo/<name>.yaml names its own), each with only the keys it reads -----
# ebrl/checks.py checks each (ALGO_CHECKS, by the same names)
@dataclass
class AlgoConfig:
    """What every algorithm takes: AdamW over what policy.train trains, its batches and its gradient clip."""

    name: str = MISSING  # ppo | grpo | sft
    # The keys set to ${recipe:...} default to the run's recipe (ebrl/recipes.py): this repository's tuning for
    # the tiny and small presets, RLinf's / piRL's published configs for the model and benchmark at full size
    lr: float = II("recipe:lr")  # AdamW's for the policy
    adam_betas: List[float] = II("recipe:adam_betas")
    adam_eps: float = II("recipe:adam_eps")
    weight_decay: float = II("recipe:weight_decay")  # AdamW's decoupled decay
    max_grad_norm: float = II("recipe:max_grad_norm")
    # rows per forward/backward pass; their gradients accumulate to the minibatch, which stays one optimizer step
    # (also the rows of the trainer's proximal pass); null: the whole minibatch in one pass
    micro_batch: Optional[int] = II("recipe:micro_batch")
    optimizer_dtype: str = "float32"  # Adam's moments: float32 | bfloat16 (half their memory)


@dataclass
class RLAlgoConfig(AlgoConfig):
    """PPO's and GRPO's shared keys: epochs of the clipped loss over minibatches of one rollout."""

    epochs: int = II("recipe:epochs")
    minibatches: int = 4
    clip: float = II("recipe:clip")  # the ratio's clip below 1 (and above, unless clip_high)
    clip_high: Optional[float] = II("recipe:clip_high")  # the clip above 1 (DAPO's clip-higher); null: clip
    entropy_coef: float = II("recipe:entropy_coef")
    # chunk steps per optimizer step over all ranks (RLinf's global_batch_size), in place of algo.minibatches; a
    # rollout smaller than it is one step; null: the rollout batch / algo.minibatches
    global_batch: Optional[int] = II("recipe:global_batch")
    # what one ratio is taken over: action (each executed action's log-prob) | chunk (their sum over a chunk's
    # executed actions: RLinf's chunk_level)
    logprob_level: str = II("recipe:logprob_level")
    # a negative advantage's ratio counts at most this much (dual-clip PPO, RLinf's clip_ratio_c; > 1); null: no cap
    dual_clip: Optional[float] = II("recipe:dual_clip")
    # a policy whose backbone does not train (policy.train=action_expert) runs it once per row and update, and every
    # epoch, micro-batch and the proximal pass reuse its output (docs/internals/design.md, "The frozen prefix"); false:
    # every pass runs it again (the same numbers, more time)
    cache_prefix: bool = True
    # rows a decoupled update's proximal pass values: stale (those sampled by older weights; the others take their
    # behaviour log-prob and value, which those weights gave) | all (every row: a second pass under the same weights)
    proximal: str = "stale"
    normalize_advantages: bool = True
    target_kl: Optional[float] = None  # stop the epochs of an update once approx KL per action exceeds it
    # A step whose gradient holds NaN/inf is skipped and counted (train/nonfinite_steps); after this many updates in a
    # row with such steps the run stops, its checkpoint the last one written before them
    max_nonfinite_updates: int = 3


@dataclass
class PPOConfig(RLAlgoConfig):
    """algo=ppo: GAE over chunk steps and a value loss beside the clipped ratio (ebrl/rl/ppo.py)."""

    name: str = "ppo"
    rollout_chunks: int = 10  # chunks each env collects per iteration
    critic_lr: float = II("recipe:critic_lr")  # AdamW's for the value head
    gamma: float = 0.99  # discount per chunk
    gae_lambda: float = 0.95
    # an episode cut off by env.max_episode_steps is bootstrapped from the value of its last observation (the limit
    # is the env's, the task would go on); false: it ends there with nothing more to come (the task is to succeed
    # within the limit: a failure's return is 0). By default true with env.reward=dense, false with sparse
    bootstrap_truncated: bool = II("equals:${env.reward},dense")
    reward_scale: float = 1.0  # rewards are multiplied by it before GAE (the critic's targets keep a scale near 1)
    # the value moves at most this far from the rollout's per update (PPO2's value clip); null: unclipped
    value_clip: Optional[float] = II("recipe:value_clip")
    huber_delta: Optional[float] = II("recipe:huber_delta")  # the value loss is Huber at this delta; null: squared
    value_coef: float = II("recipe:value_coef")
    # from `init` (an SFT checkpoint, whose value head never learned): the first critic_warmup updates train the
    # value head alone on the rollouts, the policy loss counts from the next; 0: from the first. Ignored from scratch
    critic_warmup: int = II("recipe:critic_warmup")


@dataclass
class GRPOConfig(RLAlgoConfig):
    """algo=grpo: every env runs one whole episode per iteration, advantages relative to its group's returns, no
    critic (ebrl/rl/grpo.py): no value head learning rate, value loss, discount or rollout length."""

    name: str = "grpo"
    group_size: int = 4  # K envs that start from the same seeded reset form a group; env.num_envs a multiple of it


@dataclass
class SFTConfig(AlgoConfig):
    """algo=sft, on demos.path (ebrl/runs/sft.py): the family's supervised loss, no rollout."""

    name: str = "sft"
    # (observation, action chunk) samples per optimizer step, and the steps of one iteration (the held-out loss is
    # measured after each)
    batch_size: int = 64
    steps_per_iteration: int = 100


ALGO_SCHEMAS = {"ppo": PPOConfig, "grpo": GRPOConfig, "sft": SFTConfig}


# --- logger, sweep ------------------------------------------------------------------------
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
    """`mode=eval`: how many episodes the loaded policy runs (ebrl/runs/evaluation.py)."""

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
    # | auto: ddp where the memory model says a replica fits one GPU, else fsdp
    strategy: str = "auto"


@dataclass
class DemosConfig:
    """algo=sft: the demonstrations it trains on, in robomimic's HDF5 layout or LeRobot's (docs/use/demos.md)."""

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
    algo: AlgoConfig = MISSING  # its algorithm's schema (PPOConfig, GRPOConfig, SFTConfig), which conf/algo names
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
    # ebrl/runs/init.py), else none; null: the family's initialisation (or policy.checkpoint's weights)
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
    for name, node in ALGO_SCHEMAS.items():
        cs.store(group="schema/algo", name=f"{name}_schema", node=node)
    cs.store(group="schema/logger", name="logger_schema", node=LoggerConfig)
