"""Decode attention on the CPU over a slot-indexed cache, in `RowMM` products.

Rows are grouped by slot and key block: a prefill chunk's rows of one block share one
copy of their live keys, and the scores and p @ V are products (`mm`, whose rows never
depend on the call) over fixed blocks of `KEY_BLOCK` keys, so a row's sums have one
order whatever rows share its slot, its call or its block, combined in ascending block
order.
"""

from __future__ import annotations

import torch

KEY_BLOCK = 256  # keys per block (a multiple of 32: see `KeyBlockAttention.attend`)


class KeyBlockAttention:
    """`attend` for a class with `mm(a, b)`, `padded(M, b)` and `alone(b)`
    (`cpu_route.RowMM`); it keeps `_keys` and `_heads` (storage by device), `_row_ok`
    (measured operand layouts) and `_cols` (key indices)."""

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
        first = max(0, lo - window + 1) // block
        nb = hi // block + 1 - first
        start, L = first * block, nb * block
        keys = self._keys_buffer(KV, L, hd, q.device)
        keys[:, :, : hi + 1 - start] = kv[:, start : hi + 1].transpose(1, 2)
        keys[:, :, hi + 1 - start :].zero_()  # past every row: never read stale (NaN) entries
        kt = keys[0].transpose(1, 2)  # [KV, hd, L]
        j = torch.arange(start, start + L, device=q.device)
        live = (j <= pos[:, None]) & (j > pos[:, None] - window)  # [n, L]
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
        if n == 1 and G > 1 and self._row_products_ok(KV, G, L, hd, block):
            return self._attend_row(q, kv, pos, scale, G, block, hi, L)
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
        dead = self._past_keys(pos, L, block)  # [n, block]
        s[:, :M, L - block :].view(KV, n, G, block).masked_fill_(dead[None, :, None],
                                                                 float("-inf"))  # fmt: skip
        out = self._weighted_values(s, keys[1], block)[:, :M]  # [KV, n G, hd]
        return out.view(KV, n, G, hd).transpose(0, 1).reshape(n, H, hd)

    def _past_keys(self, pos: torch.Tensor, L: int, block: int) -> torch.Tensor:
        """[n, block] bool: the keys of the last of L // block blocks past each row's
        position. Only the last block holds such keys (a group's rows share it), so it
        alone is masked."""
        if len(self._cols) < L or self._cols.device != pos.device:
            self._cols = torch.arange(2 * L, device=pos.device)
        return self._cols[L - block : L] > pos[:, None]

    def _weighted_values(self, s: torch.Tensor, values: torch.Tensor, block: int) -> torch.Tensor:
        """softmax(s) @ values for scores s [Z, R, L] (dead keys at -inf) and values
        [Z, L, hd]: exp over whole blocks (numel a multiple of 32, so every element takes
        the vector path), then per block its p @ V (`mm`) and its sum of p, added in
        ascending block order: one order of the sums for every call. [Z, R, hd]."""
        Z, R, L = s.shape
        nb = L // block
        p = s.sub_(s.amax(-1, keepdim=True)).exp_()
        sums = p.view(Z, R, nb, block).sum(-1)  # [Z, R, nb]
        acc, den = self.mm(p[:, :, :block], values[:, :block]), sums[:, :, 0]
        if nb > 1:
            den = den.clone()
        for b in range(1, nb):
            cols = slice(b * block, (b + 1) * block)
            acc += self.mm(p[:, :, cols], values[:, cols])
            den += sums[:, :, b]
        return acc.div_(den[:, :, None])

    def _row_products_ok(self, KV: int, G: int, L: int, hd: int, block: int) -> bool:
        """Whether `_attend_row`'s products give `_attend_causal`'s bits: both layouts'
        operands run rows alone (`alone`), so every product is the GEMV of one query head
        on operands of the same strides, whichever batch holds it (measured once)."""
        key = (KV, G, L, hd, block, torch.get_num_threads())
        ok = self._row_ok.get(key)
        if ok is None:
            def like(heads, shape, stride):
                return torch.empty_strided((heads, *shape), (L * hd, *stride))

            ok = self._row_ok[key] = all(
                self.alone(like(h, (hd, L), (1, hd))) and self.alone(like(h, (block, hd), (hd, 1)))
                for h in (KV, KV * G))  # fmt: skip
        return ok

    def _attend_row(self, q, kv, pos, scale, G, block, hi, L) -> torch.Tensor:
        """`_attend_causal` for one row (a decode) with `_attend_causal`'s bits: each KV
        head's live keys and values written once per query head of its group, so each
        product is one `mm` (a torch.bmm) over the H query heads, not one per KV head (a
        SmolLM2 decode token: ~10 ms less of ~65 on a 2-core EPYC). The storage is kept;
        rows past the live ones are zero (only rows a longer call wrote are zeroed again)."""
        _, H, hd = q.shape
        KV = kv.shape[2]
        heads, written = self._heads.get(q.device, (None, 0))
        if heads is None or heads.shape != (2, KV, G, L, hd):
            with torch.inference_mode(False):  # written in place in and out of it
                heads = torch.zeros((2, KV, G, L, hd), device=q.device)
            written = 0
        elif written > hi + 1:
            heads[:, :, :, hi + 1 : written].zero_()
        heads[:, :, :, : hi + 1] = kv[:, : hi + 1].permute(0, 2, 1, 3).unsqueeze(2)
        self._heads[q.device] = (heads, hi + 1)
        rows = heads.view(2, H, L, hd)
        s = self.mm(torch.mul(q.view(H, 1, hd), scale), rows[0].transpose(1, 2))  # [H, 1, L]
        s[:, :, L - block :].masked_fill_(self._past_keys(pos, L, block), float("-inf"))
        return self._weighted_values(s, rows[1], block).view(1, H, hd)
