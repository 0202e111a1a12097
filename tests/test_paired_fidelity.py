"""benchmarks/recipes/paired_fidelity.py: two models' held-out errors compared episode by episode."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

RECIPES = Path(__file__).resolve().parents[1] / "benchmarks" / "recipes"
sys.path[:0] = [str(RECIPES.parent), str(RECIPES)]
import paired_fidelity  # noqa: E402
import pusht_fidelity_targets as targets  # noqa: E402


def run(seed: int, position: np.ndarray, untouched: np.ndarray, decoder: str = "light") -> dict:
    """A pusht_fidelity_targets.py result with the per-episode values only (``[N, K]`` each, NaN: no value)."""
    count, chunks = position.shape
    return {"heldout_seed": seed, "decoder": decoder,
            "heldout": {"num_episodes": count, "num_chunks": chunks, "chunk": 8,
                        "per_episode": {"block_position_error_px_rollout": targets.json_matrix(position),
                                        "block_angle_error_deg_rollout": targets.json_matrix(position / 2)}},
            "any_action": {"num_episodes": len(untouched), "num_chunks": untouched.shape[1], "chunk": 8,
                           "untouched": {"per_episode_block_displacement_error_px": targets.json_matrix(untouched)}}}


def test_json_matrix_writes_missing_values_as_null():
    assert targets.json_matrix(np.array([[1.234, np.nan], [np.inf, 2.0]])) == [[1.23, None], [None, 2.0]]


def test_the_paired_difference_cancels_the_spread_between_episodes():
    rng = np.random.default_rng(0)
    # Episodes of very different difficulty (0-60 px); the variant is 2 px better on every one, give or take 0.5.
    hardness = rng.uniform(0, 60, size=(40, 4))
    base = hardness
    variant = hardness - 2.0 + rng.normal(0, 0.5, size=hardness.shape)
    untouched = rng.uniform(0, 10, size=(40, 4))
    baseline = [run(1, base[:20], untouched[:20]), run(2, base[20:], untouched[20:])]
    variants = [run(2, variant[20:], untouched[20:] + 1), run(1, variant[:20], untouched[:20] + 1)]  # either order
    pairs = paired_fidelity.pair_runs(baseline, variants)
    result = paired_fidelity.compare(pairs)
    assert result["num_episodes"] == 40  # two seeds pooled, each variant run matched to its seed's baseline
    chunk = result["per_chunk"]["block_position_error_px"][1]
    difference = chunk["variant_minus_baseline"]
    assert difference["n"] == 40
    assert difference["mean"] == pytest.approx(float((variant - base)[:, 1].mean()), abs=0.01)
    # paired: an interval of a fraction of a pixel, where either model's own spans tens of pixels
    assert -2.5 < difference["ci95_low"] < difference["mean"] < difference["ci95_high"] < -1.5
    assert chunk["baseline"]["ci95_high"] - chunk["baseline"]["ci95_low"] > 10
    whole = result["whole_episode"]["block_position_error_px"]["variant_minus_baseline"]
    assert whole["mean"] == pytest.approx(float((variant - base).mean()), abs=0.01)  # rounding to 2 decimals
    angle = result["per_chunk"]["block_angle_error_deg"][0]["variant_minus_baseline"]
    assert angle["mean"] == pytest.approx(float((variant - base)[:, 0].mean() / 2), abs=0.01)
    assert result["untouched_block_displacement_error_px"]["variant_minus_baseline"]["mean"] == pytest.approx(1.0)


def test_episodes_without_a_value_in_either_model_drop_out_of_that_comparison():
    base = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    variant = base + 1.0
    variant[0, 1] = np.nan  # the variant lost the block in episode 0's second chunk
    untouched = np.array([[np.nan, 1.0], [np.nan, np.nan], [2.0, 4.0]])  # episode 1: every chunk touched
    result = paired_fidelity.compare(paired_fidelity.pair_runs([run(1, base, untouched)], [run(1, variant, untouched)]))
    second = result["per_chunk"]["block_position_error_px"][1]
    assert second["variant_minus_baseline"]["n"] == 2
    assert second["baseline"]["mean"] == pytest.approx(25.0)  # episodes 1 and 2 only, for both models
    # whole episode: episode 0 of the variant is its mean over the chunk it has (2.0) against the baseline's 5.5
    whole = result["whole_episode"]["block_position_error_px"]["variant_minus_baseline"]
    assert whole["mean"] == pytest.approx(((2.0 - 5.5) + 1.0 + 1.0) / 3)
    untouched_result = result["untouched_block_displacement_error_px"]["variant_minus_baseline"]
    assert untouched_result["n"] == 2 and untouched_result["mean"] == 0.0


def test_runs_on_different_episodes_are_refused():
    values = np.ones((4, 2))
    with pytest.raises(SystemExit, match="held-out seeds"):
        paired_fidelity.pair_runs([run(1, values, values)], [run(2, values, values)])
    with pytest.raises(SystemExit, match="decoder"):
        paired_fidelity.pair_runs([run(1, values, values)], [run(1, values, values, decoder="vae")])
    with pytest.raises(SystemExit, match="heldout episodes"):
        paired_fidelity.pair_runs([run(1, values, values)], [run(1, np.ones((5, 2)), values)])
    with pytest.raises(SystemExit, match="per-episode"):
        paired_fidelity.per_episode({"heldout": {}, "any_action": {}}, "--baseline")


def test_the_command_line_writes_the_comparison(tmp_path, capsys):
    base = np.array([[1.0, 4.0], [2.0, 6.0], [3.0, 5.0]])
    for name, values in (("a.json", base), ("b.json", base + 0.5)):
        (tmp_path / name).write_text(json.dumps(run(7, values, values)))
    paired_fidelity.main(["--baseline", str(tmp_path / "a.json"), "--variant", str(tmp_path / "b.json"),
                                   "--chunks", "2", "--name", "paired.json", "--out", str(tmp_path)])
    assert "block_position_error_px chunk 2" in capsys.readouterr().out
    written = json.loads((tmp_path / "paired.json").read_text())
    assert written["baseline"] == ["a.json"] and written["variant"] == ["b.json"]
    difference = written["per_chunk"]["block_position_error_px"][1]["variant_minus_baseline"]
    assert difference["mean"] == pytest.approx(0.5) and not math.isnan(difference["ci95_low"])
