"""Tile-parallel VAE decode: the ranks of one replica group (cfg x tp) each decode a spatial tile of the frame.

The latent ``[B, C, t, h, w]`` is identical on every rank. It is split into a near-square grid of ``n = group size``
tiles (``tile_grid``); group rank ``r`` (the replica rank: cfg outer, tp inner) owns core tile ``r`` with
integer-split bounds. Two modes:

* approximate (default, ``exact=False``): each rank decodes its core widened by ``halo`` latent pixels on the
  sides that touch another tile, through the unmodified ``Cosmos3VAE.decode``. The tiles are gathered and blended
  with a separable linear feather over each overlap (``2 * halo * 16`` pixels wide: the neighbour's halo plus ours),
  weighted sum / weight sum. A tile sees neither the pixels beyond its halo through the convolutions nor the rest of
  the frame through the mid-block attention, so the result differs from an untiled decode. Measured on the tiny
  random VAE (``build_tiny_checkpoint``), random-normal latents of 2 latent frames, max / mean absolute error on
  [0, 1] against the untiled decode::

      halo                                  0              1              2              4
      4 ranks, 2x2 grid, 16x24 latent px    0.69 / 0.033   0.38 / 0.019   0.29 / 0.012   0.12 / 0.0076
      4 ranks, 2x2 grid, 8x12 latent px     0.61 / 0.054   0.41 / 0.032   0.28 / 0.021   0.10 / 0.0082

  The error is largest at the seams and falls with the halo (2 ranks, 24x48 latent px, halo 2: mean 0.068 within
  one latent px of the seam, 0.006 beyond 8). The ~0.006 floor far from the seams is the tile-local mid-block
  attention: with the attention removed it drops to ~1e-6 beyond 8 latent px. The real Wan2.2 VAE's trained weights
  may spread less or more through the attention; measure on real latents before relying on the bound.
* exact (``exact=True``): each rank decodes only its core tile, with the decoder's 3x3 convolutions padded from the
  neighbouring tiles' rows and columns (a halo exchange per convolution, per latent frame) and the mid-block
  attention run on the gathered full latent-resolution frame, as DistVAE's row sharding does, but on a 2-D grid. It
  equals the untiled decode up to float summation order (max error ~1e-6 on the tiny VAE) at the price of two small
  all-gathers per 3x3 convolution per latent frame (about 70 per frame for the Wan2.2 decoder).

Every rank enters every collective with agreed shapes, also a rank without a tile (the grid can be smaller than the
group when the latent is too small to split: in exact mode it decodes a 1x1 dummy to run the same collectives). In
the approximate mode a rank whose decode raised reports it in the first collective, so that all ranks raise instead
of leaving the others blocked; in exact mode the collectives run inside the decode, and a rank that raises there
leaves the others waiting until the process group's timeout (the client mode's workers then get killed).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, cast, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d, WanResample

from ..errors import InputError
from ..models.vae import Cosmos3VAE

OUTPUTS = ("all", "rank0")

# Metadata each rank contributes to the first all-gather (int64, pixel units):
# status, decoded tile y0, x0, height, width, blend widths on the top/bottom/left/right sides, then the latent shape
# (B, C, t, h, w) so that ranks holding different latents fail together instead of deadlocking later.
_STATUS_IDLE, _STATUS_TILE, _STATUS_FAILED = 0, 1, -1
_META_LEN = 9 + 5


@dataclass(frozen=True)
class TilePlan:
    """A ``rows x cols`` grid over a latent ``h x w``; tile ``k`` is at grid position ``divmod(k, cols)``."""

    rows: int
    cols: int
    row_bounds: tuple[tuple[int, int], ...]  # latent [start, end) of each grid row
    col_bounds: tuple[tuple[int, int], ...]

    @property
    def num_tiles(self) -> int:
        return self.rows * self.cols

    def position(self, tile: int) -> tuple[int, int] | None:
        """Grid (row, col) of ``tile``, or None for a rank beyond the grid (idle)."""
        return divmod(tile, self.cols) if tile < self.num_tiles else None

    def bounds(self, tile: int) -> tuple[int, int, int, int] | None:
        """Latent core bounds ``(y0, y1, x0, x1)`` of ``tile``, or None for an idle rank."""
        position = self.position(tile)
        if position is None:
            return None
        (y0, y1), (x0, x1) = self.row_bounds[position[0]], self.col_bounds[position[1]]
        return y0, y1, x0, x1

    def rank_at(self, row: int, col: int) -> int | None:
        """The tile (= group rank) at a grid position, None outside the grid."""
        return row * self.cols + col if 0 <= row < self.rows and 0 <= col < self.cols else None


def tile_grid(n: int, latent_hw: tuple[int, int] | None = None) -> tuple[int, int]:
    """``(rows, cols)`` for ``n`` ranks: 8 -> 2x4, 4 -> 2x2, 2 -> 1x2, a prime p -> 1xp.

    With ``latent_hw`` the grid is the one with the most tiles (at most ``n``, at least one latent pixel each) whose
    tiles are the most square for that latent; ties keep fewer rows than columns.
    """
    if not isinstance(n, int) or n < 1:
        raise InputError(f"n: expected an integer >= 1 (the group size), got {n!r}")
    if latent_hw is None:
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        return rows, n // rows
    h, w = latent_hw
    if h < 1 or w < 1:
        raise InputError(f"latent_hw: expected a positive latent height and width, got {latent_hw}")

    def score(grid):
        rows, cols = grid
        tile_h, tile_w = h / rows, w / cols
        return -rows * cols, max(tile_h / tile_w, tile_w / tile_h), rows

    grids = [(r, c) for r in range(1, min(n, h) + 1) for c in range(1, min(n // r, w) + 1)]
    return min(grids, key=score)


def plan_tiles(n: int, latent_h: int, latent_w: int) -> TilePlan:
    """The grid of ``tile_grid(n, (latent_h, latent_w))`` with integer-split bounds (``k * size // parts``)."""
    rows, cols = tile_grid(n, (latent_h, latent_w))

    def split(size: int, parts: int) -> tuple[tuple[int, int], ...]:
        return tuple((k * size // parts, (k + 1) * size // parts) for k in range(parts))

    return TilePlan(rows, cols, split(latent_h, rows), split(latent_w, cols))


@torch.no_grad()
@overload
def decode_tile_parallel(
    vae: Cosmos3VAE,
    latents: torch.Tensor,
    group: dist.ProcessGroup | None,
    halo: int = ...,
    output: Literal["all"] = ...,
    *,
    exact: bool = ...,
) -> torch.Tensor: ...
@overload
def decode_tile_parallel(
    vae: Cosmos3VAE,
    latents: torch.Tensor,
    group: dist.ProcessGroup | None,
    halo: int = ...,
    output: str = ...,
    *,
    exact: bool = ...,
) -> torch.Tensor | None: ...
def decode_tile_parallel(
    vae: Cosmos3VAE,
    latents: torch.Tensor,
    group: dist.ProcessGroup | None,
    halo: int = 2,
    output: str = "all",
    *,
    exact: bool = False,
) -> torch.Tensor | None:
    """Decode normalised latents ``[B, C, t, h, w]`` into pixels ``[B, 3, 1 + 4(t-1), 16h, 16w]`` in [0, 1].

    Collective over ``group``: every rank must call it with the same latents and arguments. ``group=None`` means
    no parallelism (a single-process engine): a plain ``vae.decode``. ``halo`` (latent pixels) widens each tile on
    its interior sides in the approximate mode and is unused when ``exact``. ``output="all"`` returns the frame on
    every rank; ``"rank0"`` only on group rank 0 (the others get None). See the module docstring for the error of
    the approximate mode and the cost of the exact one.
    """
    if not isinstance(latents, torch.Tensor) or latents.ndim != 5:
        raise InputError(f"latents: expected a tensor [B, C, t, h, w], got {_describe(latents)}")
    if not isinstance(halo, int) or isinstance(halo, bool) or halo < 0:
        raise InputError(f"halo: expected an integer >= 0 (latent pixels), got {halo!r}")
    if output not in OUTPUTS:
        raise InputError(f"output: expected one of {list(OUTPUTS)}, got {output!r}")
    if group is None:
        return vae.decode(latents)

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    _, _, _, latent_h, latent_w = latents.shape
    plan = plan_tiles(n, latent_h, latent_w)
    scale = vae.spatial_compression

    meta = torch.zeros(_META_LEN, dtype=torch.int64)
    meta[9:] = torch.tensor(latents.shape)
    tile, failure = None, None
    try:
        if exact:
            tile, meta[:9] = _decode_exact_tile(vae, latents, group, plan, rank)
        elif plan.bounds(rank) is not None:
            tile, meta[:9] = _decode_halo_tile(vae, latents, plan.bounds(rank), halo, scale)
    except Exception as error:  # reported to every rank below, then re-raised here
        failure = error
        meta[0] = _STATUS_FAILED

    metas = torch.stack(_all_gather(meta.to(latents.device), group)).cpu()
    failed = [r for r in range(n) if metas[r, 0] == _STATUS_FAILED]
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"decode_tile_parallel: group rank(s) {failed} failed to decode their tile")
    if not (metas[:, 9:] == metas[0, 9:]).all():
        shapes = {r: metas[r, 9:].tolist() for r in range(n)}
        raise RuntimeError(f"decode_tile_parallel: ranks hold latents of different shapes {shapes}")

    active = [r for r in range(n) if metas[r, 0] == _STATUS_TILE]
    max_h, max_w = int(metas[active, 3].max()), int(metas[active, 4].max())
    batch = latents.shape[0]
    num_frames = 1 + vae.temporal_compression * (latents.shape[2] - 1)
    padded = torch.zeros(batch, 3, num_frames, max_h, max_w, device=latents.device)
    if tile is not None:
        padded[..., : tile.shape[-2], : tile.shape[-1]] = tile

    if output == "rank0":
        destination = dist.get_global_rank(group, 0)
        to_rank0 = [torch.empty_like(padded) for _ in range(n)] if rank == 0 else None
        dist.gather(padded, to_rank0, dst=destination, group=group)
        if to_rank0 is None:  # rank != 0
            return None
        gathered = to_rank0
    else:
        gathered = _all_gather(padded, group)

    frame = torch.zeros(batch, 3, num_frames, latent_h * scale, latent_w * scale, device=latents.device)
    weight_sum = torch.zeros(latent_h * scale, latent_w * scale, device=latents.device)
    for r in active:
        _, y0, x0, h, w, top, bottom, left, right = metas[r, :9].tolist()
        weight = _feather(h, top, bottom, latents.device)[:, None] * _feather(w, left, right, latents.device)[None]
        frame[..., y0 : y0 + h, x0 : x0 + w] += gathered[r][..., :h, :w] * weight
        weight_sum[y0 : y0 + h, x0 : x0 + w] += weight
    return (frame / weight_sum).clamp_(0.0, 1.0)


def _decode_halo_tile(vae, latents, core, halo, scale):
    """Approximate mode: decode the core widened by ``halo`` latent pixels on its interior sides."""
    y0, y1, x0, x1 = core
    _, _, _, latent_h, latent_w = latents.shape
    ey0, ey1 = max(0, y0 - halo), min(latent_h, y1 + halo)
    ex0, ex1 = max(0, x0 - halo), min(latent_w, x1 + halo)
    tile = vae.decode(latents[..., ey0:ey1, ex0:ex1])
    # Each overlap holds our halo and the neighbour's: the feather spans both (twice the halo on that side).
    blend = [2 * (y0 - ey0), 2 * (ey1 - y1), 2 * (x0 - ex0), 2 * (ex1 - x1)]
    meta = [_STATUS_TILE, ey0 * scale, ex0 * scale, (ey1 - ey0) * scale, (ex1 - ex0) * scale]
    return tile, torch.tensor(meta + [b * scale for b in blend])


def _decode_exact_tile(vae, latents, group, plan, rank):
    """Exact mode: decode the core only, with halo exchange in every 3x3 convolution and a gathered attention.

    A rank without a tile decodes a 1x1 latent so that it runs the same sequence of collectives as the others.
    """
    core = plan.bounds(rank)
    y0, y1, x0, x1 = core if core is not None else (0, 1, 0, 1)
    exchange = _HaloExchange(plan, rank, group, (y1 - y0, x1 - x0))
    with exchange.installed(vae.vae.decoder):
        tile = vae.decode(latents[..., y0:y1, x0:x1])
    if core is None:
        return None, torch.zeros(9, dtype=torch.int64)
    scale = vae.spatial_compression
    meta = [_STATUS_TILE, y0 * scale, x0 * scale, (y1 - y0) * scale, (x1 - x0) * scale, 0, 0, 0, 0]
    return tile, torch.tensor(meta)


def _feather(length: int, blend_start: int, blend_end: int, device) -> torch.Tensor:
    """Weights along one axis of a tile: a linear ramp (0, 1] over ``blend_start`` pixels from the start, the
    mirror ramp over ``blend_end`` pixels at the end, 1 elsewhere. Neighbours' ramps over one overlap sum to 1."""
    position = torch.arange(length, dtype=torch.float32, device=device) + 0.5
    weight = torch.ones(length, device=device)
    if blend_start:
        weight = weight * (position / blend_start).clamp(max=1.0)
    if blend_end:
        weight = weight * ((length - position) / blend_end).clamp(max=1.0)
    return weight


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered


class _HaloExchange:
    """The collectives of the exact mode for one rank's tile.

    Tensors inside the decoder are ``[..., s * tile_h, s * tile_w]`` with the same scale ``s`` on every rank at a
    given layer (1 at the latent resolution, doubling at each upsample), so every rank can size every exchange from
    the plan alone: buffers are padded to the largest tile. Rows are exchanged first and columns second, on the
    row-padded tensor, which brings the diagonal neighbours' corner pixels along.
    """

    def __init__(self, plan: TilePlan, rank: int, group, local_latent_hw: tuple[int, int]):
        self.plan = plan
        self.group = group
        self.position = plan.position(rank)  # None: idle rank, it sends zeros and pads its dummy tile with zeros
        self.core = plan.bounds(rank)
        self.local_latent_h, self.local_latent_w = local_latent_hw
        self.max_latent_h = max(end - start for start, end in plan.row_bounds)
        self.max_latent_w = max(end - start for start, end in plan.col_bounds)

    def scale(self, x: torch.Tensor) -> int:
        s = x.shape[-1] // self.local_latent_w
        assert x.shape[-2:] == (s * self.local_latent_h, s * self.local_latent_w), "unexpected decoder layout"
        return s

    def pad(self, x: torch.Tensor, p: int, front: int = 0) -> torch.Tensor:
        """``x`` with ``p`` rows and columns on each side: the neighbours' pixels, zeros at the frame border; and
        ``front`` zero frames before dim -3 (a causal convolution's time padding).

        Written into one preallocated, contiguous buffer: padding by concatenation copied each activation three
        times and handed the convolution a transposed (non-contiguous) input.
        """
        s = self.scale(x)
        h, w = x.shape[-2:]
        out = x.new_zeros(*x.shape[:-3], x.shape[-3] + front, h + 2 * p, w + 2 * p)
        core = out[..., front:, :, :]
        core[..., p : p + h, p : p + w] = x
        above = below = left = right = None
        if self.position is not None:
            row, col = self.position
            above, below = self.plan.rank_at(row - 1, col), self.plan.rank_at(row + 1, col)
            left, right = self.plan.rank_at(row, col - 1), self.plan.rank_at(row, col + 1)
        if self.plan.rows > 1:  # each rank sends its first and last p rows; a grid of one row skips it everywhere
            strips = self._gather_edges(torch.cat([x[..., :p, :], x[..., -p:, :]], dim=-2), self.max_latent_w * s)
            if above is not None:
                core[..., :p, p : p + w] = strips[above][..., p:, :w]
            if below is not None:
                core[..., p + h :, p : p + w] = strips[below][..., :p, :w]
        if self.plan.cols > 1:  # then columns of the row-extended tile, which carry the diagonal corners along
            edges = torch.cat([core[..., :, p : 2 * p], core[..., :, w : w + p]], dim=-1)
            strips = self._gather_edges(edges.transpose(-1, -2), self.max_latent_h * s + 2 * p)
            if left is not None:
                core[..., :, :p] = strips[left][..., p:, : h + 2 * p].transpose(-1, -2)
            if right is not None:
                core[..., :, p + w :] = strips[right][..., :p, : h + 2 * p].transpose(-1, -2)
        return out

    def _gather_edges(self, edges: torch.Tensor, max_width: int) -> list[torch.Tensor]:
        """All-gather every rank's ``[..., 2p, width]`` edge strips, padded to ``max_width`` (the widest tile's)."""
        return _all_gather(F.pad(edges, (0, max_width - edges.shape[-1])), self.group)

    def gather_frame(self, x: torch.Tensor) -> torch.Tensor:
        """The whole frame at ``x``'s resolution, assembled from every rank's tile."""
        s = self.scale(x)
        padded = F.pad(x, (0, self.max_latent_w * s - x.shape[-1], 0, self.max_latent_h * s - x.shape[-2]))
        tiles = _all_gather(padded, self.group)
        frame_h, frame_w = self.plan.row_bounds[-1][1] * s, self.plan.col_bounds[-1][1] * s
        frame = x.new_empty(*x.shape[:-2], frame_h, frame_w)
        for tile in range(self.plan.num_tiles):
            bounds = self.plan.bounds(tile)
            assert bounds is not None  # every tile of the grid has bounds
            y0, y1, x0, x1 = (bound * s for bound in bounds)
            frame[..., y0:y1, x0:x1] = tiles[tile][..., : y1 - y0, : x1 - x0]
        return frame

    def crop(self, frame: torch.Tensor, s: int) -> torch.Tensor:
        """This rank's tile of a whole frame at scale ``s``."""
        assert self.core is not None  # only a rank with a tile crops
        y0, y1, x0, x1 = (bound * s for bound in self.core)
        return frame[..., y0:y1, x0:x1]

    @contextlib.contextmanager
    def installed(self, decoder: torch.nn.Module) -> Iterator[None]:
        """Route the decoder's spatially padded convolutions and its attention through this exchange."""
        replacements: dict[torch.nn.Module, Callable[..., torch.Tensor]] = {}
        for module in decoder.modules():
            # diffusers sets ``_padding`` to ints; nn.Conv3d's ``padding`` (str | tuple) types its items as str | int
            if isinstance(module, WanCausalConv3d) and cast(int, module._padding[0]) > 0:
                replacements[module] = self._causal_conv3d_forward(module)
            elif isinstance(module, WanAttentionBlock):
                replacements[module] = self._attention_forward(module)
            elif isinstance(module, WanResample) and module.mode in ("upsample2d", "upsample3d"):
                conv = module.resample[-1]
                assert isinstance(conv, torch.nn.Conv2d)  # diffusers' upsample: Sequential(WanUpsample, Conv2d)
                replacements[conv] = self._conv2d_forward(conv)
        for module, forward in replacements.items():
            module.forward = forward  # an instance attribute shadows the class's forward
        try:
            yield
        finally:
            for module in replacements:
                del module.forward

    def _causal_conv3d_forward(self, conv: WanCausalConv3d):
        pad_w, _, pad_h, _, pad_t, _ = conv._padding
        assert pad_w == pad_h, "square spatial padding expected"

        def forward(x, cache_x=None):
            # WanCausalConv3d.forward with the spatial zero padding replaced by the neighbours' pixels.
            time_pad = pad_t
            if cache_x is not None and pad_t > 0:
                x = torch.cat([cache_x.to(x.device), x], dim=2)
                time_pad -= cache_x.shape[2]
            return torch.nn.Conv3d.forward(conv, self.pad(x, pad_h, front=time_pad))

        return forward

    def _conv2d_forward(self, conv: torch.nn.Conv2d):
        assert conv.padding_mode == "zeros" and conv.padding[0] == conv.padding[1]

        def forward(x):
            return F.conv2d(
                self.pad(x, conv.padding[0]), conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups
            )

        return forward

    def _attention_forward(self, block: WanAttentionBlock):
        def forward(x):
            s = self.scale(x)
            frame = self.gather_frame(x)
            if self.position is None:
                return x
            return self.crop(WanAttentionBlock.forward(block, frame), s)

        return forward


def _describe(value) -> str:
    return f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
