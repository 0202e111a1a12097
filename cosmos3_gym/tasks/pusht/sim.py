"""gym-pusht's PushT simulator (optional extra ``sim``; imported only when a simulator is made) with the state a
policy, a dataset and a restart from any recorded step need: ``PushTSim`` and ``rollout_episode``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...errors import InputError
from .geometry import RAW_ACTION_DIM, SUCCESS_COVERAGE

__all__ = ["SIM_STATE_FIELDS", "PushTSim", "has_gym_pusht", "require_gym_pusht", "rollout_episode"]

# What ``PushTSim.sim_state`` holds, in order: everything pymunk integrates, so a restored simulator continues as the
# recorded one did (gym-pusht's own ``reset_to_state`` takes positions only and moves the block while setting them).
SIM_STATE_FIELDS = (
    "agent_x",
    "agent_y",
    "agent_vx",
    "agent_vy",
    "block_x",
    "block_y",
    "block_angle",
    "block_vx",
    "block_vy",
    "block_angular_velocity",
)


def require_gym_pusht():
    """Import gym-pusht's ``PushTEnv`` or raise ``ImportError`` saying how to install it."""
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")  # pygame greets on import otherwise
    try:
        from gym_pusht.envs import PushTEnv
    except ImportError as error:
        raise ImportError(
            "the PushT simulator needs gym-pusht: pip install 'cosmos3_gym[sim]' (or pip install gym-pusht)"
        ) from error
    return PushTEnv


class PushTSim:
    """gym-pusht's ``PushTEnv`` rendering ``image_size`` frames, with the state a policy and a dataset need.

    ``reset(seed)`` and ``step(action)`` return the rendered frame (uint8 ``[H, W, 3]``); ``agent_xy``,
    ``block_pose``, ``coverage`` and ``reward`` (of the last step) describe the state. Stepping on after success is
    allowed (gym-pusht would terminate; datasets keep fixed-length episodes). Frames are gym-pusht's "pixels"
    observations pixel for pixel: its 512 x 512 drawing of the table, resized by OpenCV (a downscale for sizes up to
    512), read off the drawing without gym-pusht's slow copy. With ``render_every_step=False``,
    ``reset``/``step``/``restore`` return None and ``render()`` draws the frame on demand (the same pixels; a policy
    acting once per chunk needs one frame per chunk, and drawing costs more than a step). A frame is drawn at most
    once per state: ``render()`` right after ``step()`` returns a copy of the frame the step returned.

    ``sim_state`` (float64 ``[10]``, ``SIM_STATE_FIELDS``) is everything the physics integrates; ``restore(state)``
    puts the simulator back there, so an episode can restart from any recorded step (the same frame; the same
    motion up to pymunk's cached contact impulses, which are not part of the state: paths in contact part by
    hundredths of a pixel).
    """

    def __init__(self, image_size: tuple[int, int] = (256, 256), render_every_step: bool = True):
        height, width = _check_image_size(image_size)
        self.image_size = (height, width)
        self.render_every_step = bool(render_every_step)
        # Always gym-pusht's state env: frames are drawn here (``_draw_frame``), the same pixels as its "pixels"
        # observation at a fraction of the cost.
        self.env = require_gym_pusht()(
            obs_type="state", render_mode="rgb_array", observation_width=width, observation_height=height
        )
        self.fps = float(self.env.metadata["render_fps"])
        self.reward = 0.0
        self.coverage = 0.0
        self._info: dict[str, Any] | None = None
        self._frame: np.ndarray | None = None  # the current state's frame, once drawn

    def reset(self, seed: int) -> np.ndarray | None:
        _, self._info = self.env.reset(seed=int(seed))
        self.reward = 0.0
        # gym-pusht reports coverage only after a step; ask the env for the start's (a private but stable method).
        self.coverage = float(self.env._get_coverage())
        return self._moved()

    def restore(self, state: Sequence[float] | np.ndarray) -> np.ndarray | None:
        """Put the simulator in ``state`` (a ``sim_state``): positions and velocities of the agent and the block."""
        state = np.asarray(state, dtype=np.float64)
        if state.shape != (len(SIM_STATE_FIELDS),) or not np.isfinite(state).all():
            raise InputError(
                f"sim_state: expected {len(SIM_STATE_FIELDS)} finite numbers {SIM_STATE_FIELDS}, got "
                f"shape {state.shape}."
            )
        if self._info is None:
            self.env.reset(seed=0)  # builds the pymunk space
        env = self.env
        env._setup()  # a fresh space: no contact caches from the previous episode
        env.agent.position = tuple(state[0:2])
        env.agent.velocity = tuple(state[2:4])
        # Angle before position: pymunk turns a body about its center of gravity, which would move the origin.
        env.block.angle = float(state[6])
        env.block.position = tuple(state[4:6])
        env.block.velocity = tuple(state[7:9])
        env.block.angular_velocity = float(state[9])
        env.space.reindex_shapes_for_body(env.block)
        env.space.reindex_shapes_for_body(env.agent)
        env._last_action = None
        self._info = env._get_info()
        self.reward = 0.0
        self.coverage = float(env._get_coverage())
        return self._moved()

    @property
    def sim_state(self) -> np.ndarray:
        """float64 ``[10]``: agent position and velocity, block pose (x, y, angle) and velocity (x, y, angular)."""
        if self._info is None:
            raise InputError("PushTSim: call reset(seed) first.")
        agent, block = self.env.agent, self.env.block
        return np.array(
            [*agent.position, *agent.velocity, *block.position, block.angle, *block.velocity, block.angular_velocity],
            dtype=np.float64,
        )

    def step(self, action: Sequence[float] | np.ndarray) -> np.ndarray | None:
        if self._info is None:
            raise InputError("PushTSim: call reset(seed) before step().")
        _, reward, _, _, self._info = self.env.step(np.asarray(action, dtype=np.float64))
        self.reward = float(reward)
        self.coverage = float(self._info["coverage"])
        return self._moved()

    def render(self) -> np.ndarray:
        """The current frame, uint8 ``[H, W, 3]`` (drawn once per state: a policy reading the frame a step has
        just returned gets a copy of it)."""
        if self._info is None:
            raise InputError("PushTSim: call reset(seed) before render().")
        if self._frame is None:
            self._frame = self._draw_frame()
        return self._frame.copy()

    def _moved(self) -> np.ndarray | None:
        """The state changed: the frame to return (drawn now with ``render_every_step``, else on demand)."""
        self._frame = None
        if not self.render_every_step:
            return None
        self._frame = self._draw_frame()
        return self._frame.copy()

    def _draw_frame(self) -> np.ndarray:
        """gym-pusht's observation frame, pixel for pixel: its 512 x 512 drawing (``_draw``) resized by OpenCV to
        ``image_size``. gym-pusht reads the drawing through ``surfarray.pixels3d`` and a transposed copy (0.7 ms,
        more than the physics); a 32-bit XRGB surface's bytes are BGRA in memory, one ``cvtColor`` away (0.02 ms)."""
        import cv2
        import pygame

        screen = self.env._draw()
        rows, columns = screen.get_height(), screen.get_width()
        xrgb = (32, (0xFF0000, 0xFF00, 0xFF), 4 * columns)
        if (screen.get_bitsize(), screen.get_masks()[:3], screen.get_pitch()) == xrgb and sys.byteorder == "little":
            table = cv2.cvtColor(
                np.frombuffer(screen.get_buffer(), np.uint8).reshape(rows, columns, 4), cv2.COLOR_BGRA2RGB
            )
        else:
            table = np.frombuffer(pygame.image.tobytes(screen, "RGB"), np.uint8).reshape(rows, columns, 3)
        height, width = self.image_size
        return cv2.resize(table, (width, height))

    @property
    def agent_xy(self) -> np.ndarray:
        """The agent's position in table pixels."""
        return np.asarray(self._state("pos_agent"), float)

    @property
    def block_pose(self) -> np.ndarray:
        """The block's ``(x, y, angle)``: its body origin in table pixels and its angle (radians, not wrapped)."""
        return np.asarray(self._state("block_pose"), float)

    def _state(self, key: str):
        if self._info is None:
            raise InputError("PushTSim: call reset(seed) first.")
        return self._info[key]

    def close(self) -> None:
        self.env.close()


def drawn(frame: np.ndarray | None) -> np.ndarray:
    """The frame a ``PushTSim`` with ``render_every_step`` (the default) returned from ``reset``, ``step`` or
    ``restore``: never None there."""
    assert frame is not None, "PushTSim(render_every_step=False) returns no frame; call render()"
    return frame


def rollout_episode(
    sim: PushTSim, policy: Callable[[np.ndarray, np.ndarray], np.ndarray], seed: int, steps: int
) -> dict[str, np.ndarray]:
    """Run ``policy`` for ``steps`` actions from ``sim.reset(seed)``; the arrays of one dataset episode."""
    frames = [drawn(sim.reset(seed))]
    coverages = [sim.coverage]
    states = [sim.sim_state]
    actions: list[np.ndarray] = []
    rewards: list[float] = []
    for _ in range(steps):
        action = policy(sim.agent_xy, sim.block_pose)
        frames.append(drawn(sim.step(action)))
        states.append(sim.sim_state)
        actions.append(action)
        rewards.append(sim.reward)
        coverages.append(sim.coverage)
    coverage = np.asarray(coverages, np.float32)
    return {
        "frames": np.stack(frames).astype(np.uint8, copy=False),  # 25 MB at 256 x 256: no second copy
        "actions": np.asarray(actions, np.float32).reshape(steps, RAW_ACTION_DIM),
        "rewards": np.asarray(rewards, np.float32),
        "coverage": coverage,
        "success": np.asarray(bool((coverage > SUCCESS_COVERAGE).any())),
        "sim_seed": np.asarray(int(seed), np.int64),
        "sim_states": np.stack(states),  # float64 [steps + 1, 10]: PushTSim.restore(sim_states[t]) restarts at t
    }


def _check_image_size(image_size: Any) -> tuple[int, int]:
    if (
        not isinstance(image_size, (tuple, list))
        or len(image_size) != 2
        or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 16 <= n <= 512 for n in image_size)
    ):
        raise InputError(f"image_size: expected (height, width), two integers in [16, 512], got {image_size!r}.")
    return int(image_size[0]), int(image_size[1])


def has_gym_pusht() -> bool:
    try:
        require_gym_pusht()
    except ImportError:
        return False
    return True
