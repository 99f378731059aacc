"""Where Triton has no wheels (macOS, Windows) the package installs without it (an
environment marker) and its CPU route runs: the demo with TinyLM, in a process where
`import triton` fails (the run that also checks the demo's lines as requests finish)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.interpreter import ensure_interpreter

ensure_interpreter()  # triton_import imports Triton where it is installed

from graphexec.runtime.triton_import import (  # noqa: E402
    MISSING,
    _cdiv,
    _Missing,
    _next_power_of_2,
)

ROOT = Path(__file__).resolve().parents[2]
BLOCK = """
import runpy, sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTriton())
from graphexec.app import demo
demo.on_terminal = lambda: True  # progress bars as on a terminal
sys.argv = ["graphexec", *sys.argv[1:]]
runpy.run_module("graphexec", run_name="__main__")
"""


def test_triton_is_a_dependency_on_linux_only() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (triton,) = [d for d in deps if d.startswith("triton")]
    assert triton.replace(" ", "") == "triton>=3.0;sys_platform=='linux'"


def test_the_demo_runs_tinylm_on_the_cpu_without_triton_printing_each_request_as_it_finishes(
) -> None:  # fmt: skip
    """The demo without Triton, on a terminal (progress bars): every request's line comes
    out during the run, before its summary, once, and the progress lines count to 4/4."""
    r = subprocess.run([sys.executable, "-c", BLOCK, "demo", "--model", "tiny", "--device",
                        "cpu", "--threads", "1", "--requests", "4", "--max-batch-size", "2",
                        "--max-seq-len", "64", "--latency-steps", "1", "--speculative", "none"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "determinism check (replay vs eager, tokens and logprobs bit for bit): PASS" in r.stdout
    lines = r.stdout.splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("replay: 4 requests"))
    shown = [line.split()[0] for line in lines[:summary] if re.match(r"\s+r\d+ ", line)]
    assert sorted(shown) == ["r0", "r1", "r2", "r3"], r.stdout
    assert all(line.split()[:1] != [r] for line in lines[summary:] for r in shown)
    assert re.search(r"replay: .*4/4", r.stderr) and re.search(r"eager: .*/4", r.stderr), r.stderr


def test_the_stand_in_imports_kernels_and_refuses_to_launch_them() -> None:
    triton, tl = _Missing("triton"), _Missing("triton.language")
    assert tl.constexpr(7) == 7 and _cdiv(10, 4) == 3 and _next_power_of_2(33) == 64

    @triton.jit
    def kernel(X, N: tl.constexpr):
        pass

    @triton.jit(do_not_specialize=["N"])
    def other(X):
        pass

    assert triton.autotune(configs=[triton.Config({})], key=[])(kernel) is kernel
    for k in (kernel, other):
        with pytest.raises(ImportError, match="Triton is not installed") as e:
            k[(1,)](0)
        assert MISSING in str(e.value)
