"""Simulated PushT datasets in the episode layout ``cosmos3_gym.training`` reads (layout:
``cosmos3_gym.tasks.pusht.episodes``)."""

from __future__ import annotations

import functools
import json
import math
import multiprocessing
import os
import sys
import zipfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError
from .geometry import DOMAIN, RAW_ACTION_DIM, SIM_ENV_ID, SIM_FPS, TASK
from .policies import (
    REPLAY_NOISE,
    SCRIPTED_NOISE_LEVELS,
    ChunkedFramePolicy,
    RandomWaypoints,
    Replay,
    ScriptedPusher,
    UniformTargets,
)
from .policy_pools import load_policy_pools
from .sim import PushTSim, _check_image_size, require_gym_pusht, rollout_episode

__all__ = [
    "DEFAULT_POLICY_MIX",
    "POLICIES",
    "action_statistics",
    "episode_policy",
    "generate_pusht_dataset",
    "write_dataset_files",
]

POLICIES = ("random", "scripted", "scripted_random_goal", "replay", "uniform")  # and "file:PATH": a frame policy file
# The box a ``scripted_random_goal`` episode draws its goal's center from: where gym-pusht's reset puts blocks
# ([100, 400] per axis), kept 40 px further in so that a T pushed onto it stays on the table.
RANDOM_GOAL_LOW, RANDOM_GOAL_HIGH = 140.0, 372.0
POLICY_FILE_PREFIX = "file:"
DEFAULT_POLICY_MIX = {"random": 0.2, "scripted": 0.6, "replay": 0.2}


def generate_pusht_dataset(
    out_dir: str | os.PathLike,
    episodes: int,
    *,
    steps_per_episode: int = 128,
    image_size: tuple[int, int] = (256, 256),
    policy_mix: dict[str, float] | None = None,
    action_stats: str | os.PathLike | dict | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Simulate ``episodes`` episodes of ``steps_per_episode`` actions into ``out_dir`` (layout: module docstring).

    Frames are rendered by gym-pusht at ``image_size`` (256 x 256 is the model's tier-256 canvas, a downscale of the
    512 x 512 table). ``policy_mix`` gives each policy's share (default ``DEFAULT_POLICY_MIX``): ``random``
    (waypoints), ``scripted``, ``scripted_random_goal`` (the scripted pusher taking the T to a goal pose drawn per
    episode instead of the green target: contact-rich pushes in every direction, so that a model trained on them
    cannot predict where a push takes the block from the task alone), ``replay``, ``uniform`` (a uniform random
    target every step, like the env's
    ``action_space.sample()``) and ``"file:PATH"`` for a policy file of ``cosmos3_gym.rl`` acting on the rendered
    frames one chunk at a time with its own sampling noise (``ChunkedFramePolicy``; its normalised actions map to
    pixels with ``action_stats``, the model's action statistics file or dict, required then). Each episode draws
    its policy, noise level and start state from ``(seed, episode index)`` alone, so the data does not depend on
    ``workers`` (processes; default one per CPU core, 0 or 1 runs in this process). Returns ``out_dir``.
    """
    require_gym_pusht()  # fail here, not in every worker
    for name, value, minimum in (("episodes", episodes, 1), ("steps_per_episode", steps_per_episode, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise InputError(f"{name}: expected an integer >= {minimum}, got {value!r}.")
    image_size = _check_image_size(image_size)
    mix = _check_policy_mix(policy_mix)
    policy_files = [name for name in mix if name.startswith(POLICY_FILE_PREFIX)]
    stats_document = None
    if policy_files:
        if action_stats is None:
            raise InputError(
                f"action_stats: required with policy files in policy_mix ({policy_files}): the action "
                f"statistics that map their normalised actions to table pixels."
            )
        from ...processor import ActionStats

        ActionStats.from_json(action_stats)  # fail here on a bad file, not in every worker
        stats_document = action_stats if isinstance(action_stats, dict) else json.loads(Path(action_stats).read_text())
        for name in policy_files:
            if not Path(name[len(POLICY_FILE_PREFIX) :]).is_file():
                raise InputError(f"policy_mix: {name!r} names no file.")
    out_dir = Path(out_dir)
    episode_dir = out_dir / "episodes"
    if episode_dir.exists() and any(episode_dir.iterdir()):
        raise InputError(f"out_dir: {out_dir} already holds episodes; give a new or empty folder.")
    episode_dir.mkdir(parents=True, exist_ok=True)

    jobs = [
        (str(episode_dir), index, int(seed), int(steps_per_episode), image_size, mix, stats_document)
        for index in range(episodes)
    ]
    summaries = map_in_simulator_processes(
        _simulate_and_write,
        jobs,
        workers,
        fresh_workers=bool(policy_files),
        desc="simulating PushT episodes",
        progress=progress,
    )

    policies: dict[str, int] = {}
    for summary in summaries:
        policies[summary["policy"]] = policies.get(summary["policy"], 0) + 1
    meta = {
        "domain": DOMAIN,
        "raw_action_dim": RAW_ACTION_DIM,
        "fps": SIM_FPS,
        "image_size": list(image_size),
        "action_normalization": "minmax",
        "num_episodes": int(episodes),
        "source": SIM_ENV_ID,
        "policies": dict(sorted(policies.items())),
        "task": TASK,
        "steps_per_episode": int(steps_per_episode),
        "seed": int(seed),
        "success_rate": float(np.mean([summary["success"] for summary in summaries])),
        "mean_final_coverage": float(np.mean([summary["final_coverage"] for summary in summaries])),
    }
    write_dataset_files(out_dir, meta, np.concatenate([summary["actions"] for summary in summaries]))
    return out_dir


def map_in_simulator_processes(
    fn: Callable[[Any], Any],
    jobs: list,
    workers: int | None,
    *,
    fresh_workers: bool,
    desc: str,
    progress: bool = True,
) -> list:
    """``[fn(job) for job in jobs]``, in order, over ``workers`` processes (default one per CPU core; 0 or 1: in this
    process), with a progress bar. ``fresh_workers``: ``fn`` runs torch (a policy file's network), or this process
    has already run torch or a world model (whose CUDA context and thread pools a forked worker would inherit).

    Otherwise workers run only the simulator (numpy, pymunk, pygame) and are forked: safe, and it spares each
    worker re-importing cosmos3_gym (torch, diffusers: seconds each). Torch is not fork-safe once the parent has used
    it: fresh workers come from a fork server then (a fresh process that imports the main module once and forks the
    workers from it; spawning makes every worker import the main module itself, a recipe's torch and engine 16 times
    over), spawned where there is none."""
    from tqdm.auto import tqdm

    workers = min(os.cpu_count() or 1, len(jobs)) if workers is None else int(workers)
    results = []
    with tqdm(total=len(jobs), desc=desc, disable=not progress) as bar:
        if workers <= 1:
            for job in jobs:
                results.append(fn(job))
                bar.update()
            return results
        methods = multiprocessing.get_all_start_methods()
        if "fork" in methods and not fresh_workers:
            method = "fork"
        else:
            method = "forkserver" if "forkserver" in methods else "spawn"
        # A forked worker keeps the parent's thread pools' state: OpenCV's setNumThreads hangs there (it tears down
        # a pool whose threads stayed in the parent), so only fresh workers get the one-thread cap.
        initializer = None if method == "fork" else _one_thread_per_worker
        with ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(method), initializer=initializer
        ) as pool:
            for result in pool.map(fn, jobs, chunksize=max(1, len(jobs) // (8 * workers))):
                results.append(result)
                bar.update()
    return results


def save_npz(path: str | os.PathLike, arrays: dict[str, np.ndarray], compresslevel: int = 1) -> None:
    """``np.savez_compressed(path, **arrays)`` at zlib level ``compresslevel``: the same file layout (``np.load``
    reads it back), but numpy's fixed level 6 spends twice as long for files a third smaller (the frames of a
    128-step episode at 256 x 256: 25 MB raw, 0.37 MB at level 1 in 0.03 s against 0.23 MB in 0.065 s)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)


def action_statistics(actions: np.ndarray) -> dict[str, list[float]]:
    """Per-dimension ``min, max, mean, std, q01, q99`` of raw actions ``[N, D]`` (the stats.json ``action`` block)."""
    actions = np.asarray(actions, dtype=np.float64)
    if actions.ndim != 2 or actions.shape[0] < 1:
        raise InputError(f"actions: expected a non-empty [N, D] array, got shape {actions.shape}.")
    return {
        "min": actions.min(axis=0).tolist(),
        "max": actions.max(axis=0).tolist(),
        "mean": actions.mean(axis=0).tolist(),
        "std": actions.std(axis=0).tolist(),
        "q01": np.quantile(actions, 0.01, axis=0).tolist(),
        "q99": np.quantile(actions, 0.99, axis=0).tolist(),
    }


def write_dataset_files(out_dir: str | os.PathLike, meta: dict[str, Any], actions: np.ndarray) -> None:
    """Write ``meta.json`` and ``stats.json`` (statistics of all the dataset's raw ``actions [N, D]``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out_dir / "stats.json").write_text(json.dumps({"action": action_statistics(actions)}, indent=2) + "\n")


def episode_policy(seed: int, index: int, policy_mix: dict[str, float]) -> tuple[str, float, np.random.Generator]:
    """``(family, noise, rng)`` of episode ``index``: drawn from ``(seed, index)`` only."""
    rng = np.random.default_rng([seed, index])
    names = list(policy_mix)
    family = names[int(rng.choice(len(names), p=np.asarray([policy_mix[name] for name in names])))]
    noise = {"random": 0.0, "replay": REPLAY_NOISE, "uniform": 0.0}.get(family)
    if family.startswith(POLICY_FILE_PREFIX):
        noise = 0.0  # the policy's own Gaussian
    elif noise is None:
        noise = float(rng.choice(SCRIPTED_NOISE_LEVELS))
    return family, noise, rng


def random_goal_pose(rng: np.random.Generator) -> np.ndarray:
    """A goal pose ``[x, y, angle]`` for ``scripted_random_goal``: center uniform in the goal box, any angle."""
    return np.array([*rng.uniform(RANDOM_GOAL_LOW, RANDOM_GOAL_HIGH, size=2), rng.uniform(-math.pi, math.pi)])


def _one_thread_per_worker() -> None:
    """The workers fill the cores; OpenCV's thread pool (gym-pusht's resize) and torch's (a policy file's CNN) would
    each add one thread per core to every worker (16 x 16 threads on 16 cores). For workers that start fresh (a
    fork server's or spawned), not forked from a parent that has used those pools."""
    import cv2

    cv2.setNumThreads(1)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


_WORKER_SIMS: dict[tuple[tuple[int, int], bool], PushTSim] = {}  # per process, frame size and drawing mode
_WORKER_POLICIES: dict[str, Any] = {}  # one loaded policy file per process and path


def _worker_sim(image_size: tuple[int, int], render_every_step: bool) -> PushTSim:
    key = (image_size, render_every_step)
    if key not in _WORKER_SIMS:
        _WORKER_SIMS[key] = PushTSim(image_size, render_every_step=render_every_step)
    return _WORKER_SIMS[key]


def _actions_only(sim: PushTSim, policy, seed: int, steps: int) -> np.ndarray:
    """The actions float32 ``[steps, 2]`` of ``rollout_episode(sim, policy, seed, steps)`` without its frames and
    states: a replay needs only the reference's actions, and drawing costs more than the physics."""
    sim.reset(seed)
    actions = []
    for _ in range(steps):
        actions.append(policy(sim.agent_xy, sim.block_pose))
        sim.step(actions[-1])
    return np.asarray(actions, np.float32).reshape(steps, RAW_ACTION_DIM)


def _frame_policy(path: str, sim: PushTSim, stats_document: dict, rng: np.random.Generator) -> ChunkedFramePolicy:
    import torch

    from ...processor import ActionStats
    from ...rl.policy import load_policy_file

    if path not in _WORKER_POLICIES:
        torch.set_num_threads(1)  # one worker per core
        _WORKER_POLICIES[path] = load_policy_file(path)
    stats = ActionStats.from_json(stats_document)
    generator = torch.Generator().manual_seed(int(rng.integers(2**63)))
    return ChunkedFramePolicy(_WORKER_POLICIES[path], sim.render, stats.denormalize, generator)


@functools.cache
def _held_out_seed_ranges() -> tuple[tuple[int, int], ...]:
    """The reset seeds no training data may start from: every range of the policy-pool manifest but "training"
    (choosing between variants, reporting, measurements)."""
    ranges = load_policy_pools(check_files=False).seed_ranges
    return tuple((r.first, r.last) for name, r in ranges.items() if name != "training")


def training_reset_seed(rng: np.random.Generator) -> int:
    """A gym-pusht reset seed drawn from ``[0, 2**31)`` outside the held-out ranges (about 0.1 % of draws fall in
    them and are drawn again), so simulated training episodes never share a start with an evaluation."""
    while True:
        seed = int(rng.integers(2**31))
        if not any(first <= seed <= last for first, last in _held_out_seed_ranges()):
            return seed


def _simulate_and_write(job) -> dict[str, Any]:
    episode_dir, index, seed, steps, image_size, policy_mix, stats_document = job
    family, noise, rng = episode_policy(seed, index, policy_mix)
    sim = _worker_sim(image_size, render_every_step=True)
    sim_seed = training_reset_seed(rng)
    extra: dict[str, np.ndarray] = {}
    policy: Callable[[np.ndarray, np.ndarray], np.ndarray]
    if family == "random":
        policy, name = RandomWaypoints(rng), "random"
    elif family == "uniform":
        policy, name = UniformTargets(rng), "uniform"
    elif family.startswith(POLICY_FILE_PREFIX):
        path = family[len(POLICY_FILE_PREFIX) :]
        policy, name = _frame_policy(path, sim, stats_document, rng), f"file({Path(path).stem})"
    elif family == "scripted":
        policy, name = ScriptedPusher(rng, noise=noise), f"scripted(noise={noise:g})"
    elif family == "scripted_random_goal":
        goal = random_goal_pose(rng)
        policy, name = ScriptedPusher(rng, noise=noise, goal_pose=goal), f"{family}(noise={noise:g})"
        extra = {"goal_pose": goal}
    else:  # a noise-free scripted episode from the same start, replayed with noise
        reference = _actions_only(
            _worker_sim(image_size, render_every_step=False), ScriptedPusher(rng), sim_seed, steps
        )
        policy, name = Replay(reference, rng, noise), f"replay(noise={noise:g})"
    episode = rollout_episode(sim, policy, sim_seed, steps)
    save_npz(
        Path(episode_dir) / f"episode_{index:06d}.npz",
        {**episode, **extra, "task": np.asarray(TASK), "policy": np.asarray(name)},
    )
    return {
        "index": index,
        "policy": name,
        "actions": episode["actions"],
        "success": bool(episode["success"]),
        "final_coverage": float(episode["coverage"][-1]),
    }


def parse_policy_mix(text: str | None) -> dict[str, float] | None:
    """A command line's policy mix, ``"NAME=SHARE,NAME=SHARE"`` (names as ``generate_pusht_dataset``'s
    ``policy_mix``; a name may hold ``=``, as a ``file:`` path can) -> the dict; None stays None."""
    if text is None:
        return None
    mix = {}
    for item in text.split(","):
        name, _, share = item.strip().rpartition("=")
        try:
            mix[name] = float(share)
        except ValueError:
            raise InputError(f"policy mix: expected NAME=SHARE items separated by commas, got {item!r}") from None
    return mix


def _check_policy_mix(policy_mix: dict[str, float] | None) -> dict[str, float]:
    if policy_mix is None:
        return dict(DEFAULT_POLICY_MIX)
    if not isinstance(policy_mix, dict) or not policy_mix:
        raise InputError(f"policy_mix: expected a dict of policy shares, some of {list(POLICIES)}; got {policy_mix!r}.")
    unknown = sorted(
        name
        for name in policy_mix
        if name not in POLICIES and not (isinstance(name, str) and name.startswith(POLICY_FILE_PREFIX))
    )
    if unknown:
        raise InputError(
            f"policy_mix: unknown policies {unknown}; expected some of {list(POLICIES)} or '{POLICY_FILE_PREFIX}PATH'."
        )
    shares = {name: float(share) for name, share in policy_mix.items()}
    total = sum(shares.values())
    if any(not math.isfinite(share) or share < 0 for share in shares.values()) or total <= 0:
        raise InputError(f"policy_mix: expected non-negative shares with a positive sum, got {policy_mix!r}.")
    return {name: share / total for name, share in shares.items()}
