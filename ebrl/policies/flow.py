"""What the flow-matching families (openpi, gr00t, wam) share: a stochastic Euler chain from noise (t = 1) to actions
(t = 0), the Gaussian log-density of each of its steps, and sample / evaluate / value on top of it.

Two ways to make the chain stochastic (`policy.logprob`):
- flow_noise (Flow-Noise, as RLinf trains pi0): x_{k+1} = x_k + dt v + sigma_k eps, with sigma_k (per step, action and
  dim) from a small learned head on the velocity features and the time, bounded in [noise_std_min, noise_std_max].
- flow_sde (Flow-GRPO's SDE): the reverse-time SDE with the same marginals as the ODE, sigma_t = a sqrt(t / (1 - t)):
  mean = x + dt [v + sigma_t^2 / (2t) (x + (1 - t) v)], std = sigma_t sqrt(|dt|); a = policy.sde_noise_level. At
  t = 1 the denominator takes the second step's time, as Flow-GRPO and RLinf do (sigma = a sqrt(1 / (1 - t_1))).
Where the noise enters and what the log-prob of an action is (`policy.chain_logprob`):
- sum: every step is stochastic; the log-prob is the sum over the K steps of its dims' Gaussian log-densities;
- mean: every step; the mean of those K and x_0's standard normal density (RLinf's joint_logprob);
- one_step: one step, drawn per sampled batch, is stochastic and the others are plain Euler steps; the log-prob is
  that step's density (RLinf's Flow-SDE without joint_logprob), so the trainer runs the velocity once per row.
evaluate recomputes the log-prob from the stored chain, all the steps it needs in one batched pass. The chain, its
means, stds and densities are float32 whatever the policy's dtype (a bfloat16 policy's velocity is cast up): a ratio
is a product of K x action-dims Gaussian factors. Only the env's action dims are stochastic. The padded dims (the
model's flow_dim is wider) follow flow matching's straight path from their starting noise to 0, t x_0, as training on
zero-padded actions shaped them (under one_step: plain Euler steps, as every dim takes at the other steps): no noise
is injected there, so leaving them out of the density biases nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ebrl.config import ConfigError
from ebrl.policies.base import Policy, PolicySample, masked_mean
from ebrl.policies.capture import check_capture, loop_on
from ebrl.policies.layers import expand_rows, map_tensors

LOGPROBS = ("flow_noise", "flow_sde")
CHAIN_LOGPROBS = ("sum", "mean", "one_step")


def sample_flow_time(n: int, like: torch.Tensor) -> torch.Tensor:
    """n training times in (0.001, 1], denser near t = 1 (noise), as pi0 samples them: Beta(1.5, 1) scaled."""
    return (torch.distributions.Beta(1.5, 1.0).sample((n,)) * 0.999 + 0.001).to(like)


class FlowPolicy(Policy):
    """A policy whose action chunk comes out of a denoising chain. Subclasses provide:

    encode(obs, prefix=None) -> (cond, pooled): what the velocity is conditioned on (any nested structure of
        (B, ...) tensors) and (B, F) features for `value_head`; from `prefix(obs)` where given (a frozen prefix);
    features(x, t, cond) -> (h, temb): the input (N, H, feature_dim) of `velocity_out` for noisy chunks x
        (N, H, flow_dim) at times t (N,), and a time embedding (N, time_dim) or (N, H, time_dim);
    velocity_out: the final nn.Linear(feature_dim, flow_dim) of the velocity; value_head: (B, F) -> (B, 1).
    """

    velocity_out: nn.Linear
    value_head: nn.Module

    def init_flow(
        self,
        *,
        flow_dim: int,
        chunk_len: int,
        denoise_steps: int,
        feature_dim: int,
        time_dim: int,
        logprob: str,
        noise_std_min: float,
        noise_std_max: float,
        sde_noise_level: float,
        chain_logprob: str = "sum",
        detach_critic_input: bool = False,
    ) -> None:
        """Check the chain's options and build the Flow-Noise std head (only for logprob=flow_noise).
        detach_critic_input: the value head reads the features without passing its loss's gradient into them."""
        if logprob not in LOGPROBS:
            raise ConfigError(f"policy.logprob={logprob!r} is not available; accepted: {', '.join(LOGPROBS)}")
        if chain_logprob not in CHAIN_LOGPROBS:
            raise ConfigError(
                f"policy.chain_logprob={chain_logprob!r} is not available; accepted: {', '.join(CHAIN_LOGPROBS)}"
            )
        if not 0 < noise_std_min <= noise_std_max:
            raise ConfigError(
                f"policy.noise_std_min={noise_std_min} and policy.noise_std_max={noise_std_max} "
                "must satisfy 0 < min <= max"
            )
        if not sde_noise_level > 0:
            raise ConfigError(f"policy.sde_noise_level={sde_noise_level} must be > 0")
        for key, value in (("policy.chunk", chunk_len), ("policy.denoise_steps", denoise_steps)):
            if value < 1:
                raise ConfigError(f"{key}={value} must be a positive integer")
        self.flow_dim, self.chunk_len, self.denoise_steps = flow_dim, chunk_len, denoise_steps
        self.logprob, self.chain_logprob, self.detach_critic_input = logprob, chain_logprob, bool(detach_critic_input)
        self.log_std_min, self.log_std_max = math.log(noise_std_min), math.log(noise_std_max)
        self.sde_noise_level = sde_noise_level
        self.capture, self._loops = "auto", {}  # policy.capture (build_policy sets it) -> its loop, once made
        if logprob == "flow_noise":
            self.noise_std_head = nn.Sequential(
                nn.Linear(feature_dim + time_dim, feature_dim), nn.SiLU(), nn.Linear(feature_dim, flow_dim)
            )
            self._close_noise_head()

    def _close_noise_head(self) -> None:
        """The noise std starts at the geometric mean of its bounds everywhere."""
        nn.init.zeros_(self.noise_std_head[-1].weight)
        nn.init.zeros_(self.noise_std_head[-1].bias)

    def init_head(self, prefix: str) -> None:
        super().init_head(prefix)
        if prefix.rstrip(".") == "noise_std_head":
            self._close_noise_head()

    # --- subclass API ------------------------------------------------------------------------
    def encode(self, obs: dict[str, torch.Tensor], prefix: Any = None) -> tuple[Any, torch.Tensor]:
        raise NotImplementedError

    def features(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def rl_heads(self) -> list[str]:
        return self.heads_of(self.logprob)

    @staticmethod
    def heads_of(logprob: str) -> list[str]:
        """The RL heads a flow policy of this `policy.logprob` adds: the value head, and Flow-Noise's std head."""
        return ["value_head", "noise_std_head"] if logprob == "flow_noise" else ["value_head"]

    # --- the chain ---------------------------------------------------------------------------
    def times(self, steps: int, device: torch.device) -> torch.Tensor:
        """Flow time at the start of each Euler step, 1 down to 1/steps; sample and evaluate share it bit for bit."""
        return 1.0 - torch.arange(steps, device=device, dtype=torch.float32) / steps

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """v(x, t) (N, H, flow_dim) and, for flow_noise, the log noise std of this step in [log min, log max], both
        float32. cond may hold the rows of N / r observations for N = r x that many chains (`layers.attention`)."""
        h, temb = self.features(x, t, cond)
        v = self.velocity_out(h).float()
        if self.logprob != "flow_noise":
            return v, None
        if temb.dim() == 2:
            temb = temb[:, None].expand(-1, h.shape[1], -1)
        raw = self.noise_std_head(torch.cat([h, temb.to(h.dtype)], -1)).float()
        return v, self.log_std_min + (self.log_std_max - self.log_std_min) * raw.sigmoid()

    def step(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        cond: Any,
        velocity: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log std (both (N, H, flow_dim), float32) of x at the next time, from x (float32) at times t (N,)
        (`velocity`: v and the log std at x, where the caller has them)."""
        steps = self.denoise_steps
        v, log_std = velocity or self.velocity(x, t, cond)
        dt = -1.0 / steps
        if log_std is not None:
            return x + dt * v, log_std
        # Flow-SDE; sigma_t is infinite at t = 1: there the denominator takes the second step's time (Flow-GRPO's
        # sde_step_with_logprob, RLinf's sample_mean_var_val)
        t = t.to(x.dtype)[:, None, None]
        denominator = 1.0 - t.clamp(max=1.0 - 1.0 / steps if steps > 1 else 0.5)
        sigma = self.sde_noise_level * torch.sqrt(t / denominator)
        mean = x + dt * (v + sigma.pow(2) / (2.0 * t) * (x + (1.0 - t) * v))
        return mean, torch.log(sigma * math.sqrt(-dt)).expand_as(mean)

    def advance(
        self, start: torch.Tensor, k: int, mean: torch.Tensor, log_std: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """x after Euler step k of a chain that started at `start`: the env's dims drawn around the step's mean, the
        padded dims at (1 - (k + 1) / K) x_0 on their straight path to 0 (module docstring)."""
        x = mean + log_std.exp() * noise
        if self.model_action_dim == self.flow_dim:
            return x
        t_next = 1.0 - (k + 1) / self.denoise_steps
        return torch.cat([x[..., : self.model_action_dim], t_next * start[..., self.model_action_dim :]], -1)

    def log_density(self, x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
        """Gaussian log-density summed over the env's action dims (the padded dims are deterministic: no density)."""
        z = (x - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - 0.5 * math.log(2 * math.pi))[..., : self.model_action_dim].sum(-1)

    def x0_log_density(self, start: torch.Tensor) -> torch.Tensor:
        """x_0's standard normal log-density over the env's action dims (the chain's first term under
        chain_logprob=mean), (N, H)."""
        return (-0.5 * start.pow(2) - 0.5 * math.log(2 * math.pi))[..., : self.model_action_dim].sum(-1)

    def euler(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        """A plain Euler step x + dt v over every dim, as openpi, lerobot and GR00T sample."""
        return x - self.velocity(x, t, cond)[0] / self.denoise_steps

    @torch.no_grad()
    def sample(
        self, obs: dict[str, torch.Tensor], deterministic: bool = False, noise: torch.Tensor | None = None
    ) -> PolicySample:
        """x_0 ~ N(0, I) (or `noise`, (B, H, flow_dim)), then K Euler steps from t = 1 to t = 0, stochastic where
        `chain_logprob` says (module docstring); the chain goes to extras for evaluate. deterministic: plain Euler
        steps over every dim, as openpi, lerobot and GR00T sample (evaluation: a loaded checkpoint's real success);
        its log-probs are 0. The chunk is in the env's action space (`to_env`), the chain in the model's."""
        with self.precision():
            cond, pooled = self.encode(obs)
            batch, steps, device = pooled.shape[0], self.denoise_steps, pooled.device
            start = (
                torch.randn(batch, self.chunk_len, self.flow_dim, device=device)
                if noise is None
                else noise.to(device, torch.float32)
            )
            mode = "deterministic" if deterministic else self.chain_logprob
            extras: dict[str, torch.Tensor] = {}
            index = None
            if mode == "one_step":  # the stochastic step, one per batch (as RLinf draws it)
                index = torch.randint(steps, ()).to(device)
                extras["denoise_index"] = index.expand(batch).clone()
            # the stochastic steps' noise, drawn here in the order they take it, so that a captured loop draws none
            draws = [torch.randn_like(start) for _ in range(0 if deterministic else 1 if index is not None else steps)]
            chain, log_prob = self.capture_loop(mode, cond, start, torch.stack(draws) if draws else None, index)
            value = self.value_head(pooled).squeeze(-1).float()
        return PolicySample(
            chunk=self.to_env(chain[:, -1, ..., : self.model_action_dim]),
            log_prob=log_prob,
            value=value,
            extras={"chain": chain, **extras},
        )

    def walk(
        self, mode: str, cond: Any, start: torch.Tensor, draws: torch.Tensor | None, index: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain (N, K+1, H, flow_dim) from `start` and its log-prob (N, H): mode is chain_logprob or
        "deterministic"; draws (K, N, H, flow_dim) the steps' noise (one_step: (1, ...), at step `index`, a 0-d
        tensor). It draws no random numbers and branches on no tensor, so one capture serves every draw."""
        steps, batch = self.denoise_steps, start.shape[0]
        times = self.times(steps, start.device)
        x, chain, log_prob = start, [start], start.new_zeros(start.shape[:2])
        for k in range(steps):
            t = times[k].expand(batch)
            if mode == "deterministic":
                x = self.euler(x, t, cond)
            elif mode == "one_step":  # stochastic at step `index` only: chosen by value, not by a branch
                drawn, density, euler = self.sde_step(x, t, cond, draws[0])
                here = index == k
                x, log_prob = torch.where(here, drawn, euler), torch.where(here, density, log_prob)
            else:
                mean, log_std = self.step(x, t, cond)
                x = self.advance(start, k, mean, log_std, draws[k])
                log_prob = log_prob + self.log_density(x, mean, log_std)
            chain.append(x)
        if mode == "mean":
            log_prob = (log_prob + self.x0_log_density(start)) / (steps + 1)
        return torch.stack(chain, 1), log_prob

    @property
    def capture(self) -> str:
        """How sample runs its denoising loop (`policy.capture`, ebrl/policies/capture.py)."""
        return self._capture

    @capture.setter
    def capture(self, capture: str) -> None:
        check_capture(capture)
        self._capture = capture

    def capture_loop(
        self, mode: str, cond: Any, start: torch.Tensor, draws: torch.Tensor | None, index: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`walk` as `policy.capture` runs it on start's device: replayed from CUDA graphs, compiled, or as it is
        (each setting's loop is kept, so switching back to one replays what it captured)."""
        loop = self._loops.get(self._capture)
        if loop is None:
            loop = self._loops[self._capture] = loop_on(self._capture, self.walk, start.device)
        return loop(mode, cond, start, draws, index)

    def _apply(self, fn: Any, recurse: bool = True) -> FlowPolicy:
        self._loops = {}  # moved or cast: graphs would read the old tensors, compiled code guard on them
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loops": {}}  # a copy captures its own loops

    def sde_step(
        self, x: torch.Tensor, t: torch.Tensor, cond: Any, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """chain_logprob=one_step's stochastic step from x with `noise`, its log-density (N, H), and the plain Euler
        step the other steps take: the env's dims drawn around the step's mean, the padded dims by the Euler step
        (no noise and no density, as in the chain's other steps)."""
        v, log_std = self.velocity(x, t, cond)
        mean, log_std = self.step(x, t, cond, (v, log_std))
        drawn = mean + log_std.exp() * noise
        euler = x - v / self.denoise_steps
        if self.model_action_dim < self.flow_dim:
            drawn = torch.cat([drawn[..., : self.model_action_dim], euler[..., self.model_action_dim :]], -1)
        return drawn, self.log_density(drawn, mean, log_std), euler

    @torch.no_grad()
    def value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Value head on the pooled features, without sampling a chunk."""
        with self.precision():
            return self.value_head(self.encode(obs)[1]).squeeze(-1).float()

    def evaluate(
        self, obs: dict[str, torch.Tensor], chunk: torch.Tensor, extras: dict[str, torch.Tensor], prefix: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """log_prob (B, H), entropy (B, H), value (B,) of the stored chain; chunk is its last step, so unused.
        The steps the log-prob counts (every one, or chain_logprob=one_step's) go through the velocity in one pass
        whose rows attend to their observation's features as they are (no per-step copy of them); `prefix`: the
        rows' frozen prefix, computed before (Policy.prefix)."""
        with self.precision():
            cond, pooled = self.encode(obs, prefix)
            chain = extras["chain"].to(pooled.device, torch.float32)  # (B, K+1, H, flow_dim)
            batch, steps, horizon, dim = chain.shape[0], chain.shape[1] - 1, chain.shape[2], chain.shape[3]
            times = self.times(steps, chain.device)
            if self.chain_logprob == "one_step":
                rows, k = torch.arange(batch, device=chain.device), extras["denoise_index"].to(chain.device)
                x, counted = chain[rows, k], 1
                mean, log_std = self.step(x, times[k], cond)
                nxt = chain[rows, k + 1]
            else:
                x, counted = chain[:, :-1].reshape(batch * steps, horizon, dim), steps
                mean, log_std = self.step(x, times.repeat(batch), cond)
                nxt = chain[:, 1:].reshape_as(x)
            log_prob = self.log_density(nxt, mean, log_std).view(batch, counted, horizon).sum(1)
            entropy = (log_std + 0.5 * (1.0 + math.log(2 * math.pi)))[..., : self.model_action_dim].sum(-1)
            entropy = entropy.view(batch, counted, horizon).sum(1)
            if self.chain_logprob == "mean":  # x_0's density and entropy join the K steps', averaged
                log_prob = (log_prob + self.x0_log_density(chain[:, 0])) / (steps + 1)
                entropy = (entropy + 0.5 * (1.0 + math.log(2 * math.pi)) * self.model_action_dim) / (steps + 1)
            value = self.value_head(pooled.detach() if self.detach_critic_input else pooled).squeeze(-1).float()
        return log_prob, entropy, value

    def flow_matching_loss(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Supervised loss: x_t = t noise + (1 - t) a, regress v(x_t, t) on noise - a (the model's action dims, in its
        space: `from_env`), averaged over the actions `mask` (B, H) keeps."""
        with self.precision():
            cond, pooled = self.encode(obs)
            a = self.from_env(actions.to(pooled.device, torch.float32))
            a = F.pad(a, (0, self.flow_dim - a.shape[-1]))
            noise = torch.randn_like(a)
            t = sample_flow_time(a.shape[0], a)
            x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * a
            v, _ = self.velocity(x_t, t, cond)
            return masked_mean((v - (noise - a))[..., : self.model_action_dim].pow(2).mean(-1), mask)

    def supervised_loss(
        self, obs: dict[str, torch.Tensor], actions: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Flow matching, as openpi, lerobot and GR00T train these models."""
        return self.flow_matching_loss(obs, actions, mask)

    # --- the first policy ----------------------------------------------------------------------
    def neutral_obs(self) -> dict[str, torch.Tensor]:
        """One observation of zeros (state), mid-grey images (cameras) and the env's instruction, for initialisation
        probes."""
        device = next(self.parameters()).device
        tokens, mask = self.tokenize([self.env_spec.instruction])
        obs = {
            "state": torch.zeros(1, self.env_spec.obs["state"].shape[0], device=device),
            "tokens": torch.from_numpy(tokens).to(device),
            "token_mask": torch.from_numpy(mask).to(device),
        }
        for key, spec in self.env_spec.obs.items():
            if key.startswith("image/"):
                obs[key] = torch.full((1, *spec.shape), 128, dtype=torch.uint8, device=device)
        return obs

    @torch.no_grad()
    def init_contracting_velocity(
        self, probe: int = 32, gain: float = 3.0, fit_tokens: int = 4096, centre_tokens: int = 640
    ) -> None:
        """Fit `velocity_out` so that v(x, t) ~= c x, c = min(3, K), on random x (call after the subclass made x
        linearly readable from the velocity features).

        Flow-Noise credits only the injected noise, not x_0: with a zero or random velocity x_K ~ x_0 + noise and most
        exploration would go uncredited. A contraction shrinks x by (1 - c/K) per step, so x_0 fades to ~e^-3 of its
        scale and the first chunks are mostly credited noise around 0; any mean in [-1, 1] stays reachable through
        the bias and the features. Then the bias is shifted so that the mean action is 0 (`centre_actions`). A loaded
        checkpoint makes all of this moot, so a build with given weights skips it (ebrl/policies/build.py).
        `probe` chains per step, at most `fit_tokens` action tokens in all (4x the features of the widest expert),
        and `centre_tokens` per step of the centring chains: the full presets' fit stays a few passes.
        """
        steps, horizon = self.denoise_steps, self.chunk_len
        generator = torch.Generator().manual_seed(0)
        with self.precision():
            cond, _ = self.encode(self.neutral_obs())
            n = min(probe, max(1, fit_tokens // (horizon * steps))) * steps
            cond = expand_rows(cond, n)  # views: a full-size prefix is not copied n times
            device = self.velocity_out.weight.device
            x = torch.randn(n, horizon, self.flow_dim, generator=generator).to(device)
            h, _ = self.features(x, self.times(steps, device).repeat(n // steps), cond)
        h = torch.cat([h.flatten(0, 1), h.new_ones(n * horizon, 1)], 1).float()
        target = min(gain, steps) * x.flatten(0, 1)[:, : self.model_action_dim].float()
        ridge = 1e-3 * h.shape[0] * torch.eye(h.shape[1], device=device)
        solution = torch.linalg.solve(h.T @ h + ridge, h.T @ target)  # (feature_dim + 1, action_dim)
        out = self.velocity_out
        out.weight.zero_()
        out.bias.zero_()
        out.weight[: self.model_action_dim] = solution[:-1].T.to(out.weight.dtype)
        out.bias[: self.model_action_dim] = solution[-1].to(out.bias.dtype)
        rows = min(n, 64, max(1, centre_tokens // horizon))  # 64 chains x H actions: the mean to ~0.01
        with self.precision():
            self.centre_actions(map_tensors(cond, lambda t: t[:rows]), rows, min(gain, steps), generator)

    @torch.no_grad()
    def centre_actions(self, cond: Any, rows: int, gain: float, generator: torch.Generator, rounds: int = 3) -> None:
        """Shift `velocity_out`'s bias until the chain's mean action over `cond`'s `rows` is 0 in every env dim.

        The tiny features cannot carry x exactly (the fit leaves ~40% of v's scale), and what is left adds up over
        the chain into a mean action that the seed decides: on Lift, tiny pi0 drifted the gripper's z by -0.28 to
        +0.36 (in units of the action bound) for seeds 0-4, and only seed 0, going down towards the cube, learned in
        24 iterations. For v ~= c x + b the chain's mean moves by -b/K * sum_j (1 - c/K)^j; the features are not
        linear, so after the first step the response is measured (the same chains and noise every round, so the
        change is the bias's alone) and the correction repeated.
        """
        steps, dims = self.denoise_steps, self.model_action_dim
        times = self.times(steps, self.velocity_out.weight.device)
        start = torch.randn(rows, self.chunk_len, self.flow_dim, generator=generator).to(times.device)
        noise = [torch.randn(start.shape, generator=generator).to(start) for _ in range(steps)]

        def drift() -> torch.Tensor:
            x = start
            for k in range(steps):
                mean, log_std = self.step(x, times[k].expand(rows), cond)
                x = self.advance(start, k, mean, log_std, noise[k])
            return x[..., :dims].float().mean((0, 1))

        bias = self.velocity_out.bias
        response = sum((1.0 - gain / steps) ** j for j in range(steps)) / steps
        now = drift()
        for _ in range(rounds):
            shift = now / response
            bias[:dims] += shift.to(bias.dtype)
            before, now = now, drift()
            measured = float(((before - now) * shift).sum() / shift.pow(2).sum().clamp_min(1e-12))
            if measured > 0:
                response = measured
