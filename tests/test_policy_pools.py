"""The PushT evaluation protocol (issue 42): the committed policy-pools manifest validates, and a manifest that mixes
the pools, reuses seeds or names a missing file fails with an error naming the field."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from cosmos3_gym.errors import InputError
from cosmos3_gym.policy_specs import parse_policy_spec
from cosmos3_gym.tasks.pusht.policy_pools import (
    MANIFEST,
    REPOSITORY_ROOT,
    SeedRange,
    load_policy_pools,
    validate_policy_pools,
)


@pytest.fixture(scope="module")
def document() -> dict:
    return json.loads(MANIFEST.read_text())


def validate(document: dict, **kwargs):
    return validate_policy_pools(copy.deepcopy(document), root=REPOSITORY_ROOT, check_files=True, **kwargs)


def test_the_committed_manifest_validates():
    pools = load_policy_pools(check_files=True)
    assert len(pools.evaluation) >= 10
    assert len({entry.family for entry in pools.evaluation}) >= 3
    for spec in pools.specs("evaluation", absolute=True):
        parse_policy_spec(spec)  # file specs read their file's header
    ranges = pools.seed_ranges
    assert {"training", "choosing", "reporting", "measurements"} <= set(ranges)
    assert ranges["reporting"].first > max(r.last for r in pools.used_before)
    block = pools.seed_block("reporting", 32)
    assert len(block) == 32 and all(seed in ranges["reporting"] for seed in block)
    # Every committed policy file is in the training pool: the evaluation pool's files are new ones.
    trained = {entry.path for entry in pools.training if entry.path}
    committed = {p.relative_to(REPOSITORY_ROOT).as_posix()
                 for p in (REPOSITORY_ROOT / "benchmarks" / "results" / "rl").rglob("*.safetensors")}
    evaluation = {entry.path for entry in pools.evaluation if entry.path}
    assert committed - evaluation <= trained, sorted(committed - evaluation - trained)


def test_a_policy_in_both_pools_fails(document):
    broken = copy.deepcopy(document)
    broken["evaluation_pool"].append({"spec": "scripted:20", "family": "scripted"})
    with pytest.raises(InputError, match=r"evaluation_pool\[\d+\]\.spec: 'scripted:20' is the same policy as "
                                         r"training_pool\[3\]"):
        validate(broken)
    # The same noise written differently is the same policy.
    broken["evaluation_pool"][-1]["spec"] = "scripted:20.0"
    with pytest.raises(InputError, match="same policy"):
        validate(broken)


def test_a_copied_policy_file_is_the_same_policy(document, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPOSITORY_ROOT / "benchmarks" / "results" / "rl", root / "benchmarks" / "results" / "rl")
    copied = "benchmarks/results/rl/policies/renamed_bc.safetensors"
    shutil.copy(root / "benchmarks/results/rl/policies/rl_pusht_bc.safetensors", root / copied)
    broken = copy.deepcopy(document)
    broken["evaluation_pool"].append({"spec": f"file:{copied}", "family": "bc"})
    with pytest.raises(InputError, match="same policy as training_pool"):
        validate_policy_pools(broken, root=root, check_files=True)


@pytest.mark.parametrize("use, first, last, message", [
    ("reporting", 4_900_000, 5_100_000, r"seed_ranges\.reporting: 4900000\.\.5100000 overlaps seed_ranges\.choosing"),
    ("choosing", 3_000_000, 4_000_000, r"seed_ranges\.choosing: .* overlaps seed_ranges\.training"),
    ("measurements", 5_999_999, 6_000_100, r"seed_ranges\.measurements: .* overlaps seed_ranges\.reporting"),
    ("reporting", 110_000, 110_031, r"seed_ranges\.reporting: 110000\.\.110031 overlaps used_before\[4\]"),
    ("reporting", 10, 5, r"seed_ranges\.reporting: last \(5\) is below first \(10\)"),
])
def test_overlapping_seed_ranges_fail(document, use, first, last, message):
    broken = copy.deepcopy(document)
    broken["seed_ranges"][use].update(first=first, last=last, excluded=[])
    with pytest.raises(InputError, match=message):
        validate(broken)


def test_a_missing_policy_file_fails(document):
    broken = copy.deepcopy(document)
    broken["evaluation_pool"].append({"spec": "file:benchmarks/results/rl/policies/missing.safetensors",
                                      "family": "bc"})
    with pytest.raises(InputError, match=r"evaluation_pool\[\d+\]\.spec: the policy file "
                                         r"benchmarks/results/rl/policies/missing\.safetensors does not exist"):
        validate(broken)
    broken = copy.deepcopy(document)
    broken["training_pool"][16]["spec"] = "file:benchmarks/results/rl/policies/gone.safetensors"
    with pytest.raises(InputError, match=r"training_pool\[16\]\.spec: the policy file .*gone\.safetensors"):
        validate(broken)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["evaluation_pool"].append({"spec": "scripted:-3", "family": "scripted"}),
     r"evaluation_pool\[\d+\]\.spec: policy: 'scripted:-3': NOISE must be a number >= 0"),
    (lambda d: d["evaluation_pool"].append({"spec": "no-such-kind", "family": "x"}),
     r"evaluation_pool\[\d+\]\.spec: policy: 'no-such-kind' is not one of"),
    (lambda d: d["evaluation_pool"].append({"spec": None, "family": "scripted"}),
     r"evaluation_pool\[\d+\]\.spec: every evaluation policy needs a policy spec"),
    (lambda d: d["evaluation_pool"].append(dict(d["evaluation_pool"][0])), r"is already evaluation_pool\[0\]"),
    (lambda d: d["training_pool"][0].update(where=[]), r"training_pool\[0\]\.where: a training-pool entry says where"),
    (lambda d: d["seed_ranges"].pop("choosing"), r"seed_ranges: expected .* missing \['choosing'\]"),
    (lambda d: d.update(format="something else"), r"format: expected 'cosmos3_gym.pusht.policy_pools.v1'"),
    (lambda d: d["to_train"][0].update(reset_seeds=[5_000_000, 5_000_999]),
     r"to_train\[0\]\.reset_seeds: 5000000\.\.5000999 must lie in seed_ranges\.training"),
    (lambda d: d["seed_ranges"]["reporting"]["excluded"].append(17),
     r"seed_ranges\.reporting\.excluded: 17 is outside"),
])
def test_other_mistakes_name_their_field(document, change, message):
    broken = copy.deepcopy(document)
    change(broken)
    with pytest.raises(InputError, match=message):
        validate(broken)


def test_a_manifest_that_is_no_json_or_missing_fails(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_policy_pools(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InputError, match="not valid JSON"):
        load_policy_pools(tmp_path / "bad.json")


def test_without_the_repository_the_files_are_not_checked(document, tmp_path):
    """An installed wheel has the manifest but not benchmarks/: it still loads, specs of files unread."""
    pools = validate_policy_pools(copy.deepcopy(document), root=tmp_path)
    assert pools.specs("evaluation")[-1].startswith("file:benchmarks/")


def test_seed_blocks_skip_excluded_seeds():
    seeds = SeedRange("reporting", 100, 120, excluded=(103, 110))
    assert 103 not in seeds and 104 in seeds and 99 not in seeds
    assert seeds.seed_block(3) == range(100, 103)
    assert seeds.seed_block(5) == range(104, 109)
    assert seeds.seed_block(5, offset=6) == range(111, 116)
    with pytest.raises(InputError, match="no block of 12 seeds"):
        seeds.seed_block(12)


def test_simulated_training_episodes_never_start_from_a_held_out_seed():
    from cosmos3_gym.tasks.pusht.dataset import training_reset_seed

    class Draws:  # a generator whose draws fall in choosing, reporting and measurements before a free seed
        def __init__(self, values):
            self.values = list(values)

        def integers(self, high):
            assert high == 2**31
            return self.values.pop(0)

    assert training_reset_seed(Draws([4_000_000, 5_999_999, 6_050_000, 3_999_999])) == 3_999_999
    assert training_reset_seed(Draws([6_100_000])) == 6_100_000  # past the last held-out range
    rng = np.random.default_rng(0)
    seeds = [training_reset_seed(rng) for _ in range(2000)]
    assert not any(4_000_000 <= seed <= 6_099_999 for seed in seeds)
