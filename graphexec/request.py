"""A request as the executor sees it on the host, and what each step reports for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphexec.graphs import GraphKey
from graphexec.params import VARIANT_ORDER, SamplingParams

FINISH_REASONS = ("length", "stop", "abort", "error")


@dataclass(slots=True)  # not frozen: a frozen init costs ~2 us per output at B=256
class RequestOutput:
    """One token of one request, or its end.

    token_id: the sampled id, in [0, V); None for "abort" and "error" outputs.
    position: its output position (0 = the first generated token).
    logprob / rank: of the sampled token when the request asked for logprobs, else None.
    top_logprobs: [(token_id, logprob)], most likely first, `params.logprobs` long; None
        when logprobs are off.
    finished / finish_reason: None while running; "length" (max_tokens or the model's
        sequence limit), "stop" (a stop token, EOS, or the grammar terminated), "abort",
        "error" (see `message`).
    seed: the request's seed (drawn at admission when the params had none), so any stream
        can be replayed.
    key: the graph key of the step that drew the token; None for ends without a token.
    text: the text this token adds to the output (when the executor has a tokenizer and
        detokenises): never a partial UTF-8 character; held back while it could still be
        the start of a stop string; cut before a matched stop string.
    stop_reason: the stop string or stop token id that finished the request, else None.
    prompt_logprobs: with the first token of a request that asked: one entry per prompt
        token, None for the first (nothing precedes it).
    """

    request_id: str
    token_id: int | None
    position: int
    seed: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    message: str | None = None
    key: GraphKey | None = None
    text: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None


@dataclass(slots=True)
class PromptLogprob:
    """One prompt token's logprob given the tokens before it (raw log_softmax), its rank
    (1 = most likely) and the top-N [(token_id, logprob)], most likely first."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]


@dataclass(slots=True, eq=False)
class Request:
    """Host-side state of a running request (the device side lives in its slot)."""

    request_id: str
    params: SamplingParams  # seed set
    slot: int
    prompt_len: int
    stop_ids: frozenset[int]
    variant_rank: int  # params.variant_rank: a chunk takes the max over its rows
    generated: int = 0
    prompt_logprobs: Any = None  # reported with its first token (params.prompt_logprobs)
    history: Any = None  # n-gram speculation: its prompt and output (a TokenHistory)
    text: Any = None  # its detokenised output and stop strings (an OutputText)

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None


def chunk_key(rows: list[Request], bucket: int) -> GraphKey:
    """The key of a chunk of rows: `choose_variant`'s choice, from the ranks cached at
    admission (no per-step scan of the parameters)."""
    rank = max(r.variant_rank for r in rows)
    return GraphKey(VARIANT_ORDER[rank], bucket, any(r.params.logprobs is not None for r in rows))
