"""The reward-model score at which a frame counts as a success, fitted on frames whose true success is known.

A reward model trained to regress a task's score (e.g. the covered fraction of a target) shrinks the top of its
range, as regressors do. The built-in model scores the real frames its simulator calls successes (coverage
above 0.95) 0.93 on average and never 0.95 (``benchmarks/reward_model_calibration.py``), so a success threshold of
0.95 on its score would never end an episode. The threshold belongs to the reward model, and is measured:
``success_threshold_table`` gives precision and recall for each candidate, ``fit_success_threshold`` the best by F1,
``calibrate_success_threshold`` fits it on one set of frames and checks it on another (with a fallback where there
is no success to fit on), and ``score_episode_files`` scores the frames of simulated episodes. The built-in model's
training recipe
calibrates each reward model it trains this way, on episodes the model never saw;
``benchmarks/reward_model_calibration.py`` re-checks a model on fresh scripted episodes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InputError

__all__ = [
    "success_threshold_table",
    "fit_success_threshold",
    "calibrate_success_threshold",
    "score_episode_files",
    "DEFAULT_CANDIDATES",
]

DEFAULT_CANDIDATES = tuple(np.round(np.arange(0.80, 0.9951, 0.005), 3))


def _check(scores: Any, successes: Any, need_success: bool = True) -> tuple[np.ndarray, np.ndarray]:
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
    if need_success and not successes.any():
        raise InputError("successes: expected at least one successful frame to calibrate against, got none")
    return scores, successes


def success_threshold_table(
    scores: Any, successes: Any, thresholds: Sequence[float] = DEFAULT_CANDIDATES
) -> list[dict[str, float]]:
    """For each threshold: how many frames ``score >= threshold`` marks, and that rule's precision, recall and F1
    against ``successes`` (the true success of each frame)."""
    scores, successes = _check(scores, successes)
    return [_row(scores, successes, threshold) for threshold in thresholds]


def _row(scores: np.ndarray, successes: np.ndarray, threshold: float) -> dict[str, float]:
    """``success_threshold_table``'s row; without any success, recall and F1 are 0 (nothing to find)."""
    predicted = scores >= threshold
    hits = int((predicted & successes).sum())
    precision = hits / int(predicted.sum()) if predicted.any() else 0.0
    recall = hits / int(successes.sum()) if successes.any() else 0.0
    f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
    return {
        "threshold": float(threshold),
        "predicted": int(predicted.sum()),
        "precision": precision,
        "recall": recall,
        "f1": f1,
    }


def fit_success_threshold(
    scores: Any, successes: Any, thresholds: Sequence[float] = DEFAULT_CANDIDATES
) -> dict[str, float]:
    """The row of ``success_threshold_table`` with the best F1; of equal F1 the higher threshold (fewer false
    successes, which RL in a world model exploits)."""
    rows = success_threshold_table(scores, successes, thresholds)
    return max(rows, key=lambda row: (row["f1"], row["threshold"]))


def calibrate_success_threshold(
    fit_scores: Any,
    fit_successes: Any,
    check_scores: Any = None,
    check_successes: Any = None,
    *,
    fallback: float | None = None,
    min_success_frames: int = 1,
    thresholds: Sequence[float] = DEFAULT_CANDIDATES,
) -> dict[str, Any]:
    """Fit the threshold on one set of frames (``fit_success_threshold``) and measure it on another.

    Returns ``success_threshold`` (the fitted one, or ``fallback``), ``fitted`` (whether it was fitted), ``reason``
    (why not; None when fitted), ``fit`` and ``check``: each set's ``frames`` and ``success_frames`` with the
    precision, recall and F1 of ``score >= success_threshold`` on it (``threshold``, ``predicted``, ``precision``,
    ``recall``, ``f1``); ``check`` is None without check frames, and its recall and F1 are 0 when it holds no success.
    With fewer than ``min_success_frames`` successes among the fit frames there is nothing to fit: the result is
    ``fallback`` with its reason, or ``InputError`` when ``fallback`` is None.
    """
    if isinstance(min_success_frames, bool) or not isinstance(min_success_frames, int) or min_success_frames < 1:
        raise InputError(f"min_success_frames: expected an integer >= 1, got {min_success_frames!r}")
    fit_scores = np.asarray(fit_scores, dtype=np.float64)
    fit = _check(fit_scores, fit_successes, need_success=False) if fit_scores.size else None
    found = int(fit[1].sum()) if fit is not None else 0
    reason = None
    if fit is None:
        reason = "no frames to fit the threshold on"
    elif found < min_success_frames:
        reason = (
            f"{found} success frame{'s' if found != 1 else ''} among the {fit[0].size} fit frames, fewer than "
            f"the {min_success_frames} needed to fit the threshold"
        )
    if reason is not None:
        if fallback is None:
            raise InputError(f"successes: {reason}")
        threshold = float(fallback)
    else:
        assert fit is not None  # no reason: there were frames to fit on
        threshold = fit_success_threshold(*fit, thresholds)["threshold"]
    result: dict[str, Any] = {
        "success_threshold": threshold,
        "fitted": reason is None,
        "reason": None if reason is None else f"{reason}; the fallback {threshold:g} stands",
    }
    for name, scores, successes in (("fit", fit_scores, fit_successes), ("check", check_scores, check_successes)):
        if scores is None or np.asarray(scores).size == 0:
            result[name] = None
            continue
        scores, successes = _check(scores, successes, need_success=False)
        result[name] = {
            "frames": int(scores.size),
            "success_frames": int(successes.sum()),
            **_row(scores, successes, threshold),
        }
    return result


def score_episode_files(
    paths: Sequence[str | os.PathLike], reward_model, *, label_key: str = "coverage", batch_size: int = 256
) -> tuple[np.ndarray, np.ndarray]:
    """Every frame of episode files (``.npz`` with uint8 ``frames [T, H, W, 3]`` and a per-step ``label_key``, as
    a task's dataset generator writes them): (label, ``reward_model.score_frames``) per frame,
    all episodes concatenated (empty arrays for no paths). Frames are scored ``batch_size`` at a time on the reward
    model's device; an episode's frames beyond its labels (or labels beyond its frames) are left out."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
    parameter = next(iter(reward_model.parameters()), None) if isinstance(reward_model, torch.nn.Module) else None
    device = parameter.device if parameter is not None else torch.device("cpu")
    labels, scores = [], []
    for path in paths:
        with np.load(path) as episode:
            frames, episode_labels = episode["frames"], episode[label_key]
        count = min(len(frames), len(episode_labels))
        for start in range(0, count, batch_size):
            batch = torch.from_numpy(frames[start : min(start + batch_size, count)]).to(device)
            with torch.no_grad():
                scores.append(
                    reward_model.score_frames(batch.permute(0, 3, 1, 2).float() / 255).float().cpu().numpy().reshape(-1)
                )
        labels.append(np.asarray(episode_labels[:count]))
    if not labels:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(labels), np.concatenate(scores) if scores else np.zeros(0)
