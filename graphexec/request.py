"""The public value types of a request: the graph key of the step that drew a token, what
each step reports (`RequestOutput`, `PromptLogprob`), and the host-side `Request`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphexec.params import SamplerVariant, SamplingParams


@dataclass(frozen=True, order=True)
class GraphKey:
    """The identity of one captured graph (the executor captures only the variants with
    distinct kernels on its sampler backend: `engine.variants`)."""

    variant: SamplerVariant
    bucket: int  # static batch size of the graph; rows past the real batch are padding
    logprobs: bool  # the graph writes logprobs / ranks / top-N
    spec_k: int = 0  # draft tokens verified per row (0 = ordinary decode)

    def __post_init__(self) -> None:
        if not isinstance(self.variant, SamplerVariant):
            raise ValueError(f"variant must be a SamplerVariant, got {self.variant!r}")
        if self.bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {self.bucket}")
        if isinstance(self.spec_k, bool) or not isinstance(self.spec_k, int) or self.spec_k < 0:
            raise ValueError(f"spec_k must be an int >= 0, got {self.spec_k!r}")

    def __str__(self) -> str:
        lp = "lp" if self.logprobs else "nolp"
        spec = f"/k{self.spec_k}" if self.spec_k else ""
        return f"{self.variant.value}/b{self.bucket}/{lp}{spec}"


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
    key: the graph key of the step that drew the token (the graph that served its chunk);
        None for ends without a token.
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
    prompt_logprobs: Any = None  # reported with its first token (params.prompt_logprobs)
    history: Any = None  # n-gram speculation: its prompt and output (a TokenHistory)
    text: Any = None  # its detokenised output and stop strings (an OutputText)

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None
