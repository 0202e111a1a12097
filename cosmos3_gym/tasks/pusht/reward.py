"""``PushTGeometricReward``: PushT coverage measured on the frame by fitting a rigid T, so deformed blocks don't pay.

A learned reward scores whatever an imagined frame looks like; a world model that melts the T onto the target can
fool it. This one measures: it segments the block by its colour (gym-pusht draws it slate grey; the agent blue, the
target light green), fits a rigid T of the true size to the segment (pose ``x, y, angle`` in table pixels, the frame
of ``cosmos3_gym.tasks.pusht.geometry``), computes the coverage of the goal by the *fitted* T, and checks the fit:
``rigidity`` is the IoU of the segmented block and the fitted T (agent pixels, which may hide the block, left out).
A frame whose block is not a T (IoU below ``min_iou``) or shows no block scores 0.

The fit. The segment's colour mask is area-pooled to a ``grid`` x ``grid`` map of block occupancy in [0, 1]; a T
rendered with soft edges (occupancy ``clamp(0.5 - signed_distance / cell, 0, 1)``) is compared with it by squared
error. The search starts from the mask's moments (centroid; the major principal axis is the stem's, the T's
direction along it is one of two, both tried, and the two perpendicular ones in case the agent hides much of the
block) and refines by a coordinate search over ``(x, y, angle)`` with step halving (27 neighbours per round), all
frames of a batch at once in torch (on the frames' device). Coverage: the goal T's area sampled on a 2-px grid, the
fraction of samples inside the fitted T. On gym-pusht frames at 96 x 96 and above this is within a few points of the
simulator's coverage (tests assert correlation and mean absolute error on real frames).

``fit_tee(frames)`` returns the poses, coverage, rigidity and the occupancy of the block for any frames;
``rigidity(frames)`` is the rigidity metric for the world-model fidelity work (issue 18).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import InputError
from ...rewards.base import check_frames

__all__ = ["PushTGeometricReward", "TeeFit", "fit_tee", "rigidity", "tee_coverage"]

TABLE = 512.0
GOAL = (256.0, 256.0, math.pi / 4)
# The T in its body frame (gym-pusht's add_tee, scale 30): two boxes (center x, center y, half width, half height).
BOXES = torch.tensor([[0.0, 15.0, 60.0, 15.0], [0.0, 75.0, 15.0, 45.0]], dtype=torch.float64)
TEE_AREA = 120.0 * 30.0 + 30.0 * 90.0
CENTROID_Y = (120.0 * 30.0 * 15.0 + 30.0 * 90.0 * 75.0) / TEE_AREA  # 40.71: the T's area centroid in its body frame
DEFAULT_MIN_IOU = 0.8
# gym-pusht outlines the block outside its polygon: the drawn T is about 2 table pixels wider on every side (its
# coloured area is 1.16x the T's at 96 x 96); the fitted model is drawn as wide.
DRAWN_MARGIN = 2.0
_MIN_BLOCK_FRACTION = 0.05  # of the T's area: less visible block than this is "no block"


def _goal_samples(spacing: float = 2.0) -> torch.Tensor:
    """Points ``[M, 2]`` on a ``spacing`` grid over the T's area, in its body frame."""
    points = []
    for cx, cy, hw, hh in BOXES.tolist():
        xs = torch.arange(cx - hw + spacing / 2, cx + hw, spacing, dtype=torch.float64)
        ys = torch.arange(cy - hh + spacing / 2, cy + hh, spacing, dtype=torch.float64)
        points.append(torch.cartesian_prod(xs, ys))
    return torch.cat(points)


_GOAL_SAMPLES = _goal_samples()


def _to_body(points: torch.Tensor, poses: torch.Tensor) -> torch.Tensor:
    """Table points ``[..., P, 2]`` -> body frames of ``poses [..., 3]``: ``R(-angle) (p - position)``."""
    cos, sin = torch.cos(poses[..., 2:3]), torch.sin(poses[..., 2:3])
    dx, dy = points[..., 0] - poses[..., 0:1], points[..., 1] - poses[..., 1:2]
    return torch.stack([cos * dx + sin * dy, -sin * dx + cos * dy], dim=-1)


def _signed_distance(body: torch.Tensor) -> torch.Tensor:
    """Signed distance (negative inside) from body-frame points ``[..., 2]`` to the T (a union of two boxes)."""
    boxes = BOXES.to(body)
    q = (body[..., None, :] - boxes[:, :2]).abs() - boxes[:, 2:]  # [..., 2 boxes, 2]
    outside = q.clamp(min=0).norm(dim=-1)
    inside = q.max(dim=-1).values.clamp(max=0)
    return (outside + inside).min(dim=-1).values


def tee_coverage(poses: torch.Tensor | np.ndarray, goal=GOAL) -> torch.Tensor:
    """Fraction of the goal T's area covered by a T at each of ``poses [N, 3]`` (x, y, angle; table pixels)."""
    poses = torch.as_tensor(poses, dtype=torch.float64)
    samples = _GOAL_SAMPLES.to(poses.device)
    goal = torch.tensor(goal, dtype=torch.float64, device=poses.device)
    cos, sin = math.cos(goal[2]), math.sin(goal[2])
    world = torch.stack(
        [goal[0] + cos * samples[:, 0] - sin * samples[:, 1], goal[1] + sin * samples[:, 0] + cos * samples[:, 1]],
        dim=-1,
    )  # [M, 2]
    body = _to_body(world.expand(len(poses), -1, -1), poses)
    return (_signed_distance(body) <= 0).double().mean(dim=-1)


def _masks(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, 3, H, W]`` in [0, 1] -> (block, agent) bool masks ``[N, H, W]`` by gym-pusht's colours."""
    r, g, b = (frames * 255.0).unbind(1)
    agent = (b > 200) & (r < 150) & (b - r > 90)  # rendered (65, 105, 225) "RoyalBlue"
    # fill and outline of "LightSlateGray" (119, 136, 153) with a blue cast: unlike the table, target and agent
    block = ((r - 135).abs() < 30) & ((g - 153).abs() < 30) & ((b - 175).abs() < 30) & (b - r > 25) & (b - r < 60)
    return block, agent


@dataclass
class TeeFit:
    """Per frame: ``pose [N, 3]`` (x, y, angle of the fitted T's body origin, table pixels), ``coverage [N]`` of the
    goal by the fitted T, ``rigidity [N]`` (IoU of segment and fitted T; 0 without a block), ``block_fraction
    [N]`` (visible block area over the T's area) and ``valid [N]`` (a block was found)."""

    pose: torch.Tensor
    coverage: torch.Tensor
    rigidity: torch.Tensor
    block_fraction: torch.Tensor
    valid: torch.Tensor


def fit_tee(frames: Any, grid: int = 96, rounds: int = 10) -> TeeFit:
    """Fit a rigid T to every frame (see the module docstring). ``frames``: uint8 ``[N, H, W, 3]`` (numpy or
    tensor) or float ``[N, 3, H, W]`` in [0, 1]; any size (the frame spans the 512 x 512 table)."""
    frames = _as_float_nchw(frames)
    device, count = frames.device, len(frames)
    rows = torch.arange(count, device=device)
    block, agent = _masks(frames)
    # Area-pool the masks onto the working grid: fractional occupancy carries sub-cell position information.
    occupancy = F.adaptive_avg_pool2d(block[:, None].float(), grid)[:, 0]  # [N, G, G]
    agent_cells = F.adaptive_avg_pool2d(agent[:, None].float(), grid)[:, 0]
    cell = TABLE / grid
    area = occupancy.sum((1, 2)) * cell * cell
    valid = area > _MIN_BLOCK_FRACTION * TEE_AREA

    # Moments of the block's occupancy -> centroid and the stem's axis.
    centres = (torch.arange(grid, device=device, dtype=torch.float32) + 0.5) * cell
    mass = occupancy.sum((1, 2)).clamp(min=1e-6)
    cx = (occupancy.sum(1) * centres).sum(-1) / mass
    cy = (occupancy.sum(2) * centres).sum(-1) / mass
    dx, dy = centres[None, None, :] - cx[:, None, None], centres[None, :, None] - cy[:, None, None]
    cov = torch.stack(
        [
            (occupancy * dx * dx).sum((1, 2)),
            (occupancy * dx * dy).sum((1, 2)),
            (occupancy * dx * dy).sum((1, 2)),
            (occupancy * dy * dy).sum((1, 2)),
        ],
        -1,
    ).view(-1, 2, 2)
    _, vectors = torch.linalg.eigh(cov / mass[:, None, None])
    major = vectors[..., 1]  # the stem's direction (body +y or -y): the T's largest variance
    base = torch.atan2(-major[:, 0], major[:, 1])  # R(angle) (0, 1) = major

    # Work in a window around the centroid that holds the whole T (its farthest point is 80 px from the centroid).
    half = int(math.ceil(84.0 / cell)) + 1
    offsets = torch.arange(-half, half + 1, device=device)
    centre_cell = torch.stack([(cx / cell).long(), (cy / cell).long()], -1)  # [N, 2] (column, row)
    cols = centre_cell[:, 0:1] + offsets  # [N, W]
    rws = centre_cell[:, 1:2] + offsets
    inside_grid = ((rws >= 0) & (rws < grid))[:, :, None] & ((cols >= 0) & (cols < grid))[:, None, :]
    flat = rws.clamp(0, grid - 1)[:, :, None] * grid + cols.clamp(0, grid - 1)[:, None, :]  # [N, W, W]
    window_occupancy = occupancy.flatten(1).gather(1, flat.flatten(1)) * inside_grid.flatten(1)  # [N, P]
    window_agent = agent_cells.flatten(1).gather(1, flat.flatten(1)) * inside_grid.flatten(1)
    weight = (window_agent < 0.05).float()  # cells the agent covers may hide block: left out of the fit
    points = torch.stack(
        [
            ((cols[:, None, :] + 0.5) * cell).expand(-1, len(offsets), -1),
            ((rws[:, :, None] + 0.5) * cell).expand(-1, -1, len(offsets)),
        ],
        -1,
    ).flatten(1, 2)  # [N,P,2]

    def soft_tee(poses: torch.Tensor) -> torch.Tensor:  # poses [N, K, 3] -> occupancy of the T [N, K, P]
        body = _to_body(points[:, None], poses)
        return (0.5 - (_signed_distance(body) - DRAWN_MARGIN) / cell).clamp(0.0, 1.0)

    def score(poses: torch.Tensor) -> torch.Tensor:  # [N, K]
        return ((soft_tee(poses) - window_occupancy[:, None]) ** 2 * weight[:, None]).sum(-1)

    angles = base[:, None] + torch.tensor([0.0, math.pi, math.pi / 2, -math.pi / 2], device=device)
    # Origin = centroid - R(angle) (0, CENTROID_Y).
    starts = torch.stack(
        [cx[:, None] + torch.sin(angles) * CENTROID_Y, cy[:, None] - torch.cos(angles) * CENTROID_Y, angles], dim=-1
    )  # [N, 4, 3]
    best = starts[rows, score(starts).argmin(-1)]  # [N, 3]
    steps = torch.tensor([8.0, 8.0, 0.1], device=device)
    moves = torch.cartesian_prod(*[torch.tensor([-1.0, 0.0, 1.0], device=device)] * 3)  # [27, 3]
    for _ in range(rounds):
        candidates = best[:, None] + moves[None] * steps
        best = candidates[rows, score(candidates).argmin(-1)]
        steps = steps / 2

    # Rigidity: soft IoU of the segmented block and the fitted T, agent cells left out; block outside the window
    # (a split or smeared block) counts against it.
    model = soft_tee(best[:, None])[:, 0]
    intersection = (torch.minimum(model, window_occupancy) * weight).sum(-1)
    outside = (occupancy.sum((1, 2)) - window_occupancy.sum(-1)).clamp(min=0)
    union = (torch.maximum(model, window_occupancy) * weight).sum(-1) + outside
    iou = torch.where(valid, intersection / union.clamp(min=1e-6), torch.zeros_like(union))
    coverage = torch.where(valid, tee_coverage(best.double()).float(), torch.zeros_like(union))
    return TeeFit(best, coverage, iou, area / TEE_AREA, valid)


def rigidity(frames: Any, grid: int = 96) -> np.ndarray:
    """The rigidity metric of each frame (issue 18): IoU of the segmented block and the best-fitting rigid T of the
    true size, in [0, 1] (0 where no block is visible). Frames as for ``fit_tee``."""
    return fit_tee(frames, grid=grid).rigidity.cpu().numpy()


def _as_float_nchw(frames: Any) -> torch.Tensor:
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(np.ascontiguousarray(frames))
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4:
        raise InputError(
            f"frames: expected uint8 [N, H, W, 3] or float [N, 3, H, W], got "
            f"{getattr(frames, 'shape', type(frames).__name__)}"
        )
    if frames.dtype == torch.uint8:
        if frames.shape[-1] != 3:
            raise InputError(f"frames: uint8 frames must be [N, H, W, 3], got {list(frames.shape)}")
        return frames.permute(0, 3, 1, 2).float() / 255.0
    if frames.shape[1] != 3 or not frames.is_floating_point():
        raise InputError(f"frames: float frames must be [N, 3, H, W] in [0, 1], got {list(frames.shape)}")
    return frames.float()


class PushTGeometricReward:
    """Reward model (``frames [B, T, 3, H, W]`` in [0, 1], tasks -> ``[B]``): the fitted-T coverage of the chunk's
    last frame (``reduce="last"``) or its best frame (``"max"``), 0 for frames whose rigidity is below
    ``min_iou``. ``last_fit`` keeps the fit of the last call (for logging hallucination flags)."""

    def __init__(
        self, min_iou: float = DEFAULT_MIN_IOU, reduce: str = "last", grid: int = 96, name: str = "pusht_geometric"
    ):
        if not 0.0 <= float(min_iou) <= 1.0:
            raise InputError(f"min_iou: expected a number in [0, 1], got {min_iou!r}")
        if reduce not in ("last", "max"):
            raise InputError(f"reduce: expected 'last' or 'max', got {reduce!r}")
        self.min_iou, self.reduce, self.grid, self.name = float(min_iou), reduce, int(grid), name
        self.device = torch.device("cpu")
        self.last_fit: TeeFit | None = None

    def to(self, device) -> PushTGeometricReward:
        self.device = torch.device(device)
        return self

    @property
    def frames_read(self) -> str:
        """ "last" with ``reduce="last"``: the env then decodes only each chunk's last frame (``envs.core``), where
        otherwise it decodes all of them for a score that reads one (the GRPO runs' setting)."""
        return "last" if self.reduce == "last" else "all"

    @torch.no_grad()
    def __call__(self, frames: torch.Tensor, tasks: list[str]) -> torch.Tensor:
        frames, tasks = check_frames(frames, tasks)
        batch, steps = frames.shape[:2]
        chosen = frames[:, -1:] if self.reduce == "last" else frames
        fit = fit_tee(chosen.reshape(-1, *frames.shape[2:]).to(self.device), grid=self.grid)
        self.last_fit = fit
        scores = torch.where(fit.rigidity >= self.min_iou, fit.coverage, torch.zeros_like(fit.coverage))
        return scores.view(batch, -1).max(dim=1).values.to(self.device)


def make_pusht_geometric_reward(spec: Any) -> PushTGeometricReward:
    """The ``pusht_geometric`` reward-model spec (entry point of group ``cosmos3_gym.reward_models``):
    ``"pusht_geometric?min_iou=0.8&reduce=last"``."""
    spec.check_options({"min_iou", "reduce"})
    return PushTGeometricReward(
        min_iou=spec.float_option("min_iou", 0.8), reduce=spec.options.get("reduce", "last"), name=spec.text
    ).to(spec.device)
