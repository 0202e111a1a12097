"""How faithful is the PushT world model to the real simulator, and does its policy mode push the T?

    python benchmarks/recipes/fidelity_pusht_chunks.py --assets cosmos3_gym/tasks/pusht/assets --out $OUT

Needs gym-pusht (the ``sim`` extra). Three measurements, on start states held out from training:

* **Forward dynamics, chunk by chunk.** From the simulator's start frame, the world model (the PushT-v0 vector env,
  one slot per episode) steps through the episode's recorded actions chunk after chunk, continuing from its own
  frames; PSNR of each chunk's frames against the simulator's (``rollout``). ``one_chunk`` restarts every chunk
  from the simulator's true frame, so it shows the error of one step without the accumulated drift. PushT frames are
  mostly white table, so PSNR alone flatters any model; two no-motion floors go with them: ``copy_start`` repeats
  the chunk's *true* start frame (the floor of ``one_chunk``, which is given that frame), ``hold_first`` repeats the
  episode's first frame (the floor of ``rollout``, which is given only that frame: a model that did not follow the
  simulator at all would score about this).
* **Policy mode in the real simulator.** ``PolicyAgent`` (the checkpoint's policy: frame + task -> action chunk)
  drives gym-pusht; coverage of the target (final and best) and success (coverage > 0.95) against uniformly random
  actions and the noise-free scripted pusher from the same start states, with 95 % confidence intervals and the
  paired policy - random difference.
* **Reward model.** Its score on the simulator's frames against their true coverage (MAE, success accuracy).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.agents import PolicyAgent  # noqa: E402
from cosmos3_gym.engine import Cosmos3Engine  # noqa: E402
from cosmos3_gym.processor import ActionStats  # noqa: E402
from cosmos3_gym.rewards import ClassifierRewardModel  # noqa: E402
from cosmos3_gym.statistics import mean_interval, wilson_interval  # noqa: E402
from cosmos3_gym.tasks.pusht import episodes as pusht  # noqa: E402
from cosmos3_gym.tasks.pusht.env import load_pusht_assets, make_pusht_vector_env, pusht_env_defaults  # noqa: E402


def mean_ci95(values, bounds: tuple[float, float] | None = None) -> dict[str, float]:
    """Mean and its 95 % confidence interval: ``cosmos3_gym.statistics.mean_interval`` (Student t, clipped to
    ``bounds`` when the values have known bounds; NaN for fewer than 2 values)."""
    values = np.asarray(values, dtype=np.float64).ravel().tolist()
    low, high = mean_interval(values, 0.95, bounds) or (math.nan, math.nan)
    return {"mean": float(np.mean(values)), "ci95_low": low, "ci95_high": high, "n": len(values)}


def finite_mean_ci95(values, bounds: tuple[float, float] | None = None) -> dict[str, float]:
    """``mean_ci95`` of the finite values only (a PSNR of identical frames is inf; a NaN summary when none are)."""
    values = np.asarray(values, np.float64).ravel()
    values = values[np.isfinite(values)]
    if not len(values):
        return {"mean": math.nan, "ci95_low": math.nan, "ci95_high": math.nan, "n": 0}
    return mean_ci95(values, bounds)


def rate_ci95(outcomes) -> dict[str, float]:
    """A success rate and its 95 % Wilson interval (``cosmos3_gym.statistics.wilson_interval``), as ``mean_ci95``."""
    outcomes = np.asarray(outcomes, dtype=bool).ravel()
    low, high = wilson_interval(int(outcomes.sum()), len(outcomes))
    return {"mean": float(outcomes.mean()), "ci95_low": low, "ci95_high": high, "n": len(outcomes)}


def load_episodes(dataset_dir: Path, count: int) -> list[dict[str, np.ndarray]]:
    paths = sorted((dataset_dir / "episodes").glob("episode_*.npz"))[:count]
    episodes = []
    for path in paths:
        with np.load(path) as archive:
            episodes.append({key: archive[key] for key in ("frames", "actions", "coverage", "sim_seed")})
    return episodes


# ---------------------------------------------------------------------------------------------------------------
# Forward dynamics
# ---------------------------------------------------------------------------------------------------------------


def forward_fidelity(engine, assets_dir: Path, episodes: list[dict], num_chunks: int, seed: int = 0) -> dict:
    """PSNR per chunk of world-model rollouts against the simulator (same start, same actions)."""
    envs = make_pusht_vector_env(len(episodes), assets_dir=assets_dir, engine=engine, return_frames=True,
                                 reward_model=None, success_threshold=None, max_episode_steps=None)
    try:
        chunk = envs.single_action_space.shape[0]
        stats = envs.action_stats
        needed = num_chunks * chunk
        if any(len(episode["actions"]) < needed for episode in episodes):
            raise ValueError(f"episodes need {needed} actions for {num_chunks} chunks of {chunk}")
        true_frames = np.stack([episode["frames"][: needed + 1] for episode in episodes])  # [N, T+1, H, W, 3]
        actions = np.stack([episode["actions"][:needed] for episode in episodes]).reshape(len(episodes), num_chunks,
                                                                                         chunk, -1)
        actions = np.clip(stats.normalize(actions.astype(np.float32)), -1.0, 1.0)

        rollout, one_chunk, copy_start, hold_first = [], [], [], []
        held = np.repeat(true_frames[:, :1], chunk, axis=1)  # the episode's first frame, the same for every chunk
        envs.reset(seed=seed, options={"frames": list(true_frames[:, 0])})
        for k in range(num_chunks):
            truth = true_frames[:, 1 + k * chunk : 1 + (k + 1) * chunk]
            infos = envs.step(actions[:, k])[-1]
            rollout.append([pusht.psnr(truth[i], infos["frames"][i]) for i in range(len(episodes))])
            hold_first.append([pusht.psnr(truth[i], held[i]) for i in range(len(episodes))])
        for k in range(num_chunks):  # each chunk from the simulator's frame
            truth = true_frames[:, 1 + k * chunk : 1 + (k + 1) * chunk]
            envs.reset(seed=seed + 1 + k, options={"frames": list(true_frames[:, k * chunk])})
            infos = envs.step(actions[:, k])[-1]
            one_chunk.append([pusht.psnr(truth[i], infos["frames"][i]) for i in range(len(episodes))])
            start = true_frames[:, k * chunk : k * chunk + 1]
            copy_start.append([pusht.psnr(truth[i], np.repeat(start[i], chunk, axis=0)) for i in range(len(episodes))])
    finally:
        envs.close()
    return {
        "chunk": chunk,
        "num_episodes": len(episodes),
        "psnr_db": {
            name: [mean_ci95(values) for values in per_chunk]
            for name, per_chunk in (("rollout", rollout), ("hold_first", hold_first), ("one_chunk", one_chunk),
                                    ("copy_start", copy_start))
        },
    }


# ---------------------------------------------------------------------------------------------------------------
# Policy mode in the simulator
# ---------------------------------------------------------------------------------------------------------------


def policy_in_simulator(engine, settings: dict, stats: ActionStats, sim_seeds: list[int], num_chunks: int,
                        image_size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Coverage ``[N, steps + 1]`` of ``PolicyAgent`` driving one simulator per start state (one batched policy
    call per chunk)."""
    agent = PolicyAgent(
        engine, task=settings["task"], domain=settings["domain"], raw_action_dim=settings["raw_action_dim"],
        chunk=settings["chunk"], num_steps=settings["num_steps"], guidance_scale=settings["guidance_scale"],
        resolution_tier=settings["resolution_tier"], fps=settings["fps"], seed=seed,
    )
    sims = [pusht.PushTSim(image_size) for _ in sim_seeds]
    try:
        frames = [sim.reset(s) for sim, s in zip(sims, sim_seeds)]
        coverage = [[sim.coverage] for sim in sims]
        for _ in range(num_chunks):
            chunks = stats.denormalize(agent.act(np.stack(frames)))  # [N, chunk, 2] table pixels
            for i, sim in enumerate(sims):
                for action in np.clip(chunks[i], 0.0, pusht.TABLE_SIZE):
                    frames[i] = sim.step(action)
                    coverage[i].append(sim.coverage)
    finally:
        for sim in sims:
            sim.close()
    return np.asarray(coverage)


def _baseline_coverage(job) -> np.ndarray:
    """Coverage of one simulator episode under a baseline policy ("random" actions or the "scripted" pusher)."""
    name, sim_seed, steps, low, high = job
    sim = pusht.PushTSim((32, 32))  # coverage does not depend on the rendering size
    rng = np.random.default_rng(sim_seed)
    scripted = pusht.ScriptedPusher(rng)
    try:
        sim.reset(sim_seed)
        coverage = [sim.coverage]
        for _ in range(steps):
            action = rng.uniform(low, high) if name == "random" else scripted(sim.agent_xy, sim.block_pose)
            sim.step(action)
            coverage.append(sim.coverage)
    finally:
        sim.close()
    return np.asarray(coverage)


def coverage_summary(coverage: np.ndarray) -> dict[str, Any]:
    return {
        "final_coverage": mean_ci95(coverage[:, -1], bounds=(0.0, 1.0)),
        "max_coverage": mean_ci95(coverage.max(axis=1), bounds=(0.0, 1.0)),
        "success_rate": rate_ci95((coverage > pusht.SUCCESS_COVERAGE).any(axis=1)),
    }


def policy_versus_baselines(engine, settings: dict, stats: ActionStats, sim_seeds: list[int], num_chunks: int,
                            image_size: tuple[int, int], workers: int) -> dict:
    steps = num_chunks * settings["chunk"]
    # Random actions span the policy's range: the action space [-1, 1] in table pixels.
    ones = np.ones(settings["raw_action_dim"], np.float32)
    low, high = stats.denormalize(np.stack([-ones, ones]))
    jobs = [(name, s, steps, low, high) for name in ("random", "scripted") for s in sim_seeds]
    # The baselines are simulated in worker processes while the policy runs below. The workers only run the
    # simulator (never torch or CUDA), so forking a process that holds a CUDA context is safe.
    with ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("fork")) as pool:
        baseline_runs = pool.map(_baseline_coverage, jobs)
        started = time.perf_counter()
        policy = policy_in_simulator(engine, settings, stats, sim_seeds, num_chunks, image_size)
        policy_seconds = time.perf_counter() - started
        baselines = np.asarray(list(baseline_runs)).reshape(2, len(sim_seeds), steps + 1)
    random, scripted = baselines
    return {
        "num_episodes": len(sim_seeds),
        "steps": steps,
        "policy": coverage_summary(policy),
        "random": coverage_summary(random),
        "scripted_pusher": coverage_summary(scripted),
        "policy_minus_random_final_coverage": mean_ci95(policy[:, -1] - random[:, -1]),
        "policy_minus_random_max_coverage": mean_ci95(policy.max(axis=1) - random.max(axis=1)),
        "policy_seconds": policy_seconds,
    }


# ---------------------------------------------------------------------------------------------------------------
# Reward model
# ---------------------------------------------------------------------------------------------------------------


def reward_model_accuracy(reward_model_dir: Path, episodes: list[dict], device: str) -> dict:
    """The classifier's score on simulator frames against their true coverage."""
    model = ClassifierRewardModel.load(reward_model_dir, device=device)
    frames = np.concatenate([episode["frames"] for episode in episodes])
    coverage = np.concatenate([episode["coverage"] for episode in episodes])
    with torch.no_grad():
        scores = torch.cat([
            model.score_frames(torch.from_numpy(batch).permute(0, 3, 1, 2).float().div(255.0)).cpu()
            for batch in np.array_split(frames, max(1, len(frames) // 256))
        ]).numpy()
    success = coverage > pusht.SUCCESS_COVERAGE
    predicted = scores > pusht.SUCCESS_COVERAGE
    return {
        "num_frames": int(len(frames)),
        "mae": float(np.abs(scores - coverage).mean()),
        "correlation": float(np.corrcoef(scores, coverage)[0, 1]) if coverage.std() > 0 else math.nan,
        "success_frames": int(success.sum()),
        "success_accuracy": float((predicted == success).mean()),
        "success_recall": float(predicted[success].mean()) if success.any() else math.nan,
    }


# ---------------------------------------------------------------------------------------------------------------


def evaluate(assets_dir: Path, heldout_dir: Path, *, device: str, fidelity_episodes: int, fidelity_chunks: int,
             policy_episodes: int, policy_chunks: int, workers: int) -> dict:
    """All three measurements for the model in ``assets_dir`` on the held-out episodes in ``heldout_dir``."""
    assets = load_pusht_assets(assets_dir)
    defaults = pusht_env_defaults(assets)
    settings = {key: defaults[key] for key in ("task", "domain", "raw_action_dim", "chunk", "num_steps",
                                                "guidance_scale", "resolution_tier", "fps")}
    stats = ActionStats.from_json(defaults["action_stats"], mode=assets.meta.get("action_normalization", "minmax"))
    episodes = load_episodes(heldout_dir, max(fidelity_episodes, policy_episodes))
    image_size = tuple(episodes[0]["frames"].shape[1:3])
    engine = Cosmos3Engine.from_pretrained(assets.checkpoint, device=device, progress=False)
    results: dict[str, Any] = {"settings": settings, "assets": str(assets.root), "heldout": str(heldout_dir)}
    try:
        started = time.perf_counter()
        results["forward_dynamics"] = forward_fidelity(engine, assets.root, episodes[:fidelity_episodes],
                                                       fidelity_chunks)
        results["forward_dynamics"]["seconds"] = time.perf_counter() - started
        started = time.perf_counter()
        results["policy_in_simulator"] = policy_versus_baselines(
            engine, settings, stats, [int(e["sim_seed"]) for e in episodes[:policy_episodes]], policy_chunks,
            image_size, workers,
        )
        results["policy_in_simulator"]["seconds"] = time.perf_counter() - started
        results["reward_model"] = reward_model_accuracy(assets.reward_model, episodes[:fidelity_episodes], device)
    finally:
        engine.close()
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the installed built-in one)")
    parser.add_argument("--heldout", default=None, help="held-out episode dataset (default: simulate --episodes)")
    parser.add_argument("--heldout-seed", type=int, default=10_000, help="dataset seed of simulated held-out data")
    parser.add_argument("--fidelity-episodes", type=int, default=16)
    parser.add_argument("--fidelity-chunks", type=int, default=4)
    parser.add_argument("--policy-episodes", type=int, default=32)
    parser.add_argument("--policy-chunks", type=int, default=16)
    parser.add_argument("--workers", type=int, default=None, help="simulator processes (default: CPU cores)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_output_arguments(parser)
    parser.add_argument("--results-name", default="fidelity_pusht_chunks.json")
    args = parser.parse_args(argv)
    check_results_target(args.results_name, args.out, args.overwrite)

    assets = load_pusht_assets(args.assets)
    heldout = Path(args.heldout) if args.heldout else None
    if heldout is None:
        import tempfile

        chunk = int(assets.meta["chunk"])
        heldout = pusht.generate_pusht_dataset(
            Path(tempfile.mkdtemp()) / "heldout", max(args.fidelity_episodes, args.policy_episodes),
            steps_per_episode=args.fidelity_chunks * chunk, image_size=tuple(assets.meta["image_size"]),
            seed=args.heldout_seed, workers=args.workers,
        )
    results = evaluate(
        assets.root, heldout, device=args.device, fidelity_episodes=args.fidelity_episodes,
        fidelity_chunks=args.fidelity_chunks, policy_episodes=args.policy_episodes, policy_chunks=args.policy_chunks,
        workers=args.workers or (os.cpu_count() or 1),
    )
    results = {"provenance": provenance(["benchmarks/recipes/fidelity_pusht_chunks.py", *(argv or sys.argv[1:])]),
               **results}
    write_results(results, args.results_name, args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    main()
