"""CI runs the README's own commands, exactly as written (issue 41), and the README stays a short front door."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    """The command lines (not comments) of the README's first bash block: install + demo, then the tests."""
    block = re.search(r"```bash\n(.*?)```", README, re.DOTALL)
    assert block, "the README has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_readme_starts_with_the_two_commands():
    install_and_demo, tests = readme_commands()
    assert "pip install torch==2.13.0" in install_and_demo and "cosmos3-gym demo" in install_and_demo
    assert tests == "python -m pytest"


def test_ci_runs_the_readme_commands_exactly_as_written():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in ci_lines, f"CI does not run the README's command {command!r} as written"


def test_the_readme_is_short_and_says_how_long_the_suite_takes():
    assert len(README.splitlines()) <= 250
    assert re.search(r"[Aa]bout \d+ minutes on 2 CPU cores", README)
