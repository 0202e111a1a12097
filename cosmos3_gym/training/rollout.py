"""Rollout conditioning: train on the model's own frames, as the env feeds them back.

In an env rollout every chunk after the first starts from the model's previous output: the last generated frame,
decoded to uint8 pixels and encoded again. A model trained only on clean encodes of real frames has never seen that
input, and its errors compound chunk after chunk (exposure bias). Here a sample that conditions on frame 0 (policy
and forward-dynamics modes) can instead get, as its frame 0, what the current model generates for that same frame by
forward dynamics from a real frame 1 to ``max_chunks`` chunks earlier in its episode, through the env's exact path
(sampler steps, decode (the VAE, or the checkpoint's light decoder where the env uses it), uint8,
``processor.prepare_conditioning``, VAE encode). Its targets stay the real frames,
so the model learns to steer back towards the truth from its own drifted frames. Generation runs without gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from .. import processor
from ..media import to_uint8
from ..models.light_decoder import LightDecoder
from ..models.transformer import Cosmos3Transformer, TextKV
from ..models.vae import Cosmos3VAE
from ..sampling import FlowUniPCSampler, Schedule
from .data import TrainingWindows


def predecessor_windows(windows: TrainingWindows, chunk: int) -> torch.Tensor:
    """[N] long: the index of the window of the same episode that starts ``chunk`` frames earlier (whose last frame
    is this window's first), or -1 where there is none."""
    index_of = {(int(e), int(s)): i for i, (e, s) in enumerate(zip(windows.episode_index, windows.start))}
    return torch.tensor(
        [index_of.get((int(e), int(s) - chunk), -1) for e, s in zip(windows.episode_index, windows.start)],
        dtype=torch.long,
    )


@torch.no_grad()
def generate_forward_dynamics(
    transformer: Cosmos3Transformer,
    text: TextKV,
    first_latents: torch.Tensor,
    actions: torch.Tensor,
    domain_ids: torch.Tensor,
    video_noise: torch.Tensor,
    schedule: Schedule,
    fps: float,
) -> torch.Tensor:
    """The engine's forward-dynamics denoising (guidance 1): clean latent frame 0 ``first_latents`` [B, C, 1, h, w]
    and clean ``actions`` [B, chunk, action_dim] in, the clean latents [B, C, t, h, w] out. ``video_noise``
    [B, C, t, h, w] is the initial noise (its frame 0 is replaced by ``first_latents``)."""
    batch, _, latent_t = video_noise.shape[:3]
    chunk = actions.shape[1]
    device = first_latents.device
    video_noisy = (torch.arange(latent_t, device=device) >= 1)[None].expand(batch, -1)
    action_noisy = torch.zeros(batch, chunk, dtype=torch.bool, device=device)
    latent_thw = cast("tuple[int, int, int]", tuple(video_noise.shape[2:]))  # video_noise [B, C, t, h, w]
    layout = transformer.gen_layout(text.lengths, latent_thw, chunk, [fps] * batch)
    sampler = FlowUniPCSampler([schedule] * batch, device)
    video = torch.cat([first_latents, video_noise[:, :, 1:]], dim=2)
    for i in range(schedule.num_steps):
        v_video, _ = transformer(
            text, layout, video, video_noisy, sampler.timesteps_for_step(i), actions, action_noisy, domain_ids
        )
        video = sampler.step(i, v_video.float(), video)
        video = torch.cat([first_latents, video[:, :, 1:]], dim=2)  # the clean frame is re-imposed exactly
    return video


@torch.no_grad()
def reencode_last_frame(
    vae: Cosmos3VAE, latents: torch.Tensor, resolution_tier: int, light_decoder: LightDecoder | None = None
) -> torch.Tensor:
    """The env's hand-over between chunks: decode ``latents`` [B, C, t, h, w] (with ``light_decoder`` when given,
    as an env with ``decoder="light"`` does; else the VAE), take the last frame as uint8 (what the env keeps), and
    encode it as the next request's clean frame 0: [B, C, 1, h, w]."""
    h, w = latents.shape[-2:]
    if light_decoder is not None:
        last = light_decoder.decode(latents, frames="last")[:, :, -1]
    else:
        last = vae.decode(latents)[:, :, -1]
    frames = to_uint8(last.permute(0, 2, 3, 1).cpu().numpy())  # [B, H, W, 3]
    pixels = torch.cat([processor.prepare_conditioning(frame, resolution_tier, 1).pixels for frame in frames])
    return vae.encode(pixels.to(latents.device))[..., :h, :w]


class RolloutConditioner:
    """Replaces frame 0 of some samples of a batch with the model's own rollout of it (see the module docstring).

    ``prob`` is the fraction of each batch that gets it (among the samples in policy or forward-dynamics mode with
    enough predecessor windows); the depth (chunks generated) is drawn per step, uniform in 1..``max_chunks``.
    ``light_decoder``: the hand-over decodes with it, as the env does for a checkpoint that decodes with its light
    decoder (the built-in model); None: with the VAE.
    """

    def __init__(
        self,
        windows: TrainingWindows,
        vae: Cosmos3VAE,
        schedule: Schedule,
        *,
        chunk: int,
        prob: float,
        max_chunks: int,
        resolution_tier: int,
        fps: float,
        domain_id: int,
        action_dim: int,
        light_decoder: LightDecoder | None = None,
    ):
        self.windows, self.vae, self.schedule, self.light_decoder = windows, vae, schedule, light_decoder
        self.prob, self.max_chunks = prob, max_chunks
        self.resolution_tier, self.fps, self.domain_id, self.action_dim = resolution_tier, fps, domain_id, action_dim
        predecessor = predecessor_windows(windows, chunk)
        # chains[i, k]: the window k + 1 chunks before window i (-1: none); available[i]: how many there are
        chains = [predecessor]
        for _ in range(max_chunks - 1):
            previous = chains[-1]
            chains.append(torch.where(previous >= 0, predecessor[previous.clamp_min(0)], -1))
        self.chains = torch.stack(chains, dim=1)
        self.available = (self.chains >= 0).sum(1)

    def draw(self, window_index: torch.Tensor, eligible: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """[B] long depth per sample (0: keep the real frame 0). One depth per step, uniform in 1..max_chunks, given
        to round(prob * B) samples drawn among the eligible ones that have that many predecessors (fewer when there
        are not enough). A fixed count and one depth per step keep the generation's shapes fixed: with
        cudnn.benchmark every new batch size of the VAE's 3-D convolutions is autotuned again (on an H200, varying
        sub-batches ran 0.5 training steps/s, fixed ones 2.6 with half the rollout share; 10.6 without rollouts)."""
        batch = len(window_index)
        depth = 1 + int(torch.randint(self.max_chunks, (1,), generator=generator))
        candidates = eligible & (self.available[window_index] >= depth)
        order = torch.randperm(batch, generator=generator)
        picked = order[candidates[order]][: round(self.prob * batch)]
        depths = torch.zeros(batch, dtype=torch.long)
        depths[picked] = depth
        return depths

    @torch.no_grad()
    def first_frames(
        self,
        transformer: Cosmos3Transformer,
        encode_prompts: Callable[[list[list[int]]], TextKV],
        window_index: torch.Tensor,
        depth: torch.Tensor,
        generator: torch.Generator,
        autocast: bool,
    ) -> torch.Tensor:
        """Frame 0 latents [n, C, 1, h, w] of the samples with ``depth > 0`` (in batch order): starting from the real
        frame of the window ``depth`` chunks back, each chunk is generated with that window's actions and handed
        over as the env does; chains of different depths run in lockstep, the deepest first."""
        rows = torch.nonzero(depth > 0).flatten()
        windows, device = self.windows, transformer.device
        targets, depths = window_index[rows], depth[rows]
        latent_t, h, w = windows.latent_thw
        channels = windows.latents.shape[1]
        first = torch.empty(len(rows), channels, 1, h, w, device=device)
        for k in range(int(depths.max()) if len(rows) else 0, 0, -1):  # k: chunks before the target window
            starting = depths == k
            if starting.any():  # chains of depth k start from the real frame of their window k chunks back
                source = self.chains[targets[starting], k - 1]
                first[starting.to(device)] = windows.latents[source.to(windows.latents.device), :, :1].to(device)
            active = depths >= k
            window = self.chains[targets[active], k - 1]  # generating its chunk ends on the next window's frame 0
            prompts = [windows.prompts[int(windows.prompt_index[i])][0] for i in window]
            actions = torch.zeros(len(window), windows.actions.shape[1], self.action_dim)
            actions[..., : windows.actions.shape[2]] = windows.actions[window]
            noise = torch.randn((len(window), channels, latent_t, h, w), generator=generator)
            domain_ids = torch.full((len(window),), self.domain_id, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                latents = generate_forward_dynamics(
                    transformer,
                    encode_prompts(prompts),
                    first[active.to(device)],
                    actions.to(device),
                    domain_ids,
                    noise.to(device),
                    self.schedule,
                    self.fps,
                )
            first[active.to(device)] = reencode_last_frame(
                self.vae, latents.float(), self.resolution_tier, self.light_decoder
            )
        return first
