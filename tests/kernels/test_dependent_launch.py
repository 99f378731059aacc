"""Programmatic dependent launch and the TMA tiles: when a kernel starts, and how it loads,
never changes a bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphexec.kernels import dependent_launch, fused, rms_norm
from graphexec.kernels import matmul as mm
from graphexec.kernels.attention import AttentionConfig, decode_attention
from graphexec.kernels.row_parallel import row_linear_gpu, row_split_gpu


def test_pdl_is_off_where_it_cannot_run() -> None:
    """Off the GPU (or not wanted) no launch asks for PDL, and the launch keywords are
    empty, so older Triton launchers never see `launch_pdl`."""
    assert not dependent_launch.enabled(True, torch.device("cpu"))
    assert not dependent_launch.enabled(False, torch.device("cuda", 0))
    assert dependent_launch.launch_options(False) == {}
    assert dependent_launch.launch_options(True) == {"launch_pdl": True}
    assert dependent_launch.kernel_options(True, torch.device("cpu")) == {"PDL": False}


def test_config_checks_the_prefetch() -> None:
    with pytest.raises(ValueError, match="prefetch_k"):
        mm.MatmulConfig(prefetch_k=-1)


def test_tile_for_takes_a_large_tile_only_of_the_calls_split() -> None:
    """A row-parallel layer (split 4) gets the large tile of split 4, never the one of
    another split; a plain call gets its decode tile's split."""
    t4 = mm.MatmulTile(128, 128, 64, 8, 3, 4, tma=True)
    cfg = mm.MatmulConfig.gpu().replace(large_tiles=((896, 896, t4),),
                                        verified=frozenset({(896, 896)}))  # fmt: skip
    assert cfg.tile(896, 896).split == 1
    assert cfg.tile_for(896, 896, 256) == cfg.tile(896, 896)
    assert cfg.tile_for(896, 896, 256, 4) == t4
    assert cfg.tile_for(896, 896, 64, 4) == dataclasses.replace(cfg.tile(896, 896), split=4)
    unverified = cfg.replace(verified=frozenset())
    assert unverified.tile_for(896, 896, 256, 4).tma is False


def test_tile_for_takes_a_long_tile_from_long_m_rows_only_where_verified() -> None:
    """Calls of at least long_m rows take the shape's verified long tile of their split;
    below it, or unverified, the large tile (or the decode tile) as before."""
    t_large = mm.MatmulTile(64, 64, 64, 4, 4, 4, tma=True, programs=2)
    t_long = mm.MatmulTile(128, 128, 64, 8, 5, 4, tma=True, programs=2)
    cfg = mm.MatmulConfig.gpu().replace(
        large_tiles=((896, 896, t_large),), long_tiles=((896, 896, t_long),),
        verified=frozenset({(896, 896)}), verified_long=frozenset({(896, 896)}))  # fmt: skip
    assert cfg.tile_for(896, 896, cfg.long_m - 1, 4) == t_large
    assert cfg.tile_for(896, 896, cfg.long_m, 4) == t_long
    assert cfg.tile_for(896, 896, 4096, 1) == cfg.tile(896, 896)  # another split
    assert cfg.replace(verified_long=frozenset()).tile_for(896, 896, 4096, 4) == t_large
    assert cfg.replace(verified=frozenset()).tile_for(896, 896, 4096, 4) == t_long
    assert cfg.replace(verified=frozenset()).tile_for(896, 896, 256, 4).tma is False
    with pytest.raises(ValueError, match="long_m"):
        mm.MatmulConfig(long_m=64, wide_m=64)
    with pytest.raises(ValueError, match="power of two"):
        mm.MatmulConfig(long_tiles=((896, 896, mm.MatmulTile(64, 64, 64, 4, 4, 3)),))


def test_tile_for_takes_a_wide_tile_from_wide_m_rows_only_where_verified() -> None:
    """Calls of wide_m rows up to long_m take the shape's verified wide tile of their
    split; below wide_m, unverified, or for a shape without one, the large tile."""
    t_large = mm.MatmulTile(64, 64, 64, 4, 6, 4, tma=True, programs=2)
    t_wide = mm.MatmulTile(128, 128, 64, 8, 5, 4, tma=True, programs=2)
    t_long = mm.MatmulTile(128, 256, 64, 8, 3, 4, tma=True, programs=4)
    both = frozenset({(896, 896)})
    cfg = mm.MatmulConfig.gpu().replace(
        large_tiles=((896, 896, t_large),), wide_tiles=((896, 896, t_wide),),
        long_tiles=((896, 896, t_long),), verified=both, verified_wide=both,
        verified_long=both)  # fmt: skip
    assert cfg.tile_for(896, 896, cfg.wide_m - 1, 4) == t_large
    assert cfg.tile_for(896, 896, cfg.wide_m, 4) == t_wide
    assert cfg.tile_for(896, 896, cfg.long_m - 1, 4) == t_wide
    assert cfg.tile_for(896, 896, cfg.long_m, 4) == t_long
    assert cfg.replace(verified_wide=frozenset()).tile_for(896, 896, cfg.wide_m, 4) == t_large
    assert cfg.replace(wide_tiles=()).tile_for(896, 896, cfg.wide_m, 4) == t_large
    assert cfg.replace(verified=frozenset()).tile_for(896, 896, cfg.wide_m, 4) == t_wide
    with pytest.raises(ValueError, match="wide_m"):
        mm.MatmulConfig(wide_m=64)
    with pytest.raises(ValueError, match="wide_m"):
        mm.MatmulConfig(wide_m=2048)


def test_gpu_tiles_keep_the_split_the_model_runs() -> None:
    """Every large, wide and long tile of the GPU preset splits K as the model runs the
    shape (the decode tile's split; o and down, row-parallel: at least ROW_SPLIT), so
    each can give the decode tile's bits."""
    from graphexec.kernels.row_parallel import ROW_SPLIT

    gpu = mm.MatmulConfig.gpu()
    row_parallel = {(896, 4864), (2048, 8192), (4096, 14336), (896, 896), (2048, 2048),
                    (4096, 4096)}  # fmt: skip
    for n, k, t in gpu.large_tiles + gpu.wide_tiles + gpu.long_tiles:
        want = gpu.tile(n, k).split
        want = max(ROW_SPLIT, want) if (n, k) in row_parallel else want
        assert t.split == want, (n, k, t)
        assert t.tma


# ---------------------------------------------------------------------------------- GPU


def _layer(B: int, D: int = 2048, H: int = 32, KV: int = 8, hd: int = 64, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    w = dict(ln=torch.randn(D, generator=g, **bf),
             qkv=torch.randn((H + 2 * KV) * hd, D, generator=g, **bf) * D**-0.5,
             o=torch.randn(D, H * hd, generator=g, **bf) * D**-0.5)  # fmt: skip
    x = torch.randn(B, D, generator=g, **bf)
    kv = torch.randn(2, B + 1, 64, KV, hd, generator=g, **bf)
    cos, sin = torch.randn(64, hd, generator=g, **bf), torch.randn(64, hd, generator=g, **bf)
    pos = torch.randint(0, 64, (B,), device="cuda", generator=g)
    return w, x, kv, cos, sin, pos, torch.arange(B, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 32, 256])
def test_cuda_pdl_chain_gives_the_bits_of_plain_launches(B) -> None:
    """norm -> qkv GEMM -> rotary + cache write -> attention -> o GEMM (row-parallel
    split) -> norm, every kernel launched with PDL, captured and replayed 20 times: the
    same bits as plain launches each time (a kernel reading before its predecessor's
    writes would show as a difference)."""
    w, x, kv, cos, sin, pos, slots = _layer(B)
    split = row_split_gpu(2048, 2048, 1)

    def chain(pdl: bool, kv: torch.Tensor):
        cfg = mm.MatmulConfig.gpu().replace(pdl=pdl)
        fc = fused.FusedConfig(pdl=pdl)
        h, res = rms_norm.residual_rms_norm(x, None, w["ln"], 1e-5, config=fc)
        qkv = mm.linear(h, w["qkv"], config=cfg)
        q = fused.rope_kv_write(qkv, pos, slots, cos, sin, kv, 32, config=fc)
        a = decode_attention(q, kv, slots, pos, 0.125, config=AttentionConfig(pdl=pdl))
        o = row_linear_gpu(a.reshape(B, -1), w["o"], split, config=cfg)
        return rms_norm.residual_rms_norm(o, res, w["ln"], 1e-5, config=fc)[0]

    want = chain(False, kv.clone())
    kv_pdl = kv.clone()
    held = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        held["y"] = chain(True, kv_pdl)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(held["y"], want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        held["y"] = chain(True, kv_pdl)
    for _ in range(20):
        g.replay()
        assert torch.equal(held["y"], want)


TMA_SHAPES = [(4096, 14336, False, 4), (14336, 4096, True, 1), (1152, 896, False, 1),
              (896, 896, False, 4)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,silu,split", TMA_SHAPES)
def test_cuda_tma_tile_is_the_pointer_tile(N, K, silu, split) -> None:
    """The TMA kernel and the pointer-load kernel with the same tile and split give the
    same bits (the same MMAs over the same parts in the same order), for M past a tile
    boundary and with every programs-per-tile count the launcher may pick."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or newer")
    g = torch.Generator(device="cuda").manual_seed(N)
    w = torch.randn((2 if silu else 1) * N, K, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(300, K, device="cuda", generator=g, dtype=torch.bfloat16)
    cfg = mm.MatmulConfig.gpu()
    for bm, bn in ((128, 128), (64, 256)):
        t = mm.MatmulTile(bm, bn, 64, 8, 3, split, tma=True)
        for P in sorted({1, split}):
            got = mm._launch(x, w * K**-0.5, None, silu, cfg, P, tile=t)
            ptr = dataclasses.replace(t, tma=False)
            assert torch.equal(got, mm._launch(x, w * K**-0.5, None, silu, cfg, P, tile=ptr))
            assert torch.equal(got[:7], mm._launch(x[:7], w * K**-0.5, None, silu, cfg, tile=t))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K,silu,split", TMA_SHAPES[:2])
def test_cuda_warp_specialised_tma_tile_is_the_pointer_tile(N, K, silu, split) -> None:
    """A TMA tile whose K loop is warp-specialised gives the pointer tile's bits: the
    producer warps only move the loads, the MMAs and their order are the same."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or newer")
    g = torch.Generator(device="cuda").manual_seed(K)
    w = torch.randn((2 if silu else 1) * N, K, device="cuda", generator=g, dtype=torch.bfloat16)
    x = torch.randn(300, K, device="cuda", generator=g, dtype=torch.bfloat16) * K**-0.5
    cfg = mm.MatmulConfig.gpu()
    t = mm.MatmulTile(128, 128, 64, 8, 3, split, tma=True, ws=True)
    try:
        got = mm._launch(x, w, None, silu, cfg, 1, tile=t)
    except Exception as e:  # noqa: BLE001 (a Triton that cannot warp-specialise this loop)
        pytest.skip(f"this Triton does not warp-specialise the TMA loop: {str(e)[:200]}")
    ptr = dataclasses.replace(t, tma=False, ws=False)
    assert torch.equal(got, mm._launch(x, w, None, silu, cfg, 1, tile=ptr))
    assert torch.equal(got[:7], mm._launch(x[:7], w, None, silu, cfg, 1, tile=ptr))
