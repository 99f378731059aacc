"""Tensor parallelism for `HFTransformer`: which weight each rank holds, the shard loader,
and the two places the ranks meet (the vocabulary-parallel embedding, the row-parallel
all-reduce).

Megatron's scheme over T ranks of a torch.distributed group; rank r holds:

    weight                      split        rank r's part
    q_proj (weight, bias)       rows         its H/T query heads (heads r*H/T ..)
    k_proj, v_proj              rows         its KV/T key/value heads (KV r*KV/T ..)
    o_proj                      columns      the same query heads' inputs
    gate_proj, up_proj          rows         its slice of the intermediate (I)
    down_proj                   columns      the same slice of I
    lm_head                     rows         its vocabulary slice
    embed_tokens, norms         -            all of it (replicated)

Column-parallel layers (q/k/v, gate/up) need no communication: each rank computes its
heads' attention and its slice of the SwiGLU from the full hidden state. The row-parallel
layers (o, down) give each rank a partial sum [N, D]. Where T divides their K split S
(`models.row_parallel`: S >= 4 parts, T = 1, 2, 4) that partial is the float32 sum of
the rank's subtree of parts and `reduce_tree` gathers the T sums and finishes the tree
in rank order: the bits of one rank. Otherwise (T = 3) `reduce` adds rounded partials
(`distributed.comm.sum_in_rank_order`: all-gather, then a sum in rank order, so every
rank holds the same bits and no row depends on the batch, close to T = 1). Rank r's query
heads map to its own KV heads (heads per KV group H/KV on every rank), so attention stays
local. The embedding is replicated: a lookup costs no collective (a sharded table would
need one all-reduce a step for a few KB of rows; the whole table costs V x D more bytes
per rank). The LM head: logits [N, V_r] of the rank's slice (a tied head: the rank's
rows of the embedding), what the executor's TP sampler takes; no all-gather of logits.

Slices of the vocabulary and of the intermediate follow `distributed.vocab_slices`
(contiguous, in rank order, the first V % T ranks one wider); heads must divide evenly
(ValueError naming the field otherwise).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# weight name suffix -> (dim split, what is split)
SPLITS: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "q"), "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"), "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"), "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "mlp.gate_proj.weight": (0, "inter"), "mlp.up_proj.weight": (0, "inter"),
    "mlp.down_proj.weight": (1, "inter"),
    "lm_head.weight": (0, "vocab"),
}  # fmt: skip


BIT_WORLDS = (1, 2, 4)  # the worlds whose logits agree bit for bit (row_parallel's S = 4)


def head_pieces(vocab_size: int, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """[a, b) pieces of a rank's vocabulary slice [lo, hi), local to it: the slice cut at
    every rank boundary of `vocab_slices` at BIT_WORLDS, so that each piece lies in one
    rank's slice at each of them. The CPU route runs the LM head a piece a call
    (`RowMM.linear`'s pieces): a BLAS call's column bits may depend on its width (MKL on
    an AVX-512 Xeon: the whole [301, 32] head took another plan than its halves, some
    logits a bit apart), and a piece is the same call at every world."""
    from graphexec.distributed import vocab_slices

    cuts = {lo, hi}
    for world in BIT_WORLDS:
        if vocab_size >= world:
            cuts.update(b for s in vocab_slices(vocab_size, world) for b in s if lo < b < hi)
    c = sorted(cuts)
    return tuple((a - lo, b - lo) for a, b in zip(c[:-1], c[1:], strict=True))


def check_divisible(cfg: dict[str, Any], world: int) -> None:
    """ValueError naming the field when `cfg` cannot be split over `world` ranks."""
    H = int(cfg["num_attention_heads"])
    KV = int(cfg.get("num_key_value_heads") or H)
    for name, n in (("num_attention_heads", H), ("num_key_value_heads", KV)):
        if n % world:
            raise ValueError(f"{name} ({n}) must be divisible by the tensor-parallel world "
                             f"size ({world})")  # fmt: skip
    for name in ("vocab_size", "intermediate_size"):
        if int(cfg[name]) < world:
            raise ValueError(f"{name} ({cfg[name]}) must be at least the tensor-parallel "
                             f"world size ({world})")  # fmt: skip


@dataclass(frozen=True)
class TPShard:
    """This rank's part of a model (module docstring); world 1 (group None) is the whole
    model, where `embed` is a lookup and `reduce` the identity."""

    group: Any
    rank: int
    world: int
    ranges: dict[str, tuple[int, int]]  # "q", "kv", "inter", "vocab": [lo, hi) of rows
    tree: Any = None  # distributed.tree_reduce.SymmetricTree, from `bind` (CUDA, NCCL)

    @classmethod
    def create(cls, group, cfg: dict[str, Any]) -> TPShard:
        """The shard of `group`'s rank (None: the whole model)."""
        rank, world = 0, 1
        if group is not None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValueError("tp_group needs torch.distributed initialised "
                                 "(init_process_group first)")  # fmt: skip
            rank, world = dist.get_rank(group), dist.get_world_size(group)
        return cls.of(cfg, rank, world, group)

    @classmethod
    def of(cls, cfg: dict[str, Any], rank: int, world: int, group: Any = None) -> TPShard:
        """The shard of rank `rank` of `world` (no group needed: shapes, tests)."""
        from graphexec.distributed import vocab_slices

        check_divisible(cfg, world)
        D, H = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        KV = int(cfg.get("num_key_value_heads") or H)
        hd = int(cfg.get("head_dim") or D // H)
        q, kv = H // world * hd, KV // world * hd
        ranges = {"q": (rank * q, rank * q + q), "kv": (rank * kv, rank * kv + kv),
                  "inter": vocab_slices(int(cfg["intermediate_size"]), world)[rank],
                  "vocab": vocab_slices(int(cfg["vocab_size"]), world)[rank]}  # fmt: skip
        return cls(group, rank, world, ranges)

    @property
    def vocab(self) -> tuple[int, int]:
        """[lo, hi) of this rank's vocabulary slice: its logits' columns."""
        return self.ranges["vocab"]

    def split(self, name: str) -> tuple[int, int, int] | None:
        """(dim, lo, hi) of this rank's part of weight `name`; None: replicated."""
        if self.world == 1:
            return None
        for suffix, (dim, what) in SPLITS.items():
            if name.endswith(suffix):
                return (dim, *self.ranges[what])
        return None

    def shape(self, name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        cut = self.split(name)
        if cut is None:
            return full
        dim, lo, hi = cut
        return full[:dim] + (hi - lo,) + full[dim + 1 :]

    def take(self, name: str, t: torch.Tensor, full: tuple[int, ...]) -> torch.Tensor:
        """This rank's part of `t`, which holds either the whole weight (shape `full`,
        then cut and copied, so the whole is not kept alive) or this rank's part already;
        ValueError for any other shape."""
        got, mine = tuple(t.shape), self.shape(name, full)
        if got == mine:
            return t
        if got != full:
            also = "" if mine == full else f" (or this rank's part {list(mine)})"
            raise ValueError(f"weight {name!r} has shape {list(got)}; the config expects "
                             f"{list(full)}{also}")  # fmt: skip
        dim, lo, hi = self.split(name)  # type: ignore[misc]
        return t.narrow(dim, lo, hi - lo).clone(memory_format=torch.contiguous_format)

    def load(self, folder: Path, files: list[str],
             shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:  # fmt: skip
        """The weights of `shapes` from the safetensors `files`, each rank reading only
        its part (`get_slice`: the bytes of its rows, or of its columns in each row) and
        checking the whole weight's shape from the header first. Names the model does not
        use are not read."""
        from safetensors import safe_open

        state: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(folder / f), framework="pt") as sf:
                for name in sf.keys():
                    if name not in shapes:
                        continue
                    part = sf.get_slice(name)
                    got = tuple(part.get_shape())
                    if got != shapes[name]:
                        raise ValueError(f"weight {name!r} has shape {list(got)}; the config "
                                         f"expects {list(shapes[name])}")  # fmt: skip
                    cut = self.split(name)
                    if cut is None:
                        state[name] = part[:]
                    elif cut[0] == 0:
                        state[name] = part[cut[1] : cut[2]]
                    else:
                        state[name] = part[:, cut[1] : cut[2]]
        return state

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x [N, D] (a row-parallel layer's partial), the same
        bits on every rank, independent of N (`comm.sum_in_rank_order`)."""
        if self.world == 1:
            return x
        from graphexec.distributed.comm import sum_in_rank_order

        return sum_in_rank_order(x, self.group)

    def bind(self, device: torch.device, rows: int, width: int) -> TPShard:
        """This shard with its symmetric buffers for row-parallel reductions of up to
        `rows` rows of `width` (`distributed.tree_reduce`), where the ranks run on CUDA
        over NCCL and torch has symmetric memory; else unchanged (the NCCL or gloo path).
        A collective: every rank binds at once."""
        from graphexec.distributed import tree_reduce

        if (self.world == 1 or device.type != "cuda" or self.tree is not None
                or not tree_reduce.available(self.group)):  # fmt: skip
            return self
        tree = tree_reduce.SymmetricTree.create(self.group, rows, width, device)
        return dataclasses.replace(self, tree=tree)

    def partial_out(self, which: int, M: int) -> torch.Tensor | None:
        """Where a row-parallel layer's float32 subtree sum [M, D] goes: symmetric buffer
        `which` (0: o, 1: down: consecutive reductions alternate) within the row cap,
        else None (a new tensor, reduced over NCCL)."""
        return self.tree.buffer(which, M) if self.tree is not None else None

    def reduce_tree(self, part: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """A row-parallel layer's output from each rank's float32 subtree sum `part`
        [N, D] (`row_parallel`): gather the T sums (float32, so nothing is rounded
        before the root), finish the split's tree over them in rank order
        (`matmul.tree_sum`), add the bias in float32, round once to `dtype`. The same
        bits on every rank, and at every T dividing the split. A `part` in a symmetric
        buffer (`partial_out`) is reduced by one kernel (`tree_reduce`), the same bits."""
        from graphexec.kernels.matmul import tree_sum
        from graphexec.kernels.row_parallel import finish

        if self.tree is not None and self.tree.owns(part):
            return self.tree.reduce(part, dtype, bias)
        if self.world > 1:
            from graphexec.distributed.comm import all_gather

            part = tree_sum(all_gather(part, self.group))  # [T, N, D]
        return finish(part, bias, dtype)
