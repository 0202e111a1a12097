"""LoRA fine-tuning (cosmos3_gym.training.lora) of the tiny checkpoint: only the GEN tower's adapters train, and the
merged export loads as a plain diffusers checkpoint whose outputs equal the adapted model's."""

from __future__ import annotations

import json

import pytest
import torch
from test_training import make_dataset, world_model_config

from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import Cosmos3Transformer
from cosmos3_gym.testing import build_tiny_checkpoint
from cosmos3_gym.tokenizer import build_tiny_tokenizer
from cosmos3_gym.training import WorldModelTrainer
from cosmos3_gym.training.distributed import init_distributed
from cosmos3_gym.training.lora import merge_lora_state_dict
from cosmos3_gym.training.world_model import sample_batch, step_generator


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("lora")
    tiny = build_tiny_checkpoint(work / "tiny")
    dataset = make_dataset(work / "dataset", num_episodes=2)
    (work / "tokenizer").mkdir()
    build_tiny_tokenizer().save_pretrained(str(work / "tokenizer"))
    config = world_model_config(work, model={}, init_checkpoint=str(tiny), lora_rank=4, lora_alpha=8.0, steps=3,
                                lr=1e-2, ema_decay=0.0, tokenizer_dir=str(work / "tokenizer"))
    ctx = init_distributed("cpu")
    try:
        trainer = WorldModelTrainer(dataset, work / "out", config, tiny / "vae", ctx)
        trainer.train()
        out = trainer.export()
    finally:
        ctx.close()
    return tiny, trainer, out


def test_only_the_gen_adapters_train(trained):
    tiny, trainer, _ = trained
    base = Cosmos3Transformer.from_pretrained(tiny / "transformer").state_dict()
    adapted = trainer.transformer.state_dict()
    adapters = [k for k in adapted if ".lora_" in k]
    assert adapters and all(k.startswith("gen_layers.") for k in adapters)
    assert {k.split(".lora_")[0].split(".", 2)[2] for k in adapters} == {"attn.qkv", "attn.out", "mlp.gate_up",
                                                                         "mlp.down"}
    assert any(not torch.equal(adapted[k], torch.zeros_like(adapted[k])) for k in adapters if ".lora_B." in k)
    for key, value in adapted.items():  # every base weight is the checkpoint's, bit for bit
        if ".lora_" not in key:
            assert torch.equal(value, base[key.replace(".base_layer.", ".")]), key
    trainable = {n for n, p in trainer.transformer.named_parameters() if p.requires_grad}
    assert trainable == set(adapters)


@torch.no_grad()
def test_merged_export_equals_the_adapted_model(trained):
    tiny, trainer, out = trained
    merged = Cosmos3Transformer.from_pretrained(out / "transformer")
    base = Cosmos3Transformer.from_pretrained(tiny / "transformer")
    batch = sample_batch(trainer.windows, step_generator(5, 0, 0), trainer.config, domain_id=trainer.domain_id,
                         raw_action_dim=trainer.raw_action_dim, action_dim=merged.config.action_dim, fps=trainer.fps)
    outputs = {}
    for name, model in (("adapted", trainer.transformer), ("merged", merged), ("base", base)):
        objective = type(trainer.objective)(model)
        result = objective(batch)
        # per-sample errors (NaN where a sample has no noisy video / actions) and the loss
        outputs[name] = torch.cat([result["video_mse"], result["action_mse"], result["loss"][None]]).nan_to_num(-1.0)
    torch.testing.assert_close(outputs["merged"], outputs["adapted"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outputs["base"], outputs["adapted"], rtol=1e-4, atol=1e-6)  # the adapters did move it
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train_steps"] == 3


def test_merge_folds_the_scaled_product_and_checks_its_input():
    a, b, w = torch.randn(2, 5), torch.randn(3, 2), torch.randn(3, 5)
    state = {"x.base_layer.weight": w, "x.base_layer.bias": torch.ones(3), "x.lora_A.default.weight": a,
             "x.lora_B.default.weight": b, "y.weight": torch.zeros(1)}
    merged = merge_lora_state_dict(state, 0.5)
    assert set(merged) == {"x.weight", "x.bias", "y.weight"}
    torch.testing.assert_close(merged["x.weight"], w + 0.5 * b @ a)
    with pytest.raises(InputError, match="lora_rank"):
        world_model_config(__import__("pathlib").Path("/tmp"), lora_rank=-1).validate()
