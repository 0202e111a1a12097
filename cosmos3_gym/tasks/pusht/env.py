"""``cosmos3_gym/PushT-v0``: the built-in world model of the PushT task, ready to use offline.

The package ships (in ``cosmos3_gym/tasks/pusht/assets/``) a small Cosmos3 model trained by this project on the
PushT simulator (gym-pusht), a reward model and a few dozen start frames held out from training, all inside the
checkpoint folder (a checkpoint's meta.json may only name files inside it)::

    assets/
      checkpoint/           diffusers layout written by cosmos3_gym.training.train_world_model, plus
        meta.json           domain, raw_action_dim, fps, chunk, resolution_tier, image_size and the env defaults
                            task, num_steps, guidance_scale, success_threshold, max_episode_steps,
                            initial_states ("initial_states.npz"), reward_model ("classifier:reward_model");
                            optionally decoder ("vae" or "light"), what the env decodes with unless told otherwise
        action_stats.json   the dataset's action statistics (raw actions are table pixels in [0, 512])
        light_decoder/      optional: a LightDecoder for ``decoder="light"`` (5x fewer FLOPs than the VAE's exact
                            decode; benchmarks/recipes/train_light_decoder.py distils one from it)
        reward_model/       a ClassifierRewardModel trained on the simulator's coverage of the target (soft labels),
                            so its score estimates coverage
        initial_states.npz  frames uint8 [N, H, W, 3], task (0-d str), sim_seeds int64 [N] (gym-pusht reset seeds
                            that give each frame)

The built-in model's meta.json says ``"decoder": "light"``: its light decoder, distilled on the world model's own
latents, matches the VAE's exact decode on every fidelity metric of issue 18 within their CIs (H200, one run:
benchmarks/results/fidelity/pusht_fidelity_targets_h200_round9_light_v2.json against
..._vae_same_run_as_light_v2.json) at a fifth of its FLOPs (6.7 instead of 27 ms per step at one env on an H200).
``decoder="vae"`` decodes exactly. ``optimize=False`` (the baseline path) keeps the VAE.

``gym.make("cosmos3_gym/PushT-v0")`` needs nothing else: no gym-pusht, no GPU, no network. Every argument of
``WorldModelEnv`` can still be given and wins over the shipped defaults (a changed checkpoint setting is logged).
The same model is ``checkpoint="pusht"`` (or ``"builtin:pusht"``) wherever a checkpoint is accepted.

``rigid_block=True`` (opt-in, needs gym-pusht): each chunk's last frame, which conditions the next chunk, is re-drawn
by gym-pusht from the agent position and the rigid-T block pose read off it (``pusht_projection``), so the block's
deformation does not carry over from chunk to chunk; ``info["handover_projected"]`` says where a state was found.
``assets_dir=`` (or the environment variable
``COSMOS3_GYM_PUSHT_ASSETS``) points to another folder of that layout, e.g. one written by
``benchmarks/recipes/train_pusht.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...checkpoint import checkpoint_decoder, checkpoint_defaults, read_json_object
from ...data.initial_states import read_initial_states_archive
from ...engine import Cosmos3Engine
from ...envs.core import ENGINE_LOAD_KEYS
from ...envs.vector_env import WorldModelVectorEnv
from ...envs.world_model_env import WorldModelEnv
from ...errors import CheckpointError, InputError
from .registration import ASSETS_ENV_VAR, PUSHT_ENV_ID, PUSHT_MODEL

__all__ = [
    "ASSETS_ENV_VAR",
    "PUSHT_ENV_ID",
    "PushTAssets",
    "builtin_checkpoint_dir",
    "default_assets_dir",
    "fast_pusht_engine",
    "load_pusht_assets",
    "make_pusht_env",
    "make_pusht_vector_env",
    "pusht_env_arguments",
    "pusht_env_defaults",
]

CHECKPOINT_DIR = "checkpoint"
# Paths from the assets folder: both live inside the checkpoint folder (module docstring), whose meta.json names them
# relative to itself.
REWARD_MODEL_DIR = f"{CHECKPOINT_DIR}/reward_model"
INITIAL_STATES_FILE = f"{CHECKPOINT_DIR}/initial_states.npz"
META_FILE = "meta.json"
ACTION_STATS_FILE = "action_stats.json"

# Used where the checkpoint's meta.json leaves a setting out.
FALLBACK_SETTINGS = {
    "domain": "pusht",
    "resolution_tier": 256,
    "fps": 10.0,  # gym-pusht's control rate
    "num_steps": 4,
    "guidance_scale": 1.0,
    "success_threshold": 0.95,  # gym-pusht's success: 95 % of the target covered
    "score_name": "coverage",  # the reward model estimates the covered fraction of the target (gym-pusht's name)
}


def default_assets_dir() -> Path:
    """``$COSMOS3_GYM_PUSHT_ASSETS`` if set, else the package's ``assets/pusht`` folder."""
    return PUSHT_MODEL.assets_dir


@dataclass(frozen=True)
class PushTAssets:
    """The files of a PushT world model folder (see the module docstring), checked to exist."""

    root: Path
    checkpoint: Path
    reward_model: Path
    initial_states: Path
    meta: dict[str, Any]  # checkpoint/meta.json


def load_pusht_assets(assets_dir: str | os.PathLike | None = None) -> PushTAssets:
    """The PushT world model files in ``assets_dir`` (default ``default_assets_dir()``).

    ``CheckpointError`` saying what is missing and how to get it when the folder is not a complete PushT model
    (the case of a package built before the model was trained).
    """
    root = Path(assets_dir).expanduser() if assets_dir is not None else default_assets_dir()
    checkpoint = root / CHECKPOINT_DIR
    expected = [
        checkpoint / META_FILE,
        checkpoint / "model_index.json",
        root / REWARD_MODEL_DIR / "config.json",
        root / INITIAL_STATES_FILE,
    ]
    missing = [str(path.relative_to(root)) for path in expected if not path.is_file()]
    if missing:
        where = (
            f"assets_dir={str(root)!r}"
            if assets_dir is not None
            else (
                f"${ASSETS_ENV_VAR}={str(root)!r}" if os.environ.get(ASSETS_ENV_VAR) else f"the package folder {root}"
            )
        )
        raise CheckpointError(
            f"{PUSHT_ENV_ID}: the built-in PushT world model is not installed ({where} lacks {', '.join(missing)}). "
            "Train one with `python benchmarks/recipes/train_pusht.py --out DIR` and pass "
            f"assets_dir='DIR/assets/pusht' or set {ASSETS_ENV_VAR}, or use cosmos3_gym/WorldModel-v0 with checkpoint=."
        )
    meta = read_json_object(checkpoint / META_FILE)
    return PushTAssets(root, checkpoint, root / REWARD_MODEL_DIR, root / INITIAL_STATES_FILE, meta)


def builtin_checkpoint_dir() -> Path | None:
    """The built-in PushT checkpoint folder if it is installed, else None (for defaults elsewhere)."""
    try:
        return load_pusht_assets().checkpoint
    except CheckpointError:
        return None


def pusht_env_defaults(assets: PushTAssets) -> dict[str, Any]:
    """The ``WorldModelEnv`` arguments of the PushT env: the checkpoint, ``FALLBACK_SETTINGS``, the assets' reward
    model and start frames, all under the checkpoint's own settings (``checkpoint_defaults``: its meta.json and
    action_stats.json). ``action_stats`` is the path of the statistics file."""
    defaults: dict[str, Any] = dict(FALLBACK_SETTINGS)
    defaults["reward_model"] = f"classifier:{assets.reward_model}"
    defaults.update(checkpoint_defaults(assets.checkpoint))
    if "initial_states" not in defaults:  # a meta.json that names none: the assets' archive, read here
        defaults["initial_states"] = read_initial_states(assets.initial_states)
    stats = assets.checkpoint / ACTION_STATS_FILE
    if stats.is_file():
        defaults["action_stats"] = str(stats)  # the path, as the benchmarks read it (minmax, as meta.json says)
    defaults["checkpoint"] = str(assets.checkpoint)
    return defaults


def read_initial_states(path: Path) -> list[dict[str, Any]]:
    """``initial_states.npz`` as the list of ``{"frames", "task"}`` items ``WorldModelEnv`` takes (one per frame)."""
    try:
        return read_initial_states_archive(path)
    except InputError as error:
        raise CheckpointError(f"{PUSHT_ENV_ID}: {error}") from error


def make_pusht_env(assets_dir: str | os.PathLike | None = None, optimize: bool = True, **kwargs: Any) -> WorldModelEnv:
    """``WorldModelEnv`` with the PushT model's defaults; any ``WorldModelEnv`` argument in ``kwargs`` wins.

    ``engine=`` (a shared ``Cosmos3Engine``) replaces the shipped checkpoint. ``optimize`` (default on): the shipped
    checkpoint runs on ``fast_pusht_engine``'s fast path; ``optimize=False`` loads it as ``WorldModel-v0`` would.
    ``decoder``: "light" decodes with the checkpoint's ``light_decoder/`` (``InputError`` when it has none), "vae"
    with the VAE (exact); default: the checkpoint's meta.json ``decoder`` (``checkpoint_decoder``; "light" for the
    built-in model) on the fast path, the VAE with ``optimize=False``. ``rigid_block=True``: re-draw each hand-over
    frame as a rigid T (module docstring).
    """
    return _make_with_builtin_engine(WorldModelEnv, (), pusht_env_arguments(assets_dir, **kwargs), optimize)


def make_pusht_vector_env(
    num_envs: int = 1, assets_dir: str | os.PathLike | None = None, optimize: bool = True, **kwargs: Any
) -> WorldModelVectorEnv:
    """``WorldModelVectorEnv`` with the PushT model's defaults (the ``vector_entry_point`` of ``gym.make_vec``);
    ``optimize`` as for ``make_pusht_env``."""
    return _make_with_builtin_engine(
        WorldModelVectorEnv, (num_envs,), pusht_env_arguments(assets_dir, **kwargs), optimize
    )


def fast_pusht_engine(
    checkpoint: str | os.PathLike, device: Any = None, dtype: Any = None, decoder: str = "vae"
) -> Cosmos3Engine:
    """The engine the PushT env runs by default. On a GPU: ``Cosmos3Engine.optimize(stage_graphs=True)`` (compiled
    blocks, the GEN forward, the VAE encode and the light decode replayed as CUDA graphs, fused decoder norms) and a
    bf16 VAE; on a CPU: the VAE's eager fast path (``Cosmos3VAE.optimize``:
    oneDNN channels-last convolutions, in-place norms, one latent frame per decoder pass), in bf16 where oneDNN has
    native bf16 kernels (AVX512-BF16 / AMX; 1.46x faster than fp32 on the decode there), and no compile (it would
    cost more start-up time than a short run saves). Measured in benchmarks/profile_pusht_env.py and
    benchmarks/pusht_env_throughput_gpu.py (with the fidelity of bf16 against fp32).

    ``decoder="light"`` (the PushT envs' default for a checkpoint whose meta.json says so): the checkpoint's
    ``light_decoder/`` decodes instead of the VAE, in the VAE's dtype above and channels-last
    (``Cosmos3Engine.from_pretrained``); the VAE then only encodes."""
    # The device from_pretrained would pick (init_parallel's default), known before loading for the VAE dtype.
    on_gpu = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    bf16_vae = on_gpu or _cpu_has_native_bf16()
    engine = Cosmos3Engine.from_pretrained(
        checkpoint,
        device=device,
        dtype=dtype,
        decoder=decoder,
        vae_dtype=torch.bfloat16 if bf16_vae else None,
        progress=False,
    )
    if on_gpu:
        # the light decoder's channels-last weights included; the stage graphs: one env steps in 41 instead of 50 ms
        # (light decoder: 8.7 instead of 21.5 ms) on an H200, the same observations (pusht_env_stage_graphs_h200.json)
        engine.optimize(stage_graphs=True)
    elif engine.light_decoder is not None:
        engine.light_decoder.use_channels_last()
    engine.vae.optimize()
    return engine


def _cpu_has_native_bf16() -> bool:
    """oneDNN runs bf16 natively on this CPU (without it, bf16 convolutions are emulated and slower than fp32)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _make_with_builtin_engine(factory, args: tuple, arguments: dict[str, Any], optimize: bool):
    """``factory(*args, **arguments)``, with the shipped checkpoint loaded by ``fast_pusht_engine`` when
    ``optimize`` and it runs in this process (no engine given, tp = cfg = dp = 1); the env owns that engine."""
    # Any engine option but the device, dtype and decoder (several ranks, a backend, a precision, a VAE dtype) is
    # the user's own choice of engine: load_engine handles it, as for WorldModel-v0.
    own_choice = any(name in arguments for name in ENGINE_LOAD_KEYS if name not in ("device", "dtype", "decoder"))
    if not optimize and arguments.get("engine") is None:
        arguments.setdefault("decoder", "vae")  # the baseline path: the exact decode, not the checkpoint's default
    if not optimize or arguments.get("engine") is not None or own_choice:
        return factory(*args, **arguments)
    checkpoint = arguments.pop("checkpoint")
    decoder = arguments.pop("decoder", None) or checkpoint_decoder(checkpoint)
    engine = fast_pusht_engine(checkpoint, arguments.pop("device", None), arguments.pop("dtype", None), decoder=decoder)
    # The env owns this engine, so no other batch size meets it: a vector env's first step is its largest batch, and
    # padding the rarer smaller ones (slots that ended reset instead of stepping) to its CUDA graphs keeps host and
    # GPU memory flat over a long run (cuda_graphs.graph_rows; nothing changes where there are no graphs).
    engine.set_graph_padding(None)
    try:
        env = factory(*args, engine=engine, **arguments)
    except BaseException:
        engine.close()
        raise
    env._core.owns_engine = True  # closed with the env, as an engine the env loaded itself
    return env


def pusht_env_arguments(
    assets_dir: str | os.PathLike | None = None, rigid_block: bool = False, **overrides: Any
) -> dict[str, Any]:
    """The ``WorldModelEnv`` arguments ``make_pusht_env`` uses: the defaults of ``assets_dir`` updated with
    ``overrides`` (an ``engine`` override drops the default checkpoint); ``rigid_block=True`` adds the
    ``handover_projection`` that re-draws each chunk's last frame as a rigid T (``pusht_projection``). Another
    ``reward_model`` without a ``success_threshold`` gets gym-pusht's 0.95, not the checkpoint's (calibrated for
    its own reward model). The env logs the overrides that change a setting of the checkpoint."""
    from .projection import RigidBlockProjection, check_rigid_block  # the simulator's modules: only here

    if check_rigid_block(rigid_block):
        overrides["handover_projection"] = RigidBlockProjection()
    defaults = pusht_env_defaults(load_pusht_assets(assets_dir))
    arguments = {**defaults, **overrides}
    if overrides.get("reward_model") not in (None, defaults["reward_model"]) and "success_threshold" not in overrides:
        # The checkpoint's threshold is its own reward model's score at gym-pusht's success line
        # (benchmarks/reward_model_calibration.py); another scorer gets that line itself.
        arguments["success_threshold"] = FALLBACK_SETTINGS["success_threshold"]
    if arguments.get("engine") is not None and "checkpoint" not in overrides:
        del arguments["checkpoint"]
    return arguments
