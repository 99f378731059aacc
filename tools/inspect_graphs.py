"""Capture every graph key of an executor (TinyLM by default) and print one row per key.

python tools/inspect_graphs.py [--model tiny|table] [--max-batch-size N] [--steps N]
                               [--dot default/b8/lp --dot-path g.dot] [--threads N]
(the same as `python -m graphexec inspect`; --dot needs CUDA and exits 2 without it)
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from graphexec.cli import configure_threads
from graphexec.inspection import add_arguments, inspect_graphs

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    configure_threads(args.device or ("cuda" if torch.cuda.is_available() else "cpu"), args.threads)
    sys.exit(inspect_graphs(args))
