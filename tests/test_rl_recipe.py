"""benchmarks/rl_pusht.py --tiny: every stage of the RL recipe on the CPU (tiny sizes, the tiny random model)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.sim  # needs gym-pusht (the sim extra)

pytest.importorskip("gym_pusht")

RECIPE = Path(__file__).resolve().parent.parent / "benchmarks" / "rl_pusht.py"


def test_tiny_recipe_writes_results_policies_and_curves(tmp_path, monkeypatch):
    from cosmos3_gym.rl.policy import load_policy_file, read_policy_metadata

    monkeypatch.setenv("COSMOS3_GYM_COMMIT", "test")
    spec = importlib.util.spec_from_file_location("rl_pusht_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--tiny", "--work", str(work), "--scratch", str(tmp_path / "scratch"), "--no-progress", "--device",
              "cpu"]
    first = recipe.main([*common, "--out", str(tmp_path / "first"), "--stages", "demos,bc,dagger,eval_bc",
                         "--bc-snapshot-steps", "1,3,99", "--dagger-snapshots"])
    # Checkpoints of one run: BC after steps 1 and 3 (99 is past the tiny run's 4 steps), then every DAgger round.
    assert [(s["name"], s["stage"]) for s in first["snapshots"]] == [
        ("bc_step1", "bc"), ("bc_step3", "bc"), ("dagger_round1", "dagger"), ("dagger_round2", "dagger")]
    snapshot_files = [tmp_path / "first" / "policies" / Path(s["policy"]).name for s in first["snapshots"]]
    assert read_policy_metadata(snapshot_files[1])["bc_steps"] == 3
    assert read_policy_metadata(snapshot_files[3])["dagger_rounds"] == 2
    # Each snapshot is the policy as it was then: DAgger's last round is the final policy, BC's first step is not.
    final = load_policy_file(work / "policies" / "rl_pusht_bc.safetensors").state_dict()
    for file, same in ((snapshot_files[3], True), (snapshot_files[0], False)):
        weights = load_policy_file(file).state_dict()
        assert all(torch.equal(weights[k], final[k]) for k in final) == same
    # A second run with a fresh --out (another GPU call) continues from --work.
    # GRPO from fresh gym-pusht resets (after the DAgger seeds) instead of demonstration steps.
    results = recipe.main([*common, "--out", str(out), "--stages", "grpo_sim,grpo_wm,eval",
                           "--guard-every", "1", "--rl-starts", "resets", "--initial-log-std", "-3",
                           "--grpo-snapshot-iterations", "1"])

    assert set(results["policies"]) == {"bc", "bc_demos", "grpo_simulator", "grpo_world_model"}
    for key, path in results["policies"].items():
        assert path == f"benchmarks/results/rl/policies/rl_pusht_{key}.safetensors"
        assert load_policy_file(out / "policies" / Path(path).name).action_shape == (8, 2)
    saved = json.loads((out / "rl_pusht.json").read_text())
    assert saved["provenance"]["commit"] == "test" and "rl_pusht.py" in saved["provenance"]["command"]
    assert saved["bc"]["eval"]["episodes"] == 3 and "demos" in saved  # kept from the first run
    assert saved["bc"]["eval_on_demo_seeds"]["eval_seeds"] == [0, 2] and saved["bc"]["steps"] == 4
    assert [call["stages"] for call in saved["calls"]] == ["demos,bc,dagger,eval_bc", "grpo_sim,grpo_wm,eval"]
    dagger = saved["bc"]["dagger"]  # DAgger's policy became "bc"; the demonstrations-only one is "bc_demos"
    assert [r["round"] for r in dagger["history"]] == [0, 1] and dagger["seeds"] == [3, 6]
    assert read_policy_metadata(work / "policies" / "rl_pusht_bc.safetensors")["dagger_rounds"] == 2
    # GRPO's snapshots after iteration 1 of 2, listed after the first call's, and not the final GRPO policy.
    grpo_snapshots = [s for s in saved["snapshots"] if s["stage"].startswith("grpo")]
    assert [(s["name"], s["grpo_iterations"]) for s in grpo_snapshots] == [
        ("grpo_simulator_it1", 1), ("grpo_world_model_it1", 1)]
    assert len(saved["snapshots"]) == 6
    final = load_policy_file(out / "policies" / "rl_pusht_grpo_simulator.safetensors").state_dict()
    weights = load_policy_file(out / "policies" / Path(grpo_snapshots[0]["policy"]).name).state_dict()
    assert read_policy_metadata(out / "policies" / Path(grpo_snapshots[0]["policy"]).name)["grpo_iterations"] == 1
    assert not all(torch.equal(weights[k], final[k]) for k in final)
    world_model = saved["grpo_world_model"]
    assert len(world_model["history"]) == 2 and all(r["guard"] for r in world_model["history"])
    assert world_model["reward_check"]["replayed_episodes"] == 8
    # GRPO started from BC with its exploration noise reset (BC saves -2.5).
    grpo_policy = load_policy_file(out / "policies" / "rl_pusht_grpo_simulator.safetensors")
    assert grpo_policy.log_std.detach().mean().item() == pytest.approx(-3.0, abs=0.05)
    # seeds 7..: after the 3 demonstrations and DAgger's 2 rounds of 2 episodes
    assert world_model["starts"] == saved["grpo_simulator"]["starts"] == "2048 gym-pusht resets (seeds 7..)"
    assert saved["grpo_simulator"]["env_steps"] == world_model["env_steps"] == 16
    for key in ("grpo_simulator", "grpo_world_model"):  # the whole loop's speed: fewer iterations than the warm-up
        speed = saved[key]["loop_speed"]  # left out, so all of them count
        assert speed["iterations"] == 2 and speed["skipped"] == 0 and speed["env_steps"] == 16
        assert len(speed["iteration_s"]) == 2 and min(speed["iteration_s"]) > 0
        assert speed["loop_env_steps_per_s"] == pytest.approx(16 / sum(speed["iteration_s"]))
        assert speed["env_only_env_steps_per_s"] > speed["loop_env_steps_per_s"]  # the env is part of the loop
    assert "success_rate_difference_t95" in saved["grpo_world_model"]["vs_bc"]
    assert (out / "rl_pusht.png").stat().st_size > 0

    # GRPO from the states the BC policy itself visits: rolled once, kept in --work for the next stage or call.
    policy_run = recipe.main([*common, "--out", str(tmp_path / "third"), "--stages", "grpo_sim",
                              "--rl-starts", "policy", "--guard-every", "0", "--grpo-seconds", "600"])
    assert policy_run["grpo_simulator"]["starts"].endswith("policy rollouts (success 0.00)")
    assert policy_run["grpo_simulator"]["starts"].startswith("4 states of 2")  # 2 episodes x 2 chunks (tiny)
    assert len(list(work.glob("policy_starts_*.npz"))) == 1


@pytest.mark.parametrize("argv, field", [(["--grpo-seconds", "0"], "--grpo-seconds"),
                                         (["--initial-log-std", "0"], "--initial-log-std")])
def test_recipe_refuses_bad_settings_before_any_work(tmp_path, capsys, argv, field):
    spec = importlib.util.spec_from_file_location("rl_pusht_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--tiny", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--stages",
                     "grpo_sim", *argv])
    assert exit_info.value.code == 2 and field in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
