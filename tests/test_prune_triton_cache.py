"""benchmarks/prune_triton_cache.py against Triton's own cache manager: after pruning, a
kernel group still loads (binary and metadata) and its IR files are gone."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import prune_triton_cache  # noqa: E402

cache = pytest.importorskip("triton.runtime.cache")
knobs = getattr(pytest.importorskip("triton"), "knobs", None)
if knobs is None:  # an older Triton sets its cache dir another way
    pytest.skip("needs triton.knobs", allow_module_level=True)


@pytest.fixture
def manager(tmp_path, monkeypatch):
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))
    return cache.FileCacheManager("k0")


def put_kernel(m, name: str) -> dict:
    group = {
        f"{name}.source": m.put("src", f"{name}.source"),
        f"{name}.ttir": m.put("ttir " * 100, f"{name}.ttir"),
        f"{name}.ttgir": m.put("ttgir", f"{name}.ttgir"),
        f"{name}.llir": m.put("llir", f"{name}.llir"),
        f"{name}.ptx": m.put("ptx " * 50, f"{name}.ptx"),
        f"{name}.cubin": m.put(b"\x7fELF", f"{name}.cubin"),
        f"{name}.json": m.put(json.dumps({"name": name}), f"{name}.json"),
    }
    m.put_group(f"{name}.json", group)
    return group


def test_pruned_group_still_loads_binary_and_metadata(tmp_path, manager, capsys):
    before = {n: put_kernel(manager, n) for n in ("_row_draw_kernel", "_block_pass_kernel")}
    launcher = manager.put(b"so", "cuda_utils.so")  # in no group: kept
    ir_bytes = sum(
        os.path.getsize(p) for g in before.values() for c, p in g.items() if c.split(".")[-1]
        not in ("cubin", "json")
    )  # fmt: skip
    assert prune_triton_cache.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == f"pruned 10 IR files, {ir_bytes / 1e6:.1f} MB"
    for name, group in before.items():
        loaded = manager.get_group(f"{name}.json")
        assert loaded == {c: p for c, p in group.items() if c.endswith((".cubin", ".json"))}
        for c, p in group.items():
            assert os.path.exists(p) == (c in loaded)
    assert os.path.exists(launcher)
    assert prune_triton_cache.prune(tmp_path) == (0, 0)  # nothing left to prune


def test_unreadable_group_is_left_alone(tmp_path, manager):
    group = put_kernel(manager, "k")
    grp = tmp_path / "k0" / "__grp__k.json"
    grp.write_text("{not json")
    assert prune_triton_cache.prune(tmp_path) == (0, 0)
    assert all(os.path.exists(p) for p in group.values())
