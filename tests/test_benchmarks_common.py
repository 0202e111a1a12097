"""benchmarks/common.py: one timing helper, one results writer that never overwrites a committed result by default and
records where every number came from."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import common  # noqa: E402


def test_timed_reports_the_median_and_the_last_output():
    calls = []
    median, times, output = common.timed(lambda: calls.append(1) or len(calls), repeats=3, warmup=2,
                                         keep_output=True)
    assert len(calls) == 5 and output == 5 and len(times) == 3 and median == sorted(times)[1]
    output, ms = common.timed_ms(lambda: "x", repeats=2)
    assert output == "x" and len(ms) == 2 and all(t >= 0 for t in ms)


def test_write_results_refuses_a_committed_result_unless_overwrite(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    committed = sorted(common.COMMITTED_RESULTS.rglob("*.json"))[0]
    before = committed.read_bytes()
    with pytest.raises(SystemExit, match="refusing to overwrite the committed result"):
        common.write_results({"x": 1}, committed.name)
    with pytest.raises(SystemExit):
        common.check_results_target(committed.name, str(common.COMMITTED_RESULTS))
    assert committed.read_bytes() == before
    # --out given relative to the repository (as the README's commands do): --overwrite replaces the file where it
    # lies (this once failed comparing a relative path with the absolute results root).
    current = next(p for p in sorted(common.COMMITTED_RESULTS.rglob("*.json")) if "archive" not in p.parts)
    monkeypatch.chdir(common.COMMITTED_RESULTS.parents[1])
    target = common.check_results_target(current.name, "benchmarks/results", overwrite=True)
    assert target.resolve() == current.resolve()
    # Elsewhere (--out DIR, or $OUT) results are written, and a script may update its own file as it goes.
    path = common.write_results({"x": 1}, committed.name, tmp_path)
    saved = json.loads(path.read_text())
    assert saved["x"] == 1 and "commit" in saved["provenance"]  # a result without a provenance gets one
    monkeypatch.setenv("OUT", str(tmp_path / "device_out"))
    assert common.write_results({"x": 2}, "new.json").parent == tmp_path / "device_out"


def test_every_benchmark_takes_out_dir_and_overwrite():
    """--out DIR means the same everywhere: each script's --help offers --out and --overwrite."""
    scripts = sorted(p for p in BENCHMARKS.rglob("*.py") if p.name != "common.py")
    assert {"recipes/train_pusht.py", "parallel_gpu.py"} <= {str(p.relative_to(BENCHMARKS)) for p in scripts}
    missing = []
    for script in scripts:
        text = script.read_text()
        if "add_output_arguments(parser)" not in text and '"--overwrite"' not in text:
            missing.append(script.name)
    assert not missing, missing


def test_a_benchmark_refuses_before_it_measures(tmp_path):
    """preprocess_cpu.json is committed: running the script without --out stops at once, naming the way out."""
    assert (common.COMMITTED_RESULTS / "engine" / "preprocess_cpu.json").is_file()
    result = subprocess.run([sys.executable, str(BENCHMARKS / "preprocess_cpu.py")], capture_output=True, text=True,
                            timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "--overwrite" in result.stderr


def test_provenance_records_commit_dirty_tree_card_and_versions(monkeypatch):
    monkeypatch.delenv("COSMOS3_GYM_COMMIT", raising=False)
    record = common.provenance(["benchmarks/x.py", "--flag"])
    assert {"commit", "dirty", "card", "num_gpus", "torch", "python", "command", "date"} <= set(record)
    assert record["command"] == "benchmarks/x.py --flag" and record["dirty"] in (True, False, None)
    assert record["num_gpus"] >= 1 or ("cpu" in record and record["cpu_cores"] >= 1)
    assert "hashes" not in record
    # A source snapshot without .git names its commit (and its state) through the environment.
    monkeypatch.setenv("COSMOS3_GYM_COMMIT", "abc123")
    monkeypatch.setenv("COSMOS3_GYM_DIRTY", "1")
    assert common.provenance()["commit"] == "abc123" and common.provenance()["dirty"] is True


def test_hashes_follow_the_bytes_of_files_and_folders(tmp_path):
    folder = tmp_path / "checkpoint"
    (folder / "transformer").mkdir(parents=True)
    weights = folder / "transformer" / "model.safetensors"
    weights.write_bytes(b"weights one")
    (folder / "config.json").write_text("{}")
    policy = tmp_path / "policy.safetensors"
    policy.write_bytes(b"policy one")

    before = common.provenance(inputs=[folder, policy, tmp_path / "missing"])["hashes"]
    folder_key, weights_key, policy_key = str(folder) + "/", str(weights), str(policy)
    assert set(before) == {folder_key, weights_key, policy_key}  # a folder, its safetensors, a file; missing skipped
    weights.write_bytes(b"weights two")
    policy.write_bytes(b"policy two")
    after = common.input_hashes([folder, policy])
    assert after[folder_key] != before[folder_key] and after[weights_key] != before[weights_key]
    assert after[policy_key] != before[policy_key]
    (folder / "config.json").write_text('{"a": 1}')  # any file of a folder changes its digest
    assert common.input_hashes([folder])[folder_key] != after[folder_key]


def test_write_results_records_the_inputs_an_argparse_namespace_names(tmp_path):
    policy = tmp_path / "p.safetensors"
    policy.write_bytes(b"x")
    args = argparse.Namespace(checkpoint=str(tmp_path), policies=f"random,file:{policy}=0.5", steps=3)
    assert set(map(str, common.inputs_from_args(args))) == {str(tmp_path), str(policy)}
    path = common.write_results({"x": 1}, "new.json", tmp_path / "out", args=args)
    saved = json.loads(path.read_text())
    assert saved["x"] == 1 and {str(tmp_path) + "/", str(policy)} <= set(saved["provenance"]["hashes"])


def test_write_results_refuses_a_committed_result_in_any_topic_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    committed = common.COMMITTED_RESULTS / "engine" / "preprocess_cpu.json"
    before = committed.read_bytes()
    assert common.result_topic("preprocess_cpu.json") == "engine"
    assert common.committed_result(committed.name) == committed
    # The same name asked for in another topic folder, or in benchmarks/results itself, is still refused.
    for topic in ("training", None):
        with pytest.raises(SystemExit, match="refusing to overwrite the committed result"):
            common.write_results({"x": 1}, committed.name, topic=topic)
    with pytest.raises(SystemExit, match="refusing"):
        common.check_results_target(committed.name, str(common.COMMITTED_RESULTS / "fidelity"))
    assert committed.read_bytes() == before
    # New results land in their topic's folder; elsewhere (--out DIR) a committed name is fine.
    target = common.check_results_target("rl_pusht_new_run.json")
    assert target == common.COMMITTED_RESULTS / "rl" / "rl_pusht_new_run.json" and not target.exists()
    assert common.write_results({"x": 1}, committed.name, tmp_path).parent == tmp_path
