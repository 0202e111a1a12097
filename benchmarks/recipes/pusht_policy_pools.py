"""The PushT evaluation pool's real spread in gym-pusht, and an audit of the manifest's seed ranges (issue 42).

    python benchmarks/recipes/pusht_policy_pools.py --out $OUT                  # 2-core CPU: about 15 minutes
    python benchmarks/recipes/pusht_policy_pools.py --write-untrained --out DIR # write the untrained policy file first
    python benchmarks/recipes/pusht_policy_pools.py --smoke --out /tmp/pools    # 2 starts x 2 chunks, 3 policies

Needs gym-pusht (the ``sim`` extra). Reads ``cosmos3_gym/tasks/pusht/policy_pools.json`` through
``load_policy_pools`` (which validates it), then:

1. **Seed audit.** ``generate_pusht_dataset`` draws each episode's gym-pusht reset seed from ``(dataset seed, episode
   index)`` pseudo-randomly over ``[0, 2**31)``. For every dataset seed in ``dataset_seeds_used_before`` and every
   policy mix used so far (``USED_MIXES``), the first ``AUDIT_EPISODES`` episodes' reset seeds are recomputed with
   the generator's own ``episode_policy`` (a superset of what was drawn); those inside the choosing, reporting and
   measurements ranges must be exactly each range's ``excluded`` list. The reporting block measured here must hold
   none of them, nor any seed of ``used_before``.
2. **Real spread.** Every evaluation-pool policy in gym-pusht alone (``tasks.pusht.compare.evaluate_in_simulator``,
   what ``cosmos3-gym eval-real --real-only`` runs) from the first ``--starts`` seeds of the reporting range
   (``PolicyPools.seed_block``), for ``--chunks`` chunks (default: the built-in checkpoint's ``max_episode_steps``,
   a whole episode): success rate (Wilson 95 %) and mean final coverage (t 95 %). The pool must span real final
   coverage from about 0 (``SPAN_LOW``) to at least ``SPAN_HIGH``; ``span`` in the JSON says whether it does.

``--write-untrained`` writes the evaluation pool's untrained pixel policy (``PixelGaussianPolicy`` with the entry's
``untrained_seed``) to the file the manifest names, once. ``--bc-results FILE`` adds the ``rl_pusht.json`` of the run
that trained the pool's CPU BC policy (its demonstrations and BC summary) to the results.

Writes ``pusht_policy_pools_cpu.json`` (``--results-name``; card, commit, command and the sha256 of the manifest and
policy files via ``common.write_results``) to ``--out`` (default ``$OUT``, else benchmarks/results/fidelity).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

RECIPES = Path(__file__).resolve().parent
sys.path[:0] = [str(RECIPES.parents[1]), str(RECIPES.parent), str(RECIPES)]  # the repository, benchmarks/, recipes/

from common import add_output_arguments, check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.tasks.pusht.policy_pools import (  # noqa: E402
    HELD_OUT_USES,
    MANIFEST,
    PolicyPools,
    load_policy_pools,
)

RESULTS_NAME = "pusht_policy_pools_cpu.json"
TOPIC = "fidelity"
SPAN_LOW, SPAN_HIGH = 0.05, 0.8  # the pool must reach real final coverage <= SPAN_LOW and >= SPAN_HIGH
AUDIT_EPISODES = 2048  # per dataset seed and mix: more than any dataset so far (1536)
# The policy mixes generate_pusht_dataset ran with (train_pusht.py, train_light_decoder.py and
# reward_model_calibration.py: --policy-mix). Only the family order and shares matter for the reset seeds, so file
# names stand in as a, b, c.
USED_MIXES = {
    "default": None,
    "round4": "scripted=0.35,random=0.1,replay=0.1,uniform=0.15,file:a=0.1,file:b=0.1,file:c=0.1",
    "round5_6_7": "scripted=0.4,random=0.1,replay=0.1,uniform=0.1,file:a=0.1,file:b=0.1,file:c=0.1",
    "round8": "scripted_random_goal=0.35,scripted=0.2,random=0.1,replay=0.05,uniform=0.1,file:a=0.07,file:b=0.07,"
              "file:c=0.06",
    "round9_10": "scripted_random_goal=0.33,scripted=0.17,random=0.1,replay=0.05,uniform=0.1,file:a=0.1,file:b=0.1,"
                 "file:c=0.05",
    "light_decoder_v2": "scripted_random_goal=0.4,scripted=0.25,random=0.15,replay=0.05,uniform=0.15",
    "reward_model_calibration": "scripted=1.0",
}
SMOKE_POLICIES = 3


def dataset_reset_seeds(dataset_seeds: list[int], episodes: int = AUDIT_EPISODES) -> np.ndarray:
    """The gym-pusht reset seeds ``generate_pusht_dataset`` draws for the first ``episodes`` episodes of each dataset
    seed under each of ``USED_MIXES`` (sorted, unique): ``episode_policy`` then ``rng.integers(2**31)``, as
    ``dataset._simulate_and_write`` does."""
    from cosmos3_gym.tasks.pusht.dataset import _check_policy_mix, episode_policy, parse_policy_mix

    seeds = set()
    for text in USED_MIXES.values():
        mix = _check_policy_mix(parse_policy_mix(text))
        for dataset_seed in dataset_seeds:
            for index in range(episodes):
                _, _, rng = episode_policy(int(dataset_seed), index, mix)
                seeds.add(int(rng.integers(2**31)))
    return np.asarray(sorted(seeds), dtype=np.int64)


def seed_audit(pools: PolicyPools, document: dict, block: range) -> dict[str, Any]:
    """Step 1 of the module docstring: ``{"ok", per range: computed vs listed exclusions, the measured block}``."""
    drawn = dataset_reset_seeds(document["dataset_seeds_used_before"])
    report: dict[str, Any] = {"dataset_seeds": document["dataset_seeds_used_before"], "mixes": list(USED_MIXES),
                              "episodes_per_seed_and_mix": AUDIT_EPISODES, "drawn_seeds": int(len(drawn)),
                              "ranges": {}, "ok": True}
    for use in HELD_OUT_USES:
        if use not in pools.seed_ranges:
            continue
        seed_range = pools.seed_ranges[use]
        inside = drawn[(drawn >= seed_range.first) & (drawn <= seed_range.last)].tolist()
        listed = list(seed_range.excluded)
        report["ranges"][use] = {"first": seed_range.first, "last": seed_range.last, "computed_excluded": inside,
                                 "listed_excluded": listed, "match": inside == listed}
        report["ok"] &= inside == listed
    drawn_set = set(drawn.tolist())
    hits = [s for s in block if s in drawn_set]
    old = [r.name for r in pools.used_before if r.first <= block[-1] and block[0] <= r.last]
    report["measured_block"] = {"first": block[0], "last": block[-1], "dataset_seeds_inside": hits,
                                "used_before_overlaps": old}
    report["ok"] &= not hits and not old
    return report


def write_untrained(pools: PolicyPools) -> list[str]:
    """Write every evaluation-pool file of an ``untrained_seed`` entry that does not exist yet; the paths written."""
    from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, save_policy_file

    written = []
    for entry in pools.evaluation:
        seed = entry.fields.get("untrained_seed")
        if seed is None or entry.path is None:
            continue
        path = pools.root / entry.path
        if path.exists():
            print(f"{entry.path} exists; left as it is", flush=True)
            continue
        torch.manual_seed(int(seed))
        policy = PixelGaussianPolicy(PolicyConfig(chunk=8))
        save_policy_file(policy, path, trained_by="benchmarks/recipes/pusht_policy_pools.py --write-untrained "
                         "(never trained)", seed=int(seed))
        written.append(entry.path)
        print(f"wrote {entry.path}", flush=True)
    return written


def bc_summary(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    run = json.loads(Path(path).read_text())
    bc = run.get("bc", {})
    return {"command": run.get("provenance", {}).get("command"), "card": run.get("provenance", {}).get("card"),
            "demos": run.get("demos"), "timings": run.get("timings"),
            "bc": {key: bc.get(key) for key in ("final_loss", "samples", "steps", "train_s", "ms_per_step", "config")}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", default=str(MANIFEST), help="the policy-pools manifest")
    parser.add_argument("--starts", type=int, default=32, help="gym-pusht starts per policy (reporting seeds)")
    parser.add_argument("--chunks", type=int, default=None,
                        help="chunks per episode (default: the built-in checkpoint's max_episode_steps)")
    parser.add_argument("--policies", default=None, help="comma-separated specs instead of the evaluation pool")
    parser.add_argument("--seed", type=int, default=0, help="policy seed (the scripted pushers' noise)")
    parser.add_argument("--smoke", action="store_true", help=f"2 starts x 2 chunks, the first {SMOKE_POLICIES} "
                        "policies, no seed audit")
    parser.add_argument("--write-untrained", action="store_true",
                        help="write the evaluation pool's untrained policy file(s) first (only where missing)")
    parser.add_argument("--bc-results", default=None, help="rl_pusht.json of the run that trained the CPU BC policy")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_output_arguments(parser)
    parser.add_argument("--results-name", default=RESULTS_NAME)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    check_results_target(args.results_name, args.out, args.overwrite, topic=TOPIC)

    document = json.loads(Path(args.manifest).read_text())
    written = []
    if args.write_untrained:
        written = write_untrained(load_policy_pools(args.manifest, check_files=False))
    pools = load_policy_pools(args.manifest)  # validated, files included
    starts, chunks = (2, 2) if args.smoke else (args.starts, args.chunks)
    specs = args.policies.split(",") if args.policies else pools.specs("evaluation")
    if args.smoke:
        specs = specs[:SMOKE_POLICIES]
    block = pools.seed_block("reporting", starts)
    started = time.perf_counter()
    audit = None if args.smoke else seed_audit(pools, document, block)
    audit_s = time.perf_counter() - started
    if audit is not None and not audit["ok"]:
        print(json.dumps(audit, indent=1, default=str)[:4000])
        raise SystemExit("seed audit failed: the manifest's excluded seeds or the measured block are wrong (above)")

    from cosmos3_gym.tasks.pusht.compare import evaluate_in_simulator, format_real_only

    started = time.perf_counter()
    real = evaluate_in_simulator(specs, num_episodes=starts, num_chunks=chunks, first_sim_seed=block[0],
                                 seed=args.seed, progress=False)
    real_s = time.perf_counter() - started
    print(format_real_only(real))
    coverage = {spec: entry["final_coverage"] for spec, entry in real["policies"].items()}
    families = {e.spec: e.family for e in pools.evaluation}
    low, high = min(coverage.values()), max(coverage.values())
    results = {
        "provenance": provenance(["benchmarks/recipes/pusht_policy_pools.py", *(argv or sys.argv[1:])]),
        "manifest": str(Path(args.manifest).resolve().relative_to(Path(RECIPES.parents[1]).resolve()))
        if Path(args.manifest).resolve().is_relative_to(RECIPES.parents[1].resolve()) else args.manifest,
        "smoke": args.smoke,
        "seed_ranges": {use: {"first": r.first, "last": r.last, "excluded": len(r.excluded), "use": r.use}
                        for use, r in pools.seed_ranges.items()},
        "reporting_block": [block[0], block[-1]],
        "seed_audit": audit,
        "evaluation_pool": [{"spec": spec, "family": families.get(spec), **real["policies"][spec]} for spec in specs],
        "training_pool": [{"spec": e.spec, "data_family": e.fields.get("data_family"), "family": e.family,
                           "where": list(e.where)} for e in pools.training],
        "to_train": list(pools.to_train),
        "real_only": {key: value for key, value in real.items() if key != "policies"},
        "span": {"low": low, "high": high, "required": [SPAN_LOW, SPAN_HIGH],
                 "holds": bool(low <= SPAN_LOW and high >= SPAN_HIGH),
                 "families": sorted({families.get(spec, "?") for spec in specs}), "policies": len(specs)},
        "untrained_written": written,
        "cpu_bc_run": bc_summary(args.bc_results),
        "timings": {"seed_audit_s": audit_s, "real_s": real_s},
    }
    files = [pools.root / e.path for e in pools.evaluation if e.path is not None]
    write_results(results, args.results_name, args.out, args.overwrite, topic=TOPIC,
                  inputs=[Path(args.manifest), *files])
    print(f"real final coverage spans {low:.3f} .. {high:.3f} over {len(specs)} policies "
          f"({'holds' if results['span']['holds'] else 'does NOT hold'}: <= {SPAN_LOW} and >= {SPAN_HIGH})")
    return results


if __name__ == "__main__":
    main()
