"""``precision="fp8"`` (cosmos3_gym/quantization.py): which GEN-layer GEMMs each layer policy quantizes, the errors
on CPU, on pre-Hopper GPUs and for unknown names; with tensor parallelism, the shards it quantizes and the parallel
plan it gets (NCCL, no overlap). On a GPU with FP8 tensor cores, the FP8 forward and engine against bf16, and on two
such GPUs a tp=2 FP8 engine against the one-GPU FP8 engine. Speed and the error on Nano-size and trained weights:
benchmarks/fp8_gpu.py."""

import numpy as np
import pytest
import torch
from dist_utils import run_distributed

from cosmos3_gym import quantization
from cosmos3_gym.checkpoint import resolve_checkpoint, validate_checkpoint
from cosmos3_gym.cli import main
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig
from cosmos3_gym.parallel.mesh import ParallelConfig, ParallelContext
from cosmos3_gym.parallel.overlap import OverlappedGenForward
from cosmos3_gym.parallel.plan import parallelize_transformer
from cosmos3_gym.parallel.tensor_parallel import RowParallelLinear, apply_tensor_parallel, is_quantized
from cosmos3_gym.quantization import (
    FP8_LAYER_POLICIES,
    apply_fp8,
    check_fp8_supported,
    check_precision,
    fp8_linear_names,
)
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG

has_fp8_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(not has_fp8_gpu, reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")


def gen_names(layers, linears):
    return [f"gen_layers.{i}.{name}" for i in layers for name in linears]


ALL = ("attn.qkv", "attn.out", "mlp.gate_up", "mlp.down")
NO_QKV = ("attn.out", "mlp.gate_up", "mlp.down")
MLP = ("mlp.gate_up", "mlp.down")


@pytest.fixture(scope="module")
def tiny_transformer(tiny_checkpoint):
    layout = validate_checkpoint(resolve_checkpoint(tiny_checkpoint))
    return Cosmos3Transformer.from_pretrained(layout.transformer_dir)


def test_policies_pick_the_named_gen_linears_of_the_tiny_checkpoint(tiny_transformer):
    assert len(tiny_transformer.gen_layers) == 2  # so first and last are all the layers there are
    expected = {
        "all": gen_names([0, 1], ALL),
        "keep_qkv": gen_names([0, 1], NO_QKV),
        "keep_edges": [],
        "keep_qkv_edges": [],
        "mlp_only": gen_names([0, 1], MLP),
    }
    assert set(expected) == set(FP8_LAYER_POLICIES)
    for policy, names in expected.items():
        assert fp8_linear_names(tiny_transformer, policy) == names, policy
    # Never the UND tower, the patch embedding / velocity head, the time embedder or the action heads.
    every_linear = {name for name, module in tiny_transformer.named_modules() if isinstance(module, torch.nn.Linear)}
    assert {"proj_in", "proj_out", "time_embedder.linear_1", "text_layers.0.attn.qkv"} <= every_linear
    assert set(fp8_linear_names(tiny_transformer, "all")) == {n for n in every_linear if n.startswith("gen_layers.")}


def test_edge_policies_keep_the_first_and_last_gen_layers():
    with torch.device("meta"):
        model = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG,
                                                                       "num_hidden_layers": 5}))
    assert fp8_linear_names(model, "keep_edges") == gen_names([1, 2, 3], ALL)
    assert fp8_linear_names(model, "keep_qkv_edges") == gen_names([1, 2, 3], NO_QKV)
    assert fp8_linear_names(model) == fp8_linear_names(model, quantization.DEFAULT_FP8_LAYERS)


def test_gemms_that_scaled_mm_cannot_run_are_left_out():
    # hidden 64 stays a multiple of 16, an intermediate size of 40 does not: gate_up (64 -> 80) fits, down (40 ->
    # 64) does not, and torchao would silently leave it in bf16.
    with torch.device("meta"):
        model = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG,
                                                                       "intermediate_size": 40}))
    assert fp8_linear_names(model, "mlp_only") == gen_names([0, 1], ("mlp.gate_up",))


def test_unknown_policy_and_precision_are_input_errors(tiny_transformer, tiny_checkpoint):
    with pytest.raises(InputError, match="layers: expected an FP8 layer policy"):
        fp8_linear_names(tiny_transformer, "keep_qk")
    with pytest.raises(InputError, match="layers: expected an FP8 layer policy"):
        apply_fp8(tiny_transformer, layers="everything")
    with pytest.raises(InputError, match="precision: expected one of"):
        Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", precision="int8")


def test_fp8_on_cpu_is_an_input_error_and_changes_nothing(tiny_transformer, tiny_checkpoint, tmp_path, capsys):
    before = {name: p.clone() for name, p in tiny_transformer.named_parameters()}
    with pytest.raises(InputError, match="precision: 'fp8' needs a CUDA GPU"):
        apply_fp8(tiny_transformer, layers="all")
    for name, p in tiny_transformer.named_parameters():
        assert type(p.data) is torch.Tensor and torch.equal(p, before[name]), name
    with pytest.raises(InputError, match="precision: 'fp8' needs a CUDA GPU"):
        Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", precision="fp8", progress=False)
    image = tmp_path / "frame.png"
    from PIL import Image

    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(image)
    assert main(["infer", "--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "run"), "--image",
                 str(image), "--device", "cpu", "--precision", "fp8"]) == 2
    assert "precision: 'fp8' needs a CUDA GPU" in capsys.readouterr().err


def test_pre_hopper_gpu_is_an_input_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(InputError, match=r"compute capability >= 8\.9.*A100-SXM4-80GB has 8\.0"):
        check_fp8_supported(torch.device("cuda", 0))


def test_missing_torchao_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(InputError, match=r"needs torchao \(pip install 'cosmos3_gym\[fp8\]'"):
        check_fp8_supported(torch.device("cuda", 0))


class FakeQuantized(torch.Tensor):
    """A weight of a tensor subclass, as torchao's ``Float8Tensor`` is, for the CPU tests (torchao quantizes on FP8
    GPUs only)."""


def fake_quantize(module: torch.nn.Module) -> None:
    module.weight = torch.nn.Parameter(module.weight.detach().as_subclass(FakeQuantized), requires_grad=False)


def sharded_tiny_transformer(monkeypatch, **overrides) -> Cosmos3Transformer:
    """Rank 0's shards of a tp=2 tiny transformer, without a process group: sharding runs no collective, only asks
    the group's size and rank."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    model = Cosmos3Transformer(Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, **overrides}))
    return apply_tensor_parallel(model, tp_group=None)


def test_fp8_with_tensor_parallelism_is_no_longer_refused(tiny_checkpoint, stub_engine_client):
    # Outside a process group a tp=2 from_pretrained starts the worker ranks (stubbed here), each to quantize its
    # shards; unknown names still fail before anything starts.
    with pytest.warns(DeprecationWarning):
        assert Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", tp=2, precision="fp8") == "client"
    (_, config, kwargs), = stub_engine_client
    assert config.tp == 2 and kwargs["precision"] == "fp8"
    with pytest.raises(InputError, match=r"precision: expected one of \['bf16', 'fp8'\], got 'fp4'"):
        check_precision("fp4")


def test_fp8_names_the_shards_of_a_tensor_parallel_model(monkeypatch):
    model = sharded_tiny_transformer(monkeypatch)
    assert isinstance(model.gen_layers[0].attn.out, RowParallelLinear)
    assert fp8_linear_names(model, "all") == gen_names([0, 1], ALL)
    assert fp8_linear_names(model, "keep_qkv") == gen_names([0, 1], NO_QKV)  # the row-parallel out and down too
    # The local shapes count: with intermediate_size 40 the full gate_up (64 -> 80) fits, rank 0's shard (64 -> 40)
    # does not, nor does its down (20 -> 64).
    narrow = sharded_tiny_transformer(monkeypatch, intermediate_size=40)
    assert fp8_linear_names(narrow, "mlp_only") == []
    # On CPU apply_fp8 gets as far as the device check: no refusal of the sharded model.
    with pytest.raises(InputError, match="precision: 'fp8' needs a CUDA GPU"):
        apply_fp8(model)


def test_fp8_after_the_symmetric_memory_all_reduce_is_refused(monkeypatch):
    model = sharded_tiny_transformer(monkeypatch)
    model.gen_layers[1].mlp.down.all_reduce = "symm_mem"  # as optimize() leaves it on a GPU host
    with pytest.raises(InputError, match=r"apply FP8 before optimize\(\)"):
        apply_fp8(model)


def test_symmetric_memory_all_reduce_refuses_a_quantized_weight():
    layer = RowParallelLinear(torch.randn(64, 32), None, group=None)
    assert not is_quantized(layer.weight) and not is_quantized(torch.randn(2))
    fake_quantize(layer)
    assert is_quantized(layer.weight)
    # The quantized weight is named before the device: on CPU "symm_mem" would otherwise fail for needing CUDA.
    with pytest.raises(InputError, match=r"all_reduce: 'symm_mem' .* weight is quantized \(FakeQuantized\)"):
        layer.set_all_reduce("symm_mem")
    assert layer.all_reduce == "nccl"


def test_tp_plan_keeps_nccl_and_compiles_fp8_blocks_whole(monkeypatch):
    """``optimize()``'s plan (compile, tp_overlap) on a tp=2 model: overlapped with bf16 row-parallel weights, and
    with FP8 ones NCCL all-reduces inside whole compiled blocks. (On CPU the plan never picks symmetric memory; on a
    GPU, ``set_all_reduce`` would refuse it, tested above.)"""
    context = ParallelContext(ParallelConfig(tp=2), mesh=None, device=torch.device("cpu"))
    for precision in ("bf16", "fp8"):
        model = sharded_tiny_transformer(monkeypatch)
        if precision == "fp8":
            for name in fp8_linear_names(model):
                fake_quantize(model.get_submodule(name))
        parallelize_transformer(model, context, compile=True, tp_overlap=True)
        overlapped = [isinstance(layer.gen_forward, OverlappedGenForward) for layer in model.gen_layers]
        assert overlapped == [precision == "bf16"] * 2, precision
        assert model.blocks_compiled
        assert {m.all_reduce for m in model.modules() if isinstance(m, RowParallelLinear)} == {"nccl"}


# ------------------------------------------------------------------------------------------------- GPU (FP8) tests


def _relative(a, b) -> float:
    a, b = torch.as_tensor(np.asarray(a), dtype=torch.float64), torch.as_tensor(np.asarray(b), dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.gpu
@needs_fp8_gpu
def test_fp8_forward_is_close_to_bf16_and_quantizes_what_the_policy_names(tiny_checkpoint):
    from torchao.quantization import Float8Tensor

    layout = validate_checkpoint(resolve_checkpoint(tiny_checkpoint))
    bf16 = Cosmos3Transformer.from_pretrained(layout.transformer_dir, device="cuda", dtype=torch.bfloat16)
    fp8 = apply_fp8(Cosmos3Transformer.from_pretrained(layout.transformer_dir, device="cuda",
                                                       dtype=torch.bfloat16), layers="keep_qkv")
    quantized = {name for name, module in fp8.named_modules()
                 if isinstance(getattr(module, "weight", None), Float8Tensor)}
    assert quantized == set(fp8_linear_names(bf16, "keep_qkv"))

    torch.manual_seed(0)
    thw, chunk = (3, 8, 8), 8
    outputs = []
    with torch.inference_mode():
        for model in (bf16, fp8):
            text = model.encode_text([list(range(3, 40))])
            layout_ = model.gen_layout(text.lengths, thw, chunk, 15.0)
            torch.manual_seed(0)
            video = torch.randn(1, model.config.latent_channel, *thw, device="cuda")
            actions = torch.randn(1, chunk, model.config.action_dim, device="cuda")
            noisy_v = torch.tensor([[False, True, True]], device="cuda")
            noisy_a = torch.ones(1, chunk, dtype=torch.bool, device="cuda")
            outputs.append(model(text, layout_, video, noisy_v, torch.tensor([900], device="cuda"), actions, noisy_a,
                                 torch.tensor([8], device="cuda")))
    (v16, a16), (v8, a8) = outputs
    # FP8 (e4m3: 3 mantissa bits, ~4% rms rounding per operand, rowwise scales) on two random layers: several
    # percent; a wrong scale or a transposed weight gives O(1).
    assert 0 < _relative(v8.cpu(), v16.cpu()) < 0.2
    assert 0 < _relative(a8.cpu(), a16.cpu()) < 0.2


def policy_request() -> Cosmos3Request:
    """A guided policy request of two denoising steps: the engine tests' yardstick."""
    observation = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return Cosmos3Request(mode="policy", observation=observation, task="push the block", domain="pusht", chunk=8,
                          num_inference_steps=2, guidance_scale=2.0, seed=0, resolution_tier=256)


@pytest.mark.gpu
@needs_fp8_gpu
def test_fp8_engine_with_compile_and_cuda_graphs_matches_bf16_closely(tiny_checkpoint):
    request = policy_request()
    results = {}
    for precision in ("bf16", "fp8"):
        engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", precision=precision, optimize=True,
                                               progress=False)
        results[precision] = engine.step(request, decode=False)
        assert engine.gen_forward is not engine.transformer  # the CUDA-graphed replay ran
        engine.close()
    # Two denoising steps with guidance 2 amplify the per-forward error somewhat; O(1) would mean broken FP8.
    assert 0 < _relative(results["fp8"].action, results["bf16"].action) < 0.3
    assert 0 < _relative(results["fp8"].video_latents, results["bf16"].video_latents) < 0.3


def tp_fp8_engine_check(checkpoint: str) -> dict:
    """One rank of a tp=2 FP8 engine (bf16 on its GPU): the policy request eager, then after ``optimize()``
    (compile, CUDA graphs), and what its sharded GEMMs became."""
    from torchao.quantization import Float8Tensor

    engine = Cosmos3Engine.from_pretrained(checkpoint, device="cuda", tp=2, precision="fp8", progress=False)
    out = {}
    for stage in ("eager", "optimized"):
        if stage == "optimized":
            engine.optimize()
        result = engine.step(policy_request(), decode=False)
        out[stage] = dict(action=result.action, latents=result.video_latents.cpu())
    model = engine.transformer
    out["quantized"] = {name: type(module).__name__ for name, module in model.named_modules()
                        if isinstance(getattr(module, "weight", None), Float8Tensor)}
    out["all_reduces"] = {m.all_reduce for m in model.modules() if isinstance(m, RowParallelLinear)}
    out["overlapped"] = any(isinstance(layer.gen_forward, OverlappedGenForward) for layer in model.gen_layers)
    out["graphed"] = engine.gen_forward is not model
    engine.close()
    return out


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fp8_with_tensor_parallelism_on_two_gpus_matches_one_gpu(tiny_checkpoint):
    ranks = run_distributed(tp_fp8_engine_check, 2, str(tiny_checkpoint), timeout=600, backend="nccl")
    one_gpu = {}
    for precision in ("fp8", "bf16"):
        engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", precision=precision, progress=False)
        if precision == "fp8":
            one_gpu["fp8_eager"] = engine.step(policy_request(), decode=False)
        one_gpu[precision] = engine.optimize().step(policy_request(), decode=False)
        engine.close()

    for rank_out in ranks:
        # Both shards of every GEMM the default policy names, the row-parallel out and down included, on NCCL
        # all-reduces inside whole compiled blocks (no overlap), replayed as CUDA graphs.
        default = {"all": ALL, "keep_qkv": NO_QKV}[quantization.DEFAULT_FP8_LAYERS]
        assert set(rank_out["quantized"]) == set(gen_names([0, 1], default))
        assert rank_out["quantized"]["gen_layers.0.attn.out"] == "RowParallelLinear"
        assert rank_out["quantized"]["gen_layers.1.mlp.down"] == "RowParallelLinear"
        assert rank_out["quantized"]["gen_layers.0.mlp.gate_up"] == "Linear"
        assert rank_out["all_reduces"] == {"nccl"} and not rank_out["overlapped"] and rank_out["graphed"]
    # The error FP8 itself makes (one GPU, optimised): the yardstick for the tp=2 difference.
    fp8_errors = dict(action=_relative(one_gpu["fp8"].action, one_gpu["bf16"].action),
                      latents=_relative(one_gpu["fp8"].video_latents, one_gpu["bf16"].video_latents))
    assert all(0 < error < 0.3 for error in fp8_errors.values()), fp8_errors
    for stage, want in (("eager", one_gpu["fp8_eager"]), ("optimized", one_gpu["fp8"])):
        got, other = ranks[0][stage], ranks[1][stage]
        assert np.array_equal(got["action"], other["action"]) and torch.equal(got["latents"], other["latents"])
        # The column shards quantize as the full GEMMs do (per token of the full input, per weight row); the row
        # shards scale their slice of the input features, and the partial sums add in another order: FP8 rounding,
        # no more than FP8 itself costs against bf16. A wrong shard or scale gives O(1).
        errors = dict(action=_relative(got["action"], want.action),
                      latents=_relative(got["latents"], want.video_latents))
        for name, error in errors.items():
            assert error < min(0.3, 2 * fp8_errors[name]), (stage, name, error, fp8_errors[name])


def _fp8_benchmark():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import fp8_gpu
    finally:
        sys.path.pop(0)
    return fp8_gpu


def test_benchmark_twin_shares_the_und_tower_and_owns_its_gen_layers(tiny_transformer):
    """benchmarks/fp8_gpu.py times every precision on a twin of one loaded model: the twin must compute what the
    model computes, share the UND tower (no second copy of it), and own its GEN layers (quantizing them must not
    touch the model's)."""
    fp8_gpu = _fp8_benchmark()
    twin = fp8_gpu.gen_twin(tiny_transformer, None, compile_blocks=False)
    assert twin.text_layers is tiny_transformer.text_layers and twin.proj_in is tiny_transformer.proj_in
    assert twin.gen_layers is not tiny_transformer.gen_layers
    assert tiny_transformer.blocks_compiled is False and twin.blocks_compiled is True
    v_model, a_model = fp8_gpu.velocity(tiny_transformer, (3, 8, 8), 8, 15.0, "cpu")
    v_twin, a_twin = fp8_gpu.velocity(twin, (3, 8, 8), 8, 15.0, "cpu")
    assert torch.equal(v_model, v_twin) and torch.equal(a_model, a_twin)
    with torch.no_grad():
        twin.gen_layers[0].mlp.down.weight.mul_(2.0)
    assert not torch.equal(twin.gen_layers[0].mlp.down.weight, tiny_transformer.gen_layers[0].mlp.down.weight)
    assert not torch.equal(fp8_gpu.velocity(twin, (3, 8, 8), 8, 15.0, "cpu")[0], v_model)


def test_benchmark_turns_tf32_off_only_for_the_fp32_reference():
    """The timed sections (diffusers' baseline included) run with PyTorch's TF32 defaults: ``tf32_off`` must give
    them back after the fp32 reference, also when it fails."""
    fp8_gpu = _fp8_benchmark()
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        with pytest.raises(RuntimeError, match="reference failed"):
            with fp8_gpu.tf32_off():
                assert fp8_gpu.tf32_settings() == {"matmul_allow_tf32": False, "cudnn_allow_tf32": False}
                raise RuntimeError("reference failed")
        assert fp8_gpu.tf32_settings() == {"matmul_allow_tf32": False, "cudnn_allow_tf32": True}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_benchmark_compares_fp8_ranking_scores_with_bf16s():
    fp8_gpu = _fp8_benchmark()

    def ranking(scores):
        return {"policies": {f"p{i}": {"world_model": {"final_coverage": s}} for i, s in enumerate(scores)}}

    same = fp8_gpu.score_agreement(ranking([0.1, 0.5, 0.3]), ranking([0.1, 0.5, 0.3]))
    assert same == {"pearson": pytest.approx(1.0), "max_abs_difference": 0.0}
    other = fp8_gpu.score_agreement(ranking([0.1, 0.5, 0.3]), ranking([0.3, 0.1, 0.5]))
    assert other["pearson"] < 0 and other["max_abs_difference"] == pytest.approx(0.4)
    with pytest.raises(SystemExit, match="--skip: unknown section"):
        fp8_gpu.section_list("pusht,vector_envs", fp8_gpu.SKIPPABLE_SECTIONS, "--skip")
