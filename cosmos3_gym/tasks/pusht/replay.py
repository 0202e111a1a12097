"""Checking policies and imagined episodes in the real simulator: evaluation and open-loop replay on
``PushTSimVectorEnv`` (gym-pusht).

``evaluate_in_simulator``: a policy (``act(observations, deterministic) -> [N, chunk, 2]``, e.g.
``PixelGaussianPolicy``) closed loop from given starts for ``num_chunks`` chunks; per episode: success (coverage
above 0.95 at some step, where gym-pusht ends it), final and best coverage.

``replay_in_simulator``: the world-model guard. Action chunks ``[N, T, chunk, 2]`` an agent took in imagination are
stepped, open loop, from the same starts (``DemoStartStates`` indices: the world model's start frames are renders
of these simulator states) for each episode's imagined length; returns whether each really succeeded.

``policy_rollout_starts``: the simulator states a policy itself visits, as ``DemoStartStates`` (RL rollouts that
start where the policy goes and fails).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InputError
from .sim_vector_env import PushTSimVectorEnv
from .starts import DemoStartStates

__all__ = ["evaluate_in_simulator", "policy_rollout_starts", "replay_in_simulator", "taken_mask"]


def _check_env(env: Any, count: int) -> None:
    if not isinstance(env, PushTSimVectorEnv) or env.group_size != 1 or env.num_envs != count:
        raise InputError(
            f"env: expected a PushTSimVectorEnv with group_size 1 and num_envs {count}, got "
            f"{type(env).__name__} ({getattr(env, 'num_envs', '?')} slots, group_size "
            f"{getattr(env, 'group_size', '?')})."
        )


def replay_in_simulator(
    env: PushTSimVectorEnv, start_indices: np.ndarray, action_chunks: np.ndarray, lengths: np.ndarray
) -> dict[str, np.ndarray]:
    """Episode ``i`` (start ``start_indices[i]``, chunks ``action_chunks[i, :lengths[i]]``) in gym-pusht:
    ``{"success": bool [N], "final_coverage": [N]}`` (coverage after its last replayed step)."""
    start_indices = np.asarray(start_indices, np.int64)
    action_chunks = np.asarray(action_chunks, np.float32)
    lengths = np.asarray(lengths, np.int64)
    _check_env(env, len(start_indices))
    success = np.zeros(len(start_indices), bool)
    done = lengths <= 0
    final = np.asarray(env.reset(seed=0, options={"initial_state_index": start_indices})[1]["coverage"], float)
    for t in range(int(lengths.max(initial=0))):
        _, _, terminated, truncated, info = env.step(action_chunks[:, t])
        running = ~done
        success |= running & terminated
        final[running] = np.asarray(info["coverage"])[running]
        done |= terminated | truncated | (t + 1 >= lengths)
    return {"success": success, "final_coverage": final}


def evaluate_in_simulator(
    policy: Any, env: PushTSimVectorEnv, start_indices: np.ndarray, num_chunks: int, deterministic: bool = True
) -> dict[str, np.ndarray]:
    """Per episode (one per start): ``success`` bool, ``final_coverage`` (after its last step: at success, or
    after ``num_chunks`` chunks), ``max_coverage``, ``chunks`` (taken)."""
    start_indices = np.asarray(start_indices, np.int64)
    count = len(start_indices)
    _check_env(env, count)
    observations, info = env.reset(seed=0, options={"initial_state_index": start_indices})
    success = np.zeros(count, bool)
    done = np.zeros(count, bool)
    final = np.asarray(info["coverage"], float).copy()
    best = final.copy()
    chunks = np.zeros(count, np.int64)
    for _ in range(num_chunks):
        actions = np.asarray(policy.act(observations, deterministic=deterministic), np.float32)
        observations, _, terminated, truncated, info = env.step(np.clip(actions, -1.0, 1.0))
        running = ~done
        final[running] = np.asarray(info["coverage"])[running]
        best[running] = np.maximum(best[running], np.asarray(info["max_coverage"])[running])
        success |= running & terminated
        chunks[running] += 1
        done |= terminated | truncated
        if done.all():
            break
    return {"success": success, "final_coverage": final, "max_coverage": best, "chunks": chunks}


def taken_mask(recorded_chunks: int, chunks: np.ndarray) -> np.ndarray:
    """bool ``[recorded_chunks, N]``: which of the per-chunk records of all ``N`` slots (a wrapping policy records
    every slot at every ``act``) belong to a chunk the slot's episode took; finished slots wait and are still asked
    for actions. ``chunks``: ``evaluate_in_simulator``'s per-episode count."""
    return np.arange(recorded_chunks)[:, None] < np.asarray(chunks)[None, :]


def policy_rollout_starts(
    policy: Any,
    env: PushTSimVectorEnv,
    start_indices: np.ndarray,
    num_chunks: int,
    image_size: tuple[int, int] = (256, 256),
) -> DemoStartStates:
    """The states a policy itself visits: one episode per slot of ``env`` (``len(start_indices)`` slots, group size
    1) from those of its starts, ``policy.act`` (its mean action) for up to ``num_chunks`` chunks, and the simulator
    state before every chunk an episode took (its reset included; none after it ends). ``episodes`` holds each
    state's start index, ``steps`` its simulator step. Rollouts that start here see the states the policy reaches,
    mid-task and off the demonstrations' path, where it fails."""
    recorder = _StateRecorder(policy, env)
    start_indices = np.asarray(start_indices, np.int64)
    episodes = evaluate_in_simulator(recorder, env, start_indices, num_chunks)
    chunk_index, slot = np.nonzero(taken_mask(len(recorder.states), episodes["chunks"]))
    states = np.stack(recorder.states)[chunk_index, slot]
    return DemoStartStates(
        states,
        episodes=start_indices[slot],
        steps=chunk_index * int(env.chunk),
        image_size=image_size,
        description=f"{len(states)} states of {len(start_indices)} policy rollouts "
        f"(success {episodes['success'].mean():.2f})",
    )


class _StateRecorder:
    """``evaluate_in_simulator``'s policy for ``policy_rollout_starts``: records every slot's simulator state, then
    acts as ``policy`` does."""

    def __init__(self, policy: Any, env: PushTSimVectorEnv):
        self.policy, self.env = policy, env
        self.states: list[np.ndarray] = []

    def act(self, observations: dict[str, np.ndarray], deterministic: bool = True) -> np.ndarray:
        self.states.append(self.env.sim_states())
        return self.policy.act(observations, deterministic=deterministic)
