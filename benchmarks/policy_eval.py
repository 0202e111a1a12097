"""Policy evaluation as a benchmark: ``cosmos3-gym eval`` plus provenance (card, commit, command) and timing.

    python benchmarks/policy_eval.py --checkpoint CKPT --initial-states states/ --policy agent \\
        --episodes 100 --num-envs 16 --device cuda --out runs/eval_agent

Takes exactly the options of ``cosmos3-gym eval``; everything goes to ``--out DIR`` as everywhere: report.json, the
episode videos and ``policy_eval.json`` (or ``--results-name``: the provenance, the report and episodes/s). A result
committed in benchmarks/results is not overwritten without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import check_results_target, provenance, write_results  # noqa: E402

from cosmos3_gym.cli import add_eval_arguments, eval_options  # noqa: E402
from cosmos3_gym.evaluation import evaluate_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_eval_arguments(parser)
    parser.add_argument("--results-name", default="policy_eval.json", help="name of the results JSON in --out")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a result of the same name already in benchmarks/results")
    args = parser.parse_args(argv)
    check_results_target(args.results_name, args.out, args.overwrite)

    start = time.perf_counter()
    report = evaluate_checkpoint(**eval_options(args))
    wall_s = time.perf_counter() - start  # checkpoint loading included
    print(report.table())
    results = {
        "provenance": provenance(["benchmarks/policy_eval.py", *(sys.argv[1:] if argv is None else argv)]),
        "wall_s": wall_s,
        "episodes_per_s": len(report.episodes) / report.settings["wall_s"],
        "report": report.to_dict(),
    }
    write_results(results, args.results_name, args.out, args.overwrite, args=args)
    return results


if __name__ == "__main__":
    main()
