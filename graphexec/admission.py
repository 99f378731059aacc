"""Admission: what `add_request` checks on the caller's thread, and what the step thread
does with it (one prefill per request, shared by its n streams; first tokens; prompt
logprobs).

`add_request` only validates and queues an `Admit` (no device work, so it is cheap and
safe from any thread); the next `step()` runs the queued admissions before its decode
rows, on the thread that steps.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphexec.params import SamplingParams, token_ids
from graphexec.request import PromptLogprob


@dataclass
class Admit:
    """A queued request: `ids` are its streams' request ids (one unless params.n > 1),
    `params` has its seed set; `streams[i]` is the stream index of ids[i]."""

    request_id: str
    ids: list[str]
    streams: list[int]
    prompt: list[int]
    params: SamplingParams
    bad_words: list[tuple[int, ...]]
    min_ids: tuple[int, ...]  # held back until min_tokens: stop ids, and EOS unless ignored

    def stream_params(self, i: int) -> SamplingParams:
        return self.params if self.params.n == 1 else self.params.stream(self.streams[i])


@dataclass
class Aborted:
    """A request aborted while still queued: reported at the next step, position 0."""

    request_id: str
    seed: int


@dataclass
class Abort:
    """Abort running requests at the next step (a no-op for one that ended meanwhile)."""

    ids: list[str]


def check_prompt(prompt_token_ids, vocab_size: int, max_seq_len: int) -> list[int]:
    """The prompt as a list of ints in [0, V); ValueError naming prompt_token_ids."""
    if isinstance(prompt_token_ids, numbers.Integral):
        raise ValueError("prompt_token_ids must be a sequence of ints, got one int")
    prompt = list(token_ids("prompt_token_ids", prompt_token_ids))
    if not 1 <= len(prompt) <= max_seq_len:
        raise ValueError(
            f"prompt_token_ids must hold 1 to {max_seq_len} tokens (the model's max_seq_len), "
            f"got {len(prompt)}"
        )
    bad = [t for t in prompt if t >= vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}), got {bad[0]}")
    return prompt


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], n: int) -> list:
    """[None] + one `PromptLogprob` per prompt token after the first, from the prefill's
    logits [len(prompt), V] (row i predicts token i + 1): raw log_softmax in float32,
    rank 1 = most likely, top-n most likely first with ties to the lower id."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1).cpu()
    nxt = torch.tensor(prompt[1:], dtype=torch.int64)
    tok_lp = lp.gather(1, nxt.unsqueeze(1)).squeeze(1)
    ranks = (lp > tok_lp.unsqueeze(1)).sum(dim=1) + 1
    out: list[PromptLogprob | None] = [None]
    top_lp, top_id = (None, None)
    if n:
        top_lp, top_id = torch.sort(lp, dim=1, descending=True, stable=True)
        top_lp, top_id = top_lp[:, :n].tolist(), top_id[:, :n].tolist()
    for i, t in enumerate(prompt[1:]):
        top = list(zip(top_id[i], top_lp[i], strict=True)) if n else []
        out.append(PromptLogprob(t, float(tok_lp[i]), int(ranks[i]), top))
    return out
