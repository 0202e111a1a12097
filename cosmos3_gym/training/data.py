"""Episode datasets for training: reading, validation, and the training windows with cached VAE latents.

The dataset layout (the contract between data generation and training), its types and its reader are in
``episodes.py``; LeRobot v3.0 / v2.1 datasets (``"lerobot:PATH"``) are read through ``lerobot.py`` into the same
episodes.

Action ``t`` takes frame ``t`` to frame ``t + 1``. A training window starting at frame ``s`` holds frames
``s .. s+chunk`` (chunk + 1 frames, the clip the engine generates) and actions ``s .. s+chunk-1``; windows start
every ``stride`` frames. Actions are normalised with stats.json in the mode meta.json names (minmax by default).

Frames reach the model exactly as at inference: ``processor.prepare_conditioning`` (tier canvas, padding), the
frozen VAE's ``encode`` (posterior mean, latent normalisation) and the crop to the content latent
(``Conditioning.latent_hw``), as ``Cosmos3Engine.prepare`` does. ``prepare_conditioning`` works frame by frame, so
the whole episode is put on the canvas once and windows are slices of it. How windows are encoded follows the env's
hand-over between chunks (``handover``):

- ``"pixels"`` (the env decodes a chunk's last frame and encodes it again as the next chunk's first): each window is
  encoded on its own (the causal VAE's latents of a window are not a slice of the episode's latents), so its latent
  frame 0 is a first-frame latent, as the env's re-encoded frame is;
- ``"latent"`` (the env keeps the last ``context_frames`` generated latent frames as the next chunk's clean context):
  the whole episode is encoded once, frames ``0 .. tc*floor(T/tc)`` (``tc`` the VAE's temporal compression, 4) into
  latents ``E[0..L]``, ``E[0]`` being the first frame alone. The window of latent index ``j`` (pixel start
  ``s = tc*j``) holds the K context latents ``E[j-K+1 .. j]``, left-padded with ``E[0]`` at the episode's start (as
  the env starts: the start frame encoded and repeated K times), then the targets ``E[j+1 .. j+chunk/tc]``; its
  actions are ``s .. s+chunk-1`` as above. Chunk and stride must be multiples of ``tc``.

The latents are cached on disk, one safetensors file per episode (its windows' latents, or its whole-episode latents
with ``"latent"``), in a folder named by a hash of everything they depend on (VAE weights and config, tier, the
episode files, chunk and stride or the hand-over), so a changed input never reuses stale latents.

A **loss focus** (``window_focus``) marks, per window, the latent cells where a task's focus mask
(``"module:function"``, uint8 frames ``[N, H, W, 3]`` -> bool ``[N, H, W]``, e.g. a pushed object's pixels found by
its colour) is set in any of the window's frames, grown by one cell: where the object is, was
and goes, so that a model that leaves it behind or melts it is corrected where it errs. ``flow_matching`` weighs those
cells up in the video loss.
"""

from __future__ import annotations

import collections
import hashlib
import importlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.distributed as dist

from .. import processor
from ..checkpoint import HANDOVERS, safetensors_files
from ..data.episodes import DatasetInfo, read_episode_dataset, window_starts
from ..data.lerobot import is_lerobot_spec, read_lerobot_dataset
from ..errors import CheckpointError, InputError
from ..storage import load_safetensors, save_safetensors

logger = logging.getLogger(__name__)


def read_dataset(
    dataset_dir: str | os.PathLike,
    *,
    camera: str | None = None,
    action_key: str | None = None,
    state_key: str | None = None,
    domain: str | int | None = None,
) -> DatasetInfo:
    """Read and check meta.json and stats.json and list the episodes; ``InputError`` names the bad file and field.

    ``"lerobot:PATH"`` (or a folder with meta/info.json) is a LeRobot dataset (``lerobot.py``); ``camera``,
    ``action_key`` and ``state_key`` pick its features and ``domain`` its embodiment (default: info.json robot_type).
    ``domain`` also overrides our layout's meta.json domain.
    """
    if is_lerobot_spec(dataset_dir):
        return read_lerobot_dataset(
            dataset_dir, camera=camera, action_key=action_key or "action", state_key=state_key, domain=domain
        )
    for name, value in (("camera", camera), ("action_key", action_key), ("state_key", state_key)):
        if value is not None:
            raise InputError(
                f"{name}: only LeRobot datasets (lerobot:PATH) have features to pick; {dataset_dir} is "
                f"in our episode layout"
            )
    return read_episode_dataset(dataset_dir, domain=domain)


# ----------------------------------------------------------------------------------------------------------------
# Training windows
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TrainingWindows:
    """Every training window of a dataset, in memory.

    ``latents[i]`` are window i's clean latents (``t = 1 + chunk/tc`` frames; with handover "latent" ``K + chunk/tc``,
    the first K the context), ``actions[i]`` its normalised raw-width actions (with ``action_history_length`` H, the
    H actions before the window first: its state rows), and ``prompt_index[i]`` indexes ``prompts``: the
    (conditional, unconditional) token ids of its episode's task.
    """

    latents: torch.Tensor  # [N, C, t, h, w] float32
    actions: torch.Tensor  # [N, H + chunk, raw_action_dim] float32, normalised (H: the state rows)
    prompt_index: torch.Tensor  # [N] long
    prompts: list[tuple[list[int], list[int]]]
    episode_index: torch.Tensor  # [N] long (into DatasetInfo.episodes)
    start: torch.Tensor  # [N] long (the window's first pixel frame: its first action's)
    successful: torch.Tensor  # [N] bool: the window's episode has success=True
    canvas_hw: tuple[int, int]
    focus: torch.Tensor | None = None  # [N, h, w] bool: the loss focus (window_focus), when training uses one

    def __len__(self) -> int:
        return int(self.latents.shape[0])

    @property
    def latent_thw(self) -> tuple[int, int, int]:
        return cast("tuple[int, int, int]", tuple(self.latents.shape[2:]))  # latents [N, C, t, h, w]


def _sha256_of_files(paths) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def latent_cache_key(
    info: DatasetInfo, vae_dir: Path, *, chunk: int, stride: int, resolution_tier: int, handover: str = "pixels"
) -> str:
    """A hash of everything the cached latents depend on."""
    fingerprint = {
        "vae_config": json.loads((vae_dir / "config.json").read_text()),
        "vae_weights": _sha256_of_files(safetensors_files(vae_dir)),
        "resolution_tier": resolution_tier,
        "episodes": info.episodes.fingerprint(),
    }
    if handover == "pixels":  # windows encoded one by one (the key of caches written before hand-overs existed)
        fingerprint.update(chunk=chunk, stride=stride)
    else:  # whole episodes, whatever the chunk and stride that cut windows from them
        fingerprint["handover"] = handover
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


PREPARE_THREADS = 4  # host threads reading and preparing episodes ahead of the encoder


def save_cache_entry(cache: Path, name: str, cond: processor.Conditioning, latents: torch.Tensor) -> Path:
    """One episode's latents, written crash-safe with their checksum (``storage.save_safetensors``: a temporary file,
    fsynced, renamed into place; a damaged entry is found when read and encoded again)."""
    return save_safetensors(
        cache / f"{name}.safetensors", {"latents": latents}, {"canvas_hw": json.dumps(list(cond.canvas_hw))}
    )


@torch.no_grad()
def encode_episode_windows(
    vae, frames: np.ndarray, starts: list[int], chunk: int, resolution_tier: int, batch_size: int
) -> tuple[torch.Tensor, processor.Conditioning]:
    """Latents [len(starts), C, t, h, w] of the windows of one episode, as ``Cosmos3Engine.prepare`` encodes a clip.

    Also returns the conditioning of the whole episode (for its canvas and latent sizes).
    """
    cond = processor.prepare_conditioning(frames, resolution_tier, int(frames.shape[0]))
    return encode_windows(vae, cond, starts, chunk, batch_size), cond


@torch.no_grad()
def encode_windows(vae, cond: processor.Conditioning, starts: list[int], chunk: int, batch_size: int) -> torch.Tensor:
    """Latents [len(starts), C, t, h, w] of the ``chunk + 1`` frame windows of an episode's conditioning."""
    return encode_windows_of_episodes(vae, [(cond, starts)], chunk, batch_size)[0]


@torch.no_grad()
def encode_windows_of_episodes(
    vae, episodes: list[tuple[processor.Conditioning, list[int]]], chunk: int, batch_size: int
) -> list[torch.Tensor]:
    """``encode_windows`` of several episodes (conditioning, window starts), their windows encoded ``batch_size`` at
    a time across episode boundaries: each window is encoded on its own either way, and a dataset of short episodes
    (one window each, as self-forcing samples are) would otherwise run the VAE one window per call."""
    clips = [(k, cond.pixels[:, :, s : s + chunk + 1]) for k, (cond, starts) in enumerate(episodes) for s in starts]
    latents: list[list[torch.Tensor]] = [[] for _ in episodes]
    for first in range(0, len(clips), batch_size):
        batch = clips[first : first + batch_size]  # pixels stay on the host; each batch goes to the VAE's device
        encoded = vae.encode(torch.cat([clip for _, clip in batch]).to(vae.vae.device)).cpu()
        for (k, _), window in zip(batch, encoded):
            h, w = episodes[k][0].latent_hw
            latents[k].append(window[None, ..., :h, :w])
    return [torch.cat(parts) for parts in latents]


@torch.no_grad()
def encode_episodes(vae, conds: list[processor.Conditioning]) -> list[torch.Tensor]:
    """Latents [1, C, L+1, h, w] of whole episodes' conditionings, each in one causal encode of its frames cut to
    ``1 + tc*floor(T/tc)`` (``tc`` the VAE's temporal compression; ``T + 1`` frames), for ``handover="latent"``.

    Episodes of one length and canvas are encoded as one batch: the causal encoder loops over latent frames one after
    the other (77 steps for a 305-frame episode), so one episode at a time leaves a GPU mostly idle; each sample is
    encoded on its own, so batching does not change the latents."""
    tc = vae.temporal_compression
    out: list[torch.Tensor | None] = [None] * len(conds)
    groups: dict[tuple, list[int]] = {}
    for k, cond in enumerate(conds):
        frames = 1 + tc * ((cond.pixels.shape[2] - 1) // tc)
        groups.setdefault((frames, *cond.pixels.shape[3:]), []).append(k)
    for (frames, *_), members in groups.items():
        pixels = torch.cat([conds[k].pixels[:, :, :frames] for k in members]).to(vae.vae.device)
        for k, latents in zip(members, vae.encode(pixels)):
            h, w = conds[k].latent_hw
            out[k] = latents[None, ..., :h, :w].cpu()
    return cast("list[torch.Tensor]", out)


def encode_episode(vae, cond: processor.Conditioning) -> torch.Tensor:
    """``encode_episodes`` of one episode."""
    return encode_episodes(vae, [cond])[0]


def latent_windows(
    episode_latents: torch.Tensor, starts: list[int], chunk: int, tc: int, context_frames: int
) -> torch.Tensor:
    """Windows [len(starts), C, K + chunk/tc, h, w] of whole-episode latents ``E`` [1, C, L+1, h, w] (module
    docstring): for pixel start ``s = tc*j``, ``E[j-K+1 .. j+chunk/tc]`` with indices below 0 clamped to ``E[0]``."""
    offsets = torch.arange(1 - context_frames, chunk // tc + 1)
    index = (torch.tensor(starts)[:, None] // tc + offsets[None, :]).clamp_min(0)  # [n, t]
    return episode_latents[0][:, index].transpose(0, 1)  # [C, n, t, h, w] -> [n, C, t, h, w]


def build_training_windows(
    info: DatasetInfo,
    vae,
    vae_dir: str | os.PathLike,
    tokenizer,
    *,
    chunk: int,
    stride: int,
    resolution_tier: int,
    view_point: str,
    fps: float,
    cache_dir: str | os.PathLike,
    encode_batch_size: int = 8,
    progress: bool = True,
    handover: str = "pixels",
    context_frames: int = 1,
    action_history_length: int = 0,
) -> TrainingWindows:
    """Load (or encode and cache) every window's latents and gather actions and prompts.

    ``vae`` is a ``models.vae.Cosmos3VAE`` loaded from ``vae_dir``. ``handover`` and ``context_frames`` (K) choose
    the windows' latents (module docstring): ``"pixels"`` (K = 1) or ``"latent"``. ``action_history_length`` H puts
    the H actions before each window ahead of its actions, the first action standing in for those before an episode's
    start (the env's state rows at a slot's first step: its chunk's first action, repeated). Under
    torch.distributed each rank encodes every world_size-th missing episode and all ranks then read the whole cache.
    """
    from tqdm.auto import tqdm

    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise InputError(f"window_stride: expected an integer >= 1, got {stride!r}")
    if handover not in HANDOVERS:
        raise InputError(f"handover: expected one of {list(HANDOVERS)}, got {handover!r}")
    if isinstance(context_frames, bool) or not isinstance(context_frames, int) or context_frames < 1:
        raise InputError(f"context_frames: expected an integer >= 1, got {context_frames!r}")
    if handover == "pixels" and context_frames != 1:
        raise InputError(f"context_frames: expected 1 with handover 'pixels', got {context_frames}")
    if (
        isinstance(action_history_length, bool)
        or not isinstance(action_history_length, int)
        or action_history_length < 0
    ):
        raise InputError(f"action_history_length: expected an integer >= 0, got {action_history_length!r}")
    tc = vae.temporal_compression
    if handover == "latent":
        for name, value in (("chunk", chunk), ("window_stride", stride)):
            if value % tc:
                raise InputError(
                    f"{name}: expected a multiple of the VAE's temporal compression {tc} with handover "
                    f"'latent' (windows start on latent frames), got {value}"
                )
    vae_dir = Path(vae_dir)
    cache = Path(cache_dir) / latent_cache_key(
        info, vae_dir, chunk=chunk, stride=stride, resolution_tier=resolution_tier, handover=handover
    )
    cache.mkdir(parents=True, exist_ok=True)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    # Frames are read only for the episodes this rank encodes; actions and tasks of all of them.
    store = info.episodes
    episodes = [store.load(i, with_frames=False) for i in range(len(store))]
    starts_per_episode = [window_starts(e.num_actions, chunk, stride) for e in episodes]
    if not any(starts_per_episode):
        longest = max(e.num_actions for e in episodes)
        raise InputError(f"chunk: {chunk} is longer than every episode of {info.root} (at most {longest} actions)")

    todo = [
        i
        for i, starts in enumerate(starts_per_episode)
        if starts and i % world_size == rank and not (cache / f"{store.name(i)}.safetensors").exists()
    ]

    # Reading an episode (zlib) and putting it on the canvas is host work that releases the GIL: threads prepare the
    # next episodes while this one encodes, so a GPU is not left waiting on one core.
    def prepare(i: int) -> processor.Conditioning:
        frames = store.read_frames(i)
        return processor.prepare_conditioning(frames, resolution_tier, int(frames.shape[0]))

    def encode_group(group: list[tuple[int, processor.Conditioning]]) -> list[torch.Tensor]:
        """The cache entries of the episodes ``(i, cond)`` of ``group``: their windows' latents, or their
        whole-episode latents."""
        if handover == "latent":  # whole episodes, encode_batch_size at a time
            return encode_episodes(vae, [cond for _, cond in group])
        return encode_windows_of_episodes(  # windows, encode_batch_size at a time across episodes
            vae, [(cond, starts_per_episode[i]) for i, cond in group], chunk, encode_batch_size
        )

    def group_is_full(group: list[tuple[int, processor.Conditioning]]) -> bool:
        if handover == "latent":
            return len(group) == encode_batch_size
        return sum(len(starts_per_episode[i]) for i, _ in group) >= encode_batch_size

    group: list[tuple[int, processor.Conditioning]] = []
    saved = []
    with ThreadPoolExecutor(PREPARE_THREADS) as pool:
        # At most 2 * PREPARE_THREADS episodes in flight: each is ~100 MB of float pixels at 256 x 256.
        pending = collections.deque(pool.submit(prepare, i) for i in todo[: 2 * PREPARE_THREADS])
        for position, i in enumerate(
            tqdm(todo, desc="encoding windows", disable=not progress or not todo, leave=False)
        ):
            cond = pending.popleft().result()
            if position + len(pending) + 1 < len(todo):
                pending.append(pool.submit(prepare, todo[position + len(pending) + 1]))
            group.append((i, cond))
            if group_is_full(group) or position == len(todo) - 1:
                for (j, episode_cond), encoded in zip(group, encode_group(group)):
                    # Written by the pool's threads (a safetensors file fsynced per episode: milliseconds each,
                    # which thousands of one-window episodes would add to the encoder's critical path).
                    saved.append(pool.submit(save_cache_entry, cache, store.name(j), episode_cond, encoded))
                group = []
        for future in saved:
            future.result()  # a failed write is an error here, not a silent cache miss later
    if world_size > 1:
        dist.barrier()

    prompts: list[tuple[list[int], list[int]]] = []
    prompt_of_key: dict[tuple, int] = {}
    latents, actions, prompt_index, episode_index, window_start, successful = [], [], [], [], [], []
    canvas_hw: tuple[int, int] | None = None
    latent_shape: tuple[int, ...] | None = None
    for i, (episode, starts) in enumerate(zip(episodes, starts_per_episode)):
        if not starts:
            continue
        path = cache / f"{store.name(i)}.safetensors"
        try:
            tensors, metadata = load_safetensors(path, what="latent cache")
            episode_canvas, episode_latents = tuple(json.loads(metadata["canvas_hw"])), tensors["latents"]
        except (CheckpointError, KeyError, ValueError) as error:
            # A damaged entry (its checksum says so) is only a cache miss: encode the episode again.
            logger.warning("%s; encoding episode %s again", error, store.name(i))
            cond = prepare(i)
            episode_canvas = cond.canvas_hw
            episode_latents = encode_group([(i, cond)])[0]
            save_cache_entry(cache, store.name(i), cond, episode_latents)
        if handover == "latent":
            episode_latents = latent_windows(episode_latents, starts, chunk, tc, context_frames)
        if canvas_hw is None:
            canvas_hw, latent_shape = episode_canvas, tuple(episode_latents.shape[1:])
        elif episode_canvas != canvas_hw or tuple(episode_latents.shape[1:]) != latent_shape:
            raise InputError(
                f"dataset: {info.root} {store.name(i)} gives a {episode_canvas} canvas / latent "
                f"{episode_latents.shape[1:]}"
                f" but earlier episodes give {canvas_hw} / {latent_shape}; all frames must have one size"
            )
        key = (episode.task, episode_canvas)
        if key not in prompt_of_key:
            prompt_of_key[key] = len(prompts)
            prompts.append(
                processor.build_prompt_token_ids(
                    tokenizer,
                    episode.task,
                    negative_prompt=None,
                    view_point=view_point,
                    num_frames=chunk + 1,
                    fps=fps,
                    height=episode_canvas[0],
                    width=episode_canvas[1],
                )
            )
        normalised = torch.from_numpy(np.asarray(info.stats.normalize(episode.actions), dtype=np.float32))
        latents.append(episode_latents)
        rows = torch.arange(-action_history_length, chunk)
        actions.append(torch.stack([normalised[(s + rows).clamp_min(0)] for s in starts]))
        prompt_index += [prompt_of_key[key]] * len(starts)
        episode_index += [i] * len(starts)
        window_start += starts
        successful += [bool(episode.success)] * len(starts)
    assert canvas_hw is not None  # some episode has a window (checked above)
    return TrainingWindows(
        latents=torch.cat(latents),
        actions=torch.cat(actions),
        prompt_index=torch.tensor(prompt_index),
        prompts=prompts,
        episode_index=torch.tensor(episode_index),
        start=torch.tensor(window_start),
        successful=torch.tensor(successful, dtype=torch.bool),
        canvas_hw=canvas_hw,
    )


# ----------------------------------------------------------------------------------------------------------------
# Loss focus
# ----------------------------------------------------------------------------------------------------------------


def load_focus_mask(spec: str):
    """``"module:function"`` -> the focus mask function (module docstring); errors name ``video_loss_focus``."""
    module_name, colon, attribute = spec.rpartition(":")
    if not colon or not module_name or not attribute:
        raise InputError(f"video_loss_focus: expected 'module:function', got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise InputError(f"video_loss_focus: cannot load {spec!r} ({type(error).__name__}: {error})") from None
    if not callable(function):
        raise InputError(f"video_loss_focus: {spec!r} is not a function")
    return function


def window_focus(
    info: DatasetInfo,
    windows: TrainingWindows,
    focus_mask,
    *,
    chunk: int,
    context_frames: int = 1,
    temporal_compression: int = 4,
    progress: bool = True,
) -> torch.Tensor:
    """[N, h, w] bool: for each window, the latent cells where ``focus_mask`` of any of its frames is set, grown by
    one cell (module docstring). A window starting at pixel frame ``s`` spans frames ``s - tc*(K-1) .. s + chunk``
    (its context frames included, clamped at the episode's start); the content latent grid maps onto the whole frame
    (``prepare_conditioning`` puts the content at the canvas' top left and the latents are cropped to it)."""
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    h, w = windows.latent_thw[1:]
    focus = torch.zeros(len(windows), h, w, dtype=torch.bool)
    episodes = windows.episode_index.unique().tolist()

    def cells(i: int) -> torch.Tensor:  # [T+1, h, w]: each frame's focus on the latent grid
        frames = info.episodes.read_frames(i)
        masks = np.asarray(focus_mask(frames))
        if masks.shape != frames.shape[:3] or masks.dtype != np.bool_:
            raise InputError(
                f"video_loss_focus: expected a bool mask of shape {frames.shape[:3]} for frames {frames.shape}, got "
                f"{masks.dtype} {masks.shape}"
            )
        return F.adaptive_max_pool2d(torch.from_numpy(masks).float()[:, None], (h, w))[:, 0] > 0

    with ThreadPoolExecutor(PREPARE_THREADS) as pool:  # zlib reads and numpy masks release the GIL
        for i, per_frame in zip(
            episodes,
            tqdm(pool.map(cells, episodes), total=len(episodes), desc="loss focus", disable=not progress, leave=False),
        ):
            rows = (windows.episode_index == i).nonzero()[:, 0]
            for row in rows.tolist():
                start = int(windows.start[row])
                first = max(0, start - temporal_compression * (context_frames - 1))
                focus[row] = per_frame[first : start + chunk + 1].any(0)
    grown = F.max_pool2d(focus[:, None].float(), kernel_size=3, stride=1, padding=1)[:, 0] > 0
    return grown
