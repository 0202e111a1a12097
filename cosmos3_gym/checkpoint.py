"""Find, check and read Cosmos3 policy checkpoints (the tiny random test checkpoint is ``cosmos3_gym.testing``).

A checkpoint is a diffusers ``Cosmos3OmniPipeline`` directory, laid out like ``nvidia/Cosmos3-Nano-Policy-DROID``::

    model_index.json
    transformer/            config.json + *.safetensors (or shards listed by *.safetensors.index.json)
    vae/                    config.json + *.safetensors (AutoencoderKLWan, Wan2.2 shape)
    scheduler/              scheduler_config.json (UniPCMultistepScheduler)
    text_tokenizer/         Qwen tokenizer files + chat template

    meta.json               optional: the settings the checkpoint was trained for (see ``checkpoint_defaults``)
    action_stats.json       optional: the dataset's action statistics

``resolve_checkpoint`` turns a local path, a hub id or a built-in name (``NAME`` / ``builtin:NAME``) into a
directory, ``validate_checkpoint`` checks every part cheaply (JSON parses, required config keys, safetensors headers
and lengths) and names the exact file that is wrong, and ``checkpoint_defaults`` reads the settings a checkpoint
carries, which every entry point (envs, agents, CLI) uses unless the user overrides them.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cosmos3_gym.errors import CheckpointError
from cosmos3_gym.registration import builtin_model, builtin_models
from cosmos3_gym.storage import check_no_interrupted_save, is_weights_file, verify_manifest

TRANSFORMER_DIR = "transformer"
VAE_DIR = "vae"
TEXT_TOKENIZER_DIR = "text_tokenizer"
SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"

# Index files naming the shards of a sharded component: diffusers writes the first, transformers-style exports the
# second.
WEIGHT_INDEX_NAMES = ("diffusion_pytorch_model.safetensors.index.json", "model.safetensors.index.json")

# Keys the engine reads from transformer/config.json to build the model; `Cosmos3OmniTransformer` has defaults for
# them, but a config without them describes no particular model, so it is rejected rather than silently defaulted.
REQUIRED_TRANSFORMER_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "patch_latent_dim",
)
# The latent statistics (de)normalise every latent, so they must be present and match the latent width.
REQUIRED_VAE_KEYS = ("z_dim", "latents_mean", "latents_std")

# safetensors stores an 8-byte little-endian header length, then a JSON header of at most 100 MB.
_SAFETENSORS_MAX_HEADER_BYTES = 100_000_000

# A hub id is "org/name" with the characters the hub allows.
_HUB_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Only the parts this project loads; skips e.g. the unused vision_encoder/ of the HF export.
_HUB_ALLOW_PATTERNS = [
    "model_index.json",
    "meta.json",
    "action_stats.json",
    f"{TRANSFORMER_DIR}/*",
    f"{VAE_DIR}/*",
    f"{TEXT_TOKENIZER_DIR}/*",
    f"{SCHEDULER_CONFIG.parent.as_posix()}/*",
]
# Pickled weights are never loaded (torch.load runs code), so they are never fetched either.
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_IGNORE_PATTERNS = [f"*{suffix}" for suffix in PICKLE_WEIGHT_SUFFIXES]
# Seconds to wait for the hub before concluding it is unreachable.
HUB_TIMEOUT_S = 10.0
_OFFLINE_ENV_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


# ----------------------------------------------------------------------------------------------------------------
# Resolving a path or hub id
# ----------------------------------------------------------------------------------------------------------------


BUILTIN_PREFIX = "builtin:"


def builtin_model_name(path_or_id: Any) -> str | None:
    """The name of the built-in model ``path_or_id`` names (``"NAME"`` where no local folder of that name exists, or
    ``"builtin:NAME"``; models are registered by tasks, ``cosmos3_gym.registration``), else None."""
    if not isinstance(path_or_id, (str, os.PathLike)):
        return None
    text = os.fspath(path_or_id)
    if text.startswith(BUILTIN_PREFIX):
        return text[len(BUILTIN_PREFIX) :]
    return text if builtin_model(text) is not None and not Path(text).expanduser().is_dir() else None


def resolve_checkpoint(path_or_id: str | os.PathLike) -> Path:
    """Return the local directory of a checkpoint given as a local path, a built-in name or a hub id ("org/name").

    A local directory is returned as is (resolved). ``builtin:NAME`` (or ``NAME`` where no local folder of that
    name exists) is a built-in model a task registered (``cosmos3_gym.registration``). Anything else that looks like
    a hub id is fetched with
    ``huggingface_hub.snapshot_download`` (the local cache is tried first, without network); when the hub is
    offline or unreachable, or the repo does not exist, ``CheckpointError`` is raised at once.
    """
    text = os.fspath(path_or_id)
    local_path = Path(text).expanduser()
    name = builtin_model_name(text)
    if name is None and local_path.is_dir():
        return local_path.resolve()
    if name is not None:
        model = builtin_model(name)
        if model is None:
            raise CheckpointError(
                f"checkpoint: unknown built-in model {text!r}; expected one of "
                f"{[BUILTIN_PREFIX + known for known in builtin_models()]}"
            )
        directory = model.checkpoint_dir
        if not (directory / "model_index.json").is_file():
            where = f" (or set {model.env_var} to a folder of that layout)" if model.env_var else ""
            raise CheckpointError(
                f"checkpoint: the built-in model {name!r} is not installed ({directory} has no model_index.json){where}"
            )
        return directory.resolve()
    if local_path.exists():
        raise CheckpointError(f"checkpoint: {local_path} is a file; expected a checkpoint directory or a hub id")
    if not _HUB_ID_PATTERN.match(text):
        raise CheckpointError(f"checkpoint: {local_path} does not exist (and is not a hub id like 'org/name')")
    return _download_from_hub(text)


def _hub_is_offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once, at import; the environment is read again here so that setting it
    # later in the process still counts.
    from huggingface_hub import constants

    offline_values = {"1", "ON", "YES", "TRUE"}
    env_offline = any(os.environ.get(name, "").upper() in offline_values for name in _OFFLINE_ENV_VARS)
    return env_offline or bool(constants.HF_HUB_OFFLINE)


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import HfApi, snapshot_download

    not_local = f"checkpoint: {repo_id!r} is not a local directory"
    pass_local = "pass the path of a local checkpoint directory instead"
    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=_HUB_ALLOW_PATTERNS, ignore_patterns=_HUB_IGNORE_PATTERNS, local_files_only=True
            )
        )
    except Exception:  # not (completely) in the local cache: fetch it below
        pass
    if _hub_is_offline():
        raise CheckpointError(
            f"{not_local}, is not in the Hugging Face cache, and the hub is offline ({' / '.join(_OFFLINE_ENV_VARS)} "
            f"is set); {pass_local}"
        )
    try:
        # The default HTTP client waits forever on a silent network; one bounded request fails fast instead.
        HfApi().repo_info(repo_id, timeout=HUB_TIMEOUT_S)
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=_HUB_ALLOW_PATTERNS,
                ignore_patterns=_HUB_IGNORE_PATTERNS,
                etag_timeout=HUB_TIMEOUT_S,
            )
        )
    # The HTTP client (requests, httpx) and so its exception types differ between huggingface_hub versions; any
    # failure here means the checkpoint could not be fetched, and the cause stays chained.
    except Exception as error:
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise CheckpointError(
            f"{not_local} and could not be fetched from the Hugging Face hub ({type(error).__name__}: {first_line}); "
            f"{pass_local}"
        ) from error


# ----------------------------------------------------------------------------------------------------------------
# Validating the layout
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointLayout:
    """The checked parts of a checkpoint directory: component paths, weight files and parsed configs."""

    root: Path
    transformer_dir: Path
    vae_dir: Path
    text_tokenizer_dir: Path
    scheduler_config_path: Path
    transformer_weights: tuple[Path, ...]
    vae_weights: tuple[Path, ...]
    transformer_config: dict[str, Any]
    vae_config: dict[str, Any]
    scheduler_config: dict[str, Any]


def validate_checkpoint(path: str | os.PathLike) -> CheckpointLayout:
    """Check a local checkpoint directory and return its layout; ``CheckpointError`` names the first bad path.

    Reads only configs and safetensors headers (a few KB per file), so it is cheap even for the full model. A
    checkpoint written by this package (``training.export``) carries a MANIFEST.json: every weights file it lists must
    exist with its size (``storage.verify_manifest(root)`` checks every file's sha256; configs such as meta.json may be
    edited, and are checked field by field), and a checkpoint left mid-save by a
    crash is refused (``storage.finish_interrupted_save`` completes it). Pickled weights (``.bin``, ``.pt``, ...) in a
    weights folder are refused: only safetensors are loaded.
    """
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint: {root} is not a directory")
    check_no_interrupted_save(root)
    verify_manifest(root, checksums=False, required=False, only=is_weights_file)
    transformer_dir = _require_dir(root / TRANSFORMER_DIR)
    vae_dir = _require_dir(root / VAE_DIR)
    text_tokenizer_dir = _require_dir(root / TEXT_TOKENIZER_DIR)
    scheduler_config_path = root / SCHEDULER_CONFIG

    transformer_config = _read_config(transformer_dir / "config.json", REQUIRED_TRANSFORMER_KEYS)
    vae_config = _read_config(vae_dir / "config.json", REQUIRED_VAE_KEYS)
    _check_latent_statistics(vae_dir / "config.json", vae_config)
    _check_latent_width(transformer_dir / "config.json", transformer_config, vae_config["z_dim"])
    scheduler_config = _read_config(scheduler_config_path, required_keys=())
    _check_tokenizer_files(text_tokenizer_dir)

    transformer_weights = safetensors_files(transformer_dir)
    vae_weights = safetensors_files(vae_dir)
    for weights_file in (*transformer_weights, *vae_weights):
        check_safetensors_file(weights_file)

    return CheckpointLayout(
        root=root,
        transformer_dir=transformer_dir,
        vae_dir=vae_dir,
        text_tokenizer_dir=text_tokenizer_dir,
        scheduler_config_path=scheduler_config_path,
        transformer_weights=transformer_weights,
        vae_weights=vae_weights,
        transformer_config=transformer_config,
        vae_config=vae_config,
        scheduler_config=scheduler_config,
    )


# meta.json keys that are env settings of the same name (``WorldModelSettings`` fields).
META_SETTING_KEYS = (
    "domain",
    "raw_action_dim",
    "chunk",
    "resolution_tier",
    "fps",
    "num_steps",
    "guidance_scale",
    "task",
    "reward_mode",
    "success_threshold",
    "max_episode_steps",
    "score_name",
    "context_frames",
    "handover",
    "action_history_length",
    "context_noise",
)
# meta.json "handover": how a checkpoint's chunks hand over to the next. "pixels" (every released checkpoint): the
# chunk's decoded last frame is encoded again as the next chunk's clean frame; "latent": the last "context_frames"
# latent frames are the next chunk's clean context, never re-encoded (the env and training both follow it).
HANDOVERS = ("pixels", "latent")
META_FILE = "meta.json"
ACTION_STATS_FILE = "action_stats.json"


@dataclass(frozen=True)
class StartFramesArchive:
    """A checkpoint's ``initial_states`` archive: an ``.npz`` of start frames ``frames [N, H, W, 3]`` (optional 0-d
    ``task``) that gives N start states (``cosmos3_gym.data.load_initial_states`` reads it; an ``.npz`` a user passes
    as ``initial_states`` is one start state, its first frame)."""

    path: Path


def checkpoint_decoder(path_or_id: str | os.PathLike) -> str:
    """What a checkpoint's envs decode with unless told otherwise: its meta.json's ``decoder`` ("vae", the exact
    decode, or "light", its ``light_decoder/``), else "vae"."""
    meta = resolve_checkpoint(path_or_id) / META_FILE
    decoder = read_json_object(meta).get("decoder", "vae") if meta.is_file() else "vae"
    if decoder not in ("vae", "light"):
        raise CheckpointError(f"checkpoint: {meta} field 'decoder': expected 'vae' or 'light', got {decoder!r}")
    return decoder


def checkpoint_defaults(path_or_id: str | os.PathLike) -> dict[str, Any]:
    """The settings a checkpoint carries, as keyword arguments of the envs and agents (``WorldModelSettings``
    fields plus ``initial_states`` and ``reward_model``). Empty for a checkpoint without ``meta.json``.

    From ``meta.json``: the ``META_SETTING_KEYS`` it has; ``initial_states`` (a path relative to the checkpoint, inside
    it; an ``.npz`` is a ``StartFramesArchive``, N start states); ``reward_model`` (a reward spec ``NAME:PATH``, PATH
    relative to the checkpoint, inside it). Paths that lead outside the checkpoint folder are refused. From
    ``action_stats.json``: ``action_stats`` (a ``processor.ActionStats`` in meta's ``action_normalization`` mode,
    default minmax). Entry points use these unless the user overrides them (and log what was overridden).
    """
    from cosmos3_gym.processor import ActionStats

    root = resolve_checkpoint(path_or_id)
    meta_path = root / META_FILE
    meta = read_json_object(meta_path) if meta_path.is_file() else {}
    defaults: dict[str, Any] = {key: meta[key] for key in META_SETTING_KEYS if key in meta}
    stats_path = root / ACTION_STATS_FILE
    if stats_path.is_file():
        defaults["action_stats"] = ActionStats.from_json(stats_path, mode=meta.get("action_normalization", "minmax"))
    if "initial_states" in meta:
        states = _relative_file(root, meta["initial_states"], "initial_states")
        defaults["initial_states"] = StartFramesArchive(states) if states.suffix == ".npz" else str(states)
    if "reward_model" in meta:
        spec = meta["reward_model"]
        name, colon, argument = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        if not colon or not argument:
            raise CheckpointError(f"checkpoint: {meta_path} field 'reward_model' must be 'NAME:PATH', got {spec!r}")
        argument, question, query = argument.partition("?")
        resolved = _relative_file(root, argument, "reward_model")
        defaults["reward_model"] = f"{name}:{resolved}{question}{query}"
    return defaults


def _relative_file(root: Path, value: Any, key: str) -> Path:
    """A meta.json path: relative to the checkpoint and inside it (a checkpoint names only its own files). The check
    is on the path as written, not through symbolic links: a hub snapshot's files are links into the hub cache."""
    if not isinstance(value, str) or not value:
        raise CheckpointError(f"checkpoint: {root / META_FILE} field {key!r} must be a path, got {value!r}")
    relative = os.path.normpath(value)
    if os.path.isabs(value) or relative == os.pardir or relative.startswith(os.pardir + os.sep) or "\0" in value:
        raise CheckpointError(
            f"checkpoint: {root / META_FILE} field {key!r} is {value!r}, which leads outside the checkpoint folder "
            f"{root}; expected a path inside it"
        )
    path = root.resolve() / relative
    if not path.exists():
        raise CheckpointError(f"checkpoint: {root / META_FILE} field {key!r} names {path}, which does not exist")
    return path


def _require_dir(path: Path) -> Path:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: missing directory {path}")
    return path


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object; ``CheckpointError`` names the file and the fault."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint: missing file {path}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint: {path} is not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"checkpoint: {path} must hold a JSON object, got {type(value).__name__}")
    return value


def _read_config(path: Path, required_keys: Iterable[str]) -> dict[str, Any]:
    config = read_json_object(path)
    missing = [key for key in required_keys if key not in config]
    if missing:
        raise CheckpointError(f"checkpoint: {path} lacks required keys {missing}")
    return config


def _check_latent_statistics(path: Path, vae_config: Mapping[str, Any]) -> None:
    z_dim = vae_config["z_dim"]
    for key in ("latents_mean", "latents_std"):
        values = vae_config[key]
        if not isinstance(values, list) or len(values) != z_dim or not all(isinstance(v, (int, float)) for v in values):
            raise CheckpointError(f"checkpoint: {path} field {key!r} must be a list of z_dim={z_dim} numbers")
    if any(value <= 0 for value in vae_config["latents_std"]):
        raise CheckpointError(f"checkpoint: {path} field 'latents_std' must be positive")


def _check_latent_width(path: Path, transformer_config: Mapping[str, Any], z_dim: int) -> None:
    # A transformer and VAE from different models load fine separately and only fail deep inside the first step.
    latent_channel = transformer_config.get("latent_channel", z_dim)
    if latent_channel != z_dim:
        raise CheckpointError(
            f"checkpoint: {path} field 'latent_channel' is {latent_channel}, but the VAE's z_dim is {z_dim}"
        )


def _check_tokenizer_files(tokenizer_dir: Path) -> None:
    tokenizer_json = tokenizer_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        read_json_object(tokenizer_json)
    elif not ((tokenizer_dir / "vocab.json").is_file() and (tokenizer_dir / "merges.txt").is_file()):
        raise CheckpointError(
            f"checkpoint: {tokenizer_dir} has no tokenizer files (expected tokenizer.json, or vocab.json + merges.txt)"
        )
    tokenizer_config = tokenizer_dir / "tokenizer_config.json"
    if tokenizer_config.exists():
        read_json_object(tokenizer_config)


def safetensors_files(component_dir: str | os.PathLike) -> tuple[Path, ...]:
    """The weight files of a component directory: the shards its index names, or else its ``*.safetensors``.

    Pickled weights in the folder (``.bin``, ``.pt``, ...: diffusers and transformers would load them, running
    whatever code they hold) are refused with ``CheckpointError`` naming them."""
    component_dir = Path(component_dir)
    check_no_pickle_weights(component_dir)
    for index_name in WEIGHT_INDEX_NAMES:
        index_path = component_dir / index_name
        if index_path.exists():
            weight_map = read_json_object(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"checkpoint: {index_path} has no 'weight_map' object")
            shards = tuple(component_dir / name for name in sorted(set(weight_map.values())))
            for shard in shards:
                if not shard.is_file():
                    raise CheckpointError(f"checkpoint: missing shard {shard} (named in {index_path})")
            return shards
    files = tuple(sorted(component_dir.glob("*.safetensors")))
    if not files:
        raise CheckpointError(f"checkpoint: no *.safetensors weights in {component_dir}")
    return files


def check_no_pickle_weights(component_dir: str | os.PathLike) -> None:
    """``CheckpointError`` when a weights folder holds pickled weights (module docstring of ``safetensors_files``)."""
    component_dir = Path(component_dir)
    pickles = sorted(p.name for p in component_dir.glob("*") if p.suffix in PICKLE_WEIGHT_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"checkpoint: {component_dir} holds pickled weights {pickles}; only safetensors are loaded, remove them"
        )


def check_safetensors_file(path: str | os.PathLike) -> None:
    """Check a safetensors file from its header alone: the header parses and the file holds all the data it lists.

    Catches truncated downloads and files that are not safetensors without reading the tensors.
    """
    path = Path(path)
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        length_bytes = handle.read(8)
        if len(length_bytes) < 8:
            raise CheckpointError(f"checkpoint: {path} is too short ({file_size} bytes) to be a safetensors file")
        (header_length,) = struct.unpack("<Q", length_bytes)
        if header_length > _SAFETENSORS_MAX_HEADER_BYTES or 8 + header_length > file_size:
            raise CheckpointError(
                f"checkpoint: {path} is not a valid safetensors file (header length {header_length}, file size "
                f"{file_size}): truncated or corrupt"
            )
        header_bytes = handle.read(header_length)
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint: {path} has an unreadable safetensors header ({error})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint: {path} has a safetensors header that is not a JSON object")

    data_length = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (  # well formed
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(offset, int) for offset in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(f"checkpoint: {path} has a malformed safetensors entry for tensor {name!r}")
        data_length = max(data_length, offsets[1])
    available = file_size - 8 - header_length
    if available < data_length:
        raise CheckpointError(
            f"checkpoint: {path} is truncated: its header lists {data_length} bytes of tensor data but the file "
            f"holds {available}"
        )


def load_safetensors_state_dict(
    paths_or_dir: str | os.PathLike | Iterable[str | os.PathLike], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Load all shards of a component (a component directory, one file, or a list of files) into one state dict.

    safetensors only (never ``torch.load``); a corrupt or truncated file raises ``CheckpointError`` naming it.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if isinstance(paths_or_dir, (str, os.PathLike)):
        single = Path(paths_or_dir)
        paths = safetensors_files(single) if single.is_dir() else (single,)
    else:
        paths = tuple(Path(p) for p in paths_or_dir)

    state_dict: dict[str, torch.Tensor] = {}
    for path in paths:
        if not path.is_file():
            raise CheckpointError(f"checkpoint: missing weights file {path}")
        check_safetensors_file(path)
        try:
            tensors = load_file(path, device=str(device))
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"checkpoint: cannot read safetensors file {path} ({error})") from error
        duplicates = state_dict.keys() & tensors.keys()
        if duplicates:
            raise CheckpointError(f"checkpoint: {path} repeats tensors from another shard: {sorted(duplicates)[:5]}")
        state_dict.update(tensors)
    return state_dict


# The sampler settings of the native policy server (linear flow sigmas, shift 5, order-2 UniPC bh2): the scheduler
# config of checkpoints this project writes (training exports, the tiny test checkpoints).
POLICY_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 5.0,
    "solver_order": 2,
    "solver_type": "bh2",
    "final_sigmas_type": "zero",
    "use_karras_sigmas": False,
}


# Names that moved out of this module (loading and validation only): the tiny-checkpoint factory to
# ``cosmos3_gym.testing``, the small tokenizer to ``cosmos3_gym.tokenizer``. Kept importable from here, deprecated.
_MOVED = {
    "TINY_TRANSFORMER_CONFIG": "testing",
    "TINY_VAE_CONFIG": "testing",
    "TINY_SCHEDULER_CONFIG": "testing",
    "build_tiny_checkpoint": "testing",
    "TINY_TOKENIZER_VOCAB_SIZE": "tokenizer",
    "PAD_TOKEN": "tokenizer",
    "EOS_TOKEN": "tokenizer",
    "SPECIAL_TOKENS": "tokenizer",
    "QWEN_CHAT_TEMPLATE": "tokenizer",
    "build_tiny_tokenizer": "tokenizer",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings

    module = f"cosmos3_gym.{_MOVED[name]}"
    warnings.warn(f"cosmos3_gym.checkpoint.{name} moved to {module}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
