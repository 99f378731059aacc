"""The CPU route: GEMMs and attention whose row bits never depend on the call, at BLAS speed.

torch's CPU GEMM (MKL, oneDNN for bf16) picks its kernel and its thread split by the
shape, M included. Measured on a 2-core Xeon (AVX512, MKL 2024.2, SmolLM2's weights):
a row of ``x @ w.T`` has one set of bits at M = 1 (a GEMV), another at every M in 2..512
with one thread; with two threads the [576, 1536] weight also rounds differently at M in
17..192 (K split across the threads), and with w in nn.Linear's [N, K] layout M = 2, 3
differ from M >= 4 for K = 576. So nothing here assumes a class of sizes: `RowMM`
measures, per operand (b's shape, strides and dtype, torch's thread count), which call
sizes among 1, 2, 4, ..., 512 give each row the same bits (random rows, at shifted
places), once per process, and cuts every product into calls of one such class only
(`_calls`: the largest that fits, until one call holds the rest, padded with zero
rows). A row's bits are then those of any other call, and a decode of one row costs a
2-row product, not a padded 8- or 16-row one.

`RowMM.attend` is decode attention over a slot-indexed cache with the rows grouped by
slot and key block: a prefill chunk's rows of one block share one copy of their live
keys, and the scores and p @ V are `RowMM` products over fixed key blocks (so a row's
sums have one order whatever rows share its slot, its call or its block), combined in
ascending block order.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # candidate rows per torch.mm call
KEY_BLOCK = 256  # keys per block of `RowMM.attend` (a multiple of 32: see `attend`)


def _classes(outs: dict[int, torch.Tensor]) -> list[list[int]]:
    """Sizes whose rows agree bit for bit (on the rows they share), ascending."""
    classes: list[list[int]] = []
    for s, y in outs.items():
        for c in classes:
            ref = outs[c[0]]
            n = min(len(ref), len(y))
            if torch.equal(ref[:n], y[:n]):
                c.append(s)
                break
        else:
            classes.append([s])
    return classes


def _calls(M: int, sizes: tuple[int, ...]) -> list[int]:
    """Call sizes (all of one class) for M rows: the largest that fits, again, until one
    call holds the rest with at most a quarter of it as padding (320 rows: 256 + 64, not
    a 512 call); the last call's zero rows are dropped."""
    calls, rest = [], M
    while rest > 0:
        up = next((t for t in sizes if t >= rest), None)
        down = next((t for t in reversed(sizes) if t <= rest), None)
        if up is not None and (down is None or 4 * up <= 5 * rest):
            calls.append(up)
            break
        calls.append(down)
        rest -= down
    return calls


class RowMM:
    """``a @ b`` in calls whose sizes are measured to give every row the same bits.

    `sizes(b)` probes once per operand key; `mm(a, b)` cuts a's rows into calls of those
    sizes. The choice among classes: the one with the most sizes, then the smallest
    (so the cheap small calls of decode and the big calls of prefill agree).
    """

    def __init__(self, candidates: tuple[int, ...] = SIZES) -> None:
        self.candidates = tuple(sorted(candidates))
        self._plans: dict[tuple, tuple[int, ...]] = {}
        self._cols = torch.arange(0)  # key indices, grown as needed
        self._pads: dict[tuple, torch.Tensor] = {}  # zero-padded rows of one call, by size
        self._batched: dict[tuple, bool] = {}  # row_linear's batched parts, as measured
        self._keys: dict[torch.device, torch.Tensor] = {}  # `_keys_buffer`'s storage

    def sizes(self, b: torch.Tensor) -> tuple[int, ...]:
        key = (tuple(b.shape), b.stride(), b.dtype, b.device, torch.get_num_threads())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._probe(b)
        return plan

    def _probe(self, b: torch.Tensor) -> tuple[int, ...]:
        """Random operands of b's shape, strides and dtype (never b's values: a block of
        zero keys would agree in any order). Every size runs rows 1..s, at places
        0..s - 1; the largest also runs rows 0..top - 1, so a row's place changes too."""
        g = torch.Generator().manual_seed(0)
        top = self.candidates[-1]
        x = torch.randn(*b.shape[:-2], top + 1, b.shape[-2], generator=g).to(b.dtype)
        rb = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype)
        rb.copy_(torch.randn(b.shape, generator=g))
        outs = {s: torch.matmul(x[..., 1 : 1 + s, :], rb).flatten(0, -2) if b.dim() == 2
                else torch.matmul(x[..., 1 : 1 + s, :], rb).transpose(0, 1).flatten(1)
                for s in self.candidates}  # fmt: skip
        classes = _classes(outs)
        best = max(classes, key=lambda c: (len(c), -c[0]))
        shifted = torch.matmul(x[..., :top, :], rb)[..., 1:, :]  # rows 1..top - 1, in place
        n = min(best[-1], top - 1)
        if not torch.equal(shifted[..., :n, :], torch.matmul(x[..., 1 : 1 + n, :], rb)):
            warnings.warn(f"torch.matmul rounds a row by its place in the call (b "
                          f"{list(b.shape)} {b.dtype}): CPU rows are not batch-invariant",
                          stacklevel=3)  # fmt: skip
        return tuple(best)

    def padded(self, M: int, b: torch.Tensor) -> int:
        """M rows rounded up to what `mm` with b computes (M itself when a call size)."""
        return sum(_calls(M, self.sizes(b)))

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [M, K] @ b [K, N] -> [M, N], or batched: a [Z, M, K] @ b [Z, K, N] (torch.bmm);
        a row's bits independent of M and of its place in the call."""
        M, N = a.shape[-2], b.shape[-1]
        calls = _calls(M, self.sizes(b)) if M else []
        if len(calls) == 1 and calls[0] == M:
            return torch.matmul(a, b)
        if len(calls) == 1:  # one padded call (a decode row): no copies out
            s = calls[0]
            if a.dim() > 2:
                return torch.matmul(F.pad(a, (0, 0, 0, s - M)), b)[..., :M, :]
            # a kept buffer of s rows: rows past M hold earlier calls' rows (a GEMM row's
            # bits never depend on the other rows), ~10 us less than a fresh pad per call
            key = (s, a.shape[1], a.dtype, a.device)
            pad = self._pads.get(key)
            if pad is None:
                with torch.inference_mode(False):  # written in place in and out of it
                    pad = self._pads[key] = a.new_zeros((s, a.shape[1]))
            pad[:M] = a
            return torch.matmul(pad, b)[:M]
        out = torch.empty((*a.shape[:-2], M, N), dtype=a.dtype, device=a.device)
        i = 0
        for s in calls:
            rest = min(s, M - i)
            if s == rest:
                out[..., i : i + s, :] = torch.matmul(a[..., i : i + s, :], b)
            else:  # zero rows below it: its bits are those of any call of s rows
                pad = a.new_zeros((*a.shape[:-2], s, a.shape[-1]))
                pad[..., :rest, :] = a[..., i:, :]
                out[..., i:, :] = torch.matmul(pad, b)[..., :rest, :]
            i += rest
        return out

    # ---- the ops of `ops.ForwardOps` ----------------------------------------------------

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               *, config=None) -> torch.Tensor:  # fmt: skip
        """x [M, K] @ w [N, K].T (+ bias, added after the one product); `config` unused."""
        out = self.mm(x, w.t())
        return out if bias is None else out.add_(bias)

    def row_linear(self, x: torch.Tensor, w: torch.Tensor, split, bias=None, *,
                   f32: bool = False) -> torch.Tensor:  # fmt: skip
        """A row-parallel layer's product over the rank's parts of K
        (`row_parallel.row_linear_reference`'s bits): w stored K-major in float32
        (`row_weight`). The parts as one batched product [parts, M, k] @ [parts, k, N]
        where measured (`_batched_ok`) to give each part the bits of its own `mm`, so any
        world's batch of parts agrees; else one `mm` per part."""
        from graphexec.kernels.matmul import tree_sum
        from graphexec.kernels.row_parallel import finish, row_linear_reference

        wt, parts = w.t(), split.local
        if not (w.dtype == torch.float32 and wt.is_contiguous()
                and self._batched_ok(tuple(wt.shape), parts)):  # fmt: skip
            return row_linear_reference(x, w, split, bias, f32=f32, mm=self.mm)
        M, K = x.shape
        xs = x.float().view(M, parts, K // parts).transpose(0, 1).contiguous()
        acc = tree_sum(self.mm(xs, wt.view(parts, K // parts, -1)))  # parts [parts, M, N]
        return acc if f32 else finish(acc, bias, x.dtype)

    def _batched_ok(self, shape: tuple[int, int], parts: int) -> bool:
        """Whether the batched product of `parts` parts of a [K, N] float32 weight gives
        every part the bits of `mm` alone (random operands; once per shape, parts and
        thread count)."""
        key = (shape, parts, torch.get_num_threads())
        ok = self._batched.get(key)
        if ok is None:
            g = torch.Generator().manual_seed(0)
            K, N = shape
            k = K // parts
            wt = torch.randn(K, N, generator=g)
            ok = True
            for M in (1, 3, 40):
                xs = torch.randn(parts, M, k, generator=g)
                both = self.mm(xs, wt.view(parts, k, N))
                ok &= all(torch.equal(both[j], self.mm(xs[j], wt[j * k : (j + 1) * k]))
                          for j in range(parts))  # fmt: skip
            self._batched[key] = ok
        return ok

    def attend(self, q: torch.Tensor, kv: torch.Tensor, slot_ids: torch.Tensor,
               positions: torch.Tensor, scale: float, window: int | None = None, *,
               config=None, block: int = KEY_BLOCK) -> torch.Tensor:  # fmt: skip
        """Attention of one query token per row over its slot's live keys (the signature
        of `attention.decode_attention`; `config` unused), math in float32.

        Rows are grouped by slot and by the 256-key block of their position (one host
        read: the CPU only), so a row computes only blocks up to its own: a prefill chunk
        skips the causally dead half. For a group, its live keys (blocks up to its
        furthest position, from the first block of its nearest window) are copied once,
        zero past the furthest position. Per KV head: scores of the group's rows (all G
        query heads of a row: GEMM rows) as `mm`, masked by position and window; a row's
        max; exp; per block the sum of p and p @ V (`mm`), added into the row's sums in
        ascending block order, only over the blocks that hold its live keys. So every sum
        a row takes has the same operands in the same order in any call. The exp runs over
        whole blocks (numel a multiple of 32), so every element takes torch's vectorised
        path."""
        B, H, hd = q.shape
        T, KV = kv.shape[2], kv.shape[3]
        G = H // KV
        out = torch.empty((B, H, hd), dtype=q.dtype, device=q.device)
        if B == 0:
            return out
        pos = positions.clamp(0, T - 1)
        qf = q.float()
        if B == 1:  # a decode row: its own group
            return self._attend_slot(qf, kv[:, int(slot_ids[0])], pos, scale, window, G,
                                     block).to(q.dtype)  # fmt: skip
        # groups of (slot, block of the row's position): a row pays only for its own
        # blocks, so a prefill chunk skips the causally dead half (one host read)
        key = slot_ids.long() * (T // block + 1) + pos // block
        groups, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
        if len(groups) == 1:
            slot = int(slot_ids[0])
            return self._attend_slot(qf, kv[:, slot], pos, scale, window, G, block).to(q.dtype)
        order = torch.argsort(inverse, stable=True)
        for g, rows in zip(groups.tolist(), order.split(counts.tolist()), strict=True):
            slot = g // (T // block + 1)
            out[rows] = self._attend_slot(qf[rows], kv[:, slot], pos[rows], scale, window, G,
                                          block).to(q.dtype)  # fmt: skip
        return out

    def _keys_buffer(self, KV: int, L: int, hd: int, device) -> torch.Tensor:
        """A contiguous [2, KV, L, hd] float32 for a group's live keys (the strides of a
        fresh one: the products' operands never change with the buffer's history), on
        storage kept between calls: a fresh one a layer cost ~0.2 ms in first-touch page
        faults on a 2-core EPYC. Every element a call reads is written first."""
        n = 2 * KV * L * hd
        flat = self._keys.get(device)
        if flat is None or flat.numel() < n:
            with torch.inference_mode(False):  # written in place in and out of it
                flat = self._keys[device] = torch.empty(n, device=device)
        return flat[:n].view(2, KV, L, hd)

    def _attend_slot(self, q, kv, pos, scale, window, G, block) -> torch.Tensor:
        """q [n, H, hd] float32 of one slot's rows, kv [2, T, KV, hd] its cache row; the
        KV heads are the batch of every product ([KV, n G, hd] @ [KV, hd, block])."""
        if window is None:
            return self._attend_causal(q, kv, pos, scale, G, block)
        n, H, hd = q.shape
        KV = kv.shape[2]
        lo, hi = (int(v) for v in torch.aminmax(pos))
        first = 0 if window is None else max(0, lo - window + 1) // block
        nb = hi // block + 1 - first
        start, L = first * block, nb * block
        keys = self._keys_buffer(KV, L, hd, q.device)
        keys[:, :, : hi + 1 - start] = kv[:, start : hi + 1].transpose(1, 2)
        keys[:, :, hi + 1 - start :].zero_()  # past every row: never read stale (NaN) entries
        kt = keys[0].transpose(1, 2)  # [KV, hd, L]
        j = torch.arange(start, start + L, device=q.device)
        live = j <= pos[:, None]  # [n, L]
        if window is not None:
            live &= j > pos[:, None] - window
        blive = live.view(n, nb, block).any(-1)  # [n, nb]: blocks holding live keys
        # GEMM rows padded once (zero queries, all keys live: finite, then dropped) to a
        # call size of the score product, not once per block
        M = n * G
        Mp = self.padded(M, kt[:, :, :block])
        qh = q.new_zeros((KV, Mp, hd))
        qh[:, :M] = q.view(n, KV, G, hd).transpose(0, 1).reshape(KV, M, hd)
        if Mp > M:
            live = torch.cat([live, live.new_ones((Mp - M + G - 1) // G, L)])
            blive = torch.cat([blive, blive.new_ones(live.shape[0] - n, nb)])
            n = live.shape[0]
        s = torch.full((KV, Mp, L), float("-inf"), device=q.device)
        picks = []  # per block: its GEMM rows (None: every row)
        for b in range(nb):
            cols = slice(b * block, (b + 1) * block)
            r = blive[:, b]
            gr = None if bool(r.all()) else r.repeat_interleave(G)[:Mp].nonzero().flatten()
            picks.append(gr)
            if gr is None:
                s[:, :, cols] = self.mm(qh, kt[:, :, cols])
            elif len(gr):
                s[:, gr, cols] = self.mm(qh[:, gr], kt[:, :, cols])
        s.mul_(scale).masked_fill_(~live.repeat_interleave(G, 0)[:Mp], float("-inf"))
        p = torch.exp(s - s.amax(-1, keepdim=True))  # finite: a row's own key is live
        sums = p.view(KV, Mp, nb, block).sum(-1)  # [KV, Mp, nb]
        den = torch.zeros((KV, Mp), device=q.device)
        acc = torch.zeros((KV, Mp, hd), device=q.device)
        for b, gr in enumerate(picks):  # ascending: one order of the sums for every call
            cols = slice(b * block, (b + 1) * block)
            if gr is None:
                acc += self.mm(p[:, :, cols], keys[1, :, cols])
                den += sums[:, :, b]
            elif len(gr):
                acc[:, gr] += self.mm(p[:, gr, cols], keys[1, :, cols])
                den[:, gr] += sums[:, gr, b]
        out = acc[:, :M] / den[:, :M, None]  # [KV, n G, hd]
        return out.view(KV, M // G, G, hd).transpose(0, 1).reshape(M // G, H, hd)

    def _attend_causal(self, q, kv, pos, scale, G, block) -> torch.Tensor:
        """`_attend_slot` without a window, for rows whose positions share one block (as
        `attend` groups them): every block up to theirs holds live keys of every row, so
        the sums need no row picks. The scores are one product over all the blocks (a
        score column is one hd-long dot product: its bits do not depend on the number of
        columns, tested), p @ V one product per block, added in ascending order."""
        n, H, hd = q.shape
        KV = kv.shape[2]
        hi = int(pos.max())
        nb = hi // block + 1
        L = nb * block
        keys = self._keys_buffer(KV, L, hd, q.device)
        keys[:, :, : hi + 1] = kv[:, : hi + 1].transpose(1, 2)
        keys[:, :, hi + 1 :].zero_()  # past every row: never read stale (NaN) entries
        M = n * G
        kt = keys[0].transpose(1, 2)  # [KV, hd, L]
        Mp = self.padded(M, kt)
        qh = q.new_zeros((KV, Mp, hd)) if Mp > M else q.new_empty((KV, M, hd))
        # the scale on the queries (fewer multiplies than on the scores; one place for all)
        torch.mul(q.view(n, KV, G, hd).transpose(0, 1), scale, out=qh[:, :M].view(KV, n, G, hd))
        s = self.mm(qh, kt)  # [KV, Mp, L]; padding rows: all live
        if len(self._cols) < L or self._cols.device != q.device:
            self._cols = torch.arange(2 * L, device=q.device)
        # only the last block holds keys past a row (the group shares it): mask it alone
        last = L - block
        dead = self._cols[last:L] > pos[:, None]  # [n, block]
        s[:, :M, last:].view(KV, n, G, block).masked_fill_(dead[None, :, None], float("-inf"))
        # whole blocks: numel a multiple of 32, so every element takes the vector path
        p = s.sub_(s.amax(-1, keepdim=True)).exp_()
        sums = p.view(KV, Mp, nb, block).sum(-1)  # [KV, Mp, nb]
        acc, den = self.mm(p[:, :, :block], keys[1, :, :block]), sums[:, :, 0]
        if nb > 1:
            den = den.clone()
        for b in range(1, nb):  # ascending: one order of the sums for every call
            cols = slice(b * block, (b + 1) * block)
            acc += self.mm(p[:, :, cols], keys[1, :, cols])
            den += sums[:, :, b]
        out = acc[:, :M].div_(den[:, :M, None])  # [KV, n G, hd]
        return out.view(KV, n, G, hd).transpose(0, 1).reshape(n, H, hd)


def rope_kv(qkv: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
            cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, heads: int, *,
            config=None) -> torch.Tensor:  # fmt: skip
    """`fused.rope_kv_write_reference` with q and k rotated in one pass (fewer small ops
    per layer; every op elementwise, so the same bits); q returned as a view."""
    B, (T, KVH, hd) = qkv.shape[0], kv.shape[2:]
    pos = positions.clamp(0, T - 1)
    qk = qkv[:, : (heads + KVH) * hd].view(B, heads + KVH, hd)
    x1, x2 = qk.chunk(2, dim=-1)
    r = qk * cos[pos].unsqueeze(1) + torch.cat([-x2, x1], dim=-1) * sin[pos].unsqueeze(1)
    kv[0, slot_ids, pos] = r[:, heads:]
    kv[1, slot_ids, pos] = qkv[:, (heads + KVH) * hd :].view(B, KVH, hd)
    return r[:, :heads]


def residual_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, *, config=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`fused.residual_rms_norm_reference` in plain ops, float32 math: torch's fused CPU
    rms_norm costs ~40 us a call on a decode row (61 calls a token). Every op is per row
    (the mean a reduction over one row's D values, the same for any row count: tested)."""
    new = x if residual is None else residual + x
    f = new.float()
    normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * normed.to(x.dtype), new
