"""`python -m graphexec demo|inspect`: the decode demo, and the captured graphs' table."""

from __future__ import annotations

import argparse
import logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphexec")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the decode loop on a mixed workload, replay vs eager")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    d.add_argument("--max-batch-size", type=int, default=None, help="default 64 GPU, 16 CPU")
    d.add_argument("--requests", type=int, default=24)
    d.add_argument("--latency-steps", type=int, default=10)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.add_argument("--no-speculative", dest="speculative", action="store_false",
                   help="skip the speculative-decoding runs")  # fmt: skip
    i = sub.add_parser("inspect", help="capture and print one row per graph key")
    from graphexec.inspection import add_arguments

    add_arguments(i)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "demo":
        from graphexec.demo import demo

        return demo(args)
    from graphexec.inspection import inspect_graphs

    return inspect_graphs(args)
