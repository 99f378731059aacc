"""Admission: what `add_request` checks on the caller's thread (it validates and queues;
no device work), and what the stepping thread does with the queue at the start of a step
(`drain`, host bookkeeping only): each queued request gets its slots (staged writes) and
its prompt joins the step's prefill (`graphexec.prefill`); queued aborts release their
slots. Both work on the executor's state (`ex`)."""

from __future__ import annotations

import logging
import numbers

from graphexec.masks import bad_word_ids
from graphexec.output_text import OutputText
from graphexec.params import SamplingParams, token_ids, variant_rank
from graphexec.prefill import Pending
from graphexec.request import Request, RequestOutput
from graphexec.request_queue import Aborted, Admit
from graphexec.state import min_id_words

log = logging.getLogger(__name__)


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


def check_request(ex, request_id, prompt_token_ids, params: SamplingParams):
    """Validate a request for executor `ex`: (prompt ids, bad words as token sequences,
    ids min_tokens holds back). ValueError naming the field."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.check_vocab(ex.vocab_size)
    for field, needs in (("grammar", params.grammar is not None), ("stop", params.stop)):
        if needs and ex.tokenizer is None:
            raise ValueError(f"params.{field} needs a tokenizer: pass tokenizer= to "
                             "DecodeExecutor")  # fmt: skip
    if params.stop and not ex.detokenize:
        raise ValueError("params.stop needs detokenize=True")
    nb = ex.slots.tensors.bias_ids.shape[1]
    if len(params.logit_bias or {}) > nb:
        raise ValueError(f"logit_bias may hold at most {nb} entries in this executor "
                         "(max_logit_bias)")  # fmt: skip
    if ex.tp is not None and params.prompt_logprobs is not None:
        raise ValueError("params.prompt_logprobs is not served with tp_group")
    prompt = check_prompt(prompt_token_ids, ex.vocab_size, ex.model.max_seq_len)
    if params.grammar is not None:
        ex.grammar.compiler.compile(params.grammar)  # a bad grammar fails here
    bad = bad_word_ids(params, ex.tokenizer)
    if any(t >= ex.vocab_size for w in bad for t in w):
        raise ValueError(f"bad_words tokenise to ids outside [0, {ex.vocab_size})")
    min_ids: tuple[int, ...] = ()
    if params.min_tokens:
        eos = () if params.ignore_eos else ex.eos_token_ids
        min_ids = tuple(sorted(set(params.stop_token_ids) | set(eos)))
        if len(min_id_words(min_ids)) > ex.slots.min_words.shape[1]:
            raise ValueError(f"min_tokens cannot hold back {len(min_ids)} stop ids here "
                             "(max_min_ids)")  # fmt: skip
    return prompt, bad, min_ids


def drain(ex) -> None:
    """Run the commands queued since the last step (on the stepping thread)."""
    for c in ex._queue.take():
        if isinstance(c, Admit):
            if c.ids:
                _admit(ex, c)
        elif isinstance(c, Aborted):
            ex._pending.append(
                RequestOutput(c.request_id, None, 0, c.seed, finished=True, finish_reason="abort")
            )
        else:
            for rid in c.ids:
                req = ex._running.get(rid)
                if req is not None:
                    ex._release(req)  # retires the plan first: req.generated is current
                elif (hit := ex.prefiller.find(rid)) is not None:  # still prefilling
                    ex.prefiller.drop(*hit)
                    req = hit[1]
                    ex._free_slot(req)
                else:
                    continue  # it ended meanwhile: a no-op
                ex._pending.append(RequestOutput(rid, None, req.generated, req.params.seed,
                                                 finished=True, finish_reason="abort"))  # fmt: skip


def _admit(ex, c: Admit) -> None:
    """Give each stream of `c` a slot (staged: written at the next flush) and queue its
    prompt for the step's prefill."""
    reqs = []
    for i, rid in enumerate(c.ids):
        p = c.stream_params(i)
        slot = ex.slots.assign(p, c.prompt, c.min_ids)
        stops = frozenset(p.stop_token_ids) | frozenset(() if p.ignore_eos else ex.eos_token_ids)
        req = Request(rid, p, slot, len(c.prompt), stops, variant_rank(p))
        if ex.detokenize:
            req.text = OutputText(ex.tokenizer, p)
        if ex.spec is not None:
            ex.spec.admit(req, c.prompt)
        ex.masks.add(slot, p, c.bad_words)
        reqs.append(req)
    ex.prefiller.add(Pending(reqs, c.prompt, c.params.prompt_logprobs))
