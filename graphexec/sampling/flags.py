"""The codes a step writes where a row has no token, why, and the +inf check.

A row's token id is -1 where the sampler found nothing samplable (`SamplerOutput`), -2
(`INF_TOKEN`) where the sampled token's raw logit is +inf (the model's fault, flagged
inside the step), -3 (`CHUNK_FAILED`, written on the host) where its chunk's step raised.
"""

from __future__ import annotations

import torch

from graphexec.sampling.tensors import SamplerOutput

INVALID_MESSAGE = (
    "no samplable token: every logit was NaN or -inf, or the token masks (grammar, "
    "allowed_token_ids, bad_words, min_tokens) allowed none"
)
INF_MESSAGE = "the model's logits hold +inf for the sampled token: the model is broken"
INF_TOKEN = -2
CHUNK_FAILED = -3


def error_message(code: int, chunk_error: str | None = None) -> str:
    """Why a row with token id `code` (< 0) has no token (chunk_error: why its chunk's
    step raised, for CHUNK_FAILED)."""
    if code == INF_TOKEN:
        return INF_MESSAGE
    if code == CHUNK_FAILED:
        return f"the step failed: {chunk_error or 'unknown error'}"
    return INVALID_MESSAGE


def flag_inf(logits: torch.Tensor, out: SamplerOutput) -> None:
    """Mark rows that drew a token whose raw logit is +inf (only such rows can: the
    sampler keeps just the +inf tokens of a row that has any): token INF_TOKEN, invalid."""
    # an invalid row (-1) reads column 0: if that is +inf, the model is broken all the same
    hit = logits.gather(1, out.token_ids.clamp(min=0).unsqueeze(1)).squeeze(1) == torch.inf
    out.token_ids.masked_fill_(hit, INF_TOKEN)
    out.valid.masked_fill_(hit, False)


def flag_inf_runs(values: torch.Tensor, out) -> None:
    """A run holding a token whose raw logit is +inf emits nothing: token INF_TOKEN at
    offset 0, invalid. values [b, T]: the raw logits at out.token_ids (a `VerifyOutput`)."""
    t = out.token_ids
    emitted = torch.arange(t.shape[1], device=t.device).unsqueeze(0) < out.num_tokens.unsqueeze(1)
    hit = (torch.isposinf(values) & emitted).any(dim=1) & out.valid
    t[:, 0] = torch.where(hit, INF_TOKEN, t[:, 0])
    out.num_tokens.copy_(torch.where(hit, 0, out.num_tokens))
    out.num_accepted.copy_(torch.where(hit, 0, out.num_accepted))
    out.valid &= ~hit
