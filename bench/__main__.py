"""``python -m bench``: run the benchmarks, print the table, write bench/results.json."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .harness import PROFILES_DIR, RESULTS_PATH, load_benchmarks, run, select

EXAMPLE = """\
examples:
  .venv/bin/python -m bench                                # everything, embedded Apache Kafka (Tansu without a JDK)
  .venv/bin/python -m bench --quick                        # small sizes (~2.5 min); CI runs it per area, gateway and lake left out
  .venv/bin/python -m bench --only region.put_all.ingest   # one benchmark
  .venv/bin/python -m bench --only region --engine tansu   # every region.* benchmark, on Tansu
  .venv/bin/python -m bench --only region.put_all.ingest --profile   # where the service spends its time
  .venv/bin/python -m bench --list

Every figure is compared with a baseline measured in the same run on the
same broker; see bench/README.md for what each one means.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Sluice benchmarks: each figure with a baseline measured in the same run, on one "
        "embedded broker.  Prints a table and writes bench/results.json.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", metavar="NAME",
                        help="run only benchmark NAME, or every benchmark under it (e.g. 'region')")
    parser.add_argument("--engine", choices=("auto", "kafka", "tansu"), default="auto",
                        help="embedded broker (default auto: Apache Kafka when java can run it, else Tansu)")
    parser.add_argument("--quick", action="store_true", help="small workloads, for a smoke test")
    parser.add_argument("--output", type=Path,
                        help="where to write the results (default bench/results.json; "
                        "bench/profiles/results.json with --profile)")
    parser.add_argument("--profile", action="store_true",
                        help="sample the services with py-spy while they are measured; profiles go to "
                        "bench/profiles/ and their top functions are printed (figures come out lower)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        for entry in load_benchmarks().values():
            print(f"{entry.name:28} {entry.summary}")
        return 0
    output = args.output or (PROFILES_DIR / "results.json" if args.profile else RESULTS_PATH)
    return run(select(args.only), engine=args.engine, quick=args.quick, output=output,
               profile_dir=PROFILES_DIR if args.profile else None)


if __name__ == "__main__":
    sys.exit(main())
