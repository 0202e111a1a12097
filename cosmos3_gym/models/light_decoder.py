"""``LightDecoder``: a small 2-D convolutional decoder trained for the latent space of a Cosmos3 VAE.

The exact decode (``Cosmos3VAE.decode``, the causal Wan decoder) runs every latent frame through 3-D convolutions
even when only the last pixel frame is wanted (the env's observation and reward: ``decode="last"``); for the
built-in model that is ~51 GFLOP per env step and most of its time. For models this project trains itself, a
cheaper decoder of the same latents is allowed when the fidelity metrics say it is good enough (issue 24). This one
is TAESD / TAEHV-shaped: plain 3x3 convolutions with ReLU, residual blocks, nearest-neighbour 2x upsampling and a
pixel-shuffle head; no attention, no normalisation, no 3-D convolutions.

Time: the pixel frames of latent frame ``i`` are predicted from latent frames ``i`` and ``i - 1`` concatenated on
the channels (latent frame 0 sees itself twice), so the decoder is causal and looks back one latent frame. As in the
VAE, latent frame 0 gives one pixel frame and every later latent frame ``temporal_compression`` (4): ``t`` latent
frames give ``1 + 4(t - 1)`` pixel frames. One head convolution predicts all of them at once as channel groups:
group 0 is the first latent frame's pixel frame, groups 1..4 the 4 pixel frames of a later latent frame. So
``frames="last"`` runs the trunk on the last latent pair only and the head's last group only: its cost does not grow
with the clip.

Input: normalised latents ``[B, z, t, h, w]`` exactly as ``Cosmos3VAE.decode`` takes them; output ``[B, 3, T, 16h,
16w]`` float32 in [0, 1] (the same contract). Files: ``save_pretrained`` / ``from_pretrained`` write and read
``config.json`` and ``model.safetensors`` (diffusers-style; nothing is unpickled). Trained by
``cosmos3_gym.training.light_decoder.train_light_decoder``; used by the engine with
``Cosmos3Engine.from_pretrained(..., decoder="light")`` from the checkpoint's ``light_decoder/`` folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F

from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.storage import check_no_interrupted_save, is_weights_file, replace_entries, verify_manifest

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_CLASS_NAME = "LightDecoder"
ACTIVATIONS = ("relu", "silu")
FRAMES = ("all", "last")


@dataclass(frozen=True)
class LightDecoderConfig:
    """The decoder's shape (configs as data: ``config.json`` holds these fields).

    ``channels[k]`` is the width at ``2**k`` times the latent resolution, after ``blocks[k]`` residual blocks; the
    last level is followed by a 3x3 head convolution and a ``patch_size`` pixel shuffle, so the spatial compression
    is ``2**(len(channels) - 1) * patch_size`` (16 for the defaults, as the Wan2.2 VAE). The defaults cost about
    3.3 GFLOP per last frame at a 16 x 16 latent (the built-in model's exact decode: ~51) and weigh 2.2 MB in fp16.
    """

    latent_channels: int = 16
    channels: tuple[int, ...] = (128, 96, 64, 32)
    blocks: tuple[int, ...] = (2, 1, 1, 1)
    patch_size: int = 2
    temporal_compression: int = 4
    activation: str = "relu"

    def __post_init__(self) -> None:
        # JSON gives lists; the dataclass is frozen, so normalise through object.__setattr__.
        for name in ("channels", "blocks"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    def validate(self) -> None:
        def fail(name: str, expected: str):
            raise InputError(f"LightDecoderConfig.{name}: expected {expected}, got {getattr(self, name)!r}")

        def positive_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value >= 1

        for name in ("latent_channels", "patch_size", "temporal_compression"):
            if not positive_int(getattr(self, name)):
                fail(name, "an integer >= 1")
        if not isinstance(self.channels, tuple) or not self.channels or not all(map(positive_int, self.channels)):
            fail("channels", "a non-empty tuple of integers >= 1")
        if (
            not isinstance(self.blocks, tuple)
            or len(self.blocks) != len(self.channels)
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.blocks)
        ):
            fail("blocks", f"a tuple of {len(self.channels)} integers >= 0 (one per entry of channels)")
        if self.activation not in ACTIVATIONS:
            fail("activation", f"one of {list(ACTIVATIONS)}")

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.channels) - 1) * self.patch_size

    def to_dict(self) -> dict[str, Any]:
        return {"_class_name": _CLASS_NAME, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LightDecoderConfig:
        values = {key: value for key, value in values.items() if not key.startswith("_")}
        unknown = sorted(set(values) - {field.name for field in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"LightDecoderConfig: unknown fields {unknown}")
        return cls(**values)


class _ResidualBlock(torch.nn.Module):
    """act(x + conv(act(conv(x)))), 3x3 convolutions of constant width."""

    def __init__(self, channels: int, activation: torch.nn.Module):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.act = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x + self.conv2(self.act(self.conv1(x))))


class LightDecoder(torch.nn.Module):
    """Normalised Cosmos3 latents -> pixels, cheaply; see the module docstring."""

    def __init__(self, config: LightDecoderConfig | None = None):
        super().__init__()
        self.config = config = config or LightDecoderConfig()
        act = torch.nn.ReLU(inplace=True) if config.activation == "relu" else torch.nn.SiLU(inplace=True)
        self.conv_in = torch.nn.Conv2d(2 * config.latent_channels, config.channels[0], 3, padding=1)
        levels = []
        for k, (width, count) in enumerate(zip(config.channels, config.blocks)):
            layers: list[torch.nn.Module] = []
            if k > 0:  # 2x up from the previous level, then a convolution to this level's width
                layers += [
                    torch.nn.Upsample(scale_factor=2, mode="nearest"),
                    torch.nn.Conv2d(config.channels[k - 1], width, 3, padding=1),
                    act,
                ]
            layers += [_ResidualBlock(width, act) for _ in range(count)]
            levels.append(torch.nn.Sequential(*layers))
        self.levels = torch.nn.ModuleList(levels)
        self.act = act
        # (1 + temporal_compression) groups of 3 * patch**2 channels: the first latent frame's pixel frame, then the
        # pixel frames of a later latent frame; each group is pixel-shuffled to 3 channels.
        self.conv_out = torch.nn.Conv2d(config.channels[-1], self.frames_per_head * self.group_channels, 3, padding=1)

    # ------------------------------------------------------------------ shape

    @property
    def group_channels(self) -> int:
        return 3 * self.config.patch_size**2

    @property
    def frames_per_head(self) -> int:
        return 1 + self.config.temporal_compression

    @property
    def latent_channels(self) -> int:
        return self.config.latent_channels

    @property
    def spatial_compression(self) -> int:
        return self.config.spatial_compression

    @property
    def temporal_compression(self) -> int:
        return self.config.temporal_compression

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.conv_in.weight.device

    def num_frames(self, latent_frames: int) -> int:
        """Pixel frames of ``latent_frames`` latent frames: ``1 + temporal_compression * (latent_frames - 1)``."""
        return 1 + self.config.temporal_compression * (latent_frames - 1)

    # ------------------------------------------------------------------ forward

    def trunk(self, pairs: torch.Tensor) -> torch.Tensor:
        """Latent pairs ``[N, 2z, h, w]`` (frame i, frame i-1) -> features at ``1 / patch_size`` of the pixels."""
        x = self.act(self.conv_in(pairs))
        for level in self.levels:
            x = level(x)
        return x

    def head(self, features: torch.Tensor, groups: slice) -> torch.Tensor:
        """The head's frame ``groups`` only (a slice of the output convolution's weights): ``[N, 3, G, H, W]``."""
        width = self.group_channels
        weight = self.conv_out.weight[groups.start * width : groups.stop * width]
        assert self.conv_out.bias is not None  # built with a bias
        bias = self.conv_out.bias[groups.start * width : groups.stop * width]
        x = F.conv2d(features, weight, bias, padding=1)
        count = groups.stop - groups.start
        n, _, h, w = x.shape
        x = F.pixel_shuffle(x.reshape(n * count, width, h, w), self.config.patch_size)  # [N*G, 3, H, W]
        return x.reshape(n, count, 3, *x.shape[-2:]).transpose(1, 2)

    def forward(self, latents: torch.Tensor, frames: str = "all") -> torch.Tensor:
        """Normalised latents ``[B, z, t, h, w]`` -> pixels ``[B, 3, T, H, W]`` in the VAE's [-1, 1] scale,
        unclamped, in the module's dtype (for training; ``decode`` is the inference entry point). ``frames="last"``:
        ``T == 1``, only the last pixel frame (last latent pair, last head group)."""
        b, z, t, h, w = latents.shape
        x = latents.to(self.dtype)
        previous = torch.cat([x[:, :, :1], x[:, :, :-1]], dim=2)  # frame i-1; frame 0 sees itself
        pairs = torch.cat([x, previous], dim=1)  # [B, 2z, t, h, w]
        if frames == "last":
            features = self.trunk(self._channels_last(pairs[:, :, -1]))
            group = slice(0, 1) if t == 1 else slice(self.frames_per_head - 1, self.frames_per_head)
            return self.head(features, group)
        features = self.trunk(self._channels_last(pairs.transpose(1, 2).reshape(b * t, 2 * z, h, w)))
        features = features.reshape(b, t, *features.shape[1:])
        first = self.head(features[:, 0], slice(0, 1))  # [B, 3, 1, H, W]
        if t == 1:
            return first
        later = self.head(features[:, 1:].reshape(b * (t - 1), *features.shape[2:]), slice(1, self.frames_per_head))
        later = later.reshape(b, t - 1, 3, self.temporal_compression, *later.shape[-2:])  # [B, t-1, 3, 4, H, W]
        later = later.permute(0, 2, 1, 3, 4, 5).reshape(b, 3, (t - 1) * self.temporal_compression, *later.shape[-2:])
        return torch.cat([first, later], dim=2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, frames: str = "all") -> torch.Tensor:
        """``Cosmos3VAE.decode``'s contract: normalised latents ``[B, z, t, h, w]`` -> pixels ``[B, 3, 1 + 4(t-1),
        16h, 16w]`` (``frames="last"``: ``[B, 3, 1, 16h, 16w]``) float32 in [0, 1]."""
        if frames not in FRAMES:
            raise InputError(f"frames: expected 'all' or 'last', got {frames!r}")
        if not isinstance(latents, torch.Tensor) or latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            shape = list(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise InputError(f"latents: expected a tensor [B, {self.latent_channels}, t, h, w], got {shape}")
        if not latents.is_floating_point() or latents.shape[2] < 1:
            raise InputError(
                f"latents: expected a floating-point tensor with t >= 1, got dtype {latents.dtype}, "
                f"shape {list(latents.shape)}"
            )
        pixels = self(latents.to(self.device), frames=frames)
        return (pixels.float() * 0.5 + 0.5).clamp_(0.0, 1.0).contiguous()

    # ------------------------------------------------------------------ fast path

    def use_channels_last(self) -> LightDecoder:
        """Store the convolution weights channels-last (NHWC): the layout cuDNN's bf16 tensor-core kernels and
        oneDNN read natively; the input is converted once and the activations follow. Same math."""
        for module in self.modules():
            if isinstance(module, torch.nn.Conv2d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)
        return self

    def _channels_last(self, x: torch.Tensor) -> torch.Tensor:
        # once at the input: every convolution after it keeps the layout of its input and weights
        if self.conv_in.weight.is_contiguous(memory_format=torch.channels_last):
            return x.contiguous(memory_format=torch.channels_last)
        return x

    # ------------------------------------------------------------------ files

    def save_pretrained(
        self, path: str | os.PathLike, dtype: torch.dtype | None = None, extra_files: dict[str, str] | None = None
    ) -> Path:
        """Write ``path/config.json`` and ``path/model.safetensors`` (in ``dtype``, default the module's), and the text
        files ``extra_files`` (name -> content), with the crash-safe protocol of ``cosmos3_gym.storage.replace_entries``
        (a previous decoder stays whole until the new one is complete; a MANIFEST.json of sizes and sha256s, which
        ``from_pretrained`` checks)."""
        config = json.dumps(self.config.to_dict(), indent=2) + "\n"
        state = {
            key: value.detach().to("cpu", dtype or value.dtype).contiguous() for key, value in self.state_dict().items()
        }

        def fill(staging: Path) -> None:
            (staging / CONFIG_NAME).write_text(config)
            safetensors.torch.save_file(state, str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
            for name, text in (extra_files or {}).items():
                (staging / name).write_text(text)

        return replace_entries(path, fill)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> LightDecoder:
        """Load a folder written by ``save_pretrained``; ``CheckpointError`` saying what is wrong otherwise."""
        path = Path(path)
        config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not config_path.is_file() or not weights_path.is_file():
            raise CheckpointError(
                f"light decoder: expected a folder with {CONFIG_NAME} and {WEIGHTS_NAME} "
                f"(LightDecoder.save_pretrained), got {str(path)!r}"
            )
        check_no_interrupted_save(path, "light decoder")
        try:
            values = json.loads(config_path.read_text())
            if not isinstance(values, dict) or values.get("_class_name") != _CLASS_NAME:
                raise InputError(f"'_class_name' is not {_CLASS_NAME!r}")
            config = LightDecoderConfig.from_dict(values)
        except (OSError, json.JSONDecodeError, InputError, TypeError) as error:
            raise CheckpointError(f"light decoder: bad {config_path}: {error}") from error
        model = cls(config)
        verify_manifest(path, what="light decoder", required=False, only=is_weights_file)  # damaged weights are named
        try:
            model.load_state_dict(safetensors.torch.load_file(str(weights_path)), strict=True)
        except Exception as error:  # safetensors raises its own error types; load_state_dict a RuntimeError
            raise CheckpointError(f"light decoder: cannot load weights {weights_path}: {error}") from error
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
