"""GRPO (group-relative policy optimisation) for ``PixelGaussianPolicy`` on any vector env with group resets.

Readable top to bottom, CleanRL-style: the hyper-parameters are ``GRPOConfig``; one iteration is

1. **Rollouts.** ``num_envs / group_size`` start states are drawn (``initial_state_index``, each repeated for the
   ``group_size`` slots of its group) and every slot acts for at most ``horizon`` chunks, sampling from the Gaussian
   policy. A slot's episode ends at ``terminated`` (success) or ``truncated``; what the env returns for it afterwards
   (an autoreset, or a group slot *waiting* for its group) is masked out. The env is any Gymnasium vector env that
   takes ``reset(options={"initial_state_index": [...]})``: a world-model vector env or a real simulator behind the
   same interface
   (the bundled task's ``sim_vector_env``), so the trainer runs unchanged in both worlds.
2. **Returns and advantages.** An episode's return is ``1[success] + coverage_weight * final score`` (sparse success,
   with a small dense term that separates failures: the score is ``info["coverage"]``, or the reward model's
   ``info["score"]``). Its advantage is the return minus its group's mean (no value network), divided by the group's
   std (GRPO), the batch's std or nothing (``advantage_normalization``, see ``group_advantages``); every chunk of the
   episode gets it. Groups whose returns are all equal teach nothing and get advantage 0.
3. **Update.** ``update_epochs`` passes of minibatches over the chunks of the rollouts: PPO's clipped ratio
   objective on the chunk's log-probability, minus ``entropy_coef`` x entropy, plus ``kl_coef`` x the k3 estimate of
   the KL to the reference policy (the behaviour-cloned start; keeps the policy near states the world model knows).
4. **Guard** (every ``guard_every`` iterations, when a ``guard`` is given): the action chunks of this iteration's
   episodes are replayed from the same starts in the real simulator (``guard(start_indices, action_chunks,
   lengths) -> {"success": [N], "final_coverage": [N]}``); imagined success is logged next to replayed-real success,
   and the imagined final score next to the real final coverage (Pearson, MAE), so reward hacking in the world model
   shows in the curves. The replay runs in a background thread while the next iterations run (``guard_in_background``)
   and its numbers join its own iteration's record; ``train`` returns only with every replay in, and a failed replay
   raises in the training loop.

``save(path)`` writes a safetensors checkpoint (policy, Adam state, the RNG states, iteration, history);
``GRPOTrainer.load(path, env)`` continues exactly where it stopped: the same starts, seeds and noise follow.

**Data-parallel replicas** (torchrun, or any initialised ``torch.distributed`` group): each rank owns an env of its
own (e.g. one world-model engine per GPU) and its own groups, so a group never spans ranks and its advantages are
computed where it was played; ranks draw their own starts, seeds and noise (rank 0 as a single process would). The
policy starts from rank 0's weights; each minibatch step sums every rank's per-chunk losses over the whole
minibatch's chunks (all ranks' ``minibatch_size`` slices together) and all-reduces the gradients, so the ranks take
the same step as one process with all their chunks in one minibatch would, and their weights stay identical. The
logged rates are over all ranks' episodes (the guard's over rank 0's); rank 0 writes the checkpoint, with every
rank's RNG state.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import CheckpointError, InputError
from ..storage import load_safetensors, save_safetensors
from .policy import PixelGaussianPolicy, PolicyConfig

__all__ = ["ADVANTAGE_NORMALIZATIONS", "GRPOConfig", "GRPOTrainer", "group_advantages"]

ADVANTAGE_NORMALIZATIONS = ("group", "batch", "none")

CHECKPOINT_FORMAT = "cosmos3_gym.grpo_checkpoint"
Guard = Callable[[np.ndarray, np.ndarray, np.ndarray], dict[str, np.ndarray]]  # (starts, chunks, lengths) -> replay


@dataclass
class GRPOConfig:
    iterations: int = 20
    group_size: int = 8  # slots sharing a start; num_envs must be a multiple
    horizon: int = 8  # chunks per rollout at most (the env may truncate earlier)
    learning_rate: float = 3e-4
    update_epochs: int = 4
    minibatch_size: int = 256  # chunks per gradient step
    clip_coef: float = 0.2
    kl_coef: float = 0.05  # KL to the reference (behaviour-cloned) policy; 0 turns it off
    entropy_coef: float = 0.0
    coverage_weight: float = 0.1  # return = 1[success] + coverage_weight * final score
    # "group", "batch" or "none" (see group_advantages). On the bundled task's simulator (horizon 4, 80 iterations)
    # "group" and
    # "batch" gained alike over BC (+13 and +9.5 / +11 points; RESULTS.md, issue 17): GRPO's own default stays.
    advantage_normalization: str = "group"
    max_grad_norm: float = 1.0
    min_log_std: float = -4.0  # the Gaussian's log std is clamped here (no collapse, no blow-up)
    max_log_std: float = -1.0
    guard_every: int = 1  # iterations between guard replays (0: never)
    # The replay runs in a thread beside the next iteration; its numbers join its iteration's record when done (at the
    # latest when ``train`` returns). Off: in line, before the update.
    guard_in_background: bool = True
    seed: int = 0


# exp() of a log-probability ratio overflows float32 past ~88. With a narrow Gaussian over 16 action dimensions (log
# std -3.5 or below) a policy that moved a few of its stds from the sampling or reference policy reaches that, and one
# inf made every weight NaN. Clamped at 20, those samples' ratios stop passing gradient (the clipped objective ignores
# them too when the advantage agrees) and the k3 KL stays finite while still pulling back hard.
MAX_LOG_RATIO = 20.0

# How each rollout statistic combines over data-parallel ranks (the rest stay the rank's own: the guard's, rank 0's).
_SUMMED_STATS = ("chunks", "env_steps")
_AVERAGED_STATS = ("success_rate", "mean_return", "mean_final_score", "mean_length", "informative_groups")
_SLOWEST_STATS = ("rollout_s", "env_s")


def group_advantages(returns: np.ndarray, group_size: int, normalization: str = "group") -> np.ndarray:
    """Each slot's return minus its group's mean, divided by

    * ``"group"``: the group's std (GRPO; 0 for groups whose returns are all equal). A group whose episodes all fail
      but differ a little in coverage gets advantages of +-1, as large as one that tells success from failure;
    * ``"batch"``: the std over the whole batch of these differences (REINFORCE++-style): groups keep their relative
      weight (success against failure counts ``1 / coverage_weight`` times a coverage difference);
    * ``"none"``: nothing (Dr. GRPO, Liu et al. 2025, which argues the std division biases the update).

    On the bundled task the first two gained alike (RESULTS.md, issue 17).
    """
    if normalization not in ADVANTAGE_NORMALIZATIONS:
        raise InputError(f"advantage_normalization: expected one of {ADVANTAGE_NORMALIZATIONS}, got {normalization!r}")
    grouped = np.asarray(returns, np.float64).reshape(-1, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if normalization == "group":
        std = grouped.std(axis=1, keepdims=True)
        centred = np.where(std > 1e-8, centred / np.maximum(std, 1e-8), 0.0)
    elif normalization == "batch":
        std = centred.std()
        centred = centred / std if std > 1e-8 else np.zeros_like(centred)
    return centred.reshape(-1)


@dataclass
class Rollout:
    images: torch.Tensor  # uint8 [C, H, W, 3] on the CPU: the observation of every live chunk
    actions: torch.Tensor  # [C, chunk * D]: the sampled (unclipped) Gaussian actions
    log_probs: torch.Tensor  # [C]
    reference_log_probs: torch.Tensor | None  # [C]
    advantages: torch.Tensor  # [C]
    stats: dict[str, Any]
    guard: Future | None = None  # the guard's numbers, replaying in the background (GRPOConfig.guard_in_background)


class GRPOTrainer:
    """GRPO on ``env`` (a vector env of ``num_envs`` slots); see the module docstring.

    ``reference``: the policy the KL term pulls towards (default: a frozen copy of ``policy`` as given: the BC
    start). ``num_starts``: how many start states ``initial_state_index`` can pick (default
    ``len(env.initial_states)``). ``guard``: replays action chunks in the real simulator (module docstring).
    """

    def __init__(
        self,
        policy: PixelGaussianPolicy,
        env: Any,
        config: GRPOConfig | None = None,
        *,
        reference: PixelGaussianPolicy | None = None,
        num_starts: int | None = None,
        guard: Guard | None = None,
    ):
        self.config = config or GRPOConfig()
        self.policy = policy
        self.env = env
        self.num_envs = int(env.num_envs)
        if self.num_envs % self.config.group_size:
            raise InputError(
                f"group_size: num_envs ({self.num_envs}) must be a multiple of group_size ({self.config.group_size})."
            )
        if self.config.advantage_normalization not in ADVANTAGE_NORMALIZATIONS:
            raise InputError(
                f"advantage_normalization: expected one of {ADVANTAGE_NORMALIZATIONS}, got "
                f"{self.config.advantage_normalization!r}"
            )
        if num_starts is None:
            starts = getattr(env, "initial_states", None)
            if starts is None:
                raise InputError("num_starts: the env exposes no initial_states; pass num_starts=.")
            num_starts = len(starts)
        self.num_starts = int(num_starts)
        if reference is None and self.config.kl_coef > 0:
            reference = PixelGaussianPolicy(policy.config).to(policy.device)
            reference.load_state_dict(policy.state_dict())
        self.reference = reference.eval() if reference is not None else None
        if self.reference is not None:
            self.reference.requires_grad_(False)
        self.guard = guard
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world_size > 1 else 0
        if self.world_size > 1:  # every rank starts from rank 0's weights (module docstring: data-parallel replicas)
            for module in (policy, self.reference):
                for tensor in module.state_dict().values() if module is not None else ():
                    dist.broadcast(tensor, 0)
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=self.config.learning_rate, eps=1e-5)
        seed = self.config.seed
        # starts and env seeds; action noise and minibatches: per rank, rank 0's those of a single process
        self.rng = np.random.default_rng(seed if self.rank == 0 else [seed, self.rank])
        self.generator = torch.Generator().manual_seed(seed + (self.rank << 32))
        self.iteration = 0
        self.history: list[dict[str, Any]] = []
        self._guard_thread: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ 1-2: rollouts, returns, advantages

    @torch.no_grad()
    def collect(self) -> Rollout:
        config, policy, n = self.config, self.policy, self.num_envs
        started = time.perf_counter()
        groups = n // config.group_size
        start_indices = np.repeat(self.rng.integers(self.num_starts, size=groups), config.group_size)
        observations, _ = self.env.reset(
            seed=int(self.rng.integers(2**31 - n)), options={"initial_state_index": start_indices}
        )
        alive = np.ones(n, bool)
        success = np.zeros(n, bool)
        final_score = np.zeros(n)
        lengths = np.zeros(n, np.int64)
        chunk_shape = policy.action_shape
        taken = np.zeros((n, config.horizon, *chunk_shape), np.float32)
        images, actions, log_probs, reference_log_probs, owners = [], [], [], [], []
        env_seconds = 0.0
        for t in range(config.horizon):
            live = np.flatnonzero(alive)
            pixels = policy.preprocess(observations["image"])
            distribution = policy.distribution(pixels)
            noise = torch.randn(distribution.mean.shape, generator=self.generator).to(pixels.device)
            sample = distribution.mean + distribution.stddev * noise
            log_prob = distribution.log_prob(sample).sum(-1)
            images.append(torch.from_numpy(np.asarray(observations["image"])[live]))
            actions.append(sample[live].cpu())
            log_probs.append(log_prob[live].cpu())
            if self.reference is not None:
                reference_log_probs.append(self.reference.distribution(pixels).log_prob(sample).sum(-1)[live].cpu())
            owners.append(live)
            chunks = sample.clamp(-1.0, 1.0).view(n, *chunk_shape).cpu().numpy()
            taken[live, t] = chunks[live]
            env_started = time.perf_counter()
            observations, _, terminated, truncated, info = self.env.step(chunks)
            env_seconds += time.perf_counter() - env_started
            score = np.asarray(info["coverage"] if "coverage" in info else info.get("score", np.zeros(n)), float)
            final_score[live] = score[live]
            success[live] |= np.asarray(terminated)[live]
            lengths[live] += 1
            alive &= ~(np.asarray(terminated) | np.asarray(truncated))
            if not alive.any():
                break

        returns = success.astype(np.float64) + config.coverage_weight * final_score
        advantages = group_advantages(returns, config.group_size, config.advantage_normalization)
        owner = np.concatenate(owners)
        stats = {
            "success_rate": float(success.mean()),
            "mean_return": float(returns.mean()),
            "mean_final_score": float(final_score.mean()),
            "mean_length": float(lengths.mean()),
            "informative_groups": float((returns.reshape(groups, -1).std(axis=1) > 1e-8).mean()),
            "chunks": int(len(owner)),
            "env_steps": int(lengths.sum()),
            "rollout_s": time.perf_counter() - started,
            "env_s": env_seconds,
        }
        stats = self._combine_over_ranks(stats)
        guard = None
        if self.guard is not None and config.guard_every and self.iteration % config.guard_every == 0:
            replay = partial(self._replay_in_guard, start_indices, taken, lengths, success, final_score)
            if config.guard_in_background:
                guard = self._guard_executor().submit(replay)
            else:
                stats.update(replay())
        return Rollout(
            images=torch.cat(images),
            actions=torch.cat(actions),
            log_probs=torch.cat(log_probs),
            reference_log_probs=torch.cat(reference_log_probs) if reference_log_probs else None,
            advantages=torch.from_numpy(advantages[owner]).float(),
            stats=stats,
            guard=guard,
        )

    def _replay_in_guard(
        self,
        start_indices: np.ndarray,
        taken: np.ndarray,
        lengths: np.ndarray,
        success: np.ndarray,
        final_score: np.ndarray,
    ) -> dict[str, Any]:
        """Step 4: the episodes replayed in the real simulator, against what the env imagined."""
        assert self.guard is not None  # scheduled only with a guard
        started = time.perf_counter()
        replayed = self.guard(start_indices, taken, lengths)
        real = np.asarray(replayed["success"], bool)
        real_coverage = np.asarray(replayed["final_coverage"], float)
        imagined = int(success.sum())
        spread = final_score.std() * real_coverage.std()
        return {
            "guard": True,
            "imagined_success_rate": float(success.mean()),
            "replayed_success_rate": float(real.mean()),
            "false_success_rate": float((success & ~real).sum() / imagined) if imagined else math.nan,
            "imagined_successes": imagined,
            "false_successes": int((success & ~real).sum()),
            "episodes": int(len(success)),
            "success_agreement": float((success == real).mean()),
            "imagined_final_score": float(final_score.mean()),
            "replayed_final_coverage": float(real_coverage.mean()),
            "score_coverage_pearson": float(
                np.mean((final_score - final_score.mean()) * (real_coverage - real_coverage.mean())) / spread
            )
            if spread > 0
            else math.nan,
            "score_coverage_mae": float(np.abs(final_score - real_coverage).mean()),
            "guard_s": time.perf_counter() - started,
        }

    def _guard_executor(self) -> ThreadPoolExecutor:
        # One thread: the replay mostly waits on the simulator's worker processes, so it runs beside the next
        # iteration's rollout on the GPU instead of in front of it (issue 44: the guard was 5-7 % of the loop).
        if self._guard_thread is None:
            self._guard_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-guard")
        return self._guard_thread

    # ------------------------------------------------------------------ 3: the clipped-ratio update

    def update(self, rollout: Rollout) -> dict[str, float]:
        config, policy = self.config, self.policy
        device = policy.device
        started = time.perf_counter()
        policy.train()
        count = len(rollout.actions)
        totals = {"policy_loss": 0.0, "kl_to_reference": 0.0, "entropy": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0}
        batches = 0
        size = config.minibatch_size
        # Every rank takes the same number of steps (a rank whose episodes ended early has fewer chunks).
        steps_per_epoch = int(self._reduce([math.ceil(count / size)], dist.ReduceOp.MAX)[0])
        for _ in range(config.update_epochs):
            order = torch.randperm(count, generator=self.generator)
            for step in range(steps_per_epoch):
                index = order[step * size : (step + 1) * size]
                minibatch = self._reduce([len(index)])[0]  # the chunks of this step on all ranks
                self.optimizer.zero_grad(set_to_none=True)
                if not len(index):  # nothing left here this step: it adds no gradient but takes the common step
                    self._check_finite(True)
                    self._all_reduce_gradients()
                    self._step_optimizer()
                    continue
                pixels = policy.preprocess(rollout.images[index])
                distribution = policy.distribution(pixels)
                actions = rollout.actions[index].to(device)
                log_prob = distribution.log_prob(actions).sum(-1)
                log_ratio = log_prob - rollout.log_probs[index].to(device)
                ratio = log_ratio.clamp(max=MAX_LOG_RATIO).exp()
                advantages = rollout.advantages[index].to(device)
                per_chunk_policy = torch.max(
                    -advantages * ratio, -advantages * ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)
                )
                per_chunk_entropy = distribution.entropy().sum(-1)
                per_chunk = per_chunk_policy - config.entropy_coef * per_chunk_entropy
                per_chunk_kl = torch.zeros_like(per_chunk)
                if rollout.reference_log_probs is not None and config.kl_coef > 0:
                    # k3 estimator of KL(policy || reference) on the sampled actions (Schulman 2020), as in GRPO.
                    log_ref_ratio = (rollout.reference_log_probs[index].to(device) - log_prob).clamp(max=MAX_LOG_RATIO)
                    per_chunk_kl = log_ref_ratio.exp() - log_ref_ratio - 1
                    per_chunk = per_chunk + config.kl_coef * per_chunk_kl
                # The mean over the whole minibatch (all ranks' chunks): the all-reduced gradients are its gradient.
                loss = per_chunk.sum() / minibatch
                policy_loss, entropy, kl = per_chunk_policy.mean(), per_chunk_entropy.mean(), per_chunk_kl.mean()
                finite = bool(torch.isfinite(loss))
                self._check_finite(finite, "" if finite else f" (policy loss {float(policy_loss)}, KL {float(kl)})")
                loss.backward()
                self._all_reduce_gradients()
                self._step_optimizer()
                with torch.no_grad():
                    totals["policy_loss"] += float(policy_loss)
                    totals["kl_to_reference"] += float(kl)
                    totals["entropy"] += float(entropy)
                    totals["clip_fraction"] += float(((ratio - 1).abs() > config.clip_coef).float().mean())
                    totals["approx_kl"] += float(((ratio - 1) - log_ratio).mean())
                batches += 1
        policy.eval()
        stats = {key: value / max(batches, 1) for key, value in totals.items()}
        stats["log_std"] = float(policy.log_std.detach().mean())
        stats["update_s"] = time.perf_counter() - started
        return stats

    def _step_optimizer(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        with torch.no_grad():
            self.policy.log_std.clamp_(self.config.min_log_std, self.config.max_log_std)

    def _check_finite(self, finite: bool, detail: str = "") -> None:
        """``FloatingPointError`` on every rank when any rank's loss is not finite (no rank is left waiting in the
        gradient all-reduce), before anything changes the weights."""
        if self._reduce([0.0 if finite else 1.0])[0] == 0:
            return
        raise FloatingPointError(
            f"GRPO: the loss is not finite at iteration {self.iteration}{detail}; the policy's weights are left as "
            f"they were after the last finite step. Check the env's rewards, lower learning_rate or raise min_log_std."
        )

    def _all_reduce_gradients(self) -> None:
        """Sum every parameter's gradient over the ranks (a rank without a gradient adds zeros)."""
        if self.world_size == 1:
            return
        grads = []
        for p in self.policy.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
        dist.all_reduce(flat)
        for g, value in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(value.view_as(g))

    def _reduce(self, values: list[float], op: Any = None) -> list[float]:
        """``values`` reduced over the ranks (sum by default); as given in a single process."""
        if self.world_size == 1:
            return [float(v) for v in values]
        tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
        dist.all_reduce(tensor, op=op if op is not None else dist.ReduceOp.SUM)
        return tensor.tolist()

    def _combine_over_ranks(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The rollout's statistics over all ranks: counts summed, rates averaged (every rank has ``num_envs``
        slots), times of the slowest rank."""
        if self.world_size == 1:
            return stats
        summed = self._reduce([stats[k] for k in _SUMMED_STATS])
        averaged = self._reduce([stats[k] for k in _AVERAGED_STATS])
        slowest = self._reduce([stats[k] for k in _SLOWEST_STATS], dist.ReduceOp.MAX)
        out = dict(stats)
        out.update({k: int(v) for k, v in zip(_SUMMED_STATS, summed)})
        out.update({k: v / self.world_size for k, v in zip(_AVERAGED_STATS, averaged)})
        out.update(dict(zip(_SLOWEST_STATS, slowest)))
        return out

    # ------------------------------------------------------------------ the loop

    def train(
        self,
        iterations: int | None = None,
        *,
        checkpoint_path: str | os.PathLike | None = None,
        checkpoint_every: int = 1,
        progress: bool = True,
        max_seconds: float | None = None,
        on_iteration: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Run until ``iterations`` (default ``config.iterations``) iterations are done in total (a resumed trainer
        continues its count); checkpoint to ``checkpoint_path`` every ``checkpoint_every`` iterations.

        ``max_seconds``: stop early, after the last iteration that is expected to finish within this budget (the
        slowest iteration so far is the estimate; at least one runs), so a run inside a time-limited job ends with
        its checkpoint written and the caller's own saving done; ``train`` again (or ``load``) continues it. Data-
        parallel ranks stop at the same iteration: when one of them would run out of time."""
        from tqdm.auto import tqdm

        total = self.config.iterations if iterations is None else int(iterations)
        if max_seconds is not None and not max_seconds > 0:
            raise InputError(f"max_seconds: expected a positive number of seconds or None, got {max_seconds!r}.")
        started, slowest = time.perf_counter(), 0.0
        bar = tqdm(total=total, initial=self.iteration, desc="GRPO", disable=not progress)
        guards: list[tuple[dict[str, Any], Future]] = []  # records whose guard replay runs in the background
        try:
            while self.iteration < total:
                elapsed = time.perf_counter() - started
                over = max_seconds is not None and slowest and elapsed + slowest > max_seconds
                if self._reduce([float(bool(over))], dist.ReduceOp.MAX)[0]:  # all ranks stop together
                    break
                rollout = self.collect()
                record = {"iteration": self.iteration, **rollout.stats, **self.update(rollout)}
                record["env_steps_total"] = record["env_steps"] + (
                    self.history[-1]["env_steps_total"] if self.history else 0
                )
                self.history.append(record)
                if rollout.guard is not None:
                    guards.append((record, rollout.guard))
                guards = _join_guards(guards, wait=False)
                self.iteration += 1
                if checkpoint_path is not None and (self.iteration % checkpoint_every == 0 or self.iteration == total):
                    self.save(checkpoint_path)
                bar.set_postfix(
                    success=f"{record['success_rate']:.2f}",
                    ret=f"{record['mean_return']:.2f}",
                    kl=f"{record['kl_to_reference']:.3f}",
                )
                bar.update()
                if on_iteration is not None:
                    on_iteration(record)
                slowest = max(slowest, time.perf_counter() - started - elapsed)
            # The last replays, into the history and its checkpoint; every rank saves together (save is collective)
            # when any has one pending (a guard may run on rank 0 alone).
            pending_anywhere = self._reduce([float(bool(guards))], dist.ReduceOp.MAX)[0]
            guards = _join_guards(guards, wait=True)
            if pending_anywhere and checkpoint_path is not None:
                self.save(checkpoint_path)
        finally:
            bar.close()
            wait_for([future for _, future in guards])  # no replay outlives the loop (the caller closes its env)
            if self._guard_thread is not None:
                self._guard_thread.shutdown()
                self._guard_thread = None
        return self.history

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike) -> Path:
        """Everything ``load`` needs to continue exactly: policy, Adam state, RNG states, iteration, history. Under
        data parallelism every rank calls it; rank 0 writes the file, with every rank's RNG states."""
        rank_states = [(self.generator.get_state().tolist(), self.rng.bit_generator.state)]
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, rank_states[0])
            rank_states = gathered
            if self.rank != 0:
                dist.barrier()  # the file exists once save returns on any rank
                return Path(path)
        tensors = {f"policy.{name}": t.detach().cpu().contiguous() for name, t in self.policy.state_dict().items()}
        optimizer = self.optimizer.state_dict()
        for index, state in optimizer["state"].items():
            for key, value in state.items():
                tensors[f"optimizer.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
        tensors["rng.torch"] = self.generator.get_state()
        metadata = {
            "format": CHECKPOINT_FORMAT,
            "kind": "grpo_checkpoint",
            "iteration": self.iteration,
            "config": asdict(self.config),
            "policy_config": asdict(self.policy.config),
            "optimizer_param_groups": optimizer["param_groups"],
            "rng_numpy": self.rng.bit_generator.state,
            "history": self.history,
            "num_starts": self.num_starts,
            "world_size": self.world_size,
            "rank_states": rank_states[1:],  # ranks 1..: (torch generator state, numpy state)
        }
        # Crash-safe: a temporary file, fsynced and renamed over ``path`` (a crash mid-write leaves the previous
        # checkpoint intact), with the tensors' sha256, verified by ``load`` (cosmos3_gym.storage).
        written = save_safetensors(
            path, tensors, {key: json.dumps(value, default=_json_number) for key, value in metadata.items()}
        )
        if self.world_size > 1:
            dist.barrier()
        return written

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        env: Any,
        *,
        device: torch.device | str = "cpu",
        reference: PixelGaussianPolicy | None = None,
        guard: Guard | None = None,
    ) -> GRPOTrainer:
        """A trainer continuing the checkpoint at ``path`` on ``env``. ``reference``: the KL reference (default:
        the one the checkpoint's run started from is not stored, so pass the BC policy when ``kl_coef`` > 0)."""
        tensors, raw = load_safetensors(path, what="grpo checkpoint")  # a damaged file: CheckpointError naming it
        try:
            metadata = {key: json.loads(value) for key, value in raw.items()}
        except json.JSONDecodeError as error:
            raise CheckpointError(f"grpo checkpoint: {path} has metadata that is not JSON ({error}).") from error
        if metadata.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"grpo checkpoint: {path} is not a GRPO checkpoint (format {metadata.get('format')!r})."
            )
        policy = PixelGaussianPolicy(PolicyConfig(**metadata["policy_config"]))
        policy.load_state_dict({name[len("policy.") :]: t for name, t in tensors.items() if name.startswith("policy.")})
        policy.to(device)
        if reference is None and metadata["config"]["kl_coef"] > 0:
            raise InputError("reference: the checkpoint trains with a KL term; pass the reference (BC) policy.")
        trainer = cls(
            policy,
            env,
            GRPOConfig(**metadata["config"]),
            reference=reference,
            num_starts=metadata["num_starts"],
            guard=guard,
        )
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if name.startswith("optimizer."):
                _, index, key = name.split(".", 2)
                state.setdefault(int(index), {})[key] = tensor.to(device) if key != "step" else tensor
        trainer.optimizer.load_state_dict({"state": state, "param_groups": metadata["optimizer_param_groups"]})
        saved_world = int(metadata.get("world_size", 1))
        if saved_world != trainer.world_size:
            raise InputError(
                f"grpo checkpoint: {path} was written by {saved_world} data-parallel rank(s); continue it with as many "
                f"(this run has {trainer.world_size})."
            )
        if trainer.rank == 0:
            trainer.generator.set_state(tensors["rng.torch"])
            trainer.rng.bit_generator.state = metadata["rng_numpy"]
        else:
            generator_state, numpy_state = metadata["rank_states"][trainer.rank - 1]
            trainer.generator.set_state(torch.tensor(generator_state, dtype=torch.uint8))
            trainer.rng.bit_generator.state = numpy_state
        trainer.iteration = int(metadata["iteration"])
        trainer.history = metadata["history"]
        return trainer


def _join_guards(guards: list[tuple[dict[str, Any], Future]], wait: bool) -> list[tuple[dict[str, Any], Future]]:
    """Merges the finished (``wait``: all) background guard replays into their records; the rest stay pending. A
    replay that failed raises here, in the training loop."""
    pending = []
    for record, future in guards:
        if wait or future.done():
            record.update(future.result())
        else:
            pending.append((record, future))
    return pending


def _collective_device() -> torch.device:
    """Where small collective tensors go: the rank's GPU under NCCL, else the host."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _json_number(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")
