"""PushT episodes from the real simulator (gym-pusht), for training and checking the built-in world model.

The simulator is ``gym_pusht``'s ``PushTEnv`` (optional extra ``sim``; imported only when a simulator is made): a
blue disc (the agent) pushes a grey T-shaped block onto a fixed green target pose on a 512 x 512 table. An action is
the agent's target position in table pixels, ``[x, y]`` in [0, 512] (a PD controller moves the agent towards it),
at 10 control steps per second. ``coverage`` is the fraction of the target covered by the block; the task counts as
solved above 0.95, as in gym-pusht.

``generate_pusht_dataset`` writes episodes in the episode dataset layout that ``cosmos3_gym.training`` reads::

    DATASET/
      meta.json    {"domain": "pusht", "raw_action_dim": 2, "fps": 10.0, "image_size": [H, W],
                    "action_normalization": "minmax", "num_episodes": N, "source": "gym_pusht/PushT-v0",
                    "policies": {policy: count}, "task": ..., "steps_per_episode": T, "seed": ...,
                    "success_rate": ..., "mean_final_coverage": ...}
      stats.json   {"action": {"min", "max", "mean", "std", "q01", "q99"}}  (ActionStats.from_json reads it)
      episodes/episode_000000.npz
                   frames uint8 [T+1, H, W, 3] (the frame before each action, then the final frame);
                   actions float32 [T, 2] (raw target positions); task (0-d str); rewards float32 [T] (gym-pusht's
                   reward after each action); coverage float32 [T+1] (of each frame); success bool (coverage > 0.95
                   at some frame); policy (0-d str); sim_seed int64 (``PushTSim.reset(sim_seed)`` restores frame 0)

Episodes come from a mix of policies so that the model sees both success and failure: ``random`` (the agent
wanders between random waypoints, touching the block now and then), ``scripted`` (a pusher that walks around the
T and pushes it towards the target pose; its targets get Gaussian noise of a few levels), and ``replay`` (a
noise-free scripted episode replayed from the same start with noisy actions, so near-misses of good pushes).

``side_by_side`` renders the simulator and a world-model env from the same start under the same actions into one
video (a world-model-only video where gym-pusht is not installed).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InputError

__all__ = [
    "AGENT_RADIUS",
    "GOAL_POSE",
    "POLICIES",
    "SIM_ENV_ID",
    "SUCCESS_COVERAGE",
    "TASK",
    "PushTSim",
    "RandomWaypoints",
    "ScriptedPusher",
    "action_statistics",
    "contact_candidates",
    "generate_pusht_dataset",
    "require_gym_pusht",
    "rollout_episode",
    "side_by_side",
    "tee_center",
    "tee_outline",
    "write_dataset_files",
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
    [(-60.0, 0.0), (60.0, 0.0), (60.0, 30.0), (15.0, 30.0), (15.0, 120.0), (-15.0, 120.0), (-15.0, 30.0),
     (-60.0, 30.0)]
)
# PushTEnv sets the block's center of gravity to the mean of the two rectangles' centroids; it turns about it.
TEE_CENTER_OF_GRAVITY = np.array([0.0, 45.0])
_TEE_EDGE_LENGTHS = np.hypot(*(np.roll(TEE_OUTLINE, -1, axis=0) - TEE_OUTLINE).T)
POLICIES = ("random", "scripted", "replay")
DEFAULT_POLICY_MIX = {"random": 0.2, "scripted": 0.6, "replay": 0.2}
SCRIPTED_NOISE_LEVELS = (0.0, 4.0, 10.0, 20.0)  # px std of the Gaussian noise on a scripted pusher's targets
REPLAY_NOISE = 8.0  # px std of the noise added to a replayed action


# ---------------------------------------------------------------------------------------------------------------
# Geometry of the T (pure numpy, the same frame as gym-pusht's physics)
# ---------------------------------------------------------------------------------------------------------------


def rotation(angle: float) -> np.ndarray:
    """The 2x2 matrix pymunk's ``Vec2d.rotated(angle)`` applies."""
    cos, sin = math.cos(angle), math.sin(angle)
    return np.array([[cos, -sin], [sin, cos]])


def tee_outline(pose: Sequence[float]) -> np.ndarray:
    """The T's outline ``[8, 2]`` in table pixels for a block pose ``(x, y, angle)`` (gym-pusht's ``block_pose``)."""
    return np.asarray(pose[:2], float) + TEE_OUTLINE @ rotation(pose[2]).T


def tee_center(pose: Sequence[float]) -> np.ndarray:
    """Where the T's center of gravity is for a block pose: the point it turns about."""
    return np.asarray(pose[:2], float) + rotation(pose[2]) @ TEE_CENTER_OF_GRAVITY


def contact_candidates(pose: Sequence[float], spacing: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
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


def _limit_step(agent: np.ndarray, target: np.ndarray, max_step: float) -> np.ndarray:
    offset = target - agent
    distance = float(np.hypot(*offset))
    return target if distance <= max_step else agent + offset * (max_step / distance)


# ---------------------------------------------------------------------------------------------------------------
# Policies: (agent_xy, block_pose) -> target position; each keeps its own state for one episode
# ---------------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------------------------------------------


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
    allowed (gym-pusht would terminate; datasets keep fixed-length episodes). Frames are rendered from the 512 x 512
    table by gym-pusht itself (a downscale for sizes up to 512).
    """

    def __init__(self, image_size: tuple[int, int] = (256, 256)):
        height, width = _check_image_size(image_size)
        self.image_size = (height, width)
        self.env = require_gym_pusht()(obs_type="pixels", observation_width=width, observation_height=height)
        self.fps = float(self.env.metadata["render_fps"])
        self.reward = 0.0
        self.coverage = 0.0
        self._info: dict[str, Any] | None = None

    def reset(self, seed: int) -> np.ndarray:
        frame, self._info = self.env.reset(seed=int(seed))
        self.reward = 0.0
        # gym-pusht reports coverage only after a step; ask the env for the start's (a private but stable method).
        self.coverage = float(self.env._get_coverage())
        return frame

    def step(self, action: Sequence[float]) -> np.ndarray:
        if self._info is None:
            raise InputError("PushTSim: call reset(seed) before step().")
        frame, reward, _, _, self._info = self.env.step(np.asarray(action, dtype=np.float64))
        self.reward = float(reward)
        self.coverage = float(self._info["coverage"])
        return frame

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


def rollout_episode(
    sim: PushTSim, policy: Callable[[np.ndarray, np.ndarray], np.ndarray], seed: int, steps: int
) -> dict[str, np.ndarray]:
    """Run ``policy`` for ``steps`` actions from ``sim.reset(seed)``; the arrays of one dataset episode."""
    frames = [sim.reset(seed)]
    coverage = [sim.coverage]
    actions, rewards = [], []
    for _ in range(steps):
        action = policy(sim.agent_xy, sim.block_pose)
        frames.append(sim.step(action))
        actions.append(action)
        rewards.append(sim.reward)
        coverage.append(sim.coverage)
    coverage = np.asarray(coverage, np.float32)
    return {
        "frames": np.stack(frames).astype(np.uint8),
        "actions": np.asarray(actions, np.float32).reshape(steps, RAW_ACTION_DIM),
        "rewards": np.asarray(rewards, np.float32),
        "coverage": coverage,
        "success": np.asarray(bool((coverage > SUCCESS_COVERAGE).any())),
        "sim_seed": np.asarray(int(seed), np.int64),
    }


def _check_image_size(image_size: Any) -> tuple[int, int]:
    if (
        not isinstance(image_size, (tuple, list))
        or len(image_size) != 2
        or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 16 <= n <= 512 for n in image_size)
    ):
        raise InputError(f"image_size: expected (height, width), two integers in [16, 512], got {image_size!r}.")
    return int(image_size[0]), int(image_size[1])


# ---------------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------------


def generate_pusht_dataset(
    out_dir: str | os.PathLike,
    episodes: int,
    *,
    steps_per_episode: int = 128,
    image_size: tuple[int, int] = (256, 256),
    policy_mix: dict[str, float] | None = None,
    seed: int = 0,
    workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Simulate ``episodes`` episodes of ``steps_per_episode`` actions into ``out_dir`` (layout: module docstring).

    Frames are rendered by gym-pusht at ``image_size`` (256 x 256 is the model's tier-256 canvas, a downscale of the
    512 x 512 table). ``policy_mix`` gives each policy's share (default ``DEFAULT_POLICY_MIX``); each episode draws
    its policy, noise level and start state from ``(seed, episode index)`` alone, so the data does not depend on
    ``workers`` (processes; default one per CPU core, 0 or 1 runs in this process). Returns ``out_dir``.
    """
    require_gym_pusht()  # fail here, not in every worker
    for name, value, minimum in (("episodes", episodes, 1), ("steps_per_episode", steps_per_episode, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise InputError(f"{name}: expected an integer >= {minimum}, got {value!r}.")
    image_size = _check_image_size(image_size)
    mix = _check_policy_mix(policy_mix)
    out_dir = Path(out_dir)
    episode_dir = out_dir / "episodes"
    if episode_dir.exists() and any(episode_dir.iterdir()):
        raise InputError(f"out_dir: {out_dir} already holds episodes; give a new or empty folder.")
    episode_dir.mkdir(parents=True, exist_ok=True)

    jobs = [(str(episode_dir), index, int(seed), int(steps_per_episode), image_size, mix) for index in range(episodes)]
    workers = min(os.cpu_count() or 1, episodes) if workers is None else int(workers)
    from tqdm.auto import tqdm

    bar = tqdm(total=episodes, desc="simulating PushT episodes", disable=not progress)
    summaries = []
    if workers <= 1:
        for job in jobs:
            summaries.append(_simulate_and_write(job))
            bar.update()
    else:
        # Workers run only the simulator (numpy, pymunk, pygame), never torch or CUDA, so forking is safe and spares
        # each worker re-importing cosmos3_gym (torch, diffusers: seconds each); spawn where fork does not exist.
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            for summary in pool.map(_simulate_and_write, jobs):
                summaries.append(summary)
                bar.update()
    bar.close()

    policies: dict[str, int] = {}
    for summary in summaries:
        policies[summary["policy"]] = policies.get(summary["policy"], 0) + 1
    meta = {
        "domain": DOMAIN,
        "raw_action_dim": RAW_ACTION_DIM,
        "fps": SIM_FPS,
        "image_size": list(image_size),
        "action_normalization": "minmax",
        "num_episodes": int(episodes),
        "source": SIM_ENV_ID,
        "policies": dict(sorted(policies.items())),
        "task": TASK,
        "steps_per_episode": int(steps_per_episode),
        "seed": int(seed),
        "success_rate": float(np.mean([summary["success"] for summary in summaries])),
        "mean_final_coverage": float(np.mean([summary["final_coverage"] for summary in summaries])),
    }
    write_dataset_files(out_dir, meta, np.concatenate([summary["actions"] for summary in summaries]))
    return out_dir



def action_statistics(actions: np.ndarray) -> dict[str, list[float]]:
    """Per-dimension ``min, max, mean, std, q01, q99`` of raw actions ``[N, D]`` (the stats.json ``action`` block)."""
    actions = np.asarray(actions, dtype=np.float64)
    if actions.ndim != 2 or actions.shape[0] < 1:
        raise InputError(f"actions: expected a non-empty [N, D] array, got shape {actions.shape}.")
    return {
        "min": actions.min(axis=0).tolist(),
        "max": actions.max(axis=0).tolist(),
        "mean": actions.mean(axis=0).tolist(),
        "std": actions.std(axis=0).tolist(),
        "q01": np.quantile(actions, 0.01, axis=0).tolist(),
        "q99": np.quantile(actions, 0.99, axis=0).tolist(),
    }


def write_dataset_files(out_dir: str | os.PathLike, meta: dict[str, Any], actions: np.ndarray) -> None:
    """Write ``meta.json`` and ``stats.json`` (statistics of all the dataset's raw ``actions [N, D]``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out_dir / "stats.json").write_text(json.dumps({"action": action_statistics(actions)}, indent=2) + "\n")


def episode_policy(seed: int, index: int, policy_mix: dict[str, float]) -> tuple[str, float, np.random.Generator]:
    """``(family, noise, rng)`` of episode ``index``: drawn from ``(seed, index)`` only."""
    rng = np.random.default_rng([seed, index])
    names = list(policy_mix)
    family = names[int(rng.choice(len(names), p=np.asarray([policy_mix[name] for name in names])))]
    noise = {"random": 0.0, "replay": REPLAY_NOISE}.get(family)
    if noise is None:
        noise = float(rng.choice(SCRIPTED_NOISE_LEVELS))
    return family, noise, rng


_WORKER_SIMS: dict[tuple[int, int], PushTSim] = {}  # one simulator per process and frame size


def _simulate_and_write(job) -> dict[str, Any]:
    episode_dir, index, seed, steps, image_size, policy_mix = job
    family, noise, rng = episode_policy(seed, index, policy_mix)
    sim = _WORKER_SIMS.get(image_size) or _WORKER_SIMS.setdefault(image_size, PushTSim(image_size))
    sim_seed = int(rng.integers(2**31))
    if family == "random":
        policy, name = RandomWaypoints(rng), "random"
    elif family == "scripted":
        policy, name = ScriptedPusher(rng, noise=noise), f"scripted(noise={noise:g})"
    else:  # a noise-free scripted episode from the same start, replayed with noise
        reference = rollout_episode(sim, ScriptedPusher(rng), sim_seed, steps)
        policy, name = Replay(reference["actions"], rng, noise), f"replay(noise={noise:g})"
    episode = rollout_episode(sim, policy, sim_seed, steps)
    np.savez_compressed(
        Path(episode_dir) / f"episode_{index:06d}.npz", **episode, task=np.asarray(TASK), policy=np.asarray(name)
    )
    return {
        "index": index,
        "policy": name,
        "actions": episode["actions"],
        "success": bool(episode["success"]),
        "final_coverage": float(episode["coverage"][-1]),
    }


def _check_policy_mix(policy_mix: dict[str, float] | None) -> dict[str, float]:
    if policy_mix is None:
        return dict(DEFAULT_POLICY_MIX)
    if not isinstance(policy_mix, dict) or not policy_mix:
        raise InputError(f"policy_mix: expected a dict of policy shares, some of {list(POLICIES)}; got {policy_mix!r}.")
    unknown = sorted(set(policy_mix) - set(POLICIES))
    if unknown:
        raise InputError(f"policy_mix: unknown policies {unknown}; expected some of {list(POLICIES)}.")
    shares = {name: float(share) for name, share in policy_mix.items()}
    total = sum(shares.values())
    if any(not math.isfinite(share) or share < 0 for share in shares.values()) or total <= 0:
        raise InputError(f"policy_mix: expected non-negative shares with a positive sum, got {policy_mix!r}.")
    return {name: share / total for name, share in shares.items()}


# ---------------------------------------------------------------------------------------------------------------
# Simulator next to the world model
# ---------------------------------------------------------------------------------------------------------------


def has_gym_pusht() -> bool:
    try:
        require_gym_pusht()
    except ImportError:
        return False
    return True


def psnr(reference: np.ndarray, estimate: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images or videos of one shape (inf when equal)."""
    if reference.shape != estimate.shape:
        raise InputError(f"psnr: the frames differ in shape, {reference.shape} vs {estimate.shape}.")
    error = np.mean((reference.astype(np.float64) - estimate.astype(np.float64)) ** 2) / 255.0**2
    return math.inf if error == 0 else float(10.0 * math.log10(1.0 / error))


def side_by_side(
    path: str | os.PathLike, *, seed: int = 0, num_chunks: int = 6, assets_dir: str | os.PathLike | None = None,
    **env_kwargs: Any,
) -> dict[str, Any]:
    """Write a video of the PushT world model; where gym-pusht is installed, next to the real simulator.

    With gym-pusht, each video frame is ``[simulator | world model]``: the simulator starts from
    ``PushTSim.reset(seed)`` and the noise-free ``ScriptedPusher`` acts for ``num_chunks`` chunks; the world model
    starts from the same frame and steps through the same actions (normalised with the checkpoint's action
    statistics). Without it, the world model alone, from one of its start frames (drawn with ``seed``), driven by
    the checkpoint's own policy mode (``PolicyAgent``). ``assets_dir`` and ``env_kwargs`` go to ``make_pusht_env``
    (e.g. ``engine=`` to share a loaded model, ``device=``). An mp4 needs imageio-ffmpeg or OpenCV; without either a
    GIF is written next to ``path`` instead.

    Returns ``{"path", "mode": "side_by_side" | "world_model_only", "num_frames", "psnr_per_chunk" (dB, side by
    side only), "final_sim_coverage" (side by side only)}``.
    """
    from ..envs.pusht import pusht_env_arguments
    from ..envs.world_model_env import WorldModelEnv

    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise InputError(f"num_chunks: expected an integer >= 1, got {num_chunks!r}.")
    # return_frames: every generated frame, not only each chunk's last; render: the start frame at the model's size.
    arguments = {**pusht_env_arguments(assets_dir, **env_kwargs), "return_frames": True, "render_mode": "rgb_array"}
    env = WorldModelEnv(**arguments)
    try:
        if has_gym_pusht():
            result, frames = _simulator_and_model(env, seed, num_chunks)
        else:
            result, frames = _model_only(env, arguments, seed, num_chunks)
        fps = env.metadata["render_fps"]
    finally:
        env.close()
    result["path"] = str(write_video_any(path, frames, fps))
    result["num_frames"] = len(frames)
    return result


def _simulator_and_model(env, seed: int, num_chunks: int) -> tuple[dict[str, Any], np.ndarray]:
    if env.action_stats is None:
        raise InputError("action_stats: the side-by-side video maps simulator actions into the model's space; the "
                         "checkpoint has no action_stats.json and none was given.")
    chunk = env.action_space.shape[0]
    sim = PushTSim(env.image_size)
    try:
        pusher = ScriptedPusher(np.random.default_rng(seed))
        sim_frames = [sim.reset(seed)]
        chunks = []
        for _ in range(num_chunks):
            actions = []
            for _ in range(chunk):
                actions.append(pusher(sim.agent_xy, sim.block_pose))
                sim_frames.append(sim.step(actions[-1]))
            chunks.append(np.stack(actions))
        final_coverage = sim.coverage
    finally:
        sim.close()

    env.reset(seed=seed, options={"frames": sim_frames[0], "task": TASK})
    model_frames = [env.render()]
    for actions in chunks:
        normalised = np.clip(env.action_stats.normalize(actions.astype(np.float32)), -1.0, 1.0)
        info = env.step(normalised)[-1]
        model_frames.extend(info["frames"])
    sim_frames, model_frames = np.stack(sim_frames), np.stack(model_frames)
    psnr_per_chunk = [
        psnr(sim_frames[1 + k * chunk : 1 + (k + 1) * chunk], model_frames[1 + k * chunk : 1 + (k + 1) * chunk])
        for k in range(num_chunks)
    ]
    result = {"mode": "side_by_side", "psnr_per_chunk": psnr_per_chunk, "final_sim_coverage": final_coverage}
    return result, np.stack([
        np.concatenate([_label(a, "simulator"), _gap(a), _label(b, "world model")], axis=1)
        for a, b in zip(sim_frames, model_frames)
    ])


def _model_only(env, arguments: dict[str, Any], seed: int, num_chunks: int) -> tuple[dict[str, Any], np.ndarray]:
    from ..agents import PolicyAgent

    chunk, raw_action_dim = env.action_space.shape
    agent = PolicyAgent(
        env.engine, task=arguments.get("task") or TASK, domain=arguments["domain"], raw_action_dim=raw_action_dim,
        chunk=chunk, num_steps=arguments["num_steps"], guidance_scale=arguments["guidance_scale"],
        resolution_tier=arguments["resolution_tier"], fps=arguments["fps"], seed=seed,
    )
    env.reset(seed=seed)
    frames = [env.render()]
    for _ in range(num_chunks):
        info = env.step(agent.act(frames[-1]))[-1]
        frames.extend(info["frames"])
    return {"mode": "world_model_only"}, np.stack([_label(frame, "world model") for frame in frames])


def _label(frame: np.ndarray, text: str) -> np.ndarray:
    """``frame`` under a white strip that names it."""
    from PIL import Image, ImageDraw

    strip = Image.new("RGB", (frame.shape[1], 16), "white")
    ImageDraw.Draw(strip).text((4, 2), text, fill=(0, 0, 0))
    return np.concatenate([np.asarray(strip), frame], axis=0)


def _gap(frame: np.ndarray) -> np.ndarray:
    return np.full((frame.shape[0] + 16, 4, 3), 128, dtype=np.uint8)


def write_video_any(path: str | os.PathLike, frames: np.ndarray, fps: float) -> Path:
    """``frames [T, H, W, 3]`` uint8 as an mp4 with H.264 (imageio-ffmpeg), else MPEG-4 (OpenCV), else a GIF at
    ``path`` with the suffix ``.gif``. Returns the path written."""
    import importlib.util

    from ..media import write_video

    path = Path(path)
    if path.suffix.lower() != ".mp4" or importlib.util.find_spec("imageio_ffmpeg") is not None:
        return write_video(path, frames, fps)
    try:
        import cv2
    except ImportError:
        return write_video(path.with_suffix(".gif"), frames, fps)
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (width, height))
    if not writer.isOpened():
        return write_video(path.with_suffix(".gif"), frames, fps)
    for frame in frames:
        writer.write(np.ascontiguousarray(frame[..., ::-1]))  # OpenCV wants BGR
    writer.release()
    return path
