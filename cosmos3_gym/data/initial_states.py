"""Where episodes start: a collection of initial frames, each with an optional task instruction.

An initial-state source is given as

* ``"lerobot:PATH"``: the first frame and task of every episode of a LeRobot dataset (``training.lerobot``);
* a folder: every image (.png .jpg .jpeg .bmp .webp), video (.mp4 .gif .webm .avi .mov .mkv), ``.npy`` frame array
  or ``.npz`` archive in it (sorted by name) is one initial state;
* one such file;
* an in-memory frame: a numpy array ``HWC``/``THWC``, a torch tensor, a PIL image;
* a list mixing any of these, or dicts ``{"frames": ..., "task": ...}``.

Only the first frame of a video or frame array is used. Tasks come from an ``.npz`` key ``task`` (or
``instruction``), from a sidecar text file ``<stem>.txt`` next to any file, or from a dict's ``"task"``. Files are
read when an episode starts, so a folder of hundreds of videos costs nothing up front; a file that cannot be read
raises ``InputError`` naming it. Pickled ``.npy`` files (RLinf's trajectory format) are refused: unpickling can run
arbitrary code; convert them to ``.npz`` with a ``frames`` array and a ``task`` string.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .. import processor
from ..checkpoint import StartFramesArchive
from ..errors import CheckpointError, InputError
from ..host_threads import map_in_threads
from ..media import to_uint8

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
ARRAY_SUFFIXES = (".npy", ".npz")
SUPPORTED_SUFFIXES = IMAGE_SUFFIXES + processor.VIDEO_SUFFIXES + ARRAY_SUFFIXES
_NPZ_FRAME_KEYS = ("frames", "images", "image")
_NPZ_TASK_KEYS = ("task", "instruction")


@dataclass(frozen=True)
class InitialState:
    """One episode start: an RGB frame ``[H, W, 3]`` uint8 and its task (None when the source has none)."""

    frame: np.ndarray
    task: str | None
    source: str  # where it came from: a path, "<dict>" or the in-memory type, for messages and debugging


class InitialStateSource:
    """An indexable collection of initial states; ``source[i]`` reads item ``i`` (files are read on access)."""

    def __init__(self, items: list[Any], description: str):
        if not items:
            raise InputError(f"initial_states: {description} holds no initial states.")
        self._items = items
        self.description = description

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> InitialState:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self):
            raise InputError(f"initial_state_index: expected an integer in [0, {len(self)}), got {index!r}.")
        return read_initial_state(self._items[int(index)], field=f"initial_states[{int(index)}]")


def load_initial_states(spec: Any) -> InitialStateSource | None:
    """An ``InitialStateSource`` for any of the forms listed in the module docstring (None stays None)."""
    if spec is None:
        return None
    if isinstance(spec, InitialStateSource):
        return spec
    if isinstance(spec, StartFramesArchive):  # a checkpoint's meta.json archive: N start states
        try:
            return InitialStateSource(read_initial_states_archive(spec.path), f"archive {spec.path}")
        except InputError as error:
            raise CheckpointError(f"checkpoint: meta.json field 'initial_states': {error}") from error
    if isinstance(spec, str) and spec.startswith("lerobot:"):  # every episode's first frame and task
        return lerobot_initial_states(spec)
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
            if not files:
                raise InputError(
                    f"initial_states: folder {path} has no image, video, .npy or .npz files "
                    f"(expected suffixes {list(SUPPORTED_SUFFIXES)})."
                )
            return InitialStateSource(files, f"folder {path}")
        if not path.is_file():
            raise InputError(f"initial_states: {path} is neither a folder nor a file.")
        return InitialStateSource([path], f"file {path}")
    if isinstance(spec, (list, tuple)):
        return InitialStateSource(list(spec), f"a list of {len(spec)} items")
    return InitialStateSource([spec], "an in-memory frame")


def lerobot_initial_states(path, camera: str | None = None) -> InitialStateSource:
    """Every episode's first frame and task of a LeRobot dataset (read on access)."""
    from .lerobot import LeRobotDataset

    dataset = LeRobotDataset(path, camera=camera)

    class LeRobotInitialStates(InitialStateSource):
        def __getitem__(self, index: int) -> InitialState:
            if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self):
                raise InputError(f"initial_state_index: expected an integer in [0, {len(self)}), got {index!r}.")
            i = int(index)
            frame = dataset.read_frames(i, 0, 1)[0]
            task = dataset.episodes[i].tasks[0] if dataset.episodes[i].tasks else dataset.read_rows(i)["task"]
            return InitialState(frame, task or None, f"{dataset.root} episode {dataset.episodes[i].index}")

    return LeRobotInitialStates(list(range(len(dataset))), f"LeRobot dataset {dataset.root} ({dataset.camera})")


def read_initial_states_archive(path: str | os.PathLike) -> list[dict[str, Any]]:
    """An ``.npz`` archive of start frames (``frames`` uint8 ``[N, H, W, 3]``, optional 0-d ``task``) as N start
    states ``{"frames", "task"}`` (given to the env directly, an .npz file is ONE start state: its first frame)."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            frames = archive["frames"]
            task = str(archive["task"]) if "task" in archive.files else None
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"initial_states: cannot read the start frames archive {path} ({error}).") from error
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise InputError(
            f"initial_states: {path} 'frames' must be uint8 [N, H, W, 3] with N >= 1, got {frames.dtype} "
            f"{list(frames.shape)}."
        )
    return [{"frames": frame, "task": task} for frame in frames]


def read_initial_state(item: Any, field: str = "initial_states") -> InitialState:
    """Read one item (path, frame, or ``{"frames", "task"}`` dict) as an ``InitialState``."""
    if isinstance(item, InitialState):
        return item
    if isinstance(item, dict):
        unknown = sorted(set(item) - {"frames", "task"})
        if unknown or "frames" not in item:
            raise InputError(f"{field}: a dict item needs the key 'frames' and optionally 'task', got {sorted(item)}.")
        task = check_task(item.get("task"), f"{field}['task']")
        return InitialState(first_frame(item["frames"], field), task, "<dict>")
    if isinstance(item, (str, os.PathLike)):
        return _read_file(Path(item), field)
    return InitialState(first_frame(item, field), None, f"<{type(item).__name__}>")


def first_frame(frames: Any, field: str) -> np.ndarray:
    """The first frame of anything ``processor.load_frames`` reads, as uint8 ``[H, W, 3]``."""
    if isinstance(frames, torch.Tensor) and frames.ndim == 4:
        frames = frames[:1]  # don't convert a whole video tensor to read one frame
    elif isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = frames[:1]
    try:
        return to_uint8(processor.load_frames(frames)[0])
    except InputError as error:
        raise InputError(f"{field}: {error}") from error


def check_task(task: Any, field: str) -> str | None:
    if task is not None and not isinstance(task, str):
        raise InputError(f"{field}: expected a string (or None), got {type(task).__name__}.")
    return task


def _read_file(path: Path, field: str) -> InitialState:
    field = f"{field} ({path})"
    if not path.is_file():
        raise InputError(f"{field}: file not found.")
    suffix = path.suffix.lower()
    task = None
    if suffix == ".npy":
        frames = _load_numpy(path, field)
    elif suffix == ".npz":
        with _load_numpy(path, field) as archive:
            frame_key = next((key for key in _NPZ_FRAME_KEYS if key in archive.files), None)
            if frame_key is None:
                raise InputError(f"{field}: expected one of the keys {list(_NPZ_FRAME_KEYS)}, found {archive.files}.")
            task_key = next((key for key in _NPZ_TASK_KEYS if key in archive.files), None)
            try:  # an .npz reads each array when it is accessed
                frames = archive[frame_key]
                if task_key is not None:
                    task = str(np.asarray(archive[task_key]).reshape(-1)[0])
            except ValueError as error:
                raise _numpy_error(field, error) from error
    elif suffix in processor.VIDEO_SUFFIXES:
        frames = _read_first_video_frame(path, field)
    elif suffix in IMAGE_SUFFIXES:
        frames = _read_image(path, field)
    else:
        frames = path  # any other suffix: processor.load_frames tries it as an image
    sidecar = path.with_suffix(".txt")
    if task is None and sidecar.is_file():
        task = sidecar.read_text().strip()
    return InitialState(first_frame(frames, field), task, str(path))


def _load_numpy(path: Path, field: str):
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise _numpy_error(field, error) from error


def _numpy_error(field: str, error: Exception) -> InputError:
    if "allow_pickle" in str(error):
        return InputError(
            f"{field}: the file holds pickled Python objects, which cosmos3_gym does not load (unpickling can run "
            "code); save the frames as a numeric array (.npy) or an .npz with 'frames' and 'task'."
        )
    return InputError(f"{field}: cannot read it as a numpy file ({error}).")


def _read_image(path: Path, field: str) -> Image.Image:
    """An image file, read in full here so that one that is not an image says so (``processor.load_frames`` converts
    it: grayscale, RGBA and 16-bit images become RGB)."""
    try:
        image = Image.open(path)
        image.load()
    except (OSError, ValueError) as error:  # PIL.UnidentifiedImageError is an OSError; truncated data too
        raise InputError(f"{field}: not a readable image ({error}).") from error
    return image


def _read_first_video_frame(path: Path, field: str) -> np.ndarray:
    import imageio.v3 as iio

    # GIF frames are palette images; ask Pillow for RGB, as processor.load_frames does.
    options = {"plugin": "pillow", "mode": "RGB"} if path.suffix.lower() == ".gif" else {}
    try:
        return np.asarray(iio.imread(path, index=0, **options))
    except Exception as error:  # imageio/ffmpeg raise many exception types for unreadable files
        raise InputError(f"{field}: cannot read the first frame of the video ({error}).") from error


def resize_frame(frame: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """uint8 ``[H, W, 3]`` -> uint8 ``[h, w, 3]`` (Pillow bicubic, antialiased when shrinking); a no-op at that size."""
    if frame.shape[:2] == tuple(size_hw):
        return frame
    height, width = size_hw
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC))


def resize_frames(frames: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """uint8 ``[B, H, W, 3]`` -> a new uint8 ``[B, h, w, 3]``, each frame by ``resize_frame`` (the same bytes).

    A vector env's observations at 128 envs were 0.15 s of Pillow per step on one core, a third of the whole env
    step in the GRPO loop (``benchmarks/results/rl/grpo_loop_profile_h200.json``); Pillow releases the GIL while it
    resizes, so the batch is split over a thread pool."""
    if frames.shape[1:3] == tuple(size_hw):
        return frames.copy()
    return np.stack(map_in_threads(lambda frame: resize_frame(frame, size_hw), list(frames)))
