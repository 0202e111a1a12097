"""The PushT task's geometry in gym-pusht's table frame (pure numpy): the T block, the goal pose and the distances
the scripted pusher and the geometric reward need. A point of the T in its body frame maps to the table as
``position + R(angle) v``, the same convention as gym-pusht's pymunk bodies."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "AGENT_RADIUS",
    "DOMAIN",
    "GOAL_POSE",
    "RAW_ACTION_DIM",
    "SIM_ENV_ID",
    "SIM_FPS",
    "SUCCESS_COVERAGE",
    "TABLE_SIZE",
    "TASK",
    "TEE_CENTER_OF_GRAVITY",
    "TEE_OUTLINE",
    "contact_candidates",
    "distance_to_outline",
    "rotation",
    "tee_center",
    "tee_outline",
    "wrap_angle",
]

TASK = "push the T-shaped block onto the green target"
SIM_ENV_ID = "gym_pusht/PushT-v0"
DOMAIN = "pusht"
RAW_ACTION_DIM = 2
SIM_FPS = 10.0  # gym-pusht's control rate (PushTEnv.metadata["render_fps"]; a test checks it)
TABLE_SIZE = 512.0  # actions and poses are in table pixels, [0, 512]
GOAL_POSE = np.array([256.0, 256.0, math.pi / 4])  # PushTEnv._setup: the target's x, y, angle
AGENT_RADIUS = 15.0  # PushTEnv.add_circle(..., 15)
SUCCESS_COVERAGE = 0.95  # PushTEnv.success_threshold
# The T in its body frame (PushTEnv.add_tee with scale 30): the outline of the union of the bar (x in [-60, 60],
# y in [0, 30]) and the stem (x in [-15, 15], y in [30, 120]), counter-clockwise. World point = position + R(angle) v.
TEE_OUTLINE = np.array(
    [(-60.0, 0.0), (60.0, 0.0), (60.0, 30.0), (15.0, 30.0), (15.0, 120.0), (-15.0, 120.0), (-15.0, 30.0), (-60.0, 30.0)]
)
# PushTEnv sets the block's center of gravity to the mean of the two rectangles' centroids; it turns about it.
TEE_CENTER_OF_GRAVITY = np.array([0.0, 45.0])
_TEE_EDGE_LENGTHS = np.hypot(*(np.roll(TEE_OUTLINE, -1, axis=0) - TEE_OUTLINE).T)


def rotation(angle: float) -> np.ndarray:
    """The 2x2 matrix pymunk's ``Vec2d.rotated(angle)`` applies."""
    cos, sin = math.cos(angle), math.sin(angle)
    return np.array([[cos, -sin], [sin, cos]])


def tee_outline(pose: Sequence[float] | np.ndarray) -> np.ndarray:
    """The T's outline ``[8, 2]`` in table pixels for a block pose ``(x, y, angle)`` (gym-pusht's ``block_pose``)."""
    return np.asarray(pose[:2], float) + TEE_OUTLINE @ rotation(pose[2]).T


def tee_center(pose: Sequence[float] | np.ndarray) -> np.ndarray:
    """Where the T's center of gravity is for a block pose: the point it turns about."""
    return np.asarray(pose[:2], float) + rotation(pose[2]) @ TEE_CENTER_OF_GRAVITY


def contact_candidates(pose: Sequence[float] | np.ndarray, spacing: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """Points along the T's outline and their outward unit normals, ``([N, 2], [N, 2])``, in table pixels.

    Each edge is cut into pieces about ``spacing`` long and a point sits at the middle of each piece; the count and
    order depend only on ``spacing``, so index ``i`` is the same place on the T at every pose.
    """
    outline = tee_outline(pose)
    points, normals = [], []
    for start, end, local_length in zip(outline, np.roll(outline, -1, axis=0), _TEE_EDGE_LENGTHS):
        edge = end - start
        count = max(1, int(local_length // spacing))  # from the body frame, so it never depends on the pose
        fractions = (np.arange(count) + 0.5) / count
        points.append(start + fractions[:, None] * edge)
        # Counter-clockwise outline: the outward normal is the edge direction turned clockwise.
        normals.append(np.repeat([[edge[1], -edge[0]]], count, axis=0) / local_length)
    return np.concatenate(points), np.concatenate(normals)


def distance_to_outline(points: np.ndarray, outline: np.ndarray) -> np.ndarray:
    """Signed distance ``[M]`` from ``points [M, 2]`` to a closed polygon: negative inside."""
    starts, ends = outline, np.roll(outline, -1, axis=0)
    edges = ends - starts  # [E, 2]
    offsets = points[:, None, :] - starts[None]  # [M, E, 2]
    t = np.clip((offsets * edges).sum(-1) / (edges * edges).sum(-1), 0.0, 1.0)
    nearest = starts[None] + t[..., None] * edges[None]
    distance = np.hypot(*(points[:, None, :] - nearest).transpose(2, 0, 1)).min(axis=1)
    # Even-odd rule: a horizontal ray from the point crosses the outline an odd number of times when inside.
    y, x = points[:, 1:2], points[:, 0:1]
    crosses = (starts[None, :, 1] > y) != (ends[None, :, 1] > y)
    with np.errstate(divide="ignore", invalid="ignore"):
        x_cross = starts[None, :, 0] + (y - starts[None, :, 1]) * edges[None, :, 0] / edges[None, :, 1]
    inside = (crosses & (x < x_cross)).sum(axis=1) % 2 == 1
    return np.where(inside, -distance, distance)


def wrap_angle(angle: float) -> float:
    """``angle`` in [-pi, pi)."""
    return (angle + math.pi) % (2 * math.pi) - math.pi
