"""Training a small Wan2.2-layout VAE (diffusers ``AutoencoderKLWan``) on the frames of an episode dataset.

The VAE keeps the Wan2.2 structure Cosmos3 uses (residual variant, 2x2 pixel patchify, three downsamples: 16x
spatial and 4x temporal compression, causal in time) with configurable widths. Training clips of
``frames_per_clip`` (1 + 4k) consecutive frames go through ``processor.prepare_conditioning`` exactly as the engine's
observations do: the whole tier canvas (content plus padding) is encoded, the latent is cropped to the content's
latent grid as the engine crops it, and the decoder reconstructs the content from that crop. The loss is
``l1_weight * L1 + l2_weight * MSE + kl_weight * KL`` (per-element means; the KL of the posterior against N(0, I)),
on the content pixels only (the padding is never decoded at inference).

After training, ``latents_mean`` / ``latents_std`` are fitted per channel on the posterior means of ``stats_clips``
training clips (content crop) and written into the config, so ``Cosmos3VAE`` normalises latents to about N(0, 1).
``out_dir`` is an ``AutoencoderKLWan.save_pretrained`` folder (config.json + safetensors), plus train_log.jsonl and
train_config.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import processor
from ..checkpoint import check_no_pickle_weights
from ..data.episodes import load_episode
from ..errors import InputError
from ..models.vae import WAN22_FIXED_CONFIG
from ..storage import replace_entries
from .data import read_dataset
from .distributed import init_distributed
from .schedule import check_optimizer_settings, learning_rate


@dataclass
class VAETrainConfig:
    """Settings of ``train_vae``. The Wan2.2 VAE itself is base_dim 160, decoder_base_dim 256, z_dim 48,
    num_res_blocks 2; the defaults here are a small version (the built-in model's): 4.8 M parameters (19 MB in
    float32, 1.0 M of
    them in the encoder). base_dim 12 / decoder_base_dim 16 gives 2.3 M; 32 / 48 gives 19 M."""

    base_dim: int = 16
    decoder_base_dim: int | None = 24  # None: same as base_dim
    z_dim: int = 16
    num_res_blocks: int = 1
    dim_mult: tuple[int, int, int, int] = (1, 2, 4, 4)
    steps: int = 20_000
    batch_size: int = 8
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 200
    lr_schedule: str = "cosine"  # after warmup: "constant", or cosine decay to min_lr_ratio * lr at `steps`
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    # 1 + 4k, at least the world model's chunk + 1 (17 for WorldModelTrainConfig's default chunk 16): the causal
    # decoder only learns to decode as many latent frames as its clips have (trained on 5-frame clips, the built-in
    # model's VAE
    # faded frames 5-8 of a 9-frame chunk to 29-34 dB from 38-40 dB, and env rollouts lost the target in two chunks).
    frames_per_clip: int = 17
    resolution_tier: int = 256
    l1_weight: float = 1.0
    l2_weight: float = 1.0
    kl_weight: float = 1e-4
    # Extra reconstruction weight for pixels that differ from their image's background (per-channel median):
    # 0 = plain means. Scenes that are mostly empty table otherwise settle on painting the background.
    contrast_weight: float = 0.0
    stats_clips: int = 256  # clips encoded to fit latents_mean / latents_std
    camera: str | None = None  # LeRobot datasets: the video feature to train on (default: the only one)
    init_vae: str | None = None  # fine-tune this AutoencoderKLWan folder (its architecture; the widths are ignored)
    # False (needs init_vae): train the decoder only; the encoder and the latent statistics stay, so the latent space
    # and every world model trained on it stay valid.
    train_encoder: bool = True
    seed: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    bf16: bool = True  # bf16 autocast on CUDA; ignored on CPU
    log_every: int = 50
    num_workers: int = 0  # DataLoader workers that put clips on the canvas
    progress: bool = True

    def validate(self) -> None:
        def fail(name: str, expected: str):
            raise InputError(f"VAETrainConfig.{name}: expected {expected}, got {getattr(self, name)!r}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("base_dim", "z_dim", "num_res_blocks", "batch_size", "log_every", "stats_clips"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "an integer >= 1")
        for name in ("steps", "warmup_steps", "seed", "num_workers"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                fail(name, "an integer >= 0")
        if self.decoder_base_dim is not None and (not is_int(self.decoder_base_dim) or self.decoder_base_dim < 1):
            fail("decoder_base_dim", "an integer >= 1 or None")
        if len(self.dim_mult) != 4 or not all(is_int(m) and m >= 1 for m in self.dim_mult):
            fail("dim_mult", "4 positive integers (three downsamples give the 16x compression Cosmos3 needs)")
        if not is_int(self.frames_per_clip) or self.frames_per_clip < 1 or (self.frames_per_clip - 1) % 4:
            fail("frames_per_clip", "1 + 4k frames (1, 5, 9, ...)")
        if self.resolution_tier not in processor.RESOLUTION_TIERS:
            fail("resolution_tier", f"one of {list(processor.RESOLUTION_TIERS)}")
        check_optimizer_settings(
            self, fail, ("lr", "weight_decay", "grad_clip", "l1_weight", "l2_weight", "kl_weight", "contrast_weight")
        )
        if not self.train_encoder and self.init_vae is None:
            fail("train_encoder", "True unless init_vae names the VAE whose decoder to fine-tune")

    def autoencoder_config(self) -> dict:
        return {
            **WAN22_FIXED_CONFIG,
            "base_dim": self.base_dim,
            "decoder_base_dim": self.decoder_base_dim,
            "z_dim": self.z_dim,
            "dim_mult": list(self.dim_mult),
            "num_res_blocks": self.num_res_blocks,
            "attn_scales": [],
        }


class _ClipBatches(torch.utils.data.Dataset):
    """Item ``k`` is the batch of training step ``k``: canvas pixels [B, 3, F, H, W] and the content's latent size.

    Clips are drawn uniformly over all clip positions of all episodes with a generator seeded by (seed, k), so the
    batches do not depend on the number of DataLoader workers. ``episodes`` is a list of frame arrays [T, H, W, 3]
    (in memory), or an episode store that reads clips from disk (``DatasetInfo.episodes`` of a LeRobot dataset:
    ``lengths`` and ``read_frames(i, start, stop)``).
    """

    def __init__(self, episodes, config: VAETrainConfig, salt: str = "train"):
        self.episodes = episodes
        self.config = config
        self.salt = salt
        lengths = episodes.lengths if hasattr(episodes, "read_frames") else [len(frames) for frames in episodes]
        counts = [max(length - config.frames_per_clip + 1, 0) for length in lengths]
        if not any(counts):
            raise InputError(
                f"VAETrainConfig.frames_per_clip: {config.frames_per_clip} is longer than every episode "
                f"(at most {max(lengths)} frames)"
            )
        self.offsets = np.cumsum([0] + counts)

    def __len__(self) -> int:
        return 2**62

    def clip(self, position: int) -> tuple[torch.Tensor, tuple[int, int]]:
        episode = int(np.searchsorted(self.offsets, position, side="right") - 1)
        start = position - int(self.offsets[episode])
        stop = start + self.config.frames_per_clip
        if hasattr(self.episodes, "read_frames"):
            frames = self.episodes.read_frames(episode, start, stop)
        else:
            frames = self.episodes[episode][start:stop]
        cond = processor.prepare_conditioning(frames, self.config.resolution_tier, self.config.frames_per_clip)
        return cond.pixels, cond.latent_hw

    def __getitem__(self, step: int):
        digest = hashlib.sha256(f"cosmos3_gym.train_vae/{self.salt}/{self.config.seed}/{step}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        positions = torch.randint(int(self.offsets[-1]), (self.config.batch_size,), generator=generator).tolist()
        clips = [self.clip(p) for p in positions]
        latent_hws = {hw for _, hw in clips}
        if len(latent_hws) > 1:
            raise InputError(f"dataset: frames of different sizes give different latent grids {sorted(latent_hws)}")
        noise_seed = int(torch.randint(2**62, (1,), generator=generator))
        return torch.cat([pixels for pixels, _ in clips]), clips[0][1], noise_seed


def _kl_to_standard_normal(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    return 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).mean()


def reconstruction_weights(target: torch.Tensor, contrast_weight: float) -> torch.Tensor:
    """[B, 1, T, H, W] per-pixel weights 1 + contrast_weight * |pixel - background| (channel mean), where the
    background is each image's per-channel median; all ones when ``contrast_weight`` is 0."""
    if contrast_weight == 0:
        return torch.ones_like(target[:, :1])
    background = target.flatten(3).median(dim=-1).values[..., None, None]  # [B, 3, T, 1, 1]
    return 1.0 + contrast_weight * (target - background).abs().mean(1, keepdim=True)


def vae_loss(vae, pixels: torch.Tensor, latent_hw: tuple[int, int], config: VAETrainConfig, noise_seed: int):
    """Encode the canvas, crop the latent to the content, decode, and compare with the content pixels."""
    h, w = latent_hw
    posterior = vae.encode(pixels).latent_dist
    mean, logvar = posterior.mean[..., :h, :w], posterior.logvar[..., :h, :w]
    generator = torch.Generator().manual_seed(noise_seed)
    noise = torch.randn(mean.shape, generator=generator).to(mean.device, mean.dtype)
    z = mean + torch.exp(0.5 * logvar) * noise
    recon = vae.decode(z).sample.float()
    target = pixels[..., : h * processor.VAE_SPATIAL_FACTOR, : w * processor.VAE_SPATIAL_FACTOR].float()
    weights = reconstruction_weights(target, config.contrast_weight)
    l1 = ((recon - target).abs() * weights).mean() / weights.mean()
    l2 = ((recon - target).square() * weights).mean() / weights.mean()
    kl = _kl_to_standard_normal(mean.float(), logvar.float())
    loss = config.l1_weight * l1 + config.l2_weight * l2 + config.kl_weight * kl
    return loss, {"l1": l1.detach(), "l2": l2.detach(), "kl": kl.detach()}


@torch.no_grad()
def fit_latent_statistics(vae, clips: _ClipBatches, num_clips: int, device: torch.device) -> tuple[list, list]:
    """Per-channel mean and std of the posterior means of ``num_clips`` clips (content crop), in float64."""
    total: torch.Tensor | float = 0.0
    total_sq: torch.Tensor | float = 0.0
    clips_seen = values_per_channel = step = 0
    while clips_seen < num_clips:
        pixels, (h, w), _ = clips[step]
        step += 1
        mu = vae.encode(pixels.to(device)).latent_dist.mode()[..., :h, :w].double()
        per_channel = mu.transpose(0, 1).flatten(1)  # [C, B*t*h*w]
        total = total + per_channel.sum(1)
        total_sq = total_sq + per_channel.square().sum(1)
        values_per_channel += per_channel.shape[1]
        clips_seen += pixels.shape[0]
    assert isinstance(total, torch.Tensor) and isinstance(total_sq, torch.Tensor)  # num_clips >= 1: the loop ran
    mean = total / values_per_channel
    std = (total_sq / values_per_channel - mean.square()).clamp_min(1e-12).sqrt().clamp_min(1e-4)
    return [round(v, 6) for v in mean.tolist()], [round(v, 6) for v in std.tolist()]


def train_vae(dataset_dir: str | os.PathLike, out_dir: str | os.PathLike, config: VAETrainConfig | None = None) -> Path:
    """Train the VAE on the dataset's frames, fit its latent statistics and save it to ``out_dir`` (returned)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    config = config or VAETrainConfig()
    config.validate()
    out_dir = Path(out_dir).expanduser()
    info = read_dataset(dataset_dir, camera=config.camera)
    ctx = init_distributed(config.device)
    if ctx.world_size > 1:
        ctx.close()
        raise InputError("train_vae: runs on one device; launch it without torchrun")
    device = ctx.device
    # Our layout is read into memory (the existing behaviour); a LeRobot dataset streams clips from its videos.
    episodes = (
        info.episodes
        if not info.episode_paths
        else [load_episode(path, info.raw_action_dim).frames for path in info.episode_paths]
    )
    clips = _ClipBatches(episodes, config)

    if config.init_vae is not None:
        check_no_pickle_weights(config.init_vae)
        vae = AutoencoderKLWan.from_pretrained(config.init_vae, torch_dtype=torch.float32, use_safetensors=True)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            vae = AutoencoderKLWan(**config.autoencoder_config())
    vae = vae.to(device).train()
    if not config.train_encoder:
        for module in (vae.encoder, vae.quant_conv):
            module.requires_grad_(False)
    trainable = [p for p in vae.parameters() if p.requires_grad]
    betas = cast("tuple[float, float]", tuple(config.betas))
    optimizer = torch.optim.AdamW(trainable, lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    autocast = device.type == "cuda" and config.bf16
    loader = torch.utils.data.DataLoader(
        clips,
        batch_size=None,
        sampler=range(config.steps),
        num_workers=config.num_workers,
        pin_memory=device.type == "cuda",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "train_log.jsonl"
    log_path.write_text("")
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, l1, l2, kl since the last log line
    started = time.perf_counter()
    bar = tqdm(total=config.steps, desc="training VAE", disable=not config.progress)
    for step, (pixels, latent_hw, noise_seed) in enumerate(loader, start=1):
        lr = learning_rate(config, step - 1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, parts = vae_loss(vae, pixels.to(device, non_blocking=True), tuple(latent_hw), config, noise_seed)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sums += torch.stack([loss.detach(), parts["l1"], parts["l2"], parts["kl"]]).double()
        bar.update(1)
        if step % config.log_every == 0 or step == config.steps:
            n = (step - 1) % config.log_every + 1
            loss_mean, l1, l2, kl = (sums / n).tolist()
            elapsed = time.perf_counter() - started
            with log_path.open("a") as handle:
                handle.write(
                    json.dumps(
                        {
                            "step": step,
                            "lr": lr,
                            "loss": loss_mean,
                            "l1": l1,
                            "l2": l2,
                            "kl": kl,
                            "clips_per_s": n * config.batch_size / max(elapsed, 1e-9),
                        }
                    )
                    + "\n"
                )
            bar.set_postfix(loss=f"{loss_mean:.4f}")
            sums.zero_()
            started = time.perf_counter()
    bar.close()

    vae = vae.float().eval()
    if config.train_encoder:  # a decoder-only fine-tune keeps the latent space, statistics included
        latents_mean, latents_std = fit_latent_statistics(
            vae, _ClipBatches(episodes, config, salt="latent_statistics"), config.stats_clips, device
        )
        vae.register_to_config(latents_mean=latents_mean, latents_std=latents_std)
    train_config = json.dumps(
        {"config": dataclasses.asdict(config), "dataset": str(info.root), "steps": config.steps}, indent=2
    )

    def fill(staging: Path) -> None:
        vae.save_pretrained(staging, safe_serialization=True)
        (staging / "train_config.json").write_text(train_config)

    # The VAE and its train_config.json replace an earlier one only once complete (cosmos3_gym.storage).
    replace_entries(out_dir, fill)
    ctx.close()
    return out_dir
