"""Triton cache keys of the sampler's kernels are the same whichever kernel a process hashes
first (`runtime.triton_keys`): the launcher's process and one that compiles a single
kernel ahead (`benchmarks/gpu/precompile.py`) name the same disk-cache entries. (Triton
3.6, the GPU host's, fails this without `settle`: _topk_kernel's keys differ; 3.9 merges a
callee's globals after hashing it, and passes either way.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (not imported here: the other tests set TRITON_INTERPRET before anything imports it)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")

ROOT = Path(__file__).resolve().parents[2]
# a row kernel whose callees read constexpr globals of other modules, and its module
KERNELS = [("tail", "_topk_kernel")]

# the launcher's process: the module that launches them imported, keys read in launch order
LAUNCHER = """
import json, graphexec.sampling.triton.launch as launch
print(json.dumps({k: getattr(launch, k).cache_key for k in %r}))
"""
# a process that hashes one kernel, first, the way precompile.py does (its module settled)
AHEAD = """
import importlib, json
from graphexec.runtime.triton_keys import settle
mod = importlib.import_module("graphexec.sampling.triton." + %r)
settle(mod)
print(json.dumps(getattr(mod, %r).cache_key))
"""


def _run(code: str) -> object:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # JIT functions, whose keys these are
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=240, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_kernel_hashed_alone_has_the_launchers_key() -> None:
    launcher = _run(LAUNCHER % [name for _, name in KERNELS])
    for module, name in KERNELS:
        assert _run(AHEAD % (module, name)) == launcher[name], name
