"""The Triton processing (`process.tile_x`, which every pass runs) equals
processing.process_logits bit for bit."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from graphexec.params import SamplingParams  # noqa: E402
from graphexec.sampling.processing import process_logits  # noqa: E402
from graphexec.sampling.tensors import SamplingTensors  # noqa: E402
from graphexec.sampling.triton.process import bias_ids, proc_args, tile_x  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@triton.jit
def _process_kernel(P, x_ptr, FL: tl.constexpr, NB_P2: tl.constexpr, BLOCK: tl.constexpr):
    """x [B, V] f32 of `tile_x`, a [BLOCK] tile per program: grid (B, cdiv(V, BLOCK))."""
    row = tl.program_id(0)
    slot = tl.load(P.slots + row).to(tl.int64)
    lo = tl.program_id(1) * BLOCK
    offs = lo + tl.arange(0, BLOCK)
    x = tile_x(P, row, slot, bias_ids(P, slot, NB_P2), offs, lo, lo + BLOCK, FL)
    tl.store(x_ptr + row.to(tl.int64) * P.vocab + offs, x, mask=offs < P.vocab)


def process(logits, slot_ids, table, bitmask=None, *, block: int = 1024) -> torch.Tensor:
    """[B, V] processed logits, as every pass computes them."""
    B, V = logits.shape
    x = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    if B == 0:
        return x
    pos = torch.zeros(B, dtype=torch.int64, device=logits.device)
    P, fl = proc_args(logits, slot_ids, pos, table, bitmask)
    _process_kernel[(B, triton.cdiv(V, block))](
        P, x, FL=fl, NB_P2=max(16, triton.next_power_of_2(table.bias_ids.shape[1])),
        BLOCK=block, enable_fp_fusion=False,
    )  # fmt: skip
    return x


DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAN, INF = float("nan"), float("inf")
V = 77  # not a multiple of 32 (last bitmask word partial) nor of the tile width
NB = 4

# One slot each. Slots 0-3 and 10 have every penalty off, 3 and 10 with a -0.0 presence
# or frequency penalty (x - -0.0 turns a -0.0 logit into +0.0 where the reference applies it).
PARAMS = [
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=0.0, seed=1, logit_bias={3: 7.0, 4: -7.0, 10: 0.0, 11: -0.0}),
    SamplingParams(temperature=0.7, seed=2, logit_bias={0: 2.5, 76: -1.0}),
    SamplingParams(temperature=1.7, seed=3, presence_penalty=-0.0),
    SamplingParams(temperature=0.3, seed=4, repetition_penalty=1.3, logit_bias={5: -100.0}),
    SamplingParams(temperature=0.0, seed=5, repetition_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(temperature=2.0, seed=6, presence_penalty=1.5, frequency_penalty=-1.2),
    SamplingParams(
        temperature=1.1,
        seed=7,
        repetition_penalty=0.5,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logit_bias={1: 1e30, 2: -3.25, 40: 0.5, 70: 1.0},
    ),
    SamplingParams(temperature=0.0, seed=8, repetition_penalty=2.0, presence_penalty=0.25),
    SamplingParams(temperature=1e-3, seed=9, repetition_penalty=1.05, frequency_penalty=0.1),
    SamplingParams(temperature=0.9, seed=10, frequency_penalty=-0.0, logit_bias={6: 1.0, 9: 2.0}),
    SamplingParams(temperature=1.3, seed=11, repetition_penalty=3.0, logit_bias={7: -0.5}),
]
S = len(PARAMS)
# Rows read slots through slot_ids: a permutation of a subset, slot 4 twice.
SLOTS = [11, 3, 0, 5, 4, 7, 1, 9, 4, 8, 2, 6, 10]
B = len(SLOTS)
ROW = {s: r for r, s in enumerate(SLOTS)}  # a batch row of each slot
NEG_ZERO_TOKEN = 50  # row ROW[3] has logit -0.0 here, allowed, generated before


def _table(penalties: str) -> SamplingTensors:
    """penalties: which of token_counts / prompt_mask the table holds."""
    g = torch.Generator().manual_seed(1)
    t = SamplingTensors.allocate(S, V, DEV, max_bias=NB, penalties=True)
    t.write_rows(torch.arange(len(PARAMS)), PARAMS, V)
    counts = torch.randint(0, 4, (S, V), generator=g, dtype=torch.int32)
    counts[torch.rand(S, V, generator=g) < 0.5] = 0
    counts[:, 0] = 2**20 + 1  # count -> f32 is exact here; large frequency term
    counts[3, NEG_ZERO_TOKEN] = 1  # presence -0.0 applies: -0.0 - -0.0 = +0.0
    t.token_counts.copy_(counts)
    t.prompt_mask.copy_(torch.rand(S, V, generator=g) < 0.3)
    if penalties in ("none", "prompt"):
        t.token_counts = None
    if penalties in ("none", "counts"):
        t.prompt_mask = None
    return t


def _logits(dtype: torch.dtype, rows: int = B, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[:, 13] = x[:, 13].abs()  # some exact positives / negatives around 0
    specials = [NAN, INF, -INF, -0.0, 0.0, 1e-40, -1e-40, 3e38, -3e38, 1e-3]
    for r in range(rows):
        for k, v in enumerate(specials):
            x[r, (3 + 5 * r + 7 * k) % vocab] = v
    if rows == B:
        r = ROW[1]  # biased ids of slot 1
        x[r, 3], x[r, 4], x[r, 10], x[r, 11] = NAN, INF, -0.0, -0.0
        x[ROW[3], NEG_ZERO_TOKEN] = -0.0
        x[ROW[0]] = NAN  # a row with nothing samplable
    return x.to(dtype).to(DEV)


def _bitmask(rows: int = B, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    words = (vocab + 31) // 32
    m = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int32)
    m[0] = -1  # all allowed (bit 31 set: the sign bit)
    m[3] = 0  # nothing allowed
    m[4, -1] = -(2**31)  # only bit 31 of the last word: beyond V, ignored
    if rows == B:
        m[ROW[1]] = -1  # the NaN / inf / -0.0 biased ids of slot 1 allowed
        m[ROW[7], 0] = 0  # biased ids 1 and 2 of slot 7 disallowed
        m[ROW[3], NEG_ZERO_TOKEN // 32] = -1
    return m.to(DEV)


def assert_same_bits(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Bitwise equality (so -0.0 != +0.0), NaN equal to NaN."""
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    gb, rb = got.view(torch.int32), ref.view(torch.int32)
    bad = (gb != rb) & ~nan
    assert not bool(bad.any()), (
        f"{int(bad.sum())} entries differ, first at {bad.nonzero()[0].tolist()}: "
        f"got {got[bad][0].item()!r}, reference {ref[bad][0].item()!r}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("penalties", ["none", "counts", "prompt", "both"])
@pytest.mark.parametrize("with_bitmask", [False, True])
def test_equals_reference(dtype: torch.dtype, penalties: str, with_bitmask: bool) -> None:
    table = _table(penalties)
    logits = _logits(dtype)
    slots = torch.tensor(SLOTS, device=DEV)
    bitmask = _bitmask() if with_bitmask else None
    ref = process_logits(logits, slots, table, bitmask)
    assert_same_bits(process(logits, slots, table, bitmask), ref)


@pytest.mark.parametrize("block", [16, 32, 128])
def test_tilings(block: int) -> None:
    # tiles that cut the row, its bitmask words and its bias ids anywhere
    table = _table("both")
    logits = _logits(torch.float32)
    slots = torch.tensor(SLOTS, device=DEV)
    ref = process_logits(logits, slots, table, _bitmask())
    got = process(logits, slots, table, _bitmask(), block=block)
    assert_same_bits(got, ref)


def test_strided_inputs_and_int32_slots() -> None:
    table = _table("both")
    # logits: a column slice of a wider tensor (row stride != V); bitmask likewise
    wide = _logits(torch.bfloat16, vocab=V + 19)
    logits = wide[:, 5 : 5 + V]
    words = (V + 31) // 32
    bitmask = torch.cat([_bitmask(), torch.zeros(B, 3, dtype=torch.int32, device=DEV)], 1)
    bitmask = bitmask[:, :words]
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEV)
    ref = process_logits(logits, slots.long(), table, bitmask)
    assert_same_bits(process(logits, slots, table, bitmask), ref)


def test_column_strided_logits() -> None:
    table = _table("counts")
    logits = _logits(torch.float16).t().contiguous().t()  # column stride B, row stride 1
    slots = torch.tensor(SLOTS, device=DEV)
    assert logits.stride(1) != 1
    assert_same_bits(process(logits, slots, table), process_logits(logits, slots, table))


def test_random_large_table() -> None:
    # 48 rows drawn from a 200-slot table with random parameters, V = 300
    g = torch.Generator().manual_seed(3)
    Sb, Bb, Vb, nb = 200, 48, 300, 6
    t = SamplingTensors.allocate(Sb, Vb, DEV, max_bias=nb, penalties=True)
    temp = torch.rand(Sb, generator=g) * 2
    temp[torch.rand(Sb, generator=g) < 0.3] = 0.0
    t.temperature.copy_(temp)
    t.inv_temperature.copy_(torch.where(temp == 0, 1.0, 1.0 / temp))
    rep = torch.exp(torch.randn(Sb, generator=g) * 0.5)
    rep[torch.rand(Sb, generator=g) < 0.4] = 1.0
    t.repetition_penalty.copy_(rep)
    t.inv_repetition_penalty.copy_(1.0 / rep)
    for col in (t.presence_penalty, t.frequency_penalty):
        v = torch.rand(Sb, generator=g) * 4 - 2
        v[torch.rand(Sb, generator=g) < 0.4] = 0.0
        col.copy_(v)
    ids = torch.stack([torch.randperm(Vb, generator=g)[:nb] for _ in range(Sb)]).int()
    ids[torch.rand(Sb, nb, generator=g) < 0.5] = Vb
    ids = ids.sort(dim=1).values  # a table's ids are ascending, -1 pads last
    ids[ids == Vb] = -1
    t.bias_ids.copy_(ids)
    t.bias_values.copy_(torch.where(ids >= 0, torch.randn(Sb, nb, generator=g) * 5, 0.0))
    t.token_counts.copy_(torch.randint(0, 3, (Sb, Vb), generator=g, dtype=torch.int32))
    t.prompt_mask.copy_(torch.rand(Sb, Vb, generator=g) < 0.2)
    slots = torch.randperm(Sb, generator=g)[:Bb].to(DEV)
    logits = _logits(torch.float32, rows=Bb, vocab=Vb, seed=4)
    bitmask = _bitmask(Bb, Vb)
    assert_same_bits(process(logits, slots, t, bitmask), process_logits(logits, slots, t, bitmask))


def test_empty_batch() -> None:
    table = _table("none")
    x = process(torch.empty(0, V, device=DEV), torch.empty(0, dtype=torch.int64), table)
    assert x.shape == (0, V) and x.dtype == torch.float32
