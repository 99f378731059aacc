"""Run Triton kernels on the CPU in the tests: TRITON_INTERPRET=1 where CUDA is unavailable.

Triton decides between compiling and interpreting when a kernel is defined (at import of
the module that holds it), so the variable must be set before triton is imported. Test
files that launch kernels start with

    from tests.triton_env import ensure_interpreter; ensure_interpreter()

before importing triton or any `graphexec.sampling.triton.*` kernel module.
"""

from __future__ import annotations

import os
import sys


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def ensure_interpreter() -> None:
    """Set TRITON_INTERPRET=1 when CUDA is unavailable; raise if it is too late for that."""
    if interpreter_enabled():
        return
    import torch

    if torch.cuda.is_available():
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set and there is no CUDA "
            "device, so its kernels cannot run. Call tests.triton_env.ensure_interpreter() "
            "before anything imports triton (or run with TRITON_INTERPRET=1 in the environment)."
        )
    os.environ["TRITON_INTERPRET"] = "1"
