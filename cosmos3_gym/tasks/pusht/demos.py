"""Scripted-pusher demonstrations for behaviour cloning, in the observation and action spaces of the PushT envs.

``generate_demonstrations`` runs ``ScriptedPusher`` in gym-pusht from ``PushTSim.reset(seed)`` for seeds
``seed, seed + 1, ...`` until success (coverage above 0.95, where gym-pusht ends an episode) or ``max_steps``. Each
episode's pusher draws its target noise from ``noise_levels`` (noisy targets, executed and recorded as labels) and
its execution noise from ``execution_noise`` (DART, Laskey et al. 2017: the simulator executes the scripted target
plus Gaussian noise of that std in pixels, the label is the clean scripted target; the policy sees the states a
slightly wrong action leads to, labelled with the way back, which closed-loop cloned policies otherwise never
see). Per recorded step (every ``stride``-th):

* ``observations`` uint8 ``[M, s, s, 3]``: the frame rendered at ``image_size`` (the world model's) and downscaled
  to ``observation_size`` with the envs' ``resize_frame``, exactly as ``PushTSimVectorEnv`` and
  ``cosmos3_gym/PushT-v0`` make their observations;
* ``action_chunks`` float32 ``[M, chunk, 2]``: the next ``chunk`` (clean) actions normalised with ``action_stats`` and
  clipped to [-1, 1] (the last action repeated past the episode's end).

Plus each episode's ``sim_states`` (for ``DemoStartStates.from_episodes``: starts from any step), its seed, success
and final coverage. Episodes run in ``workers`` processes (one thread each).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from ...data.initial_states import resize_frame
from ...errors import InputError
from .geometry import SUCCESS_COVERAGE, TABLE_SIZE
from .policies import ScriptedPusher
from .sim import PushTSim, drawn, require_gym_pusht

__all__ = ["generate_demonstrations"]


def _demonstrate(job) -> dict[str, Any]:
    seed, noise, execution_noise, max_steps, stride, chunk, image_size, observation_size, stats = job
    sim = PushTSim(image_size)
    try:
        pusher = ScriptedPusher(np.random.default_rng([seed, 1]), noise=noise)
        perturbation = np.random.default_rng([seed, 2])
        frame = drawn(sim.reset(seed))
        frames, states = [resize_frame(frame, observation_size)], [sim.sim_state]
        actions: list[np.ndarray] = []
        success = sim.coverage > SUCCESS_COVERAGE
        while not success and len(actions) < max_steps:
            actions.append(pusher(sim.agent_xy, sim.block_pose))
            executed = actions[-1]
            if execution_noise:
                executed = np.clip(executed + perturbation.normal(0.0, execution_noise, 2), 0.0, TABLE_SIZE)
            frame = drawn(sim.step(executed))
            frames.append(resize_frame(frame, observation_size))
            states.append(sim.sim_state)
            success = sim.coverage > SUCCESS_COVERAGE
        coverage = sim.coverage
    finally:
        sim.close()
    if not actions:  # already solved at the start: nothing to imitate
        return {
            "seed": seed,
            "success": True,
            "final_coverage": coverage,
            "steps": 0,
            "execution_noise": execution_noise,
            "observations": np.zeros((0, *observation_size, 3), np.uint8),
            "action_chunks": np.zeros((0, chunk, 2), np.float32),
            "sim_states": np.stack(states),
        }
    normalised = np.clip(stats.normalize(np.asarray(actions, np.float32)), -1.0, 1.0).astype(np.float32)
    padded = np.concatenate([normalised, np.repeat(normalised[-1:], chunk - 1, axis=0)])
    recorded = np.arange(0, len(actions), stride)
    return {
        "seed": seed,
        "success": bool(success),
        "final_coverage": float(coverage),
        "steps": len(actions),
        "execution_noise": execution_noise,
        "observations": np.stack([frames[t] for t in recorded]),
        "action_chunks": np.stack([padded[t : t + chunk] for t in recorded]),
        "sim_states": np.stack(states),
    }


def generate_demonstrations(
    episodes: int,
    *,
    action_stats,
    seed: int = 0,
    max_steps: int = 300,
    stride: int = 1,
    chunk: int = 8,
    image_size: tuple[int, int] = (256, 256),
    observation_size: tuple[int, int] = (96, 96),
    noise_levels: Sequence[float] = (0.0, 0.0, 4.0),
    execution_noise: Sequence[float] = (0.0,),
    workers: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """``episodes`` scripted-pusher demonstrations (see the module docstring). Returns ``{"observations",
    "action_chunks", "episodes": [{"seed", "success", "final_coverage", "steps", "sim_states", "execution_noise"}],
    "success_rate"}``."""
    require_gym_pusht()
    for name, value in (("episodes", episodes), ("max_steps", max_steps), ("stride", stride), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{name}: expected an integer >= 1, got {value!r}.")
    for name, levels in (("noise_levels", noise_levels), ("execution_noise", execution_noise)):
        if len(levels) == 0 or min(levels) < 0:
            raise InputError(f"{name}: expected non-negative pixel noise levels, got {levels!r}.")
    rng = np.random.default_rng(seed)
    jobs = [
        (
            seed + i,
            float(rng.choice(noise_levels)),
            float(rng.choice(execution_noise)),
            max_steps,
            stride,
            chunk,
            tuple(image_size),
            tuple(observation_size),
            action_stats,
        )
        for i in range(episodes)
    ]
    workers = min(os.cpu_count() or 1, episodes) if workers is None else int(workers)
    from tqdm.auto import tqdm

    results = []
    with tqdm(total=episodes, desc="scripted demonstrations", disable=not progress) as bar:
        if workers <= 1:
            for job in jobs:
                results.append(_demonstrate(job))
                bar.update()
        else:
            context = multiprocessing.get_context(
                "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            )
            with ProcessPoolExecutor(workers, mp_context=context, initializer=_one_thread) as pool:
                for result in pool.map(_demonstrate, jobs, chunksize=max(1, episodes // (4 * workers))):
                    results.append(result)
                    bar.update()
    return {
        "observations": np.concatenate([r.pop("observations") for r in results]),
        "action_chunks": np.concatenate([r.pop("action_chunks") for r in results]),
        "episodes": results,
        "success_rate": float(np.mean([r["success"] for r in results])),
    }


def _one_thread() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
