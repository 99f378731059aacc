"""Triton kernels of verification's row bookkeeping: one launch each for step 1 (flatten)
and step 4 (emit) of `verify.verify_step`, in place of some thirty small torch kernels
(a fixed ~60 us per replayed step on an H100). Their torch references are
`verify.clean_drafts` + `verify.flatten_rows` and `verify.emit`; tests compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _flatten_kernel(
    slot_ids,  # [B] i64
    positions,  # [B] i64
    drafts_in,  # [B, K] i64, contiguous
    drafts,  # [B, K] i64 out: cleaned (-1 from the first pad or bad id on)
    rows_slot,  # [B*T] i64 out
    rows_pos,  # [B*T] i64 out
    count_ids,  # [B*T, K] i64 out: drafts before each offset, -1 elsewhere
    V,
    K: tl.constexpr,
    KP2: tl.constexpr,
    TP2: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    T = K + 1
    k = tl.arange(0, KP2)
    d = tl.load(drafts_in + b * K + k, mask=k < K, other=-1)
    bad = (d < 0) | (d >= V) | (k >= K)
    first = tl.min(tl.where(bad, k, KP2), axis=0)
    d = tl.where(k < first, d, -1)
    tl.store(drafts + b * K + k, d, mask=k < K)
    j = tl.arange(0, TP2)
    tl.store(rows_slot + b * T + j, tl.load(slot_ids + b) + j * 0, mask=j < T)
    tl.store(rows_pos + b * T + j, tl.load(positions + b) + j, mask=j < T)
    before = k[None, :] < j[:, None]
    ids = tl.where(before, d[None, :], -1)
    tl.store(count_ids + (b * T + j[:, None]) * K + k[None, :], ids,
             mask=(j[:, None] < T) & (k[None, :] < K))  # fmt: skip


@triton.jit
def _emit_kernel(
    drafts,  # [B, K] i64 (cleaned)
    cand,  # [B, T] i64: the token each offset emits if the run stops there
    accepted,  # [B, K] bool (unused when STRICT: accepted = drafts == cand)
    token_ids,  # [B, T] i64 out
    num_tokens,  # [B] i64 out
    num_accepted,  # [B] i64 out
    valid,  # [B] bool out
    K: tl.constexpr,
    TP2: tl.constexpr,
    STRICT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    T = K + 1
    j = tl.arange(0, TP2)
    c = tl.load(cand + b * T + j, mask=j < T, other=-1)
    d = tl.load(drafts + b * K + j, mask=j < K, other=-1)
    if STRICT:
        acc = (d >= 0) & (d == c)
    else:
        acc = tl.load(accepted + b * K + j, mask=j < K, other=0) != 0
    acc = acc & (j < K)
    n_acc = tl.min(tl.where(acc, TP2, j), axis=0)  # the first offset not accepted
    last = tl.sum(tl.where(j == n_acc, c, 0), axis=0)
    ok = last >= 0
    n_tok = n_acc + ok.to(tl.int64)
    tok = tl.where(j < n_acc, d, tl.where((j == n_acc) & ok, last, -1))
    tl.store(token_ids + b * T + j, tok, mask=j < T)
    tl.store(num_tokens + b, n_tok)
    tl.store(num_accepted + b, tl.maximum(n_tok - 1, 0))
    tl.store(valid + b, n_tok > 0)


def flatten(slot_ids, positions, draft_ids, vocab_size: int):
    """Triton twin of `clean_drafts` + `flatten_rows`: (drafts [B, K], rows_slot [B*T],
    rows_pos [B*T], count_ids [B*T, K] or None)."""
    B, K = draft_ids.shape
    T = K + 1
    dev = draft_ids.device
    # the kernel indexes by row: strided views (a transposed draft tensor) are copied
    slot_ids, positions, draft_ids = (t.contiguous() for t in (slot_ids, positions, draft_ids))
    drafts = torch.empty((B, K), dtype=torch.int64, device=dev)
    rows_slot = torch.empty(B * T, dtype=torch.int64, device=dev)
    rows_pos = torch.empty(B * T, dtype=torch.int64, device=dev)
    count_ids = torch.empty((B * T, max(K, 1)), dtype=torch.int64, device=dev)
    if B:
        _flatten_kernel[(B,)](
            slot_ids, positions, draft_ids, drafts, rows_slot, rows_pos, count_ids, vocab_size, K=K,
            KP2=max(2, triton.next_power_of_2(max(K, 1))), TP2=triton.next_power_of_2(T),
        )  # fmt: skip
    return drafts, rows_slot, rows_pos, (count_ids if K else None)


def emit(drafts, cand, out, accepted=None) -> None:
    """Triton twin of `verify.emit`; accepted None = strict (accepted iff draft == cand)."""
    B, K = drafts.shape
    if B == 0:
        return
    _emit_kernel[(B,)](
        drafts, cand, drafts if accepted is None else accepted, out.token_ids, out.num_tokens,
        out.num_accepted, out.valid, K=K, TP2=max(2, triton.next_power_of_2(K + 1)),
        STRICT=accepted is None,
    )  # fmt: skip
