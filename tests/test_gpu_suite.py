"""benchmarks/gpu_suite.py's fp8 variant on the CPU: FP8 itself needs a Hopper GPU, so the dry run sends a bf16
stand-in twin down the same path; it must reproduce the engine it was copied from, fill every column, and record a
failing section in its place while the others still run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import gpu_suite
    from common import gen_twin
finally:
    sys.path.pop(0)

pytest.importorskip("diffusers")


def test_only_fp8_tiny_runs_the_fp8_columns_through_a_bf16_stand_in(tmp_path):
    results = gpu_suite.main(["--tiny", "--only-fp8", "--env-counts", "1,2,16", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_suite_fp8_tiny.json").read_text())["fp8"] == json.loads(
        json.dumps(results["fp8"], default=str))
    # --only-fp8: the policy request is the one mode; no eager env or GEN tables, no bf16 check.
    assert list(results["request_latency_tier480"]) == ["policy"]
    assert "gen_forward" not in results and "bf16_vs_fp32_nano_width_4_layers" not in results
    fp8 = results["fp8"]
    assert "no CUDA device" in fp8["skipped"]
    entry = fp8["bf16_stand_in"]
    assert "error" not in json.dumps(entry)
    assert entry["fp8_linears"] == 0 and entry["fp8_linears_of_the_default_policy"] > 0
    # The stand-in twin is the engine's own weights: the same request gives the same actions and latents.
    assert entry["action_rel_vs_bf16"] < 1e-6 and entry["video_latents_rel_vs_bf16"] < 1e-6
    request = entry["policy_request_tier480"]
    diffusers = results["request_latency_tier480"]["policy"]
    assert entry["speedup_no_decode_vs_diffusers"] == pytest.approx(
        diffusers["diffusers_no_decode_s"] / request["total_no_decode_s"])
    assert entry["time_vs_diffusers_with_decode"] == pytest.approx(1 / entry["speedup_with_decode_vs_diffusers"])
    assert set(entry["gen_forward"]) == {"tier480_b1", "tier480_b16"}
    assert all(row["speedup_vs_bf16"] > 0 for row in entry["gen_forward"].values())
    # --tiny keeps the env counts <= 4 (16 tiny envs take a minute on a CPU).
    envs = entry["fd_env_throughput_tier256"]
    assert set(envs) == {"diffusers_one_env_step_s", "envs_1", "envs_2"}
    assert envs["diffusers_one_env_step_s"] == results["fd_env_throughput_tier256"]["diffusers_one_env_step_s"]
    assert entry["targets"]["envs_16_ge_4x_diffusers_one_at_a_time"] is None  # not measured here
    assert isinstance(entry["targets"]["policy_no_decode_time_vs_diffusers_le_0.40"], bool)


def test_fp8_on_refuses_where_fp8_cannot_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_suite.main(["--tiny", "--fp8", "on", "--out", str(tmp_path)])
    assert "--fp8 on" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_fp8_targets_compare_with_the_issue_limits():
    entry = {"time_vs_diffusers_no_decode": 0.39, "time_vs_diffusers_with_decode": 0.46,
             "gen_forward": {"tier480_b1": {"speedup_vs_bf16": 1.5}, "tier480_b16": {"error": "OOM"}},
             "fd_env_throughput_tier256": {"envs_16": {"speedup_vs_diffusers_one_at_a_time": 4.0}}}
    targets = gpu_suite.fp8_targets(entry)
    assert targets["policy_no_decode_time_vs_diffusers_le_0.40"] is True
    assert targets["policy_with_decode_time_vs_diffusers_le_0.45"] is False
    assert targets["gen_forward_tier480_b1_ge_1.4x_bf16"] is True
    assert targets["gen_forward_tier480_b16_ge_1.4x_bf16"] is None
    assert targets["envs_16_ge_4x_diffusers_one_at_a_time"] is True
    assert gpu_suite.fp8_targets({"policy_request_tier480": {"error": "x"}})[
        "policy_no_decode_time_vs_diffusers_le_0.40"] is None


def test_a_failing_fp8_section_is_recorded_and_the_others_still_run(monkeypatch):
    pipe, engine, _ = gpu_suite.make_models(True, "cpu")
    chunk, steps, guidance, fps = 8, 2, 3.0, 15.0
    image = gpu_suite.scene(256, 256)
    twin = gen_twin(engine.transformer, None, compile_blocks=False)

    def broken_env_table(*args, **kwargs):
        raise RuntimeError("env table broke")

    monkeypatch.setattr(gpu_suite, "env_throughput", broken_env_table)
    per_mode = {"policy": {"diffusers_no_decode_s": 1.0, "diffusers_with_decode_s": 2.0}}
    actions = np.zeros((chunk, 10), np.float32)
    entry = gpu_suite.fp8_variant(engine, twin, None, {"name": "none"}, per_mode, image, 256, [1], 1.0, chunk, steps,
                                  guidance, fps, actions, (3, 16, 16), 1.0, "cpu", ())
    assert entry["fd_env_throughput_tier256"] == {"error": "RuntimeError: env table broke"}
    assert entry["speedup_no_decode_vs_diffusers"] == pytest.approx(
        1.0 / entry["policy_request_tier480"]["total_no_decode_s"])
    assert "action_rel_vs_bf16" not in entry and "gen_forward" not in entry  # no baseline result, no GEN batches
    assert entry["targets"]["envs_16_ge_4x_diffusers_one_at_a_time"] is None
