"""Triton kernels of the sampler: one kernel family per file, each with a thin launcher.

Kernels run on CUDA, and on the CPU under TRITON_INTERPRET=1 (set before triton is
imported) for the tests; `graphexec.sampling.reference` is their definition.
"""

import os


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
