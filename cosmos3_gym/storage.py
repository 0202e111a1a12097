"""Crash-safe saving: the one protocol every artifact of this package is written with.

A save never writes over what it replaces. It writes into a new staging place beside the target, fsyncs every file and
directory, records a manifest (``MANIFEST.json``: each file's size and sha256) and only then makes the new data
visible with ``rename(2)``, which is atomic; the previous data stays complete on disk until the new data is. A process
killed at any point leaves either the old artifact or the new one, never a mixture nobody notices. Three shapes:

* **Snapshots** (training state, FSDP/DCP state): ``save_snapshot(parent, step, fill)`` writes ``parent/step-N/`` as a
  whole new folder (``parent/.step-N.partial`` until one rename commits it) and keeps the previous snapshot.
  ``latest_snapshot(parent)`` returns the newest snapshot whose manifest checks out; a damaged one is refused with a
  one-line ``CheckpointError`` naming the file, logged and skipped when an older good snapshot exists.
* **Entries of a folder** (an exported checkpoint's ``transformer/``, ``vae/``, ...; a VAE, a light decoder, a reward
  model): ``replace_entries(folder, fill)`` stages the new entries in ``folder/.cosmos3-staging/new``, writes their
  manifest, commits them by renaming ``new`` to ``ready`` and then moves each entry into place (the old one aside
  first). A crash before the commit leaves the previous entries untouched (the staging is discarded by the next save);
  a crash after it is rolled forward by the next save or ``finish_interrupted_save(folder)``; readers refuse a folder
  left half-moved (``check_no_interrupted_save``). The folder's ``MANIFEST.json`` lists the artifact's files (other
  files there, e.g. a training log, are not part of it).
* **Single files** (policy files, GRPO checkpoints, latent-cache entries): ``atomic_write`` writes a temporary file in
  the same folder, fsyncs it and renames it over the target; ``save_safetensors`` also stores a sha256 of the tensors
  in the file's metadata, which ``load_safetensors`` verifies.

Fault injection, for tests: the environment variable ``COSMOS3_GYM_STORAGE_FAULT`` set to ``kill:N`` makes the process
SIGKILL itself at the N-th point of the protocol it reaches (1-based: after each file, before and after each commit and
each move; the world-model trainer adds one after each training step), and ``sleep:S`` sleeps S seconds at every such
point (both: ``sleep:S,kill:N``), so that kills from outside land inside every phase of a save too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cosmos3_gym.errors import CheckpointError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "cosmos3_gym.manifest.v1"
STAGING_DIR = ".cosmos3-staging"  # replace_entries' journal inside the folder it writes
SNAPSHOT_PREFIX = "step-"
_SNAPSHOT_PATTERN = re.compile(rf"^{SNAPSHOT_PREFIX}(\d+)$")
_PARTIAL = ".partial"
CHECKSUM_KEY = "cosmos3_gym.sha256"  # save_safetensors' metadata entry: the sha256 of the tensors
FAULT_ENV_VAR = "COSMOS3_GYM_STORAGE_FAULT"
_CHUNK = 1 << 20

_fault_points_reached = 0


def fault_point(phase: str) -> None:
    """A point of the protocol where a test may kill this process (``COSMOS3_GYM_STORAGE_FAULT``, module docstring)."""
    spec = os.environ.get(FAULT_ENV_VAR)
    if not spec:
        return
    global _fault_points_reached
    _fault_points_reached += 1
    for part in spec.split(","):
        kind, _, value = part.partition(":")
        if kind == "kill" and _fault_points_reached == int(value):
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sleep":
            time.sleep(float(value))


# ----------------------------------------------------------------------------------------------------------------
# Durability
# ----------------------------------------------------------------------------------------------------------------


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (renames, new files) durable; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root``), deepest first."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(os.path.join(directory, name))
        fsync_dir(directory)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ----------------------------------------------------------------------------------------------------------------
# Manifests
# ----------------------------------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(root: Path, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``root/MANIFEST.json`` listing every file under ``root`` (size, sha256) after fsyncing them all."""
    root = Path(root)
    fsync_tree(root)
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if relative != MANIFEST_NAME:
            files[relative] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": MANIFEST_FORMAT, **dict(extra or {}), "files": files}
    path = root / MANIFEST_NAME
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    fsync_dir(root)
    fault_point("manifest written")
    return manifest


def read_manifest(root: str | os.PathLike, what: str = "checkpoint") -> dict[str, Any] | None:
    """``root/MANIFEST.json`` parsed (None when there is none); ``CheckpointError`` when it is unreadable."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{what}: {path} is not a readable manifest ({_one_line(error)})") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{what}: {path} is not a {MANIFEST_FORMAT} manifest")
    return manifest


def is_weights_file(relative: str) -> bool:
    """The files a model loader checks against its folder's manifest: the weights (large, opaque). Its JSON configs
    are parsed and checked field by field instead, and users may edit them (e.g. a checkpoint's meta.json)."""
    return relative.endswith(".safetensors")


def verify_manifest(
    root: str | os.PathLike,
    *,
    what: str = "checkpoint",
    checksums: bool = True,
    required: bool = True,
    only: Callable[[str], bool] | None = None,
) -> dict[str, Any] | None:
    """Check every file ``root/MANIFEST.json`` lists (those ``only`` accepts, by relative path): present, of the listed
    size and (``checksums``) sha256.

    ``CheckpointError`` names the first bad file; a missing manifest is an error when ``required`` (a snapshot without
    one was never completed), else None is returned."""
    root = Path(root)
    manifest = read_manifest(root, what)
    if manifest is None:
        if required:
            raise CheckpointError(f"{what}: {root} has no {MANIFEST_NAME} (an incomplete save)")
        return None
    for relative, entry in manifest["files"].items():
        if only is not None and not only(relative):
            continue
        path = root / relative
        if not isinstance(entry, dict) or ".." in Path(relative).parts or Path(relative).is_absolute():
            raise CheckpointError(f"{what}: {root / MANIFEST_NAME} has a malformed entry for {relative!r}")
        if not path.is_file():
            raise CheckpointError(f"{what}: missing file {path} (listed in {root / MANIFEST_NAME})")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(
                f"{what}: {path} is {size} bytes but {MANIFEST_NAME} says {entry.get('size')}: truncated or damaged"
            )
        if checksums and sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(f"{what}: {path} does not match its sha256 in {MANIFEST_NAME}: the file is damaged")
    return manifest


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]


# ----------------------------------------------------------------------------------------------------------------
# Single files
# ----------------------------------------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(parent: Path, name: str) -> None:
    """Temporary files of ``atomic_write`` for ``name`` whose writer is gone (killed mid-write)."""
    for stale in parent.glob(f".{glob_escape(name)}{_PARTIAL}-*"):
        pid = stale.name.rsplit("-", 2)[-2] if stale.name.count("-") >= 2 else ""
        if pid.isdigit() and not _pid_alive(int(pid)):
            stale.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Call ``write(temporary)`` for a temporary path beside ``path``, fsync it and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(path.parent, path.name)
    temporary = path.with_name(f".{path.name}{_PARTIAL}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        write(temporary)
        fault_point(f"{path.name} written")
        fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    fault_point(f"{path.name} committed")
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def tensor_digest(tensors: Mapping[str, Any]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes (in name order), as ``save_safetensors`` records."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        if tensor.numel():
            digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def save_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None
) -> Path:
    """``safetensors.torch.save_file`` through ``atomic_write``, with the tensors' sha256 in the metadata."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    # JSON-encoded like the metadata values of this package's files (their readers decode every value as JSON).
    metadata = {**dict(metadata or {}), CHECKSUM_KEY: json.dumps(tensor_digest(tensors))}
    return atomic_write(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))


def load_safetensors(
    path: str | os.PathLike, *, device: Any = "cpu", what: str = "weights"
) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors and the metadata (without the checksum entry) of a safetensors file; the checksum
    ``save_safetensors`` stored is verified (files without one load as they are). ``CheckpointError`` (one line,
    naming the file) for a missing, unreadable or damaged file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what}: missing file {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
        tensors = load_file(str(path), device="cpu")
    except Exception as error:  # safetensors raises SafetensorError, OSError, ... for damaged files
        raise CheckpointError(f"{what}: {path} is not a readable safetensors file ({_one_line(error)})") from error
    expected = metadata.pop(CHECKSUM_KEY, None)
    if expected is not None and json.dumps(tensor_digest(tensors)) != expected:
        raise CheckpointError(f"{what}: {path} does not match the checksum it was saved with: the file is damaged")
    if str(device) != "cpu":
        tensors = {name: tensor.to(device) for name, tensor in tensors.items()}
    return tensors, metadata


# ----------------------------------------------------------------------------------------------------------------
# Snapshots
# ----------------------------------------------------------------------------------------------------------------


def snapshot_path(parent: str | os.PathLike, step: int) -> Path:
    return Path(parent) / f"{SNAPSHOT_PREFIX}{int(step):09d}"


def snapshots(parent: str | os.PathLike) -> list[tuple[int, Path]]:
    """The committed snapshots in ``parent``, newest (highest step) first."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        match = _SNAPSHOT_PATTERN.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def begin_snapshot(parent: str | os.PathLike, step: int) -> Path:
    """A fresh, empty staging folder for snapshot ``step`` (the leftovers of interrupted saves are removed). Call on
    one process only; with several writers (FSDP ranks), the others write into it after a barrier."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{SNAPSHOT_PREFIX}*{_PARTIAL}"):
        _remove(stale)
    staging = parent / f".{snapshot_path(parent, step).name}{_PARTIAL}"
    staging.mkdir()
    fsync_dir(parent)
    return staging


def commit_snapshot(
    parent: str | os.PathLike, step: int, staging: Path, *, keep: int = 2, extra: Mapping[str, Any] | None = None
) -> Path:
    """Write the manifest of ``staging`` (fsyncing everything), rename it to ``step-N`` and delete all but the newest
    ``keep`` snapshots. An existing snapshot of the same step is replaced (moved aside first, then deleted)."""
    parent = Path(parent)
    write_manifest(staging, {"step": int(step), **dict(extra or {})})
    target = snapshot_path(parent, step)
    replaced = None
    if target.exists():
        replaced = parent / f".{target.name}.replaced{_PARTIAL}"
        _remove(replaced)
        os.rename(target, replaced)
    fault_point("snapshot staged")
    os.rename(staging, target)
    fsync_dir(parent)
    fault_point("snapshot committed")
    if replaced is not None:
        _remove(replaced)
    for _, old in snapshots(parent)[max(int(keep), 1) :]:
        shutil.rmtree(old, ignore_errors=True)
        fault_point("old snapshot removed")
    fsync_dir(parent)
    return target


def save_snapshot(
    parent: str | os.PathLike,
    step: int,
    fill: Callable[[Path], Any],
    *,
    keep: int = 2,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """``fill(staging)`` writes the snapshot's files; then ``commit_snapshot``. Returns ``parent/step-N``."""
    staging = begin_snapshot(parent, step)
    try:
        fill(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fault_point("snapshot filled")
    return commit_snapshot(parent, step, staging, keep=keep, extra=extra)


def latest_snapshot(
    parent: str | os.PathLike, *, what: str = "resume", checksums: bool = True
) -> tuple[int, Path] | None:
    """The newest snapshot in ``parent`` whose files match its manifest, as ``(step, path)``; None when there is none.

    A damaged snapshot is skipped with a warning naming the bad file when an older good one exists (the fallback is
    logged); when every snapshot is damaged, the newest one's ``CheckpointError`` is raised."""
    failures: list[CheckpointError] = []
    for step, path in snapshots(parent):
        try:
            verify_manifest(path, what=what, checksums=checksums)
        except CheckpointError as error:
            logger.warning("%s", error)
            failures.append(error)
            continue
        if failures:
            logger.warning("%s: falling back to the previous good state %s (step %d)", what, path, step)
        return step, path
    if failures:
        raise failures[0]
    return None


# ----------------------------------------------------------------------------------------------------------------
# Entries of a folder
# ----------------------------------------------------------------------------------------------------------------


def replace_entries(folder: str | os.PathLike, fill: Callable[[Path], Any]) -> Path:
    """Write an artifact into ``folder`` without ever leaving it half-written (module docstring).

    ``fill(staging)`` writes the artifact's files and folders into an empty staging folder; each top-level entry it
    writes then replaces the entry of that name in ``folder`` (a folder entry as a whole: stale files of an earlier
    save do not survive). Other entries of ``folder`` are left alone. Returns ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    finish_interrupted_save(folder)
    journal = folder / STAGING_DIR
    _remove(journal)
    new = journal / "new"
    new.mkdir(parents=True)
    try:
        fill(new)
    except BaseException:
        shutil.rmtree(journal, ignore_errors=True)
        raise
    fault_point("entries filled")
    write_manifest(new)
    os.rename(new, journal / "ready")
    fsync_dir(journal)
    fault_point("entries committed")
    _roll_forward(folder)
    return folder


def finish_interrupted_save(folder: str | os.PathLike) -> bool:
    """Complete a ``replace_entries`` save that a crash interrupted after its commit (move the rest of its entries into
    place), or discard one interrupted before (the previous entries were never touched). True when one was found."""
    journal = Path(folder) / STAGING_DIR
    if not journal.exists():
        return False
    if (journal / "ready").is_dir():
        _roll_forward(Path(folder))
    else:
        _remove(journal)
        fsync_dir(folder)
    return True


def check_no_interrupted_save(folder: str | os.PathLike, what: str = "checkpoint") -> None:
    """``CheckpointError`` when ``folder`` holds a committed save whose entries are not all in place yet."""
    ready = Path(folder) / STAGING_DIR / "ready"
    if ready.is_dir():
        raise CheckpointError(
            f"{what}: {folder} holds an interrupted save ({ready}); save again, or call "
            f"cosmos3_gym.storage.finish_interrupted_save({str(folder)!r}) to complete it"
        )


def _roll_forward(folder: Path) -> None:
    journal = folder / STAGING_DIR
    ready, aside = journal / "ready", journal / "old"
    aside.mkdir(exist_ok=True)
    # The manifest last: a folder whose MANIFEST.json is the new one has every new entry in place.
    entries = sorted(ready.iterdir(), key=lambda p: (p.name == MANIFEST_NAME, p.name))
    for entry in entries:
        target = folder / entry.name
        if target.exists() or target.is_symlink():
            _remove(aside / entry.name)
            os.rename(target, aside / entry.name)
            fault_point(f"old {entry.name} moved aside")
        os.rename(entry, target)
        fault_point(f"new {entry.name} moved in")
    fsync_dir(folder)
    shutil.rmtree(journal)
    fsync_dir(folder)
    fault_point("entries done")
