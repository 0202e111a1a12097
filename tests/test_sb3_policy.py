"""SB3 PPO policies saved as safetensors (cosmos3_gym.agents.sb3_policy): the round trip, the errors on bad files, and
``ppo:PATH`` policy specs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from cosmos3_gym.agents import SB3PolicyAgent, load_sb3_policy, read_sb3_policy_metadata, save_sb3_policy
from cosmos3_gym.errors import CheckpointError, InputError
from cosmos3_gym.tasks.pusht.compare import parse_policy_specs


def test_round_trip_acts_bit_identically_to_the_trained_model(tiny_ppo_model, tmp_path):
    path = save_sb3_policy(tiny_ppo_model, tmp_path / "policies" / "ppo.safetensors", world="world_model",
                           env_steps=64)
    metadata = read_sb3_policy_metadata(path)
    assert metadata["world"] == "world_model" and metadata["env_steps"] == 64
    assert metadata["net_arch"] == [16] and metadata["features_extractor_kwargs"] == {"cnn_output_dim": 16}
    # The shared CNN is stored once, not under each of its three state-dict names.
    with safetensors.safe_open(str(path), framework="pt") as handle:
        assert not any(name.startswith(("pi_features", "vf_features")) for name in handle.keys())

    loaded = load_sb3_policy(path)
    original = tiny_ppo_model.policy
    assert loaded.observation_space == original.observation_space and loaded.action_space == original.action_space
    assert not loaded.training
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.pi_features_extractor is loaded.features_extractor  # still shared, as in the original

    # Frames at the simulator's size, downscaled to the policy's 48 x 48 as the envs did in training.
    frames = np.random.default_rng(0).integers(0, 256, size=(3, 96, 96, 3), dtype=np.uint8)
    expected = SB3PolicyAgent(tiny_ppo_model).act(frames)
    actions = SB3PolicyAgent.from_file(path).act(frames)
    assert actions.shape == (3, 8, 2) and actions.dtype == np.float32
    np.testing.assert_array_equal(actions, expected)
    assert np.abs(actions).max() <= 1.0


def _rewrite(source, target, tensors=None, **metadata_changes):
    """Copy of the policy file ``source`` at ``target`` with its tensors and string metadata changed."""
    with safetensors.safe_open(str(source), framework="pt") as handle:
        metadata = {**handle.metadata(), **metadata_changes}
        stored = {name: handle.get_tensor(name) for name in handle.keys()}
    safetensors.torch.save_file(stored if tensors is None else tensors(stored), str(target), metadata=metadata)
    return target


def test_bad_policy_files_raise_errors_naming_the_file_and_the_problem(tiny_ppo_model, tmp_path):
    good = save_sb3_policy(tiny_ppo_model, tmp_path / "good.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    text = tmp_path / "text.safetensors"
    text.write_text("not a safetensors file")
    bare = tmp_path / "bare.safetensors"
    safetensors.torch.save_file({"weight": torch.zeros(2)}, str(bare))
    cases = {
        tmp_path / "missing.safetensors": "does not exist",
        truncated: "not a readable safetensors file",
        text: "not a readable safetensors file",
        bare: "lacks the metadata",
        _rewrite(good, tmp_path / "format.safetensors", format=json.dumps("other")): "has format 'other'",
        _rewrite(good, tmp_path / "json.safetensors", net_arch="[16"): "not JSON",
        _rewrite(good, tmp_path / "activation.safetensors", activation_fn='"NoSuchLayer"'): "does not describe",
        _rewrite(good, tmp_path / "width.safetensors", net_arch="[32]"): "do not fit",
        _rewrite(good, tmp_path / "tensor.safetensors",
                 tensors=lambda stored: {k: v for k, v in stored.items() if k != "log_std"}): r"missing \['log_std'\]",
    }
    for path, problem in cases.items():
        with pytest.raises(CheckpointError, match=problem) as raised:
            load_sb3_policy(path)
        assert str(path) in str(raised.value)


def test_save_rejects_metadata_that_would_overwrite_the_architecture(tiny_ppo_model, tmp_path):
    with pytest.raises(InputError, match="net_arch"):
        save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors", net_arch=[1])
    with pytest.raises(InputError, match="MultiInputActorCriticPolicy"):
        save_sb3_policy(torch.nn.Linear(1, 1), tmp_path / "ppo.safetensors")


def test_ppo_policy_specs(tiny_ppo_model, tmp_path):
    path = save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors")
    random, ppo = parse_policy_specs(f"random, ppo:{path}")
    assert (ppo.spec, ppo.kind, ppo.path) == (f"ppo:{path}", "ppo", str(path))
    assert ppo.closed_loop_in_world_model and not random.closed_loop_in_world_model
    with pytest.raises(InputError, match="'ppo:/missing.safetensors'.*/missing.safetensors does not exist"):
        parse_policy_specs("random,ppo:/missing.safetensors")
    not_a_policy = tmp_path / "not_a_policy.safetensors"
    safetensors.torch.save_file({"weight": torch.zeros(2)}, str(not_a_policy))
    with pytest.raises(InputError, match=f"policies: 'ppo:{not_a_policy}'.*lacks the metadata"):
        parse_policy_specs(["random", f"ppo:{not_a_policy}"])
