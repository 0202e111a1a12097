"""Shared pieces of the benchmarks: provenance, timing, the process group, results files, and the full-size
Cosmos3-Nano / Wan2.2 models with random weights (speed does not depend on weight values; see
shared/reference/performance.md §8).

Every script uses the same three helpers: ``timed`` (``timed_ms`` for the distributed ones), ``init_distributed`` and
``write_results``. ``--out DIR`` (``add_output_arguments``) means one thing everywhere: the folder the results JSON
(and any other output) goes to, default ``$OUT``, else benchmarks/results/<topic> (``result_topic``: engine,
parallel, pusht_env, fidelity, rl, training; benchmarks/results/INDEX.md says what each committed file backs). A
result already committed anywhere under benchmarks/results is never overwritten unless ``--overwrite`` is given;
scripts check that before they start (``check_results_target``), so a long run does not end in a refusal.

``write_results`` records the provenance (``provenance``: commit, dirty tree, card, versions, command) in every JSON
that lacks one, and the sha256 of the checkpoint and policy files the run read (``inputs=`` paths, or ``args=`` the
script's argparse namespace: ``inputs_from_args``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
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


REPO_ROOT = Path(__file__).resolve().parent.parent
# Changes under these (tracked or not) make a run's tree dirty; benchmarks/results is what runs write.
_CODE_PATHS = ("cosmos3_gym", "benchmarks", "pyproject.toml", ":(exclude)benchmarks/results")


def _git(*arguments: str) -> str | None:
    try:
        return subprocess.run(["git", *arguments], capture_output=True, text=True, check=True,
                              cwd=REPO_ROOT).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def _commit_and_dirty() -> tuple[str, bool | None, list[str]]:
    """The commit, whether the code differs from it (None: unknown), and up to 20 changed paths."""
    # COSMOS3_GYM_COMMIT names the commit of a source snapshot that has no .git of its own (a git repository around
    # the snapshot would report its own, unrelated HEAD); COSMOS3_GYM_DIRTY=1/0 says whether the snapshot had changes.
    commit = os.environ.get("COSMOS3_GYM_COMMIT")
    if commit:
        flag = os.environ.get("COSMOS3_GYM_DIRTY")
        return commit, (None if flag is None else flag not in ("", "0", "false")), []
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "unknown", None, []
    status = _git("status", "--porcelain", "--untracked-files=normal", "--", *_CODE_PATHS)
    if status is None:
        return head.strip(), None, []
    changed = [line[3:].split(" -> ")[-1] for line in status.splitlines() if line.strip()]
    return head.strip(), bool(changed), changed[:20]


def machine() -> dict:
    """The card: GPU name(s) and count, or the CPU model and core count."""
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return {"card": names[0], "num_gpus": len(names), "gpus": names}
    model = platform.processor() or "x86"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"card": f"cpu ({model})", "num_gpus": 0, "cpu": model, "cpu_cores": cores}


_HASHES: dict[tuple, str] = {}  # (path, size, mtime) -> sha256: a script that writes its results often hashes once


def _file_sha256(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def _display(path: Path) -> str:
    resolved = path.resolve()
    try:
        return resolved.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(resolved)


def input_hashes(inputs) -> dict[str, str]:
    """sha256 of each path in ``inputs`` (files or folders; missing ones are skipped), keyed by the path (relative
    to the repository when inside it). A folder gets one digest over every file under it (sorted relative paths and
    their digests), and each ``*.safetensors`` file in it its own entry as well."""
    hashes: dict[str, str] = {}
    for item in inputs or ():
        path = Path(item).expanduser()
        if path.is_file():
            hashes[_display(path)] = _file_sha256(path)
        elif path.is_dir():
            folder = hashlib.sha256()
            for file in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
                rel = file.relative_to(path).as_posix()
                digest = _file_sha256(file)
                folder.update(f"{rel}\0{digest}\n".encode())
                if file.suffix == ".safetensors":
                    hashes[_display(file)] = digest
            hashes[_display(path) + "/"] = folder.hexdigest()
    return hashes


def provenance(command: list[str] | None = None, inputs=None) -> dict:
    """Card, commit (and whether the code differs from it), versions and command: every results JSON carries them;
    ``hashes`` of ``inputs`` (checkpoint and policy files or folders, see ``input_hashes``) when given."""
    commit, dirty, changed = _commit_and_dirty()
    record = {
        **machine(),
        "commit": commit,
        "dirty": dirty,
        "command": " ".join(command or sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if changed:
        record["dirty_paths"] = changed
    if inputs is not None:
        record["hashes"] = input_hashes(inputs)
    return record


# Attributes of a script's argparse namespace that name the model or policy files a run reads.
INPUT_ARGUMENTS = ("checkpoint", "assets", "light_decoder", "wm_init", "first_part", "policy", "policies",
                   "policy_mix")


def _paths_in(value) -> list[Path]:
    """The existing paths in an argument's value: a path, or a policy spec list such as
    ``random,file:DIR/p.safetensors=0.1,ppo:q.zip``."""
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _paths_in(v)]
    found = []
    for token in [str(value), *str(value).split(",")]:
        token = token.strip()
        for candidate in (token, token.split("=")[0], token.split(":", 1)[-1], token.split(":", 1)[-1].split("=")[0]):
            if candidate and Path(candidate).expanduser().exists():
                found.append(Path(candidate).expanduser())
                break
    return found


def inputs_from_args(args: argparse.Namespace, builtin_assets: bool = True) -> list[Path]:
    """The existing files and folders named by ``args``' ``INPUT_ARGUMENTS``. ``builtin_assets``: ``assets`` None
    stands for the built-in PushT model, which the scripts then load (off for a script where it means none)."""
    paths: list[Path] = []
    for name in INPUT_ARGUMENTS:
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if name == "assets" and value is None and builtin_assets:
            try:
                from cosmos3_gym.tasks.pusht.env import default_assets_dir

                value = default_assets_dir()
            except Exception:  # noqa: BLE001 - no built-in model installed: nothing to hash
                continue
        paths += _paths_in(value)
    unique: dict[Path, Path] = {}
    for path in paths:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


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
# Result name prefix -> its folder under benchmarks/results (first match wins; anything else goes to the top).
RESULT_TOPICS = (
    ("gpu_suite", "engine"), ("gpu_smoke", "engine"), ("profile_gpu", "engine"), ("fp8_gpu", "engine"),
    ("vae_decode", "engine"), ("preprocess", "engine"),
    ("parallel_", "parallel"), ("allreduce_", "parallel"), ("eight_rank", "parallel"),
    ("pusht_env", "pusht_env"), ("profile_pusht_env", "pusht_env"), ("soak_", "pusht_env"),
    ("env_host_stages", "pusht_env"), ("vector_env", "pusht_env"), ("pusht_cpu", "pusht_env"),
    ("fidelity_", "fidelity"), ("pusht_fidelity", "fidelity"), ("wm_reward_audit", "fidelity"),
    ("reward_model_calibration", "fidelity"), ("pusht_sampler_sweep", "fidelity"), ("pusht_side_by_side", "fidelity"),
    ("policy_eval", "rl"), ("rl_", "rl"),
    ("train_", "training"), ("training_", "training"), ("pusht_finetune", "training"), ("simulate_pusht", "training"),
)


def result_topic(name: str) -> str | None:
    """The folder of benchmarks/results a result called ``name`` belongs in (``RESULT_TOPICS``), or None."""
    return next((topic for prefix, topic in RESULT_TOPICS if Path(name).name.startswith(prefix)), None)


def committed_result(name: str) -> Path | None:
    """The committed result called ``name`` anywhere under benchmarks/results, or None."""
    return next((p for p in sorted(COMMITTED_RESULTS.rglob(Path(name).name)) if p.is_file()), None)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` and ``--overwrite``, the same in every benchmark."""
    parser.add_argument("--out", default=None,
                        help="results folder (default: $OUT, else benchmarks/results/<topic>)")
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
    from cosmos3_gym.tasks.pusht.env import load_pusht_assets

    target = Path(tempfile.mkdtemp(prefix="pusht_light_")) / "pusht"
    shutil.copytree(load_pusht_assets(args.assets).root, target)
    shutil.rmtree(target / "checkpoint" / LIGHT_DECODER_DIR, ignore_errors=True)
    shutil.copytree(args.light_decoder, target / "checkpoint" / LIGHT_DECODER_DIR)
    args.assets = str(target)


def results_dir(out_dir: str | os.PathLike | None = None, topic: str | None = None) -> Path:
    """The folder results are written to: ``out_dir``, else ``$OUT``, else benchmarks/results; in benchmarks/results
    itself, its ``topic`` subfolder (created)."""
    out = Path(out_dir or os.environ.get("OUT") or COMMITTED_RESULTS)
    if topic and out.resolve() == COMMITTED_RESULTS:
        out = out / topic
    out.mkdir(parents=True, exist_ok=True)
    return out


def _in_committed_tree(path: Path) -> bool:
    return path.resolve().is_relative_to(COMMITTED_RESULTS)


def check_results_target(name: str, out_dir: str | os.PathLike | None = None, overwrite: bool = False,
                         topic: str | None = None) -> Path:
    """The path ``write_results`` will write: ``name`` in ``results_dir(out_dir, topic)``, ``topic`` by default
    ``result_topic(name)``. ``SystemExit`` with a one-line reason if that is in benchmarks/results and a result of
    that name is committed anywhere under it, and ``overwrite`` is off (call it before the measurement starts). With
    ``overwrite``, the committed file is replaced where it lies."""
    path = results_dir(out_dir, topic or result_topic(name)) / name
    if not _in_committed_tree(path):
        return path
    committed = path if path.is_file() else committed_result(name)
    if committed is None or committed.resolve() in _WRITTEN:  # new, or this process's own file: write on
        return committed or path
    if not overwrite:
        raise SystemExit(f"refusing to overwrite the committed result {committed}; pass --out DIR for another folder "
                         f"or --overwrite to replace it")
    # Replaced where it lies, unless that is the archive: a new run of an archived result is a current one.
    return path if "archive" in committed.resolve().relative_to(COMMITTED_RESULTS).parts[:1] else committed


def write_results(results: dict, name: str, out_dir: str | os.PathLike | None = None, overwrite: bool = False, *,
                  topic: str | None = None, inputs=None, args: argparse.Namespace | None = None) -> Path:
    """Write ``results`` as ``name`` in ``results_dir(out_dir, topic)`` (see ``check_results_target``).

    A ``provenance`` is added when ``results`` has none (neither a ``provenance`` nor a top-level ``commit``). The
    sha256 of ``inputs`` (paths of checkpoints, policy files, folders) and of ``inputs_from_args(args)`` go to
    ``results["provenance"]["hashes"]`` (top-level ``hashes`` for a flat provenance)."""
    path = check_results_target(name, out_dir, overwrite, topic)
    results = dict(results)
    if "provenance" not in results and "commit" not in results:
        results["provenance"] = provenance()
    paths = [*(inputs or ()), *(inputs_from_args(args) if args is not None else ())]
    if paths:
        hashes = input_hashes(paths)
        if isinstance(results.get("provenance"), dict):
            results["provenance"] = {**results["provenance"], "hashes": hashes}
        else:
            results["hashes"] = hashes
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    _WRITTEN.add(path.resolve())
    print(f"wrote {path}")
    return path
