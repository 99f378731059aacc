"""Whether Triton kernels run under its CPU interpreter (TRITON_INTERPRET=1, set before
triton is imported): kernels pick their interpreter presets by it."""

import os


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
