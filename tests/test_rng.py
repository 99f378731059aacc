"""The counter-based noise of graphexec.rng: Philox4x32-10 known answers, the documented
counter/key/lane layout, the uniform mapping into the open interval, and bit quality."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch

from graphexec import rng
from graphexec.sampling import reference

M32 = 0xFFFFFFFF


def philox_py(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Independent pure-Python Philox4x32-10 (Salmon et al., SC'11; Random123)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & M32,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & M32,
        )
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


# Random123 kat_vectors for philox4x32_10
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def _t(v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers_torch(ctr, key, expected) -> None:
    out = rng.philox4x32(*(_t(c) for c in ctr), *(_t(k) for k in key))
    assert tuple(int(w) for w in out) == expected


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_philox_known_answers_python_twin(ctr, key, expected) -> None:
    # guards the independent implementation used below
    assert philox_py(ctr, key) == expected


def test_philox_matches_python_twin_on_random_inputs() -> None:
    g = np.random.default_rng(1234)
    n = 300
    ctr = g.integers(0, 2**32, size=(4, n), dtype=np.uint64).astype(np.int64)
    key = g.integers(0, 2**32, size=(2, n), dtype=np.uint64).astype(np.int64)
    # include the extremes in some lanes
    ctr[:, :3] = [[0, M32, 0x80000000]] * 4
    key[:, :3] = [[M32, 0, 0x7FFFFFFF]] * 2
    words = rng.philox4x32(*(torch.from_numpy(c) for c in ctr), *(torch.from_numpy(k) for k in key))
    got = torch.stack(words, dim=1).tolist()
    for i in range(n):
        exp = philox_py(tuple(int(c) for c in ctr[:, i]), (int(key[0, i]), int(key[1, i])))
        assert tuple(got[i]) == exp, i


def test_both_32_bit_products_give_pythons_words() -> None:
    """The split product and the wrapping one (used where int64 products wrap, checked at
    import) give the exact words of a * m, on random uint32 values and the extremes."""
    g = torch.Generator().manual_seed(5)
    a = torch.cat([torch.randint(0, 2**32, (4000,), generator=g, dtype=torch.int64),
                   torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1])])  # fmt: skip
    for m in (rng.PHILOX_M0, rng.PHILOX_M1):
        want = [(x * m >> 32, x * m & M32) for x in a.tolist()]
        for f in (rng._mul32_split, rng._mul32_wrapping, rng._mul32):
            hi, lo = f(a, m)
            assert list(zip(hi.tolist(), lo.tolist(), strict=True)) == want, f.__name__
    assert rng._mul32 is rng._mul32_wrapping  # what every torch build does


@pytest.mark.parametrize("seed", [0, 1, 0xDEADBEEF, 2**32, 2**32 + 5, 2**63 - 1, 0x123456789ABCDEF])
def test_random_bits_layout(seed: int) -> None:
    """counter = (tok >> 2, pos, stream, 0), key = (seed lo, seed hi), word = r[tok & 3]."""
    toks = torch.tensor([0, 1, 2, 3, 4, 7, 41, 1000, 2**20 + 3])
    for pos in (0, 1, 77, 2**32 - 1):
        for stream in (rng.Stream.TOKEN, rng.Stream.SPEC_ACCEPT, rng.Stream.SPEC_RECOVER):
            bits = rng.random_bits(_t(seed), _t(pos), toks, stream)
            for tok, b in zip(toks.tolist(), bits.tolist(), strict=True):
                words = philox_py((tok >> 2, pos, int(stream), 0), (seed & M32, seed >> 32))
                assert b == words[tok & 3], (seed, pos, stream, tok)


def test_uniform_is_the_documented_mapping() -> None:
    seed = torch.tensor([3, 2**40 + 9]).unsqueeze(1)
    pos = torch.tensor([0, 12345]).unsqueeze(1)
    toks = torch.arange(257).unsqueeze(0)
    bits = rng.random_bits(seed, pos, toks)
    u = rng.uniform(seed, pos, toks)
    assert u.dtype == torch.float32
    scaled = u.double() * 2.0**24
    assert torch.equal(scaled, scaled.round())
    assert torch.equal(scaled.to(torch.int64), (bits >> 8) | 1)
    assert (scaled.to(torch.int64) % 2 == 1).all()


@pytest.mark.parametrize(
    "word,expected",
    [
        (0, 2.0**-24),
        (0xFF, 2.0**-24),
        (0x100, 2.0**-24),
        (0x200, 3 * 2.0**-24),
        (0x80000000, 0.5 + 2.0**-24),
        (0xFFFFFDFF, 1.0 - 3 * 2.0**-24),
        (0xFFFFFEFF, 1.0 - 2.0**-24),
        (M32, 1.0 - 2.0**-24),
    ],
)
def test_uniform_mapping_extreme_words(monkeypatch, word: int, expected: float) -> None:
    fake = lambda seed, pos, tok, stream=0: torch.full_like(tok, word, dtype=torch.int64)
    monkeypatch.setattr(rng, "random_bits", fake)
    u = rng.uniform(_t(0), _t(0), torch.arange(4))
    assert (u > 0).all() and (u < 1).all()
    assert torch.equal(u, torch.full((4,), expected, dtype=torch.float32))
    g = rng.gumbel(_t(0), _t(0), torch.arange(4))
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("word", [0, M32])
def test_row_gumbel_extreme_words_finite(monkeypatch, word: int) -> None:
    def fake(c0, c1, c2, c3, k0, k1):
        shape = torch.broadcast_shapes(c0.shape, c1.shape, k0.shape)
        w = torch.full(shape, word, dtype=torch.int64)
        return w, w, w, w

    monkeypatch.setattr(reference, "philox4x32", fake)
    seed, pos = torch.tensor([1, 2]), torch.tensor([0, 3])
    g = reference.row_gumbel_stream(seed, pos, 10, rng.Stream.TOKEN)
    assert g.shape == (2, 10)
    assert torch.isfinite(g).all()
    u = 2.0**-24 if word == 0 else 1 - 2.0**-24
    expected = -np.log(-np.log(np.float32(u)))
    np.testing.assert_allclose(g.numpy(), expected, rtol=1e-5)


def test_uniform_open_interval_and_gumbel_finite_on_many_draws() -> None:
    seed = torch.arange(16).unsqueeze(1) * 977 + 2**33
    pos = torch.arange(16).unsqueeze(1)
    toks = torch.arange(4096).unsqueeze(0)
    u = rng.uniform(seed, pos, toks)
    assert u.shape == (16, 4096)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(rng.gumbel(seed, pos, toks)).all()
    # mean and variance of U(0, 1), loosely (n = 65536)
    assert abs(u.double().mean().item() - 0.5) < 0.006
    assert abs(u.double().var().item() - 1 / 12) < 0.002


def test_pure_function_and_streams_positions_seeds_differ() -> None:
    toks = torch.arange(1024)
    base = rng.uniform(_t(11), _t(5), toks)
    assert torch.equal(base, rng.uniform(_t(11), _t(5), toks))
    others = [
        rng.uniform(_t(11), _t(5), toks, rng.Stream.SPEC_ACCEPT),
        rng.uniform(_t(11), _t(5), toks, rng.Stream.SPEC_RECOVER),
        rng.uniform(_t(11), _t(6), toks),
        rng.uniform(_t(12), _t(5), toks),
        rng.uniform(_t(11 + 2**32), _t(5), toks),  # the seed's high word matters
    ]
    for o in others:
        assert (o != base).float().mean() > 0.99
    s1 = rng.uniform(_t(11), _t(5), toks, rng.Stream.SPEC_ACCEPT)
    s2 = rng.uniform(_t(11), _t(5), toks, rng.Stream.SPEC_RECOVER)
    assert (s1 != s2).float().mean() > 0.99
    # adjacent tokens sharing one Philox call still get different words
    assert (base[0::4] != base[1::4]).all()


def test_row_gumbel_equals_gumbel_per_token() -> None:
    V = 37  # not a multiple of 4: the last Philox call is partly used
    seed = torch.tensor([0, 1, 2**32 + 1, 2**63 - 1, 987654321])
    pos = torch.tensor([0, 9, 2**32 - 1, 3, 100])
    rg = reference.row_gumbel_stream(seed, pos, V, rng.Stream.TOKEN)
    per_tok = rng.gumbel(seed.unsqueeze(1), pos.unsqueeze(1), torch.arange(V).unsqueeze(0))
    assert rg.shape == (5, V) and rg.dtype == torch.float32
    assert torch.equal(rg, per_tok)


def test_chi_square_uniformity_of_bits() -> None:
    """Bytes of the words over many (seed, pos, token) are uniform; p > 1e-6."""
    seed = torch.tensor([42, 2**35 + 7]).repeat_interleave(64).unsqueeze(1)
    pos = torch.arange(64).repeat(2).unsqueeze(1)
    toks = torch.arange(4096).unsqueeze(0)
    bits = rng.random_bits(seed, pos, toks).flatten()  # 524288 words
    assert bits.min() >= 0 and bits.max() <= M32
    for shift in (0, 8, 16, 24):
        byte = ((bits >> shift) & 0xFF).numpy()
        counts = np.bincount(byte, minlength=256)
        p = scipy.stats.chisquare(counts).pvalue
        assert p > 1e-6, (shift, p)
    # every bit is set half the time
    ones = torch.stack([((bits >> i) & 1).sum() for i in range(32)]).double()
    n = bits.numel()
    z = (ones - n / 2) / (n / 4) ** 0.5
    assert z.abs().max() < 5.5  # two-sided p ~ 4e-8 per bit
    # the floats used by the sampler: 1024 equal bins of u
    u = rng.uniform(seed, pos, toks).flatten().double()
    counts = np.bincount((u * 1024).floor().to(torch.int64).numpy(), minlength=1024)
    assert counts.size == 1024
    assert scipy.stats.chisquare(counts).pvalue > 1e-6


def test_chi_square_pairs_of_adjacent_tokens() -> None:
    """Pairs (u_t, u_t+1) in a 16 x 16 grid: adjacent lanes of one call are independent."""
    seed = torch.tensor(2024)
    pos = torch.arange(128).unsqueeze(1)
    toks = torch.arange(2048).unsqueeze(0)
    u = rng.uniform(seed, pos, toks)
    a = (u[:, 0::2] * 16).floor().to(torch.int64)
    b = (u[:, 1::2] * 16).floor().to(torch.int64)
    counts = np.bincount((a * 16 + b).flatten().numpy(), minlength=256)
    assert scipy.stats.chisquare(counts).pvalue > 1e-6
