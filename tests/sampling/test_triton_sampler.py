"""The Triton sampler (CPU interpreter) against the torch reference, token for token.

Every route is forced at small V: the whole-row tile kernel, the split-row passes with a
candidate gather, and the exact bisection path (a candidate cap too small for any row).
"""

from __future__ import annotations

from tests.triton_env import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

import graphexec as gx  # noqa: E402
from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import reference  # noqa: E402
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import launch  # noqa: E402

P = gx.SamplingParams
V = 200
# the split routes use blocks of 16 tokens for the two-level draw, so V = 200 has 13
ROUTES = {
    "tile": dict(),
    "split": dict(tile_v=16, rows=2, cap=64, small=8, mid=16, draw_block=16),
    "exact": dict(tile_v=16, rows=2, cap=4, small=4, mid=4, draw_block=16),
    "split_one_block_tiles": dict(
        tile_v=16, rows=1, split=3, cap=64, small=16, mid=32, draw_block=16
    ),
}


def mixed(n: int, seed: int = 0) -> list[gx.SamplingParams]:
    kinds = [
        lambda i: P(seed=i, logit_bias={7: 3.0, 150: -2.0}, logprobs=3, logprobs_mode="processed"),
        lambda i: P(temperature=0.0, seed=i, logprobs=2),
        lambda i: P(top_k=5, seed=i, temperature=0.8),
        lambda i: P(top_p=0.8, seed=i, presence_penalty=0.7, frequency_penalty=0.4),
        lambda i: P(top_k=20, top_p=0.5, seed=i, temperature=1e-30, logit_bias={1: 10.0}),
        lambda i: P(min_p=0.2, seed=i, repetition_penalty=1.5, logprobs=0),
        lambda i: P(top_k=3, min_p=0.1, top_p=0.9, seed=i, temperature=1.5),
        lambda i: P(seed=i, temperature=0.7),
    ]
    return [kinds[i % len(kinds)](seed * 100 + i) for i in range(n)]


def inputs(B: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
    logits[0, 5] = float("nan")
    logits[3, 10:13] = float("inf")
    logits[4, 20:22] = logits[4].float().max() + 1  # a tied maximum at a tiny temperature
    logits[6, :] = float("-inf")  # nothing samplable
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    counts[torch.rand(B, V, generator=g) < 0.9] = 0
    prompt = torch.rand(B, V, generator=g) < 0.05
    bitmask = torch.randint(-(2**31), 2**31 - 1, (B, (V + 31) // 32), generator=g,
                            dtype=torch.int32)  # fmt: skip
    bitmask[::2] = -1
    return logits, counts, prompt, bitmask


def run_both(params, logits, counts, prompt, bitmask, variant, route, slots=None, num_top=3):
    B = logits.shape[0]
    table = SamplingTensors.from_params(params, V, "cpu", counts, prompt)
    slot_ids = torch.arange(B) if slots is None else slots
    pos = torch.arange(B) * 7 + 3
    ref = SamplerOutput.allocate(B, "cpu", num_top)
    tri = SamplerOutput.allocate(B, "cpu", num_top)
    kw = ROUTES[route]
    reference.sample(logits, slot_ids, pos, table, ref, bitmask, variant,
                     draw_block=kw.get("draw_block", reference.DRAW_BLOCK))  # fmt: skip
    launch.sample(logits, slot_ids, pos, table, tri, bitmask, variant, **kw)
    return ref, tri


def assert_same(ref: SamplerOutput, tri: SamplerOutput) -> None:
    assert torch.equal(ref.token_ids, tri.token_ids)
    assert torch.equal(ref.valid, tri.valid)
    if ref.logprobs is not None:
        torch.testing.assert_close(tri.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5,
                                   equal_nan=True)  # fmt: skip
        assert torch.equal(tri.ranks, ref.ranks)
        assert torch.equal(tri.top_token_ids, ref.top_token_ids)
        torch.testing.assert_close(tri.top_logprobs, ref.top_logprobs, rtol=1e-5, atol=1e-5,
                                   equal_nan=True)  # fmt: skip


@pytest.mark.parametrize("route", list(ROUTES))
def test_mixed_batch_equals_reference(route: str) -> None:
    B = 16
    logits, counts, prompt, bitmask = inputs(B, torch.float32, seed=1)
    ref, tri = run_both(mixed(B), logits, counts, prompt, bitmask, SamplerVariant.DEFAULT, route)
    assert not ref.valid[6] and ref.token_ids[6] == -1
    assert 10 <= ref.token_ids[3] < 13 or ref.token_ids[3] == -1
    assert_same(ref, tri)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("route", ["tile", "split"])
def test_half_precision_inputs(dtype: torch.dtype, route: str) -> None:
    B = 8
    logits, counts, prompt, bitmask = inputs(B, dtype, seed=2)
    ref, tri = run_both(mixed(B, 1), logits, counts, prompt, bitmask, SamplerVariant.DEFAULT,
                        route)  # fmt: skip
    assert_same(ref, tri)


@pytest.mark.parametrize("route", ["tile", "split"])
@pytest.mark.parametrize("variant", [SamplerVariant.NO_FILTER, SamplerVariant.TOP_K_TOP_P])
def test_variants_give_the_default_token(route: str, variant: SamplerVariant) -> None:
    logits, counts, prompt, bitmask = inputs(24, torch.float32, seed=3)
    params = [p for p in mixed(24, 2) if variant.serves(p)][:8]
    rows = torch.arange(len(params))
    args = (params, logits[rows], counts[rows], prompt[rows], bitmask[rows])
    _, fast = run_both(*args, variant, route)
    ref, dflt = run_both(*args, SamplerVariant.DEFAULT, route)
    assert torch.equal(fast.token_ids, dflt.token_ids)
    assert torch.equal(fast.token_ids, ref.token_ids)


def test_slots_of_a_larger_table() -> None:
    """Rows read their parameters through slot ids; the tokens follow the slot, not the row."""
    B = 6
    logits = inputs(8, torch.float32, seed=4)[0][:B]
    params = mixed(10, 3)
    slots = torch.tensor([9, 2, 5, 0, 7, 3])
    table = SamplingTensors.from_params(params, V, "cpu")
    pos = torch.arange(B)
    outs = []
    for fn in (reference.sample, launch.sample):
        out = SamplerOutput.allocate(B, "cpu", 3)
        fn(logits, slots, pos, table, out, None, SamplerVariant.DEFAULT)
        outs.append(out)
    assert_same(*outs)
    alone = gx.sample_logits(logits[:1], [params[9]], [0], backend="triton")
    assert alone.token_ids[0] == outs[1].token_ids[0]


def test_batch_position_invariance_triton() -> None:
    logits, counts, prompt, bitmask = inputs(8, torch.float32, seed=5)
    params = mixed(8, 4)
    pos = list(range(8))
    full = gx.sample_logits(logits, params, pos, bitmask=bitmask, backend="triton")
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    shuf = gx.sample_logits(logits[perm], [params[i] for i in perm], [pos[i] for i in perm],
                            bitmask=bitmask[perm], backend="triton")  # fmt: skip
    assert torch.equal(shuf.token_ids, full.token_ids[perm])


@pytest.mark.parametrize("route", ["split", "split_one_block_tiles"])
def test_two_level_rows_with_bad_data(route: str) -> None:
    """Plain rows (two-level draw) holding +inf in several blocks, NaN, a fully masked
    block, or nothing samplable: Triton equals the reference token for token."""
    B = 6
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(B, V, generator=g) * 3
    logits[0, [3, 40, 41, 199]] = float("inf")  # +inf in three blocks
    logits[1, 100] = float("inf")
    logits[2, ::3] = float("nan")
    logits[3, 16:48] = float("-inf")  # two whole blocks masked
    logits[4, :] = float("-inf")
    logits[5, :] = float("-inf")
    logits[5, 150] = 2.0  # one samplable token
    params = [P(seed=40 + i, temperature=0.5 + 0.1 * i) for i in range(B)]
    ref, tri = run_both(params, logits, None, None, None, SamplerVariant.DEFAULT, route,
                        num_top=None)  # fmt: skip
    assert ref.token_ids[0].item() in (3, 40, 41, 199) and ref.token_ids[1] == 100
    assert not ref.valid[4] and ref.token_ids[5] == 150
    assert_same(ref, tri)
    # the +inf row draws among its four +inf tokens, from more than one block
    table = SamplingTensors.from_params(params[:1] * 64, V, "cpu")
    out = SamplerOutput.allocate(64, "cpu", None)
    reference.sample(logits[:1].expand(64, -1), torch.arange(64), torch.arange(64), table, out,
                     draw_block=16)  # fmt: skip
    seen = set(out.token_ids.tolist())
    assert seen <= {3, 40, 41, 199} and len(seen) >= 3


def test_block_stats_logprobs_writer_serves_raw_rows(monkeypatch) -> None:
    """With the general logprobs kernel switched off, the writer that works from the block
    pass's raw stats (`raw_logprobs`) alone gives raw-mode rows the reference's logprobs,
    ranks and top-N (rows with a raw +inf are left to the general kernel)."""
    B = 8
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, V, generator=g) * 3
    logits[1, 17] = float("nan")
    logits[2, 40:80] = float("-inf")
    logits[3, [5, 50, 150]] = logits[3].max()  # tied max: ties to the lower id
    params = [P(seed=i, logprobs=4, temperature=0.6 + 0.1 * i, top_k=(0, 5)[i % 2])
              for i in range(B)]  # fmt: skip
    params[4] = P(seed=4, logprobs=None)  # a row that did not ask is written too
    monkeypatch.setattr(launch, "write_logprobs", lambda *a, **k: None)
    ref, tri = run_both(params, logits, None, None, None, SamplerVariant.DEFAULT, "split",
                        num_top=4)  # fmt: skip
    assert_same(ref, tri)


def test_rows_past_the_logprobs_cap_go_to_the_general_writer(monkeypatch) -> None:
    """A row whose top-N blocks outnumber lp_cap is left by `raw_logprobs` (done stays 0)
    to the general kernel; either way every row gets the reference's values."""
    B = 8
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(B, V, generator=g) * torch.linspace(0.2, 4.0, B)[:, None]
    params = [P(seed=i, logprobs=4, top_k=(0, 7)[i % 2]) for i in range(B)]
    done = []
    real = launch.write_logprobs

    def spy(*a, **k):
        done.append(k["done"].clone())
        return real(*a, **k)

    monkeypatch.setattr(launch, "write_logprobs", spy)
    table = SamplingTensors.from_params(params, V, "cpu")
    pos = torch.arange(B) * 5
    ref = SamplerOutput.allocate(B, "cpu", 4)
    tri = SamplerOutput.allocate(B, "cpu", 4)
    reference.sample(logits, torch.arange(B), pos, table, ref, None, SamplerVariant.DEFAULT,
                     draw_block=16)  # fmt: skip
    launch.sample(logits, torch.arange(B), pos, table, tri, None, SamplerVariant.DEFAULT,
                  **ROUTES["split"], lp_cap=4)  # fmt: skip
    assert_same(ref, tri)
    assert len(done) == 1 and 0 < int(done[0].sum()) < B  # both writers served rows
