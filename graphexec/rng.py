"""The counter-based noise every draw uses: a pure function u(seed, pos, token_id, stream).

Definition (the Triton twin in `graphexec/sampling/triton/philox.py` computes the same
bits):

    key     = (seed & 0xFFFFFFFF, seed >> 32)                 # seed in [0, 2**63)
    counter = (token_id >> 2, pos, stream, 0)                  # all uint32
    r       = Philox4x32-10(counter, key)                      # 4 uint32 words
    x       = r[token_id & 3]                                  # 4 consecutive tokens share one call
    u       = ((x >> 8) | 1) * 2**-24                          # odd multiple of 2**-24

so u lies in [2**-24, 1 - 2**-24], strictly inside (0, 1), and the integer-to-float step
is exact (an odd integer below 2**24 times a power of two). Philox4x32-10 is the
Salmon et al. (SC'11) generator: ten rounds of two 32x32->64 multiplications with the
constants 0xD2511F53 and 0xCD9E8D57 and Weyl key increments 0x9E3779B9, 0xBB67AE85.

`stream` separates independent uses of the same (seed, pos, token): token noise, the
block noise of the two-level draw (keyed on the block index), the fallback draw of a
filtered row whose candidate was not kept (its own token and block streams), speculative
acceptance coins, recovered-token noise, a rejection-mode draft model's draw. Nothing here holds
state: there is no generator object, no global RNG and no per-batch offset, which is what makes a
request's draws independent of batch, bucket, row, variant and eager-vs-replay.

The torch code below works on int64 tensors holding uint32 values and splits each
multiplication into 16-bit halves so that nothing overflows; it is the reference the
Triton kernel is tested against, bit for bit.
"""

from __future__ import annotations

import enum

import torch

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF
# u = ((x >> 8) | 1) * U_SCALE
U_SCALE = 2.0**-24


class Stream(enum.IntEnum):
    """Separate noise streams for separate uses of one (seed, pos, token)."""

    TOKEN = 0  # Gumbel noise of the main draw
    SPEC_ACCEPT = 1  # speculative decoding: acceptance coin per draft position
    SPEC_RECOVER = 2  # speculative decoding: noise of the recovered-token draw
    BLOCK = 3  # the block choice of the two-level draw ("token_id" = block index)
    MODEL = 4  # TableModel's logits (test model; never sampling noise)
    SPEC_DRAFT = 5  # speculative decoding, rejection mode: a draft model's own draw
    FALLBACK_TOKEN = 6  # a filtered row's fallback draw (its candidate was not kept): tokens
    FALLBACK_BLOCK = 7  # ... and its block choice


def _mul32_split(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * m for uint32 values a (held in int64) and a constant m.
    a's 16-bit halves times m stay below 2**48, so int64 never overflows."""
    th, tl = (a >> 16) * m, (a & 0xFFFF) * m  # a * m = th * 2**16 + tl
    hi = (th + (tl >> 16)) >> 16
    lo = (((th & 0xFFFF) << 16) + tl) & MASK32
    return hi, lo


def _mul32_wrapping(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_mul32_split`'s words from one int64 product taken modulo 2**64 (its two words are
    exact whatever the sign it wraps to): an eighth of the time on a CPU."""
    p = a * m
    return (p >> 32) & MASK32, p & MASK32


def _products_wrap() -> bool:
    """Whether this torch's int64 products wrap modulo 2**64 (every build does, but C++
    leaves signed overflow undefined): checked once, on products past 2**63, against
    Python's integers."""
    a = torch.tensor([0xFFFFFFFF, 0xDEADBEEF, 0x80000000, 0x7FFFFFFF, 1, 0], dtype=torch.int64)
    for m in (PHILOX_M0, PHILOX_M1):
        hi, lo = _mul32_wrapping(a, m)
        want = [(x * m >> 32, x * m & MASK32) for x in a.tolist()]
        if list(zip(hi.tolist(), lo.tolist(), strict=True)) != want:
            return False
    return True


_mul32 = _mul32_wrapping if _products_wrap() else _mul32_split


def philox4x32(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    k0: torch.Tensor,
    k1: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on broadcastable int64 tensors of uint32 values; returns 4 words."""
    c0, c1, c2, c3 = (t.to(torch.int64) & MASK32 for t in (c0, c1, c2, c3))
    k0, k1 = k0.to(torch.int64) & MASK32, k1.to(torch.int64) & MASK32
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mul32(c0, PHILOX_M0)
        hi1, lo1 = _mul32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & MASK32
        k1 = (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def random_bits(
    seed: torch.Tensor, pos: torch.Tensor, token_ids: torch.Tensor, stream: int = Stream.TOKEN
) -> torch.Tensor:
    """The uint32 word (in int64) for each (seed, pos, token_id); broadcastable shapes."""
    seed = seed.to(torch.int64)
    tok = token_ids.to(torch.int64)
    zero = torch.zeros((), dtype=torch.int64, device=tok.device)
    r0, r1, r2, r3 = philox4x32(
        tok >> 2, pos.to(torch.int64), zero + int(stream), zero, seed & MASK32, seed >> 32
    )
    lane = tok & 3
    return torch.where(lane == 0, r0, torch.where(lane == 1, r1, torch.where(lane == 2, r2, r3)))


def uniform(
    seed: torch.Tensor, pos: torch.Tensor, token_ids: torch.Tensor, stream: int = Stream.TOKEN
) -> torch.Tensor:
    """float32 uniforms strictly inside (0, 1): u(seed, pos, token_id, stream)."""
    x = random_bits(seed, pos, token_ids, stream)
    return ((x >> 8) | 1).to(torch.float32) * U_SCALE


def gumbel(
    seed: torch.Tensor, pos: torch.Tensor, token_ids: torch.Tensor, stream: int = Stream.TOKEN
) -> torch.Tensor:
    """float32 standard Gumbel noise -log(-log(u)); always finite."""
    u = uniform(seed, pos, token_ids, stream)
    return -torch.log(-torch.log(u))
