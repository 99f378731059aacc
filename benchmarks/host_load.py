"""A loaded serving host, for the step benchmarks (step_replay.py).

- `busy_processes`: N busy Python processes beside the run (API servers, tokenizers).
- `raised_priority`: this process at a lower nice value (a higher CPU share) for the
  block, as `serve --engine-nice` runs its engine processes; nothing if the OS refuses.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

from graphexec.runtime.threads import restore_nice, set_nice


@contextlib.contextmanager
def busy_processes(n: int, settle_s: float = 0.5):
    """n busy Python processes (each spins on a core) while the block runs; killed after."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for _ in range(n)]  # fmt: skip
    try:
        time.sleep(settle_s)  # started and spinning
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@contextlib.contextmanager
def raised_priority(nice: int):
    """Every thread of this process at nice value `nice` while the block runs, then each
    put back (`threads.set_nice`). Yields `nice`, or None (nothing changed) where the OS
    refuses."""
    try:
        was = set_nice(nice)
    except PermissionError:
        yield None
        return
    try:
        yield nice
    finally:
        restore_nice(was)
