"""benchmarks/wm_reward_audit.py: the success rules and the imagined-vs-real comparison it reports."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import wm_reward_audit
finally:
    sys.path.pop(0)


def test_rule_fires_needs_threshold_rigidity_and_persistence_and_stays_fired():
    coverage = np.array([[0.96, 0.50, 0.97, 0.97, 0.10],
                         [0.96, 0.96, 0.10, 0.10, 0.10],
                         [0.99, 0.99, 0.99, 0.99, 0.99]])
    iou = np.array([[0.9] * 5, [0.9] * 5, [0.5] * 5])  # the third episode's block is not a rigid T
    once = wm_reward_audit.rule_fires(coverage, iou, threshold=0.95, min_iou=0.8, persist=1)
    np.testing.assert_array_equal(once, [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    twice = wm_reward_audit.rule_fires(coverage, iou, threshold=0.95, min_iou=0.8, persist=2)
    np.testing.assert_array_equal(twice, [[0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    any_shape = wm_reward_audit.rule_fires(coverage, iou, threshold=0.95, min_iou=0.0, persist=1)
    assert any_shape[2].all()


def test_audit_metrics_count_false_successes_and_recall():
    # 4 episodes, 2 chunks. Imagined: episodes 0 and 1 reach 0.99 at chunk 2; real: only episodes 0 and 2 succeed.
    imagined = np.array([[0.5, 0.99], [0.5, 0.99], [0.2, 0.3], [0.1, 0.2]])
    iou = np.ones_like(imagined)
    real_coverage = np.array([[0.6, 0.96], [0.4, 0.5], [0.5, 0.97], [0.1, 0.1]])
    real_success = real_coverage >= 0.95
    report = wm_reward_audit.audit_metrics(imagined, iou, imagined, real_coverage, real_success, horizons=[1, 2])
    rule = next(r for r in report["rules"] if (r["threshold"], r["min_iou"], r["persist"], r["horizon"]) ==
                (0.95, 0.0, 1, 2))
    assert rule["imagined_success_rate"] == 0.5 and rule["real_success_rate"] == 0.5
    assert rule["false_success_rate"] == 0.5  # episode 1: imagined success, real failure
    assert rule["recall"] == 0.5  # episode 2's real success is not seen
    assert rule["agreement"] == 0.5
    first = report["rules"][0]
    assert first["horizon"] == 1 and first["false_success_rate"] is None  # nothing imagined by chunk 1
    chunk1, chunk2 = report["per_chunk"]
    assert chunk1["episodes"] == 4 and chunk2["episodes"] == 4  # nobody had succeeded before chunk 2
    np.testing.assert_allclose(chunk1["fit_coverage_pearson"], np.corrcoef(imagined[:, 0], real_coverage[:, 0])[0, 1])
    np.testing.assert_allclose(chunk2["fit_coverage_mae"], np.abs(imagined[:, 1] - real_coverage[:, 1]).mean())
