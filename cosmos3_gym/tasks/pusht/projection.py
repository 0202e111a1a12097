"""``RigidBlockProjection``: the PushT env's opt-in ``rigid_block=True`` (issue 18), a clean hand-over frame.

The world model generates a chunk from one conditioning frame, and a chunk's last frame conditions the next one.
Whatever the model bent or smeared in that frame is carried into the next chunk and grows there: the T deforms and
its pose error compounds over hand-overs. The projection reads the state off the last frame, the block's pose from
the best-fitting rigid T (``rewards.pusht_geometric.fit_tee``) and the agent's position from its blue disc
(``sim.readoff.read_positions``), and re-draws the frame from that state with gym-pusht's own renderer
(``sim.pusht_sim.PushTSim``): the next chunk starts from a perfect rigid T. ``fit_tee``'s pose is gym-pusht's
``block.position`` and ``block.angle`` (the same body frame, ``sim.pusht_geometry``; a test renders states, fits
them and compares).

A frame where no block or no agent is visible is left as generated (there is no state to read), and so is one whose
fit's rigidity is below ``min_rigidity`` (default 0: every found block; a threshold keeps a badly melted T, whose
fitted angle may be wrong, as generated). Velocities are not
visible on one frame: the re-drawn frame, like every frame, carries none. Needs gym-pusht (the ``sim`` extra).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from ...errors import InputError
from .readoff import read_state
from .sim import SIM_STATE_FIELDS, PushTSim, has_gym_pusht

__all__ = ["RigidBlockProjection", "check_rigid_block"]


def check_rigid_block(value: Any) -> bool:
    """The ``rigid_block`` option: a bool; ``True`` needs gym-pusht (``ImportError`` naming the option)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"rigid_block: expected True or False, got {value!r}.")
    if value and not has_gym_pusht():
        raise ImportError(
            "rigid_block=True re-draws the hand-over frame with gym-pusht's renderer: pip install "
            "'cosmos3_gym[sim]' (or pip install gym-pusht), or leave rigid_block=False."
        )
    return bool(value)


class RigidBlockProjection:
    """Frames uint8 ``[N, H, W, 3]`` -> (frames, ``projected`` bool ``[N]``): each frame where a block and the
    agent are found re-drawn by gym-pusht from the state read off it; the others unchanged (see the module
    docstring). One simulator per frame size, made on first use."""

    def __init__(self, min_rigidity: float = 0.0) -> None:
        if (
            isinstance(min_rigidity, bool)
            or not isinstance(min_rigidity, (int, float))
            or not 0.0 <= min_rigidity <= 1.0
        ):
            raise InputError(f"min_rigidity: expected a number in [0, 1], got {min_rigidity!r}.")
        self.min_rigidity = float(min_rigidity)
        self._sims: dict[tuple[int, int], PushTSim] = {}

    def read_state(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(states [N, 5], found [N])``: agent x, y and block x, y, angle (table pixels, radians) read off
        ``frames``; ``found`` where both the block and the agent are visible (and the fit's rigidity is at least
        ``min_rigidity``)."""
        agent, block_pose, block_found = read_state(frames, self.min_rigidity)
        return np.concatenate([agent, block_pose], axis=1), block_found & np.isfinite(agent).all(axis=1)

    def render(self, states: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
        """gym-pusht's frames uint8 ``[N, H, W, 3]`` of ``states [N, 5]`` (as ``read_state``), at rest."""
        size = cast("tuple[int, int]", tuple(image_size))
        sim = self._sims.get(size)
        if sim is None:
            sim = self._sims[size] = PushTSim(size, render_every_step=False)
        frames = []
        for agent_x, agent_y, block_x, block_y, angle in np.asarray(states, np.float64):
            state = dict.fromkeys(SIM_STATE_FIELDS, 0.0)
            state.update(agent_x=agent_x, agent_y=agent_y, block_x=block_x, block_y=block_y, block_angle=angle)
            sim.restore([state[name] for name in SIM_STATE_FIELDS])
            frames.append(sim.render())
        return np.stack(frames) if frames else np.zeros((0, *image_size, 3), np.uint8)

    def __call__(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InputError(f"frames: expected uint8 [N, H, W, 3], got {frames.dtype} {frames.shape}")
        states, found = self.read_state(frames)
        out = frames.copy()
        if found.any():
            out[found] = self.render(states[found], frames.shape[1:3])
        return out, found

    def close(self) -> None:
        for sim in self._sims.values():
            sim.close()
        self._sims.clear()
