"""``PixelGaussianPolicy``: a small CNN from one frame to an action chunk, with a Gaussian head for RL.

The frame (uint8 ``[H, W, 3]``, the world-model envs' ``{"image": ...}`` observation, 96 x 96 by default) goes
through four
convolutions; a spatial soft-argmax turns each of the last layer's channels into an (x, y) keypoint (Levine et al.
2016, robomimic's and Diffusion Policy's visual encoders: where the agent and the block are is what a pushing policy
needs) and an MLP maps the keypoints to the mean of an action chunk ``[chunk, action_dim]`` in [-1, 1] (tanh). The
Gaussian's log standard deviation is one learned vector (state independent), as in CleanRL's continuous PPO.

Files: ``save_policy_file`` writes safetensors whose string metadata says what the file is::

    {"format": "cosmos3_gym.policy", "kind": "pixel_gaussian", "config": {...PolicyConfig...}, + the caller's}

``load_policy_file(path)`` reads any such file back (the evaluation's ``file:PATH`` policy spec calls exactly
``cosmos3_gym.rl.policy:load_policy_file``). A loaded policy is called like the evaluation API's policies:
``policy(observation) -> actions`` (a batch ``{"image": [N, H, W, 3]}`` gives ``[N, chunk, 2]``, one frame gives
``[chunk, 2]``; the mean action), or ``policy.act(observation, deterministic=False)`` to sample.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

from ..data.initial_states import resize_frame
from ..errors import CheckpointError, InputError
from ..storage import CHECKSUM_KEY, load_safetensors, save_safetensors

__all__ = [
    "FORMAT",
    "PixelGaussianPolicy",
    "PolicyConfig",
    "load_policy_file",
    "read_policy_metadata",
    "save_policy_file",
]

FORMAT = "cosmos3_gym.policy"
KIND = "pixel_gaussian"


@dataclass(frozen=True)
class PolicyConfig:
    image_size: int = 96  # the observed frame's side; other sizes are resized with the envs' resize_frame
    chunk: int = 8
    action_dim: int = 2
    channels: tuple[int, ...] = (32, 64, 64, 64)
    hidden: int = 256
    initial_log_std: float = -2.5  # std 0.08 in the [-1, 1] action space: about 21 table pixels on the bundled task

    def __post_init__(self):
        for name in ("image_size", "chunk", "action_dim", "hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name}: expected a positive integer, got {value!r}.")
        object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))
        if len(self.channels) < 2 or min(self.channels) < 1:
            raise InputError(f"channels: expected at least two positive widths, got {self.channels!r}.")


@contextlib.contextmanager
def ieee_fp32_convolutions(device: torch.device):
    """cuDNN's float32 convolutions in IEEE float32 inside the block on a CUDA device, not TF32 (elsewhere a no-op).

    GRPO samples around the mean with sigma = exp(-3.5) = 0.03 and compares the log-probabilities the rollout
    computed with those the update computes. On an H200 with PyTorch's default (TF32 allowed for cuDNN convolutions)
    they disagreed far more than on the CPU: the median fraction of clipped ratios was 0.13 against the CPU's 0.017,
    and the k3 KL to the reference passed 5 in 8 of 145 iterations in the world model (44 of 400 in the real
    simulator, up to
    1e6; none on the CPU). With IEEE convolutions the same world-model run clipped a median 0.015 and the KL never
    passed 5 (benchmarks/RESULTS.md, issue 17, session 18). A no-grad forward matched the CPU to 4e-4 sigma either
    way, so the difference arises in the update's forward with autograd (the backward runs after this block, under
    the global setting); which one was not measured. The policy is a few MFLOP per frame."""
    if device.type != "cuda":
        yield
        return
    # torch's annotations of the replaced torch.backends.cudnn module leave out ``conv`` (an _FP32Precision).
    conv = torch.backends.cudnn.conv  # type: ignore[attr-defined]
    previous = conv.fp32_precision
    conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        conv.fp32_precision = previous


class SpatialSoftArgmax(nn.Module):
    """``[B, C, H, W]`` -> ``[B, 2C]``: the expected (x, y) in [-1, 1] of each channel's softmax over positions."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = features.shape
        weights = features.flatten(2).softmax(-1).view(batch, channels, height, width)
        ys = torch.linspace(-1.0, 1.0, height, device=features.device, dtype=features.dtype)
        xs = torch.linspace(-1.0, 1.0, width, device=features.device, dtype=features.dtype)
        x = (weights.sum(2) * xs).sum(-1)
        y = (weights.sum(3) * ys).sum(-1)
        return torch.cat([x, y], dim=1)


class PixelGaussianPolicy(nn.Module):
    """Frame -> Gaussian over action chunks; see the module docstring."""

    metadata: dict[str, Any]  # set by load_policy_file: the file's decoded metadata

    def __init__(self, config: PolicyConfig | None = None):
        super().__init__()
        self.config = config or PolicyConfig()
        c = self.config.channels
        layers: list[nn.Module] = [nn.Conv2d(3, c[0], 5, stride=2, padding=2), nn.ReLU()]
        for index, (a, b) in enumerate(zip(c[:-1], c[1:])):
            layers += [nn.Conv2d(a, b, 3, stride=2 if index % 2 else 1, padding=1), nn.ReLU()]
        self.encoder = nn.Sequential(*layers)
        self.keypoints = SpatialSoftArgmax()
        out = self.config.chunk * self.config.action_dim
        self.head = nn.Sequential(
            nn.Linear(2 * c[-1], self.config.hidden),
            nn.ReLU(),
            nn.Linear(self.config.hidden, self.config.hidden),
            nn.ReLU(),
            nn.Linear(self.config.hidden, out),
        )
        self.log_std = nn.Parameter(torch.full((out,), float(self.config.initial_log_std)))

    @property
    def action_shape(self) -> tuple[int, int]:
        return self.config.chunk, self.config.action_dim

    @property
    def device(self) -> torch.device:
        return self.log_std.device

    def preprocess(self, images: Any) -> torch.Tensor:
        """uint8 ``[B, H, W, 3]`` (numpy or tensor) -> float ``[B, 3, S, S]`` in [0, 1] on the policy's device."""
        if isinstance(images, torch.Tensor):
            tensor = images.to(self.device)
        else:
            images = np.asarray(images)
            if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
                raise InputError(
                    f"observation['image']: expected uint8 [N, H, W, 3], got {images.dtype} {list(images.shape)}."
                )
            size = self.config.image_size
            if images.shape[1:3] != (size, size):
                images = np.stack([resize_frame(image, (size, size)) for image in images])
            tensor = torch.from_numpy(np.ascontiguousarray(images)).to(self.device)
        return tensor.permute(0, 3, 1, 2).float() / 255.0

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Float ``[B, 3, S, S]`` -> the mean action chunk ``[B, chunk * action_dim]`` in [-1, 1]."""
        with ieee_fp32_convolutions(pixels.device):
            return torch.tanh(self.head(self.keypoints(self.encoder(pixels))))

    def distribution(self, pixels: torch.Tensor) -> torch.distributions.Normal:
        mean = self(pixels)
        return torch.distributions.Normal(mean, self.log_std.exp().expand_as(mean))

    @torch.no_grad()
    def act(self, observation: Any, deterministic: bool = True, generator: torch.Generator | None = None) -> np.ndarray:
        """Action chunks for ``{"image": [N, H, W, 3]}`` (or the images, or one frame): float32 ``[N, chunk, D]``
        (``[chunk, D]`` for one frame), clipped to [-1, 1]. ``deterministic``: the mean; else a sample."""
        images = observation["image"] if isinstance(observation, dict) else observation
        images = np.asarray(images) if not isinstance(images, torch.Tensor) else images
        single = images.ndim == 3
        if single:
            images = images[None]
        mean = self(self.preprocess(images))
        if not deterministic:
            noise = torch.randn(mean.shape, generator=generator, device="cpu").to(mean.device)
            mean = mean + noise * self.log_std.exp()
        actions = mean.clamp(-1.0, 1.0).view(-1, *self.action_shape).float().cpu().numpy()
        return actions[0] if single else actions

    def __call__(self, *args, **kwargs):
        # A tensor goes through forward (training); an observation (dict / numpy) gets actions (the eval API's
        # ``policy(observation) -> action``).
        if args and not isinstance(args[0], torch.Tensor):
            return self.act(*args, **kwargs)
        return super().__call__(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------


def save_policy_file(policy: PixelGaussianPolicy, path: str | os.PathLike, **metadata: Any) -> Path:
    """Write ``policy`` to ``path`` (safetensors, float32) with ``metadata`` (JSON-serialisable) beside its config."""
    clashing = sorted(set(metadata) & {"format", "kind", "config"})
    if clashing:
        raise InputError(f"metadata: {clashing} are written by save_policy_file itself.")
    header = {"format": FORMAT, "kind": KIND, "config": asdict(policy.config), **metadata}
    try:
        encoded = {key: json.dumps(value) for key, value in header.items()}
    except TypeError as error:
        raise InputError(f"metadata: values must be JSON-serialisable ({error})") from error
    tensors = {name: tensor.detach().float().cpu().contiguous() for name, tensor in policy.state_dict().items()}
    # Crash-safe: a temporary file, fsynced and renamed over ``path``, with the tensors' sha256 (cosmos3_gym.storage).
    return save_safetensors(path, tensors, encoded)


def read_policy_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The decoded metadata of any policy file this package writes (its header only). Files of
    ``cosmos3_gym.agents.save_sb3_policy`` read as ``{"kind": "sb3_ppo", ...}``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"policy file: {path} does not exist.")
    try:
        with safetensors.safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"policy file: {path} is not a readable safetensors file ({error})") from error
    try:
        metadata = {key: json.loads(value) for key, value in raw.items()}
    except json.JSONDecodeError as error:
        raise CheckpointError(f"policy file: {path} has metadata that is not JSON ({error}).") from error
    metadata.pop(CHECKSUM_KEY, None)
    if metadata.get("format") == "cosmos3_gym.sb3_policy.v1":
        metadata.setdefault("kind", "sb3_ppo")
    if "kind" not in metadata:
        raise CheckpointError(
            f"policy file: {path} says nothing of what it holds (no 'kind' in its metadata); "
            f"expected a file of cosmos3_gym.rl.policy.save_policy_file or save_sb3_policy."
        )
    return metadata


def load_policy_file(path: str | os.PathLike, device: torch.device | str = "cpu"):
    """The policy in ``path``, ready to act: ``PixelGaussianPolicy`` (kind ``pixel_gaussian``, eval mode) or, for
    an SB3 PPO file (kind ``sb3_ppo``), an ``SB3PolicyAgent``-backed callable. ``policy(observation) -> actions``
    (the mean) and ``policy.act(observation, deterministic)`` work for both."""
    metadata = read_policy_metadata(path)
    kind = metadata["kind"]
    if kind == "sb3_ppo":
        return _SB3FilePolicy(path, device)
    if kind != KIND or metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"policy file: {path} holds kind {kind!r} (format {metadata.get('format')!r}); this "
            f"version reads {KIND!r} ({FORMAT}) and 'sb3_ppo'."
        )
    try:
        policy = PixelGaussianPolicy(PolicyConfig(**metadata["config"]))
    except (TypeError, InputError) as error:
        raise CheckpointError(f"policy file: {path} has a config that does not describe a policy ({error}).") from error
    tensors, _ = load_safetensors(path, what="policy file")  # the checksum it was saved with is verified
    try:
        policy.load_state_dict(tensors, strict=True)
    except RuntimeError as error:
        raise CheckpointError(f"policy file: the weights in {path} do not fit its config ({error}).") from error
    policy.metadata = metadata
    return policy.eval().to(device)


class _SB3FilePolicy:
    """An SB3 PPO file behind the same ``__call__`` / ``act`` as ``PixelGaussianPolicy``."""

    def __init__(self, path, device):
        from ..agents.sb3_policy import SB3PolicyAgent

        self.agent = SB3PolicyAgent.from_file(path, device=device)
        self.name = f"sb3:{Path(path).name}"

    def act(self, observation: Any, deterministic: bool = True) -> np.ndarray:
        images = np.asarray(observation["image"] if isinstance(observation, dict) else observation)
        single = images.ndim == 3
        self.agent.deterministic = deterministic
        actions = self.agent.act(images[None] if single else images)
        return actions[0] if single else actions

    def __call__(self, observation: Any) -> np.ndarray:
        return self.act(observation, deterministic=True)
