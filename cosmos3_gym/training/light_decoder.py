"""Distilling a ``LightDecoder`` (``cosmos3_gym.models.light_decoder``) for the latent space of a Cosmos3 VAE.

Data: the training windows the world model sees (``chunk + 1`` frames, starting every ``stride`` frames, as
``training.data`` builds them): each window's frames go through ``processor.prepare_conditioning`` and the frozen
VAE's ``encode`` exactly as at inference (``training.data.encode_windows``), and the decoder learns to map those
latents back to the window's real frames (``build_decoder_windows``). With ``handover="latent"`` (a world model that
hands chunks over as latents, ``training.data``) the windows are cut from whole-episode encodings instead, so the
decoder learns the pairs of consecutive latent frames of long encodings that it decodes in such an env; a window's
first latent frame then stands for its last pixel frame. The windows live in memory: latents float32
and frames uint8 ``[N, 3, chunk + 1, H, W]`` (1.8 MB per 9-frame 256 x 256 window), on the training device.

Loss, per pixel frame of the window: ``l1_weight * L1 + gradient_weight * L1 of the horizontal and vertical pixel
differences`` (edges: the agent and the T's outline), with the VAE trainer's contrast weighting
(``training.vae.reconstruction_weights``: pixels away from the background count more, a table scene being mostly empty
table) and ``last_frame_weight`` extra on each latent frame's last pixel frame (frames 0, 4, 8, ...: the one the env
returns with ``decode="last"``); ``latent_noise`` optionally perturbs the latents (the world model's are generated).
AdamW, warmup then cosine, bf16 autocast on a GPU, a step budget and optionally a time budget (``seconds``: then the
schedule follows the elapsed time, and the step count depends on the machine).
``decoder_psnr`` measures the result on held-out windows against the real frames and the exact VAE decode.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import processor
from ..checkpoint import HANDOVERS
from ..data.episodes import window_starts
from ..errors import InputError
from ..models.light_decoder import LightDecoder, LightDecoderConfig
from .data import encode_episode, encode_windows, latent_windows, read_dataset
from .schedule import check_optimizer_settings, learning_rate
from .vae import reconstruction_weights


@dataclass
class LightDecoderTrainConfig:
    """Settings of ``train_light_decoder``."""

    decoder: LightDecoderConfig = field(default_factory=LightDecoderConfig)
    steps: int = 20_000  # at most this many optimizer steps
    seconds: float | None = None  # and at most this long (the schedule then runs on the elapsed time)
    batch_size: int = 32  # windows per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 100
    lr_schedule: str = "cosine"  # after warmup: "constant", or cosine decay to min_lr_ratio * lr at the end
    min_lr_ratio: float = 0.05
    grad_clip: float = 1.0  # 0 disables clipping
    l1_weight: float = 1.0
    gradient_weight: float = 0.5
    contrast_weight: float = 10.0  # as the built-in model's VAE was trained
    last_frame_weight: float = 1.0
    # std of Gaussian noise added to the (unit-variance) latents of each batch: robustness to the world model's
    # generated latents, which are near but not on the encoder's outputs; 0 trains on the encoded latents as they are
    latent_noise: float = 0.0
    seed: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    bf16: bool = True  # bf16 autocast on CUDA; ignored on CPU
    log_every: int = 50
    progress: bool = True

    def validate(self) -> None:
        def fail(name: str, expected: str):
            raise InputError(f"LightDecoderTrainConfig.{name}: expected {expected}, got {getattr(self, name)!r}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not isinstance(self.decoder, LightDecoderConfig):
            fail("decoder", "a LightDecoderConfig")
        for name in ("steps", "batch_size", "log_every"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "an integer >= 1")
        for name in ("warmup_steps", "seed"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                fail(name, "an integer >= 0")
        if self.seconds is not None and (not isinstance(self.seconds, (int, float)) or not self.seconds > 0):
            fail("seconds", "a positive number or None")
        check_optimizer_settings(
            self,
            fail,
            (
                "lr",
                "weight_decay",
                "grad_clip",
                "l1_weight",
                "gradient_weight",
                "contrast_weight",
                "last_frame_weight",
                "latent_noise",
            ),
        )


@dataclass
class DecoderWindows:
    """Windows for the decoder: normalised latents and the real frames they were encoded from."""

    latents: torch.Tensor  # [N, C, t, h, w] float32, as Cosmos3VAE.encode gives them (content crop)
    frames: torch.Tensor  # [N, 3, 1 + 4(t-1), 16h, 16w] uint8, the content pixels

    def __post_init__(self) -> None:
        if self.latents.ndim != 5 or self.frames.ndim != 5 or self.frames.dtype != torch.uint8:
            raise InputError(
                f"DecoderWindows: expected latents [N, C, t, h, w] and uint8 frames [N, 3, T, H, W], "
                f"got {list(self.latents.shape)} and {self.frames.dtype} {list(self.frames.shape)}"
            )
        if len(self.latents) != len(self.frames) or len(self.latents) == 0:
            raise InputError(
                f"DecoderWindows: expected as many latents as frame clips (>= 1), got "
                f"{len(self.latents)} and {len(self.frames)}"
            )

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    def to(self, device: torch.device | str) -> DecoderWindows:
        return DecoderWindows(self.latents.to(device), self.frames.to(device))


@torch.no_grad()
def build_decoder_windows(
    dataset_dir: str | os.PathLike,
    vae,
    *,
    chunk: int,
    stride: int | None = None,
    resolution_tier: int = 256,
    encode_batch_size: int = 64,
    max_episodes: int | None = None,
    progress: bool = True,
    handover: str = "pixels",
) -> DecoderWindows:
    """The ``chunk + 1`` frame windows of a dataset's episodes (every ``stride`` frames, default ``chunk``), encoded
    by ``vae`` (a ``Cosmos3VAE``) as the world model's training windows are (``handover``: each window on its own, or
    cut from whole-episode encodings; see the module docstring), with their content frames as uint8."""
    tc = vae.temporal_compression
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or chunk % tc:
        raise InputError(f"chunk: expected a positive multiple of {tc}, got {chunk!r}")
    stride = chunk if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise InputError(f"stride: expected an integer >= 1, got {stride!r}")
    if handover not in HANDOVERS:
        raise InputError(f"handover: expected one of {list(HANDOVERS)}, got {handover!r}")
    if handover == "latent" and stride % tc:
        raise InputError(f"stride: expected a multiple of {tc} with handover 'latent', got {stride}")
    store = read_dataset(dataset_dir).episodes
    count = len(store) if max_episodes is None else min(max_episodes, len(store))
    latents, frames = [], []
    for i in tqdm(range(count), desc="encoding windows", disable=not progress, leave=False):
        starts = window_starts(store.load(i, with_frames=False).num_actions, chunk, stride)
        if not starts:
            continue
        episode = store.read_frames(i)
        cond = processor.prepare_conditioning(episode, resolution_tier, int(episode.shape[0]))
        if handover == "latent":  # E[j .. j+chunk/tc] for the frames s .. s+chunk, s = tc*j
            latents.append(latent_windows(encode_episode(vae, cond), starts, chunk, tc, context_frames=1))
        else:
            latents.append(encode_windows(vae, cond, starts, chunk, encode_batch_size))
        h, w = cond.latent_hw
        content = cond.pixels[0, :, :, : h * vae.spatial_compression, : w * vae.spatial_compression]
        content = ((content + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)  # exact for uint8 sources
        frames.append(torch.stack([content[:, s : s + chunk + 1] for s in starts]))
    if not latents:
        raise InputError(f"chunk: {chunk} is longer than every episode of {dataset_dir}")
    return DecoderWindows(torch.cat(latents), torch.cat(frames))


def frame_weights(num_frames: int, temporal_compression: int, last_frame_weight: float) -> torch.Tensor:
    """[T] weights: 1, plus ``last_frame_weight`` on each latent frame's last pixel frame (0, 4, 8, ...)."""
    weights = torch.ones(num_frames)
    weights[::temporal_compression] += last_frame_weight
    return weights


def light_decoder_loss(
    decoder: LightDecoder, latents: torch.Tensor, target: torch.Tensor, config: LightDecoderTrainConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss of one batch (module docstring); ``target`` [B, 3, T, H, W] in [0, 1]."""
    pixels = decoder(latents).float() * 0.5 + 0.5  # [B, 3, T, H, W], the decode's [0, 1] scale, unclamped
    weights = reconstruction_weights(target, config.contrast_weight)
    weights = weights * frame_weights(target.shape[2], decoder.temporal_compression, config.last_frame_weight).to(
        target.device
    ).view(1, 1, -1, 1, 1)
    l1 = ((pixels - target).abs() * weights).mean() / weights.mean()
    gradient = (pixels.diff(dim=-1) - target.diff(dim=-1)).abs().mean() + (
        pixels.diff(dim=-2) - target.diff(dim=-2)
    ).abs().mean()
    loss = config.l1_weight * l1 + config.gradient_weight * gradient
    return loss, {"l1": l1.detach(), "gradient": gradient.detach()}


def train_light_decoder(
    windows: DecoderWindows,
    out_dir: str | os.PathLike | None = None,
    config: LightDecoderTrainConfig | None = None,
    *,
    init: LightDecoder | None = None,
) -> LightDecoder:
    """Train a ``LightDecoder`` (``init`` to continue one, else a new one seeded by ``config.seed``) on ``windows``;
    with ``out_dir``, save it there (``save_pretrained``: config.json, model.safetensors) with ``train_log.jsonl``
    and ``train_config.json``. Returns the decoder (float32, eval mode, on the training device)."""
    config = config or LightDecoderTrainConfig()
    config.validate()
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if windows.latents.shape[1] != config.decoder.latent_channels:
        raise InputError(
            f"windows: latents with {windows.latents.shape[1]} channels, the decoder config has "
            f"latent_channels={config.decoder.latent_channels}"
        )
    if init is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            decoder = LightDecoder(config.decoder)
    else:
        decoder = init
    decoder = decoder.to(device=device, dtype=torch.float32).train().requires_grad_(True)
    if device.type == "cuda":
        decoder.use_channels_last()  # bf16 tensor-core convolutions read NHWC natively
    data = windows.to(device)
    betas = cast("tuple[float, float]", tuple(config.betas))
    optimizer = torch.optim.AdamW(decoder.parameters(), lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    autocast = device.type == "cuda" and config.bf16
    generator = torch.Generator().manual_seed(config.seed)
    log_path = None
    if out_dir is not None:
        out_dir = Path(out_dir).expanduser()
        out_dir.mkdir(parents=True, exist_ok=True)
        log_path = out_dir / "train_log.jsonl"
        log_path.write_text("")
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, l1, gradient since the last log line
    started = last_log = time.perf_counter()
    bar = tqdm(total=config.steps, desc="training light decoder", disable=not config.progress)
    step = 0
    while step < config.steps:
        elapsed = time.perf_counter() - started
        if config.seconds is not None and elapsed >= config.seconds:
            break
        lr = learning_rate(config, step, elapsed / config.seconds if config.seconds is not None else 0.0)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = torch.randint(len(data), (config.batch_size,), generator=generator).to(device)
        target = data.frames[index].float() / 255.0
        latents = data.latents[index]
        if config.latent_noise > 0:
            noise = torch.randn(latents.shape, generator=generator).to(device)
            latents = latents + config.latent_noise * noise
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, parts = light_decoder_loss(decoder, latents, target, config)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(decoder.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums += torch.stack([loss.detach(), parts["l1"], parts["gradient"]]).double()
        step += 1
        bar.update(1)
        if step % config.log_every == 0 or step == config.steps:
            n = (step - 1) % config.log_every + 1
            loss_mean, l1, gradient = (sums / n).tolist()  # a device sync: the time budget is checked on real time
            now = time.perf_counter()
            if log_path is not None:
                with log_path.open("a") as handle:
                    handle.write(
                        json.dumps(
                            {
                                "step": step,
                                "lr": lr,
                                "loss": loss_mean,
                                "l1": l1,
                                "gradient": gradient,
                                "elapsed_s": round(now - started, 2),
                                "windows_per_s": n * config.batch_size / max(now - last_log, 1e-9),
                            }
                        )
                        + "\n"
                    )
            bar.set_postfix(loss=f"{loss_mean:.4f}")
            sums.zero_()
            last_log = now
    bar.close()
    decoder = decoder.eval().requires_grad_(False)
    if out_dir is not None:
        train_config = json.dumps(
            {
                "config": dataclasses.asdict(config),
                "steps": step,
                "windows": len(windows),
                "seconds": round(time.perf_counter() - started, 2),
            },
            indent=2,
            default=str,
        )
        # One crash-safe save of the decoder and its train_config.json (cosmos3_gym.storage.replace_entries).
        decoder.save_pretrained(out_dir, extra_files={"train_config.json": train_config})
    return decoder


def psnr_db(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR (dB) per item of two [B, ...] tensors in [0, 1] (inf where equal)."""
    mse = (a.double() - b.double()).square().flatten(1).mean(1)
    return 10.0 * torch.log10(1.0 / mse)


@torch.no_grad()
def decoder_psnr(
    decoder: LightDecoder, windows: DecoderWindows, vae=None, *, batch_size: int = 64, frames: str = "last"
) -> dict[str, np.ndarray]:
    """PSNR per window (dB) of ``frames`` ("last": the window's last pixel frame, what the env returns; "all": every
    frame) decoded by ``decoder`` against the real frames (``light_vs_real``) and, with ``vae`` (a ``Cosmos3VAE``),
    of the exact decode against the real frames (``vae_vs_real``) and of the two decodes (``light_vs_vae``)."""
    if frames not in ("all", "last"):
        raise InputError(f"frames: expected 'all' or 'last', got {frames!r}")
    results: dict[str, list[torch.Tensor]] = {"light_vs_real": []}
    if vae is not None:
        results.update(vae_vs_real=[], light_vs_vae=[])
    for start in range(0, len(windows), batch_size):
        latents = windows.latents[start : start + batch_size]
        real = windows.frames[start : start + batch_size]
        real = (real[:, :, -1:] if frames == "last" else real).float().cpu() / 255.0
        light = decoder.decode(latents.to(decoder.device), frames=frames).cpu()
        results["light_vs_real"].append(psnr_db(light, real))
        if vae is not None:
            exact = vae.decode(latents.to(vae.vae.device), frames=frames).cpu()
            results["vae_vs_real"].append(psnr_db(exact, real))
            results["light_vs_vae"].append(psnr_db(light, exact))
    return {key: torch.cat(values).numpy() for key, values in results.items()}
