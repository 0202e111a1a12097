"""``ClassifierRewardModel``: a small ResNet-style CNN scoring frames with a success probability.

The counterpart of RLinf's ``ResnetRM`` (ResNet -> sigmoid, applied to every generated frame), smaller and
self-contained: a stride-2 stem, one residual block per stage (each halving the resolution), global average pooling
and a linear head. Frames are resized to a fixed square input inside the model, so any frame size can be scored.
GroupNorm instead of BatchNorm keeps a frame's score independent of the other frames in its batch.

Weights are stored as safetensors next to a JSON config (``save``/``load``); nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..cuda_graphs import DEFAULT_MAX_PADDING, GraphedFunction, check_max_padding, replay_padded
from ..errors import CheckpointError, InputError
from ..storage import check_no_interrupted_save, is_weights_file, replace_entries, verify_manifest
from .base import check_frames

__all__ = ["ClassifierRewardModel", "train_classifier", "REDUCTIONS"]

REDUCTIONS = ("last", "max", "mean")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_FORMAT = "cosmos3_gym.ClassifierRewardModel"


def _group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class _ResidualBlock(nn.Module):
    """ResNet basic block (two 3x3 convs) that halves the resolution; a 1x1 projection on the shortcut."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False)
        self.norm1 = _group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = _group_norm(out_channels)
        self.shortcut = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride=2, bias=False), _group_norm(out_channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ClassifierRewardModel(nn.Module):
    """Success probability per frame; a chunk's reward reduces its frames' scores with ``reduce``.

    ``reduce``: ``"last"`` (score of the chunk's last frame), ``"max"`` (best frame: RLinf's success test) or
    ``"mean"``.
    """

    def __init__(
        self,
        input_size: int = 64,
        channels: Sequence[int] = (16, 32, 64),
        reduce: str = "last",
        name: str | None = None,
    ):
        super().__init__()
        if isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 8:
            raise InputError(f"input_size: expected an integer >= 8, got {input_size!r}")
        channels = list(channels)
        if not channels or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in channels):
            raise InputError(f"channels: expected a non-empty list of positive integers, got {channels!r}")
        self.input_size = input_size
        self.channels = channels
        self.reduce = _check_reduce(reduce)
        self.name = name or "classifier"
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels[0], 3, stride=2, padding=1, bias=False), _group_norm(channels[0]), nn.ReLU()
        )
        self.blocks = nn.Sequential(*(_ResidualBlock(c_in, c_out) for c_in, c_out in zip(channels, channels[1:])))
        self.head = nn.Linear(channels[-1], 1)
        self._graphed_scores: GraphedFunction | None = None  # use_cuda_graphs

    def use_cuda_graphs(
        self, on: bool = True, max_padding: float | None = DEFAULT_MAX_PADDING
    ) -> ClassifierRewardModel:
        """Replay ``score_frames`` as CUDA graphs (one per image shape, rows padded as ``cuda_graphs.graph_rows``;
        GroupNorm scores each frame alone, so padding rows change nothing): the env's one-env step launches its ~30
        kernels at once. Same math. Needs the model on a CUDA device; moving it (``to``) drops the graphs, and while
        it is off the GPU the eager forward runs. The built-in model's env turns it on where its engine replays its
        stages as
        CUDA graphs (``Cosmos3Engine.stage_graphs``), with the engine's ``graph_padding`` as ``max_padding``
        (``cuda_graphs.graph_rows``)."""
        check_max_padding(max_padding)
        if not on:
            self._graphed_scores = None
            return self
        device = self.head.weight.device
        if device.type != "cuda":
            raise InputError(f"cuda_graphs: needs the reward model on a CUDA device, it is on {device}")
        if self._graphed_scores is None:
            self._graphed_scores = GraphedFunction(self._scores, device, max_graphs=8)
        self._graphed_scores.max_padding = max_padding
        return self

    @property
    def cuda_graphs(self) -> bool:
        return self._graphed_scores is not None

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() move or recast the weights the graphs read at their old addresses
        if self._graphed_scores is not None:
            self._graphed_scores.reset()
        return super()._apply(fn, *args, **kwargs)

    @property
    def frames_read(self) -> str:
        """Which frames of a chunk the score depends on: "last" with ``reduce="last"``, else "all". An env that
        returns only the last frame may then decode only that one (``Cosmos3VAE.decode(frames="last")``)."""
        return "last" if self.reduce == "last" else "all"

    @property
    def config(self) -> dict[str, Any]:
        return {"format": _FORMAT, "input_size": self.input_size, "channels": self.channels, "reduce": self.reduce}

    # ------------------------------------------------------------------ scoring

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[N, 3, H, W]`` float in [0, 1] (any size) -> success logits ``[N]``."""
        size = (self.input_size, self.input_size)
        images = images.to(device=self.head.weight.device, dtype=self.head.weight.dtype)
        if images.shape[-2:] != size:
            images = F.interpolate(images, size=size, mode="bilinear", align_corners=False, antialias=True)
        features = self.blocks(self.stem(images * 2.0 - 1.0))
        return self.head(features.mean(dim=(2, 3))).squeeze(-1)

    @torch.no_grad()
    def score_frames(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[N, 3, H, W]`` float in [0, 1] -> success probabilities ``[N]``."""
        graphed = self._graphed_scores
        if graphed is not None and self.head.weight.device == graphed.device:
            return replay_padded(graphed, images)
        return self._scores(images)

    def _scores(self, images: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(images))

    @torch.no_grad()
    def forward(self, frames: torch.Tensor, tasks: list[str]) -> torch.Tensor:
        """``frames [B, T, 3, H, W]`` in [0, 1] -> rewards ``[B]``: every frame is scored, then reduced over T."""
        frames, _ = check_frames(frames, tasks)
        if self.reduce == "last":  # each frame is scored alone (GroupNorm, no batch statistics): score only the last
            return self.score_frames(frames[:, -1])
        batch, steps = frames.shape[:2]
        scores = self.score_frames(frames.flatten(0, 1)).view(batch, steps)
        if self.reduce == "max":
            return scores.amax(dim=1)
        return scores.mean(dim=1)

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path/config.json`` and ``path/model.safetensors`` (the directory is created) with the crash-safe
        protocol of ``cosmos3_gym.storage.replace_entries`` (a previous model stays whole until the new one is complete;
        a MANIFEST.json of sizes and sha256s, which ``load`` checks). Returns ``path``."""
        config = json.dumps(self.config, indent=2) + "\n"
        state = {key: value.detach().cpu().contiguous() for key, value in self.state_dict().items()}

        def fill(staging: Path) -> None:
            (staging / CONFIG_NAME).write_text(config)
            safetensors.torch.save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})

        return replace_entries(path, fill)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        device: torch.device | str = "cpu",
        reduce: str | None = None,
        name: str | None = None,
    ) -> ClassifierRewardModel:
        """Load a directory written by ``save`` (or its ``model.safetensors``); ``reduce`` overrides the saved one."""
        path = Path(path)
        if path.is_file() and path.name == WEIGHTS_NAME:
            path = path.parent
        config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not config_path.is_file() or not weights_path.is_file():
            raise CheckpointError(
                f"classifier: expected a directory with {CONFIG_NAME} and {WEIGHTS_NAME} "
                f"(written by ClassifierRewardModel.save), got {str(path)!r}"
            )
        check_no_interrupted_save(path, "classifier")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"classifier: cannot read {config_path}: {error}") from error
        if not isinstance(config, dict) or config.get("format") != _FORMAT:
            raise CheckpointError(f"classifier: {config_path} is not a {_FORMAT} config (its 'format' differs)")
        # The saved JSON values as they are: the constructor checks them (an InputError becomes a CheckpointError).
        saved_input_size: Any = config.get("input_size")
        saved_reduce: Any = config.get("reduce")
        try:
            model = cls(
                input_size=saved_input_size,
                channels=config.get("channels") or [],
                reduce=saved_reduce,
                name=name,
            )
        except InputError as error:
            raise CheckpointError(f"classifier: {config_path}: {error}") from error
        if reduce is not None:
            model.reduce = _check_reduce(reduce)
        verify_manifest(path, what="classifier", required=False, only=is_weights_file)  # damaged weights are named
        try:
            state = safetensors.torch.load_file(str(weights_path))
            model.load_state_dict(state, strict=True)
        except Exception as error:  # safetensors raises its own error types; load_state_dict a RuntimeError
            raise CheckpointError(f"classifier: cannot load weights {weights_path}: {error}") from error
        return model.eval().to(device)


def _check_reduce(reduce: Any) -> str:
    if reduce not in REDUCTIONS:
        raise InputError(f"reduce: expected one of {list(REDUCTIONS)}, got {reduce!r}")
    return reduce


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------


def train_classifier(
    frames: Any,
    labels: Any,
    *,
    epochs: int = 10,
    lr: float = 1e-3,
    batch_size: int = 64,
    seed: int = 0,
    progress: bool = True,
    device: torch.device | str = "cpu",
    input_size: int = 64,
    channels: Sequence[int] = (16, 32, 64),
    reduce: str = "last",
) -> ClassifierRewardModel:
    """Train a ``ClassifierRewardModel`` on labelled frames with binary cross-entropy and Adam.

    ``frames``: uint8 ``[N, H, W, 3]`` or float ``[N, 3, H, W]`` in [0, 1] (numpy or torch); ``labels``: ``[N]`` in
    [0, 1] (success 1, failure 0; soft labels are fine). Frames stay in their own dtype and are converted one batch
    at a time, so a large uint8 dataset is not copied to float. The same ``seed`` gives the same weights.
    """
    images = _as_image_batch(frames)
    targets = _as_labels(labels, images.shape[0])
    for field, value in (("epochs", epochs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{field}: expected an integer >= 1, got {value!r}")
    if not isinstance(lr, (int, float)) or not np.isfinite(lr) or lr <= 0:
        raise InputError(f"lr: expected a positive number, got {lr!r}")

    # Initialise from the seed without touching the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ClassifierRewardModel(input_size=input_size, channels=channels, reduce=reduce)
    model = model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    shuffle = torch.Generator().manual_seed(seed)
    count = images.shape[0]

    bar = tqdm(range(epochs), desc="training reward classifier", disable=not progress)
    for _ in bar:
        total_loss, correct = 0.0, 0
        for index in torch.randperm(count, generator=shuffle).split(batch_size):
            batch = _to_float_chw(images[index]).to(device)
            target = targets[index].to(device)
            logits = model.logits(batch)
            loss = F.binary_cross_entropy_with_logits(logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * len(index)
            correct += int(((logits > 0) == (target >= 0.5)).sum().item())
        bar.set_postfix(loss=f"{total_loss / count:.4f}", accuracy=f"{correct / count:.3f}")
    return model.eval()


def _as_image_batch(frames: Any) -> torch.Tensor:
    """uint8 ``[N, H, W, 3]`` or float ``[N, 3, H, W]`` in [0, 1] -> a tensor in that same layout and dtype."""
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(frames)
    if not isinstance(frames, torch.Tensor):
        raise InputError(f"frames: expected a numpy array or torch tensor, got {type(frames).__name__}")
    if frames.dtype == torch.uint8:
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
            raise InputError(f"frames: uint8 frames must be [N, H, W, 3] with N >= 1, got {list(frames.shape)}")
        return frames
    if frames.is_floating_point():
        if frames.ndim != 4 or frames.shape[1] != 3 or frames.shape[0] == 0:
            raise InputError(f"frames: float frames must be [N, 3, H, W] with N >= 1, got {list(frames.shape)}")
        low, high = frames.aminmax()
        if not (0.0 <= low.item() and high.item() <= 1.0):
            raise InputError(f"frames: float frames must lie in [0, 1], got range [{low.item()}, {high.item()}]")
        return frames
    raise InputError(f"frames: expected uint8 [N, H, W, 3] or float [N, 3, H, W], got dtype {frames.dtype}")


def _to_float_chw(images: torch.Tensor) -> torch.Tensor:
    if images.dtype == torch.uint8:
        return images.permute(0, 3, 1, 2).float() / 255.0
    return images.float()


def _as_labels(labels: Any, count: int) -> torch.Tensor:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu()
    try:
        values = torch.as_tensor(np.asarray(labels, dtype=np.float32))
    except (TypeError, ValueError) as error:
        raise InputError(f"labels: expected {count} numbers in [0, 1] ({error})") from error
    if tuple(values.shape) != (count,):
        raise InputError(f"labels: expected shape [{count}] (one per frame), got {list(values.shape)}")
    if not torch.isfinite(values).all() or values.min() < 0 or values.max() > 1:
        raise InputError("labels: expected values in [0, 1]")
    return values
