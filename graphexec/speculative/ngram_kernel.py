"""The n-gram match of a speculative step in one launch instead of ~30 small torch kernels.

    _ngram_kernel grid (b,): one row of `NgramHistory.match`: its last token written into
        its history at model_pos (clamped at 0: padding rows), then, over the window of
        the last W tokens, every end i <= W - 2 in blocks of BLOCK: the run length of
        w[i - t] == w[W - 1 - t] for t < NMAX; the longest run and its latest end (a later
        block wins a tie); the allowance overwritten with the drafts' count, and the
        drafts stored, -1 past it.

Its torch reference is `NgramHistory.write_last` + `NgramHistory.drafts`; both are integer
work, so the two give the same values (tests/speculative/test_ngram_kernel.py). A row
touches only its own slot's history (real rows hold distinct slots; padding rows write
column 0 of the padding slot's).
"""

from __future__ import annotations

import torch

from graphexec.runtime.triton_import import tl, triton


@triton.jit
def _ngram_kernel(
    SLOT,  # [b] i64: slot of each row
    MODEL_POS,  # [b] i64: sequence index of its last token (-1: a padding row)
    LAST,  # [b] i64: its last token
    ALLOW,  # [b] i64: its draft allowance; overwritten with the drafts' count
    TOKENS,  # [S, M + 1] i32: the histories (row stride s_tok)
    DRAFTS,  # [b, K] i64 contiguous: out, -1 past the count
    s_tok, K, NMIN,
    W: tl.constexpr, NMAX: tl.constexpr, BLOCK: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    base = TOKENS + tl.load(SLOT + r) * s_tok
    L = tl.load(MODEL_POS + r) + 1  # tokens in the history, the last included
    tl.store(base + tl.maximum(L - 1, 0), tl.load(LAST + r).to(tl.int32))
    tl.debug_barrier()  # the last token is the suffix's first: its store lands first
    best = -1
    end = -1
    for b0 in range(0, W - 1, BLOCK):
        i = b0 + tl.arange(0, BLOCK)
        ok = i <= W - 2  # a token follows the end
        run = ok
        m = tl.zeros([BLOCK], dtype=tl.int32)
        for t in tl.static_range(NMAX):
            at = L - 1 - t
            s = tl.load(base + tl.maximum(at, 0))
            s = tl.where(at >= 0, s, -2)  # before the sequence: equal to nothing
            c = L - W + i - t
            x = tl.load(base + c, mask=run & (i >= t) & (c >= 0), other=-1)
            run = run & (x == s)
            m += run.to(tl.int32)
        top = tl.max(m, 0)
        last_end = tl.max(tl.where(ok & (m == top), i, -1), 0)
        end = tl.where(top >= best, last_end, end)
        best = tl.maximum(best, top)
    count = tl.minimum(tl.load(ALLOW + r), W - 1 - end)
    count = tl.maximum(tl.where(best >= NMIN, count, 0), 0)
    tl.store(ALLOW + r, count)
    j = tl.arange(0, K_PAD)
    d = tl.load(base + L - W + end + 1 + j, mask=j < count, other=-1)
    tl.store(DRAFTS + r * K + j, d.to(tl.int64), mask=j < K)


def ngram_match(tokens: torch.Tensor, slot_ids: torch.Tensor, model_pos: torch.Tensor,
                last: torch.Tensor, allow: torch.Tensor, k: int, window: int, ngram_max: int,
                ngram_min: int) -> torch.Tensor:  # fmt: skip
    """`_ngram_kernel` (Triton): [b, k] i64 drafts; `allow` [b] (contiguous) becomes the
    drafts' count. `ngram_max` at most window - 1 (a longer run never fits)."""
    b = slot_ids.shape[0]
    drafts = torch.empty((b, max(k, 1)), dtype=torch.int64, device=slot_ids.device)
    if b:
        _ngram_kernel[(b,)](
            slot_ids, model_pos, last, allow, tokens, drafts, tokens.stride(0), drafts.shape[1],
            ngram_min,
            W=window, NMAX=ngram_max, BLOCK=min(1024, triton.next_power_of_2(window - 1)),
            K_PAD=triton.next_power_of_2(max(k, 1)), num_warps=4,
        )  # fmt: skip
    return drafts[:, :k]
