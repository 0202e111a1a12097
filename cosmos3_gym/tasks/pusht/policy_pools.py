"""The PushT evaluation protocol (issue 42): two policy pools and the gym-pusht reset-seed ranges of each use.

``policy_pools.json`` (beside this module) is the committed manifest; ``load_policy_pools()`` reads and validates it.

* The **training pool** holds every policy whose rollouts are in the training data of the shipped PushT model or of
  any checkpoint it descends from, and every policy that steered a choice between model variants (each entry says
  where: file and round). Its rollouts may go into training data; it may steer choices.
* The **evaluation pool** holds policies that were never in that training data and never chose anything. It is for
  reporting only: a number on it is a held-out number.
* **Seed ranges** (gym-pusht reset seeds, ``PushTSim.reset(seed)`` / ``eval-real --first-sim-seed``): one range per
  use, ``training``, ``choosing`` (between model variants or settings), ``reporting`` (the evaluation pool's
  numbers), and optionally ``measurements`` (one-off measurements such as the hand-over round trip). The ranges are
  disjoint, and the choosing, reporting and measurement ranges overlap none of the seed ranges earlier scripts used
  (``used_before``). Datasets simulated by ``generate_pusht_dataset`` draw their reset seeds pseudo-randomly over
  ``[0, 2**31)``; the few that fell inside a range are listed in that range's ``excluded``, and ``seed_block`` never
  hands them out.

Validation (``InputError`` naming the field): the pools share no policy (a policy file counts as the same policy as
another path with the same bytes), every evaluation spec parses with ``policy_specs.parse_policy_spec``, every
committed policy file the manifest names exists (checked when the repository's ``benchmarks/`` folder is there, or
``check_files=True``), the seed ranges are well-formed and disjoint as above, and ``to_train`` entries (policies
still to be trained for the evaluation pool) name seeds inside the training range and files no pool names yet.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InputError

__all__ = [
    "MANIFEST",
    "MANIFEST_FORMAT",
    "SEED_USES",
    "PolicyPools",
    "PoolEntry",
    "SeedRange",
    "load_policy_pools",
    "validate_policy_pools",
]

MANIFEST = Path(__file__).resolve().with_name("policy_pools.json")
MANIFEST_FORMAT = "cosmos3_gym.pusht.policy_pools.v1"
REQUIRED_SEED_USES = ("training", "choosing", "reporting")
SEED_USES = (*REQUIRED_SEED_USES, "measurements")
# Uses whose seeds must never have been used by an earlier script (the training range may reuse old seeds).
HELD_OUT_USES = ("choosing", "reporting", "measurements")
REPOSITORY_ROOT = Path(__file__).resolve().parents[3]  # cosmos3_gym/tasks/pusht/ -> the repository
FILE_PREFIXES = ("file:", "sb3:", "ppo:")


@dataclass(frozen=True)
class SeedRange:
    """gym-pusht reset seeds ``first .. last`` (inclusive) for one use, minus ``excluded``."""

    name: str
    first: int
    last: int
    use: str = ""
    excluded: tuple[int, ...] = ()

    def __contains__(self, seed: object) -> bool:
        return isinstance(seed, int) and self.first <= seed <= self.last and seed not in self.excluded

    def overlaps(self, other: SeedRange) -> bool:
        return self.first <= other.last and other.first <= self.last

    def seed_block(self, count: int, offset: int = 0) -> range:
        """The first ``count`` consecutive seeds from ``first + offset`` on that hold no excluded seed (a block
        ``eval-real --first-sim-seed`` can take): ``InputError`` if none fits in the range."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise InputError(f"count: expected an integer >= 1, got {count!r}.")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InputError(f"offset: expected an integer >= 0, got {offset!r}.")
        start = self.first + offset
        for seed in sorted(self.excluded):
            if seed >= start + count:
                break
            if seed >= start:
                start = seed + 1
        if start + count - 1 > self.last:
            raise InputError(
                f"seed_ranges.{self.name}: no block of {count} seeds free of excluded seeds from {self.first + offset} "
                f"to {self.last}."
            )
        return range(start, start + count)


@dataclass(frozen=True)
class PoolEntry:
    """One policy of a pool. ``spec``: a ``policy_specs`` spec (None for a training-data family no spec names, e.g.
    the replayed pusher); ``family``: what kind of policy it is; ``where``: where it was used (training pool) or how it
    was made (evaluation pool); ``path``: the repository-relative file of a file spec; ``fields``: the entry as
    written."""

    spec: str | None
    family: str
    where: tuple[str, ...] = ()
    note: str = ""
    path: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class PolicyPools:
    """The validated manifest: ``training`` and ``evaluation`` pools, ``seed_ranges`` by use, the seed ranges earlier
    scripts used (``used_before``), the policies still to be trained for the evaluation pool (``to_train``), and the
    manifest's ``source`` path and ``root`` (the repository that policy file paths are relative to)."""

    training: tuple[PoolEntry, ...]
    evaluation: tuple[PoolEntry, ...]
    seed_ranges: Mapping[str, SeedRange]
    used_before: tuple[SeedRange, ...]
    to_train: tuple[Mapping[str, Any], ...]
    source: str
    root: Path

    def specs(self, pool: str = "evaluation", absolute: bool = False) -> list[str]:
        """The policy specs of ``pool`` ("evaluation" or "training"; entries without a spec left out). File specs'
        paths are repository-relative (run from the repository root), or absolute with ``absolute``."""
        entries = {"evaluation": self.evaluation, "training": self.training}.get(pool)
        if entries is None:
            raise InputError(f"pool: expected 'evaluation' or 'training', got {pool!r}.")
        return [_absolute_spec(e, self.root) if absolute else e.spec for e in entries if e.spec is not None]

    def seed_block(self, use: str, count: int, offset: int = 0) -> range:
        """``count`` consecutive reset seeds of ``use``'s range (``SeedRange.seed_block``)."""
        if use not in self.seed_ranges:
            raise InputError(f"use: expected one of {sorted(self.seed_ranges)}, got {use!r}.")
        return self.seed_ranges[use].seed_block(count, offset)


def load_policy_pools(
    path: str | os.PathLike | None = None, *, root: str | os.PathLike | None = None, check_files: bool | None = None
) -> PolicyPools:
    """Read and validate a policy-pools manifest (default: the committed ``policy_pools.json``).

    ``root``: the repository that the manifest's policy file paths are relative to (default: the repository this
    package sits in). ``check_files``: check that every policy file exists and every file spec parses (reading its
    header); default: when ``root`` holds a ``benchmarks/`` folder (an installed wheel has no committed policy files).
    """
    source = Path(path) if path is not None else MANIFEST
    try:
        document = json.loads(source.read_text())
    except FileNotFoundError:
        raise InputError(f"policy pools: {source} does not exist.") from None
    except json.JSONDecodeError as error:
        raise InputError(f"policy pools: {source} is not valid JSON ({error}).") from None
    return validate_policy_pools(document, root=root, check_files=check_files, source=str(source))


def validate_policy_pools(
    document: Any,
    *,
    root: str | os.PathLike | None = None,
    check_files: bool | None = None,
    source: str = "policy_pools",
) -> PolicyPools:
    """``load_policy_pools`` for a manifest already read (a dict)."""
    from .registration import register

    register()  # the scripted policy kinds (idempotent): specs parse without the package's entry points
    root_path = Path(root) if root is not None else REPOSITORY_ROOT
    if check_files is None:
        check_files = (root_path / "benchmarks").is_dir()
    where = source
    if not isinstance(document, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(document).__name__}.")
    if document.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{where}: format: expected {MANIFEST_FORMAT!r}, got {document.get('format')!r}.")
    training = _entries(document, "training_pool", where, root_path, check_files, require_spec=False)
    evaluation = _entries(document, "evaluation_pool", where, root_path, check_files, require_spec=True)
    _check_disjoint_pools(training, evaluation, where, root_path, check_files)
    seed_ranges = _seed_ranges(document, where)
    used_before = _used_before(document, where)
    _check_seed_ranges(seed_ranges, used_before, where)
    named = {e.path for e in (*training, *evaluation) if e.path is not None}
    to_train = _to_train(document, where, seed_ranges["training"], named)
    return PolicyPools(training, evaluation, seed_ranges, used_before, to_train, source, root_path)


# ---------------------------------------------------------------------------------------------------------------


def _entries(
    document: dict, key: str, where: str, root: Path, check_files: bool, require_spec: bool
) -> tuple[PoolEntry, ...]:
    from ...policy_specs import parse_policy_spec

    items = document.get(key)
    if not isinstance(items, list) or not items:
        raise InputError(f"{where}: {key}: expected a non-empty list of policies, got {items!r}.")
    entries: list[PoolEntry] = []
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        name = f"{where}: {key}[{index}]"
        if not isinstance(item, dict):
            raise InputError(f"{name}: expected an object, got {item!r}.")
        spec, family = item.get("spec"), item.get("family")
        if not isinstance(family, str) or not family:
            raise InputError(f"{name}.family: expected a non-empty string, got {family!r}.")
        if spec is None and require_spec:
            raise InputError(f"{name}.spec: every evaluation policy needs a policy spec, got none.")
        if spec is None and not isinstance(item.get("data_family"), str):
            raise InputError(f"{name}: an entry without a spec needs data_family (the dataset family it names).")
        if spec is not None and (not isinstance(spec, str) or not spec.strip()):
            raise InputError(f"{name}.spec: expected a policy spec string, got {spec!r}.")
        path = _spec_path(spec)
        if spec is not None:
            if path is not None:
                resolved = root / path
                if check_files and not resolved.is_file():
                    raise InputError(f"{name}.spec: the policy file {path} does not exist (under {root}).")
                if check_files:
                    _parse(parse_policy_spec, _with_path(spec, str(resolved)), name)
                elif Path(path).is_absolute():
                    raise InputError(f"{name}.spec: policy file paths are repository-relative, got {path!r}.")
            else:
                _parse(parse_policy_spec, spec, name)
            if spec in seen:
                raise InputError(f"{name}.spec: {spec!r} is already {key}[{seen[spec]}].")
            seen[spec] = index
        where_used = item.get("where", [])
        if isinstance(where_used, str):
            where_used = [where_used]
        if not isinstance(where_used, list) or not all(isinstance(w, str) for w in where_used):
            raise InputError(f"{name}.where: expected a list of strings, got {item.get('where')!r}.")
        if key == "training_pool" and not where_used:
            raise InputError(f"{name}.where: a training-pool entry says where it was used (file and round).")
        entries.append(PoolEntry(spec, family, tuple(where_used), str(item.get("note", "")), path, dict(item)))
    return tuple(entries)


def _parse(parse, spec: str, name: str) -> None:
    try:
        parse(spec)
    except InputError as error:
        raise InputError(f"{name}.spec: {error}") from None


def _spec_path(spec: str | None) -> str | None:
    if spec is None:
        return None
    for prefix in FILE_PREFIXES:
        if spec.strip().startswith(prefix):
            return spec.strip()[len(prefix) :]
    return None


def _with_path(spec: str, path: str) -> str:
    prefix = next(p for p in FILE_PREFIXES if spec.strip().startswith(p))
    return prefix + path


def _absolute_spec(entry: PoolEntry, root: Path) -> str:
    assert entry.spec is not None
    return _with_path(entry.spec, str(root / entry.path)) if entry.path is not None else entry.spec


def _identity(entry: PoolEntry, root: Path, check_files: bool) -> tuple:
    """What makes two entries the same policy: a registered kind and its noise, random / agent, or a policy file's
    bytes (its path when files are not checked)."""
    from ...policy_specs import parse_policy_spec

    if entry.spec is None:
        return ("data", entry.fields.get("data_family"), entry.fields.get("noise_px"))
    if entry.path is not None:
        resolved = root / entry.path
        if check_files and resolved.is_file():
            return ("file", hashlib.sha256(resolved.read_bytes()).hexdigest())
        return ("file", os.path.normpath(entry.path))
    parsed = parse_policy_spec(entry.spec)
    return (parsed.kind, float(parsed.noise))


def _check_disjoint_pools(
    training: Sequence[PoolEntry], evaluation: Sequence[PoolEntry], where: str, root: Path, check_files: bool
) -> None:
    trained = {_identity(e, root, check_files): i for i, e in enumerate(training)}
    for index, entry in enumerate(evaluation):
        identity = _identity(entry, root, check_files)
        if identity in trained:
            other = training[trained[identity]]
            raise InputError(
                f"{where}: evaluation_pool[{index}].spec: {entry.spec!r} is the same policy as training_pool"
                f"[{trained[identity]}] ({other.spec or other.fields.get('data_family')!r}); the pools share no policy."
            )


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(f"{name}: expected an integer >= 0, got {value!r}.")
    return value


def _seed_range(item: Any, name: str, label: str) -> SeedRange:
    if not isinstance(item, dict):
        raise InputError(f"{name}: expected an object with first and last, got {item!r}.")
    first, last = _int(item.get("first"), f"{name}.first"), _int(item.get("last"), f"{name}.last")
    if last < first:
        raise InputError(f"{name}: last ({last}) is below first ({first}).")
    excluded = item.get("excluded", [])
    if not isinstance(excluded, list):
        raise InputError(f"{name}.excluded: expected a list of seeds, got {excluded!r}.")
    for seed in excluded:
        if _int(seed, f"{name}.excluded") < first or seed > last:
            raise InputError(f"{name}.excluded: {seed} is outside {first}..{last}.")
    use = item.get("use", item.get("by", ""))
    return SeedRange(label, first, last, str(use), tuple(sorted(set(excluded))))


def _seed_ranges(document: dict, where: str) -> dict[str, SeedRange]:
    ranges = document.get("seed_ranges")
    if not isinstance(ranges, dict):
        raise InputError(f"{where}: seed_ranges: expected an object with {list(REQUIRED_SEED_USES)}, got {ranges!r}.")
    missing = [use for use in REQUIRED_SEED_USES if use not in ranges]
    unknown = sorted(set(ranges) - set(SEED_USES))
    if missing or unknown:
        raise InputError(
            f"{where}: seed_ranges: expected {list(REQUIRED_SEED_USES)} (and optionally 'measurements'); "
            f"missing {missing}, unknown {unknown}."
        )
    return {use: _seed_range(ranges[use], f"{where}: seed_ranges.{use}", use) for use in SEED_USES if use in ranges}


def _used_before(document: dict, where: str) -> tuple[SeedRange, ...]:
    items = document.get("used_before", [])
    if not isinstance(items, list):
        raise InputError(f"{where}: used_before: expected a list of seed ranges, got {items!r}.")
    return tuple(_seed_range(item, f"{where}: used_before[{i}]", f"used_before[{i}]") for i, item in enumerate(items))


def _check_seed_ranges(ranges: Mapping[str, SeedRange], used_before: Iterable[SeedRange], where: str) -> None:
    names = list(ranges)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if ranges[a].overlaps(ranges[b]):
                raise InputError(
                    f"{where}: seed_ranges.{b}: {ranges[b].first}..{ranges[b].last} overlaps seed_ranges.{a} "
                    f"({ranges[a].first}..{ranges[a].last}); the seeds for each use are disjoint."
                )
    for use in HELD_OUT_USES:
        if use not in ranges:
            continue
        for old in used_before:
            if ranges[use].overlaps(old):
                raise InputError(
                    f"{where}: seed_ranges.{use}: {ranges[use].first}..{ranges[use].last} overlaps {old.name} "
                    f"({old.first}..{old.last}, {old.use}); {use} seeds must be ones no script used before."
                )


def _to_train(document: dict, where: str, training: SeedRange, named: set[str]) -> tuple[Mapping[str, Any], ...]:
    items = document.get("to_train", [])
    if not isinstance(items, list):
        raise InputError(f"{where}: to_train: expected a list, got {items!r}.")
    for index, item in enumerate(items):
        name = f"{where}: to_train[{index}]"
        if not isinstance(item, dict):
            raise InputError(f"{name}: expected an object, got {item!r}.")
        for key in ("family", "command", "policy_file"):
            if not isinstance(item.get(key), str) or not item[key]:
                raise InputError(f"{name}.{key}: expected a non-empty string, got {item.get(key)!r}.")
        if item["policy_file"] in named:
            raise InputError(f"{name}.policy_file: {item['policy_file']} is already named by a pool.")
        seeds = item.get("reset_seeds")
        if not (isinstance(seeds, list) and len(seeds) == 2):
            raise InputError(f"{name}.reset_seeds: expected [first, last], got {seeds!r}.")
        first, last = _int(seeds[0], f"{name}.reset_seeds"), _int(seeds[1], f"{name}.reset_seeds")
        if not (training.first <= first <= last <= training.last):
            raise InputError(
                f"{name}.reset_seeds: {first}..{last} must lie in seed_ranges.training "
                f"({training.first}..{training.last})."
            )
    return tuple(items)
