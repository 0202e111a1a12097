"""Agent and block positions read off PushT frames by colour, for measuring where a world model puts things.

gym-pusht draws the agent as a blue disc and the block as a slate-grey T on a white table with a light-green target,
in fixed colours, so a colour threshold finds both in real frames and, as long as the colours survive, in generated
ones; no learned regressor is needed (and none could be fooled into agreeing with itself). ``read_positions`` returns
the centroid of each colour mask in table pixels (0..512): the agent's position (within 3.5 px on simulator
frames), and for the block the centroid of the drawn T, which is ``block_pose[:2] + R(angle) @ BLOCK_CENTROID_OFFSET``
(within 3 px; ``block_centroid``). A part that is not visible (no pixel of its colour) reads as NaN.
"""

from __future__ import annotations

import numpy as np

from .geometry import TABLE_SIZE

# The T's drawn centroid in the block body's frame (pymunk's body origin is the top bar's centre): a least-squares
# fit over simulator frames, 2.4 px worst case.
BLOCK_CENTROID_OFFSET = np.array([0.14, 41.07])


def block_centroid(block_pose: np.ndarray) -> np.ndarray:
    """``[..., 3]`` (x, y, angle) -> ``[..., 2]`` the T's centroid in table pixels."""
    pose = np.asarray(block_pose, dtype=np.float64)
    c, s = np.cos(pose[..., 2]), np.sin(pose[..., 2])
    dx, dy = BLOCK_CENTROID_OFFSET
    return np.stack([pose[..., 0] + c * dx - s * dy, pose[..., 1] + s * dx + c * dy], axis=-1)


def _masks(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    f = np.asarray(frames).astype(np.int16)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    agent = (b > 200) & (r < 150) & (b - r > 90)  # rendered (78, 126, 255)
    # fill (143, 163, 184) and outline (119, 136, 153): grey with a blue cast, unlike the table, target and agent
    block = (np.abs(r - 135) < 30) & (np.abs(g - 153) < 30) & (np.abs(b - 175) < 30) & (b - r > 25) & (b - r < 60)
    return agent, block


def block_mask(frames: np.ndarray) -> np.ndarray:
    """uint8 frames ``[N, H, W, 3]`` -> bool ``[N, H, W]``, the block's pixels: the loss focus of PushT world-model
    training (``WorldModelTrainConfig.video_loss_focus``)."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames: expected [N, H, W, 3], got shape {frames.shape}")
    return _masks(frames)[1]


def read_positions(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 frames ``[N, H, W, 3]`` -> (agent ``[N, 2]``, block centroid ``[N, 2]``) in table pixels, NaN where a
    part is not visible."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames: expected [N, H, W, 3], got shape {frames.shape}")
    height, width = frames.shape[1:3]
    ys, xs = np.mgrid[0:height, 0:width]
    scale = np.array([TABLE_SIZE / width, TABLE_SIZE / height])

    def centroids(masks: np.ndarray) -> np.ndarray:
        counts = masks.sum(axis=(1, 2)).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            xy = np.stack([(masks * xs).sum(axis=(1, 2)) / counts, (masks * ys).sum(axis=(1, 2)) / counts], -1)
        return (xy + 0.5) * scale  # pixel centres

    agent, block = _masks(frames)
    return centroids(agent), centroids(block)


def read_state(frames: np.ndarray, min_rigidity: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 frames ``[N, H, W, 3]`` -> (agent ``[N, 2]``, NaN where not visible; block pose ``[N, 3]`` (x, y, angle
    of gym-pusht's ``block.position`` / ``block.angle``: the best-fitting rigid T, ``rewards.pusht_geometric.fit_tee``);
    ``block_found [N]``: a block is visible and its fit's rigidity is at least ``min_rigidity``). On simulator frames
    both are within about 1 px and 0.4 degrees of the true state."""
    from .reward import fit_tee  # torch: only for the callers that fit the block's pose

    fit = fit_tee(frames)
    agent, _ = read_positions(frames)
    found = (fit.valid & (fit.rigidity >= min_rigidity)).cpu().numpy()
    return agent, fit.pose.double().cpu().numpy(), found
