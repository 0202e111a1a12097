"""``InverseDynamicsAgent``: Cosmos3's inverse-dynamics mode (video -> the action chunk that produced it).

Uses: labelling action-free videos with actions (``label_video``), and measuring how faithfully the world model
follows commanded actions: generate a chunk with forward dynamics, infer the actions back from the generated frames
and compare (``action_following_error``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..processor import load_frames
from .base import EngineAgent

__all__ = ["InverseDynamicsAgent", "action_errors", "video_windows"]


class InverseDynamicsAgent(EngineAgent):
    """``agent.infer(frames)`` (or ``agent(frames)``): ``chunk + 1`` frames -> the ``[chunk, raw_action_dim]`` actions
    between them, in the model's normalised space (not clipped: they are measurements).

    ``frames``: a list of images or an array ``[chunk + 1, H, W, 3]`` (uint8, or float in [0, 1]) or float
    ``[chunk + 1, 3, H, W]`` in [0, 1]. A list of such videos, or a 5-D array, is a batch: ``[N, chunk, raw]`` from
    ONE batched ``engine.step``. Seeds follow ``seed`` as in ``PolicyAgent``.
    """

    mode = "inverse_dynamics"
    default_task = ""

    def infer(self, frames: Any, task: str | Sequence[str] | None = None) -> np.ndarray:
        """Actions between the frames of one video ``[chunk, raw]`` or of each video of a batch ``[N, chunk, raw]``."""
        videos, batched = _split_videos(frames)
        for video in videos:
            if video.shape[0] != self.chunk + 1:
                raise InputError(
                    f"frames: expected chunk + 1 = {self.chunk + 1} frames per video, got {video.shape[0]}"
                )
        tasks = self._tasks(task, len(videos))
        actions = self._run([self._request(video, task) for video, task in zip(videos, tasks)])
        return actions if batched else actions[0]

    __call__ = infer

    def label_video(
        self, frames: Any, chunk: int | None = None, task: str | None = None, batch_size: int | None = None
    ) -> np.ndarray:
        """Label every transition of a long video: ``T`` frames -> actions ``[T - 1, raw_action_dim]``.

        The video is cut into consecutive ``chunk + 1``-frame windows that share their end frames (see
        ``video_windows``); the windows run ``batch_size`` at a time (default: all in one ``engine.step``).
        """
        chunk = self.chunk if chunk is None else chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise InputError(f"chunk: expected an integer >= 1, got {chunk!r}")
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise InputError(f"batch_size: expected an integer >= 1 or None, got {batch_size!r}")
        if task is not None and not isinstance(task, str):
            raise InputError(f"task: expected one string for the whole video, got {type(task).__name__}")
        video = _video_frames(frames)
        windows = video_windows(video.shape[0], chunk)
        task = self._tasks(task, 1)[0]
        requests = [self._request(video[start : start + chunk + 1], task, chunk=chunk) for start, _ in windows]
        batch_size = batch_size or len(requests)
        actions = np.concatenate([self._run(requests[i : i + batch_size]) for i in range(0, len(requests), batch_size)])
        return np.concatenate([window_actions[chunk - keep :] for window_actions, (_, keep) in zip(actions, windows)])

    def action_following_error(
        self, frames: Any, commanded_actions: Any, task: str | Sequence[str] | None = None
    ) -> dict[str, Any]:
        """How well generated ``frames`` follow ``commanded_actions``: infer the actions from the frames and compare.

        ``frames``/``commanded_actions``: one video and its ``[chunk, raw]`` actions, or a batch of videos and
        ``[N, chunk, raw]``. Returns ``action_errors(inferred, commanded)`` plus the ``inferred_actions``.
        """
        commanded = _as_float_array(commanded_actions, "commanded_actions")
        expected_tail = (self.chunk, self.raw_action_dim)
        if commanded.shape[-2:] != expected_tail or commanded.ndim not in (2, 3):
            raise InputError(
                f"commanded_actions: expected [chunk, raw_action_dim] = {list(expected_tail)} or [N, ...] of it, "
                f"got {list(commanded.shape)}"
            )
        inferred = self.infer(frames, task)
        if inferred.shape != commanded.shape:
            raise InputError(
                f"commanded_actions: shape {list(commanded.shape)} does not match the frames, which give "
                f"{list(inferred.shape)}"
            )
        return {**action_errors(inferred, commanded), "inferred_actions": inferred}


def action_errors(inferred: np.ndarray, commanded: np.ndarray) -> dict[str, Any]:
    """Errors between inferred and commanded action chunks of the same shape ``[chunk, D]`` or ``[N, chunk, D]``.

    ``mse`` / ``mae``: mean squared / absolute error over the chunk and the action dimensions (a float per chunk,
    an array ``[N]`` for a batch); ``per_step``: the squared error averaged over the action dimensions, ``[chunk]``
    (or ``[N, chunk]``), which shows whether the error grows along the chunk.
    """
    difference = np.asarray(inferred, dtype=np.float64) - np.asarray(commanded, dtype=np.float64)
    squared = np.square(difference)
    mse, mae = squared.mean(axis=(-2, -1)), np.abs(difference).mean(axis=(-2, -1))
    if difference.ndim == 2:
        mse, mae = float(mse), float(mae)
    return {"mse": mse, "mae": mae, "per_step": squared.mean(axis=-1)}


def video_windows(num_frames: int, chunk: int) -> list[tuple[int, int]]:
    """How ``label_video`` covers ``num_frames - 1`` transitions with windows of ``chunk`` transitions.

    Returns ``(start, keep)`` pairs: the window is frames ``[start, start + chunk]`` and its last ``keep`` actions are
    transitions no earlier window labelled. Windows step by ``chunk`` (consecutive windows share an end frame); when
    ``chunk`` does not divide the transitions, one last window ends on the final frame and keeps only its new ones.
    """
    transitions = num_frames - 1
    if transitions < chunk:
        raise InputError(f"frames: expected at least chunk + 1 = {chunk + 1} frames, got {num_frames}")
    windows = [(start, chunk) for start in range(0, transitions - chunk + 1, chunk)]
    labelled = len(windows) * chunk
    if labelled < transitions:
        windows.append((transitions - chunk, transitions - labelled))
    return windows


def _split_videos(frames: Any) -> tuple[list[np.ndarray], bool]:
    """``(videos, batched)``: each video as float32 ``[T, H, W, 3]`` in [0, 1]."""
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise InputError("frames: got an empty list")
        if all(_is_video(item) for item in frames):
            return [_video_frames(item) for item in frames], True
        return [_video_frames(frames)], False
    if isinstance(frames, (np.ndarray, torch.Tensor)) and frames.ndim == 5:
        return [_video_frames(video) for video in frames], True
    return [_video_frames(frames)], False


def _is_video(item: Any) -> bool:
    if isinstance(item, (list, tuple)):
        return True
    return isinstance(item, (np.ndarray, torch.Tensor)) and item.ndim == 4


def _video_frames(video: Any) -> np.ndarray:
    """One video -> float32 ``[T, H, W, 3]`` in [0, 1], with ``[T, 3, H, W]`` numpy arrays read channels-first."""
    if (
        isinstance(video, np.ndarray)
        and video.ndim == 4
        and video.shape[-1] not in (1, 3, 4)
        and video.shape[1] in (1, 3, 4)
    ):
        video = np.moveaxis(video, 1, -1)
    try:
        return load_frames(video)
    except InputError as error:
        raise InputError(str(error).replace("observation:", "frames:", 1)) from error


def _as_float_array(values: Any, field: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().float().numpy()
    try:
        array = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise InputError(f"{field}: expected a numeric array ({error})") from error
    if not np.isfinite(array).all():
        raise InputError(f"{field}: contains NaN or infinity")
    return array
