"""benchmarks/common.py: one timing helper, one results writer that never overwrites a committed result by default."""

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
    committed = sorted(common.COMMITTED_RESULTS.glob("*.json"))[0]
    before = committed.read_bytes()
    with pytest.raises(SystemExit, match="refusing to overwrite the committed result"):
        common.write_results({"x": 1}, committed.name)
    with pytest.raises(SystemExit):
        common.check_results_target(committed.name, str(common.COMMITTED_RESULTS))
    assert committed.read_bytes() == before
    # Elsewhere (--out DIR, or $OUT) results are written, and a script may update its own file as it goes.
    path = common.write_results({"x": 1}, committed.name, tmp_path)
    assert json.loads(path.read_text()) == {"x": 1}
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
    assert (common.COMMITTED_RESULTS / "preprocess_cpu.json").is_file()
    result = subprocess.run([sys.executable, str(BENCHMARKS / "preprocess_cpu.py")], capture_output=True, text=True,
                            timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "--overwrite" in result.stderr
