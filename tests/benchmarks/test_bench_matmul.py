"""CPU tests of bench_matmul's sweep bookkeeping (its timings need a GPU): which rows a
decode tile is judged on, which candidates keep the model's split, and a swept tile's
key read back as MatmulTile fields."""

import bench_matmul as bm

from graphexec.kernels.matmul_config import MatmulConfig, MatmulTile


def test_a_decode_tile_is_judged_on_the_rows_it_serves() -> None:
    gpu = MatmulConfig.gpu()
    rows = [1, 8, 32, 64, 128, 256, 1024]
    by = {s["layer"]: s for s in bm.shapes("llama-3.1-8b")}
    assert bm.decode_rows(by["qkv"], rows, gpu) == [1, 8, 32, 64]  # a large tile takes 128
    none = gpu.replace(large_tiles=())
    assert bm.decode_rows(by["qkv"], rows, none) == [1, 8, 32, 64, 128, 256]
    assert bm.decode_rows(by["qkv"], [512], gpu) == [512]  # nothing served: the first row


def test_candidates_keep_the_split_the_model_runs() -> None:
    gpu = MatmulConfig.gpu()
    by = {s["layer"]: s for s in bm.shapes("llama-3.2-1b")}
    assert bm.large_split(by["qkv"], gpu) == gpu.tile(3072, 2048).split
    assert bm.large_split(by["down"], gpu) >= 4  # row-parallel
    for t in bm.large_candidates(4, True, 8192, ws=True):
        assert t.split == 4 and t.tma and (8192 // 4) % t.block_k == 0
    assert {t.ws for t in bm.large_candidates(4, True, 8192, ws=True)} == {False, True}
    assert all(t.num_warps == 8 for t in bm.large_candidates(4, True, 8192, ws=True) if t.ws)
    assert not any(t.ws for t in bm.large_candidates(4, True, 8192))
    one, four = MatmulTile(64, 64, 128, 4, 4, 1), MatmulTile(64, 64, 128, 4, 4, 4)
    assert bm.swept(by["down"], four, gpu, keep_split=True)
    assert not bm.swept(by["down"], one, gpu, keep_split=True)
    assert bm.swept(by["down"], one, gpu, keep_split=False)


def test_a_tile_key_reads_back_as_its_fields() -> None:
    for t in (MatmulTile(64, 128, 64, 4, 6, 1, tma=True),
              MatmulTile(128, 128, 64, 8, 5, 4, tma=True, programs=2, ws=True)):
        key = f"{t.block_m}x{t.block_n}x{t.block_k}x{t.num_warps}x{t.num_stages}x{t.split}"
        key += f"x{t.programs}t" + ("w" if t.ws else "")
        assert MatmulTile(*eval(f"({bm.tile_fields(key)})")) == t
    assert bm.tile_fields("64x64x64x4x4x1") == "64, 64, 64, 4, 4, 1"
