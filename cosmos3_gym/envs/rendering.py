"""Gymnasium rendering for the world-model envs: ``rgb_array``, ``rgb_array_list`` and ``human``.

One env step is one chunk of ``chunk`` generated frames, ``chunk / fps`` seconds of the robot's time.

* ``rgb_array``: ``render()`` returns the current (last generated) frame.
* ``rgb_array_list``: ``render()`` returns every frame since the last ``reset()`` or ``render()`` call: the reset
  frame, then all ``chunk`` frames of every step (Gymnasium's ``RenderCollection`` semantics). Save them at
  ``env.settings.fps`` for real-time video (``gymnasium.utils.save_video(frames, DIR, fps=env.settings.fps)``).
* ``human``: each reset frame and every generated frame is shown in a window at ``fps`` (pygame, else OpenCV).
  Where there is no display (no ``DISPLAY`` / ``WAYLAND_DISPLAY`` on Linux) or neither library is installed, making
  the env raises ``InputError``, and ``metadata["render_modes"]`` does not list "human" (Gymnasium's env checker
  makes the env in every listed mode). ``SDL_VIDEODRIVER`` (e.g. ``dummy``) counts as a display for pygame.

``metadata["render_fps"]`` is ``fps / chunk``, the env's step rate: Gymnasium's ``RecordVideo`` records one frame per
step (the last of a list), so at that rate its videos play in real time. It depends on the checkpoint, so the class
attribute is None and each instance sets its own.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InputError

if TYPE_CHECKING:
    import pygame


def check_render_mode(render_mode: str | None, render_modes: Sequence[str]) -> str | None:
    if render_mode == "human":
        _check_human_rendering()  # the clear error where "human" is not listed for want of a display
        return render_mode  # a display may have appeared (or SDL_VIDEODRIVER been set) since the import
    if render_mode is not None and render_mode not in render_modes:
        raise InputError(f"render_mode: expected None or one of {list(render_modes)}, got {render_mode!r}.")
    return render_mode


def step_rate(fps: float, chunk: int) -> float:
    """Env steps per second of robot time: ``metadata["render_fps"]``."""
    return fps / chunk


def _has_display() -> bool:
    if sys.platform in ("darwin", "win32"):
        return True
    return any(os.environ.get(name) for name in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"))


def _window_backend() -> str | None:
    for module in ("pygame", "cv2"):
        try:
            __import__(module)
            return module
        except ImportError:
            continue
    return None


def _check_human_rendering() -> None:
    if _window_backend() is None:
        raise InputError(
            "render_mode: 'human' needs pygame or opencv-python to open a window (pip install pygame); use "
            "'rgb_array' or 'rgb_array_list' to get the frames instead."
        )
    if not _has_display():
        raise InputError(
            "render_mode: 'human' needs a display, and there is none (DISPLAY and WAYLAND_DISPLAY are not set); use "
            "'rgb_array' or 'rgb_array_list' to get the frames, or gymnasium.wrappers.RecordVideo to save them."
        )


def human_rendering_available() -> bool:
    return _window_backend() is not None and _has_display()


# "human" is listed only where a window can open: Gymnasium's env checker makes the env in every listed mode.
RENDER_MODES = ("rgb_array", "rgb_array_list") + (("human",) if human_rendering_available() else ())


class Renderer:
    """The render state of one env: the frames ``rgb_array_list`` collects and the ``human`` window."""

    def __init__(self, render_mode: str | None, fps: float, title: str = "cosmos3_gym"):
        self.render_mode = render_mode
        self.fps = fps
        self.title = title
        self._collected: list[np.ndarray] = []
        self._window: _PygameWindow | _OpenCVWindow | None = None

    def on_reset(self, frame: np.ndarray) -> None:
        if self.render_mode == "rgb_array_list":
            self._collected = [frame]
        elif self.render_mode == "human":
            self._show([frame])

    def on_step(self, frames: np.ndarray) -> None:
        """``frames``: the step's generated frames uint8 ``[chunk, H, W, 3]``."""
        if self.render_mode == "rgb_array_list":
            self._collected.extend(frames)
        elif self.render_mode == "human":
            self._show(frames)

    def collected(self) -> list[np.ndarray]:
        """The frames since the last reset or call (``rgb_array_list``); the list starts anew."""
        frames, self._collected = self._collected, []
        return frames

    def close(self) -> None:
        if self._window is not None:
            self._window.close()
            self._window = None

    def _show(self, frames: Iterable[np.ndarray]) -> None:
        if self._window is None:
            self._window = _PygameWindow(self.title) if _window_backend() == "pygame" else _OpenCVWindow(self.title)
        for frame in frames:
            started = time.perf_counter()
            self._window.show(frame)
            time.sleep(max(0.0, 1.0 / self.fps - (time.perf_counter() - started)))


class _PygameWindow:
    def __init__(self, title: str):
        import pygame

        self._pygame = pygame
        pygame.display.init()
        pygame.display.set_caption(title)
        self._surface: pygame.Surface | None = None

    def show(self, frame: np.ndarray) -> None:
        pygame = self._pygame
        height, width = frame.shape[:2]
        if self._surface is None or self._surface.get_size() != (width, height):
            self._surface = pygame.display.set_mode((width, height))
        pygame.event.pump()  # keeps the window responsive
        self._surface.blit(pygame.surfarray.make_surface(np.ascontiguousarray(frame.transpose(1, 0, 2))), (0, 0))
        pygame.display.flip()

    def close(self) -> None:
        self._pygame.display.quit()


class _OpenCVWindow:
    def __init__(self, title: str):
        import cv2

        self._cv2 = cv2
        self._title = title

    def show(self, frame: np.ndarray) -> None:
        self._cv2.imshow(self._title, frame[..., ::-1])  # OpenCV shows BGR
        self._cv2.waitKey(1)

    def close(self) -> None:
        self._cv2.destroyWindow(self._title)
