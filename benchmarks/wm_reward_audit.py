"""How far a reward computed on imagined frames can be trusted (issue 17, item 5): a policy's episodes in the PushT
world model, replayed open loop in gym-pusht, compared chunk by chunk; and which success rule the imagined frames
fool least.

    python benchmarks/wm_reward_audit.py --starts runs/rl_pusht_work/starts.npz --out OUT          # GPU, ~1 min
    python benchmarks/wm_reward_audit.py --device cpu --episodes 64 --chunks 8 --out OUT           # 2 CPU cores, ~4 min

1. ``--episodes`` starts (``DemoStartStates`` of the RL recipe's demonstrations, mid-task states too; without
   ``--starts``, fresh gym-pusht resets from ``--first-seed``); the policy file (default the committed BC policy)
   samples its action chunks (``deterministic=False``, seeded: GRPO's rollouts) for ``--chunks`` chunks in
   ``cosmos3_gym/PushT-v0`` (never terminated, so every chunk is seen).
2. The same chunks are replayed in gym-pusht from the same simulator states (``PushTSimVectorEnv``): the real
   coverage after every chunk, and whether the real episode has succeeded by then (coverage >= 0.95 at any step,
   gym-pusht's rule).
3. Per chunk: the imagined coverage of the rigid T fitted to the imagined frame (``pusht_geometric``: the env's
   score on the decoded frame, and ``fit_tee`` on the 96 x 96 observation with its rigidity) against the real
   coverage (Pearson, MAE); per horizon and success rule (``threshold`` on the fitted coverage, ``min_iou`` on the
   fit's rigidity, ``persist`` consecutive chunks): imagined success rate, real success rate of the same episodes,
   the false-success rate (imagined successes that really failed) and recall (real successes the rule sees).
4. ``--samples K`` > 1: the same action chunks replayed open loop in the world model K - 1 more times with other
   sampling seeds; the comparison of step 3 again on the mean and on the minimum (pessimistic) coverage over the K
   imagined episodes, rigidity likewise: whether disagreement between samples flags the false successes.

Writes ``wm_reward_audit.json`` (card, commit, command) to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from common import add_output_arguments, provenance, write_results  # noqa: E402

REAL_SUCCESS = 0.95  # gym-pusht's success: coverage above this at any step
THRESHOLDS = (0.9, 0.95, 0.98)
MIN_IOUS = (0.0, 0.8, 0.9)
PERSISTS = (1, 2)


def _pearson(a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def rule_fires(coverage: np.ndarray, iou: np.ndarray, threshold: float, min_iou: float, persist: int) -> np.ndarray:
    """bool ``[N, T]``: by chunk t the rule has fired, i.e. for ``persist`` consecutive chunks ending at or before t
    the fitted coverage was >= ``threshold`` with rigidity >= ``min_iou``."""
    hit = (coverage >= threshold) & (iou >= min_iou)
    run = np.zeros_like(hit, dtype=np.int64)
    for t in range(hit.shape[1]):
        run[:, t] = np.where(hit[:, t], (run[:, t - 1] if t else 0) + 1, 0)
    return np.maximum.accumulate(run >= persist, axis=1)


def audit_metrics(imagined_coverage: np.ndarray, imagined_iou: np.ndarray, env_score: np.ndarray,
                  real_coverage: np.ndarray, real_success_by: np.ndarray, horizons: list[int]) -> dict:
    """The comparison of step 3 from ``[N, T]`` arrays (chunk t = after t + 1 chunks)."""
    per_chunk = []
    for t in range(real_coverage.shape[1]):
        live = ~(real_success_by[:, t - 1] if t else np.zeros(len(real_coverage), bool))  # real episode still on
        per_chunk.append({
            "chunk": t + 1, "episodes": int(live.sum()),
            "fit_coverage_pearson": _pearson(imagined_coverage[live, t], real_coverage[live, t]),
            "fit_coverage_mae": float(np.abs(imagined_coverage[live, t] - real_coverage[live, t]).mean()),
            "env_score_pearson": _pearson(env_score[live, t], real_coverage[live, t]),
            "env_score_mae": float(np.abs(env_score[live, t] - real_coverage[live, t]).mean()),
            "mean_rigidity": float(imagined_iou[live, t].mean()),
        })
    rules = []
    for threshold, min_iou, persist in itertools.product(THRESHOLDS, MIN_IOUS, PERSISTS):
        fired = rule_fires(imagined_coverage, imagined_iou, threshold, min_iou, persist)
        for horizon in horizons:
            imagined, real = fired[:, horizon - 1], real_success_by[:, horizon - 1]
            rules.append({
                "threshold": threshold, "min_iou": min_iou, "persist": persist, "horizon": horizon,
                "imagined_success_rate": float(imagined.mean()), "real_success_rate": float(real.mean()),
                "false_success_rate": float((imagined & ~real).sum() / imagined.sum()) if imagined.any() else None,
                "recall": float((imagined & real).sum() / real.sum()) if real.any() else None,
                "agreement": float((imagined == real).mean()),
            })
    return {"per_chunk": per_chunk, "rules": rules}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--policy", default="benchmarks/results/rl/policies/rl_pusht_bc.safetensors")
    parser.add_argument("--starts", default=None, help="DemoStartStates .npz (rl_pusht.py's demos stage)")
    parser.add_argument("--first-seed", type=int, default=300_000, help="fresh gym-pusht resets when no --starts")
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--horizons", default="2,4,8", help="comma-separated chunks at which success is compared")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=2, help="gym-pusht processes")
    parser.add_argument("--num-steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: the model's)")
    parser.add_argument("--samples", type=int, default=1,
                        help="imagined episodes per action sequence (different sampling seeds), for the ensemble")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples: expected an integer >= 1")
    horizons = [int(h) for h in args.horizons.split(",") if h.strip()]
    if not horizons or min(horizons) < 1 or max(horizons) > args.chunks:
        parser.error(f"--horizons: expected chunk counts in 1..{args.chunks}, got {args.horizons!r}")

    from cosmos3_gym.processor import ActionStats
    from cosmos3_gym.rl.policy import load_policy_file
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets, make_pusht_vector_env
    from cosmos3_gym.tasks.pusht.reward import fit_tee
    from cosmos3_gym.tasks.pusht.sim_vector_env import PushTSimVectorEnv
    from cosmos3_gym.tasks.pusht.starts import DemoStartStates

    assets = load_pusht_assets()
    chunk = int(assets.meta.get("chunk", 8))
    image_size = tuple(assets.meta.get("image_size", (256, 256)))
    action_stats = ActionStats.from_json(assets.checkpoint / "action_stats.json", mode="minmax")
    rng = np.random.default_rng(args.seed)
    if args.starts:
        starts = DemoStartStates.load(args.starts)
        indices = rng.choice(len(starts), size=args.episodes, replace=len(starts) < args.episodes)
    else:
        starts = DemoStartStates.from_seeds(range(args.first_seed, args.first_seed + args.episodes), image_size)
        indices = np.arange(args.episodes)
    n, chunks = args.episodes, args.chunks
    # Simulator workers fork before anything touches CUDA.
    sim = PushTSimVectorEnv(n, starts=starts, action_stats=action_stats, group_size=1, chunk=chunk,
                            image_size=image_size, observation_size=(96, 96), max_episode_steps=chunks + 1,
                            workers=args.workers)
    sampling = {key: value for key, value in (("num_steps", args.num_steps), ("guidance_scale", args.guidance_scale))
                if value is not None}
    world = make_pusht_vector_env(n, initial_states=starts, reward_model="pusht_geometric?min_iou=0.0",
                                  success_threshold=None, max_episode_steps=chunks, observation_size=(96, 96),
                                  device=args.device, **sampling)
    policy = load_policy_file(args.policy, device=args.device)
    generator = torch.Generator().manual_seed(args.seed)
    taken = np.zeros((n, chunks, chunk, 2), np.float32)
    fit_coverage, fit_iou, env_score = (np.zeros((n, chunks)) for _ in range(3))
    started = time.perf_counter()
    try:
        observations, _ = world.reset(seed=args.seed, options={"initial_state_index": indices})
        for t in tqdm(range(chunks), desc="world model", unit="chunk"):
            taken[:, t] = policy.act(observations, deterministic=False, generator=generator)
            observations, reward, _, _, info = world.step(taken[:, t])
            env_score[:, t] = np.asarray(info.get("score", reward), float)
            fit = fit_tee(observations["image"])
            fit_coverage[:, t], fit_iou[:, t] = np.asarray(fit.coverage), np.asarray(fit.rigidity)
        # More imagined episodes of the same action sequences: the sampling noise is all that differs.
        ensemble_coverage, ensemble_iou = [fit_coverage], [fit_iou]
        for sample in range(1, args.samples):
            coverage, iou = np.zeros((n, chunks)), np.zeros((n, chunks))
            observations, _ = world.reset(seed=args.seed + sample, options={"initial_state_index": indices})
            for t in tqdm(range(chunks), desc=f"world model, sample {sample + 1}", unit="chunk"):
                observations, *_ = world.step(taken[:, t])
                fit = fit_tee(observations["image"])
                coverage[:, t], iou[:, t] = np.asarray(fit.coverage), np.asarray(fit.rigidity)
            ensemble_coverage.append(coverage)
            ensemble_iou.append(iou)
        world_s = time.perf_counter() - started
        real_coverage, real_success_by = np.zeros((n, chunks)), np.zeros((n, chunks), bool)
        _, info = sim.reset(seed=0, options={"initial_state_index": indices})
        done = np.zeros(n, bool)
        last = np.asarray(info["coverage"], float)
        for t in range(chunks):
            _, _, terminated, _, info = sim.step(taken[:, t])
            done |= np.asarray(terminated)  # gym-pusht's success (any step of the chunk) ends the real episode
            last = np.where(done & ~np.asarray(terminated), last, np.asarray(info["coverage"], float))
            real_coverage[:, t], real_success_by[:, t] = last, done
    finally:
        world.close()
        sim.close()
    report = {
        "what": "imagined vs replayed-real PushT episodes of one policy: per chunk and per success rule",
        "settings": {key: value for key, value in vars(args).items()},
        "policy": args.policy, "real_success_threshold": REAL_SUCCESS, "world_model_s": world_s,
        **audit_metrics(fit_coverage, fit_iou, env_score, real_coverage, real_success_by, horizons),
        "provenance": provenance(),
    }
    if args.samples > 1:
        coverage, iou = np.stack(ensemble_coverage), np.stack(ensemble_iou)
        report["ensemble"] = {
            "samples": args.samples,
            "mean_coverage_spread": float(coverage.std(axis=0).mean()),
            "mean": audit_metrics(coverage.mean(0), iou.mean(0), coverage.mean(0), real_coverage, real_success_by,
                                  horizons),
            "pessimistic": audit_metrics(coverage.min(0), iou.min(0), coverage.min(0), real_coverage,
                                         real_success_by, horizons),
        }
    write_results(report, "wm_reward_audit.json", args.out, args.overwrite, args=args)
    for rule in report["rules"]:
        if rule["persist"] == 1 and rule["min_iou"] == 0.8 or rule["threshold"] == 0.95:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rule.items()})
    return report


if __name__ == "__main__":
    main()
