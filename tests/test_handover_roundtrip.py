"""benchmarks/recipes/handover_roundtrip.py (issue 42): the hand-over round trip runs end to end at tiny sizes, and on
real frames the fit it measures with finds the simulator's pose."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

RECIPES = Path(__file__).resolve().parents[1] / "benchmarks" / "recipes"
sys.path[:0] = [str(RECIPES.parent), str(RECIPES)]
import handover_roundtrip  # noqa: E402


@pytest.mark.sim
def test_the_round_trip_runs_on_the_tiny_checkpoint(tmp_path):
    """Two states, two rounds, the VAE decode of the tiny random checkpoint: every round is measured, and lost blocks
    (the random VAE draws no T) are counted, not averaged."""
    pytest.importorskip("gym_pusht")
    from cosmos3_gym.testing import cached_tiny_checkpoint

    results = handover_roundtrip.main([
        "--checkpoint", str(cached_tiny_checkpoint()), "--states", "2", "--rounds", "2", "--decoders", "vae",
        "--push-steps", "3", "--vae-dtype", "float32", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "handover_roundtrip_cpu.json").read_text())
    assert saved["provenance"]["commit"] and saved["provenance"]["hashes"]
    assert saved["image_size"] == [64, 64] and saved["sim_seeds"] == [6_000_000, 6_000_001]
    rounds = results["decoders"]["vae"]["rounds"]
    assert [row["round"] for row in rounds] == [1, 2]
    for row in rounds:
        block = row["against_simulator"]["block_position_px"]
        assert block["n"] + block["missing"] == 2 and row["block_lost"] == block["missing"]
    assert "chunk_last_frame" in results["decoders"]["vae"]
    # The fit's own floor on real 64 x 64 frames (8 table px a pixel): the simulator's pose within 10 px.
    floor = results["fit_floor"]["against_simulator"]
    assert floor["block_position_px"]["n"] == 2 and floor["block_position_px"]["mean"] < 10.0


def test_pose_errors_are_centroid_distances_with_their_sign():
    truth = np.array([[200.0, 200.0, 0.0], [300.0, 100.0, 1.0]])
    moved = truth + [[3.0, -4.0, 0.0], [0.0, 0.0, 0.0]]
    position, angle, shift = handover_roundtrip.pose_errors(moved, truth)
    np.testing.assert_allclose(position, [5.0, 0.0], atol=1e-9)
    np.testing.assert_allclose(angle, [0.0, 0.0], atol=1e-9)
    np.testing.assert_allclose(shift, [[3.0, -4.0], [0.0, 0.0]], atol=1e-9)


def test_summary_leaves_out_and_counts_missing_values():
    result = handover_roundtrip.summary(np.array([1.0, np.nan, 3.0]))
    assert result["mean"] == pytest.approx(2.0) and result["n"] == 2 and result["missing"] == 1
    assert handover_roundtrip.summary(np.array([np.nan]))["n"] == 0
