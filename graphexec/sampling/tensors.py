"""Typed device-side state of the sampler: the per-slot parameter table and the outputs.

`SamplingTensors` holds one row per slot (the executor's `SlotTable` owns one sized
`max_slots`; `sample_logits` builds a throwaway one with a slot per batch row). Kernels
read a batch row's parameters through `slot_ids[b]`, so the table never moves and a CUDA
graph captured over it stays valid while the values change between replays. Values are
normalised (`SamplingTensors`' field comments), so kernels test one thing.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphexec.params import SamplingParams

# host_columns' keys, in order: the order of `SamplingTensors.host_row`'s values; their
# columns are float32 but for HOST_DTYPES
HOST_FIELDS = ("temperature", "inv_temperature", "top_k", "top_p", "min_p", "log_min_p", "seed",
               "repetition_penalty", "inv_repetition_penalty", "presence_penalty",
               "frequency_penalty", "logprobs", "logprobs_processed")  # fmt: skip
HOST_DTYPES = {"top_k": torch.int32, "seed": torch.int64, "logprobs": torch.int32,
               "logprobs_processed": torch.bool}  # fmt: skip
_F32 = struct.Struct("<f")
_F32_MAX = float(torch.finfo(torch.float32).max)


def _f32(x: float) -> float:
    """`x` rounded to float32 as torch.tensor(x, dtype=float32) rounds it (to nearest,
    inf past the range), back as a Python float."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # struct refuses what float32 cannot hold; torch gives inf
        return math.copysign(math.inf, x)


def _recip32(x: float) -> float:
    """fp32(1 / x) for a float32 value `x`, clamped to the float32 max: the double quotient,
    rounded to float32 later, is the float32 quotient (53 >= 2 * 24 + 2 bits: double
    rounding of a division is harmless)."""
    q = 1.0 / x
    return _F32_MAX if q >= _F32_MAX else q


@dataclass
class SamplingTensors:
    """Per-slot sampling parameters, each a device tensor with a leading [S] dim."""

    temperature: torch.Tensor  # f32 [S]: 0 = greedy
    inv_temperature: torch.Tensor  # f32 [S]: fp32(1 / T) (1 for greedy rows)
    top_k: torch.Tensor  # i32 [S]: 0 = off (top_k <= 0 or >= V)
    top_p: torch.Tensor  # f32 [S]: 1 = off
    min_p: torch.Tensor  # f32 [S]: 0 = off
    # f32 [S]: fp32(ln(min_p)) from a float64 log on the host (-inf = off): min-p keeps
    # y >= log_min_p, a compare every backend makes on the same bits
    log_min_p: torch.Tensor
    seed: torch.Tensor  # i64 [S]
    repetition_penalty: torch.Tensor  # f32 [S]
    inv_repetition_penalty: torch.Tensor  # f32 [S]
    presence_penalty: torch.Tensor  # f32 [S]
    frequency_penalty: torch.Tensor  # f32 [S]
    logprobs: torch.Tensor  # i32 [S]: -1 = off; else the top-N asked (0..20)
    logprobs_processed: torch.Tensor  # bool [S]
    bias_ids: torch.Tensor  # i32 [S, NB]: ascending, -1 pads the list (bias_values 0 there)
    bias_values: torch.Tensor  # f32 [S, NB]
    token_counts: torch.Tensor | None = None  # i32 [S, V]: tokens generated so far
    prompt_mask: torch.Tensor | None = None  # bool [S, V]: token occurs in the prompt

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    @classmethod
    def allocate(cls, num_slots: int, vocab_size: int, device: torch.device | str,
                 max_bias: int = 1, penalties: bool = False) -> SamplingTensors:  # fmt: skip
        """A table of `num_slots` rows, every row set to plain sampling (default params)."""
        d = torch.device(device)
        plain = cls.host_row(SamplingParams(seed=0), vocab_size)
        cols = {
            name: torch.full((num_slots,), v, dtype=HOST_DTYPES.get(name, torch.float32), device=d)
            for name, v in zip(HOST_FIELDS, plain, strict=True)
        }
        nb = max(1, max_bias)
        wide = (num_slots, vocab_size)
        return cls(
            **cols,
            bias_ids=torch.full((num_slots, nb), -1, dtype=torch.int32, device=d),
            bias_values=torch.zeros((num_slots, nb), dtype=torch.float32, device=d),
            token_counts=torch.zeros(wide, dtype=torch.int32, device=d) if penalties else None,
            prompt_mask=torch.zeros(wide, dtype=torch.bool, device=d) if penalties else None,
        )

    @staticmethod
    def host_columns(params: Sequence[SamplingParams], vocab_size: int) -> dict[str, torch.Tensor]:
        """The scalar columns for `params`, normalised (the fields' comments), on the CPU:
        `host_row`'s values as tensors of the columns' dtypes, but ln(min_p) from torch's
        float64 log (`host_row`'s math.log gives the same float32 bits; tests check both)."""
        for i, p in enumerate(params):
            if p.seed is None:
                raise ValueError(f"params[{i}].seed must be set for sampling "
                                 "(the executor draws one at admission)")  # fmt: skip
            p.check_vocab(vocab_size)
        rows = [SamplingTensors.host_row(p, vocab_size) for p in params]
        cols = {name: torch.tensor([r[j] for r in rows], dtype=HOST_DTYPES.get(name, torch.float32))
                for j, name in enumerate(HOST_FIELDS)}  # fmt: skip
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64)
        cols["log_min_p"] = min_p.log().to(torch.float32)
        return cols

    @staticmethod
    def host_row(p: SamplingParams, vocab_size: int) -> tuple:
        """The scalar columns of one request without torch, for hot paths (SlotTable.flush):
        the values in HOST_FIELDS order as Python scalars, each rounded to float32 exactly
        as torch.tensor(..., dtype=float32) rounds it. 1/T and 1/rep are the fp32
        reciprocals computed once, so every backend multiplies by the same bits; 1/T is
        clamped so that a tiny temperature never turns into inf (0 * inf = NaN). `p` must
        be checked already (seed set, check_vocab)."""
        t = _f32(p.temperature)
        rep = _f32(p.repetition_penalty)
        return (
            t,
            1.0 if t == 0.0 else _recip32(t),
            p.top_k if 0 < p.top_k < vocab_size else 0,
            p.top_p,
            p.min_p,
            math.log(p.min_p) if p.min_p > 0.0 else -math.inf,  # float64 log, as host_columns
            p.seed,
            rep,
            _recip32(rep),
            p.presence_penalty,
            p.frequency_penalty,
            -1 if p.logprobs is None else p.logprobs,
            p.logprobs_mode == "processed",
        )

    @staticmethod
    def host_bias(params: Sequence[SamplingParams], nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([len, nb] int32 ids padded with -1, [len, nb] f32 values), ids ascending per row."""
        ids = torch.full((len(params), nb), -1, dtype=torch.int32)
        vals = torch.zeros((len(params), nb), dtype=torch.float32)
        for b, p in enumerate(params):
            bias = sorted((p.logit_bias or {}).items())
            if len(bias) > nb:
                raise ValueError(f"logit_bias has {len(bias)} entries; "
                                 f"the table holds at most {nb}")  # fmt: skip
            if bias:
                ids[b, : len(bias)] = torch.tensor([t for t, _ in bias], dtype=torch.int32)
                vals[b, : len(bias)] = torch.tensor([v for _, v in bias], dtype=torch.float32)
        return ids, vals

    def write_rows(self, slots: torch.Tensor, params: Sequence[SamplingParams], vocab_size: int):
        """Set table rows `slots` ([n] int64) to `params` (one copy per column)."""
        cols = self.host_columns(params, vocab_size)
        idx = slots.to(self.device)
        for name, col in cols.items():
            getattr(self, name).index_copy_(0, idx, col.to(self.device))
        ids, vals = self.host_bias(params, self.bias_ids.shape[1])
        self.bias_ids.index_copy_(0, idx, ids.to(self.device))
        self.bias_values.index_copy_(0, idx, vals.to(self.device))

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], vocab_size: int,
                    device: torch.device | str, token_counts: torch.Tensor | None = None,
                    prompt_mask: torch.Tensor | None = None) -> SamplingTensors:  # fmt: skip
        """A table with one slot per entry of `params` (slot b serves batch row b)."""
        d = torch.device(device)
        nb = max(len(p.logit_bias or {}) for p in params)
        table = cls.allocate(len(params), vocab_size, d, max_bias=nb)
        table.write_rows(torch.arange(len(params)), params, vocab_size)
        table.token_counts = token_counts
        table.prompt_mask = prompt_mask
        return table


@dataclass
class SamplerOutput:
    """What one sampler call produces, one entry per batch row.

    token_ids: i64 [B], -1 where valid is False.   valid: bool [B].
    logprobs: f32 [B] logprob of the sampled token (NaN where invalid).
    ranks: i64 [B], 1 = most likely (0 where invalid).
    top_logprobs: f32 [B, N] / top_token_ids: i64 [B, N], most likely first, ties to
        the lower id. The logprob fields are None when logprobs are off.
    """

    token_ids: torch.Tensor
    valid: torch.Tensor
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None

    @classmethod
    def allocate(cls, batch: int, device: torch.device | str, num_top: int | None) -> SamplerOutput:
        """Static output buffers; num_top None = logprobs off, else the top-N width."""
        d = torch.device(device)
        out = cls(token_ids=torch.full((batch,), -1, dtype=torch.int64, device=d),
                  valid=torch.zeros(batch, dtype=torch.bool, device=d))  # fmt: skip
        if num_top is not None:
            out.logprobs = torch.zeros(batch, dtype=torch.float32, device=d)
            out.ranks = torch.zeros(batch, dtype=torch.int64, device=d)
            out.top_logprobs = torch.zeros((batch, num_top), dtype=torch.float32, device=d)
            out.top_token_ids = torch.zeros((batch, num_top), dtype=torch.int64, device=d)
        return out

    @property
    def num_top(self) -> int | None:
        return None if self.top_logprobs is None else self.top_logprobs.shape[1]
