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

The block error per chunk is the T's area-centroid distance (px) and angle difference (deg) against the undisturbed
replay, mean and 95 % t interval over episodes (``fidelity_pusht_chunks.mean_ci95``), with the disturbances drawn
from ``--seed`` (the same draws for every variant of one S). Writes ``handover_sensitivity_cpu.json`` (card, commit,
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heldout-seed", type=int, default=4_900_000,
                        help="dataset seed of the held-out episodes (pusht_fidelity_targets.py's default)")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=8, help="actions per chunk (the built-in model's)")
    parser.add_argument("--seed", type=int, default=0, help="of the disturbances")
    parser.add_argument("--workers", type=int, default=None, help="simulation processes for the episodes")
    parser.add_argument("--results-name", default=RESULTS_NAME)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    check_results_target(args.results_name, args.out, args.overwrite)

    started = time.perf_counter()
    steps = args.chunks * args.chunk
    dataset = pusht.generate_pusht_dataset(Path(tempfile.mkdtemp()) / "heldout", args.episodes,
                                           steps_per_episode=steps, image_size=(256, 256), seed=args.heldout_seed,
                                           workers=args.workers, progress=False)
    episodes = []
    for path in sorted((dataset / "episodes").glob("episode_*.npz"))[: args.episodes]:
        with np.load(path) as archive:
            episodes.append((archive["sim_states"], archive["actions"]))

    variants = ["exact", "no_velocity", "no_agent_velocity", "no_block_velocity", *(f"block_noise_{s:g}{once}" for s in NOISE_LEVELS_PX for once in ("", "_once"))]
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
               "seconds": time.perf_counter() - started}
    write_results(results, args.results_name, args.out, args.overwrite, topic=TOPIC)
    shown = (1, 3, 7, 11, 15)
    print(f"block position error (px) at chunks {[k + 1 for k in shown]}")
    for variant, entry in per_variant.items():
        row = ", ".join(f"{entry['block_position_error_px'][k]['mean']:.1f}" for k in shown if k < args.chunks)
        print(f"  {variant:22s} {row}")
    return results


if __name__ == "__main__":
    main()
