"""The layers of DESIGN.md decision 7 are import-linter contracts in pyproject.toml (``lint-imports`` in CI); these
tests show the contracts pass on the package and fail on a deliberately wrong import, and that no generic module
names the PushT task."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cosmos3_gym"
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([LINT_IMPORTS, "--config", str(tree / "pyproject.toml"), "--no-cache"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def package_copy(tmp_path) -> Path:
    """The package's source (no assets) and pyproject.toml in a folder of their own."""
    shutil.copytree(PACKAGE, tmp_path / "cosmos3_gym",
                    ignore=shutil.ignore_patterns("assets", "__pycache__", "*.safetensors"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_keeps_its_layer_contracts(package_copy):
    result = lint_imports(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("module", "wrong_import", "broken"), [
    ("engine.py", "from .tasks.pusht import geometry", "core -> data"),  # core reaching up to a task
    ("data/episodes.py", "from ..envs import settings", "core -> data"),  # data reaching up to envs
    ("rewards/base.py", "import gym_pusht", "Generic layers reach no task"),  # a task's simulator in generic code
    ("parallel/mesh.py", "from .. import engine", "No import cycles"),  # engine imports parallel: a cycle
])
def test_a_wrong_import_breaks_a_contract(package_copy, module, wrong_import, broken):
    path = package_copy / "cosmos3_gym" / module
    source = path.read_text()
    # after the module docstring and `from __future__`, inside a function: lazy imports count too
    path.write_text(source + f"\n\ndef _planted():\n    {wrong_import}  # noqa\n")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    broken_section = result.stdout.split("Broken contracts", 1)[-1]
    assert broken in broken_section, result.stdout


def test_no_generic_module_names_the_pusht_task():
    """Issue 41: the generic layers know no environment family; PushT lives in tasks/pusht and plugs in through
    registries. cli.py, the top layer, may name it (its demo and eval-real commands)."""
    naming = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "tasks" or relative.name == "cli.py":
            continue
        naming += [f"{relative}:{number}" for number, line in enumerate(path.read_text().splitlines(), 1)
                   if re.search(r"push-?t", line, re.IGNORECASE)]
    assert naming == []
