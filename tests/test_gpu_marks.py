"""Every test that needs CUDA carries the ``gpu`` marker, so ``pytest -m gpu`` runs all of them on the GPU machine and
``-m "not gpu"`` leaves all of them out (issue 43: one CUDA test lacked it and ran nowhere on purpose)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent
GPU_MARKERS = ("mark.gpu", "needs_cuda")  # test_cuda_graphs.needs_cuda adds the marker


def _needs_cuda_without_the_marker(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    module_marks = " ".join(
        ast.unparse(node.value) for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
    )
    if "gpu" in module_marks:
        return []
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith(("test_", "Test")):
            decorators = " ".join(ast.unparse(d) for d in node.decorator_list)
            if "cuda" in decorators and not any(marker in decorators for marker in GPU_MARKERS):
                missing.append(f"{path.name}::{node.name}")
    return missing


def test_every_test_that_skips_without_cuda_is_marked_gpu():
    missing = [name for path in sorted(TESTS.glob("test_*.py")) for name in _needs_cuda_without_the_marker(path)]
    assert not missing, f"CUDA tests without @pytest.mark.gpu: {missing}"


def test_the_check_sees_an_unmarked_cuda_test(tmp_path):
    path = tmp_path / "test_example.py"
    path.write_text('import pytest, torch\n\n@pytest.mark.skipif(not torch.cuda.is_available(), reason="x")\n'
                    'def test_on_gpu():\n    pass\n\n@pytest.mark.gpu\n'
                    '@pytest.mark.skipif(not torch.cuda.is_available(), reason="x")\ndef test_marked():\n    pass\n')
    assert _needs_cuda_without_the_marker(path) == ["test_example.py::test_on_gpu"]
