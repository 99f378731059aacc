"""The executor's thread-safe side: request checks, queued commands and request-id
bookkeeping.

`add_request` and `abort` may run on any thread while another thread is inside `step()`;
all they touch is a `RequestQueue`, under one lock held for microseconds. The stepping
thread `take`s the commands at the start of each step and does the work (prefill, slots,
device writes) itself.

Life of an id: queued (`add`) -> running (admitted by a step) -> ended (its slot freed;
its last output built) -> reported (returned by `step()`), when the id becomes free again.
"""

from __future__ import annotations

import numbers
import random
import threading
from dataclasses import dataclass
from typing import Any

from graphexec.engine.masks import bad_word_ids
from graphexec.engine.slot_writes import min_id_words
from graphexec.params import SamplingParams, token_ids


def stream_ids(request_id: str, n: int) -> list[str]:
    """The request ids a request of n streams reports under."""
    return [request_id] if n == 1 else [f"{request_id}/{i}" for i in range(n)]


class ExecutorFullError(RuntimeError):
    """add_request when max_batch_size requests are already running or queued."""


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
    """The prompt as a list of ints in [0, V), shorter than `max_seq_len`; ValueError
    naming prompt_token_ids."""
    if isinstance(prompt_token_ids, numbers.Integral):
        raise ValueError("prompt_token_ids must be a sequence of ints, got one int")
    prompt = list(token_ids("prompt_token_ids", prompt_token_ids))
    # a prompt that fills the context leaves no room for a token: refused, never admitted
    if not 1 <= len(prompt) < max_seq_len:
        raise ValueError(
            f"prompt_token_ids must hold 1 to {max_seq_len - 1} tokens (the model's max_seq_len "
            f"{max_seq_len} less one for the first generated token), got {len(prompt)}"
        )
    bad = [t for t in prompt if t >= vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}), got {bad[0]}")
    return prompt


@dataclass(frozen=True)
class RequestCheck:
    """What `add_request` checks on the caller's thread (no device work): called with
    (request_id, prompt_token_ids, params), it returns (prompt ids, bad words as token
    sequences, ids min_tokens holds back); ValueError naming the field."""

    vocab_size: int
    max_seq_len: int
    max_logit_bias: int
    max_min_words: int
    tokenizer: Any = None
    detokenize: bool = False
    compiler: Any = None  # a GrammarCompiler (with a tokenizer)
    eos_token_ids: tuple[int, ...] = ()
    tp: bool = False

    def __call__(self, request_id, prompt_token_ids, params: SamplingParams):
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.vocab_size)
        for field, needs in (("grammar", params.grammar is not None), ("stop", params.stop)):
            if needs and self.tokenizer is None:
                raise ValueError(f"params.{field} needs a tokenizer: pass tokenizer= to "
                                 "DecodeExecutor")  # fmt: skip
        if params.stop and not self.detokenize:
            raise ValueError("params.stop needs detokenize=True")
        nb = self.max_logit_bias
        if len(params.logit_bias or {}) > nb:
            raise ValueError(f"logit_bias may hold at most {nb} entries in this executor "
                             "(max_logit_bias)")  # fmt: skip
        if self.tp and params.prompt_logprobs is not None:
            raise ValueError("params.prompt_logprobs is not served with tp_group")
        prompt = check_prompt(prompt_token_ids, self.vocab_size, self.max_seq_len)
        if params.grammar is not None:
            self.compiler.compile(params.grammar)  # a bad grammar fails here
        bad = bad_word_ids(params, self.tokenizer)
        if any(t >= self.vocab_size for w in bad for t in w):
            raise ValueError(f"bad_words tokenise to ids outside [0, {self.vocab_size})")
        min_ids: tuple[int, ...] = ()
        if params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            min_ids = tuple(sorted(set(params.stop_token_ids) | set(eos)))
            if len(min_id_words(min_ids)) > self.max_min_words:
                raise ValueError(f"min_tokens cannot hold back {len(min_ids)} stop ids here "
                                 "(max_min_ids)")  # fmt: skip
        return prompt, bad, min_ids


class RequestQueue:
    """Commands for the stepping thread, and which ids are in use (see the module
    docstring). `capacity` slots in all; `seed` seeds the draws for unseeded requests."""

    def __init__(self, capacity: int, seed: int | None) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._seeds = random.Random(seed) if seed is not None else random.SystemRandom()
        self._inbox: list[Admit | Abort | Aborted] = []
        self._live: set[str] = set()  # queued, running, or last output not yet returned
        self._ended: set[str] = set()  # finished; last output not yet returned
        self._groups: dict[str, list[str]] = {}  # n > 1: request id -> its streams' ids
        self._reserved = 0  # slots taken or promised to queued admissions

    @property
    def free(self) -> int:
        return self.capacity - self._reserved

    @property
    def empty(self) -> bool:
        return not self._inbox

    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            bad_words: list[tuple[int, ...]], min_ids: tuple[int, ...]) -> None:  # fmt: skip
        n = params.n
        ids = stream_ids(request_id, n)
        with self._lock:
            taken = [i for i in {request_id, *ids} if i in self._live or i in self._groups]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use (queued, running, "
                                 "or its last output not yet returned by step())")  # fmt: skip
            if self._reserved + n > self.capacity:
                raise ExecutorFullError(
                    f"{n} stream(s) do not fit: {self.capacity - self._reserved} of "
                    f"{self.capacity} slots are free (ex.free_slots); wait for requests to "
                    "finish"
                )
            if params.seed is None:
                params = params.with_seed(self._seeds.getrandbits(63))
            self._reserved += n
            self._live.update(ids)
            if n > 1:
                self._groups[request_id] = list(ids)
            self._inbox.append(Admit(request_id, ids, list(range(n)), prompt, params, bad_words,
                                     min_ids))  # fmt: skip

    def abort(self, request_id: str) -> bool:
        """Queue the abort (True) of a queued or running id; False, a no-op, for any other
        id: ended (reported or not) or never added. No record of ended ids is kept (memory
        stays bounded), so those two cannot be told apart, and a server aborting on
        disconnect need not know whether the request ended first. A stream still queued
        is dropped here: it never takes a slot. ValueError only for a non-str or empty id."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        with self._lock:
            ids = [i for i in self._groups.get(request_id) or [request_id]
                   if i in self._live and i not in self._ended]  # fmt: skip
            if not ids:
                return False  # ended (its end may still be about to be reported) or unknown
            running = []
            for rid in ids:
                adm = next((c for c in self._inbox if isinstance(c, Admit) and rid in c.ids), None)
                if adm is None:
                    running.append(rid)
                    continue
                k = adm.ids.index(rid)
                seed = adm.stream_params(k).seed
                del adm.ids[k], adm.streams[k]
                self._reserved -= 1
                self._ended.add(rid)
                self._inbox.append(Aborted(rid, seed))
            if running:
                self._inbox.append(Abort(running))
            return True

    def take(self) -> list[Admit | Abort | Aborted]:
        with self._lock:
            cmds, self._inbox = self._inbox, []
        return cmds

    def ended(self, request_id: str) -> None:
        """The request's slot is free and its last output is built."""
        with self._lock:
            self._reserved -= 1
            self._ended.add(request_id)

    def reported(self, ids: list[str]) -> None:
        """`step()` returned the last outputs of `ids`: they may be used again."""
        with self._lock:
            self._live.difference_update(ids)
            self._ended.difference_update(ids)
            for parent in [p for p, g in self._groups.items() if not self._live.intersection(g)]:
                del self._groups[parent]
