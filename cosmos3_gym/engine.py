"""``Cosmos3Engine``: batched Cosmos3 inference for the three action modes.

One ``step(requests)`` call validates and preprocesses every request, encodes only the clean conditioning frames,
draws seeded noise exactly as diffusers' ``Cosmos3OmniPipeline`` does, and denoises all requests that share a latent
shape and step count in one batched GEN-tower pass per step (conditional and unconditional branches together).
Text K/V come from a per-prompt cache, so a prompt's UND tower runs once for the engine's lifetime.

Multi-GPU (SPMD): under torchrun (or any initialised process group) every rank builds the engine with the same
``ParallelConfig(dp, cfg_parallel, tp)`` and calls ``step`` with the same requests; every rank returns the same
results. ``parallel/plan.py`` shards and speeds up the transformer, ``parallel/collectives.py`` keeps the ranks in
step.
- tp: both towers are tensor-parallel (``parallel/tensor_parallel.py``), text K/V sharded by KV head;
- cfg_parallel: the rows of the batched pass (conditional rows, then the unconditional rows of guided requests) are
  split between the two cfg rank groups, and one all-gather per denoising step gives every rank all velocities; CFG
  and the sampler then run redundantly, so latents stay bit-identical on every rank;
- dp: the requests are dealt round-robin to the dp replicas and the results all-gathered once at the end;
- VAE encode, noise and sampler state are replicated (same seed everywhere); the decode is split over the cfg*tp
  ranks of a replica.
This class is the in-process engine. ``cosmos3_gym.load_engine`` (``launcher.py``) picks it or another
implementation of ``WorldModelEngine`` (``engine_protocol.py``): outside a process group, several ranks run as worker
processes (``parallel/client.py``), several engines as Ray actors (``parallel/ray_replicas.py``).
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
import os
import secrets
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from . import presets, processor
from .checkpoint import resolve_checkpoint, validate_checkpoint
from .cuda_graphs import (
    DEFAULT_MAX_PADDING,
    GraphedFunction,
    GraphedGenForward,
    check_max_padding,
    graph_rows,
    replay_padded,
)
from .errors import CheckpointError, InputError
from .host_threads import map_in_threads
from .models.light_decoder import LightDecoder
from .models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig, TextKV
from .models.vae import Cosmos3VAE
from .parallel.collectives import (
    agree_on_seeds,
    dp_share,
    gather_cfg_rows,
    gather_dp_results,
    run_on_every_rank,
)
from .parallel.mesh import (
    ParallelConfig,
    ParallelContext,
    in_process_group,
    init_parallel,
    resolve_parallel_config,
)
from .parallel.plan import parallelize_transformer
from .parallel.tensor_parallel import check_tensor_parallel, release_symmetric_buffers
from .quantization import apply_precision, check_precision
from .sampling import FlowUniPCSampler, Schedule, cfg_combine, make_schedule, timesteps_from_sigmas

MODES = ("policy", "forward_dynamics", "inverse_dynamics")
# The modes that can continue from a latent context (``Cosmos3Request.context_latents``): those that generate frames
# after clean ones. Inverse dynamics has no frame to generate.
CONTEXT_MODES = ("forward_dynamics", "policy")
# What decodes latents to pixels: "vae" (the checkpoint's VAE decoder, exact) or "light" (a ``LightDecoder`` trained
# for the same latent space, read from the checkpoint's LIGHT_DECODER_DIR; cheaper, approximate).
DECODERS = ("vae", "light")
LIGHT_DECODER_DIR = "light_decoder"


@dataclass
class Cosmos3Request:
    """One inference request. Defaults follow the native RoboLab DROID policy server (4 steps, guidance 3, chunk
    32, 15 fps); the flow shift defaults to the checkpoint's scheduler config.

    Names follow diffusers' ``Cosmos3OmniPipeline`` and Gymnasium: ``action`` is the action chunk in (forward
    dynamics) as ``Cosmos3Result.action`` is the chunk out, ``num_inference_steps`` the denoising steps. The old
    names ``actions=`` and ``num_steps=`` still work for one release, with a ``DeprecationWarning``."""

    mode: str
    observation: Any  # image / video / path / frames, see processor.load_frames
    task: str = ""
    action: Any = None  # [T, raw_action_dim] chunk, forward_dynamics only (normalised model space)
    domain: str | int = "droid_lerobot"
    raw_action_dim: int | None = None
    chunk: int = 32
    cond_frame_indexes: Sequence[int] | None = None  # clean latent frames; default [0] (all for inverse dynamics)
    num_inference_steps: int = 4
    guidance_scale: float = 3.0
    flow_shift: float | None = None
    use_karras_sigmas: bool | None = None
    fps: float = 15.0
    seed: int | None = None
    resolution_tier: int = 480
    view_point: str = "ego_view"
    negative_prompt: str | None = None
    # How the released checkpoints were trained beyond diffusers' pipeline (processor.py, presets.py). None means
    # unset: a preset ("droid_robolab", "diffusers") fills it, else diffusers' behaviour (presets.UNSET_DEFAULTS).
    preset: str | None = None
    prompt_format: str | None = None  # "json" (default) | "plain" | "auto" (from the transformer's hidden_act, PR49)
    use_system_prompt: bool | None = None  # None: on for JSON (diffusers), off for plain (PR49)
    additional_view_description: str | None = None  # appended to the viewpoint sentence (e.g. the camera layout)
    canvas: str | None = None  # "diffusers" (default) | "native": no snap to a multiple of 16 first (PR49)
    observation_adapter: str | None = None  # e.g. "robolab_composite": dict of cameras -> one image
    action_history: Any = None  # [>= action_history_length, raw_action_dim] proprio state rows, oldest first
    action_history_length: int | None = None  # state rows prepended as clean action rows, dropped from the result
    flip_gripper: bool | None = None  # g -> 1 - g on the last action channel, in (history, actions) and out
    use_native_flow_schedule: bool | None = None  # native cosmos' linear sigma grid (sampling.make_schedule)
    # [C, K, h, w] normalised latents (as ``Cosmos3Result.video_latents`` holds them) that condition the chunk instead
    # of ``observation``: the clean latent frames 0..K-1 (forward_dynamics and policy; see ``Cosmos3Engine.step``).
    context_latents: Any = None
    # Noise on the clean context frames (forward_dynamics and policy): a flow sigma in [0, 1) that puts
    # (1 - sigma) * x0 + sigma * noise in their place and gives their tokens that level's timestep embedding, as a model
    # trained with context noise saw its context (WorldModelTrainConfig.context_noise_max; Diffusion Forcing feeds its
    # own frames back at a small level). 0: clean, exactly as without it.
    context_noise: float = 0.0


# Deprecated keyword -> its current name on Cosmos3Request (kept for one release).
_REQUEST_ALIASES = {"num_steps": "num_inference_steps", "actions": "action"}


def _accept_deprecated_names(dataclass_init):
    """Wrap ``Cosmos3Request.__init__`` so that the ``_REQUEST_ALIASES`` keywords still work, with a warning."""

    @functools.wraps(dataclass_init)
    def __init__(self, *args, **kwargs):
        for old, new in _REQUEST_ALIASES.items():
            if old not in kwargs:
                continue
            value = kwargs.pop(old)
            warnings.warn(f"Cosmos3Request({old}=) is deprecated; use {new}=", DeprecationWarning, stacklevel=2)
            if new in kwargs and not _same(kwargs[new], value):
                raise InputError(f"{old}: contradicts {new}={kwargs[new]!r}; give one or the other")
            kwargs[new] = value
        dataclass_init(self, *args, **kwargs)

    return __init__


def _same(a, b) -> bool:
    return a is b or (np.shape(a) == np.shape(b) and bool(np.all(np.asarray(a) == np.asarray(b))))


def _deprecated_alias(old: str, new: str) -> property:
    def get(self):
        warnings.warn(f"Cosmos3Request.{old} is deprecated; use {new}", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated name of ``{new}``.")


# setattr: mypy rejects assigning to a method (method-assign); this patch is deliberate
setattr(Cosmos3Request, "__init__", _accept_deprecated_names(Cosmos3Request.__init__))  # noqa: B010
for _old, _new in _REQUEST_ALIASES.items():
    setattr(Cosmos3Request, _old, _deprecated_alias(_old, _new))


@dataclass
class Cosmos3Result:
    mode: str
    action: np.ndarray  # [chunk, raw_action_dim] float32 (the given actions for forward_dynamics)
    video_latents: torch.Tensor  # [C, t, h, w] float32, normalised latent space
    pixels: torch.Tensor | None  # [3, T, H, W] float32 in [0, 1] when decoded
    seed: int
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Prepared:
    """A validated request turned into tensors, ready to be batched."""

    request: Cosmos3Request
    seed: int
    domain_id: int
    raw_action_dim: int
    cond_ids: list[int]
    uncond_ids: list[int]
    clean_frames: list[int]
    clean_rows: list[int]
    pixels: torch.Tensor | None  # [1, 3, n_clean_pixel_frames, H, W] in [-1, 1], until encoded
    x0_actions: torch.Tensor  # [chunk, action_dim]
    latent_thw: tuple[int, int, int]
    schedule: Any
    x0_video: torch.Tensor | None = None  # [1, C, n_clean_encoded, h, w], set by _encode_conditions (or the context)
    history_rows: int = 0  # clean state rows before the chunk (x0_actions has chunk + history_rows rows)
    # The first latent frame to decode: 0, or K - 1 with a context of K latent frames, so that the pixels are the
    # chunk's frames after the last context frame's re-render, as without a context.
    decode_start: int = 0
    # The time index of the first action row (gen_layout): 1 in diffusers, 1 - history with state rows before the
    # chunk, and temporal_compression * (K - 1) later with K context frames, so that every action row keeps its place
    # next to the frame it leads to (the current frame is context frame K - 1; training shifts it the same way,
    # FlowMatchingObjective).
    action_start_offset: int = 1

    @property
    def action_rows(self) -> int:
        return self.request.chunk + self.history_rows

    @property
    def group_key(self):
        return (self.latent_thw, self.action_rows, self.request.num_inference_steps, self.decode_start)


class Cosmos3Engine:
    """Cosmos3 policy-checkpoint inference in one process (CPU or one GPU)."""

    preset: str | None = None  # applied to requests without their own (presets.py); set by from_pretrained

    def __init__(
        self,
        transformer: Cosmos3Transformer,
        vae: Cosmos3VAE,
        tokenizer,
        scheduler_config: dict,
        *,
        decode_video: bool = True,
        progress: bool = True,
        text_cache_size: int = 256,
        parallel: ParallelContext | None = None,
        owns_process_group: bool = False,
        light_decoder: LightDecoder | None = None,
    ):
        """``transformer`` must already be sharded for ``parallel``'s tp group (``apply_tensor_parallel``).
        ``light_decoder``: decodes instead of the VAE (``from_pretrained(decoder="light")``)."""
        self.parallel = parallel or ParallelContext(ParallelConfig(), None, transformer.device)
        if light_decoder is not None:
            check_decoder("light", self.parallel.config)
            _check_light_decoder_fits(light_decoder, vae)
        self._owns_process_group = owns_process_group
        self.transformer = transformer.eval().requires_grad_(False)
        self.vae = vae.eval().requires_grad_(False)
        self.light_decoder = light_decoder.eval().requires_grad_(False) if light_decoder is not None else None
        self.tokenizer = tokenizer
        self.scheduler_config = dict(scheduler_config)
        self.decode_video = decode_video
        self.progress = progress
        self._text_cache: OrderedDict[tuple[int, ...], TextKV] = OrderedDict()
        self._text_cache_size = text_cache_size
        self._prompt_ids: dict[tuple, tuple[list[int], list[int]]] = {}  # see _prompt_token_ids
        self._closed = False
        self._home_device: torch.device | None = None  # set while offloaded
        # once optimize() turns CUDA graphs on
        self._graphed_forward: GraphedGenForward | None = None
        # of vae.encode and light_decoder.decode once optimize() turns stage graphs on
        self._graphed_encode: GraphedFunction | None = None
        self._graphed_light_decode: GraphedFunction | None = None
        self.graph_padding: float | None = DEFAULT_MAX_PADDING  # set_graph_padding
        self._schedules: dict[tuple, Schedule] = {}  # read-only, shared by every request of one setting

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        vae_dtype: torch.dtype | str | None = None,
        decode_video: bool = True,
        progress: bool = True,
        parallel: ParallelConfig | ParallelContext | None = None,
        tp: int | None = None,
        cfg_parallel: int | None = None,
        dp: int | None = None,
        optimize: bool = False,
        cfg: int | None = None,
        precision: str = "bf16",
        preset: str | None = None,
        decoder: str = "vae",
    ) -> Cosmos3Engine:
        """Load a diffusers-layout Cosmos3 checkpoint (local directory or hub id) into this process.

        ``dtype`` is the transformer's (default bf16 on CUDA, fp32 on CPU); the VAE runs in fp32 unless
        ``vae_dtype`` says otherwise (diffusers' docs load AutoencoderKLWan in fp32).

        ``parallel`` (or the shorthands ``tp``/``cfg_parallel``/``dp``) makes this process one rank of an SPMD
        engine of dp*cfg_parallel*tp ranks: inside a process group (torchrun, or ``dist.init_process_group`` already
        called) every rank calls this and gets its shard; ``device`` "cuda" then means this rank's GPU (LOCAL_RANK).
        To start the ranks as worker processes from one process, use ``cosmos3_gym.load_engine``; a multi-rank config
        here outside a process group still does that, with a ``DeprecationWarning`` (for one release).
        ``cfg`` is the deprecated name of ``cfg_parallel``.

        ``optimize`` applies ``optimize()`` (torch.compile, and CUDA graphs on a GPU; worth it on a GPU, where the
        first step of each shape compiles).

        ``precision`` "fp8" runs the GEN tower's GEMMs in FP8 (``quantization.apply_fp8``; Hopper-class GPUs, the
        ``fp8`` extra; under tensor parallelism each rank's shards); "bf16" (default) keeps them in ``dtype``.

        ``preset`` (``presets.PRESETS``, e.g. "droid_robolab") is applied to every request that names none.

        ``decoder`` "light" decodes with the ``LightDecoder`` in the checkpoint's ``light_decoder/`` folder instead
        of the VAE (cheaper, approximate; both ``decode="all"`` and ``"last"``), in ``vae_dtype``. Not with the
        tile-parallel decode: cfg_parallel * tp must be 1 (dp replicas are fine).
        """
        if preset is not None:
            presets.get_preset(preset)  # an unknown name fails before anything loads
        config = resolve_parallel_config(parallel, tp=tp, cfg_parallel=cfg_parallel, dp=dp, cfg=cfg)
        check_precision(precision)
        check_decoder(decoder, config)
        context = parallel if isinstance(parallel, ParallelContext) else None
        launched = in_process_group()
        if context is None and config.world_size > 1 and not launched:
            warnings.warn(
                "Cosmos3Engine.from_pretrained with several ranks outside a process group is deprecated: it builds "
                "in-process engines only from the next release. Use cosmos3_gym.load_engine(path, tp=..., "
                "cfg_parallel=..., dp=...), which starts the worker processes.",
                DeprecationWarning,
                stacklevel=2,
            )
            # Late-bound: the launcher imports this module, and this shim goes away with the deprecation.
            load_engine = importlib.import_module(f"{__package__}.launcher").load_engine
            return load_engine(
                path_or_id,
                parallel=config,
                backend="mp",
                device=device,
                dtype=dtype,
                vae_dtype=vae_dtype,
                decode_video=decode_video,
                progress=progress,
                optimize=optimize,
                precision=precision,
                preset=preset,
                decoder=decoder,
            )
        layout = validate_checkpoint(resolve_checkpoint(path_or_id))
        light_decoder_dir = find_light_decoder(layout.root) if decoder == "light" else None
        # Checked from config.json before any weights are read, on every rank alike.
        check_tensor_parallel(Cosmos3TransformerConfig.from_dict(layout.transformer_config), config.tp)

        launched_world = int(os.environ.get("WORLD_SIZE", "1"))
        if context is None and not dist.is_initialized() and config.world_size not in (1, launched_world):
            raise InputError(
                f"parallel config: dp*cfg_parallel*tp = {config.dp}*{config.cfg_parallel}*{config.tp} = "
                f"{config.world_size} must equal the number of processes torchrun started (WORLD_SIZE={launched_world})"
            )
        owns_process_group = False
        if context is None:
            owns_process_group = not dist.is_initialized() and config.world_size > 1
            if launched and torch.cuda.is_available() and device in (None, "cuda", torch.device("cuda")):
                # "cuda" is this rank's GPU; a single-rank config under torchrun is one independent engine per rank.
                device = None if config.world_size > 1 else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            context = init_parallel(config, device)
        device = context.device
        dtype = resolve_dtype(dtype, default=torch.bfloat16 if device.type == "cuda" else torch.float32)
        vae_dtype = resolve_dtype(vae_dtype, default=torch.float32)
        # Every rank loads the full weights and keeps its 1/tp slice (the rest is freed as the layers are resliced).
        transformer = Cosmos3Transformer.from_pretrained(layout.transformer_dir, device=device, dtype=dtype)
        if not transformer.config.action_gen:
            raise InputError(f"checkpoint {path_or_id}: transformer has action_gen=False; not a Cosmos3 policy model")
        parallelize_transformer(transformer, context)  # tensor parallel; optimize() adds the rest of the plan
        apply_precision(transformer, precision)  # before optimize(): compile and CUDA graphs capture the FP8 GEMMs
        vae = Cosmos3VAE.from_pretrained(layout.vae_dir, device=device, dtype=vae_dtype)
        light_decoder = None
        if light_decoder_dir is not None:
            light_decoder = LightDecoder.from_pretrained(light_decoder_dir, device=device, dtype=vae_dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(layout.text_tokenizer_dir))
        engine = cls(
            transformer,
            vae,
            tokenizer,
            layout.scheduler_config,
            decode_video=decode_video,
            progress=progress,
            parallel=context,
            owns_process_group=owns_process_group,
            light_decoder=light_decoder,
        )
        engine.preset = preset
        return engine.optimize() if optimize else engine

    def optimize(
        self, *, cuda_graphs: bool | None = None, tp_overlap: bool | None = None, stage_graphs: bool | None = None
    ) -> Cosmos3Engine:
        """The fast path measured in benchmarks/gpu_suite.py and benchmarks/parallel_gpu.py: regional
        ``torch.compile`` of the transformer blocks, the VAE decoder's fused RMS-norm + SiLU and, on a CUDA device,
        the GEN forward replayed as CUDA graphs (``cuda_graphs``; default: on when this engine runs on a GPU; under
        tensor parallelism every rank of the tp group captures its forward, all-reduces included, at the same step).

        ``stage_graphs`` (default off, as each graph keeps its stage's activations, for a large VAE at full
        resolution memory taken from the batch; the built-in model's env turns it on): the VAE encode
        of the conditioning frames and the light decoder's decode replayed as CUDA graphs too
        (``cuda_graphs.GraphedFunction``, one graph per batch shape; the encode's batches padded to a kept graph's
        rows as the GEN forward's are). At one env these eager stages are launch-bound (~11 ms of encode and ~2 ms of
        light decode per built-in-model env step on an H200, the GPU idle most of it:
        benchmarks/RESULTS.md, the env profile); graphed, one env of the built-in model steps in 41 instead of 50
        ms, 8.7 instead of 21.5 ms with ``decoder="light"``, with the same observations
        (benchmarks/RESULTS.md, the stage graphs). ``use_stage_graphs(on)`` turns them on or off on an
        optimised engine.

        ``tp_overlap`` (tp > 1; default: on a GPU): the GEN layers' all-reduces overlap the next row block's compute
        (``parallel.overlap``), on PyTorch's symmetric-memory all-reduce where the tp group is on one GPU host; with
        ``precision="fp8"`` the all-reduces stay NCCL and the blocks compile whole. ``parallel/plan.py`` applies all of
        it to the transformer.

        The same math up to float rounding; each new input shape pays a compile and a capture on its first step
        (about 5-11 s at the full Nano size on an H200). Calling it again changes nothing."""
        use_graphs = cuda_graphs
        if use_graphs is None:
            use_graphs = self.device.type == "cuda"
        if use_graphs and self.device.type != "cuda":
            raise InputError(f"cuda_graphs: needs a CUDA device; this engine runs on {self.device}")
        use_stage_graphs = bool(stage_graphs)
        if use_stage_graphs and self.device.type != "cuda":  # before anything changes
            raise InputError(f"stage_graphs: needs a CUDA device; this engine runs on {self.device}")
        overlap = self.device.type == "cuda" if tp_overlap is None else tp_overlap
        self._graphed_forward = parallelize_transformer(
            self.transformer,
            self.parallel,
            compile=True,
            tp_overlap=overlap,
            cuda_graphs=use_graphs,
            graphed_forward=self._graphed_forward,
        )
        if self._graphed_forward is not None:
            self._graphed_forward.max_padding = self.graph_padding
        self.vae.fuse_decoder_norms()
        if self.light_decoder is not None:  # channels-last convolutions (the engine's light decoder: bf16 on a GPU)
            self.light_decoder.use_channels_last()
        return self.use_stage_graphs(use_stage_graphs)

    def use_stage_graphs(self, on: bool = True) -> Cosmos3Engine:
        """``optimize``'s ``stage_graphs`` alone: turn the CUDA-graphed VAE encode and light decode on or off (off
        drops their graphs) and leave the rest as it is; for an A/B of them on one optimised engine."""
        if on and self.device.type != "cuda":
            raise InputError(f"stage_graphs: needs a CUDA device; this engine runs on {self.device}")
        # Captured lazily, at each shape's first call: whatever optimizes the modules after optimize() (the built-in
        # model's env
        # env's vae.optimize() swaps the encoder's convolution classes) is in place by then. The graphs call the
        # modules through these bound methods, so they follow a later module change only after reset().
        if not on:
            self._graphed_encode = self._graphed_light_decode = None
            return self
        if self._graphed_encode is None:
            self._graphed_encode = GraphedFunction(
                self.vae.encode, self.device, max_graphs=8, name="stage_graphs", max_padding=self.graph_padding
            )
        if self.light_decoder is not None and self._graphed_light_decode is None:
            self._graphed_light_decode = GraphedFunction(
                self.light_decoder.decode,
                self.device,
                max_graphs=8,
                name="stage_graphs",
                max_padding=self.graph_padding,
            )
        return self

    def set_graph_padding(self, max_padding: float | None) -> Cosmos3Engine:
        """How far a batch is padded to replay a CUDA graph already captured instead of capturing one for its size
        (``cuda_graphs.graph_rows``): at most ``max_padding`` times its rows (default 2), or, with None, up to any
        kept graph, so that no batch up to the largest one seen compiles or captures again and memory stays flat
        (what a vector env that owns its engine wants: its first step is its largest batch). Applies to the GEN
        forward's, the encode's and the light decode's graphs, now and later."""
        self.graph_padding = check_max_padding(max_padding)
        for graphed in (self._graphed_forward, self._graphed_encode, self._graphed_light_decode):
            if graphed is not None:
                graphed.max_padding = self.graph_padding
        return self

    @property
    def stage_graphs(self) -> bool:
        """Whether the VAE encode (and the light decoder's decode) replay as CUDA graphs (``optimize``)."""
        return self._graphed_encode is not None

    @property
    def decoder(self) -> str:
        """What decodes the pixels: "vae" or "light" (``DECODERS``)."""
        return "vae" if self.light_decoder is None else "light"

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def gen_forward(self):
        """What the denoising loop calls for one GEN forward: the transformer, or its CUDA-graphed replay."""
        return self._graphed_forward or self.transformer

    @property
    def is_output_rank(self) -> bool:
        """True on the one process that should write files (global rank 0; always True in a single process)."""
        return self.parallel.is_output_rank

    # ------------------------------------------------------------------ public API

    def step(
        self,
        requests: Cosmos3Request | Sequence[Cosmos3Request],
        *,
        decode: bool | None = None,
        pixels_on_device: bool = False,
        latents_on_device: bool = False,
    ):
        """Run one request (returns a ``Cosmos3Result``) or a list (returns a list, in order).

        ``decode``: True or "all" (every frame), "last" (only the last frame, ``pixels [3, 1, H, W]``: the same values
        for less work, see ``Cosmos3VAE.decode``), False (latents only); None: the engine's ``decode_video``.
        ``pixels_on_device``: the results' ``pixels`` stay on the engine's device (rows of one batch tensor, in the
        VAE's output dtype) instead of float32 host copies, for a caller that works on them there (the vector env
        scores and converts every slot's frames on the device and copies them to the host once).
        ``latents_on_device``: the same for ``video_latents`` (float32 rows of one batch tensor), for a caller that
        hands over in latent space on the device or does not read them (a vector env handing over in pixels).

        Latent context: a forward_dynamics or policy request with ``context_latents`` ``[C, K, h, w]`` (normalised
        latents, e.g. the last K frames of earlier results' ``video_latents``, or ``encode_frames`` of a start frame
        repeated) continues from those K clean latent frames instead of encoding an ``observation`` (which may be None
        and is not used): ``video_latents`` has ``K + chunk / temporal_compression`` frames, the first K the context,
        and ``pixels`` decode from the last context frame on, so they are ``[3, chunk + 1, H, W]`` as without a
        context (frame 0 re-renders the last context frame). The chunk must be a multiple of the temporal
        compression, and the canvas is the one of frames ``16h x 16w`` (where ``encode_frames`` of such frames puts
        them). The prompt and the noise are drawn as for an observation request.

        SPMD: every rank must call this with the same requests; every rank returns the same results.
        """
        if self._closed:
            raise RuntimeError("Cosmos3Engine is closed")
        self.onload()  # after offload(): back to the device first
        single = isinstance(requests, Cosmos3Request)
        batch = [requests] if isinstance(requests, Cosmos3Request) else list(requests)
        if not batch:
            raise InputError("requests: expected at least one Cosmos3Request")
        decode = self.decode_video if decode is None else decode
        frames = _decode_frames(decode)  # a bad value fails before the denoising
        if self.parallel.config.dp > 1:  # results travel between replicas as objects: host tensors only
            pixels_on_device = latents_on_device = False
        with torch.inference_mode():
            batch = agree_on_seeds(batch, self.parallel)
            prepared = run_on_every_rank(
                lambda: self._prepare_batch([batch[i] for i in dp_share(len(batch), self.parallel)]), self.parallel
            )
            local_results: list[Cosmos3Result | None] = [None] * len(prepared)
            groups: dict[Any, list[int]] = {}
            for i, p in enumerate(prepared):
                groups.setdefault(p.group_key, []).append(i)
            for indexes in groups.values():
                denoised = self._denoise([prepared[i] for i in indexes], frames, pixels_on_device, latents_on_device)
                for i, result in zip(indexes, denoised):
                    local_results[i] = result
            results = gather_dp_results(local_results, len(batch), self.parallel)
        return results[0] if single else results

    def encode_frames(
        self, frames: Any, *, resolution_tier: int = 480, canvas: str | None = None, preset: str | None = None
    ) -> torch.Tensor:
        """Latents ``[N, C, 1, h, w]`` (float32, normalised, on the engine's device) of frames uint8 ``[N, H, W, 3]``
        (numpy or a tensor), each encoded exactly as a request's ``observation`` with the same ``resolution_tier``,
        ``canvas`` and ``preset`` (the engine's, where None) is: the same canvas, encode and crop, so that
        ``context_latents=latents[i].expand(-1, K, -1, -1)`` starts a latent context where such a request starts.
        Encoded in batches, not one by one. SPMD: every rank computes the same latents, without collectives."""
        if self._closed:
            raise RuntimeError("Cosmos3Engine is closed")
        if isinstance(frames, torch.Tensor):
            frames = frames.detach().cpu().numpy()
        if not isinstance(frames, np.ndarray):
            raise InputError(f"frames: expected uint8 frames [N, H, W, 3], got {type(frames).__name__}")
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] < 1 or frames.shape[-1] != 3:
            raise InputError(f"frames: expected uint8 frames [N, H, W, 3], got dtype {frames.dtype}, {frames.shape}")
        # resolved as a request's settings are (its preset may set the tier and canvas)
        settings = Cosmos3Request(
            mode="forward_dynamics", observation=None, resolution_tier=resolution_tier, canvas=canvas, preset=preset
        )
        r = presets.resolve_request(settings, self.preset)
        self.onload()
        with torch.inference_mode():
            conditioned = [
                self._observation_conditioning(frame, r.resolution_tier, r.canvas, 1, defer_uint8_frames=True)
                for frame in frames
            ]
            on_canvas = iter(self._frames_to_canvas([deferred for _, deferred, _ in conditioned if deferred]))
            clips = [pixels if pixels is not None else next(on_canvas) for pixels, _, _ in conditioned]
            h, w = conditioned[0][2].latent_hw  # one frame size, one layout
            return torch.stack(self._encode_clips(clips))[..., :h, :w]

    def decode_latents(self, latents: torch.Tensor, *, frames: str = "all") -> torch.Tensor:
        """Normalised latents ``[N, C, t, h, w]`` -> pixels ``[N, 3, 1 + temporal_compression * (t - 1), 16h, 16w]``
        float32 in [0, 1] on the engine's device, with the engine's decoder (the VAE or the light decoder), as
        ``step`` decodes; latent frame 0 decodes to one frame (a latent context's last frame alone: its
        re-render). ``frames="last"``: the last frame only. SPMD: every rank must call it (the decode may be split
        over them)."""
        if self._closed:
            raise RuntimeError("Cosmos3Engine is closed")
        if frames not in ("all", "last"):
            raise InputError(f"frames: expected 'all' or 'last', got {frames!r}")
        if not isinstance(latents, torch.Tensor):
            raise InputError(f"latents: expected a tensor [N, C, t, h, w], got {type(latents).__name__}")
        self.onload()
        with torch.inference_mode():
            return self._decode(latents.to(self.device, torch.float32), frames).float()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def action_dim(self) -> int:
        """The model's padded action width (64 for Cosmos3); raw action widths must not exceed it."""
        action_dim = self.transformer.config.action_dim
        assert action_dim is not None  # an action_gen checkpoint (from_pretrained checks; its config validates)
        return action_dim

    @property
    def temporal_compression(self) -> int:
        return self.vae.temporal_compression

    def clear_text_cache(self) -> None:
        self._text_cache.clear()

    def offload(self) -> None:
        """Move the model to host memory between rollouts (frees the GPU for a policy update); ``onload`` or the next
        ``step`` undoes it. Under tensor parallelism every rank of the engine must call it (the client and the
        torchrun SPMD loop do)."""
        if self._home_device is None:
            self._home_device = self.device
        self.transformer.to("cpu")
        self.vae.to("cpu")
        if self.light_decoder is not None:
            self.light_decoder.to("cpu")
        for graphed in (self._graphed_forward, self._graphed_encode, self._graphed_light_decode):
            if graphed is not None:
                graphed.reset()  # its graphs read the weights at their device addresses, which are gone
        tp_group = self.parallel.group("tp")
        if tp_group is not None:
            # Only now that no graph holds them: the symmetric all-reduce buffers (re-made on the next forward).
            release_symmetric_buffers(tp_group.group_name)
        self._text_cache.clear()  # cached K/V live on the device; they are recomputed on demand
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Move the model back to its device after ``offload`` (nothing to do otherwise)."""
        if self._home_device is not None:
            self.transformer.to(self._home_device)
            self.vae.to(self._home_device)
            if self.light_decoder is not None:
                self.light_decoder.to(self._home_device)
            self._home_device = None

    def close(self) -> None:
        """Release the model (idempotent); also ends the process group if ``from_pretrained`` started it."""
        if not self._closed:
            self._text_cache.clear()
            self.use_stage_graphs(False)  # their graphs' memory pools
            self._closed = True
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()

    def text_kv(self, input_ids: list[int]) -> TextKV:
        """The UND K/V of one prompt, from the cache or computed now (and cached). Under tensor parallel it is this
        rank's KV-head shard, and every rank of the tp group must call this with the same prompts in order."""
        return self.text_kvs([input_ids])[0]

    def text_kvs(self, prompts: list[list[int]]) -> list[TextKV]:
        """``text_kv`` of several prompts; the ones not cached go through the UND tower together in one padded
        batch (a request's conditional and unconditional prompts: one forward instead of two)."""
        # One key per distinct list object (a vector env's slots share their prompt lists, ``_prepare_like``):
        # making and hashing a tuple of a few hundred ids for every slot was ~4 ms of a 256-slot step. The lists are
        # held by ``prompts`` during the call, so their ids stay theirs. Re-inserted on each use, ``keys`` ends in the
        # order of last use: the LRU order that moving every prompt's key to the end in turn gives.
        keys: dict[int, tuple[int, ...]] = {}
        for ids in prompts:
            keys[id(ids)] = keys.pop(id(ids)) if id(ids) in keys else tuple(ids)
        missing = list(dict.fromkeys(key for key in keys.values() if key not in self._text_cache))
        if missing:
            batch = self.transformer.encode_text([list(key) for key in missing])
            for index, key in enumerate(missing):
                self._text_cache[key] = batch.select(index)
        for key in keys.values():
            self._text_cache.move_to_end(key)
        by_list = {list_id: self._text_cache[key] for list_id, key in keys.items()}
        found = [by_list[id(ids)] for ids in prompts]
        while len(self._text_cache) > self._text_cache_size:
            self._text_cache.popitem(last=False)
        return found

    # ------------------------------------------------------------------ preprocessing

    def prepare(self, request: Cosmos3Request, *, encode: bool = True) -> _Prepared:
        """Validate a request and build its conditioning: prompts, clean latents, clean actions, schedule.
        With ``encode=False`` the clean pixels are kept for a later batched ``_encode_conditions``."""
        prepared, _ = self._prepare(request, defer_uint8_frames=False)
        if encode:
            self._encode_conditions([prepared])
        return prepared

    def _prepare(self, request: Cosmos3Request, defer_uint8_frames: bool) -> tuple[_Prepared, tuple | None]:
        """``prepare`` without the encode. With ``defer_uint8_frames``, an observation that
        ``processor.prepare_uint8_conditioning`` takes is not put on the canvas (``pixels`` stays None): it comes
        back as ``(observation, canvas layout, pixel frames to encode)`` for ``_prepare_batch`` to do them at once."""
        if not isinstance(request, Cosmos3Request):
            raise InputError(f"requests: expected Cosmos3Request, got {type(request).__name__}")
        r = presets.resolve_request(request, self.preset)
        if r.mode not in MODES:
            raise InputError(f"mode: expected one of {list(MODES)}, got {r.mode!r}")
        if not isinstance(r.chunk, int) or r.chunk < 1:
            raise InputError(f"chunk: expected an integer >= 1, got {r.chunk!r}")
        if not isinstance(r.num_inference_steps, int) or r.num_inference_steps < 1:
            raise InputError(f"num_inference_steps: expected an integer >= 1, got {r.num_inference_steps!r}")
        if not np.isfinite(r.guidance_scale) or r.guidance_scale < 0:
            raise InputError(f"guidance_scale: expected a finite number >= 0, got {r.guidance_scale!r}")
        if not np.isfinite(r.fps) or r.fps <= 0:
            raise InputError(f"fps: expected a positive number, got {r.fps!r}")
        if r.flow_shift is not None and (not np.isfinite(r.flow_shift) or r.flow_shift <= 0):
            raise InputError(f"flow_shift: expected a positive number, got {r.flow_shift!r}")
        is_level = isinstance(r.context_noise, (int, float, np.floating)) and not isinstance(r.context_noise, bool)
        if not is_level or not 0.0 <= r.context_noise < 1.0:  # NaN fails the range too
            raise InputError(f"context_noise: expected a noise level in [0, 1), got {r.context_noise!r}")
        if r.context_noise > 0 and r.mode not in CONTEXT_MODES:
            raise InputError(
                f"context_noise: only modes {list(CONTEXT_MODES)} have context frames to noise, got mode {r.mode!r}"
            )
        for name in ("flip_gripper", "use_native_flow_schedule"):
            if not isinstance(getattr(r, name), bool):
                raise InputError(f"{name}: expected True or False, got {getattr(r, name)!r}")
        if r.mode == "forward_dynamics" and r.action is None:
            raise InputError("action: mode 'forward_dynamics' needs an action chunk [T, raw_action_dim]")
        action_dim = self.action_dim
        domain_id, raw_dim = processor.resolve_domain(r.domain, r.raw_action_dim, action_dim=action_dim)

        num_frames = r.chunk + 1
        temporal = self.vae.temporal_compression
        x0_video: torch.Tensor | None = None
        layout: processor.CanvasLayout | processor.Conditioning
        if r.context_latents is not None:
            x0_video, layout = self._context_conditioning(r)
            context_frames = x0_video.shape[2]
            latent_t = context_frames + r.chunk // temporal
            clean_frames = list(range(context_frames))
            pixels, deferred = None, None
        else:
            latent_t = (num_frames - 1) // temporal + 1
            clean_frames = self._clean_frames(r, latent_t)
            observation = presets.adapt_observation(r.observation, r.observation_adapter)
            # The VAE is causal in time: latent frames 0..k depend only on pixel frames 0..4k, so encoding just the
            # pixel frames that feed clean latents gives the same latents as encoding the whole clip.
            encoded_pixel_frames = (max(clean_frames) * temporal + 1) if clean_frames else 1
            pixels, deferred, layout = self._observation_conditioning(
                observation, r.resolution_tier, r.canvas, encoded_pixel_frames, defer_uint8_frames
            )
        canvas_h, canvas_w = layout.canvas_hw
        h, w = layout.latent_hw

        x0_actions, clean_rows = processor.prepare_action_rows(
            r.mode,
            r.chunk,
            raw_dim,
            action_dim,
            actions=r.action,
            history=r.action_history,
            history_length=r.action_history_length,
            flip=r.flip_gripper,
        )

        cond_ids, uncond_ids = self._prompt_token_ids(r, num_frames, canvas_h, canvas_w)
        schedule = self._schedule(r.num_inference_steps, r.flow_shift, r.use_karras_sigmas, r.use_native_flow_schedule)
        seed = r.seed if r.seed is not None else secrets.randbelow(2**63)
        prepared = _Prepared(
            r,
            seed,
            domain_id,
            raw_dim,
            cond_ids,
            uncond_ids,
            clean_frames,
            clean_rows,
            pixels,
            x0_actions,
            (latent_t, h, w),
            schedule,
            x0_video=x0_video,
            history_rows=r.action_history_length,
            decode_start=0 if x0_video is None else x0_video.shape[2] - 1,
            action_start_offset=1
            - r.action_history_length
            + (0 if x0_video is None else temporal * (x0_video.shape[2] - 1)),
        )
        return prepared, deferred

    @staticmethod
    def _observation_conditioning(
        observation: Any, resolution_tier: int, canvas: str | None, num_frames: int, defer_uint8_frames: bool
    ) -> tuple[torch.Tensor | None, tuple | None, processor.CanvasLayout | processor.Conditioning]:
        """An observation's first ``num_frames`` frames on the canvas: ``(pixels [1, 3, num_frames, *canvas_hw],
        None, layout)``; with ``defer_uint8_frames`` and an observation that ``processor.prepare_uint8_conditioning``
        takes, ``(None, (observation, layout, num_frames), layout)`` for ``_frames_to_canvas`` to do with others."""
        assert canvas is not None  # a resolved request (presets.resolve_request fills it)
        layout = None
        if defer_uint8_frames:
            layout = processor.uint8_layout(observation, resolution_tier, num_frames, canvas)
        if layout is None:
            frames = processor.load_frames(observation)
            cond = processor.prepare_conditioning(frames, resolution_tier, num_frames, canvas=canvas)
            return cond.pixels, None, cond  # a Conditioning has the layout's sizes too
        return None, (observation, layout, num_frames), layout

    def _context_conditioning(self, r: Cosmos3Request) -> tuple[torch.Tensor, processor.CanvasLayout]:
        """A request's checked ``context_latents`` as clean latents ``[1, C, K, h, w]`` float32 on the device, and the
        canvas of the frames they stand for (``16h x 16w``: the frames whose latents fill ``h x w``)."""
        if r.mode not in CONTEXT_MODES:
            raise InputError(
                f"context_latents: only modes {list(CONTEXT_MODES)} continue from a latent context, got mode {r.mode!r}"
            )
        if r.cond_frame_indexes is not None:
            raise InputError("cond_frame_indexes: not with context_latents, whose K latent frames are the clean ones")
        temporal = self.vae.temporal_compression
        if r.chunk % temporal:
            raise InputError(
                f"context_latents: the chunk continues a latent context in whole latent frames, so it must be a "
                f"multiple of the VAE's temporal compression ({temporal}), got chunk {r.chunk}"
            )
        context, channels = r.context_latents, self.transformer.config.latent_channel
        if not (isinstance(context, torch.Tensor) and context.is_floating_point() and context.ndim == 4):
            got = f"shape {list(context.shape)}, dtype {context.dtype}" if isinstance(context, torch.Tensor) else None
            raise InputError(
                f"context_latents: expected a float tensor [{channels}, K, h, w], got {got or type(context).__name__}"
            )
        if context.shape[0] != channels or context.shape[1] < 1:
            raise InputError(
                f"context_latents: expected [{channels}, K, h, w] with K >= 1 (the model's {channels} latent "
                f"channels), got {list(context.shape)}"
            )
        if r.resolution_tier not in processor.RESOLUTION_TIERS:
            raise InputError(
                f"resolution_tier: got {r.resolution_tier!r}; expected one of {list(processor.RESOLUTION_TIERS)}."
            )
        if r.canvas not in processor.CANVAS_MODES:
            raise InputError(f"canvas: got {r.canvas!r}; expected one of {list(processor.CANVAS_MODES)}.")
        h, w = context.shape[2:]
        frame_hw = (h * processor.VAE_SPATIAL_FACTOR, w * processor.VAE_SPATIAL_FACTOR)
        layout = processor.canvas_layout(frame_hw, r.resolution_tier)
        if layout.latent_hw != (h, w):
            expected_h, expected_w = layout.latent_hw
            raise InputError(
                f"context_latents: {h}x{w} latents stand for {frame_hw[0]}x{frame_hw[1]} frames, which resolution_tier "
                f"{r.resolution_tier}'s {layout.canvas_hw[0]}x{layout.canvas_hw[1]} canvas shrinks; expected a tensor "
                f"[{channels}, {context.shape[1]}, {expected_h}, {expected_w}] (encode_frames of such frames)"
            )
        return context.to(self.device, torch.float32)[None], layout

    def _prompt_token_ids(self, r: Cosmos3Request, num_frames: int, height: int, width: int):
        """``processor.build_prompt_token_ids``, cached per prompt setting: the tokenizer's chat template (Jinja)
        costs milliseconds per call, which a vector env paid for every slot at every step. Bounded like the text
        cache; the cached lists are never mutated."""
        assert r.prompt_format is not None  # a resolved request (presets.resolve_request fills it)
        prompt_format = processor.resolve_prompt_format(r.prompt_format, self.transformer.config.hidden_act)
        key = (
            r.task,
            r.negative_prompt,
            r.view_point,
            num_frames,
            r.fps,
            height,
            width,
            prompt_format,
            r.use_system_prompt,
            r.additional_view_description,
        )
        cache_key: tuple | None = key
        try:
            ids = self._prompt_ids.get(key)
        except TypeError:  # an unhashable (hence invalid) field: let the builder name it
            cache_key, ids = None, None
        if ids is None:
            ids = processor.build_prompt_token_ids(
                self.tokenizer,
                r.task,
                negative_prompt=r.negative_prompt,
                view_point=r.view_point,
                num_frames=num_frames,
                fps=r.fps,
                height=height,
                width=width,
                prompt_format=prompt_format,
                use_system_prompt=r.use_system_prompt,
                additional_view_description=r.additional_view_description,
            )
            if cache_key is not None:
                if len(self._prompt_ids) >= self._text_cache_size:
                    self._prompt_ids.clear()
                self._prompt_ids[cache_key] = ids
        return ids

    def _encode_conditions(self, prepared: list[_Prepared], max_batch: int = 64) -> None:
        """VAE-encode the clean conditioning pixels of the requests that have no clean latents yet (a context is
        one), batched (``_encode_clips``); crops to the content latent."""
        waiting = [p for p in prepared if p.x0_video is None]
        clips = []
        for p in waiting:
            assert p.pixels is not None  # a request's pixels wait here for their encode
            clips.append(p.pixels)
        for p, latent in zip(waiting, self._encode_clips(clips, max_batch)):
            _, h, w = p.latent_thw
            p.x0_video = latent[None, :, :, :h, :w]
            p.pixels = None

    def _encode_clips(self, clips: list[torch.Tensor], max_batch: int = 64) -> list[torch.Tensor]:
        """The latents ``[C, t, H / 16, W / 16]`` of pixel clips ``[1, 3, T, H, W]``, in order; clips of one shape are
        encoded together, ``max_batch`` at a time (one encoder pass for all the slots of a vector env instead of one
        per slot)."""
        by_shape: dict[tuple, list[int]] = {}
        for i, clip in enumerate(clips):
            by_shape.setdefault(tuple(clip.shape), []).append(i)
        latents: list[torch.Tensor] = [torch.empty(0)] * len(clips)
        for indexes in by_shape.values():
            for start in range(0, len(indexes), max_batch):
                part = indexes[start : start + max_batch]
                for i, latent in zip(part, self._encode(torch.cat([clips[i] for i in part]).to(self.device))):
                    latents[i] = latent
        return latents

    def _frames_to_canvas(self, deferred: list[tuple]) -> list[torch.Tensor]:
        """The pixels ``[1, 3, T, *canvas_hw]`` of observations that ``_observation_conditioning`` deferred, in order:
        those of one shape and layout are put on the canvas together, on the device
        (``processor.prepare_uint8_conditioning``)."""
        by_shape: dict[tuple, list[int]] = {}
        for i, (observation, layout, num_frames) in enumerate(deferred):
            by_shape.setdefault((observation.shape, layout, num_frames), []).append(i)
        pixels: list[torch.Tensor] = [torch.empty(0)] * len(deferred)
        for (_, layout, num_frames), indexes in by_shape.items():
            observations = [deferred[i][0] for i in indexes]
            clips = processor.prepare_uint8_conditioning(observations, layout, num_frames, device=self.device)
            for i, clip in zip(indexes, clips):
                pixels[i] = clip
        return pixels

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """``vae.encode``, or its CUDA-graphed replay (``optimize(stage_graphs=True)``) with the rows padded to a kept
        graph's or a bucket (``cuda_graphs.graph_rows``; the encoder treats each sample on its own, so padding rows
        change nothing in the others)."""
        if self._graphed_encode is None:
            return self.vae.encode(pixels)
        return replay_padded(self._graphed_encode, pixels)

    def _schedule(
        self, num_steps: int, flow_shift: float | None, use_karras_sigmas: bool | None, native: bool = False
    ) -> Schedule:
        """``make_schedule`` once per setting (it costs ~3 ms of host time, diffusers' config parsing included)."""
        key = (num_steps, flow_shift, use_karras_sigmas, bool(native))
        if key not in self._schedules:
            if len(self._schedules) >= 64:
                self._schedules.clear()
            self._schedules[key] = make_schedule(
                num_steps,
                self.scheduler_config,
                flow_shift=flow_shift,
                use_karras_sigmas=use_karras_sigmas,
                use_native_flow_schedule=bool(native),
            )
        return self._schedules[key]

    @staticmethod
    def _clean_frames(r: Cosmos3Request, latent_t: int) -> list[int]:
        if r.cond_frame_indexes is None:
            return list(range(latent_t)) if r.mode == "inverse_dynamics" else [0]
        indexes = sorted(set(int(i) for i in r.cond_frame_indexes))
        if not indexes or indexes[0] < 0 or indexes[-1] >= latent_t:
            raise InputError(
                f"cond_frame_indexes: expected latent frame indexes in [0, {latent_t}) for chunk {r.chunk}, "
                f"got {list(r.cond_frame_indexes)}"
            )
        return indexes

    def initial_noise(self, p: _Prepared) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Seeded noise drawn exactly as ``Cosmos3OmniPipeline.prepare_latents``: one CPU generator, the video
        noise [1, C, t, h, w] first, then the action noise [chunk, action_dim], both float32; then, for a request
        with ``context_noise``, the context's noise [1, C, t, h, w] (read on its clean frames), else None."""
        generator = torch.Generator("cpu").manual_seed(p.seed)
        c = self.transformer.config.latent_channel
        video_noise = torch.randn((1, c, *p.latent_thw), generator=generator, dtype=torch.float32)
        action_noise = torch.randn((p.action_rows, self.action_dim), generator=generator, dtype=torch.float32)
        context_noise = None
        if p.request.context_noise > 0:  # drawn last: the pipeline's draws above stay the same
            context_noise = torch.randn((1, c, *p.latent_thw), generator=generator, dtype=torch.float32)
        return video_noise, action_noise, context_noise

    def _prepare_batch(self, requests: list) -> list[_Prepared]:
        """``prepare`` each request, then VAE-encode all their conditioning frames in shape-batched passes.

        The same tensors as ``prepare`` one by one; what was the largest host cost of a vector env's step, putting
        every slot's frame on the canvas, is done for all slots with uint8 frames of one shape together, on the
        device (``processor.prepare_uint8_conditioning``)."""
        prepared: list[_Prepared] = []
        waiting: list[tuple[_Prepared, tuple]] = []
        # Requests that differ from an earlier one only in their uint8 frame, actions and seed (a vector env's slots)
        # reuse its validated settings, prompt and schedule (``_prepare_like``): per slot, ``_prepare`` was ~5 ms of
        # host time a 64-slot step.
        leaders: dict[tuple, tuple[_Prepared, tuple]] = {}
        for request in requests:
            key = _template_key(request)
            leader = leaders.get(key) if key is not None else None
            if leader is None:
                p, deferred = self._prepare(request, defer_uint8_frames=True)
                if key is not None and deferred is not None:
                    leaders[key] = (p, deferred)
            else:
                p, deferred = self._prepare_like(*leader, request)
            prepared.append(p)
            if deferred is not None:
                waiting.append((p, deferred))
        for (p, _), clip in zip(waiting, self._frames_to_canvas([deferred for _, deferred in waiting])):
            p.pixels = clip
        self._encode_conditions(prepared)
        return prepared

    def _prepare_like(self, leader: _Prepared, deferred: tuple, request: Cosmos3Request) -> tuple[_Prepared, tuple]:
        """``_prepare(request, defer_uint8_frames=True)`` for a request whose ``_template_key`` equals the one of
        ``leader``'s request: the same settings, a uint8 frame of the same shape. Only what differs is built (its
        action rows, checked as ``_prepare`` checks them, and its seed); the rest is the leader's, the same values."""
        r = copy.copy(leader.request)  # the leader's resolved request with this request's own values
        r.observation, r.action, r.action_history, r.seed = (
            request.observation,
            request.action,
            request.action_history,
            request.seed,
        )
        if r.mode == "forward_dynamics" and r.action is None:
            raise InputError("action: mode 'forward_dynamics' needs an action chunk [T, raw_action_dim]")
        x0_actions, _ = processor.prepare_action_rows(
            r.mode,
            r.chunk,
            leader.raw_action_dim,
            self.action_dim,
            actions=r.action,
            history=r.action_history,
            history_length=leader.history_rows,  # the resolved action_history_length
            flip=bool(r.flip_gripper),
        )
        p = copy.copy(leader)
        p.request, p.x0_actions, p.pixels, p.x0_video = r, x0_actions, None, None
        p.seed = r.seed if r.seed is not None else secrets.randbelow(2**63)
        _, layout, num_frames = deferred
        return p, (r.observation, layout, num_frames)

    # ------------------------------------------------------------------ the batched denoising loop

    def _denoise(
        self,
        group: list[_Prepared],
        frames: str | None,
        pixels_on_device: bool = False,
        latents_on_device: bool = False,
    ) -> list[Cosmos3Result]:
        """Denoise one shape group; ``frames`` is the VAE's (``_decode_frames``), None for latents only."""
        device = self.device
        batch = len(group)
        latent_t, _, _ = group[0].latent_thw
        chunk = group[0].action_rows  # the request's chunk plus its clean state rows

        clean_masks = np.zeros((batch, latent_t + chunk), dtype=np.bool_)  # built in numpy: no torch op per row
        for b, p in enumerate(group):
            clean_masks[b, p.clean_frames] = True
            clean_masks[b, [latent_t + row for row in p.clean_rows]] = True
        video_clean, action_clean = torch.from_numpy(clean_masks).split([latent_t, chunk], dim=1)
        # One seeded generator per request (the pipeline's noise, bit for bit), drawn over the host threads: on one
        # core the draws were ~15 ms of a 256-slot step. The host draws while the GPU still encodes the conditioning
        # frames: nothing here waits for the device (the noise goes up from pinned memory without a sync).
        noises = map_in_threads(self.initial_noise, group, min_per_thread=16)
        action_noise = torch.stack([a_noise for _, a_noise, _ in noises])
        raw_dims = torch.tensor([p.raw_action_dim for p in group])
        action_noise.masked_fill_((torch.arange(self.action_dim) >= raw_dims[:, None])[:, None, :], 0.0)
        video = _to_device(torch.cat([noise for noise, _, _ in noises]), device)
        actions = _to_device(action_noise, device)
        x0_video = torch.zeros(batch, self.transformer.config.latent_channel, *group[0].latent_thw, device=device)
        encoded: list[torch.Tensor] = []
        for p in group:
            assert p.x0_video is not None  # _encode_conditions encoded every request's clean frames
            encoded.append(p.x0_video)
        if len({e.shape for e in encoded}) == 1:  # one copy for the batch, not one per row
            x0_video[:, :, : encoded[0].shape[2]] = torch.cat(encoded)
        else:
            for b, e in enumerate(encoded):
                x0_video[b, :, : e.shape[2]] = e[0]
        x0_actions = _to_device(torch.stack([p.x0_actions for p in group]), device)
        video_clean, action_clean = _to_device(video_clean, device), _to_device(action_clean, device)
        # Context noise (Cosmos3Request.context_noise): the clean frames the model sees are noised x0 (the results
        # keep the clean ones); each row's level goes to the transformer as its context timestep.
        clean_x0_video, context_timesteps = x0_video, None
        levels = [p.request.context_noise for p in group]
        if any(levels):
            sigma = torch.tensor(levels, dtype=torch.float32)
            context_noise = _to_device(torch.cat([n if n is not None else 0 * v for v, _, n in noises]), device)
            level = sigma.to(device).view(-1, 1, 1, 1, 1)
            x0_video = (1.0 - level) * x0_video + level * context_noise
            context_timesteps = _to_device(timesteps_from_sigmas(sigma), device)
        video = torch.where(video_clean[:, None, :, None, None], x0_video, video)
        actions = torch.where(action_clean[..., None], x0_actions, actions)
        raw_dims = raw_dims.to(device)
        action_dim_mask = torch.arange(actions.shape[-1], device=device)[None, None, :] < raw_dims[:, None, None]

        # The rows of the batched pass: the conditional branch of every request, then the unconditional branch of
        # each guided one (guidance 1 skips it, as diffusers does). With cfg=2 each cfg rank group runs half of the
        # rows, so an all-guided batch runs its conditional rows on cfg rank 0 and its unconditional rows on rank 1
        # (each prompt's text K/V only where it is needed), and an unguided batch is split instead of idling a rank.
        guided = [b for b, p in enumerate(group) if p.request.guidance_scale != 1.0]
        branches = [(b, False) for b in range(batch)] + [(b, True) for b in guided]
        cfg_size, cfg_rank = self.parallel.config.cfg_parallel, self.parallel.cfg_rank
        rows_per_cfg_rank = math.ceil(len(branches) / cfg_size)
        local_branches = branches[cfg_rank * rows_per_cfg_rank : (cfg_rank + 1) * rows_per_cfg_rank]
        num_rows = len(local_branches)
        if self._graphed_forward is not None and local_branches:
            # CUDA graphs are kept per input shape: rows padded to a kept graph's size or a bucket let a vector env
            # whose number of stepping slots changes (autoreset) replay the graphs it has instead of capturing more
            # (each holds its own memory: the soak's host and GPU memory grew with every new capture). The padding
            # rows repeat the first row; their outputs are dropped.
            padded = graph_rows(num_rows, self._graphed_forward.row_counts, self._graphed_forward.max_padding)
            local_branches = local_branches + [local_branches[0]] * (padded - num_rows)
        rows = [b for b, _ in local_branches]
        row_index = torch.tensor(rows, dtype=torch.long, device=device)  # built once, not per step
        if rows:
            text = TextKV.stack(
                self.text_kvs([group[b].uncond_ids if uncond else group[b].cond_ids for b, uncond in local_branches])
            )
            fps = [group[b].request.fps for b in rows]
            layout = self.transformer.gen_layout(
                text.lengths,
                group[0].latent_thw,
                chunk,
                fps,
                action_start_offset=[group[b].action_start_offset for b in rows],
            )
            domain_ids = torch.tensor([group[b].domain_id for b in rows], device=device)
            video_noisy, action_noisy = ~video_clean[row_index], ~action_clean[row_index]
        guided_index = torch.tensor(guided, dtype=torch.long, device=device)
        guidance = torch.tensor([group[b].request.guidance_scale for b in guided], device=device)

        video_sampler = FlowUniPCSampler([p.schedule for p in group], device)
        action_sampler = FlowUniPCSampler([p.schedule for p in group], device)
        steps = group[0].request.num_inference_steps
        gen_forward = self.gen_forward
        # Only a batch with context noise passes its timesteps: the plain call keeps the forward's diffusers-shaped
        # signature (a stand-in forward, e.g. a host-only profile's, takes just that).
        context_rows = {} if context_timesteps is None else {"context_timesteps": context_timesteps[row_index]}
        show_progress = self.progress and self.is_output_rank
        for i in tqdm(range(steps), desc="denoising", disable=not show_progress, leave=False):
            timesteps = video_sampler.timesteps_for_step(i)
            if rows:
                v_video, v_action = gen_forward(
                    text,
                    layout,
                    video[row_index],
                    video_noisy,
                    timesteps[row_index],
                    actions[row_index],
                    action_noisy,
                    domain_ids,
                    **context_rows,
                )
                v_video, v_action = v_video[:num_rows], v_action[:num_rows]
            else:  # a single unguided request under cfg=2: cfg rank 1 has no row, it only sends padding
                v_video, v_action = video[:0], actions[:0]
            if cfg_size > 1:
                v_video, v_action = gather_cfg_rows(v_video, v_action, rows_per_cfg_rank, len(branches), self.parallel)
            v_video, v_action = self._combine(v_video, v_action, batch, guided_index, guidance)
            v_action = v_action * action_dim_mask
            video = video_sampler.step(i, v_video, video)
            actions = action_sampler.step(i, v_action, actions) * action_dim_mask
            # Clean frames / rows are re-imposed exactly (diffusers keeps them only up to sampler rounding).
            video = torch.where(video_clean[:, None, :, None, None], x0_video, video)
            actions = torch.where(action_clean[..., None], x0_actions, actions)

        if context_timesteps is not None:
            video = torch.where(video_clean[:, None, :, None, None], clean_x0_video, video)
        # from the last context frame on (decode_start), so the pixels are [3, chunk + 1, H, W] with or without one
        pixels = self._decode(video[:, :, group[0].decode_start :], frames) if frames is not None else None
        # Each tensor comes to the host in one copy, all queued together and waited for once.
        host_actions, host_video, host_pixels = _rows_to_host(
            [actions, None if latents_on_device else video, None if pixels_on_device else pixels]
        )
        assert host_actions is not None  # the rows of a tensor, not of None
        if latents_on_device:
            host_video = list(video)
        if pixels_on_device and pixels is not None:
            host_pixels = list(pixels)
        assert host_video is not None
        results = []
        for b, p in enumerate(group):
            action = host_actions[b][p.history_rows :, : p.raw_action_dim].numpy()  # state rows dropped
            results.append(
                Cosmos3Result(
                    mode=p.request.mode,
                    action=processor.flip_gripper(action) if p.request.flip_gripper else action,
                    video_latents=host_video[b],
                    pixels=host_pixels[b] if host_pixels is not None else None,
                    seed=p.seed,
                )
            )
        return results

    def _decode(self, video: torch.Tensor, frames: str = "all") -> torch.Tensor:
        """VAE decode, split over the cfg*tp ranks of this replica when there are several (all hold the same
        latents); every rank gets the full pixels. ``frames="last"``: only the last frame (``Cosmos3VAE.decode``).
        With a light decoder (``decoder="light"``, one rank per replica) that decodes instead, in this process."""
        if self._graphed_light_decode is not None:  # per-sample too: padded as the encode
            return replay_padded(self._graphed_light_decode, video, frames=frames)
        if self.light_decoder is not None:
            return self.light_decoder.decode(video, frames=frames)
        group = self.parallel.replica_group
        if group is None or dist.get_world_size(group) == 1:
            return self.vae.decode(video, frames=frames)
        from .parallel.vae_decode import decode_tile_parallel

        # exact: halo exchange per convolution and a gathered mid-block attention, so the pixels equal the
        # single-process decode (the feathered-halo approximation is off by up to ~0.2 near the tile seams).
        pixels = decode_tile_parallel(self.vae, video, group, exact=True)
        return pixels[:, :, -1:] if frames == "last" else pixels

    @staticmethod
    def _combine(v_video, v_action, batch, guided_index, guidance):
        """Split the [cond; uncond] rows and apply CFG to the guided requests (``guided_index``: their rows)."""
        cond_video, cond_action = v_video[:batch], v_action[:batch]
        if guided_index.numel() == 0:
            return cond_video, cond_action
        video = cond_video.index_copy(0, guided_index, cfg_combine(cond_video[guided_index], v_video[batch:], guidance))
        action = cond_action.index_copy(
            0, guided_index, cfg_combine(cond_action[guided_index], v_action[batch:], guidance)
        )
        return video, action


# The request fields a vector env's slots differ in; ``_template_key`` is everything else.
_PER_SLOT_FIELDS = frozenset({"observation", "action", "action_history", "seed"})


def _template_key(request: Any) -> tuple | None:
    """What ``_prepare`` reads of a request other than its per-slot values, as a hashable key, for requests whose
    observation is one uint8 frame or clip (what ``_prepare_like`` takes); None for the others (a context, an
    adapter, an unhashable field), which are prepared on their own."""
    if type(request) is not Cosmos3Request or request.context_latents is not None:
        return None
    observation = request.observation
    if request.observation_adapter is not None or not isinstance(observation, np.ndarray):
        return None
    if observation.dtype != np.uint8:
        return None
    names, _ = presets.field_defaults(Cosmos3Request)
    key = (observation.shape, *(getattr(request, name) for name in names if name not in _PER_SLOT_FIELDS))
    try:
        hash(key)
    except TypeError:  # e.g. cond_frame_indexes given as a list
        return None
    return key


def _decode_frames(decode) -> str | None:
    """``step``'s ``decode``: True / "all" (every frame), "last" (the last frame only, ``Cosmos3VAE.decode``'s
    exact shortcut) or False (no decode) -> the VAE's ``frames`` or None."""
    if decode is False:
        return None
    if decode is True or decode == "all":
        return "all"
    if decode == "last":
        return "last"
    raise InputError(f"decode: expected True, False, 'all' or 'last', got {decode!r}")


def check_decoder(decoder, config: ParallelConfig) -> None:
    """``decoder`` is one of ``DECODERS``, and "light" runs in one rank per replica (cfg_parallel * tp == 1)."""
    if decoder not in DECODERS:
        raise InputError(f"decoder: expected one of {list(DECODERS)}, got {decoder!r}")
    if decoder == "light" and config.cfg_parallel * config.tp > 1:
        raise InputError(
            f"decoder: 'light' decodes in one process; with cfg_parallel * tp = {config.cfg_parallel * config.tp} "
            "the decode is tile-parallel over the ranks, which only the VAE does: use decoder='vae'"
        )


def _check_light_decoder_fits(light_decoder: LightDecoder, vae: Cosmos3VAE) -> None:
    """The light decoder reads the VAE's latents and gives its frames: same channels and compressions."""
    for name in ("latent_channels", "spatial_compression", "temporal_compression"):
        if getattr(light_decoder, name) != getattr(vae, name):
            raise CheckpointError(
                f"{LIGHT_DECODER_DIR}/config.json: {name} {getattr(light_decoder, name)} does not match the VAE's "
                f"{getattr(vae, name)}; it was trained for another latent space"
            )


def find_light_decoder(checkpoint_root: str | Path) -> Path:
    """The checkpoint's ``light_decoder/`` folder; ``InputError`` naming ``decoder`` when it has none."""
    folder = Path(checkpoint_root) / LIGHT_DECODER_DIR
    if not (folder / "config.json").is_file():
        raise InputError(
            f"decoder: 'light' needs a light decoder in {folder} (LightDecoder.save_pretrained, trained by "
            "cosmos3_gym.training.train_light_decoder); this checkpoint has none, use decoder='vae'"
        )
    return folder


def _rows_to_host(tensors: list[torch.Tensor | None]) -> list[list[torch.Tensor] | None]:
    """The rows of each tensor as float32 CPU tensors (None stays None); on a CPU views, as ``.cpu()`` gives. From a
    GPU each tensor comes up in one copy into pinned memory (one copy per row was a launch and an allocation per
    slot of a vector env), all queued and waited for once; then every row is cloned into memory of its own, so that a
    result pickled to another process carries only its row and a kept result holds no pinned memory."""
    if not any(t is not None and t.is_cuda for t in tensors):
        return [None if t is None else [row.float() for row in t] for t in tensors]
    staged = []
    for t in tensors:
        host = None
        if t is not None:
            host = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(t.float(), non_blocking=True)
        staged.append(host)
    torch.cuda.current_stream().synchronize()
    return [None if host is None else [row.clone() for row in host] for host in staged]


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a host sync on CUDA (a pageable copy waits for the queued kernels)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype not in names:
        raise InputError(f"dtype: expected one of {sorted(names)}, got {dtype!r}")
    return names[dtype]
