"""CPU tests of the GPU host's compile log and precompile tool (benchmarks/gpu/): what a
log line holds, how the tool reads logs, and how it rebuilds a specialisation for Triton.
The compiles themselves need the GPU host (or `../shared/gpu/sass.py`'s stand-in)."""

import gzip
import json
import sys
import types
from pathlib import Path
from typing import NamedTuple

import pytest

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"
if str(GPU) not in sys.path:
    sys.path.insert(0, str(GPU))

import compile_log  # noqa: E402
import precompile  # noqa: E402


class Pair(NamedTuple):
    ptr: object
    n: object


def _spec(name: str, flag: int) -> dict:
    return {"name": name, "signature": {"P": ["*fp32", "constexpr"], "N": "i32", "F": "constexpr"},
            "constant_keys": [[0, 1], [2]], "constant_vals": [1, {"constexpr": flag}],
            "attrs_keys": [[0, 0]], "attrs_vals": [[["tt.divisibility", 16]]],
            "options": {"num_warps": 4, "extern_libs": [["libdevice", "/elsewhere/x.bc"]],
                        "supported_fp8_dtypes": ["fp8e5"]},
            "key": "k"}  # fmt: skip


def _log_line(tmp_path, name: str, flag: int, secs: float) -> str:
    """One line as the plugin writes it, for a kernel with a named-tuple argument."""
    log = tmp_path / f"one-{flag}-{secs}.log"
    key = object()
    sig = {"P": Pair("*fp32", "constexpr"), "N": "i32", "F": "constexpr"}
    info = types.SimpleNamespace(name=name.rpartition(".")[2])
    compile_log._started[id(key)] = 0.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COMPILE_LOG", str(log))
        mp.setattr(compile_log.time, "perf_counter", lambda: secs)
        compile_log._post(key=key, fn=info, compile={
            "specialization_data": json.dumps(_spec(name, flag)), "signature": sig})
    return log.read_text()


def test_a_logged_compile_keeps_its_seconds_and_its_named_tuples(tmp_path) -> None:
    line = _log_line(tmp_path, "fake_kernels.k", 3, 42.5)
    ((secs, spec),) = precompile.read_specs([_write(tmp_path / "a.log", line)])
    d = json.loads(spec)
    assert secs == 42.5 and d["name"] == "fake_kernels.k"
    assert d["tuple_types"] == {"P": f"{__name__}.Pair"}  # plain args are not named


def _write(path: Path, text: str) -> Path:
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_logs_are_read_once_per_variant_longest_first(tmp_path) -> None:
    a = _log_line(tmp_path, "fake_kernels.k", 1, 2.0)
    b = _log_line(tmp_path, "fake_kernels.k", 2, 70.0)
    hit = _log_line(tmp_path, "fake_kernels.k", 2, 0.01)  # a disk-cache hit of b's variant
    logs = [_write(tmp_path / "x.log", a + "pytest noise\n" + hit),
            _write(tmp_path / "y.log.gz", b + a)]  # fmt: skip
    got = precompile.read_specs(logs)
    assert [s for s, _ in got] == [70.0, 2.0]
    assert [json.loads(spec)["constant_vals"][1]["constexpr"] for _, spec in got] == [2, 1]


def test_logs_merge_into_one_that_reads_back_the_same(tmp_path) -> None:
    a = _write(tmp_path / "a.log", _log_line(tmp_path, "fake_kernels.k", 1, 2.0))
    b = _write(tmp_path / "b.log.gz", _log_line(tmp_path, "fake_kernels.k", 2, 70.0))
    merged = tmp_path / "merged.log.gz"
    assert precompile.main(["--write", str(merged), str(a), str(b)]) == 0
    assert precompile.read_specs([merged]) == precompile.read_specs([a, b])
    assert len(precompile.read_specs([merged, a])) == 2  # merging again adds nothing


def test_a_variant_is_rebuilt_as_triton_preload_does_with_its_named_tuples(monkeypatch) -> None:
    import triton.runtime.driver  # noqa: F401 (the module, which `driver` shadows as a name)

    calls = []

    class Backend:
        @staticmethod
        def parse_options(options):
            return dict(options, parsed=True)

    class Kernel:
        device_caches = {0: (None, None, None, Backend, None)}

        def _do_compile(self, *args, **kwargs):
            calls.append((args, kwargs))

    stub = types.SimpleNamespace(active=types.SimpleNamespace(get_current_device=lambda: 0))
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "driver", stub)
    d = _spec("fake_kernels.k", 5)
    d["tuple_types"] = {"P": f"{__name__}.Pair"}
    precompile._preload(Kernel(), d)
    ((key, sig, device, constexprs, options, attrs), kw) = calls[0]
    assert key == "k" and device == 0 and kw == {"warmup": True}
    assert isinstance(sig["P"], Pair) and sig["P"].n == "constexpr"  # read by field name
    assert repr(sig["P"]) == repr(Pair("*fp32", "constexpr"))  # Triton's cache key holds it
    assert constexprs[(0, 1)] == 1 and constexprs[(2,)].value == 5
    assert attrs == {(0, 0): [["tt.divisibility", 16]]}
    # this install's libdevice, not the recording host's path; JSON lists back to tuples
    assert "extern_libs" not in options and options["supported_fp8_dtypes"] == ("fp8e5",)
    assert options["parsed"]


def test_a_kernel_that_is_gone_is_reported_not_raised() -> None:
    name, _, err = precompile.compile_one(json.dumps(_spec("graphexec.no_such_module.k", 1)))
    assert name == "graphexec.no_such_module.k" and "ModuleNotFoundError" in err
    fake = types.ModuleType("fake_kernels_gone")
    sys.modules["fake_kernels_gone"] = fake
    try:
        _, _, err = precompile.compile_one(json.dumps(_spec("fake_kernels_gone.k", 1)))
    finally:
        del sys.modules["fake_kernels_gone"]
    assert "AttributeError" in err
