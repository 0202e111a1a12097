"""benchmarks/recipes/success_visibility_pusht.py: gym-pusht's success at any step against success at chunk ends."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

RECIPES = Path(__file__).resolve().parents[1] / "benchmarks" / "recipes"
sys.path[:0] = [str(RECIPES.parent), str(RECIPES)]
import success_visibility_pusht as recipe  # noqa: E402


def test_success_between_chunk_ends_is_counted_at_any_step_only():
    chunk = 4
    coverage = np.zeros((3, 2 * chunk + 1))
    coverage[0, 2] = 0.97  # mid-chunk, gone by the chunk's end
    coverage[1, 4:] = 0.97  # from the end of chunk 1 on
    result = recipe.visibility(coverage, chunk)  # episode 2 never succeeds
    assert result["success_rate_any_step"] == pytest.approx(2 / 3)
    assert result["success_rate_at_chunk_ends"] == pytest.approx(1 / 3)
    assert result["visible_share"] == pytest.approx(0.5)
    low, high = result["success_rate_at_chunk_ends_interval"]
    assert low < 1 / 3 < high
