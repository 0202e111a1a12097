"""Checkpoint resolution, validation and the tiny random checkpoint."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, Cosmos3OmniTransformer
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

from cosmos3_gym.checkpoint import load_safetensors_state_dict, resolve_checkpoint, validate_checkpoint
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.testing import TINY_SCHEDULER_CONFIG, TINY_TRANSFORMER_CONFIG, TINY_VAE_CONFIG, build_tiny_checkpoint
from cosmos3_gym.tokenizer import SPECIAL_TOKENS


@pytest.fixture
def checkpoint_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint"))


def _message(excinfo: pytest.ExceptionInfo) -> str:
    return str(excinfo.value)


# --------------------------------------------------------------------------------------------------------------
# The tiny checkpoint
# --------------------------------------------------------------------------------------------------------------


def test_tiny_checkpoint_validates_with_diffusers_layout(tiny_checkpoint: Path):
    layout = validate_checkpoint(tiny_checkpoint)

    assert (tiny_checkpoint / "model_index.json").is_file()
    assert layout.root == tiny_checkpoint.resolve()
    assert layout.transformer_weights == (layout.transformer_dir / "diffusion_pytorch_model.safetensors",)
    assert layout.vae_weights == (layout.vae_dir / "diffusion_pytorch_model.safetensors",)
    for key, value in TINY_TRANSFORMER_CONFIG.items():
        assert layout.transformer_config[key] == value, key
    for key, value in TINY_VAE_CONFIG.items():
        assert layout.vae_config[key] == value, key
    for key, value in TINY_SCHEDULER_CONFIG.items():
        assert layout.scheduler_config[key] == value, key
    # Latent statistics are drawn, not the identity, so a missing (de)normalisation cannot go unnoticed.
    assert len(layout.vae_config["latents_mean"]) == 16 and len(layout.vae_config["latents_std"]) == 16
    assert not np.allclose(layout.vae_config["latents_mean"], 0.0)
    assert not np.allclose(layout.vae_config["latents_std"], 1.0)
    assert min(layout.vae_config["latents_std"]) > 0
    total_bytes = sum(f.stat().st_size for f in tiny_checkpoint.rglob("*") if f.is_file())
    assert total_bytes < 5_000_000


def test_tiny_transformer_has_no_trivial_parameters(tiny_checkpoint: Path):
    state_dict = load_safetensors_state_dict(tiny_checkpoint / "transformer")

    assert state_dict["action_modality_embed"].abs().min() > 0
    for name, tensor in state_dict.items():
        assert not torch.all(tensor == 0), f"{name} is all zeros"
        assert not torch.all(tensor == 1), f"{name} is all ones"


def test_load_safetensors_state_dict_matches_diffusers_loading(tiny_checkpoint: Path):
    loaded = load_safetensors_state_dict(tiny_checkpoint / "vae")
    reference = AutoencoderKLWan.from_pretrained(tiny_checkpoint / "vae").state_dict()

    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_pipeline_loads_and_runs_policy_end_to_end(tiny_checkpoint: Path):
    pipeline = Cosmos3OmniPipeline.from_pretrained(tiny_checkpoint, enable_safety_checker=False)
    pipeline.set_progress_bar_config(disable=True)
    image = np.random.default_rng(0).integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
    condition = CosmosActionCondition(
        mode="policy", chunk_size=4, domain_name="pusht", resolution_tier=256, image=image
    )

    output = pipeline(
        prompt="push the T-shaped block onto the target",
        action=condition,
        num_inference_steps=2,
        guidance_scale=2.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    )

    action = output.action[0]
    assert action.shape == (4, 2)  # chunk 4, pusht's raw action width 2
    assert torch.isfinite(action).all() and action.abs().max() > 0
    assert output.video.shape == (5, 256, 256, 3)  # chunk + 1 frames
    assert np.isfinite(output.video).all()


def test_tokenizer_renders_qwen_chat_template_and_special_tokens(tiny_checkpoint: Path):
    pipeline = Cosmos3OmniPipeline.from_pretrained(tiny_checkpoint, enable_safety_checker=False)
    tokenizer = pipeline.text_tokenizer
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "open the drawer"},
    ]

    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nopen the drawer<|im_end|>\n<|im_start|>assistant\n"
    )
    encoded = tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True, add_vision_id=False, return_dict=True
    )
    assert tokenizer.decode(encoded["input_ids"]) == text
    for token in SPECIAL_TOKENS:  # each special token is one id, never split into bytes
        assert tokenizer(token)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"

    # The pipeline's full action prompt is tens of tokens; words the tokenizer never saw still encode.
    cond_ids, uncond_ids = pipeline.tokenize_prompt(
        "pick up the red cup", None, num_frames=5, height=256, width=256, action_mode="policy",
        action_view_point="ego_view",
    )
    assert 20 < len(cond_ids) < 300 and len(uncond_ids) < len(cond_ids)
    unseen = "Zebra xylophone über 12345 ✓"
    assert tokenizer.decode(tokenizer(unseen)["input_ids"]) == unseen


# --------------------------------------------------------------------------------------------------------------
# Malformed checkpoints: every error names the offending path
# --------------------------------------------------------------------------------------------------------------


def _remove_transformer_dir(root: Path) -> Path:
    shutil.rmtree(root / "transformer")
    return root / "transformer"


def _remove_scheduler_config(root: Path) -> Path:
    (root / "scheduler" / "scheduler_config.json").unlink()
    return root / "scheduler" / "scheduler_config.json"


def _write_invalid_json(root: Path) -> Path:
    path = root / "vae" / "config.json"
    path.write_text('{"z_dim": 16,', encoding="utf-8")
    return path


def _drop_required_key(root: Path) -> Path:
    path = root / "transformer" / "config.json"
    config = json.loads(path.read_text())
    del config["hidden_size"]
    path.write_text(json.dumps(config))
    return path


def _mismatch_latent_statistics(root: Path) -> Path:
    path = root / "vae" / "config.json"
    config = json.loads(path.read_text())
    config["latents_std"] = config["latents_std"][:-1]
    path.write_text(json.dumps(config))
    return path


def _mismatch_latent_width(root: Path) -> Path:
    path = root / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["latent_channel"] = 48
    path.write_text(json.dumps(config))
    return path


def _truncate_safetensors(root: Path) -> Path:
    path = root / "vae" / "diffusion_pytorch_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return path


def _corrupt_safetensors_header(root: Path) -> Path:
    path = root / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"not json"
    path.write_bytes(bytes(data))
    return path


def _remove_weights(root: Path) -> Path:
    (root / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    return root / "vae"


def _remove_tokenizer_files(root: Path) -> Path:
    (root / "text_tokenizer" / "tokenizer.json").unlink()
    return root / "text_tokenizer"


@pytest.mark.parametrize(
    "break_checkpoint",
    [
        _remove_transformer_dir,
        _remove_scheduler_config,
        _write_invalid_json,
        _drop_required_key,
        _mismatch_latent_statistics,
        _mismatch_latent_width,
        _truncate_safetensors,
        _corrupt_safetensors_header,
        _remove_weights,
        _remove_tokenizer_files,
    ],
)
def test_malformed_checkpoint_error_names_the_path(checkpoint_copy: Path, break_checkpoint):
    offending_path = break_checkpoint(checkpoint_copy)

    with pytest.raises(CheckpointError) as excinfo:
        validate_checkpoint(checkpoint_copy)
    assert str(offending_path.resolve()) in _message(excinfo)


@pytest.mark.parametrize("break_file", [_truncate_safetensors, _corrupt_safetensors_header])
def test_loading_a_corrupt_weights_file_names_it(checkpoint_copy: Path, break_file):
    broken = break_file(checkpoint_copy)

    with pytest.raises(CheckpointError) as excinfo:
        load_safetensors_state_dict(broken.parent)
    assert str(broken) in _message(excinfo)


def test_sharded_component_loads_and_a_missing_shard_is_named(tiny_checkpoint: Path, checkpoint_copy: Path):
    transformer = Cosmos3OmniTransformer.from_pretrained(tiny_checkpoint / "transformer")
    shutil.rmtree(checkpoint_copy / "transformer")
    transformer.save_pretrained(checkpoint_copy / "transformer", max_shard_size="600KB")
    index_path = checkpoint_copy / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    assert index_path.is_file()

    layout = validate_checkpoint(checkpoint_copy)
    assert len(layout.transformer_weights) > 1
    sharded = load_safetensors_state_dict(layout.transformer_weights)
    single = load_safetensors_state_dict(tiny_checkpoint / "transformer")
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[name], single[name]) for name in single)

    missing_shard = layout.transformer_weights[-1]
    missing_shard.unlink()
    with pytest.raises(CheckpointError) as excinfo:
        validate_checkpoint(checkpoint_copy)
    assert str(missing_shard) in _message(excinfo)


# --------------------------------------------------------------------------------------------------------------
# Resolving paths and hub ids
# --------------------------------------------------------------------------------------------------------------


def test_resolve_returns_local_directory(tiny_checkpoint: Path):
    assert resolve_checkpoint(str(tiny_checkpoint)) == tiny_checkpoint.resolve()


def test_resolve_missing_local_path_names_it(tmp_path: Path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    with pytest.raises(CheckpointError) as excinfo:
        resolve_checkpoint(missing)
    assert str(missing) in _message(excinfo)


def test_resolve_hub_id_offline_fails_fast_naming_the_id(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo_id = "cosmos3-gym-tests/not-a-real-repo"

    start = time.monotonic()
    with pytest.raises(CheckpointError) as excinfo:
        resolve_checkpoint(repo_id)
    assert time.monotonic() - start < 5
    assert repo_id in _message(excinfo)
    assert "local checkpoint directory" in _message(excinfo)


def test_resolve_hub_id_unreachable_hub_names_the_id(monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", unreachable)
    repo_id = "cosmos3-gym-tests/not-a-real-repo"

    with pytest.raises(CheckpointError) as excinfo:
        resolve_checkpoint(repo_id)
    assert repo_id in _message(excinfo)
    assert "network is unreachable" in _message(excinfo)
    assert isinstance(excinfo.value.__cause__, ConnectionError)


# --------------------------------------------------------------------------------------------------------------
# Determinism and overrides
# --------------------------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_weights_and_other_seed_differs(tiny_checkpoint: Path, tmp_path: Path):
    same = build_tiny_checkpoint(tmp_path / "seed0", seed=0)
    other = build_tiny_checkpoint(tmp_path / "seed1", seed=1)

    for component in ("transformer", "vae"):
        reference = load_safetensors_state_dict(tiny_checkpoint / component)
        rebuilt = load_safetensors_state_dict(same / component)
        reseeded = load_safetensors_state_dict(other / component)
        assert all(torch.equal(rebuilt[name], tensor) for name, tensor in reference.items()), component
        assert any(not torch.equal(reseeded[name], tensor) for name, tensor in reference.items()), component
    assert json.loads((same / "vae" / "config.json").read_text()) == json.loads(
        (tiny_checkpoint / "vae" / "config.json").read_text()
    )


def test_overrides_reach_the_saved_configs(tmp_path: Path):
    path = build_tiny_checkpoint(
        tmp_path / "edge",
        num_hidden_layers=3,
        hidden_act="relu2",
        scheduler_overrides={"use_karras_sigmas": True},
    )
    layout = validate_checkpoint(path)

    assert layout.transformer_config["num_hidden_layers"] == 3
    assert layout.transformer_config["hidden_act"] == "relu2"
    assert layout.scheduler_config["use_karras_sigmas"] is True
    transformer = Cosmos3OmniTransformer.from_pretrained(path / "transformer")
    assert len(transformer.layers) == 3


def test_build_rejects_unknown_override_and_non_empty_directory(tiny_checkpoint: Path, tmp_path: Path):
    with pytest.raises(InputError, match="hidden_sise"):
        build_tiny_checkpoint(tmp_path / "typo", hidden_sise=32)
    with pytest.raises(InputError, match="not an empty directory"):
        build_tiny_checkpoint(tiny_checkpoint)


# --------------------------------------------------------------------------------------------------------------
# Built-in names and the settings a checkpoint carries
# --------------------------------------------------------------------------------------------------------------


def test_builtin_names_resolve_to_the_shipped_pusht_model(tmp_path, monkeypatch):
    from cosmos3_gym.registration import builtin_model

    shipped = builtin_model("pusht").checkpoint_dir.resolve()
    monkeypatch.chdir(tmp_path)  # no local folder named "pusht"
    assert resolve_checkpoint("pusht") == resolve_checkpoint("builtin:pusht") == shipped
    validate_checkpoint(resolve_checkpoint("pusht"))
    (tmp_path / "pusht").mkdir()
    assert resolve_checkpoint("pusht") == (tmp_path / "pusht").resolve()  # a local folder of that name wins
    assert resolve_checkpoint("builtin:pusht") == shipped  # the prefix is never ambiguous
    with pytest.raises(CheckpointError, match="unknown built-in model 'builtin:droid'"):
        resolve_checkpoint("builtin:droid")
    monkeypatch.setenv("COSMOS3_GYM_PUSHT_ASSETS", str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match="built-in model 'pusht' is not installed"):
        resolve_checkpoint("builtin:pusht")


def test_checkpoint_defaults_of_the_shipped_pusht_model():
    """Issue 20: infer/eval/demo ran the built-in model with DROID defaults (32 x 10 chunks, guidance 3.0)."""
    from cosmos3_gym.checkpoint import checkpoint_defaults

    defaults = checkpoint_defaults("pusht")
    assert (defaults["domain"], defaults["raw_action_dim"], defaults["chunk"], defaults["resolution_tier"]) == \
        ("pusht", 2, 8, 256)
    assert (defaults["fps"], defaults["num_steps"], defaults["guidance_scale"]) == (10.0, 4, 1.0)
    # success_threshold: the reward model's score at gym-pusht's success line (benchmarks/reward_model_calibration.py)
    assert (defaults["success_threshold"], defaults["max_episode_steps"], defaults["score_name"]) == \
        (0.92, 38, "coverage")
    assert defaults["action_stats"].dim == 2 and defaults["action_stats"].mode == "minmax"
    from cosmos3_gym.data import load_initial_states

    # every frame of initial_states.npz is a start, not only the first
    assert len(load_initial_states(defaults["initial_states"])) > 1
    name, _, path = defaults["reward_model"].partition(":")
    assert name == "classifier" and Path(path).is_absolute() and (Path(path) / "config.json").is_file()


def test_checkpoint_defaults_are_empty_without_meta_and_name_bad_fields(checkpoint_copy):
    from cosmos3_gym.checkpoint import checkpoint_defaults

    assert checkpoint_defaults(checkpoint_copy) == {}
    (checkpoint_copy / "meta.json").write_text(json.dumps({"chunk": 8, "reward_model": "classifier:missing"}))
    with pytest.raises(CheckpointError, match="field 'reward_model' names .*missing, which does not exist"):
        checkpoint_defaults(checkpoint_copy)
    (checkpoint_copy / "meta.json").write_text(json.dumps({"chunk": 8, "reward_model": 3}))
    with pytest.raises(CheckpointError, match="field 'reward_model' must be 'NAME:PATH'"):
        checkpoint_defaults(checkpoint_copy)


def test_the_tiny_checkpoint_factory_lives_in_testing_only():
    """checkpoint.py loads and validates; the factory is cosmos3_gym.testing, which no production module imports
    at import time (only the commands that build a tiny checkpoint on request: make-tiny-checkpoint and the demo's
    random-weight model). The old names still import from checkpoint, with a DeprecationWarning."""
    import ast

    import cosmos3_gym
    import cosmos3_gym.checkpoint as checkpoint_module
    from cosmos3_gym import testing

    package = Path(cosmos3_gym.__file__).parent
    on_request = {"cli.py", "demo.py"}
    for path in package.rglob("*.py"):
        if path.name == "testing.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name.split(".")[-1] == "testing" for name in names):
                top_level = node in tree.body
                assert path.name in on_request and not top_level, f"{path} imports cosmos3_gym.testing"
    assert "build_tiny_checkpoint" not in vars(checkpoint_module)
    with pytest.warns(DeprecationWarning, match="moved to cosmos3_gym.testing.build_tiny_checkpoint"):
        assert checkpoint_module.build_tiny_checkpoint is testing.build_tiny_checkpoint


# --------------------------------------------------------------------------------------------------------------
# Hostile checkpoints (issue 43): paths that leave the folder, pickled weights, damaged or half-written saves
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("initial_states", "../starts.npz"),
    ("initial_states", "/etc/hostname"),
    ("initial_states", "states/../../starts.npz"),
    ("reward_model", "classifier:../reward_model"),
    ("reward_model", "classifier:/tmp"),
])
def test_meta_paths_must_stay_inside_the_checkpoint(checkpoint_copy, field, value):
    from cosmos3_gym.checkpoint import checkpoint_defaults

    np.savez(checkpoint_copy.parent / "starts.npz", frames=np.zeros((1, 8, 8, 3), np.uint8))
    (checkpoint_copy.parent / "reward_model").mkdir()
    (checkpoint_copy / "meta.json").write_text(json.dumps({field: value}))
    with pytest.raises(CheckpointError, match=f"field '{field}' is .*which leads outside the checkpoint folder") as e:
        checkpoint_defaults(checkpoint_copy)
    assert "\n" not in _message(e)


def test_meta_paths_inside_the_checkpoint_resolve_through_links(checkpoint_copy, tmp_path):
    """Inside is judged on the path as written: a hub snapshot's files are links into the hub cache's blobs."""
    from cosmos3_gym.checkpoint import checkpoint_defaults

    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    np.savez(blob.with_suffix(".npz"), frames=np.zeros((2, 8, 8, 3), np.uint8))
    (checkpoint_copy / "initial_states.npz").symlink_to(blob.with_suffix(".npz"))
    (checkpoint_copy / "meta.json").write_text(json.dumps({"initial_states": "./initial_states.npz"}))
    defaults = checkpoint_defaults(checkpoint_copy)
    assert defaults["initial_states"].path == checkpoint_copy.resolve() / "initial_states.npz"


def test_pickled_weights_beside_the_safetensors_are_refused(checkpoint_copy):
    """Issue 43: AutoencoderKLWan.from_pretrained without use_safetensors=True; a checkpoint could ship a .bin."""
    from cosmos3_gym.models.vae import Cosmos3VAE

    pickled = checkpoint_copy / "vae" / "diffusion_pytorch_model.bin"
    torch.save({}, pickled)
    with pytest.raises(CheckpointError, match=r"vae holds pickled weights \['diffusion_pytorch_model.bin'\]") as e:
        validate_checkpoint(checkpoint_copy)
    assert "\n" not in _message(e)
    with pytest.raises(CheckpointError, match="pickled weights"):
        Cosmos3VAE.from_pretrained(checkpoint_copy / "vae")
    pickled.unlink()
    (checkpoint_copy / "vae" / "diffusion_pytorch_model.safetensors").rename(pickled.with_suffix(".safetensors.x"))
    torch.save({}, pickled)  # only a .bin: never loaded in its place
    with pytest.raises(CheckpointError):
        Cosmos3VAE.from_pretrained(checkpoint_copy / "vae")


def test_a_manifest_names_a_truncated_file_and_a_half_written_save_is_refused(checkpoint_copy):
    from cosmos3_gym import storage

    storage.write_manifest(checkpoint_copy)
    validate_checkpoint(checkpoint_copy)
    weights = checkpoint_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size: only the sha256 sees it
    validate_checkpoint(checkpoint_copy)  # cheap: sizes only
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        storage.verify_manifest(checkpoint_copy)
    weights.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=f"{weights} is .* bytes but MANIFEST.json says .*: truncated") as e:
        validate_checkpoint(checkpoint_copy)
    assert "\n" not in _message(e)
    weights.write_bytes(data)
    (checkpoint_copy / storage.STAGING_DIR / "ready").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="holds an interrupted save"):
        validate_checkpoint(checkpoint_copy)
