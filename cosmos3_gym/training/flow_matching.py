"""The flow-matching objective of a Cosmos3 policy model, with the engine's three action modes as masks.

Convention (the sampler's, see ``sampling.py``): a noisy sample is ``x_t = (1 - sigma) * x0 + sigma * eps`` and the
model predicts the velocity ``v = eps - x0``, so that ``x0 = x_t - sigma * v``. The model sees the timestep
``int64(sigma * 1000)`` (a truncation, as ``UniPCMultistepScheduler`` hands out timesteps), while ``x_t`` uses the
exact sigma, as at sampling time.

Sigma is drawn per sample (one sigma for the sample's video and actions, which share one timestep embedding at
inference) as ``sigma = shift(u) = s*u / (1 + (s-1)*u)`` with the flow shift ``s`` the checkpoint's scheduler uses,
and ``u`` either uniform on (0, 1) or logit-normal (``u = sigmoid(n)``, ``n ~ N(mean, std)``, as in SD3). The shift
moves the training mass to high noise just as it moves the sampler's few steps there.

Each sample gets one of the engine's modes (``engine.Cosmos3Engine.prepare`` / ``_denoise`` build the same masks),
with ``K`` clean context frames (``context_frames``: 1, or more when the env hands chunks over as latents):

============== ================================ ==========================
mode            video latent frames               action rows
============== ================================ ==========================
policy          frames 0..K-1 clean, rest noisy   all noisy
forward_dyn.    frames 0..K-1 clean, rest noisy   all clean (given)
inverse_dyn.    all clean                         all noisy
============== ================================ ==========================

Clean entries are fed as ``x0`` without a timestep embedding (the model's ``forward`` handles that from the masks)
and carry no loss. A batch with ``context_sigmas`` (context noise, ``WorldModelTrainConfig.context_noise_max``) has
its context frames already noised to those levels; their tokens get the levels' timestep embedding. Action dims at
or beyond the raw action width are zero in ``x0`` and in the noise (the engine zeroes them in the noise and after
every step) and carry no loss.

A batch may carry a **loss focus** (``video_focus``, [B, h, w] in [0, 1], from ``data.window_focus``): latent cells
where what matters moves get ``1 + focus_weight`` times the weight of the rest in the video loss. A small object on a
still background (a pushed block that fills a few percent of the frame) otherwise carries a few percent of the loss,
though its pose is what the env is for. The per-sample ``video_mse`` stays the plain mean, comparable across settings.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn as nn

from ..engine import MODES
from ..errors import InputError
from ..models.transformer import Cosmos3Transformer, TextKV
from ..sampling import timesteps_from_sigmas

SIGMA_DISTRIBUTIONS = ("uniform", "logit_normal")
# The flow shift native Cosmos3 training uses per resolution tier (reference/cosmos3.md, section 4: 256 -> 3,
# 480 -> 5, 720 -> 10); the 704 tier, not listed there, takes the 720 value.
NATIVE_FLOW_SHIFT_BY_TIER = {256: 3.0, 480: 5.0, 704: 10.0, 720: 10.0}

POLICY, FORWARD_DYNAMICS, INVERSE_DYNAMICS = (
    MODES.index(m) for m in ("policy", "forward_dynamics", "inverse_dynamics")
)


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow shift diffusers applies to its sigma grid (``use_flow_sigmas``): s*u / (1 + (s-1)*u)."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def sample_sigmas(
    batch_size: int,
    generator: torch.Generator,
    *,
    shift: float,
    distribution: str = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """[batch_size] float32 sigmas in (0, 1), drawn on the generator's device (see the module docstring)."""
    if distribution == "uniform":
        u = torch.rand(batch_size, generator=generator)
    elif distribution == "logit_normal":
        u = torch.sigmoid(logit_mean + logit_std * torch.randn(batch_size, generator=generator))
    else:
        raise InputError(f"sigma_distribution: expected one of {list(SIGMA_DISTRIBUTIONS)}, got {distribution!r}")
    # Keep sigma strictly inside (0, 1): sigma 0 has no noise to learn from, sigma 1 is the sampler's 0.9998 anyway.
    return shift_sigmas(u.clamp(1e-5, 1.0 - 1e-5), shift).float()


def mode_masks(
    modes: torch.Tensor, latent_t: int, chunk: int, context_frames: int = 1, state_rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample modes [B] (indexes into ``engine.MODES``) -> (video_noisy [B, t], action_noisy [B, state_rows +
    chunk]) bool; the first ``context_frames`` latent frames and the ``state_rows`` (the action history before the
    chunk, as ``processor.prepare_action_rows`` puts it) are clean in every mode."""
    frame = torch.arange(latent_t, device=modes.device)
    video_noisy = (frame[None, :] >= context_frames) & (modes != INVERSE_DYNAMICS)[:, None]
    row = torch.arange(state_rows + chunk, device=modes.device)
    action_noisy = (row[None, :] >= state_rows) & (modes != FORWARD_DYNAMICS)[:, None]
    return video_noisy, action_noisy


@dataclass
class FlowMatchingBatch:
    """One training batch: clean targets, per-sample conditioning and the random draws (made on the host)."""

    prompt_ids: list[list[int]]  # the token ids each sample's text tower sees (conditional or unconditional)
    fps: list[float]
    video: torch.Tensor  # [B, C, t, h, w] clean normalised latents
    actions: torch.Tensor  # [B, H + chunk, action_dim] clean normalised actions (H state rows first), zero beyond
    # the raw width
    raw_action_dims: torch.Tensor  # [B] long
    domain_ids: torch.Tensor  # [B] long
    modes: torch.Tensor  # [B] long, indexes into engine.MODES
    sigmas: torch.Tensor  # [B] float32
    video_noise: torch.Tensor  # [B, C, t, h, w]
    action_noise: torch.Tensor  # [B, H + chunk, action_dim]
    window_index: torch.Tensor | None = None  # [B] long: the training windows drawn (the objective ignores it)
    video_focus: torch.Tensor | None = None  # [B, h, w] in [0, 1]: the loss focus (module docstring); None: none
    # [B] float32: the noise level already put on each sample's context frames (context noise), given to the model
    # as their timestep; None: clean context.
    context_sigmas: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> FlowMatchingBatch:
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            values[f.name] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        return FlowMatchingBatch(**values)


class FlowMatchingObjective(nn.Module):
    """Wraps a ``Cosmos3Transformer``; ``forward(batch)`` returns the loss and per-sample errors.

    The module to hand to DDP: the text tower (unless frozen), the GEN tower and the loss all run inside one
    ``forward``. With ``freeze_text_tower`` the UND K/V of each distinct prompt are computed once without gradients
    and cached, as the engine caches them. The first ``context_frames`` latent frames of a batch's video are its clean
    context and the first ``action_history_length`` action rows its clean state rows (``mode_masks``).
    """

    def __init__(
        self,
        transformer: Cosmos3Transformer,
        *,
        video_loss_weight: float = 1.0,
        action_loss_weight: float = 1.0,
        freeze_text_tower: bool = False,
        context_frames: int = 1,
        focus_weight: float = 0.0,
        action_history_length: int = 0,
    ):
        super().__init__()
        self.transformer = transformer
        self.video_loss_weight = video_loss_weight
        self.focus_weight = focus_weight
        self.action_loss_weight = action_loss_weight
        self.freeze_text_tower = freeze_text_tower
        self.context_frames = context_frames
        self.action_history_length = action_history_length
        self._frozen_text_cache: dict[tuple[int, ...], TextKV] = {}

    def encode_prompts(self, prompt_ids: list[list[int]]) -> TextKV:
        """UND K/V for every sample; each distinct prompt runs through the text tower once."""
        unique = list(dict.fromkeys(tuple(ids) for ids in prompt_ids))
        if self.freeze_text_tower:
            with torch.no_grad():
                missing = [ids for ids in unique if ids not in self._frozen_text_cache]
                if missing:
                    encoded = self.transformer.encode_text([list(ids) for ids in missing])
                    for i, ids in enumerate(missing):
                        self._frozen_text_cache[ids] = encoded.select(i)
            return TextKV.stack([self._frozen_text_cache[tuple(ids)] for ids in prompt_ids])
        encoded = self.transformer.encode_text([list(ids) for ids in unique])
        row_of = {ids: i for i, ids in enumerate(unique)}
        rows = torch.tensor([row_of[tuple(ids)] for ids in prompt_ids], device=self.transformer.device)
        return TextKV(
            [k.index_select(0, rows) for k in encoded.keys],
            [v.index_select(0, rows) for v in encoded.values],
            [encoded.lengths[row_of[tuple(ids)]] for ids in prompt_ids],
        )

    def forward(self, batch: FlowMatchingBatch) -> dict[str, torch.Tensor]:
        """Returns ``loss`` (scalar, differentiable) and detached per-sample ``video_mse`` / ``action_mse`` [B]
        (NaN where the sample has no noisy video / no noisy action), the means over the noisy entries."""
        x0_video, x0_actions = batch.video.float(), batch.actions.float()
        _, _, latent_t, h, w = x0_video.shape
        rows, action_dim = x0_actions.shape[1:]
        history = self.action_history_length
        video_noisy, action_noisy = mode_masks(batch.modes, latent_t, rows - history, self.context_frames, history)
        dims = torch.arange(action_dim, device=x0_actions.device)
        raw_dims = dims[None, None, :] < batch.raw_action_dims[:, None, None]  # [B, 1, action_dim]
        action_noise = batch.action_noise.float() * raw_dims

        sigma_video = batch.sigmas.view(-1, 1, 1, 1, 1)
        sigma_action = batch.sigmas.view(-1, 1, 1)
        noisy_video = (1.0 - sigma_video) * x0_video + sigma_video * batch.video_noise.float()
        noisy_actions = (1.0 - sigma_action) * x0_actions + sigma_action * action_noise
        video_in = torch.where(video_noisy[:, None, :, None, None], noisy_video, x0_video)
        actions_in = torch.where(action_noisy[..., None], noisy_actions, x0_actions)

        text = self.encode_prompts(batch.prompt_ids)
        timesteps = timesteps_from_sigmas(batch.sigmas)
        # With K context frames the current frame is frame K - 1: the action rows move with it, as the engine moves
        # them (engine._Prepared.action_start_offset), so each keeps its place next to the frame it leads to; H state
        # rows come before the chunk's first, at times 1 - H .. 0.
        action_start = 1 - history + self.transformer.config.temporal_compression * (self.context_frames - 1)
        layout = self.transformer.gen_layout(
            text.lengths, (latent_t, h, w), rows, list(batch.fps), action_start_offset=action_start
        )
        context_timesteps = None if batch.context_sigmas is None else timesteps_from_sigmas(batch.context_sigmas)
        v_video, v_action = self.transformer(
            text,
            layout,
            video_in,
            video_noisy,
            timesteps,
            actions_in,
            action_noisy,
            batch.domain_ids,
            context_timesteps=context_timesteps,
        )

        video_weight = video_noisy[:, None, :, None, None].float().expand_as(x0_video)
        video_se = (v_video - (batch.video_noise.float() - x0_video)).square() * video_weight
        video_sse = video_se.flatten(1).sum(1)
        video_count = video_weight.flatten(1).sum(1)
        action_weight = (action_noisy[..., None] & raw_dims).float()
        action_sse = ((v_action - (action_noise - x0_actions)).square() * action_weight).flatten(1).sum(1)
        action_count = action_weight.flatten(1).sum(1)

        # Mean over the batch's noisy entries, per modality, so the weights do not depend on the mode mix.
        video_loss = video_sse.sum() / video_count.sum().clamp_min(1.0)
        if batch.video_focus is not None and self.focus_weight > 0:  # a weighted mean: the loss keeps its scale
            focus = 1.0 + self.focus_weight * batch.video_focus.float()[:, None, None]  # [B, 1, 1, h, w]
            video_loss = (video_se * focus).sum() / (video_weight * focus).sum().clamp_min(1.0)
        action_loss = action_sse.sum() / action_count.sum().clamp_min(1.0)
        loss = self.video_loss_weight * video_loss + self.action_loss_weight * action_loss
        nan = torch.full_like(video_sse, float("nan"))
        return {
            "loss": loss,
            "video_mse": torch.where(video_count > 0, video_sse / video_count.clamp_min(1.0), nan).detach(),
            "action_mse": torch.where(action_count > 0, action_sse / action_count.clamp_min(1.0), nan).detach(),
        }
