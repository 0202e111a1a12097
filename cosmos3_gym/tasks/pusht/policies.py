"""Reference policies that read the simulator's true state: ``(agent_xy, block_pose) -> target position`` in table
pixels; each keeps its own state for one episode. ``ScriptedPusher`` makes the demonstrations behaviour cloning
learns from; ``RandomWaypoints``, ``UniformTargets`` and ``Replay`` add failures, jerky motion and near-misses to
world-model training data; ``ChunkedFramePolicy`` runs a frame policy (a BC or RL policy file) in the same loop, so
the data also holds the states such policies visit (DAgger-style)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .geometry import (
    AGENT_RADIUS,
    GOAL_POSE,
    TABLE_SIZE,
    contact_candidates,
    distance_to_outline,
    tee_center,
    tee_outline,
    wrap_angle,
)

__all__ = [
    "REPLAY_NOISE",
    "SCRIPTED_NOISE_LEVELS",
    "ChunkedFramePolicy",
    "RandomWaypoints",
    "Replay",
    "ScriptedPusher",
    "UniformTargets",
    "plan_chunk_in_physics",
]

SCRIPTED_NOISE_LEVELS = (0.0, 4.0, 10.0, 20.0)  # px std of the Gaussian noise on a scripted pusher's targets
REPLAY_NOISE = 8.0  # px std of the noise added to a replayed action


def _limit_step(agent: np.ndarray, target: np.ndarray, max_step: float) -> np.ndarray:
    offset = target - agent
    distance = float(np.hypot(*offset))
    return target if distance <= max_step else agent + offset * (max_step / distance)


@dataclass
class ScriptedPusher:
    """Walks around the T to a contact point and pushes it towards the goal pose.

    Every step it scores the contact points of ``contact_candidates``: pushing at point ``p`` along the inward normal
    ``d`` moves the block along ``d`` and turns it by the torque ``(p - center) x d``; the score is the cosine
    between that motion and the remaining pose error, both in ``(x, y, angle * ROTATION_SCALE)`` pixels. Contacts the
    disc cannot reach (in the corners between bar and stem) are left out, and it keeps its contact unless another
    scores clearly better (so it does not dither between sides). It walks out along the contact's normal line to
    the nearest point it can reach in a straight line without touching the T (round the T on a circle about its
    center when there is none), comes in along the normal and pushes, less deep as the pose error shrinks. Targets
    move at most ``max_step`` pixels from the agent per step and get Gaussian noise of std ``noise`` pixels. In the
    simulator it covers about 0.9 of the target after 128 steps (13 s) on average, and succeeds in most episodes.
    """

    rng: np.random.Generator
    noise: float = 0.0
    max_step: float = 50.0
    push_depth: float = 35.0
    goal_pose: np.ndarray = field(default_factory=lambda: GOAL_POSE.copy())

    ROTATION_SCALE = 60.0  # px per radian of angle error: how much a turn counts against a translation
    GYRATION_RADIUS = 45.0  # px: sqrt(inertia / mass) of the T about its center, roughly
    SWITCH_MARGIN = 0.15  # another contact must score this much higher to be chosen over the current one
    ORBIT_RADIUS = 110.0  # px from the T's center: clear of its farthest corner (77) plus the agent (15)
    APPROACH_GAP = 6.0  # px between the disc and the contact before pushing
    CLEARANCE = AGENT_RADIUS + 2.0  # px: a walk whose points all keep this far from the T does not touch it
    STAGING_DISTANCES = np.array([0.0, 25.0, 50.0, 80.0, 110.0])  # px out from the contact along its normal
    DONE_DISTANCE, DONE_ANGLE = 2.0, 0.02  # close enough to the goal pose: stand still

    def __post_init__(self):
        self._contact: int | None = None

    def __call__(self, agent_xy: np.ndarray, block_pose: np.ndarray) -> np.ndarray:
        agent = np.asarray(agent_xy, float)
        target = self._plan(agent, np.asarray(block_pose, float))
        target = _limit_step(agent, target, self.max_step)
        if self.noise:
            target = target + self.rng.normal(0.0, self.noise, size=2)
        return np.clip(target, 0.0, TABLE_SIZE).astype(np.float32)

    def _plan(self, agent: np.ndarray, pose: np.ndarray) -> np.ndarray:
        center = tee_center(pose)
        translation = tee_center(self.goal_pose) - center
        turn = wrap_angle(self.goal_pose[2] - pose[2])
        if np.hypot(*translation) < self.DONE_DISTANCE and abs(turn) < self.DONE_ANGLE:
            self._contact = None
            return agent
        points, normals = contact_candidates(pose)
        scores = self._scores(points, normals, center, translation, turn)
        # Near the corners between bar and stem the disc cannot reach the contact without touching the other part.
        approach = points + normals * (AGENT_RADIUS + self.APPROACH_GAP)
        scores[distance_to_outline(approach, tee_outline(pose)) <= self.CLEARANCE] = -np.inf
        best = int(np.argmax(scores))
        if self._contact is None or scores[best] > scores[self._contact] + self.SWITCH_MARGIN:
            self._contact = best
        point, normal = points[self._contact], normals[self._contact]

        touching = point + normal * AGENT_RADIUS
        if np.hypot(*(agent - touching)) < 12.0:  # at the contact: push, gently when the block is nearly there
            error = np.hypot(*translation) + self.ROTATION_SCALE * abs(turn)
            return touching - normal * float(np.clip(0.5 * error, 2.0, self.push_depth))
        # Walk to the nearest point of the contact's normal line reachable in a straight line; when none is, round
        # the T towards the line's far end.
        staging = point + normal * (AGENT_RADIUS + self.APPROACH_GAP + self.STAGING_DISTANCES[:, None])
        for waypoint in staging:
            if self._path_is_clear(agent, waypoint, pose):
                return waypoint
        return self._orbit_waypoint(agent, staging[-1], center)

    def _scores(self, points, normals, center, translation, turn) -> np.ndarray:
        push = -normals
        lever = points - center
        torque = lever[:, 0] * push[:, 1] - lever[:, 1] * push[:, 0]
        effect = np.column_stack([push, self.ROTATION_SCALE * torque / self.GYRATION_RADIUS**2])
        wanted = np.array([*translation, self.ROTATION_SCALE * turn])
        return effect @ wanted / (np.linalg.norm(effect, axis=1) * np.linalg.norm(wanted) + 1e-9)

    def _path_is_clear(self, start: np.ndarray, end: np.ndarray, pose: np.ndarray) -> bool:
        samples = start + np.linspace(0.0, 1.0, 16)[:, None] * (end - start)
        return bool((distance_to_outline(samples, tee_outline(pose)) > self.CLEARANCE).all())

    def _orbit_waypoint(self, agent: np.ndarray, goal: np.ndarray, center: np.ndarray) -> np.ndarray:
        """A point further round the circle about the T's center, towards ``goal``'s side."""
        agent_angle = math.atan2(*(agent - center)[::-1])
        goal_angle = math.atan2(*(goal - center)[::-1])
        step = float(np.clip(wrap_angle(goal_angle - agent_angle), -0.7, 0.7))
        angle = agent_angle + step
        return center + self.ORBIT_RADIUS * np.array([math.cos(angle), math.sin(angle)])


def plan_chunk_in_physics(sim, pusher: ScriptedPusher, state: np.ndarray, steps: int) -> np.ndarray:
    """The ``steps`` targets ``pusher`` gives from simulator state ``state`` when each is executed in ``sim`` (a
    ``PushTSim`` kept for planning, put in ``state`` first): float ``[steps, 2]`` table pixels. A chunk policy that
    executes them open loop does what the per-step pusher does closed loop, up to pymunk's contact caches."""
    sim.restore(state)
    targets = np.empty((steps, 2), np.float64)
    for step in range(steps):
        targets[step] = pusher(sim.agent_xy, sim.block_pose)
        sim.step(targets[step])
    return targets


@dataclass
class RandomWaypoints:
    """Moves towards a random point of the table, picks a new one on arrival (or at random), with jitter."""

    rng: np.random.Generator
    max_step: float = 30.0
    jitter: float = 5.0
    margin: float = 40.0

    def __post_init__(self):
        self._waypoint: np.ndarray | None = None

    def __call__(self, agent_xy: np.ndarray, block_pose: np.ndarray) -> np.ndarray:
        agent = np.asarray(agent_xy, float)
        arrived = self._waypoint is not None and np.hypot(*(self._waypoint - agent)) < 10.0
        if self._waypoint is None or arrived or self.rng.random() < 0.05:
            self._waypoint = self.rng.uniform(self.margin, TABLE_SIZE - self.margin, size=2)
        target = _limit_step(agent, self._waypoint, self.max_step) + self.rng.normal(0.0, self.jitter, size=2)
        return np.clip(target, 0.0, TABLE_SIZE).astype(np.float32)


@dataclass
class Replay:
    """Replays recorded actions with Gaussian noise of std ``noise`` pixels (then holds the last one)."""

    actions: np.ndarray
    rng: np.random.Generator
    noise: float = REPLAY_NOISE

    def __post_init__(self):
        self._step = 0

    def __call__(self, agent_xy: np.ndarray, block_pose: np.ndarray) -> np.ndarray:
        action = self.actions[min(self._step, len(self.actions) - 1)]
        self._step += 1
        return np.clip(action + self.rng.normal(0.0, self.noise, size=2), 0.0, TABLE_SIZE).astype(np.float32)


@dataclass
class UniformTargets:
    """A new target drawn uniformly over ``[low, high]`` every step: what ``action_space.sample()`` gives the PushT
    env (its normalised box maps onto the action statistics' min-max range, about the whole table). The agent
    jerks across the table; a world model that never saw this loses the agent under random actions."""

    rng: np.random.Generator
    low: np.ndarray = field(default_factory=lambda: np.zeros(2))
    high: np.ndarray = field(default_factory=lambda: np.full(2, TABLE_SIZE))

    def __call__(self, agent_xy: np.ndarray, block_pose: np.ndarray) -> np.ndarray:
        return self.rng.uniform(self.low, self.high).astype(np.float32)


@dataclass
class ChunkedFramePolicy:
    """A frame policy (``policy.act(frame, deterministic, generator) -> [chunk, 2]`` normalised actions, e.g. a
    ``cosmos3_gym.rl`` policy file) driven one chunk at a time: at each chunk's first step it reads the current
    frame (``render()``), samples a chunk (``deterministic=False``: the policy's own Gaussian exploration) and maps
    it to table pixels with ``denormalize``, clipped to the table, as the env does."""

    policy: Any
    render: Callable[[], np.ndarray]  # () -> uint8 [H, W, 3], the simulator's current frame
    denormalize: Callable[[np.ndarray], np.ndarray]  # normalised [chunk, 2] -> table pixels
    generator: Any  # torch.Generator of this episode's samples
    deterministic: bool = False

    def __post_init__(self):
        self._queue: list[np.ndarray] = []

    def __call__(self, agent_xy: np.ndarray, block_pose: np.ndarray) -> np.ndarray:
        if not self._queue:
            chunk = self.policy.act(self.render(), deterministic=self.deterministic, generator=self.generator)
            targets = self.denormalize(np.clip(np.asarray(chunk, np.float64), -1.0, 1.0))
            self._queue = list(np.clip(targets, 0.0, TABLE_SIZE).astype(np.float32))
        return self._queue.pop(0)
