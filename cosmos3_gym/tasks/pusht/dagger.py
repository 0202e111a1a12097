"""DAgger (Ross, Gordon and Bagnell 2011) for chunk policies: roll the policy, label every state it visits with an
expert's action chunk, aggregate, fine-tune, repeat.

Behaviour cloning sees only the states its demonstrations visit. A pixel policy that executes eight steps open loop
leaves them within a few chunks and has no label for the way back: the recipe's BC succeeds in 11-17 % of PushT
episodes where its scripted teacher succeeds in about 90 %. DAgger labels the states the policy itself reaches.

The env labels them: ``env.expert_action_chunks()`` returns the expert's next chunk for every slot from the slot's
true state (``PushTSimVectorEnv``: the noise-free scripted pusher planned in a private copy of gym-pusht's physics,
privileged information the policy never sees). Each round runs one episode per slot from the round's starts for up
to ``chunks`` chunks; at every chunk the observation and the expert's chunk are recorded, and the slot executes the
expert's chunk with probability ``expert_probability * 0.5 ** round`` (the classic mixture, decaying), else the
policy's mean action. The policy is then fitted (``train_bc``, from its current weights) to everything recorded so
far. Per round: the rollouts' success and final coverage (on the round's seeds, training data, not held out), the
samples and the fit's last loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...errors import InputError
from ...rl.bc import BCConfig, train_bc
from ...rl.policy import PixelGaussianPolicy

__all__ = ["DAggerConfig", "collect_labelled_rollouts", "train_dagger"]


@dataclass
class DAggerConfig:
    rounds: int = 4
    chunks: int = 38  # per episode, at most (it ends at success)
    expert_probability: float = 0.5  # in round r the expert's chunk is executed with this * 0.5 ** r
    bc: BCConfig = field(default_factory=lambda: BCConfig(steps=2000, learning_rate=3e-4))
    seed: int = 0

    def __post_init__(self):
        for name in ("rounds", "chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name}: expected an integer >= 1, got {value!r}.")
        if not 0.0 <= self.expert_probability <= 1.0:
            raise InputError(f"expert_probability: expected a number in [0, 1], got {self.expert_probability!r}.")


class _LabellingPolicy:
    """``evaluate_in_simulator``'s policy for one DAgger round: at every chunk it records the observations and the
    expert's chunks of all slots, and executes the expert's chunk in a random ``expert_probability`` share of them,
    the policy's mean action elsewhere."""

    def __init__(self, policy: PixelGaussianPolicy, env: Any, expert_probability: float, rng: np.random.Generator):
        self.policy, self.env, self.expert_probability, self.rng = policy, env, expert_probability, rng
        self.frames: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []

    def act(self, observations: dict[str, np.ndarray], deterministic: bool = True) -> np.ndarray:
        expert = self.env.expert_action_chunks()
        self.frames.append(np.array(observations["image"]))
        self.labels.append(expert)
        actions = np.asarray(self.policy.act(observations, deterministic=deterministic), np.float32)
        use_expert = self.rng.random(len(actions)) < self.expert_probability
        actions[use_expert] = expert[use_expert]
        return actions


def collect_labelled_rollouts(
    policy: PixelGaussianPolicy,
    env: Any,
    start_indices: np.ndarray,
    chunks: int,
    expert_probability: float,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """One episode per slot of ``env`` (a ``PushTSimVectorEnv``, ``num_envs == len(start_indices)``, group size 1)
    from those starts. Returns ``observations`` uint8 ``[M, h, w, 3]`` and ``labels`` ``[M, chunk, 2]`` (the
    expert's chunk at every step an episode took, time-major), and per episode ``success`` and ``final_coverage``."""
    from .replay import evaluate_in_simulator, taken_mask

    labeller = _LabellingPolicy(policy, env, expert_probability, rng)
    episodes = evaluate_in_simulator(labeller, env, start_indices, chunks)
    taken = taken_mask(len(labeller.frames), episodes["chunks"])
    return {
        "observations": np.stack(labeller.frames)[taken],
        "labels": np.stack(labeller.labels)[taken],
        "success": episodes["success"],
        "final_coverage": episodes["final_coverage"],
    }


def train_dagger(
    policy: PixelGaussianPolicy,
    env: Any,
    round_starts: Callable[[int], np.ndarray],
    config: DAggerConfig | None = None,
    progress: bool = True,
    on_round: Callable[[dict], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``config.rounds`` rounds on ``env`` (``round_starts(r)``: round ``r``'s start indices, one per slot) and
    fine-tune ``policy`` in place after each. Returns one record per round."""
    config = config or DAggerConfig()
    rng = np.random.default_rng(config.seed)
    frames: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    history = []
    for round_index in range(config.rounds):
        probability = config.expert_probability * 0.5**round_index
        rollouts = collect_labelled_rollouts(policy, env, round_starts(round_index), config.chunks, probability, rng)
        frames.append(rollouts["observations"])
        labels.append(rollouts["labels"])
        losses = train_bc(
            policy,
            np.concatenate(frames),
            np.concatenate(labels),
            replace(config.bc, seed=config.bc.seed + round_index),
            progress=progress,
        )
        record = {
            "round": round_index,
            "expert_probability": probability,
            "rollout_success_rate": float(rollouts["success"].mean()),
            "rollout_mean_final_coverage": float(rollouts["final_coverage"].mean()),
            "new_samples": int(len(rollouts["labels"])),
            "samples": int(sum(len(x) for x in labels)),
            "final_loss": losses[-1],
            "bc_steps": len(losses),
        }
        history.append(record)
        if on_round is not None:
            on_round(record)
    return history
