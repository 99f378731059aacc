"""Verification of speculative drafts: `verify_step` (tensor level, capturable) and
`verify_drafts` (over `SamplingParams`).

Terms, per row with K draft slots (T = K + 1 offsets):
    offset j      the j-th token of the run, drawn at output position pos + j; its
                  logits row is the target's after the drafts before j.
    draft         d_j, proposed for offset j; -1 pads a row with fewer drafts.
    accepted      the leading drafts that pass the test at their offset.
    recovered     the token emitted at the first rejected offset (rejection mode: drawn
                  from normalise(max(0, p_j - q_j)); strict: the ordinary token there).
    bonus         the token emitted after the last draft when every draft passed (or at
                  the first -1 pad): the ordinary token at that offset.

Steps, in order:
  1. flatten      the B x T offsets become B*T sampler rows: slot b's parameters, position
                  pos_b + j, bitmask row (b, j), and the drafts before j counted for the
                  penalties (`count_ids`).
  2. draw         the ordinary sampler (`sample_step`) draws every row: t_j, exactly the
                  token ordinary sampling draws at pos + j after those drafts.
  3. test         strict: d_j is accepted iff d_j == t_j. rejection (`reference`):
                  iff u_j * q_j(d_j) < p_j(d_j), u_j the SPEC_ACCEPT coin.
  4. emit         the accepted drafts, then the recovered or bonus token; an offset with
                  nothing samplable ends the run before it (a row whose offset 0 has
                  nothing is invalid).
  5. logprobs     of each emitted token (strict: the sampler's own, as they are its tokens).

With the Triton backend, steps 1 and 4 are one kernel each (`verify_kernels`); the torch
functions here are their reference.

Strict verification never changes a seeded stream: offset j's token is the ordinary one,
so any drafter and any K give the tokens sampling without speculation gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphexec.params import SamplerVariant, SamplingParams
from graphexec.sampling.pipeline import (
    _check_tensor,
    check_batch,
    check_logits,
    default_backend,
    sample_step,
)
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
from graphexec.speculative.verify_reference import emit

METHODS = ("strict", "rejection")


@dataclass
class VerifyOutput:
    """What one verification produces, per row b (T = K + 1).

    token_ids: i64 [B, T], the emitted tokens, then -1.
    num_accepted: i64 [B] drafts accepted (num_tokens - 1; 0 where invalid).
    num_tokens: i64 [B] tokens emitted (0 where valid is False).  valid: bool [B].
    logprobs / ranks: [B, T]; top_logprobs / top_token_ids: [B, T, N] (None when logprobs
        are off); entries past num_tokens are not defined.
    sampled: the ordinary draw at every offset, as a `SamplerOutput` of B*T rows (its
        logprob fields are views of the ones above).
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    num_tokens: torch.Tensor
    valid: torch.Tensor
    sampled: SamplerOutput
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None

    @classmethod
    def allocate(cls, batch: int, num_draft: int, device, num_top: int | None) -> VerifyOutput:
        """Static buffers for B rows of K = num_draft drafts; num_top None = logprobs off."""
        d = torch.device(device)
        T = num_draft + 1
        flat = SamplerOutput.allocate(batch * T, d, num_top)
        i64 = dict(dtype=torch.int64, device=d)
        out = cls(
            token_ids=torch.full((batch, T), -1, **i64),
            num_accepted=torch.zeros(batch, **i64),
            num_tokens=torch.zeros(batch, **i64),
            valid=torch.zeros(batch, dtype=torch.bool, device=d),
            sampled=flat,
        )
        if num_top is not None:
            out.logprobs = flat.logprobs.view(batch, T)
            out.ranks = flat.ranks.view(batch, T)
            out.top_logprobs = flat.top_logprobs.view(batch, T, num_top)
            out.top_token_ids = flat.top_token_ids.view(batch, T, num_top)
        return out

    def rows(self, batch: int) -> VerifyOutput:
        """Views of the first `batch` rows (a graph bucket's share of larger buffers)."""
        T = self.token_ids.shape[1]
        s = self.sampled
        n = batch * T
        flat = SamplerOutput(s.token_ids[:n], s.valid[:n])
        out = VerifyOutput(self.token_ids[:batch], self.num_accepted[:batch],
                           self.num_tokens[:batch], self.valid[:batch], flat)  # fmt: skip
        if self.logprobs is not None:
            flat.logprobs, flat.ranks = s.logprobs[:n], s.ranks[:n]
            flat.top_logprobs, flat.top_token_ids = s.top_logprobs[:n], s.top_token_ids[:n]
            out.logprobs, out.ranks = self.logprobs[:batch], self.ranks[:batch]
            out.top_logprobs = self.top_logprobs[:batch]
            out.top_token_ids = self.top_token_ids[:batch]
        return out

    @property
    def num_top(self) -> int | None:
        return self.sampled.num_top


def clean_drafts(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, K] drafts with everything from a row's first -1 (or out-of-range id) on as -1:
    bad draft data at run time shortens that row's run, never another's."""
    ok = (draft_ids >= 0) & (draft_ids < vocab_size)
    lead = torch.cumprod(ok.to(torch.int64), dim=1) > 0
    return torch.where(lead, draft_ids, -1)


def flatten_rows(slot_ids: torch.Tensor, positions: torch.Tensor, drafts: torch.Tensor):
    """Step 1: ([B*T] slots, [B*T] positions, [B*T, K] ids counted before each offset or
    None when K = 0)."""
    B, K = drafts.shape
    T = K + 1
    j = torch.arange(T, device=drafts.device)
    # contiguous: the kernels index slot ids and positions by row (B = 1 would give a
    # stride-0 view)
    rows_slot = slot_ids.unsqueeze(1).expand(B, T).contiguous().view(-1)
    rows_pos = (positions.unsqueeze(1) + j).contiguous().view(-1)
    if K == 0:
        return rows_slot, rows_pos, None
    before = torch.arange(K, device=drafts.device).view(1, 1, K) < j.view(1, T, 1)
    count_ids = torch.where(before, drafts.unsqueeze(1), -1).reshape(B * T, K)
    return rows_slot, rows_pos, count_ids


def verify_step(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    table: SamplingTensors,
    out: VerifyOutput,
    bitmask: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    method: str = "strict",
    variant: SamplerVariant = SamplerVariant.DEFAULT,
    backend: str | None = None,
    *,
    config=None,
    workspace=None,
    sample=None,
    vocab_size: int | None = None,
) -> VerifyOutput:
    """Verify K drafts per row into `out`; CUDA-graph capturable (no host sync).

    Args:
        target_logits: [B, K+1, V] float32 / bf16 / fp16: the target's logits at the K
            draft offsets and the bonus offset.
        draft_ids: [B, K] int64, -1 pads (a row's drafts end at its first -1).
        slot_ids / positions: [B] int64: the table row and the output position of each
            row's offset 0 (offset j draws at positions + j).
        table: per-slot parameters; its token counts are the state before offset 0.
        out: `VerifyOutput.allocate(B, K, device, num_top)`.
        bitmask: optional [B, K+1, ceil(V/32)] int32, one grammar mask per offset.
        draft_probs: [B, K, V] the distributions the drafts were drawn from (rejection
            mode; None = deterministic drafts). strict ignores it.
        method: "strict" or "rejection" (module docstring).
        variant / backend / config / workspace: as `sample_step` (the workspace must hold
            B*(K+1) rows). Rejection mode computes p_j with the torch reference.
        sample / vocab_size: tensor-parallel verification (strict only): `sample` replaces
            `sample_step` for the B*(K+1) rows (`distributed.sample_step` bound to its
            group) and `vocab_size` is the full V, the logits being a vocabulary slice.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    B, T, V = target_logits.shape
    if sample is not None and method != "strict":
        raise ValueError("tensor-parallel verification supports method='strict' only")
    backend = backend or default_backend(target_logits.device)
    kernels = backend == "triton" and sample is None
    if kernels:
        from graphexec.speculative import verify_kernels

        drafts, rows_slot, rows_pos, count_ids = verify_kernels.flatten(
            slot_ids, positions, draft_ids, V
        )
    else:
        drafts = clean_drafts(draft_ids, vocab_size or V)
        rows_slot, rows_pos, count_ids = flatten_rows(slot_ids, positions, drafts)
    flat = target_logits.reshape(B * T, V)
    bm = None if bitmask is None else bitmask.reshape(B * T, bitmask.shape[-1])
    (sample or sample_step)(flat, rows_slot, rows_pos, table, out.sampled, bm, variant, backend,
                            config=config, workspace=workspace, count_ids=count_ids)  # fmt: skip
    tok = out.sampled.token_ids.view(B, T)
    if method == "strict":
        if kernels:
            verify_kernels.emit(drafts, tok, out)
        else:
            emit(drafts, (drafts >= 0) & (drafts == tok[:, : T - 1]), tok, out)
        return out
    from graphexec.speculative import verify_reference as reference  # noqa: F811

    db = None if config is None else config.draw_block
    reference.rejection(flat, drafts, rows_slot, rows_pos, count_ids, table, bm, draft_probs,
                        variant, out, draw_block=db)  # fmt: skip
    return out


def verify_drafts(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int] | torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    method: str = "strict",
    token_counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    bitmask: torch.Tensor | None = None,
    variant: SamplerVariant | str | None = None,
    backend: str | None = None,
) -> VerifyOutput:
    """Verify each row's draft tokens against the target's logits, exactly and reproducibly.

    Args:
        target_logits: [B, K+1, V] float32 / bfloat16 / float16: row b's logits at its K
            draft offsets and at the bonus offset.
        draft_token_ids: [B, K] integer ids in [0, V); a row with fewer drafts pads with
            -1 (only as a suffix).
        params: B `SamplingParams`, each with `seed` set.
        positions: [B] ints, the output position of each row's first draft.
        draft_probs: optional [B, K, V] float: the distribution each draft was drawn from
            (rejection mode); None = deterministic drafts (one-hot q). Ignored by strict.
        method: "strict" (the token at each offset is the ordinary one; drafts are
            accepted while they equal it) or "rejection" (accept d with probability
            min(1, p(d) / q(d)); recover from normalise(max(0, p - q))).
        token_counts / prompt_mask: optional [B, V]: the penalty state before the first
            draft (offset j also counts the drafts before it).
        bitmask: optional [B, K+1, ceil(V/32)] int32, the grammar mask at each offset.
        variant / backend: as `sample_logits`.

    Returns:
        `VerifyOutput`: token_ids [B, K+1] (accepted drafts, then one recovered or bonus
        token, then -1), num_accepted / num_tokens / valid [B], and with logprobs asked:
        logprobs / ranks [B, K+1], top_logprobs / top_token_ids [B, K+1, N].

    Example:
        >>> import torch, graphexec as gx
        >>> logits = torch.randn(2, 3, 1000)
        >>> ps = [gx.SamplingParams(temperature=0.0, seed=1),
        ...       gx.SamplingParams(temperature=0.8, top_p=0.9, seed=2)]
        >>> drafts = torch.tensor([[int(logits[0, 0].argmax()), 5], [7, -1]])
        >>> out = gx.verify_drafts(logits, drafts, ps, positions=[0, 4])
        >>> int(out.num_accepted[0]) >= 1
        True

    CUDA graphs: this call allocates; capture `verify_step` over static buffers.
    """
    check_logits(target_logits, 3, "[B, K+1, V]", "target_logits")
    B, T, V = target_logits.shape
    K = T - 1
    dev = target_logits.device
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    d = draft_token_ids
    if not isinstance(d, torch.Tensor):
        raise ValueError(f"draft_token_ids must be a torch.Tensor, got {type(d).__name__}")
    if d.dtype.is_floating_point or d.dtype == torch.bool:
        raise ValueError(f"draft_token_ids must be an integer tensor, got {d.dtype}")
    _check_tensor("draft_token_ids", d, (B, K), dev)
    d = d.to(torch.int64)
    if d.numel():
        if int(d.min()) < -1 or int(d.max()) >= V:
            raise ValueError(f"draft_token_ids must be in [-1, {V}), got values outside")
        pad = d < 0
        if bool((pad[:, :-1] & ~pad[:, 1:]).any()):
            raise ValueError("draft_token_ids may pad with -1 only after a row's last draft")
    params, pos, token_counts, variant, backend = check_batch(
        B, V, dev, params, positions, token_counts, prompt_mask, variant, backend
    )
    if B and int(pos.max()) + K >= 2**32:
        raise ValueError(f"positions + {K} (the last offset) must stay below 2**32")
    _check_tensor("bitmask", bitmask, (B, T, (V + 31) // 32), dev)
    if bitmask is not None and bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, (B, K, V), dev)
        if not draft_probs.dtype.is_floating_point:
            raise ValueError(f"draft_probs must be a float tensor, got {draft_probs.dtype}")
    if backend == "flashinfer":
        raise ValueError("backend 'flashinfer' cannot verify drafts (no count_ids); use "
                         "'triton' or 'torch'")  # fmt: skip
    asked = [p.logprobs for p in params if p.logprobs is not None]
    out = VerifyOutput.allocate(B, K, dev, max(asked) if asked else None)
    if B == 0:
        return out
    if token_counts is None and K and any(p.uses_penalties for p in params):
        token_counts = torch.zeros((B, V), dtype=torch.int32, device=dev)  # drafts count
    table = SamplingTensors.from_params(params, V, dev, token_counts, prompt_mask)
    slot_ids = torch.arange(B, device=dev)
    return verify_step(target_logits, d, slot_ids, pos.to(dev), table, out, bitmask,
                       draft_probs, method, variant, backend)  # fmt: skip
