"""The reward-model score at which a frame counts as a success, fitted on frames whose true success is known.

A reward model trained to regress a task's score (PushT: the covered fraction of the target) shrinks the top of its
range, as regressors do. The built-in PushT model scores the real frames that gym-pusht calls successes (coverage
above 0.95) 0.93 on average and never 0.95 (``benchmarks/reward_model_calibration.py``), so a success threshold of
0.95 on its score would never end an episode. The threshold belongs to the reward model, and is measured:
``success_threshold_table`` gives precision and recall for each candidate, ``fit_success_threshold`` the best by F1.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import InputError

__all__ = ["success_threshold_table", "fit_success_threshold", "DEFAULT_CANDIDATES"]

DEFAULT_CANDIDATES = tuple(np.round(np.arange(0.80, 0.9951, 0.005), 3))


def _check(scores: Any, successes: Any) -> tuple[np.ndarray, np.ndarray]:
    scores = np.asarray(scores, dtype=np.float64)
    successes = np.asarray(successes)
    if scores.ndim != 1 or scores.size == 0:
        raise InputError(f"scores: expected a non-empty 1-D array of reward-model scores, got shape {scores.shape}")
    if successes.shape != scores.shape:
        raise InputError(f"successes: expected one flag per score, shape {scores.shape}, got {successes.shape}")
    if not np.isfinite(scores).all():
        raise InputError("scores: expected finite values, got NaN or inf")
    if successes.dtype != np.bool_:
        if not np.isin(successes, (0, 1)).all():
            raise InputError("successes: expected booleans (or 0 / 1)")
        successes = successes.astype(bool)
    if not successes.any():
        raise InputError("successes: expected at least one successful frame to calibrate against, got none")
    return scores, successes


def success_threshold_table(scores: Any, successes: Any,
                            thresholds: Sequence[float] = DEFAULT_CANDIDATES) -> list[dict[str, float]]:
    """For each threshold: how many frames ``score >= threshold`` marks, and that rule's precision, recall and F1
    against ``successes`` (the true success of each frame)."""
    scores, successes = _check(scores, successes)
    rows = []
    for threshold in thresholds:
        predicted = scores >= threshold
        hits = int((predicted & successes).sum())
        precision = hits / int(predicted.sum()) if predicted.any() else 0.0
        recall = hits / int(successes.sum())
        f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
        rows.append({"threshold": float(threshold), "predicted": int(predicted.sum()), "precision": precision,
                     "recall": recall, "f1": f1})
    return rows


def fit_success_threshold(scores: Any, successes: Any,
                          thresholds: Sequence[float] = DEFAULT_CANDIDATES) -> dict[str, float]:
    """The row of ``success_threshold_table`` with the best F1; of equal F1 the higher threshold (fewer false
    successes, which RL in a world model exploits)."""
    rows = success_threshold_table(scores, successes, thresholds)
    return max(rows, key=lambda row: (row["f1"], row["threshold"]))
