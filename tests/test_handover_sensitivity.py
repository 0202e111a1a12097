"""benchmarks/recipes/handover_sensitivity.py (issue 42): gym-pusht's own amplification of a hand-over error, on a
few short episodes: exact restores add nothing, disturbances show up in the block error, and the agent's velocity is
recovered from its position and its last actions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

RECIPES = Path(__file__).resolve().parents[1] / "benchmarks" / "recipes"
sys.path[:0] = [str(RECIPES.parent), str(RECIPES)]
import handover_sensitivity  # noqa: E402


def test_disturbances_change_what_they_name():
    state = np.arange(10, dtype=np.float64) + 1.0
    rng = np.random.default_rng(0)
    assert np.array_equal(handover_sensitivity.disturb(state, "exact", 0, rng), state)
    agent = handover_sensitivity.disturb(state, "no_agent_velocity", 0, rng)
    assert agent[2:4].tolist() == [0.0, 0.0] and np.array_equal(np.delete(agent, [2, 3]), np.delete(state, [2, 3]))
    block = handover_sensitivity.disturb(state, "no_block_velocity", 0, rng)
    assert block[7:].tolist() == [0.0] * 3 and np.array_equal(block[:7], state[:7])
    moved = handover_sensitivity.disturb(state, "block_noise_2", 3, rng)
    assert not np.array_equal(moved[4:7], state[4:7]) and np.array_equal(np.delete(moved, [4, 5, 6]),
                                                                          np.delete(state, [4, 5, 6]))
    # "_once": only after the first chunk, with the same draws as every boundary's
    assert np.array_equal(handover_sensitivity.disturb(state, "block_noise_2_once", 3, rng), state)
    assert not np.array_equal(handover_sensitivity.disturb(state, "block_noise_2_once", 0, rng)[4:7], state[4:7])


@pytest.mark.sim
def test_the_measurement_runs_on_a_few_episodes(tmp_path):
    pytest.importorskip("gym_pusht")
    results = handover_sensitivity.main(["--episodes", "3", "--chunks", "3", "--fit-episodes", "4", "--workers", "0",
                                         "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "handover_sensitivity_cpu.json").read_text())
    assert saved["provenance"]["commit"] and saved["num_episodes"] == 3
    variants = results["variants"]
    exact = [entry["mean"] for entry in variants["exact"]["block_position_error_px"]]
    noisy = [entry["mean"] for entry in variants["block_noise_4"]["block_position_error_px"]]
    assert len(exact) == 3 and max(exact) < 1.0  # restoring the state exactly changes (almost) nothing
    assert noisy[0] < 1.0 < 2.0 < noisy[1]  # chunk 1 precedes the first disturbance (N(0, 16) px per axis: ~5 px)
    velocity = results["agent_velocity_from_history"]
    ratios = [velocity[h]["residual_rms_px_s"] / velocity[h]["velocity_rms_px_s"] for h in ("1", "4")]
    assert ratios[1] < 0.05 < ratios[0] or ratios[1] < ratios[0] / 5
