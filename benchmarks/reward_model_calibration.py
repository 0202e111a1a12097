"""How well a PushT reward model sees success: its score against gym-pusht's true coverage, frame by frame.

The env ends an episode when the reward model's score reaches the checkpoint's ``success_threshold``
(``checkpoint/meta.json``). This simulates episodes in gym-pusht (default: the scripted pusher at its four noise levels,
which succeeds in most of them) in two seed sets, scores every frame, and reports the score per coverage bin and, per
threshold, the precision and recall of ``score >= threshold`` for gym-pusht's success (coverage > 0.95). The threshold
with the best F1 on the first set (``cosmos3_gym.rewards.calibration.calibrate_success_threshold``) is checked on the
second, next to the checkpoint's own; ``--write`` puts it into the checkpoint's meta.json. ``train_pusht.py`` already
calibrates the threshold of every reward model it trains, the same way, on real episodes that model never saw (its
``success_threshold`` stage); this re-checks a model on scripted episodes of other seeds, or sets the threshold of a
reward model trained elsewhere. CPU, under a minute:

    python benchmarks/reward_model_calibration.py --out OUT [--write]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.rewards.calibration import (  # noqa: E402
    calibrate_success_threshold,
    score_episode_files,
    success_threshold_table,
)

COVERAGE_BINS = (0.0, 0.5, 0.8, 0.9, 0.95, 1.01)


def score_dataset(dataset: Path, reward_model) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of a ``generate_pusht_dataset`` folder: (true coverage, reward-model score)."""
    return score_episode_files(sorted((dataset / "episodes").glob("episode_*.npz")), reward_model)


def coverage_bins(coverage: np.ndarray, scores: np.ndarray) -> list[dict]:
    rows = []
    for low, high in zip(COVERAGE_BINS[:-1], COVERAGE_BINS[1:]):
        inside = (coverage >= low) & (coverage < high)
        if inside.any():
            rows.append({"coverage": [low, min(high, 1.0)], "frames": int(inside.sum()),
                         "score_mean": float(scores[inside].mean()), "score_max": float(scores[inside].max())})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the built-in one)")
    parser.add_argument("--episodes", type=int, default=48, help="episodes per seed set")
    parser.add_argument("--steps", type=int, default=128, help="steps per episode")
    parser.add_argument("--policy", default="scripted", help="generate_pusht_dataset's policy family for every episode")
    parser.add_argument("--fit-seed", type=int, default=777)
    parser.add_argument("--check-seed", type=int, default=778)
    parser.add_argument("--workers", type=int, default=2, help="gym-pusht processes")
    parser.add_argument("--results-name", default="reward_model_calibration_cpu.json")
    parser.add_argument("--write", action="store_true",
                        help="set the checkpoint's success_threshold (checkpoint/meta.json) to the fitted one")
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.steps < 1:
        parser.error("--episodes and --steps: expected integers >= 1")
    check_results_target(args.results_name, args.out, args.overwrite)

    from cosmos3_gym.rewards import ClassifierRewardModel
    from cosmos3_gym.tasks.pusht import episodes as pusht
    from cosmos3_gym.tasks.pusht import geometry as pusht_geometry
    from cosmos3_gym.tasks.pusht.env import META_FILE, REWARD_MODEL_DIR, load_pusht_assets

    assets = load_pusht_assets(args.assets)
    reward_model = ClassifierRewardModel.load(assets.root / REWARD_MODEL_DIR).eval()
    checkpoint_threshold = float(assets.meta["success_threshold"])
    work = Path(tempfile.mkdtemp())
    seeds, sets = {"fit": args.fit_seed, "check": args.check_seed}, {}
    for name, seed in seeds.items():
        dataset = pusht.generate_pusht_dataset(
            work / name, args.episodes, steps_per_episode=args.steps, image_size=tuple(assets.meta["image_size"]),
            policy_mix={args.policy: 1.0}, seed=seed, workers=args.workers, progress=False)
        coverage, scores = score_dataset(dataset, reward_model)
        sets[name] = (coverage, scores, coverage > pusht_geometry.SUCCESS_COVERAGE)
    calibration = calibrate_success_threshold(sets["fit"][1], sets["fit"][2], sets["check"][1], sets["check"][2])
    fitted = calibration["fit"]
    results = {"provenance": provenance(), "assets": str(assets.root), "policy": args.policy,
               "checkpoint_success_threshold": checkpoint_threshold, "fitted_on_fit_set": fitted, "sets": {}}
    for name, (coverage, scores, successes) in sets.items():
        table = success_threshold_table(scores, successes)
        at = {f"{t:g}": success_threshold_table(scores, successes, [t])[0]
              for t in sorted({checkpoint_threshold, fitted["threshold"], pusht_geometry.SUCCESS_COVERAGE})}
        results["sets"][name] = {"seed": seeds[name],
                                 "frames": int(len(scores)), "success_frames": int(successes.sum()),
                                 "coverage_bins": coverage_bins(coverage, scores), "at": at, "table": table}
        print(f"{name}: {len(scores)} frames, {int(successes.sum())} successes; score on them mean "
              f"{scores[successes].mean():.3f}, max {scores[successes].max():.3f}")
        for key, row in at.items():
            print(f"  threshold {key}: precision {row['precision']:.2f} recall {row['recall']:.2f} F1 {row['f1']:.2f}")
    if args.write:
        meta = {**assets.meta, "success_threshold": fitted["threshold"]}
        (assets.checkpoint / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        print(f"success_threshold {checkpoint_threshold:g} -> {fitted['threshold']:g} in "
              f"{assets.checkpoint / META_FILE}")
    write_results(results, args.results_name, args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    main()
