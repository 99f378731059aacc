"""Capture every graph key of an executor (the demo's model by default: SmolLM2 once set
up, else TinyLM) and print one row per key:
`python -m graphexec inspect` (graphexec/app/inspection.py), run from a source checkout.

python tools/inspect_graphs.py [--model smollm2|PATH|CONFIG|tiny|table] [--max-batch-size N]
                               [--steps N] [--dot default/b8/lp --dot-path g.dot] [--threads N]
(--dot needs CUDA and exits 2 without it)
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from graphexec.app.inspection import add_arguments, inspect_graphs
from graphexec.runtime.threads import configure_threads

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="inspect_graphs.py",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args()
    configure_threads(args.device or ("cuda" if torch.cuda.is_available() else "cpu"), args.threads)
    sys.exit(inspect_graphs(args))
