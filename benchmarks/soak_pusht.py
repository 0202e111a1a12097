"""Soak: does a long PushT-v0 run keep its memory flat? Host and GPU memory every ``--every`` env steps.

    python benchmarks/soak_pusht.py --envs 16 --steps 100000 --out $OUT        # one GPU (100k env steps)
    python benchmarks/soak_pusht.py --envs 64 --steps 100000 --out $OUT
    python benchmarks/soak_pusht.py --device cpu --envs 4 --steps 2000 --every 100   # CPU

An env step is one slot's step: ``--steps`` env steps are ``--steps / --envs`` vector steps, random actions, default
autoreset (episodes end at the PushT horizon or on success, so resets and their bookkeeping are exercised).

Each sample (after ``gc.collect()``): host RSS (``/proc/self/statm``); the C heap as glibc's ``mallinfo2`` sees it
(``heap_in_use_mb``: bytes handed out by malloc and not freed, mmapped blocks included; ``heap_free_mb``: freed
bytes malloc keeps in its arenas; ``host_rss_held_mb``: RSS less those). RSS that moves while ``heap_in_use_mb``
and ``host_rss_held_mb`` stay flat is the allocator keeping freed memory for reuse, not a leak. Also: the number of
Python objects the garbage collector tracks; the engine's caches (text K/V, prompt ids, schedules, CUDA graphs);
``torch.cuda.memory_allocated`` / ``_reserved``; ``batch_sizes_seen``, how many different numbers of slots have
stepped together so far (each new one is a new shape: a CUDA graph on a GPU, new oneDNN primitives on a CPU).
``--trace`` adds ``tracemalloc`` (Python allocations: the top growing source lines between ``--from-step`` and the
end) and the object types whose counts grew. ``--malloc-trim`` calls ``malloc_trim(0)`` before each sample (RSS
without what glibc retains). ``MALLOC_ARENA_MAX`` etc. are read from the environment and recorded.

The summary gives, for every memory series, the growth from the sample at ``--from-step`` (default 1000: after
warm-up, compiles and graph captures) to the last, in MB and percent (the issue's target: < 1 %), the floor growth
(lowest sample of the last quarter against the lowest of the first), and the growth per 500 env steps (the slope of
a least-squares line through the samples from ``--from-step``). Results JSON via benchmarks/common.py; progress on
tqdm.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_decoder_arguments,
    add_output_arguments,
    check_results_target,
    provenance,
    use_decoder_arguments,
    write_results,
)

from cosmos3_gym.tasks.pusht.env import make_pusht_vector_env  # noqa: E402

MEMORY_KEYS = ("host_rss_mb", "host_rss_held_mb", "heap_in_use_mb", "heap_free_mb", "python_objects", "tracemalloc_mb",
               "gpu_allocated_mb", "gpu_reserved_mb")
MALLOC_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


LIBC = _libc()


def host_rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def malloc_heap_mb() -> dict:
    """glibc's view of the C heap (empty where mallinfo2 is missing: another libc, or glibc < 2.33)."""
    if LIBC is None or not hasattr(LIBC, "mallinfo2"):
        return {}
    LIBC.mallinfo2.restype = _MallInfo2
    info = LIBC.mallinfo2()
    # uordblks: in use in the arenas; hblkhd: blocks malloc mmapped on their own (large allocations, in use)
    return {"heap_in_use_mb": (info.uordblks + info.hblkhd) / 2**20, "heap_free_mb": info.fordblks / 2**20}


def sample(env, env_steps: int, started: float, malloc_trim: bool) -> dict:
    gc.collect()
    if malloc_trim and LIBC is not None:
        LIBC.malloc_trim(0)
    engine = env.engine
    graphed = getattr(engine, "_graphed_forward", None)
    heap = malloc_heap_mb()
    entry = {
        "env_steps": env_steps,
        "seconds": time.perf_counter() - started,
        "host_rss_mb": host_rss_mb(),
        **heap,
        "python_objects": len(gc.get_objects()),
        "text_cache": len(getattr(engine, "_text_cache", ())),
        "prompt_cache": len(getattr(engine, "_prompt_ids", ())),
        "schedules": len(getattr(engine, "_schedules", ())),
        "cuda_graphs": graphed.num_graphs if graphed is not None else 0,
    }
    if heap:
        # RSS without the freed memory glibc keeps for reuse: what the process holds (the leak detector)
        entry["host_rss_held_mb"] = entry["host_rss_mb"] - heap["heap_free_mb"]
    if tracemalloc.is_tracing():
        entry["tracemalloc_mb"] = tracemalloc.get_traced_memory()[0] / 2**20
    if torch.cuda.is_available():
        entry["gpu_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
        entry["gpu_reserved_mb"] = torch.cuda.memory_reserved() / 2**20
    return entry


def growth(samples: list[dict], key: str, from_step: int) -> dict | None:
    """How ``key`` grew from the first sample at or after ``from_step`` to the last (None if it was not sampled)."""
    if key not in samples[0]:
        return None
    start = next((s for s in samples if s["env_steps"] >= from_step), samples[0])
    after = [s for s in samples if s["env_steps"] >= start["env_steps"]]
    end = after[-1]
    values = [s[key] for s in after]
    delta = end[key] - start[key]
    # Host RSS swings by tens of MB as the allocator takes and returns the large temporaries of a step; a leak
    # raises the floor. So also: the lowest sample of the last quarter against the lowest of the first quarter.
    quarter = max(1, len(values) // 4)
    floor_delta = min(values[-quarter:]) - min(values[:quarter])
    per_500 = 500 * _slope([s["env_steps"] for s in after], values)
    return {"from_env_step": start["env_steps"], "to_env_step": end["env_steps"], "start": start[key],
            "end": end[key], "growth": delta, "growth_percent": _percent(delta, start[key]),
            "floor_growth": floor_delta, "floor_growth_percent": _percent(floor_delta, min(values[:quarter])),
            "growth_per_500_steps": per_500, "growth_per_500_steps_percent": _percent(per_500, start[key])}


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0


def _percent(delta: float, base: float) -> float | None:
    return 100 * delta / base if base else None


def _type_counts() -> collections.Counter:
    return collections.Counter(type(obj).__qualname__ for obj in gc.get_objects())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100_000, help="env steps (slot steps) in all")
    parser.add_argument("--every", type=int, default=500, help="sample memory every this many env steps")
    parser.add_argument("--from-step", type=int, default=1000, help="growth is measured from this env step")
    parser.add_argument("--optimize", type=int, default=1, help="0: the baseline path (optimize=False)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop early (results still written) after this long, e.g. to fit a time limit")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--success-threshold", type=float, default=None,
                        help="the env's success_threshold (default: the model's, 0.95); lower, episodes end at "
                             "different steps and the number of slots stepping together varies more")
    parser.add_argument("--trace", action="store_true",
                        help="tracemalloc and object-type counts: what grew between --from-step and the end")
    parser.add_argument("--malloc-trim", action="store_true", help="malloc_trim(0) before each sample")
    add_output_arguments(parser)
    parser.add_argument("--name", default=None)
    parser.add_argument("--assets", default=None, help="PushT model folder (default: the built-in one)")
    add_decoder_arguments(parser, "vae or light (default: the checkpoint's own, the built-in model's is light)",
                          default=None)
    args = parser.parse_args(argv)
    use_decoder_arguments(parser, args)
    device = "cpu" if args.device == "cpu" else "gpu"
    name = args.name or f"soak_pusht_{device}_{args.envs}envs.json"
    check_results_target(name, args.out, args.overwrite)  # before measuring
    run = provenance()  # the commit that runs, not the one checked out when a long run ends
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.trace:
        tracemalloc.start(8)

    overrides = {} if args.success_threshold is None else {"success_threshold": args.success_threshold}
    if args.decoder is not None:
        overrides["decoder"] = args.decoder
    env = make_pusht_vector_env(args.envs, args.assets, device=args.device, optimize=bool(args.optimize),
                                **overrides)
    args.decoder_used = env.engine.decoder  # what the settings gave, recorded with them
    samples, reference = [], None
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        started = time.perf_counter()
        samples.append({**sample(env, 0, started, args.malloc_trim), "batch_sizes_seen": 0})
        env_steps, next_sample = 0, args.every
        batch_sizes = set()  # numbers of slots stepping together (autoreset leaves the finished ones out for a step)
        vector_steps = -(-args.steps // args.envs)
        for _ in tqdm(range(vector_steps), desc=f"soak {args.envs} envs", unit="step"):
            info = env.step(env.action_space.sample())[-1]
            batch_sizes.add(int(args.envs - info["waiting"].sum()))
            env_steps += args.envs
            if env_steps >= next_sample:
                samples.append({**sample(env, env_steps, started, args.malloc_trim),
                                "batch_sizes_seen": len(batch_sizes - {0})})
                next_sample += args.every
                if args.trace and reference is None and env_steps >= args.from_step:
                    reference = (tracemalloc.take_snapshot(), _type_counts())
                # written as it goes: a run stopped by a time limit keeps its samples
                write_results(summary(args, run, samples, env_steps), name, args.out, args.overwrite, args=args)
                if args.max_seconds is not None and samples[-1]["seconds"] > args.max_seconds:
                    break
        traced = _trace_report(reference) if reference is not None else None
    finally:
        env.close()
    results = summary(args, run, samples, env_steps, traced)
    for key, value in results["growth"].items():
        if value is not None:
            print(f"{key}: {value['start']:.1f} -> {value['end']:.1f} from env step {value['from_env_step']} to "
                  f"{value['to_env_step']} ({value['growth']:+.1f}; floor {value['floor_growth']:+.1f}; "
                  f"{value['growth_per_500_steps']:+.2f} per 500 steps)")
    write_results(results, name, args.out, args.overwrite, args=args)
    return results


def summary(args, run: dict, samples: list[dict], env_steps: int, traced: dict | None = None) -> dict:
    return {
        "provenance": run,
        "settings": {**vars(args), "torch_threads": torch.get_num_threads(),
                     "malloc_environment": {key: os.environ[key] for key in MALLOC_VARIABLES if key in os.environ}},
        "env_steps_per_s": env_steps / samples[-1]["seconds"] if samples[-1]["seconds"] else None,
        "growth": {key: growth(samples, key, args.from_step) for key in MEMORY_KEYS},
        "traced_growth": traced,
        "samples": samples,
    }


def _trace_report(reference, top: int = 15) -> dict:
    """The source lines whose Python allocations grew most since ``reference``, and the object types whose live
    counts grew."""
    gc.collect()
    snapshot, counts = reference
    lines = tracemalloc.take_snapshot().compare_to(snapshot, "lineno")
    types = _type_counts()
    types.subtract(counts)
    return {
        "lines": [{"where": str(stat.traceback[0]), "growth_kb": stat.size_diff / 1024, "count_growth": stat.count_diff}
                  for stat in lines[:top]],
        "object_types": dict(sorted(((k, v) for k, v in types.items() if v), key=lambda kv: -abs(kv[1]))[:top]),
    }


if __name__ == "__main__":
    main()
