"""Post-training a Cosmos3 policy model (``Cosmos3Transformer``) on an episode dataset with flow matching.

One model serves the env step (forward dynamics) and both helper agents (policy, inverse dynamics): every sample
draws its mode (``WorldModelTrainConfig.mode_probs``) and gets that mode's clean/noisy masks, exactly the masks the
engine uses (``flow_matching.py``), with ``context_frames`` clean latent frames first where the env hands chunks
over as latents (``handover="latent"``). Inputs are built exactly as the engine builds them: latents from the frozen
VAE through the tier canvas (``data.py``), prompts through ``processor.build_prompt_token_ids`` with the canvas size,
the clip length and the fps the engine reports, actions normalised with the dataset's stats.json and zero-padded to
the model's action width. The task prompt is replaced by the unconditional one ("", the engine's default negative
prompt) with probability ``uncond_prob`` so that classifier-free guidance works.

Training state lives in ``work_dir`` (default ``<out_dir>/training``): ``state/step-N/`` (model, EMA and optimizer
tensors as safetensors, step and optimizer hyperparameters as JSON, a MANIFEST.json of sizes and sha256s), written by
the crash-safe protocol of ``cosmos3_gym.storage`` (a new folder committed by one rename; the previous snapshot is kept
until the next one is complete), ``log.jsonl`` (one line per ``log_every`` steps, with per-mode losses) and
``latent_cache/``. ``resume`` continues from the newest snapshot whose files match their manifest (says which; a
damaged one is refused with an error naming the file, and the previous one used when there is one) and drops the log
lines written after it. Randomness is stateless: step ``k`` on rank ``r`` draws its windows, modes,
sigmas, prompt dropout and noise from a generator seeded with ``(seed, k, r)``, so a resumed run continues the
exact sample stream of an uninterrupted one with no RNG state to save (the model has no dropout).

With ``data_parallel="fsdp"`` the state is a sharded ``torch.distributed.checkpoint`` folder instead (fsdp.py). With
``lora_rank`` > 0 only PEFT adapters on the GEN tower train and are merged at export (lora.py).

At the end, ``out_dir`` receives a complete diffusers-layout checkpoint (EMA weights by default) that
``Cosmos3Engine.from_pretrained`` and ``Cosmos3OmniPipeline.from_pretrained`` load, plus action_stats.json and
meta.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .. import processor
from ..checkpoint import HANDOVERS, validate_checkpoint
from ..engine import MODES, find_light_decoder
from ..errors import CheckpointError, InputError
from ..models.light_decoder import LightDecoder
from ..models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig, DomainAwareLinear
from ..models.vae import WAN22_FIXED_CONFIG, Cosmos3VAE
from ..sampling import make_schedule
from ..storage import atomic_write_text, fault_point, latest_snapshot, save_snapshot
from ..tokenizer import build_tiny_tokenizer
from .data import TrainingWindows, build_training_windows, load_focus_mask, read_dataset, window_focus
from .distributed import DistributedContext, init_distributed
from .export import META_FILE, SAVE_DTYPES, export_checkpoint, scheduler_config
from .flow_matching import (
    INVERSE_DYNAMICS,
    NATIVE_FLOW_SHIFT_BY_TIER,
    SIGMA_DISTRIBUTIONS,
    FlowMatchingBatch,
    FlowMatchingObjective,
    sample_sigmas,
)
from .fsdp import (
    apply_fsdp,
    find_sharded_state,
    full_ema_state_dict,
    full_model_state_dict,
    full_tensor,
    load_sharded_state,
    save_sharded_state,
)
from .growth import grow_depth, grow_width, grown_key_value_heads
from .lora import apply_lora, merge_lora_state_dict
from .rollout import RolloutConditioner
from .schedule import LR_SCHEDULES, learning_rate

# A small Cosmos3 (11 M parameters, 22 MB in float16, with the tiny tokenizer): the Nano structure (GQA, qk-norm,
# interleaved mRoPE, domain-aware action heads) at the built-in model's scale. rope_theta is small because the latent
# grids are
# small: with Nano's 5e6 most spatial rotary slots would barely turn across a 6x6 latent. latent_channel,
# patch_latent_dim and vocab_size are filled in from the VAE and the tokenizer.
DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "action_gen": True,
    "action_dim": processor.ACTION_DIM,
    "hidden_size": 256,
    "head_dim": 32,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "latent_patch_size": 2,
    "rope_scaling": {"mrope_section": [8, 4, 4]},
    "rope_theta": 100.0,
    "num_embodiment_domains": processor.NUM_EMBODIMENT_DOMAINS,
}
PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
POLICY_EPISODES = ("all", "successful")
DATA_PARALLEL = ("ddp", "fsdp")
CHECKPOINT_POLICIES = ("full", "selective")
STATE_FORMAT_VERSION = 1
TEMPORAL_COMPRESSION = WAN22_FIXED_CONFIG["scale_factor_temporal"]  # of every VAE train_vae makes

logger = logging.getLogger(__name__)


@dataclass
class WorldModelTrainConfig:
    """Settings of ``train_world_model``; every field is checked by ``validate`` (errors name the field)."""

    model: dict = field(default_factory=dict)  # Cosmos3OmniTransformer config overrides of DEFAULT_MODEL_CONFIG
    chunk: int = 16  # actions per window; windows have chunk + 1 frames
    resolution_tier: int = 256
    fps: float | None = None  # None: the dataset's meta.json fps
    view_point: str = "ego_view"
    window_stride: int = 4  # frames between the starts of consecutive windows of an episode
    steps: int = 20_000  # total optimizer steps (a resumed run continues up to this number)
    batch_size: int = 16  # per rank
    lr: float = 3e-4
    weight_decay: float = 0.01  # on matrices only (not on norms, biases, the modality embedding)
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 500
    lr_schedule: str = "cosine"  # after warmup: "constant", or cosine decay to min_lr_ratio * lr at `steps`
    min_lr_ratio: float = 0.1
    ema_decay: float = 0.999  # 0 disables the EMA; effective decay min(ema_decay, (1 + k) / (10 + k)) at step k
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    mode_probs: dict = field(default_factory=lambda: {"policy": 0.4, "forward_dynamics": 0.4, "inverse_dynamics": 0.2})
    # "successful": policy-mode samples come only from episodes whose file says success=True (filtered behaviour
    # cloning: the policy imitates what worked, while both dynamics modes still learn from every episode); a window
    # of another episode that draws policy mode trains forward dynamics instead.
    policy_episodes: str = "all"
    # LeRobot datasets (dataset "lerobot:PATH"): the camera (video feature), action and state features, and the
    # embodiment (default: info.json robot_type). domain also overrides our layout's meta.json domain.
    camera: str | None = None
    action_key: str | None = None
    state_key: str | None = None
    domain: str | int | None = None
    uncond_prob: float = 0.1
    # Noise on the clean conditioning frames (the first context_frames latent frames: frame 0 with handover
    # "pixels"), std drawn per sample from U(0, cond_noise_std): in an env rollout they are the model's own previous
    # output, never a clean encode of a real frame, and a model that only saw clean frames drifts chunk after chunk.
    # 0 disables it. Context frames carry no loss in any mode.
    cond_noise_std: float = 0.0
    # Context noise with its level as the context's timestep (issue 42 item 4; Diffusion Forcing, GameNGen): each
    # policy / forward-dynamics sample's context frames become (1 - s) * x0 + s * noise with s ~ U(0,
    # context_noise_max), and their tokens get the timestep embedding of s (the transformer's context_timesteps), so
    # the model knows how far to trust its context. context_noise is the level the exported checkpoint's envs run at
    # (meta.json "context_noise"; Cosmos3Request.context_noise). 0 disables each; one kind of context noise at a time.
    context_noise_max: float = 0.0
    context_noise: float = 0.0
    # Rollout conditioning (rollout.py): the fraction of each batch (policy / forward-dynamics samples) whose frame 0
    # is what the model itself generates for it from a real frame 1..rollout_max_chunks chunks earlier (one depth per
    # step), through the env's path with rollout_num_steps sampler steps. 0 disables it. Needs window_stride to
    # divide chunk.
    rollout_prob: float = 0.0
    rollout_max_chunks: int = 1
    rollout_num_steps: int = 4
    # What the rollouts' hand-over decodes with: "vae", or "light", init_checkpoint's light_decoder/ (as the env
    # decodes a checkpoint whose meta.json says so: the rollouts then see the frames the env would hand over).
    rollout_decoder: str = "vae"
    # How the env hands one chunk over to the next (data.py): "pixels" decodes the last frame and encodes it again as
    # the next request's clean latent frame 0 (windows of chunk + 1 frames encoded one by one); "latent" keeps the
    # last context_frames generated latent frames as the next request's clean context (windows cut from whole-episode
    # encodings, their first context_frames latent frames clean). context_frames > 1 needs "latent"; "latent" needs
    # chunk and window_stride to be multiples of the VAE's temporal compression (4). Both go into meta.json.
    handover: str = "pixels"
    context_frames: int = 1
    # Clean state rows before each window's actions: its previous action_history_length actions (at an episode's start
    # its first action, repeated), as the env passes a slot's last executed actions (envs.core._action_history).
    # A frame shows where things are, not how they move; a PD-controlled agent's velocity is a linear function of its
    # position and its last few targets (benchmarks/recipes/handover_sensitivity.py). Goes into meta.json.
    action_history_length: int = 0
    flow_shift: float | None = None  # None: native Cosmos3 training's shift for the tier (256: 3, 480: 5, 720: 10)
    sigma_distribution: str = "logit_normal"  # of u before the shift: "logit_normal" (SD3) or "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    video_loss_weight: float = 1.0
    action_loss_weight: float = 1.0
    # A loss focus (data.window_focus, flow_matching): "module:function" mapping uint8 frames [N, H, W, 3] to a bool
    # mask [N, H, W] of what matters (a task provides it, e.g. a pushed object's pixels); the latent cells it touches
    # in a window weigh 1 + video_loss_focus_weight times the rest in the video loss. None: no focus.
    video_loss_focus: str | None = None
    video_loss_focus_weight: float = 0.0
    freeze_text_tower: bool = False  # train only the GEN tower (the UND K/V are then cached per prompt)
    gradient_checkpointing: bool = False  # activation checkpointing per transformer block
    checkpoint_policy: str = "full"  # what it recomputes: "full" (everything) or "selective" (not matmuls, attention)
    # torch.compile of each transformer block (Cosmos3Transformer.compile_blocks), inside the checkpoint wrapper and
    # before sharding (torchtitan's order): LoRA on Nano ran 1.6x faster per sample with it (RESULTS.md, issue 46).
    compile_blocks: bool = False
    # Under torchrun: "ddp" replicates the model on every rank; "fsdp" shards weights, gradients and AdamW states
    # over the ranks (FSDP2, fsdp.py), with bf16 compute / fp32 reduce on CUDA and a sharded
    # torch.distributed.checkpoint training state.
    data_parallel: str = "ddp"
    # LoRA (lora.py): 0 trains the weights themselves; r >= 1 trains rank-r PEFT adapters on the GEN tower's linear
    # layers only (everything else frozen, the text tower's K/V cached) and merges them into the exported weights.
    lora_rank: int = 0
    lora_alpha: float | None = None  # None: lora_rank (scaling 1)
    fsdp_cpu_offload: bool = False  # fsdp: sharded weights, grads and optimizer states on the host (CPU AdamW step)
    fsdp_reshard_after_forward: bool = True  # fsdp: free gathered blocks after forward (False: more memory, less comm)
    seed: int = 0
    device: str | None = None  # None: cuda if available, else cpu
    bf16: bool = True  # bf16 autocast on CUDA (float32 master weights); ignored on CPU
    param_dtype: str = "float32"  # "bfloat16" stores weights, grads and AdamW states in bf16 (for huge models)
    resume: bool = False  # continue from work_dir/state when it exists
    log_every: int = 10
    save_every: int = 1000  # training-state checkpoints (one kept); 0: only at the end
    # Wall-clock budget from the trainer's construction (data loading and latent encoding included): training stops
    # at the first log step past it and saves and exports as at the end, and the cosine decay follows whichever of
    # steps and time is further along (checked at each log step), so a run that is faster or slower than planned
    # still ends its schedule at the budget. For jobs that share a GPU or a time-limited machine, where a step count
    # measured in advance is a guess: give ``steps`` with headroom. None: run all ``steps``.
    max_seconds: float | None = None
    save_dtype: str = "float32"  # exported transformer weights: float32 | float16 | bfloat16
    vae_save_dtype: str = "float32"  # exported VAE weights: float32 | float16 | bfloat16
    export_ema: bool = True
    tokenizer_dir: str | None = None  # None: init_checkpoint's text_tokenizer, else tokenizer.build_tiny_tokenizer()
    init_checkpoint: str | None = None  # fine-tune the transformer of this checkpoint instead of a fresh one
    grow_depth: int | None = None  # init_checkpoint's layers expanded to this many per tower (training.growth)
    # init_checkpoint widened (training.growth.grow_width): {"intermediate_size": N, "num_attention_heads": M}, either
    # key optional; the key/value heads grow with the query heads. None: the checkpoint's width.
    grow_width: dict | None = None
    work_dir: str | None = None  # None: <out_dir>/training
    cache_dir: str | None = None  # None: <work_dir>/latent_cache
    encode_batch_size: int = 8
    progress: bool = True

    def validate(self) -> None:
        def fail(name: str, expected: str):
            raise InputError(f"WorldModelTrainConfig.{name}: expected {expected}, got {getattr(self, name)!r}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        for name in (
            "chunk",
            "window_stride",
            "batch_size",
            "log_every",
            "encode_batch_size",
            "rollout_max_chunks",
            "rollout_num_steps",
            "context_frames",
        ):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "an integer >= 1")
        for name in ("steps", "warmup_steps", "save_every", "seed", "lora_rank", "action_history_length"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                fail(name, "an integer >= 0")
        for name in (
            ("lr", "logit_std")
            + (("fps",) if self.fps is not None else ())
            + (("flow_shift",) if self.flow_shift is not None else ())
            + (("max_seconds",) if self.max_seconds is not None else ())
        ):
            if not is_number(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "a positive number")
        for name in (
            "weight_decay",
            "grad_clip",
            "video_loss_weight",
            "action_loss_weight",
            "cond_noise_std",
            "video_loss_focus_weight",
        ):
            if not is_number(getattr(self, name)) or getattr(self, name) < 0:
                fail(name, "a number >= 0")
        for name in ("min_lr_ratio", "ema_decay", "uncond_prob", "rollout_prob"):
            if not is_number(getattr(self, name)) or not 0 <= getattr(self, name) <= 1:
                fail(name, "a number in [0, 1]")
        for name in ("context_noise_max", "context_noise"):
            if not is_number(getattr(self, name)) or not 0 <= getattr(self, name) < 1:
                fail(name, "a noise level in [0, 1)")
        if self.context_noise > 0 and self.context_noise_max == 0:
            fail("context_noise", "0 without context_noise_max > 0 (the model would never have seen a noised context)")
        if self.context_noise_max > 0 and self.cond_noise_std > 0:
            fail("cond_noise_std", "0 with context_noise_max > 0 (one kind of context noise at a time)")
        if self.context_noise_max > 0 and self.rollout_prob > 0:
            fail("rollout_prob", "0 with context_noise_max > 0 (rollout samples condition on clean frames)")
        if not is_number(self.logit_mean):
            fail("logit_mean", "a finite number")
        if self.resolution_tier not in processor.RESOLUTION_TIERS:
            fail("resolution_tier", f"one of {list(processor.RESOLUTION_TIERS)}")
        if self.view_point not in processor.VIEW_POINTS:
            fail("view_point", f"one of {list(processor.VIEW_POINTS)}")
        if len(self.betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in self.betas):
            fail("betas", "two numbers in [0, 1)")
        if self.lr_schedule not in LR_SCHEDULES:
            fail("lr_schedule", f"one of {list(LR_SCHEDULES)}")
        if self.policy_episodes not in POLICY_EPISODES:
            fail("policy_episodes", f"one of {list(POLICY_EPISODES)}")
        if self.sigma_distribution not in SIGMA_DISTRIBUTIONS:
            fail("sigma_distribution", f"one of {list(SIGMA_DISTRIBUTIONS)}")
        if self.param_dtype not in PARAM_DTYPES:
            fail("param_dtype", f"one of {sorted(PARAM_DTYPES)}")
        for name in ("save_dtype", "vae_save_dtype"):
            if getattr(self, name) not in SAVE_DTYPES:
                fail(name, f"one of {sorted(SAVE_DTYPES)}")
        if not isinstance(self.mode_probs, dict) or not set(self.mode_probs) <= set(MODES):
            fail("mode_probs", f"a dict with keys from {list(MODES)}")
        weights = list(self.mode_probs.values())
        if not all(is_number(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            fail("mode_probs", "non-negative weights with a positive sum")
        if not isinstance(self.model, dict):
            fail("model", "a dict of Cosmos3OmniTransformer config overrides")
        if self.rollout_prob > 0 and self.chunk % self.window_stride:
            fail("window_stride", f"a divisor of chunk={self.chunk} with rollout_prob > 0 (windows a chunk apart)")
        if self.init_checkpoint is not None and self.model:
            fail("model", "{} with init_checkpoint (the architecture is the checkpoint's)")
        if self.grow_depth is not None and (
            self.init_checkpoint is None or not is_int(self.grow_depth) or self.grow_depth < 1
        ):
            fail("grow_depth", "None, or a number of layers >= the init_checkpoint's (needs init_checkpoint)")
        if self.grow_width is not None and (
            self.init_checkpoint is None
            or not isinstance(self.grow_width, dict)
            or not set(self.grow_width) <= {"intermediate_size", "num_attention_heads"}
        ):
            fail(
                "grow_width",
                "None, or a dict with intermediate_size and/or num_attention_heads (needs init_checkpoint)",
            )
        if self.lora_alpha is not None and (not is_number(self.lora_alpha) or self.lora_alpha <= 0):
            fail("lora_alpha", "a positive number or None")
        if self.checkpoint_policy not in CHECKPOINT_POLICIES:
            fail("checkpoint_policy", f"one of {list(CHECKPOINT_POLICIES)}")
        if self.data_parallel not in DATA_PARALLEL:
            fail("data_parallel", f"one of {list(DATA_PARALLEL)}")
        if self.rollout_decoder not in ("vae", "light"):
            fail("rollout_decoder", "'vae' or 'light'")
        if self.rollout_decoder == "light" and self.rollout_prob > 0 and self.init_checkpoint is None:
            fail("rollout_decoder", "'vae' without init_checkpoint ('light' reads its light_decoder/)")
        if self.data_parallel == "fsdp" and self.rollout_prob > 0:
            fail("rollout_prob", "0 with data_parallel='fsdp' (rollouts call the transformer outside the sharded step)")
        if self.video_loss_focus is not None and not isinstance(self.video_loss_focus, str):
            fail("video_loss_focus", "None or a 'module:function' string")
        if self.video_loss_focus_weight > 0 and self.video_loss_focus is None:
            fail("video_loss_focus", "a 'module:function' focus mask with video_loss_focus_weight > 0")
        if self.handover not in HANDOVERS:
            fail("handover", f"one of {list(HANDOVERS)}")
        if self.handover == "pixels" and self.context_frames != 1:
            fail("context_frames", "1 with handover='pixels' (more context frames are handed over as latents)")
        if self.handover == "latent":
            for name in ("chunk", "window_stride"):
                if getattr(self, name) % TEMPORAL_COMPRESSION:
                    fail(
                        name,
                        f"a multiple of the VAE's temporal compression {TEMPORAL_COMPRESSION} with "
                        "handover='latent' (windows start on latent frames)",
                    )
            if self.rollout_prob > 0:
                fail("rollout_prob", "0 with handover='latent' (rollouts hand over through pixels)")
        if self.action_history_length and self.rollout_prob > 0:
            fail("rollout_prob", "0 with action_history_length > 0 (rollouts pass no state rows)")

    @property
    def lora_scaling(self) -> float:
        return float(self.lora_alpha if self.lora_alpha is not None else self.lora_rank) / max(self.lora_rank, 1)

    @property
    def resolved_flow_shift(self) -> float:
        if self.flow_shift is not None:
            return float(self.flow_shift)
        return NATIVE_FLOW_SHIFT_BY_TIER[self.resolution_tier]

    def mode_probability_tensor(self) -> torch.Tensor:
        weights = torch.tensor([float(self.mode_probs.get(mode, 0.0)) for mode in MODES], dtype=torch.float64)
        return weights / weights.sum()


# ----------------------------------------------------------------------------------------------------------------
# Model construction
# ----------------------------------------------------------------------------------------------------------------


def resolve_transformer_config(config: WorldModelTrainConfig, vocab_size: int, latent_channels: int) -> dict:
    """The diffusers ``Cosmos3OmniTransformer`` config to train (the JSON that transformer/config.json will hold)."""
    if config.init_checkpoint is not None:
        layout = validate_checkpoint(config.init_checkpoint)
        transformer_config = {k: v for k, v in layout.transformer_config.items() if not k.startswith("_")}
        if config.grow_depth is not None:
            transformer_config["num_hidden_layers"] = config.grow_depth
        if config.grow_width:
            heads, kv_heads = transformer_config["num_attention_heads"], transformer_config["num_key_value_heads"]
            transformer_config.update(config.grow_width)
            transformer_config["num_key_value_heads"] = grown_key_value_heads(
                heads, kv_heads, transformer_config["num_attention_heads"]
            )
    else:
        transformer_config = {**DEFAULT_MODEL_CONFIG, "vocab_size": vocab_size, **config.model}
        transformer_config.setdefault("latent_channel", latent_channels)
        patch = transformer_config["latent_patch_size"]
        transformer_config.setdefault("patch_latent_dim", patch * patch * transformer_config["latent_channel"])
    if transformer_config.get("latent_channel") != latent_channels:
        raise InputError(
            f"model.latent_channel: the transformer reads {transformer_config.get('latent_channel')} latent channels "
            f"but the VAE has z_dim={latent_channels}"
        )
    if not transformer_config.get("action_gen") or transformer_config.get("action_dim") != processor.ACTION_DIM:
        raise InputError(f"model: a policy model needs action_gen=True and action_dim={processor.ACTION_DIM}")
    if transformer_config["vocab_size"] < vocab_size:
        raise InputError(
            f"model.vocab_size: {transformer_config['vocab_size']} is smaller than the tokenizer's {vocab_size}"
        )
    accepted = set(inspect.signature(Cosmos3OmniTransformer.__init__).parameters) - {"self"}
    unknown = sorted(set(transformer_config) - accepted)
    if unknown:
        raise InputError(f"model: unknown Cosmos3OmniTransformer config keys {unknown}")
    try:
        Cosmos3TransformerConfig.from_dict(transformer_config)
    except TypeError as error:  # a value of the wrong type
        raise InputError(f"model: invalid transformer config ({error})") from error
    return transformer_config


@torch.no_grad()
def init_transformer_weights(model: Cosmos3Transformer, seed: int) -> None:
    """GPT-style init: matrices and embeddings N(0, 0.02), biases 0, norms 1, the action modality embedding 0;
    the video and action output heads start at zero (the first velocity is 0, as DiT's zero-initialised final
    layer); the timestep MLP keeps PyTorch's default init so the noise level is a strong signal from step one."""
    generator = torch.Generator().manual_seed(seed)

    def normal_(tensor: torch.Tensor) -> None:
        tensor.copy_(0.02 * torch.randn(tensor.shape, generator=generator))

    for name, module in model.named_modules():
        if name.startswith("time_embedder"):
            continue
        if isinstance(module, nn.Linear):
            normal_(module.weight)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, DomainAwareLinear):
            normal_(module.fc.weight)
            module.bias.weight.zero_()
        elif isinstance(module, nn.Embedding) and name == "embed_tokens":
            normal_(module.weight)
    model.proj_out.weight.zero_()
    model.proj_out.bias.zero_()
    model.action_proj_out.fc.weight.zero_()
    model.action_proj_out.bias.weight.zero_()


def build_transformer(
    transformer_config: dict, config: WorldModelTrainConfig, device: torch.device
) -> Cosmos3Transformer:
    """A fresh (seeded) or init-checkpoint transformer on ``device`` in ``param_dtype`` (time embedder fp32)."""
    dtype = PARAM_DTYPES[config.param_dtype]
    if config.init_checkpoint is not None:
        layout = validate_checkpoint(config.init_checkpoint)
        model = Cosmos3Transformer.from_pretrained(layout.transformer_dir, device=device, dtype=dtype)
        if config.grow_depth is not None:
            model = grow_depth(model, config.grow_depth)
        return grow_width(model, **(config.grow_width or {}), seed=config.seed)
    cfg = Cosmos3TransformerConfig.from_dict(transformer_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)  # the time embedder's default init draws from the global RNG
        model = Cosmos3Transformer(cfg)
    init_transformer_weights(model, config.seed)
    model = model.to(device)
    for name, param in model.named_parameters():
        if not name.startswith("time_embedder."):
            param.data = param.data.to(dtype)
    return model


def never_used_parameters(model: Cosmos3Transformer) -> list[str]:
    """Parameters that never influence a velocity: the last text layer only contributes its K/V (its attention
    output, MLP and post-attention norm feed the LM head, which the policy model does not use)."""
    last = f"text_layers.{len(model.text_layers) - 1}."
    unused_prefixes = tuple(last + part for part in ("attn.out.", "attn.q_norm.", "post_attn_norm.", "mlp."))
    return [name for name, _ in model.named_parameters() if name.startswith(unused_prefixes)]


def set_trainable(model: Cosmos3Transformer, freeze_text_tower: bool) -> list[str]:
    """Freeze what does not train; returns the names of the trainable parameters (in model order)."""
    frozen = set(never_used_parameters(model))
    if freeze_text_tower:
        frozen |= {n for n, _ in model.named_parameters() if n.startswith(("text_layers.", "embed_tokens."))}
    names = []
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
        if name not in frozen:
            names.append(name)
    return names


# What selective checkpointing keeps from the forward pass: the outputs of the matmuls and of attention, the costly
# ops; norms, RoPE, gates and activations (cheap, memory-bound) are recomputed. torchtitan's "op" SAC policy, without
# its every-other-matmul memory trade.
_SAVED_OPS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)  # the attention kernels differ between torch versions
)


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_gradient_checkpointing(model: Cosmos3Transformer, text_tower: bool = True, policy: str = "full") -> None:
    """Recompute each layer's activations in the backward pass (torch.utils.checkpoint, non-reentrant): all of them
    (``policy="full"``), or all but the matmul and attention outputs (``"selective"``: more memory, less recompute).

    The towers call ``layer.gen_forward`` / ``layer.text_forward`` rather than ``forward``, so those bound methods
    are wrapped on each layer instance; parameter names and the state dict are unchanged.
    """
    from torch.utils.checkpoint import checkpoint

    if policy not in CHECKPOINT_POLICIES:
        raise InputError(f"checkpoint_policy: expected one of {list(CHECKPOINT_POLICIES)}, got {policy!r}")
    extra = {"context_fn": _selective_context} if policy == "selective" else {}

    def wrap(method):
        def checkpointed(*args, **kwargs):
            return checkpoint(method, *args, use_reentrant=False, **extra, **kwargs)

        return checkpointed

    for layer in model.gen_layers:
        layer.gen_forward = wrap(layer.gen_forward)
    if text_tower:
        for layer in model.text_layers:
            layer.text_forward = wrap(layer.text_forward)


def build_optimizer(model: nn.Module, config: WorldModelTrainConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices only. States follow the parameter dtype."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 and name != "action_modality_embed" else no_decay).append(param)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused CUDA kernel updates in place without the foreach path's full-size temporaries (GBs for big models).
    fused = all(p.is_cuda for group in groups for p in group["params"])
    betas = cast("tuple[float, float]", tuple(config.betas))  # validate(): two numbers
    return torch.optim.AdamW(groups, lr=config.lr, betas=betas, fused=fused or None)


def training_step(
    model: nn.Module,
    batch: FlowMatchingBatch,
    optimizer: torch.optim.Optimizer,
    trainable_params: list,
    grad_clip: float,
    autocast: bool,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Forward (under bf16 autocast when asked), backward, gradient clipping (``grad_clip`` 0: none, the norm is
    still returned) and one optimizer step. Returns the objective's outputs and the gradient norm."""
    device_type = batch.video.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        out = model(batch)
    out["loss"].backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_params, grad_clip if grad_clip > 0 else math.inf)
    grad_norm = full_tensor(grad_norm)  # FSDP: a replicated DTensor
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out, grad_norm


class EMA:
    """Float32 exponential moving average of the trainable parameters (exported instead of the raw weights)."""

    def __init__(self, model: nn.Module, names: list[str], decay: float):
        params = dict(model.named_parameters())
        self.decay = decay
        self.names = list(names)
        self.params = [params[n] for n in names]
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """``step`` counts completed optimizer steps; the decay warms up as min(decay, (1 + step) / (10 + step))."""
        decay = min(self.decay, (1.0 + step) / (10.0 + step))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1.0 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.shadow))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.names):
            raise InputError("training state: the EMA holds other parameters than the model trains")
        for name, shadow in zip(self.names, self.shadow):
            shadow.copy_(state[name])


# ----------------------------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------------------------


def step_generator(seed: int, step: int, rank: int, stream: str = "") -> torch.Generator:
    """The generator of one step on one rank (see the module docstring: stateless, hence exactly resumable);
    ``stream`` names an independent stream of the same step (the batch's draws use the unnamed one)."""
    digest = hashlib.sha256(f"cosmos3_gym.train/{seed}/{step}/{rank}{'/' + stream if stream else ''}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def sample_batch(
    windows: TrainingWindows,
    generator: torch.Generator,
    config: WorldModelTrainConfig,
    *,
    domain_id: int,
    raw_action_dim: int,
    action_dim: int,
    fps: float,
) -> FlowMatchingBatch:
    """Draw a batch on the host: windows, modes, prompt dropout, sigmas and noise (in that order)."""
    b = config.batch_size
    index = torch.randint(len(windows), (b,), generator=generator)
    modes = torch.multinomial(config.mode_probability_tensor(), b, replacement=True, generator=generator)
    if config.policy_episodes == "successful":
        demoted = (modes == MODES.index("policy")) & ~windows.successful[index]
        modes = torch.where(demoted, MODES.index("forward_dynamics"), modes)
    uncond = (torch.rand(b, generator=generator) < config.uncond_prob).tolist()
    sigmas = sample_sigmas(
        b,
        generator,
        shift=config.resolved_flow_shift,
        distribution=config.sigma_distribution,
        logit_mean=config.logit_mean,
        logit_std=config.logit_std,
    )
    video = windows.latents[index.to(windows.latents.device)]
    focus = windows.focus[index] if windows.focus is not None else None
    video_noise = torch.randn(video.shape, generator=generator)
    rows = windows.actions.shape[1]  # the state rows (action_history_length), then the chunk
    action_noise = torch.randn((b, rows, action_dim), generator=generator)
    actions = torch.zeros(b, rows, action_dim)
    actions[..., :raw_action_dim] = windows.actions[index]
    prompt_ids = [windows.prompts[int(windows.prompt_index[i])][int(drop)] for i, drop in zip(index, uncond)]
    if config.cond_noise_std > 0:  # drawn last, so that the draws above do not depend on it
        std = torch.rand(b, generator=generator) * config.cond_noise_std
        k = config.context_frames  # every clean context frame, each sample with its own std
        context = video[:, :, :k]
        video = torch.cat(
            [
                context
                + std.view(b, 1, 1, 1, 1).to(context) * torch.randn(context.shape, generator=generator).to(context),
                video[:, :, k:],
            ],
            dim=2,
        )
    context_sigmas = None
    if config.context_noise_max > 0:  # drawn last, so that the draws above do not depend on it
        # Inverse dynamics is given its whole video: no context to distrust, no level.
        context_sigmas = torch.rand(b, generator=generator) * config.context_noise_max
        context_sigmas = torch.where(modes == MODES.index("inverse_dynamics"), 0.0, context_sigmas)
        k = config.context_frames
        context = video[:, :, :k]
        level = context_sigmas.view(b, 1, 1, 1, 1).to(context)
        noise = torch.randn(context.shape, generator=generator).to(context)
        video = torch.cat([(1.0 - level) * context + level * noise, video[:, :, k:]], dim=2)
    return FlowMatchingBatch(
        prompt_ids=prompt_ids,
        fps=[fps] * b,
        video=video,
        actions=actions,
        raw_action_dims=torch.full((b,), raw_action_dim),
        domain_ids=torch.full((b,), domain_id),
        modes=modes,
        sigmas=sigmas,
        video_noise=video_noise,
        action_noise=action_noise,
        window_index=index,
        video_focus=focus,
        context_sigmas=context_sigmas,
    )


# ----------------------------------------------------------------------------------------------------------------
# Training state (resumable checkpoints)
# ----------------------------------------------------------------------------------------------------------------

# Fields that must not change when a run is resumed: they change the model or what its optimizer state means.
_RESUME_FIXED_FIELDS = (
    "chunk",
    "resolution_tier",
    "freeze_text_tower",
    "param_dtype",
    "init_checkpoint",
    "grow_depth",
    "grow_width",
    "data_parallel",
    "lora_rank",
    "lora_alpha",
    "handover",
    "context_frames",
    "action_history_length",
)


def state_document(config: WorldModelTrainConfig, transformer_config: dict) -> dict:
    """What state.json records besides the tensors: the format, the configs (checked on resume)."""
    return {
        "format_version": STATE_FORMAT_VERSION,
        "config": dataclasses.asdict(config),
        "transformer_config": transformer_config,
    }


def check_resumable(state_dir: Path, config: WorldModelTrainConfig, transformer_config: dict) -> dict:
    """state.json of ``state_dir`` after checking that the run may continue with ``config``; returns it."""
    document = read_state_document(state_dir)
    if document.get("format_version") != STATE_FORMAT_VERSION:
        raise InputError(
            f"resume: {state_dir} has state format {document.get('format_version')}, expected {STATE_FORMAT_VERSION}"
        )
    saved = document["config"]
    defaults = WorldModelTrainConfig()
    for name in _RESUME_FIXED_FIELDS:
        if saved.get(name, getattr(defaults, name)) != getattr(config, name):
            raise InputError(
                f"WorldModelTrainConfig.{name}: {getattr(config, name)!r} differs from {saved.get(name)!r} of the run "
                f"saved in {state_dir}; it cannot change on resume"
            )
    if json.loads(json.dumps(transformer_config)) != document["transformer_config"]:
        raise InputError(
            f"WorldModelTrainConfig.model: the transformer config differs from the run saved in {state_dir}"
        )
    return document


def save_training_state(
    state_dir: Path,
    *,
    step: int,
    model: nn.Module,
    ema: EMA | None,
    optimizer: torch.optim.Optimizer,
    config: WorldModelTrainConfig,
    transformer_config: dict,
) -> Path:
    """Write snapshot ``state_dir/step-N`` with the crash-safe protocol (``storage.save_snapshot``: a new folder,
    fsynced, with a manifest of sizes and sha256s, committed by one rename; the previous snapshot is kept):
    model.safetensors, ema.safetensors, optimizer.safetensors and state.json (step, configs, optimizer hyperparameters
    and scalar state). Returns the snapshot's folder."""
    cpu = lambda tensors: {k: v.detach().cpu().contiguous() for k, v in tensors.items()}  # noqa: E731
    optimizer_state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, param_state in optimizer_state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{key}"] = value
            else:
                scalars[f"{index}.{key}"] = value
    document = {
        **state_document(config, transformer_config),
        "step": step,
        "optimizer": {"param_groups": optimizer_state["param_groups"], "scalars": scalars},
    }

    def fill(staging: Path) -> None:
        save_file(cpu(model.state_dict()), staging / "model.safetensors")
        fault_point("model.safetensors written")
        if ema is not None:
            save_file(cpu(ema.state_dict()), staging / "ema.safetensors")
            fault_point("ema.safetensors written")
        save_file(cpu(tensors), staging / "optimizer.safetensors")
        fault_point("optimizer.safetensors written")
        (staging / "state.json").write_text(json.dumps(document, indent=2))

    return save_snapshot(state_dir, step, fill)


def find_training_state(state_dir: Path, *, what: str = "resume") -> tuple[int, Path] | None:
    """The state to resume from: the newest snapshot of ``state_dir`` whose files match its manifest (falling back to
    the previous one, with a warning naming the damaged file), else a state saved flat in ``state_dir`` (or
    ``state.old``) by versions before the snapshots (state.json beside the tensors), else None. ``CheckpointError``
    when all are damaged."""
    found = latest_snapshot(state_dir, what=what)
    if found is not None:
        return found
    # The old protocol renamed state -> state.old, then state.tmp -> state: a crash between them left the previous
    # complete state in state.old (state.tmp may be half-written).
    for legacy in (state_dir, state_dir.with_name(state_dir.name + ".old")):
        if (legacy / "state.json").is_file():
            return int(read_state_document(legacy, what)["step"]), legacy
    return None


def read_state_document(state_dir: Path, what: str = "resume") -> dict:
    """state.json of a training state; ``CheckpointError`` naming it when it is not a JSON object."""
    path = state_dir / "state.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{what}: {path} is not a readable training state ({error})") from error
    if not isinstance(document, dict) or not isinstance(document.get("step"), int):
        raise CheckpointError(f"{what}: {path} is not a training state (no integer 'step')")
    return document


def _load_tensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    try:
        return load_file(path, device=str(device))
    except Exception as error:  # SafetensorError, OSError, ...: a file damaged after its manifest was written
        raise CheckpointError(f"resume: {path} is not a readable safetensors file ({error})") from error


def load_training_state(
    state_dir: Path,
    *,
    model: nn.Module,
    ema: EMA | None,
    optimizer: torch.optim.Optimizer,
    config: WorldModelTrainConfig,
    transformer_config: dict,
) -> int:
    """Restore what ``save_training_state`` wrote into ``state_dir`` (a snapshot); returns the step to continue
    from."""
    document = check_resumable(state_dir, config, transformer_config)
    device = next(model.parameters()).device
    model.load_state_dict(_load_tensors(state_dir / "model.safetensors", device))
    if ema is not None:
        ema_path = state_dir / "ema.safetensors"
        if not ema_path.exists():
            raise InputError(f"resume: {state_dir} has no EMA but ema_decay={config.ema_decay} > 0")
        ema.load_state_dict(_load_tensors(ema_path, device))
    tensors = _load_tensors(state_dir / "optimizer.safetensors")
    optimizer_document = document["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *optimizer_document["scalars"].items()]:
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer_document["param_groups"]})
    return int(document["step"])


def truncate_log(log_path: Path, step: int) -> None:
    """Drop the lines of ``log_path`` logged after ``step`` (by a run that was killed before saving them), so that a
    resumed run's log reads as an uninterrupted run's."""
    if not log_path.is_file():
        return
    lines = log_path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            logged = json.loads(line).get("step")
        except (ValueError, AttributeError):
            logged = None  # a line cut short by the kill
        if isinstance(logged, int) and logged <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        atomic_write_text(log_path, "".join(kept))


# ----------------------------------------------------------------------------------------------------------------
# The training loop
# ----------------------------------------------------------------------------------------------------------------


def init_train_steps(init_checkpoint: str | None) -> int:
    """Steps the weights of ``init_checkpoint`` had seen (its meta.json), so that fine-tunes of fine-tunes report
    every step in ``total_train_steps``; 0 for a fresh model or a checkpoint that does not say."""
    if init_checkpoint is None:
        return 0
    path = validate_checkpoint(init_checkpoint).root / META_FILE
    if not path.is_file():
        return 0
    try:
        meta = json.loads(path.read_text())
        return int(meta.get("total_train_steps", meta.get("train_steps", 0)))
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise InputError(f"init_checkpoint: cannot read the training steps from {path}: {error}") from error


def load_tokenizer(config: WorldModelTrainConfig):
    from transformers import AutoTokenizer

    if config.tokenizer_dir is not None:
        return AutoTokenizer.from_pretrained(str(config.tokenizer_dir))
    if config.init_checkpoint is not None:
        return AutoTokenizer.from_pretrained(str(validate_checkpoint(config.init_checkpoint).text_tokenizer_dir))
    return build_tiny_tokenizer()


class _LossTracker:
    """Sums of the loss terms since the last log line, kept on the device (read and reduced over ranks only when a
    line is logged, so training steps do not wait for the host)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        # [loss sum, grad-norm sum, steps] and per mode [video mse sum, video samples, action mse sum, action samples]
        self.totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        self.by_mode = torch.zeros(len(MODES), 4, dtype=torch.float64, device=self.device)

    def add(self, out: dict[str, torch.Tensor], modes: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.totals += torch.stack(
            [out["loss"].detach().double(), grad_norm.double(), torch.ones((), dtype=torch.float64, device=self.device)]
        )
        for column, key in ((0, "video_mse"), (2, "action_mse")):
            values = out[key].double()
            present = ~values.isnan()
            self.by_mode[:, column].index_add_(0, modes, torch.where(present, values, 0.0))
            self.by_mode[:, column + 1].index_add_(0, modes, present.double())

    def summary(self, ctx: DistributedContext) -> dict:
        totals = ctx.all_reduce_sum(self.totals.clone()).tolist()
        by_mode = ctx.all_reduce_sum(self.by_mode.clone()).tolist()
        steps_times_ranks = max(totals[2], 1.0)

        def mean(total: float, count: float) -> float | None:
            return total / count if count else None

        return {
            "loss": totals[0] / steps_times_ranks,
            "grad_norm": totals[1] / steps_times_ranks,
            "losses_by_mode": {
                mode: {"video": mean(row[0], row[1]), "action": mean(row[2], row[3]), "samples": int(row[1] or row[3])}
                for mode, row in zip(MODES, by_mode)
            },
        }


class WorldModelTrainer:
    """The training run behind ``train_world_model``: ``train()`` runs the loop up to ``config.steps`` (resuming from
    the saved state when ``config.resume``), ``export()`` writes the checkpoint (on the main rank).

    ``ctx`` is the run's ``DistributedContext`` (``init_distributed``); the caller closes it.
    """

    def __init__(
        self,
        dataset_dir: str | os.PathLike,
        out_dir: str | os.PathLike,
        config: WorldModelTrainConfig,
        vae_dir: str | os.PathLike,
        ctx: DistributedContext,
    ):
        config.validate()
        self.constructed = time.perf_counter()  # max_seconds counts from here
        focus_mask = None  # loaded first: a wrong name fails before the encoding
        if config.video_loss_focus is not None and config.video_loss_focus_weight > 0:
            focus_mask = load_focus_mask(config.video_loss_focus)
        self.config, self.ctx = config, ctx
        self.vae_dir = Path(vae_dir)
        self.out_dir = Path(out_dir).expanduser()
        self.work_dir = Path(config.work_dir).expanduser() if config.work_dir else self.out_dir / "training"
        cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else self.work_dir / "latent_cache"
        self.state_dir = self.work_dir / "state"
        self.log_path = self.work_dir / "log.jsonl"
        device = ctx.device

        self.info = read_dataset(
            dataset_dir,
            camera=config.camera,
            action_key=config.action_key,
            state_key=config.state_key,
            domain=config.domain,
        )
        self.fps = float(config.fps if config.fps is not None else self.info.fps)
        self.init_train_steps = init_train_steps(config.init_checkpoint)  # read now: export comes hours later
        self.tokenizer = load_tokenizer(config)
        if ctx.is_main:
            self.work_dir.mkdir(parents=True, exist_ok=True)
        ctx.barrier()

        warn_if_vae_clips_are_short(self.vae_dir, config.chunk)
        vae = Cosmos3VAE.from_pretrained(self.vae_dir, device=device, dtype=torch.float32)
        self.windows = build_training_windows(
            self.info,
            vae,
            self.vae_dir,
            self.tokenizer,
            chunk=config.chunk,
            stride=config.window_stride,
            resolution_tier=config.resolution_tier,
            view_point=config.view_point,
            fps=self.fps,
            cache_dir=cache_dir,
            encode_batch_size=config.encode_batch_size,
            progress=config.progress and ctx.is_main,
            handover=config.handover,
            context_frames=config.context_frames,
            action_history_length=config.action_history_length,
        )
        if focus_mask is not None:
            self.windows.focus = window_focus(
                self.info,
                self.windows,
                focus_mask,
                chunk=config.chunk,
                context_frames=config.context_frames,
                temporal_compression=vae.temporal_compression,
                progress=config.progress and ctx.is_main,
            )
            self.announce(
                f"loss focus: {float(self.windows.focus.float().mean()):.1%} of the latent cells, weighing "
                f"{1 + config.video_loss_focus_weight:g}x"
            )
        latent_channels = vae.latent_channels
        if (
            config.policy_episodes == "successful"
            and config.mode_probs.get("policy", 0) > 0
            and not bool(self.windows.successful.any())
        ):
            raise InputError(
                f"policy_episodes: 'successful', but no episode of {self.info.root} has success=True (the optional "
                f"'success' array of an episode file)"
            )
        self.windows.latents = self.windows.latents.to(device)

        self.transformer_config = resolve_transformer_config(config, len(self.tokenizer), latent_channels)
        self.transformer = build_transformer(self.transformer_config, config, device)
        model_config = self.transformer.config
        # resolve_transformer_config: a policy model (action_gen with action_dim=processor.ACTION_DIM)
        assert model_config.action_dim is not None
        self.action_dim: int = model_config.action_dim
        self.domain_id, self.raw_action_dim = processor.resolve_domain(
            self.info.domain, self.info.raw_action_dim, action_dim=self.action_dim
        )
        if self.domain_id >= model_config.num_embodiment_domains:
            raise InputError(
                f"model.num_embodiment_domains: {model_config.num_embodiment_domains} has no row for domain "
                f"{self.info.domain!r} (id {self.domain_id})"
            )
        if config.lora_rank:
            trainable = apply_lora(
                self.transformer, config.lora_rank, config.lora_alpha or config.lora_rank, seed=config.seed
            )
        else:
            trainable = set_trainable(self.transformer, config.freeze_text_tower)
        text_frozen = config.freeze_text_tower or config.lora_rank > 0
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(self.transformer, text_tower=not text_frozen, policy=config.checkpoint_policy)
        if config.compile_blocks:
            self.transformer.compile_blocks()
        self.objective = FlowMatchingObjective(
            self.transformer,
            video_loss_weight=config.video_loss_weight,
            action_loss_weight=config.action_loss_weight,
            freeze_text_tower=text_frozen,
            context_frames=config.context_frames,
            focus_weight=config.video_loss_focus_weight,
            action_history_length=config.action_history_length,
        )
        self.sharded = config.data_parallel == "fsdp"
        if self.sharded:
            apply_fsdp(
                self.objective,
                device=device,
                bf16=config.bf16,
                cpu_offload=config.fsdp_cpu_offload,
                reshard_after_forward=config.fsdp_reshard_after_forward,
            )
        self.rollout = None
        if config.rollout_prob > 0:
            schedule = make_schedule(config.rollout_num_steps, scheduler_config(config.resolved_flow_shift))
            light_decoder = None
            if config.rollout_decoder != "vae":
                assert config.init_checkpoint is not None  # validate(): 'light' rollouts read its light_decoder/
                light_decoder = LightDecoder.from_pretrained(find_light_decoder(config.init_checkpoint), device=device)
            self.rollout = RolloutConditioner(
                self.windows,
                vae,
                schedule,
                chunk=config.chunk,
                prob=config.rollout_prob,
                max_chunks=config.rollout_max_chunks,
                resolution_tier=config.resolution_tier,
                fps=self.fps,
                domain_id=self.domain_id,
                action_dim=self.action_dim,
                light_decoder=light_decoder,
            )
        del vae
        self.optimizer = build_optimizer(self.transformer, config)
        self.ema = EMA(self.transformer, trainable, config.ema_decay) if config.ema_decay > 0 else None
        self.saved_step: int | None = None  # the step of the state loaded or last saved
        self.step = self.resume() if config.resume else 0
        self.model: nn.Module = self.objective
        if ctx.world_size > 1 and not self.sharded:
            self.model = nn.parallel.DistributedDataParallel(
                self.objective, device_ids=[device.index] if device.type == "cuda" else None
            )

    def resume(self) -> int:
        """Load the newest complete training state of ``state_dir`` (a damaged newest one is skipped for the previous
        one, with a warning naming the bad file) and say which; returns its step (0, said too, when there is none)."""
        config = self.config
        if self.sharded:
            found = find_sharded_state(self.state_dir, find_training_state)
        else:
            found = find_training_state(self.state_dir)
        if found is None:
            self.announce(f"resume: no training state in {self.state_dir}; starting at step 0")
            return 0
        step, path = found
        if self.sharded:
            check_resumable(path, config, self.transformer_config)
            load_sharded_state(path, objective=self.objective, ema=self.ema, optimizer=self.optimizer)
        else:
            load_training_state(
                path,
                model=self.transformer,
                ema=self.ema,
                optimizer=self.optimizer,
                config=config,
                transformer_config=self.transformer_config,
            )
        self.announce(f"resume: continuing from step {step} ({path})")
        self.saved_step = step
        if self.ctx.is_main:
            truncate_log(self.log_path, step)
        self.ctx.barrier()
        return step

    def announce(self, message: str) -> None:
        logger.info(message)
        if self.config.progress and self.ctx.is_main:
            tqdm.write(message)

    def save_state(self) -> None:
        """Save the training state of the current step (``save_training_state`` / ``save_sharded_state``); the state
        this run resumed from (a resumed run with nothing left to train) is not written again."""
        if self.step == self.saved_step:
            return
        self.saved_step = self.step
        if self.sharded:
            save_sharded_state(
                self.state_dir,
                step=self.step,
                objective=self.objective,
                ema=self.ema,
                optimizer=self.optimizer,
                document=state_document(self.config, self.transformer_config),
                is_main=self.ctx.is_main,
            )
            return
        if self.ctx.is_main:
            save_training_state(
                self.state_dir,
                step=self.step,
                model=self.transformer,
                ema=self.ema,
                optimizer=self.optimizer,
                config=self.config,
                transformer_config=self.transformer_config,
            )
        self.ctx.barrier()

    def train(self) -> None:
        config, ctx, device = self.config, self.ctx, self.ctx.device
        autocast = device.type == "cuda" and config.bf16 and config.param_dtype == "float32"
        trainable_params = [p for p in self.transformer.parameters() if p.requires_grad]
        tracker = _LossTracker(device)
        started, last_log_step = time.perf_counter(), self.step
        train_started, time_fraction = started, 0.0
        bar = tqdm(
            total=config.steps, initial=self.step, desc="training", disable=not (config.progress and ctx.is_main)
        )
        while self.step < config.steps:
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(config, self.step, time_fraction)
            batch = sample_batch(
                self.windows,
                step_generator(config.seed, self.step, ctx.rank),
                config,
                domain_id=self.domain_id,
                raw_action_dim=self.raw_action_dim,
                action_dim=self.action_dim,
                fps=self.fps,
            ).to(device)
            if self.rollout is not None:
                batch = self.condition_on_rollouts(batch, autocast)
            out, grad_norm = training_step(
                self.model, batch, self.optimizer, trainable_params, config.grad_clip, autocast
            )
            self.step += 1
            if self.ema is not None:
                self.ema.update(self.step)
            fault_point("training step")  # (a test may kill the process here: cosmos3_gym.storage)
            tracker.add(out, batch.modes, grad_norm)
            bar.update(1)

            if self.step % config.log_every == 0 or self.step == config.steps:
                summary = tracker.summary(ctx)
                tracker.reset()
                elapsed = time.perf_counter() - started
                if ctx.is_main:
                    samples = (self.step - last_log_step) * config.batch_size * ctx.world_size
                    record = {
                        "step": self.step,
                        "lr": self.optimizer.param_groups[0]["lr"],
                        **summary,
                        "samples_per_s": samples / max(elapsed, 1e-9),
                    }
                    if device.type == "cuda":
                        record["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
                    with self.log_path.open("a") as handle:
                        handle.write(json.dumps(record) + "\n")
                    bar.set_postfix(loss=f"{summary['loss']:.4f}")
                started, last_log_step = time.perf_counter(), self.step
                time_fraction = self.time_fraction(train_started)
                if time_fraction >= 1.0:
                    break
            if config.save_every and self.step % config.save_every == 0 and self.step < config.steps:
                self.save_state()
        bar.close()
        self.save_state()

    def time_fraction(self, train_started: float) -> float:
        """The share of ``max_seconds`` left at ``train_started`` (``time.perf_counter()``) that has passed (0 without
        a budget; 1 or more: out of time), the largest over ranks, so all ranks set the same learning rate and stop at
        the same step."""
        if self.config.max_seconds is None:
            return 0.0
        deadline = self.constructed + self.config.max_seconds
        now = time.perf_counter()
        fraction = 1.0 if now >= deadline else (now - train_started) / (deadline - train_started)
        if self.ctx.world_size > 1:
            fraction = self.ctx.all_reduce_max(torch.tensor(fraction, device=self.ctx.device)).item()
        return fraction

    def condition_on_rollouts(self, batch: FlowMatchingBatch, autocast: bool) -> FlowMatchingBatch:
        """``batch`` with frame 0 of the samples that draw a rollout replaced by the model's own (rollout.py)."""
        assert self.rollout is not None  # called only when rollout_prob > 0
        assert batch.window_index is not None  # sample_batch records the windows drawn
        generator = step_generator(self.config.seed, self.step, self.ctx.rank, stream="rollout")
        window_index = batch.window_index.cpu()
        depth = self.rollout.draw(window_index, (batch.modes != INVERSE_DYNAMICS).cpu(), generator)
        if not bool(depth.any()):
            return batch
        first = self.rollout.first_frames(
            self.transformer, self.objective.encode_prompts, window_index, depth, generator, autocast
        )
        video = batch.video.clone()
        video[torch.nonzero(depth > 0).flatten().to(video.device), :, :1] = first.to(video.dtype)
        return dataclasses.replace(batch, video=video)

    def export(self) -> Path:
        """Write the checkpoint (EMA weights unless ``export_ema`` is False or there is no EMA) on the main rank."""
        config = self.config
        ema = self.ema if config.export_ema else None
        use_ema = ema is not None
        if self.sharded:  # every rank takes part in gathering the full weights onto rank 0
            weights = full_model_state_dict(self.transformer)
            ema_weights = full_ema_state_dict(ema, self.ctx.is_main) if ema is not None else {}
        elif self.ctx.is_main:
            weights = self.transformer.state_dict()
            ema_weights = ema.state_dict() if ema is not None else {}
        if self.ctx.is_main:
            weights.update(ema_weights)
            if config.lora_rank:
                weights = merge_lora_state_dict(weights, config.lora_scaling)
            meta = {
                "domain": self.info.domain,
                "raw_action_dim": self.raw_action_dim,
                "fps": self.fps,
                "chunk": config.chunk,
                "resolution_tier": config.resolution_tier,
                "image_size": self.info.meta.get("image_size"),
                "canvas_hw": list(self.windows.canvas_hw),
                "latent_thw": list(self.windows.latent_thw),
                "view_point": config.view_point,
                "action_normalization": self.info.action_normalization,
                "flow_shift": config.resolved_flow_shift,
                "train_steps": self.step,
                "total_train_steps": self.step + self.init_train_steps,
                "weights": "ema" if use_ema else "model",
                "dataset": str(self.info.root),
                "source": self.info.meta.get("source"),
            }
            if config.handover == "latent":  # what the env must hand over; a meta.json without them means pixels
                meta.update(handover=config.handover, context_frames=config.context_frames)
            if config.action_history_length:  # the state rows every request must carry (a released model: none)
                meta["action_history_length"] = config.action_history_length
            if config.context_noise_max > 0:  # the level its envs run at, and what it was trained with
                meta.update(context_noise=config.context_noise, context_noise_max=config.context_noise_max)
            export_checkpoint(
                self.out_dir,
                native_state_dict={k: v.float() for k, v in weights.items()},
                transformer_config=self.transformer_config,
                vae_dir=self.vae_dir,
                tokenizer=self.tokenizer,
                flow_shift=config.resolved_flow_shift,
                action_stats=self.info.stats_document,
                meta=meta,
                save_dtype=config.save_dtype,
                vae_save_dtype=config.vae_save_dtype,
            )
        self.ctx.barrier()
        return self.out_dir


def warn_if_vae_clips_are_short(vae_dir: Path, chunk: int) -> None:
    """Warn when ``train_vae`` (its train_config.json) saw shorter clips than the chunk + 1 frames the world model
    generates: the causal decoder then decodes the last latent frames badly and env rollouts drift."""
    path = Path(vae_dir) / "train_config.json"
    if not path.is_file():
        return
    frames = json.loads(path.read_text()).get("config", {}).get("frames_per_clip")
    if isinstance(frames, int) and frames < chunk + 1:
        warnings.warn(
            f"the VAE in {vae_dir} was trained on {frames}-frame clips but chunk={chunk} generates {chunk + 1} frames;"
            f" its decoder has not learnt the last latent frames (retrain or fine-tune it with VAETrainConfig("
            f"frames_per_clip={chunk + 1}, init_vae=..., train_encoder=False))",
            stacklevel=3,
        )


def train_world_model(
    dataset_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: WorldModelTrainConfig | None = None,
    vae_dir: str | os.PathLike | None = None,
) -> Path:
    """Train a Cosmos3 policy model on the dataset and export a complete checkpoint to ``out_dir`` (returned).

    ``vae_dir`` is the frozen VAE (``train_vae`` output, or an existing checkpoint's ``vae/`` folder). Launched by
    torchrun with several processes, the ranks train data-parallel (DDP, or FSDP2 with ``data_parallel="fsdp"``;
    NCCL on CUDA, gloo on CPU), each drawing ``batch_size`` samples per step; rank 0 writes the log and the
    checkpoint (the FSDP training state is written by every rank, sharded). ``dataset_dir`` is a folder in our
    layout or ``"lerobot:PATH"``.
    """
    config = config or WorldModelTrainConfig()
    config.validate()
    if vae_dir is None:
        raise InputError("vae_dir: required (a trained AutoencoderKLWan folder, e.g. train_vae's output)")
    ctx = init_distributed(config.device)
    try:
        trainer = WorldModelTrainer(dataset_dir, out_dir, config, vae_dir, ctx)
        trainer.train()
        return trainer.export()
    finally:
        ctx.close()
