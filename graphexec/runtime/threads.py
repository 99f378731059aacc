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


def engine_threads(engines: int = 1) -> int:
    """torch threads for each of `engines` CPU engines sharing this host (serve's default):
    the cores this process may use (`available_cores`), split evenly, at least 1. Fixed by
    configuration, not by the load at start, so a restart serves alike."""
    return max(1, available_cores() // max(1, engines))


def cpu_threads(requested: int | None = None) -> int:
    """torch's intra-op thread count for a CPU run: `requested`, else the idle cores."""
    if requested is None:
        return idle_cores()
    if requested < 1:
        raise ValueError(f"threads must be >= 1, got {requested}")
    return requested


def configure_threads(device: str, requested: int | None, why: str | None = None,
                      quiet: bool = False) -> int | None:  # fmt: skip
    """Set torch's thread pool for a CPU run (a pool larger than the cores this process
    gets made the demo 5-13x slower on a busy 2-core machine); an explicit `requested`
    is applied on any device. `why`: where `requested` came from (logged; default
    "--threads"); `quiet`: no log line (the caller logged it). Returns the count set,
    None where nothing was changed."""
    import torch

    if requested is None and torch.device(device).type != "cpu":
        return None
    n = cpu_threads(requested)
    torch.set_num_threads(n)
    if not quiet:
        if requested is None:
            why = f"idle cores of {available_cores()}"
        log.info("torch intra-op threads: %d (%s)", n, why or "--threads")
    return n


def positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_threads_argument(p: argparse.ArgumentParser, serve: bool = False) -> None:
    default = ("the cores this process may use (its affinity), split among the "
               "--data-parallel engines" if serve else "the cores this process may use "
               "that are idle at start")  # fmt: skip
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help=f"torch CPU threads (default on the CPU: {default})")  # fmt: skip


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the calling thread
        return [0]


def set_nice(nice: int) -> dict[int, int]:
    """Every thread of this process at nice value `nice` (Linux keeps one per thread; new
    threads inherit their creator's); returns each thread's value before. An engine loop
    above a host's other work is rescheduled sooner after it waits (`serve --engine-nice`).
    Below the current value needs CAP_SYS_NICE: where refused, nothing is changed and the
    PermissionError says so."""
    was: dict[int, int] = {}
    try:
        for t in _thread_ids():
            was[t] = os.getpriority(os.PRIO_PROCESS, t)
            os.setpriority(os.PRIO_PROCESS, t, nice)
    except OSError as e:
        restore_nice(was)
        raise PermissionError(f"nice {nice}: refused by the OS ({e.strerror}; below the "
                              "current value needs CAP_SYS_NICE)") from e  # fmt: skip
    return was


def restore_nice(was: dict[int, int]) -> None:
    """Put back the values `set_nice` returned (a thread that has ended is skipped)."""
    for t, v in was.items():
        try:
            os.setpriority(os.PRIO_PROCESS, t, v)
        except OSError:
            pass
