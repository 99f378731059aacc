"""The row-parallel layers' all-reduce in one kernel over symmetric memory.

A row-parallel layer (o, down) on T ranks leaves each rank the float32 sum of its aligned
subtree of the layer's K parts (`kernels.row_parallel`); the output is the tree finished
over the T subtree sums in rank order, plus the bias, rounded once. Over NCCL that is an
all-gather, log2 T adds and a cast (`TPShard.reduce_tree`): four launches and a
rendezvous, per layer. Here the ranks of one host share buffers instead
(`torch.distributed._symmetric_memory`: every rank maps every other rank's buffer), and
one kernel does it all:

    1. the GEMM writes its subtree sum [M, N] float32 straight into this rank's buffer
       (`buffer`), one of two that the layers alternate between (o: 0, down: 1);
    2. `_tree_reduce_kernel`: each program signals every peer that this rank's buffer is
       written and waits for every peer's signal (a barrier per program, over a signal
       pad of one int32 per (program, sender) holding the sender's last epoch: stores
       to every peer at once, a spin on the rank's own pad only), then loads the T
       ranks' values of its elements, adds them in the tree ((r0 + r1) + (r2 + r3)) ...,
       adds the bias in float32 and rounds once: the bits of `reduce_tree`'s NCCL path,
       on every rank.

Why two buffers and no exit barrier: a rank writes buffer b again only two reductions
later, after passing the barrier of the reduction in between, which every peer enters
only after its kernel that read buffer b has completed (kernels of one stream run in
order, and this kernel is launched without dependent launch). The forward alternates
o and down, so consecutive reductions always use different buffers.

Calls of more than `rows` rows (prefill chunks) take the NCCL path, which gives the same
bits. A single stream per rank runs the model: two forwards in flight at once on one rank
would share the buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from graphexec.kernels.fused import _rounded
from graphexec.kernels.matmul_kernel import _tree_push
from graphexec.runtime.triton_import import tl, triton

logger = logging.getLogger(__name__)

MAX_PROGRAMS = 128  # programs of one reduction: all resident at once (each waits on peers)
BLOCK = 1024  # elements per program and step


@triton.jit
def _store_release(ptrs, value):
    """st.release.sys of `value` at each of `ptrs`: no reply awaited (a remote atomic
    would wait a round trip over NVLink per peer)."""
    return tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.b32 $0, 0;",
                                     "=r,l,r", [ptrs, value], dtype=tl.int32, is_pure=False,
                                     pack=1)  # fmt: skip


@triton.jit
def _load_acquire(ptrs):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _signal_and_wait(SIG_PTRS, EPOCH, pid, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `pid`'s barrier with the same program of every rank, by epochs: this call's
    epoch e (one more than the program's last, kept in this rank's EPOCH) is stored with
    release semantics into slot [pid, RANK] of every rank's pad, then the program spins
    until every slot [pid, r] of its own pad has reached e (acquire). Slots only grow, so
    a signal is never lost and nothing is reset (a peer already at e + 1 has passed e)."""
    e = tl.load(EPOCH + pid) + 1
    tl.store(EPOCH + pid, e)
    r = tl.arange(0, WORLD)
    pads = tl.load(SIG_PTRS + r).to(tl.pointer_type(tl.int32))  # [WORLD] each rank's pad
    _store_release(pads + pid * WORLD + RANK, tl.full([WORLD], 0, tl.int32) + e)
    mine = tl.load(SIG_PTRS + RANK).to(tl.pointer_type(tl.int32)) + pid * WORLD + r
    while tl.min(_load_acquire(mine) - e, 0) < 0:  # wrap-safe: a difference, not a compare
        pass
    tl.debug_barrier()  # every thread's loads after the acquire


@triton.jit
def _tree_reduce_kernel(
    BUF_PTRS,  # [WORLD] int64: each rank's buffers [2, ROWS, N] float32
    SIG_PTRS,  # [WORLD] int64: each rank's signal pad [MAX_PROGRAMS, WORLD] int32
    EPOCH,  # [MAX_PROGRAMS] int32: this rank's last epoch per program
    BIAS,  # [N] out dtype; read only with HAS_BIAS
    OUT,  # [M, N] out dtype, contiguous
    offset,  # first element of this reduction's buffer in [2, ROWS, N]
    numel, N,  # M * N, N
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    _signal_and_wait(SIG_PTRS, EPOCH, pid, RANK, WORLD)
    dt = OUT.dtype.element_ty
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, numel, step):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < numel
        z = tl.zeros([BLOCK], dtype=tl.float32)
        acc, s0, s1, s2, s3 = z, z, z, z, z
        for r in tl.static_range(WORLD):  # rank order: the tree's leaves
            buf = tl.load(BUF_PTRS + r).to(tl.pointer_type(tl.float32)) + offset
            ptrs = tl.multiple_of(buf + offs, 16)  # the buffers are 16-byte aligned
            v = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            acc, s0, s1, s2, s3 = _tree_push(r, v, s0, s1, s2, s3)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offs, _rounded(acc, dt).to(dt), mask=mask)


def available(group) -> bool:
    """Whether this torch has symmetric memory and `group` runs on CUDA devices (NCCL)."""
    try:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and dist.get_backend(group) == "nccl"


@dataclass
class SymmetricTree:
    """Buffers shared by the ranks of `group` for reductions of up to `rows` rows of
    `width` columns (module docstring). Made by `create` on every rank at once."""

    rank: int
    world: int
    rows: int
    width: int
    buffers: torch.Tensor  # [2, rows, width] float32: this rank's, symmetric
    buffer_ptrs: torch.Tensor  # [world] int64 on the device: each rank's `buffers`
    signal_ptrs: torch.Tensor  # [world] int64: each rank's pad [MAX_PROGRAMS, world] int32
    epochs: torch.Tensor  # [MAX_PROGRAMS] int32: this rank's last epoch per program
    keep: tuple  # the symmetric allocations and handles behind the pointers

    @classmethod
    def create(cls, group, rows: int, width: int, device: torch.device) -> SymmetricTree:
        """Allocate and exchange the buffers (a collective: every rank of `group` calls
        it, in the same order as its other collectives)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm

        if width % 4:
            raise ValueError(f"SymmetricTree needs a width divisible by 4, got {width}")
        name = group.group_name
        bufs = symm.empty((2, rows, width), dtype=torch.float32, device=device)
        world = dist.get_world_size(group)
        pad = symm.empty((MAX_PROGRAMS * world,), dtype=torch.int32, device=device)
        pad.zero_()
        torch.cuda.synchronize(device)
        hb, hp = symm.rendezvous(bufs, name), symm.rendezvous(pad, name)
        dist.barrier(group)  # every pad zeroed before any rank signals
        logger.info("tree all-reduce over symmetric memory: %d ranks, %d x %d float32 x 2",
                    world, rows, width)  # fmt: skip
        epochs = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
        return cls(hb.rank, hb.world_size, rows, width, bufs, _ptrs(hb.buffer_ptrs, device),
                   _ptrs(hp.buffer_ptrs, device), epochs, (bufs, pad, hb, hp))  # fmt: skip

    def buffer(self, which: int, M: int) -> torch.Tensor | None:
        """This rank's buffer `which` (0 / 1) as [M, width] float32 for a GEMM to write
        into; None above the row cap."""
        if M > self.rows:
            return None
        return self.buffers[which, :M]

    def owns(self, part: torch.Tensor) -> bool:
        """Whether `part` is a view `buffer(which, M)`."""
        starts = (self.buffers[0].data_ptr(), self.buffers[1].data_ptr())
        return (part.dim() == 2 and part.shape[1] == self.width and part.shape[0] <= self.rows
                and part.data_ptr() in starts)  # fmt: skip

    def reduce(self, part: torch.Tensor, dtype: torch.dtype,
               bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The reduction of `part`, a view `buffer(which, M)` every rank has written:
        [M, width] in `dtype`, the same bits on every rank."""
        if not self.owns(part):
            raise ValueError("SymmetricTree.reduce takes a view from SymmetricTree.buffer")
        M = part.shape[0]
        which = int(part.data_ptr() != self.buffers[0].data_ptr())
        out = torch.empty((M, self.width), dtype=dtype, device=part.device)
        numel = M * self.width
        if numel == 0:
            return out
        grid = (min(triton.cdiv(numel, BLOCK), MAX_PROGRAMS),)
        _tree_reduce_kernel[grid](
            self.buffer_ptrs, self.signal_ptrs, self.epochs, out if bias is None else bias, out,
            which * self.rows * self.width, numel, self.width,
            RANK=self.rank, WORLD=self.world, BLOCK=BLOCK, HAS_BIAS=bias is not None,
            num_warps=4,
        )  # fmt: skip
        return out


def _ptrs(ptrs, device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ptrs), dtype=torch.int64, device=device)
