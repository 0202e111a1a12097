"""Is the PushT world model a faithful simulator? Action following, policy evaluation and inverse dynamics against
gym-pusht, at a scale that runs on a CPU in minutes.

    python benchmarks/recipes/fidelity_pusht.py --out /tmp/fidelity   # CPU defaults; fidelity_pusht_cpu.json there

Needs gym-pusht (the ``sim`` extra). Held-out episodes are simulated fresh (dataset seed ``--heldout-seed``, not a
training seed). Four measurements:

1. **Action following.** From each held-out start frame the world model (the PushT-v0 vector env, one slot per
   episode) steps through the episode's recorded action chunks, continuing from its own frames; PSNR and SSIM
   (grayscale, Gaussian window) of every chunk against the simulator's frames, next to the floor of repeating the
   chunk's start frame (``copy_start``; PushT frames are mostly white table, so both metrics flatter any model);
   and at each chunk's last frame the error (table pixels, of 512) of the agent and block positions read off the
   frames by colour (``cosmos3_gym.tasks.pusht.readoff``: no learned regressor; checked against the simulator's state),
   with how often the block is visible at all in the estimate.
2. **Policy evaluation.** ``cosmos3_gym.tasks.pusht.compare.compare_with_simulator``: random actions, the scripted
   pusher at four noise levels and the checkpoint's own policy, each in the simulator (true coverage) and in the
   world model (the reward model's coverage estimate) from the same starts, with 95 % CIs, and how well the world
   model ranks them: Pearson, Spearman, MMRV and mean absolute error of the per-policy mean final coverage. PPO
   policies saved by ``rl_imagination_pusht.py`` join the ranking as ``ppo:PATH`` items of ``--policies``,
   e.g. ``--policies
   random,scripted:0,agent,ppo:benchmarks/results/rl/rl_imagination_pusht_cpu_world_model_policy.safetensors``
   (one line); like ``agent`` they run closed loop in both worlds.
3. **Inverse dynamics.** ``InverseDynamicsAgent`` on the simulator's chunk + 1 frame windows: MSE of its actions
   against the true ones (normalised space), against predicting the dataset's mean action.
4. **RL in imagination**: ``benchmarks/recipes/rl_imagination_pusht.py`` (its own script: it needs GPU time).

Default sizes (8 held-out episodes x 4 chunks; 6 policies x 8 starts x 4 chunks of 8 steps, one 48-slot vector env)
keep the run to minutes on 2 CPU cores; 32 steps is too short for the scripted pusher to finish the task (it needs
about 128), so at these sizes the policies differ in coverage more than in success. On a GPU raise
``--policy-starts`` / ``--policy-chunks`` (e.g. 32 / 16).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

from common import add_output_arguments, provenance, write_results  # noqa: E402
from fidelity_pusht_chunks import load_episodes, mean_ci95  # noqa: E402

from cosmos3_gym.agents import InverseDynamicsAgent  # noqa: E402
from cosmos3_gym.engine import Cosmos3Engine  # noqa: E402
from cosmos3_gym.processor import ActionStats  # noqa: E402
from cosmos3_gym.tasks.pusht import episodes as pusht  # noqa: E402
from cosmos3_gym.tasks.pusht.compare import compare_with_simulator, format_comparison, replay_actions, ssim  # noqa: E402
from cosmos3_gym.tasks.pusht.env import load_pusht_assets, make_pusht_vector_env, pusht_env_defaults  # noqa: E402
from cosmos3_gym.tasks.pusht.readoff import read_positions  # noqa: E402

DEFAULT_POLICIES = "random,scripted:0,scripted:10,scripted:25,scripted:50,agent"


def action_following(engine, assets_dir: Path, episodes: list[dict], stats: ActionStats, num_chunks: int,
                     seed: int = 0) -> dict[str, Any]:
    """PSNR and SSIM per chunk of world-model rollouts against the simulator (same start, same actions), and of two
    no-motion floors: ``hold_first`` repeats the episode's first frame (all the rollout is given: a model that does
    not follow the simulator scores about this), ``copy_start`` repeats each chunk's *true* start frame (an oracle
    reset the rollout never gets). At each chunk's last frame also the distance (table pixels) between the agent /
    block positions read off the estimate and off the simulator's frame (``sim.readoff``)."""
    envs = make_pusht_vector_env(len(episodes), assets_dir=assets_dir, engine=engine, return_frames=True,
                                 reward_model=None, success_threshold=None, max_episode_steps=None)
    try:
        chunk = envs.single_action_space.shape[0]
        needed = num_chunks * chunk
        true_frames = np.stack([episode["frames"][: needed + 1] for episode in episodes])  # [N, T+1, H, W, 3]
        actions = np.stack([episode["actions"][:needed] for episode in episodes])
        actions = np.clip(stats.normalize(actions.astype(np.float32)), -1.0, 1.0).reshape(len(episodes), num_chunks,
                                                                                          chunk, -1)
        metrics = {name: {"psnr_db": [], "ssim": [], "agent_error_px": [], "block_error_px": [], "block_visible": []}
                   for name in ("rollout", "hold_first", "copy_start")}
        rollouts = replay_actions(envs, true_frames[:, 0], actions, seed=seed)
        held = np.repeat(true_frames[:, :1], chunk, axis=1)  # the episode's first frame, the same for every chunk
        for k in range(num_chunks):
            truth = true_frames[:, 1 + k * chunk : 1 + (k + 1) * chunk]
            copied = np.repeat(true_frames[:, k * chunk : k * chunk + 1], chunk, axis=1)
            for name, estimate in (("rollout", rollouts[:, k]), ("hold_first", held), ("copy_start", copied)):
                metrics[name]["psnr_db"].append(mean_ci95([pusht.psnr(t, e) for t, e in zip(truth, estimate)]))
                metrics[name]["ssim"].append(mean_ci95([ssim(t, e) for t, e in zip(truth, estimate)]))
                estimated = read_positions(estimate[:, -1])
                for part, true_xy, estimated_xy in zip(("agent", "block"), read_positions(truth[:, -1]), estimated):
                    error = np.linalg.norm(estimated_xy - true_xy, axis=1)
                    metrics[name][f"{part}_error_px"].append(mean_ci95(error[np.isfinite(error)].tolist()))
                metrics[name]["block_visible"].append(float(np.isfinite(estimated[1][:, 0]).mean()))
    finally:
        envs.close()
    return {"chunk": chunk, "num_episodes": len(episodes), "num_chunks": num_chunks, **metrics}


def inverse_dynamics(engine, settings: dict, episodes: list[dict], stats: ActionStats, mean_action: np.ndarray,
                     seed: int = 0) -> dict[str, Any]:
    """MSE (normalised actions) of the inverse-dynamics mode on each episode's first chunk + 1 frames, and of
    predicting the dataset's mean action."""
    chunk = settings["chunk"]
    agent = InverseDynamicsAgent(
        engine, task=settings["task"], domain=settings["domain"], raw_action_dim=settings["raw_action_dim"],
        chunk=chunk, num_steps=settings["num_steps"], guidance_scale=settings["guidance_scale"],
        resolution_tier=settings["resolution_tier"], fps=settings["fps"], seed=seed,
    )
    videos = np.stack([episode["frames"][: chunk + 1] for episode in episodes])
    truth = np.clip(stats.normalize(np.stack([e["actions"][:chunk] for e in episodes]).astype(np.float32)), -1, 1)
    inferred = np.asarray(agent.infer(videos))
    baseline = np.broadcast_to(np.clip(stats.normalize(mean_action.astype(np.float32)), -1, 1), truth.shape)
    return {
        "num_videos": len(episodes),
        "frames_per_video": chunk + 1,
        "mse_inverse_dynamics": mean_ci95(((inferred - truth) ** 2).mean(axis=(1, 2))),
        "mse_mean_action_baseline": mean_ci95(((baseline - truth) ** 2).mean(axis=(1, 2))),
        "baseline": "the held-out dataset's mean raw action, normalised",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the installed built-in one)")
    parser.add_argument("--heldout-seed", type=int, default=10_000, help="dataset seed of the simulated held-out data")
    parser.add_argument("--episodes", type=int, default=8, help="held-out episodes for action following / inverse "
                        "dynamics")
    parser.add_argument("--chunks", type=int, default=4, help="chunks of action following")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma-separated: random, scripted:NOISE (px), agent (the checkpoint's policy), "
                        "ppo:PATH (an SB3 PPO policy .safetensors of save_sb3_policy, e.g. "
                        "rl_imagination_pusht_<card>_world_model_policy.safetensors)")
    parser.add_argument("--policy-starts", type=int, default=8, help="simulator starts per policy")
    parser.add_argument("--policy-chunks", type=int, default=4, help="chunks per policy episode")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    add_output_arguments(parser)
    parser.add_argument("--results-name", default=None, help="default: fidelity_pusht_<cpu|cuda>.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    assets = load_pusht_assets(args.assets)
    defaults = pusht_env_defaults(assets)
    settings = {key: defaults[key] for key in ("task", "domain", "raw_action_dim", "chunk", "num_steps",
                                                "guidance_scale", "resolution_tier", "fps")}
    stats = ActionStats.from_json(defaults["action_stats"], mode=assets.meta.get("action_normalization", "minmax"))
    timings: dict[str, float] = {}

    started = time.perf_counter()
    heldout = pusht.generate_pusht_dataset(
        Path(tempfile.mkdtemp()) / "heldout", args.episodes, steps_per_episode=args.chunks * settings["chunk"],
        image_size=tuple(assets.meta["image_size"]), seed=args.heldout_seed,
    )
    episodes = load_episodes(heldout, args.episodes)
    mean_action = np.asarray(json.loads((heldout / "stats.json").read_text())["action"]["mean"])
    timings["heldout_simulation_s"] = time.perf_counter() - started

    engine = Cosmos3Engine.from_pretrained(assets.checkpoint, device=args.device, progress=False)
    results: dict[str, Any] = {"settings": settings, "assets": str(assets.root), "heldout_seed": args.heldout_seed}
    try:
        started = time.perf_counter()
        results["action_following"] = action_following(engine, assets.root, episodes, stats, args.chunks, args.seed)
        timings["action_following_s"] = time.perf_counter() - started
        print(f"action following: {timings['action_following_s']:.0f} s", flush=True)

        started = time.perf_counter()
        results["policy_evaluation"] = compare_with_simulator(
            args.policies, num_starts=args.policy_starts, num_chunks=args.policy_chunks,
            first_sim_seed=args.heldout_seed + 100_000, assets_dir=assets.root, engine=engine, seed=args.seed,
        )
        timings["policy_evaluation_s"] = time.perf_counter() - started
        print(f"policy evaluation: {timings['policy_evaluation_s']:.0f} s", flush=True)
        print(format_comparison(results["policy_evaluation"]))

        started = time.perf_counter()
        results["inverse_dynamics"] = inverse_dynamics(engine, settings, episodes, stats, mean_action, args.seed)
        timings["inverse_dynamics_s"] = time.perf_counter() - started
        print(f"inverse dynamics: {timings['inverse_dynamics_s']:.0f} s", flush=True)
    finally:
        engine.close()
    results["rl_in_imagination"] = ("benchmarks/recipes/rl_imagination_pusht.py (its own results: "
                                    "rl_imagination_pusht_<card>.json)")
    results["timings"] = timings
    card = "cpu" if args.device == "cpu" else "cuda"
    results = {"provenance": provenance(["benchmarks/recipes/fidelity_pusht.py", *(argv or sys.argv[1:])]), **results}
    write_results(results, args.results_name or f"fidelity_pusht_{card}.json", args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    main()
