"""Shared pytest configuration: tests marked `gpu` are skipped where CUDA is unavailable,
tests marked `multigpu` where fewer than 2 GPUs are."""

from __future__ import annotations

import gc
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # threads that wait sleep instead of spinning (read when torch loads OpenMP, so before
    # the import): with both workers busy on 2 cores, a test that takes two threads (a lone
    # row's sum split across them) spun ~20x slower (1.1 s a 100k-token row against 0.05 s)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` on a 2-core machine: one torch thread a worker, or they fight for cores
    torch.set_num_threads(1)
    # and one for the processes a worker starts (gloo ranks, benchmark ranks), whose torch
    # would take a pool of every core beside the other worker (a rank of 3 tiny decode
    # steps: 38 s of wall with two threads on busy cores, 3 s with one); the CLI and the
    # server set their own count (--threads, or the idle cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def restore_threads():
    """Put torch's intra-op thread count back after a test that sets it (the CLI does)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_thread(restore_threads):
    """One torch thread for tests of tiny tensors: a pool as wide as a busy CI machine made
    them many times slower."""
    torch.set_num_threads(1)


# modules with the slowest CPU tests (10-40 s each), collected first: `-n 2` then ends on
# short tests, not on one worker's 40 s test while the other idles (whole modules move, so
# module fixtures are still set up once)
SLOW_FIRST = ("tests/distributed/test_hf_tp.py", "tests/engine/test_outputs.py",
              "tests/distributed/test_executor_tp.py", "tests/app/test_cli.py",
              "tests/app/test_without_triton.py", "tests/sampling/test_reference_stats.py",
              "tests/checkpoints/test_smollm2.py", "tests/speculative/test_executor_spec.py",
              "tests/distributed/test_sample_logits.py", "tests/benchmarks/test_bench_tp_step.py")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported now: its objects (torch, transformers, Triton's
    interpreter, scipy: millions) move to the collector's permanent generation, so a full
    collection scans only what the tests make (one scanning them all costs ~0.2 s on a
    2-core CPU)."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    gc.unfreeze()  # collectable again at exit (nanobind reported its objects leaked)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in SLOW_FIRST)  # stable
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    skip_multi = pytest.mark.skip(reason="needs 2 or more GPUs (marked multigpu)")
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
