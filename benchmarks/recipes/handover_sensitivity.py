"""How fast does PushT itself amplify a small hand-over error? gym-pusht replaying held-out episodes with the state
disturbed at every chunk boundary, no world model anywhere.

    python benchmarks/recipes/handover_sensitivity.py --out $OUT        # 2-core CPU: about a minute

Issue 42 asks for a block error of at most 8 px at chunk 8 of an open-loop replay (the held-out protocol of
``pusht_fidelity_targets.py``: the episode's recorded actions replayed from its first frame). The world model's
restart oracle (one chunk from the true frame) is 2-3 px off after one chunk; the rollout 19 px after eight. How much
of that growth is the model compounding its own errors and how much is the task: a push that lands a few pixels off
turns the block the other way, and from then on the recorded actions push a block that is somewhere else?

Here a *perfect* model is simulated, with one kind of hand-over error each, on the held-out protocol's own episodes
(dataset seed ``--heldout-seed``, the same 32 episodes x 16 chunks): gym-pusht restores the episode's first state
and steps its recorded actions; at the end of each chunk the state is changed as a one-frame hand-over could change
it, then stepping goes on. Variants (``VARIANTS``):

* ``exact``: the state restored exactly at every boundary (``PushTSim.restore``): what pymunk's contact caches, which
  the state leaves out, contribute; the floor of this measurement.
* ``no_velocity``: agent and block velocities zeroed at every boundary: what a model conditioned on one frame cannot
  see (a frame shows no velocity); ``no_agent_velocity`` / ``no_block_velocity``: only the agent's / the block's.
* ``block_noise_S``: the block's position moved by N(0, S^2) px per axis (table px of 512) and its angle by N(0, S^2)
  degrees at every boundary (mean displacement 1.25 S): a model whose every chunk is S px off, independently.
* ``block_noise_S_once``: the same disturbance after chunk 1 only: how the task alone grows one error.

**Velocity from the action history.** What would let a one-frame model know the agent's velocity: a least-squares fit
of the agent's velocity at each step on its position and its last H actions (and a constant), fitted on the episodes
of dataset seed ``--fit-seed`` (training data of no model; policy_pools.json's notes name it) and scored on the
held-out ones: the residual's root mean square against the velocity's, per H (``VELOCITY_HISTORY``).

The block error per chunk (at its end, before that boundary's disturbance: chunk k has k - 1 behind it) is the T's
area-centroid distance (px) and angle difference (deg) against the recorded episode, mean and 95 % t interval over
episodes (``fidelity_pusht_chunks.mean_ci95``), with the disturbances drawn from ``--seed`` (the same draws for every
variant of one S). Writes ``handover_sensitivity_cpu.json`` (card, commit,
command) to ``--out`` (default ``$OUT``, else benchmarks/results/fidelity).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

from common import add_output_arguments, check_results_target, write_results  # noqa: E402
from fidelity_pusht_chunks import mean_ci95  # noqa: E402
from pusht_fidelity_targets import pose_errors  # noqa: E402

from cosmos3_gym.tasks.pusht import episodes as pusht  # noqa: E402

RESULTS_NAME = "handover_sensitivity_cpu.json"
TOPIC = "fidelity"
NOISE_LEVELS_PX = (1.0, 2.0, 4.0)
VELOCITY_HISTORY = (1, 2, 3, 4, 8)


def disturb(state: np.ndarray, variant: str, chunk_index: int, rng: np.random.Generator) -> np.ndarray:
    """The state after a hand-over of ``variant`` at the end of chunk ``chunk_index`` (0-based)."""
    state = state.copy()
    if variant in ("no_velocity", "no_agent_velocity"):
        state[[2, 3]] = 0.0
    if variant in ("no_velocity", "no_block_velocity"):
        state[[7, 8, 9]] = 0.0
    elif variant.startswith("block_noise_"):
        level = float(variant.split("_")[2])
        draw = rng.normal(0.0, level, 3)  # drawn at every boundary, so that the stream does not depend on "_once"
        if not variant.endswith("_once") or chunk_index == 0:
            state[4:6] += draw[:2]
            state[6] += np.radians(draw[2])
    return state


def replay(sim, states: np.ndarray, actions: np.ndarray, chunk: int, variant: str,
           rng: np.random.Generator) -> np.ndarray:
    """Block poses ``[K, 3]`` at the end of each chunk of ``actions [K * chunk, 2]`` from ``states[0]``."""
    sim.restore(states[0])
    poses = []
    for k in range(len(actions) // chunk):
        for action in actions[k * chunk : (k + 1) * chunk]:
            sim.step(action)
        state = sim.sim_state
        poses.append(state[4:7].copy())
        sim.restore(disturb(state, variant, k, rng))
    return np.asarray(poses)


def velocity_features(episodes, history: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step t >= history: [agent x, y, the last ``history`` actions (newest first), 1] and the agent's velocity."""
    features, velocities = [], []
    for states, actions in episodes:
        for t in range(history, len(actions)):
            features.append(np.concatenate([states[t, 0:2], actions[t - history : t][::-1].ravel(), [1.0]]))
            velocities.append(states[t, 2:4])
    return np.asarray(features), np.asarray(velocities)


def velocity_from_history(fit_episodes, episodes) -> dict[str, dict[str, float]]:
    """Per H: the held-out residual of the linear fit of the agent's velocity (module docstring)."""
    out = {}
    for history in VELOCITY_HISTORY:
        x, y = velocity_features(fit_episodes, history)
        weights, *_ = np.linalg.lstsq(x, y, rcond=None)
        x, y = velocity_features(episodes, history)
        residual = y - x @ weights
        out[str(history)] = {"velocity_rms_px_s": float(np.sqrt((y**2).mean())),
                             "residual_rms_px_s": float(np.sqrt((residual**2).mean()))}
    return out


def load_episodes(seed: int, count: int, steps: int, workers) -> list[tuple[np.ndarray, np.ndarray]]:
    """(sim_states, actions) of ``count`` episodes of ``generate_pusht_dataset(seed=seed)`` (frames at the built-in
    model's 256 x 256: frame-reading policies in the mix act on them)."""
    dataset = pusht.generate_pusht_dataset(Path(tempfile.mkdtemp()) / "episodes", count, steps_per_episode=steps,
                                           image_size=(256, 256), seed=seed, workers=workers, progress=False)
    episodes = []
    for path in sorted((dataset / "episodes").glob("episode_*.npz"))[:count]:
        with np.load(path) as archive:
            episodes.append((archive["sim_states"], archive["actions"]))
    return episodes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout-seed", type=int, default=4_900_000,
                        help="dataset seed of the held-out episodes (pusht_fidelity_targets.py's default)")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=8, help="actions per chunk (the built-in model's)")
    parser.add_argument("--seed", type=int, default=0, help="of the disturbances")
    parser.add_argument("--fit-seed", type=int, default=103, help="dataset seed of the velocity fit's episodes")
    parser.add_argument("--fit-episodes", type=int, default=64)
    parser.add_argument("--workers", type=int, default=None, help="simulation processes for the episodes")
    parser.add_argument("--results-name", default=RESULTS_NAME)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    check_results_target(args.results_name, args.out, args.overwrite)

    started = time.perf_counter()
    steps = args.chunks * args.chunk
    episodes = load_episodes(args.heldout_seed, args.episodes, steps, args.workers)
    velocity = velocity_from_history(load_episodes(args.fit_seed, args.fit_episodes, steps, args.workers), episodes)

    variants = ["exact", "no_velocity", "no_agent_velocity", "no_block_velocity",
                *(f"block_noise_{s:g}{once}" for s in NOISE_LEVELS_PX for once in ("", "_once"))]
    sim = pusht.PushTSim((96, 96), render_every_step=False)
    per_variant = {}
    try:
        for variant in variants:
            rng = np.random.default_rng(args.seed)
            position, angle = [], []
            for states, actions in episodes:
                truth = states[args.chunk :: args.chunk][: args.chunks, 4:7]  # the recorded episode's poses
                poses = replay(sim, states, actions, args.chunk, variant, rng)
                p, a = pose_errors(poses, truth)
                position.append(p)
                angle.append(a)
            position, angle = np.asarray(position), np.asarray(angle)
            per_variant[variant] = {
                "block_position_error_px": [mean_ci95(position[:, k]) for k in range(args.chunks)],
                "block_angle_error_deg": [mean_ci95(angle[:, k]) for k in range(args.chunks)],
            }
    finally:
        sim.close()

    results = {"heldout_seed": args.heldout_seed, "num_episodes": len(episodes), "num_chunks": args.chunks,
               "chunk": args.chunk, "seed": args.seed, "variants": per_variant,
               "fit_seed": args.fit_seed, "fit_episodes": args.fit_episodes, "agent_velocity_from_history": velocity,
               "seconds": time.perf_counter() - started}
    write_results(results, args.results_name, args.out, args.overwrite, topic=TOPIC)
    shown = (1, 3, 7, 11, 15)
    print(f"block position error (px) at chunks {[k + 1 for k in shown]}")
    for variant, entry in per_variant.items():
        row = ", ".join(f"{entry['block_position_error_px'][k]['mean']:.1f}" for k in shown if k < args.chunks)
        print(f"  {variant:22s} {row}")
    print("agent velocity from position + last H actions, held-out residual rms / velocity rms: " + ", ".join(
        f"H={h} {v['residual_rms_px_s'] / v['velocity_rms_px_s']:.2%}" for h, v in velocity.items()))
    return results


if __name__ == "__main__":
    main()
