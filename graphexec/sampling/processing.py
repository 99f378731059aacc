"""Steps 1-4 of the sampler's definition (`graphexec.sampling.reference`) in torch: the
raw logits sanitised, processed (grammar bitmask, logit bias, penalties), +inf collapsed
and scaled by the temperature. Every backend's processing is tested against these."""

from __future__ import annotations

import torch

from graphexec.sampling.tensors import SamplingTensors


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 xgrammar bitmask -> [B, V] bool (bit j of word w = token 32w+j)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def sanitize(logits: torch.Tensor) -> torch.Tensor:
    x = logits.to(torch.float32)
    return torch.where(torch.isnan(x), torch.full_like(x, -torch.inf), x)


def process_logits(logits: torch.Tensor, slot_ids: torch.Tensor, table: SamplingTensors,
                   bitmask: torch.Tensor | None = None, count_ids: torch.Tensor | None = None,
                   lo: int = 0) -> torch.Tensor:  # fmt: skip
    """Steps 1-2: the processed fp32 logits x [B, V] (before temperature). count_ids
    [B, NE] (-1 = none): ids each row counts once more on top of its slot's counts
    (speculative drafts before an offset); only where the table has token counts.
    lo: the logits are the vocabulary slice [lo, lo + V) of wider rows (a tensor-parallel
    shard): bitmask, bias ids, counts and count_ids keep their full-vocabulary ids."""
    x = sanitize(logits).clone()
    B, V = x.shape
    neg_inf = torch.full((), -torch.inf, device=x.device)  # no host copy: capturable
    if bitmask is not None:
        x = torch.where(unpack_bitmask(bitmask, lo + V)[:, lo:], x, neg_inf)
    # padding ids (-1) add their 0 to an extra column that is dropped: no host sync
    ids = table.bias_ids[slot_ids].to(torch.int64) - lo
    cols = torch.where((ids >= 0) & (ids < V), ids, V)
    wide = torch.cat([x, torch.zeros((B, 1), dtype=x.dtype, device=x.device)], dim=1)
    biased = wide.gather(1, cols) + table.bias_values[slot_ids]
    x = wide.scatter(1, cols, biased)[:, :V]
    if table.token_counts is not None or table.prompt_mask is not None:
        counts = (
            table.token_counts[slot_ids, lo : lo + V]
            if table.token_counts is not None
            else torch.zeros((B, V), dtype=torch.int32, device=x.device)
        )
        if count_ids is not None and table.token_counts is not None and count_ids.shape[1]:
            ids = count_ids.to(torch.int64) - lo
            extra = torch.zeros((B, V + 1), dtype=torch.int32, device=x.device)
            extra.scatter_add_(1, torch.where((ids >= 0) & (ids < V), ids, V),
                               torch.ones_like(ids, dtype=torch.int32))  # fmt: skip
            counts = counts + extra[:, :V]
        seen = counts > 0
        if table.prompt_mask is not None:
            seen = seen | table.prompt_mask[slot_ids, lo : lo + V]
        rep = table.repetition_penalty[slot_ids].unsqueeze(1)
        inv_rep = table.inv_repetition_penalty[slot_ids].unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x * inv_rep, x * rep), x)
        freq = table.frequency_penalty[slot_ids].unsqueeze(1)
        pres = table.presence_penalty[slot_ids].unsqueeze(1)
        x = x - freq * counts.to(torch.float32)
        x = x - torch.where(counts > 0, pres, torch.zeros_like(pres))
    return x


def row_max(xc: torch.Tensor) -> torch.Tensor:
    """[B, 1] max of collapsed rows, 0 for rows with nothing samplable."""
    m = xc.max(dim=-1, keepdim=True).values
    return torch.where(m > -torch.inf, m, 0.0)


def effective_inv_t(slot_ids: torch.Tensor, table: SamplingTensors) -> torch.Tensor:
    """[B] the fp32 1/T each row scales by (1 for greedy rows)."""
    greedy = table.temperature[slot_ids] == 0
    return torch.where(greedy, 1.0, table.inv_temperature[slot_ids])


def scale(xc: torch.Tensor, slot_ids: torch.Tensor, table: SamplingTensors) -> torch.Tensor:
    """Step 4: y = (xc - max) * fp32(1/T), 1/T = 1 for greedy rows."""
    return (xc - row_max(xc)) * effective_inv_t(slot_ids, table).unsqueeze(1)


def collapse_inf(x: torch.Tensor) -> torch.Tensor:
    """Step 3: rows holding +inf become uniform over their +inf entries."""
    pinf = x == torch.inf
    has = pinf.any(dim=-1, keepdim=True)
    collapsed = torch.where(pinf, 0.0, -torch.inf).to(x.dtype)
    return torch.where(has, collapsed, x)
