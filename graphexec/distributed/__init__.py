"""Sampling across tensor-parallel ranks: vocabulary-sharded logits, the tokens of one rank.

A tensor-parallel model ends with each rank holding a contiguous slice of the vocabulary
(`vocab_slices`: ranks in order, sizes differing by at most one). Two methods give every
rank the `SamplerOutput` that `graphexec.sample_logits` gives for the full rows:

    method           moves                                      module
    all_to_all       rows: B/T full rows per rank, then tokens  distributed.all_to_all
    vocab_parallel   a few values per row, no rows              distributed.vocab_parallel

Both hold because the noise is keyed on (seed, position, global token id), never on the
rank or the row: `all_to_all` samples each row exactly as one GPU would; `vocab_parallel`
follows the reference sampler's definition on slices (block masses and selections
combine exactly across ranks as they do across blocks). Both are static-shaped with no
host sync, so a CUDA graph can capture them over an NCCL group.

Route map (which method serves what):
    all_to_all       every variant and backend (Triton on CUDA), logprobs, B < T
                     (padded to a multiple of T); what "auto" runs
    vocab_parallel   every variant, torch ops (the reference's arithmetic, exactly); only
                     when asked for by name

Why "auto" is all_to_all: vocab_parallel sends the fewest bytes (12-36 KB a row against
(T - 1) / T of a bf16 row) but is a chain of ~200 small torch ops and ~20 collectives
whose latencies add up: over NCCL on 2 H100s it took 5.3 ms where all_to_all took
0.11 ms (B = 32, V = 128256; benchmarks/results/distributed-*.json). It stays as the
executable definition of sampling on slices, which the tests check both methods against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphexec.params import SamplerVariant, SamplingParams
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors

METHODS = ("all_to_all", "vocab_parallel", "auto")


def vocab_slices(vocab_size: int, world: int) -> tuple[tuple[int, int], ...]:
    """[lo, hi) of each rank's vocabulary slice: contiguous, in rank order, the first
    V % T ranks one id wider."""
    if world < 1 or vocab_size < world:
        raise ValueError(f"cannot cut a vocabulary of {vocab_size} into {world} slices")
    base, extra = divmod(vocab_size, world)
    out, lo = [], 0
    for r in range(world):
        hi = lo + base + (r < extra)
        out.append((lo, hi))
        lo = hi
    return tuple(out)


@dataclass(frozen=True)
class TensorParallel:
    """A process group and the vocabulary slice of this rank. wire: the dtype the
    logits' values are exact in (a bf16 model's logits, upcast to float32), which the
    all-to-all sends instead of float32 (half the bytes, the same values); None: as they
    are."""

    group: object
    rank: int
    world: int
    vocab_size: int
    slices: tuple[tuple[int, int], ...]
    wire: torch.dtype | None = None

    @classmethod
    def create(cls, group, vocab_size: int) -> TensorParallel:
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised (init_process_group first)")
        g = group if group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(g), dist.get_rank(g)
        return cls(g, rank, world, vocab_size, vocab_slices(vocab_size, world))

    @property
    def slice(self) -> tuple[int, int]:
        return self.slices[self.rank]


def sample_step(shard: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor,
                table: SamplingTensors, out: SamplerOutput, bitmask=None,
                variant: SamplerVariant = SamplerVariant.DEFAULT, backend: str | None = None,
                *, tp: TensorParallel, method: str = "auto", config=None, workspace=None,
                count_ids=None, flag_inf: bool = False) -> SamplerOutput:  # fmt: skip
    """`graphexec.sampling.pipeline.sample_step` over vocabulary slices: `shard` [B, w]
    is this rank's slice of B rows; `table`, `bitmask` [B, ceil(V/32)] and `count_ids`
    keep full-vocabulary ids. Every rank gets the same `out`. flag_inf: mark rows whose
    sampled token's raw logit is +inf (`sampling.flags.flag_inf`)."""
    if method in ("auto", "all_to_all"):
        from graphexec.distributed import all_to_all

        return all_to_all.sample(shard, slot_ids, positions, table, out, bitmask, variant,
                                 backend, tp=tp, count_ids=count_ids, config=config,
                                 workspace=workspace, flag_inf=flag_inf)  # fmt: skip
    if method == "vocab_parallel":
        from graphexec.distributed import vocab_parallel

        return vocab_parallel.sample(shard, slot_ids, positions, table, out, bitmask, variant,
                                     tp=tp, count_ids=count_ids, flag_inf=flag_inf)  # fmt: skip
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def for_executor(group, method: str, model, vocab_size: int, speculative) -> TensorParallel:
    """The executor's `distributed.TensorParallel`; ValueError for what it cannot serve."""
    if method not in METHODS:
        raise ValueError(f"tp_method must be one of {METHODS}, got {method!r}")
    if int(model.vocab_size) != vocab_size:
        raise ValueError(f"tp_group needs vocab_size == the model's ({model.vocab_size}), "
                         f"got {vocab_size}")  # fmt: skip
    tp = TensorParallel.create(group, vocab_size)
    wire = getattr(model, "logits_dtype", None)  # its float32 logits are exact in it
    if wire in (torch.bfloat16, torch.float16):
        tp = dataclasses.replace(tp, wire=wire)
    got = getattr(model, "vocab_slice", None)
    if got is not None and tuple(got) != tp.slice:
        raise ValueError(f"the model holds vocabulary slice {tuple(got)}; rank {tp.rank} of "
                         f"{tp.world} samples {tp.slice}")  # fmt: skip
    if speculative is not None and (speculative.uses_model or speculative.verify != "strict"):
        raise ValueError("with tp_group, speculation needs drafter='ngram' and verify='strict'")
    return tp


def sample_logits(logits_shard: torch.Tensor, params: Sequence[SamplingParams],
                  positions: Sequence[int] | torch.Tensor, group=None,
                  token_counts: torch.Tensor | None = None,
                  prompt_mask: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                  variant: SamplerVariant | str | None = None, backend: str | None = None,
                  method: str = "auto") -> SamplerOutput:  # fmt: skip
    """`graphexec.sample_logits` for vocabulary-sharded logits; call it on every rank.

    Args:
        logits_shard: [B, V_r] this rank's slice of the logits (`vocab_slices(V, T)[rank]`;
            V is the sum of the ranks' widths, exchanged once here).
        params, positions, token_counts [B, V], prompt_mask [B, V], bitmask
            [B, ceil(V/32)], variant, backend: as `graphexec.sample_logits` (full-vocabulary
            tensors; every rank passes the same).
        group: the torch.distributed group (None = WORLD).
        method: "all_to_all", "vocab_parallel" or "auto" (module docstring).

    Returns: the `SamplerOutput` of the full rows, the same on every rank.

    Example (on each of T ranks, after init_process_group):
        >>> lo, hi = gx.distributed.vocab_slices(V, T)[rank]
        >>> out = gx.distributed.sample_logits(full[:, lo:hi], params, positions)

    CUDA graphs: this call allocates; capture `sample_step` over static buffers instead.
    """
    from graphexec.sampling.pipeline import check_batch, check_logits

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_logits(logits_shard, 2, "[B, V_r]", "logits_shard")
    B, w = logits_shard.shape
    dev = logits_shard.device
    g = group if group is not None else dist.group.WORLD if dist.is_initialized() else None
    if g is None:
        raise ValueError("torch.distributed is not initialised (init_process_group first)")
    widths = torch.tensor([w], device=dev if dist.get_backend(g) == "nccl" else "cpu")
    from graphexec.distributed.comm import all_gather

    ws = all_gather(widths, g).reshape(-1).tolist()
    tp = TensorParallel.create(g, sum(ws))
    if ws != [hi - lo for lo, hi in tp.slices]:
        raise ValueError(f"logits_shard widths {ws} are not vocab_slices({tp.vocab_size}, "
                         f"{tp.world}) = {[hi - lo for lo, hi in tp.slices]}")  # fmt: skip
    V = tp.vocab_size
    params, pos, token_counts, variant, backend = check_batch(
        B, V, dev, params, positions, token_counts, prompt_mask, variant, backend
    )
    if bitmask is not None and tuple(bitmask.shape) != (B, (V + 31) // 32):
        raise ValueError(
            f"bitmask must have shape {[B, (V + 31) // 32]}, got {list(bitmask.shape)}"
        )
    table = SamplingTensors.from_params(params, V, dev, token_counts, prompt_mask)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    out = SamplerOutput.allocate(B, dev, max(asked) if asked else None)
    slot_ids = torch.arange(B, device=dev)
    return sample_step(logits_shard, slot_ids, pos.to(dev), table, out, bitmask, variant,
                       backend, tp=tp, method=method)  # fmt: skip


__all__ = ["METHODS", "TensorParallel", "for_executor", "sample_logits", "sample_step",
           "vocab_slices"]  # fmt: skip
