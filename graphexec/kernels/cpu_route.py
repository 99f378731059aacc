"""The CPU route: GEMMs and attention whose row bits never depend on the call, at BLAS speed.

torch's CPU GEMM (MKL, oneDNN for bf16) picks its kernel and its thread split by the
shape, M included. Measured on a 2-core Xeon (AVX512, MKL 2024.2, SmolLM2's weights):
a row of ``x @ w.T`` has one set of bits at M = 1 (a GEMV), another at every M in 2..512
with one thread; with two threads the [576, 1536] weight also rounds differently at M in
17..192 (K split across the threads); on a 2-core EPYC (AVX2) M = 1..3 each differ from
M >= 4. So nothing here assumes a class of sizes: `RowMM` measures, per operand (b's
shape, strides and dtype, torch's thread count), once per process, which plan gives
each row the same bits (random rows, at shifted places):

- rows alone (`ALONE`), preferred: every row its own GEMV, all of them in one
  `torch.bmm` over the weight expanded along the rows (no copy). A decode row costs a
  GEMV, the weight read once; M rows read it M times, from cache: a weight larger than
  `CHUNK_BYTES` runs in column chunks of that size, each chunk's rows back to back.
  Measured on the EPYC (2 threads, SmolLM2's LM head): 5.5 ms for one row, against
  35 ms for the 4-row GEMM call the call-size plan runs it in; prefill pays: 300 rows
  of a [576, 3072] weight in 31 ms against 9 ms as one GEMM.
- else call sizes among 1, 2, 4, ..., 512 that agree, every product cut into calls of
  one such class only (`_calls`: the largest that fits, until one call holds the rest,
  padded with zero rows).

`RowMM.attend` is decode attention over its products (`cpu_attention.KeyBlockAttention`).
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn.functional as F

from graphexec.kernels.cpu_attention import KeyBlockAttention

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # candidate rows per torch.mm call
ALONE = (0,)  # the plan "every row alone, one batched call" (`RowMM.sizes`)
ALONE_ROWS = (1, 2, 3, 5, 16, 64, 257)  # row counts whose rows alone `_alone_ok` compares
CHUNK_BYTES = 8 << 20  # a weight's column chunk when rows run alone: it stays in cache


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


def _alone(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], each row its own GEMV: b expanded along the rows (a view)."""
    return torch.bmm(a.unsqueeze(1), b.expand(a.shape[0], *b.shape)).squeeze(1)


def _alone_batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Z, M, K] @ b [Z, K, N], `_alone` entry by entry."""
    return torch.stack([_alone(a[z], b[z]) for z in range(b.shape[0])])


def chunk_columns(b: torch.Tensor) -> int:
    """Columns of b [K, N] per product: all of them, or as many multiples of 256 as fit in
    `CHUNK_BYTES` (a function of the shape, so every call chunks alike)."""
    K, N = b.shape
    fit = CHUNK_BYTES // (K * b.element_size()) // 256 * 256
    return N if N <= fit else max(fit, 256)


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


class RowMM(KeyBlockAttention):
    """``a @ b`` by a plan measured to give every row the same bits (module docstring).

    `sizes(b)` probes once per operand key: `ALONE`, or call sizes that `mm(a, b)` cuts
    a's rows into. The choice among classes of sizes: the one with the most sizes, then
    the smallest (so the cheap small calls of decode and the big calls of prefill agree).
    """

    def __init__(self, candidates: tuple[int, ...] = SIZES) -> None:
        self.candidates = tuple(sorted(candidates))
        self._plans: dict[tuple, tuple[int, ...]] = {}
        self._cols = torch.arange(0)  # key indices, grown as needed
        self._pads: dict[tuple, torch.Tensor] = {}  # zero-padded rows of one call, by size
        self._batched: dict[tuple, bool] = {}  # row_linear's batched parts, as measured
        self._keys: dict[torch.device, torch.Tensor] = {}  # `_keys_buffer`'s storage
        self._heads: dict[torch.device, tuple] = {}  # `_attend_row`'s, and rows written
        self._row_ok: dict[tuple, bool] = {}  # `_row_products_ok`, by layout

    def sizes(self, b: torch.Tensor) -> tuple[int, ...]:
        key = (tuple(b.shape), b.stride(), b.dtype, b.device, torch.get_num_threads())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._probe(b)
        return plan

    def _probe(self, b: torch.Tensor) -> tuple[int, ...]:
        """`ALONE` where `_alone_ok`, else the call sizes of one class. Random operands of
        b's shape, strides and dtype (never b's values: a block of zero keys would agree
        in any order). Every size runs rows 1..s, at places 0..s - 1; the largest also
        runs rows 0..top - 1, so a row's place changes too."""
        if self._alone_ok(b):
            return ALONE
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

    @staticmethod
    def _alone_ok(b: torch.Tensor) -> bool:
        """Whether rows alone (`_alone`) give a row one set of bits at every row count of
        `ALONE_ROWS` and place (random operands of b's strides). A batched b [Z, K, N] runs
        entry by entry, a single row in one torch.bmm over the entries: that too must
        give each entry's bits."""
        g = torch.Generator().manual_seed(0)
        rb = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype)
        rb.copy_(torch.randn(b.shape, generator=g))
        if b.dim() == 3:
            x = torch.randn(b.shape[0], 1, b.shape[1], generator=g).to(b.dtype)
            if not torch.equal(torch.bmm(x, rb), _alone_batched(x, rb)):
                return False
            rb = rb[0]
        top = ALONE_ROWS[-1]
        x = torch.randn(top + 1, rb.shape[0], generator=g).to(b.dtype)
        ref = _alone(x[1:], rb)
        if not torch.equal(_alone(x[:top], rb)[1:], ref[: top - 1]):
            return False
        return all(torch.equal(_alone(x[1 : 1 + s], rb), ref[:s]) for s in ALONE_ROWS[:-1])

    def plan_counts(self) -> dict[str, int]:
        """Operands measured so far per plan: "alone", or "calls 4,8,...,512" (benchmarks
        record it: the plan decides a CPU's speed)."""
        names = ("alone" if p == ALONE else "calls " + ",".join(map(str, p))
                 for p in self._plans.values())  # fmt: skip
        return dict(Counter(names))

    def alone(self, b: torch.Tensor) -> bool:
        """Whether `mm` with b runs every row alone (`ALONE`)."""
        return self.sizes(b) == ALONE

    def padded(self, M: int, b: torch.Tensor) -> int:
        """M rows rounded up to what `mm` with b computes (M itself when a call size)."""
        sizes = self.sizes(b)
        return M if sizes == ALONE else sum(_calls(M, sizes))

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [M, K] @ b [K, N] -> [M, N], or batched: a [Z, M, K] @ b [Z, K, N] (torch.bmm);
        a row's bits independent of M and of its place in the call. A large b runs in
        column chunks (`chunk_columns`), each with its own plan."""
        M, N = a.shape[-2], b.shape[-1]
        if b.dim() == 2 and (c := chunk_columns(b)) < N:
            return torch.cat([self.mm(a, b[:, j : j + c]) for j in range(0, N, c)], dim=-1)
        sizes = self.sizes(b)
        if sizes == ALONE:
            if b.dim() == 2:
                return _alone(a, b)
            if M == 1:  # one GEMV per entry already (a decode row's parts of K)
                return torch.bmm(a, b)
            return _alone_batched(a, b)
        calls = _calls(M, sizes) if M else []
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
               *, config=None, pieces=None) -> torch.Tensor:  # fmt: skip
        """x [M, K] @ w [N, K].T (+ bias, added after the one product); `config` unused.
        `pieces`: [a, b) ranges of w's rows, a product each: the same call at every world
        where a call's column bits depend on its width (`hf_shard.head_pieces`)."""
        if pieces:
            out = torch.cat([self.mm(x, w[a:b].t()) for a, b in pieces], dim=-1)
        else:
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
    """`rms_norm.residual_rms_norm_reference` in plain ops, float32 math: torch's fused CPU
    rms_norm costs ~40 us a call on a decode row (61 calls a token). Every op is per row
    (the mean a reduction over one row's D values, the same for any row count: tested)."""
    new = x if residual is None else residual + x
    f = new.float()
    normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * normed.to(x.dtype), new
