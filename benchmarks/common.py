"""Shared pieces of the benchmarks: provenance, timing, the process group, results files, and the full-size
Cosmos3-Nano / Wan2.2 models with random weights (speed does not depend on weight values; see
shared/reference/performance.md §8).

Every script uses the same three helpers: ``timed`` (``timed_ms`` for the distributed ones), ``init_distributed`` and
``write_results``. ``--out DIR`` (``add_output_arguments``) means one thing everywhere: the folder the results JSON
(and any other output) goes to, default ``$OUT``, else benchmarks/results. A result already committed in
benchmarks/results is never overwritten unless ``--overwrite`` is given; scripts check that before they start
(``check_results_target``), so a long run does not end in a refusal.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cosmos3_gym.models.vae import WAN22_FIXED_CONFIG

NANO_TRANSFORMER = dict(action_gen=True, action_dim=64)  # every other field at diffusers' (= Nano's) default
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json (the Cosmos3 VAE).
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    **WAN22_FIXED_CONFIG,
)
SCHEDULER = dict(
    num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
    solver_order=2, solver_type="bh2", final_sigmas_type="zero", use_karras_sigmas=False,
)


def provenance(command: list[str] | None = None) -> dict:
    """Card, commit and command: every results JSON carries them."""
    # COSMOS3_GYM_COMMIT names the commit of a source snapshot that has no .git of its own (a git repository around
    # the snapshot would report its own, unrelated HEAD).
    commit = os.environ.get("COSMOS3_GYM_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                    cwd=Path(__file__).parent).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or 'x86'})"
    return {
        "card": card,
        "num_gpus": torch.cuda.device_count(),
        "commit": commit,
        "command": " ".join(command or sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3, warmup: int = 1, *, barrier: bool = False, cuda_events: bool = False,
          keep_output: bool = False):
    """Median time (s) of ``fn()`` after ``warmup`` calls, and every time: ``(median, times)``, or ``(median, times,
    last output)`` with ``keep_output``.

    The device is synchronised around every call. ``barrier``: the ranks of the process group are aligned before
    every call (every rank runs ``fn``). ``cuda_events``: GPU time between CUDA events on the current stream instead
    of the host's clock."""
    output = None
    for _ in range(warmup):
        output = fn()
    times = []
    for _ in range(repeats):
        sync()
        if barrier and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if cuda_events and torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            output = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            output = fn()
            sync()
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return (median, times, output) if keep_output else (median, times)


def timed_ms(fn, repeats: int = 3, warmup: int = 1, *, barrier: bool = False):
    """``(last output, [ms per call])`` of ``timed`` with CUDA events on a GPU: the distributed benchmarks' form."""
    _, times, output = timed(fn, repeats, warmup, barrier=barrier, cuda_events=True, keep_output=True)
    return output, [t * 1e3 for t in times]


def init_distributed(use_cuda: bool | None = None) -> tuple[int, int, torch.device]:
    """Join the process group of a torchrun launch (``RANK`` set; NCCL with the GPU ``LOCAL_RANK`` when CUDA is used,
    else gloo) and return ``(rank, world_size, device)``; ``(0, 1, device)`` without torchrun. ``use_cuda``:
    default, when CUDA is available."""
    use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    distributed = torch.distributed
    if "RANK" in os.environ and not distributed.is_initialized():
        if use_cuda:
            distributed.init_process_group("nccl", device_id=device)
        else:
            distributed.init_process_group("gloo")
    if distributed.is_initialized():
        return distributed.get_rank(), distributed.get_world_size(), device
    return 0, 1, device


def gemm_peak_tflops(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    median, _ = timed(lambda: a @ b, repeats=repeats, warmup=3)
    return 2 * n**3 / median / 1e12


@torch.no_grad()
def fill_random_(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights (norm scales near 1) so activations stay finite through 36 layers."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in module.named_parameters():
        values = torch.randn(p.shape, generator=g, dtype=torch.float32) if p.numel() < 2**20 else None
        if values is None:  # large tensors: draw on the device (CPU RNG for 15 B values would take minutes)
            p.normal_(0.0, std)
        else:
            p.copy_(values.to(p.device, p.dtype) * std)
        if "norm" in name:
            p.add_(1.0)


def build_nano_transformer(device: str = "cuda", dtype=torch.bfloat16, **overrides):
    """diffusers' Cosmos3OmniTransformer at the full Nano config (15.2 B parameters), random weights."""
    from diffusers import Cosmos3OmniTransformer

    from cosmos3_gym.models.transformer import build_on_meta

    model = build_on_meta(Cosmos3OmniTransformer, dtype=dtype, **{**NANO_TRANSFORMER, **overrides})
    model = model.to_empty(device=device)
    torch.manual_seed(0)
    fill_random_(model)
    model.time_embedder.float()
    # Buffers were created on meta; rebuild the rotary table on the device.
    model.rotary_emb.inv_freq = 1.0 / (
        model.config.rope_theta
        ** (torch.arange(0, model.config.head_dim, 2, dtype=torch.float32, device=device) / model.config.head_dim)
    )
    return model.eval()


def build_wan22_vae(device: str = "cuda", dtype=torch.float32):
    from diffusers import AutoencoderKLWan

    g = torch.Generator().manual_seed(0)
    stats = dict(latents_mean=(0.1 * torch.randn(48, generator=g)).tolist(),
                 latents_std=(0.5 + torch.rand(48, generator=g)).tolist())
    torch.manual_seed(0)
    return AutoencoderKLWan(**WAN22_VAE, **stats).to(device=device, dtype=dtype).eval()


def free_memory() -> None:
    """Collect garbage and give the CUDA caching allocator's free blocks back (between a benchmark's sections)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fp8_unavailable_reason() -> str | None:
    """Why FP8 GEMMs cannot run here (no CUDA GPU, one below compute capability 8.9, no torchao), or None when they
    can: ``cosmos3_gym.quantization.check_fp8_supported``'s message."""
    from cosmos3_gym.errors import InputError
    from cosmos3_gym.quantization import check_fp8_supported

    if not torch.cuda.is_available():
        return "needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); no CUDA device here"
    try:
        check_fp8_supported("cuda")
    except InputError as error:
        return str(error)
    return None


def fp8_available() -> bool:
    return fp8_unavailable_reason() is None


def gen_twin(master, policy: str | None, compile_blocks: bool):
    """A ``Cosmos3Transformer`` that shares ``master``'s UND tower, embeddings and heads and has its own copy of the
    GEN layers: bf16 (``policy`` None) or FP8 by ``apply_fp8(layers=policy)``, its GEN blocks wrapped in
    ``torch.compile`` as ``compile_blocks`` does. Make it while ``master``'s GEN blocks are not compiled yet (a copy of
    a compiled block would call the original's forward). The twin counts as compiled (``blocks_compiled``), so an
    engine's ``optimize()`` on it only adds the CUDA graphs: the UND blocks are ``master``'s, compiled with it."""
    from cosmos3_gym.quantization import apply_fp8

    if master.blocks_compiled:
        raise ValueError("gen_twin: make the twin before compiling the master's blocks")
    twin = copy.copy(master)
    twin._modules = dict(master._modules)  # own module table: the GEN layers below are twin's alone
    twin.gen_layers = copy.deepcopy(master.gen_layers)
    twin.blocks_compiled = False
    if policy is not None:
        apply_fp8(twin, layers=policy)
    if compile_blocks:
        for block in twin.gen_layers:
            block.gen_forward = torch.compile(block.gen_forward)
    twin.blocks_compiled = True
    return twin


COMMITTED_RESULTS = Path(__file__).resolve().parent / "results"
_WRITTEN: set[Path] = set()  # files this process wrote: a script may update its own results as it goes


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` and ``--overwrite``, the same in every benchmark."""
    parser.add_argument("--out", default=None,
                        help="results folder (default: $OUT, else benchmarks/results)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a result of the same name already in benchmarks/results")


def add_decoder_arguments(parser: argparse.ArgumentParser, light_help: str, default: str | None = "vae") -> None:
    """``--decoder vae|light`` and ``--light-decoder DIR`` (a trained light decoder to use instead of the assets'
    own), as the PushT env benchmarks take them; ``use_decoder_arguments`` checks and applies them. ``default``
    None: the checkpoint's own decoder unless one is named."""
    parser.add_argument("--decoder", choices=("vae", "light"), default=default, help=light_help)
    parser.add_argument("--light-decoder", default=None,
                        help="with --decoder light: a trained light decoder folder, installed into a temporary copy "
                             "of the assets (default: the assets' own checkpoint/light_decoder)")


def use_decoder_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--light-decoder`` only with ``--decoder light``; given, ``args.assets`` becomes a temporary copy of the PushT
    assets (``args.assets``, default the built-in ones) with that folder as its checkpoint's light decoder."""
    if args.light_decoder and args.decoder != "light":
        parser.error("--light-decoder goes with --decoder light")
    if not args.light_decoder:
        return
    import shutil
    import tempfile

    from cosmos3_gym.engine import LIGHT_DECODER_DIR
    from cosmos3_gym.envs.pusht import load_pusht_assets

    target = Path(tempfile.mkdtemp(prefix="pusht_light_")) / "pusht"
    shutil.copytree(load_pusht_assets(args.assets).root, target)
    shutil.rmtree(target / "checkpoint" / LIGHT_DECODER_DIR, ignore_errors=True)
    shutil.copytree(args.light_decoder, target / "checkpoint" / LIGHT_DECODER_DIR)
    args.assets = str(target)


def results_dir(out_dir: str | os.PathLike | None = None) -> Path:
    """The folder results are written to: ``out_dir``, else ``$OUT``, else benchmarks/results (created)."""
    out = Path(out_dir or os.environ.get("OUT") or COMMITTED_RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    return out


def check_results_target(name: str, out_dir: str | os.PathLike | None = None, overwrite: bool = False) -> Path:
    """The path ``write_results`` will write; ``SystemExit`` with a one-line reason if that is a committed result in
    benchmarks/results and ``overwrite`` is off (call it before the measurement starts)."""
    path = results_dir(out_dir) / name
    committed = path.resolve().parent == COMMITTED_RESULTS and path.exists()
    if committed and not overwrite and path.resolve() not in _WRITTEN:
        raise SystemExit(f"refusing to overwrite the committed result {path}; pass --out DIR for another folder or "
                         f"--overwrite to replace it")
    return path


def write_results(results: dict, name: str, out_dir: str | os.PathLike | None = None, overwrite: bool = False) -> Path:
    """Write ``results`` as ``name`` in ``results_dir(out_dir)`` (see ``check_results_target``)."""
    path = check_results_target(name, out_dir, overwrite)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    _WRITTEN.add(path.resolve())
    print(f"wrote {path}")
    return path
