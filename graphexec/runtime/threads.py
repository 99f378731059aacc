"""torch's CPU thread count for the CLI and tools: the cores this process may use that
are idle now (a pool larger than the cores it gets made the demo 5-13x slower on a busy
2-core machine), or what --threads asks for."""

from __future__ import annotations

import argparse
import logging
import os
import time

log = logging.getLogger("graphexec.app.cli")


def available_cores() -> int:
    """Cores this process may run on: its affinity mask where the OS has one (taskset or a
    container may allow fewer cores than os.cpu_count() reports)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """{cpu: (idle ticks, all ticks)} from /proc/stat for the cpus in `cpus`."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *vals = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                v = [int(x) for x in vals]
                out[int(name[3:])] = (v[3] + v[4], sum(v))  # idle + iowait
    return out


def idle_cores(read=cpu_times, sample_s: float = 0.2) -> int:
    """The available cores that are idle now (sampled over `sample_s`, at least 1): on
    cores other processes keep busy, a pool as wide as the machine waits on their work
    (measured on 2 busy cores: 2 threads 311-1625 ms a step, 1 thread 147-161 ms). Load
    averages lag by minutes (a pip install just before would count), so this samples."""
    try:
        cpus = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = set(range(os.cpu_count() or 1))
    try:
        a = read(cpus)
        time.sleep(sample_s)
        b = read(cpus)
    except OSError:
        return len(cpus)
    if not b:
        return len(cpus)
    idle = sum((b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]) for c in b if c in a)
    return max(1, min(len(cpus), round(idle)))


def cpu_threads(requested: int | None = None) -> int:
    """torch's intra-op thread count for a CPU run: `requested`, else the idle cores."""
    if requested is None:
        return idle_cores()
    if requested < 1:
        raise ValueError(f"threads must be >= 1, got {requested}")
    return requested


def configure_threads(device: str, requested: int | None) -> int | None:
    """Set torch's thread pool for a CPU run (a pool larger than the cores this process
    gets made the demo 5-13x slower on a busy 2-core machine); an explicit `requested`
    is applied on any device. Returns the count set, None where nothing was changed."""
    import torch

    if requested is None and torch.device(device).type != "cpu":
        return None
    n = cpu_threads(requested)
    torch.set_num_threads(n)
    why = "--threads" if requested is not None else f"idle cores of {available_cores()}"
    log.info("torch intra-op threads: %d (%s)", n, why)
    return n


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads (default on the CPU: the cores this process "
                   "may use)")  # fmt: skip
