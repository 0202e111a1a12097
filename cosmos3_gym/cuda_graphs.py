"""The GEN forward replayed as one CUDA graph per input signature.

At batch 1 and tier 256 the Nano GEN forward keeps an H200 busy for 14 ms but took 15-19 ms: the host cannot launch
its ~600 kernels (36 compiled blocks) as fast as the GPU runs them
(benchmarks/results/engine/profile_gpu_h200_compiled.json against profile_gpu_h200_cuda_graphs.json). A CUDA graph
launches them all at once.
``torch.compile(mode="reduce-overhead")`` cannot do it for us: it graphs each compiled *block*, and since all blocks
share one compiled graph, every block's call overwrites the previous block's output buffer ("accessing tensor output
of CUDAGraphs that has been overwritten"). So this module captures the whole forward - compiled blocks included -
with ``torch.cuda.CUDAGraph``.

A graph bakes in device addresses and Python-level structure, so one graph is kept per *signature*: the shapes and
dtypes of every input tensor plus the text lengths (which decide how attention is split by prompt length, see
``GenLayout.length_groups``). Each call copies its inputs into the graph's static buffers, replays, and returns
copies of the outputs (the next replay overwrites the static ones).

``GraphedFunction`` does the same for the engine's other launch-bound stages, pure functions of a few tensors: the
VAE encode of the conditioning frames and the light decoder's decode (``Cosmos3Engine.optimize(stage_graphs=...)``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, cast

import torch

from .errors import InputError
from .models.transformer import Cosmos3Transformer, GenLayout, TextKV

# graph_rows' default: pad a batch to a kept graph of at most twice its rows.
DEFAULT_MAX_PADDING = 2.0


def check_max_padding(max_padding: float | None) -> float | None:
    if max_padding is not None and (
        isinstance(max_padding, bool) or not isinstance(max_padding, (int, float)) or not max_padding >= 1
    ):
        raise InputError(f"max_padding: expected a number >= 1 or None (any kept graph), got {max_padding!r}")
    return max_padding


@dataclasses.dataclass(eq=False)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor | None]  # static buffers, in the order of ``_flat_inputs``
    # Indexes into ``inputs`` grouped by dtype: one multi-tensor copy per group instead of ~80 copy kernels a step.
    copy_groups: list[list[int]]
    outputs: tuple[torch.Tensor, torch.Tensor | None]
    # Holds the layout's row-index tensors of length_groups, which the graph reads but no static buffer owns: once
    # freed, their memory would be reused and the replay would index with garbage.
    layout: GenLayout


def _flat_inputs(text: TextKV, layout: GenLayout, *tensors) -> list[torch.Tensor | None]:
    return [*text.keys, *text.values, layout.cos, layout.sin, *tensors]


def _signature(text: TextKV, flat: list[torch.Tensor | None]) -> tuple:
    return (tuple(text.lengths), tuple(None if t is None else (tuple(t.shape), t.dtype) for t in flat))


_capture_streams: dict[int, torch.cuda.Stream] = {}


def _capture_stream() -> torch.cuda.Stream:
    """The current device's one side stream for every warm-up and capture. cuBLAS keeps a workspace for each stream
    it has run on (32 MiB on Hopper) for the life of the process, so a fresh stream per capture added 32 MiB of GPU
    memory with every graph (measured on an H200 by
    ``test_graphs_of_several_batch_sizes_share_one_memory_pool_and_stay_exact``); and ``torch.cuda.graph`` shares a
    pool fully only between captures on one stream."""
    device = torch.cuda.current_device()
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


def capture(fn, pool=None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` captured as a CUDA graph: (the graph, the captured call's outputs, which every replay overwrites).

    A warm-up call runs first, outside the capture and on a side stream as ``torch.cuda.graph`` expects: it compiles
    what is compiled for these shapes and lets cuBLAS / cuDNN allocate their workspaces before any address is recorded.
    ``pool`` (a ``torch.cuda.graph_pool_handle()``) lets the capture reuse the memory earlier captures into it freed.
    """
    side = _capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: under tensor parallelism the NCCL watchdog thread keeps querying its events during capture, which
    # the default (global) mode turns into a capture error.
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        outputs = fn()
    return graph, outputs


class _GraphCache:
    """The captured graphs of one callable, by signature, least recently used dropped first beyond ``max_graphs``.
    ``reset()`` drops them all (after the weights they read moved).

    The graphs share one memory pool. A graph's intermediates are dead once its replay ends, and its outputs are
    copied out before anything else runs, so a later capture may place its tensors where an earlier graph's
    intermediates were; with a pool per graph, every new batch size a vector env met (slots finishing out of step)
    added its whole activation memory. Together with one capture stream (``_capture_stream``) this took a 16-env
    soak with slots out of step on an H200 from +294 MB of GPU memory over 5 graphs to +34 MB
    (the 16-env soak with varying batches, benchmarks/RESULTS.md). Sharing is safe because the graphs
    of one cache are replayed one at a time, on one stream, with inputs in static buffers allocated outside the pool.
    """

    def __init__(self, max_graphs: int, max_padding: float | None = DEFAULT_MAX_PADDING):
        self.max_graphs = max_graphs
        self.max_padding = check_max_padding(max_padding)  # how far graph_rows pads a batch to a kept graph
        self._graphs: OrderedDict[tuple, Any] = OrderedDict()
        self._pool: tuple[int, int] | None = None  # torch.cuda.graph_pool_handle(), made at the first capture

    def reset(self) -> None:
        self._graphs.clear()
        self._pool = None

    def _capture_into_pool(self, fn) -> tuple[torch.cuda.CUDAGraph, Any]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture(fn, pool=self._pool)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _cached(self, key: tuple, capture_entry) -> tuple[Any, bool]:
        """``(entry, captured)``: the kept graph of ``key``, or a new one from ``capture_entry()``."""
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            return entry, False
        entry = self._graphs[key] = capture_entry()
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry, True


class GraphedGenForward(_GraphCache):
    """Drop-in for ``Cosmos3Transformer.__call__`` (the GEN forward) on one CUDA device.

    The first call of a signature runs the forward once on a side stream (compiles, cuDNN / cuBLAS set-up), captures
    it, then replays; later calls only copy inputs and replay. At most ``max_graphs`` signatures are kept (least
    recently used dropped first); they share one memory pool, so each adds its outputs and whatever activation memory
    exceeds the largest earlier graph's. Call ``reset()`` whenever the
    transformer's weights move (``Cosmos3Engine.offload``), since the graphs read them at their old addresses.
    """

    def __init__(self, transformer: Cosmos3Transformer, max_graphs: int = 8):
        if transformer.device.type != "cuda":
            raise InputError(f"cuda_graphs: needs the transformer on a CUDA device, it is on {transformer.device}")
        super().__init__(max_graphs)
        self.transformer = transformer

    @property
    def row_counts(self) -> set[int]:
        """The batch sizes (rows of the GEN forward) of the graphs kept now."""
        return {len(key[0]) for key in self._graphs}

    def __call__(
        self,
        text: TextKV,
        layout: GenLayout,
        video,
        video_noisy,
        timesteps,
        actions=None,
        action_noisy=None,
        domain_ids=None,
        context_timesteps=None,
    ):
        tensors = (video, video_noisy, timesteps, actions, action_noisy, domain_ids, context_timesteps)
        flat = _flat_inputs(text, layout, *tensors)
        entry, captured = self._cached(_signature(text, flat), lambda: self._capture(text, layout, flat))
        if not captured:
            for group in entry.copy_groups:
                torch._foreach_copy_([entry.inputs[i] for i in group], [flat[i] for i in group])
        entry.graph.replay()
        video_velocity, action_velocity = entry.outputs
        return video_velocity.clone(), None if action_velocity is None else action_velocity.clone()

    def _capture(self, text: TextKV, layout: GenLayout, flat: list) -> _Graph:
        static = [None if t is None else t.clone() for t in flat]
        num_layers = len(text.keys)
        keys, values = static[:num_layers], static[num_layers : 2 * num_layers]  # text K/V: tensors, never None
        static_text = TextKV(cast("list[torch.Tensor]", keys), cast("list[torch.Tensor]", values), list(text.lengths))
        cos, sin, *tensors = static[2 * num_layers :]
        assert cos is not None and sin is not None  # a layout's rotary tables
        # length_groups' row indexes follow from text.lengths, which are part of the signature: kept as they are.
        static_layout = dataclasses.replace(layout, cos=cos, sin=sin)

        graph, outputs = self._capture_into_pool(lambda: self.transformer(static_text, static_layout, *tensors))
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(static):
            if t is not None:
                groups.setdefault(t.dtype, []).append(i)
        return _Graph(graph, static, list(groups.values()), outputs, static_layout)


@dataclasses.dataclass(eq=False)
class _FunctionGraph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static buffers, one per tensor argument
    outputs: torch.Tensor | tuple[torch.Tensor, ...]


class GraphedFunction(_GraphCache):
    """A pure function of its tensor arguments replayed as one CUDA graph per signature, for the engine's eager stages
    around the GEN forward (the VAE encode of the conditioning frames, the light decoder's decode): at one env those
    are a few hundred small kernels each, and the host launching them one by one is what the step waits for.

    ``fn(*tensors, **options)`` must be a pure function of the tensors' *values* for a fixed signature (the tensors'
    shapes and dtypes, and the options, which must be hashable): any Python-side state it reads or mutates is frozen
    at capture. The Wan VAE's encode qualifies: its causal feature cache is a Python list that ``_encode`` clears at
    the start of every call and fills within it, so for one input shape every call takes the same path over the same
    cache slots (the capture records the cached tensors as graph memory). A call copies its tensors into the graph's
    static buffers (on the graph's device), replays, and returns copies of the outputs (a tensor or a tuple of them).
    ``max_graphs`` as for ``GraphedGenForward``; ``reset()`` when the module's weights move.
    """

    def __init__(
        self,
        fn,
        device: torch.device | str,
        max_graphs: int = 4,
        name: str = "cuda_graphs",
        max_padding: float | None = DEFAULT_MAX_PADDING,
    ):
        device = torch.device(device)
        if device.type != "cuda":
            raise InputError(f"{name}: needs a CUDA device, the function runs on {device}")
        super().__init__(max_graphs, max_padding)
        self.fn = fn
        self.device = device

    def row_counts(self, like: torch.Tensor, **options) -> set[int]:
        """The batch sizes (dim 0) of the kept graphs of a single-tensor call shaped like ``like`` in every other dim,
        with these ``options`` (for padding a batch to a graph already captured, see ``graph_rows``)."""
        rest = (tuple(like.shape[1:]), like.dtype)
        wanted = tuple(sorted(options.items()))
        return {
            shapes[0][0][0]
            for shapes, opts in self._graphs
            if len(shapes) == 1 and (shapes[0][0][1:], shapes[0][1]) == rest and opts == wanted
        }

    def __call__(self, *tensors: torch.Tensor, **options):
        tensors = tuple(t.to(self.device) for t in tensors)
        key = _call_key([(tuple(t.shape), t.dtype) for t in tensors], options)
        entry, captured = self._cached(key, lambda: self._capture(tensors, options))
        if not captured:
            for buffer, tensor in zip(entry.inputs, tensors):
                buffer.copy_(tensor)
        entry.graph.replay()
        if isinstance(entry.outputs, torch.Tensor):
            return entry.outputs.clone()
        return tuple(t.clone() for t in entry.outputs)

    def call_padded(self, batch: torch.Tensor, rows: int, **options):
        """``self(batch zero-padded to rows rows, **options)`` cropped back to the batch's rows, for a single-tensor
        call of a function that treats each row on its own. Once the graph of ``rows`` rows is kept, the batch and
        the zero rows are copied straight into its static buffer: no padded copy of the batch is made (at 64
        built-in-model
        envs the encode's was a 50 MB tensor beside the batch, and the first smaller batch of a soak made the caching
        allocator reserve a segment for it)."""
        count = batch.shape[0]
        batch = batch.to(self.device)
        key = _call_key([((rows, *batch.shape[1:]), batch.dtype)], options)  # the padded batch's, as __call__'s
        entry = self._graphs.get(key)
        if entry is None or count == rows:  # the plain call, which captures the graph the first time
            if count < rows:
                batch = torch.cat([batch, batch.new_zeros((rows - count, *batch.shape[1:]))])
            outputs, static = self(batch, **options), False  # copies already
        else:
            self._graphs.move_to_end(key)
            entry.inputs[0][:count].copy_(batch)
            entry.inputs[0][count:].zero_()
            entry.graph.replay()
            outputs, static = entry.outputs, True
        crop = (lambda t: t[:count].clone()) if static else (lambda t: t[:count])  # the next replay overwrites static
        return crop(outputs) if isinstance(outputs, torch.Tensor) else tuple(map(crop, outputs))

    def _capture(self, tensors: tuple[torch.Tensor, ...], options: dict) -> _FunctionGraph:
        static = [t.clone() for t in tensors]
        graph, outputs = self._capture_into_pool(lambda: self.fn(*static, **options))
        return _FunctionGraph(graph, static, outputs)


def _call_key(shapes: list[tuple[tuple[int, ...], torch.dtype]], options: dict) -> tuple:
    """A ``GraphedFunction`` call's signature: each tensor's (shape, dtype), and the options."""
    return tuple(shapes), tuple(sorted(options.items()))


def row_bucket(rows: int) -> int:
    """The padded row count of a CUDA-graphed batch: a power of two up to 8, then a multiple of 8."""
    return 1 << (rows - 1).bit_length() if rows <= 8 else -(-rows // 8) * 8


def graph_rows(rows: int, kept: set[int], max_padding: float | None = DEFAULT_MAX_PADDING) -> int:
    """The row count a CUDA-graphed batch of ``rows`` runs at: the smallest kept graph's that is at most
    ``max_padding`` times ``rows`` (default twice: padding costs at most the rows again, in the engine's denoiser,
    encode and light decode and in the reward model; a new graph costs a capture, a compile for the new shape and
    the graph's memory for the engine's lifetime), else ``row_bucket(rows)``. A 64-slot vector env whose first step
    captured 64 rows thus replays that one graph while 32 to 64 slots step.

    ``max_padding=None``: any kept graph that holds the rows. Then no batch up to the largest one seen captures a
    graph or compiles again, and memory stays flat from then on: what a vector env wants, whose first step is its
    largest batch (every slot steps after the reset) and whose smaller ones are rare (slots that ended reset instead of
    stepping); a 16-env soak whose slots fell out of step grew host memory at each new batch size otherwise
    (the 64-env 100k-step soak, benchmarks/RESULTS.md)."""
    fitting = [count for count in kept if rows <= count and (max_padding is None or count <= max_padding * rows)]
    return min(fitting) if fitting else row_bucket(rows)


def replay_padded(graphed: GraphedFunction, batch: torch.Tensor, **options) -> torch.Tensor:
    """``graphed(batch, **options)`` for a function that treats each row of ``batch`` on its own, with the rows
    zero-padded to ``graph_rows`` (a kept graph's rows or a bucket, as far as ``graphed.max_padding`` allows) so that
    changing batch sizes replay few graphs."""
    padded = graph_rows(batch.shape[0], graphed.row_counts(batch, **options), graphed.max_padding)
    return graphed.call_padded(batch, padded, **options)
