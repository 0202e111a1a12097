"""The committed results point at what is committed: every link of RESULTS.md and results/INDEX.md resolves, and every
policy file a result's ``policies`` map names exists (issue 42 asks users to follow ``rl_pusht.json``'s map)."""

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LINK = re.compile(r"\]\(([^)\s#]+)\)")


@pytest.mark.parametrize("doc", ["benchmarks/RESULTS.md", "benchmarks/results/INDEX.md", "README.md"])
def test_every_link_to_a_file_resolves(doc):
    path = REPO / doc
    targets = [t for t in LINK.findall(path.read_text()) if not t.startswith(("http://", "https://", "mailto:"))]
    assert targets, f"{doc} links nothing: the pattern no longer matches its links"
    missing = [t for t in targets if not (path.parent / t).exists()]
    assert not missing, f"{doc} links files that do not exist: {missing}"


def policy_maps():
    for path in sorted(RESULTS.rglob("*.json")):
        result = json.loads(path.read_text())
        if isinstance(result, dict) and isinstance(result.get("policies"), dict):
            files = {key: value for key, value in result["policies"].items()
                     if isinstance(value, str) and value.endswith(".safetensors")}
            if files:
                yield path.relative_to(REPO), files


def test_every_policies_map_names_committed_policy_files():
    maps = dict(policy_maps())
    assert Path("benchmarks/results/rl/rl_pusht.json") in maps  # the map users follow is among those checked
    missing = {str(path): [value for value in files.values() if not (REPO / value).is_file()]
               for path, files in maps.items()}
    missing = {path: values for path, values in missing.items() if values}
    assert not missing, f"policies maps name files that are not committed: {missing}"
