"""Admission: what `add_request` checks on the caller's thread (it validates and queues;
no device work), and what the stepping thread does with the queue at the start of a step
(`drain`): each queued request gets its slots, one prefill shared by its n streams,
prompt logprobs, and its first tokens drawn with the step's sampler; queued aborts
release their slots. Both work on the executor's state (`ex`)."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence

import torch

from graphexec.batch import BatchPlan
from graphexec.masks import bad_word_ids
from graphexec.models.protocol import check_logits
from graphexec.output_text import OutputText
from graphexec.params import SamplingParams, token_ids, variant_rank
from graphexec.request import PromptLogprob, Request, RequestOutput, chunk_key
from graphexec.request_queue import Aborted, Admit
from graphexec.state import min_id_words
from graphexec.step import first_token

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
    prompt = check_prompt(prompt_token_ids, ex.vocab_size, ex.model.max_seq_len)
    if params.grammar is not None:
        ex.grammar.compiler.compile(params.grammar)  # a bad grammar fails here
    bad = bad_word_ids(params, ex.tokenizer)
    if any(t >= ex.vocab_size for w in bad for t in w):
        raise ValueError(f"bad_words tokenise to ids outside [0, {ex.vocab_size})")
    min_ids: tuple[int, ...] = ()
    if params.min_tokens:
        eos = () if params.ignore_eos or ex.eos_token_id is None else (ex.eos_token_id,)
        min_ids = tuple(sorted(set(params.stop_token_ids) | set(eos)))
        if len(min_id_words(min_ids)) > ex.slots.min_words.shape[1]:
            raise ValueError(f"min_tokens cannot hold back {len(min_ids)} stop ids here "
                             "(max_min_ids)")  # fmt: skip
    return prompt, bad, min_ids


def prefill(model, c, slots: list[int], vocab_size: int):
    """Prefill `c.prompt` into slots[0] and copy it to the other streams' slots (`fork`;
    a model without it prefills each). (last logits [W], prompt logprobs or None)."""
    prompt = torch.tensor(c.prompt, dtype=torch.int64)
    lp_n = c.params.prompt_logprobs
    w = model.vocab_size
    if lp_n is None:
        logits = check_logits(model.prefill(slots[0], prompt), (w,), model, "prefill")
        prompt_lp = None
    else:
        rows = model.prefill(slots[0], prompt, all_logits=True)
        rows = check_logits(rows, (len(c.prompt), w), model, "prefill")
        logits = rows[-1]
        prompt_lp = prompt_logprobs(rows[:, :vocab_size], c.prompt, lp_n)
    for s in slots[1:]:
        if hasattr(model, "fork"):
            model.fork(slots[0], s, len(c.prompt))
        else:
            model.prefill(s, prompt)
    return logits, prompt_lp


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
                if req is not None:  # else it ended meanwhile: a no-op
                    ex._release(req)  # retires the plan first: req.generated is current
                    ex._pending.append(
                        RequestOutput(
                            rid,
                            None,
                            req.generated,
                            req.params.seed,
                            finished=True,
                            finish_reason="abort",
                        )  # fmt: skip
                    )


def _admit(ex, c: Admit) -> None:
    """Prefill `c` once, give each stream a slot, draw first tokens (-> ex._pending)."""
    reqs = []
    for i, rid in enumerate(c.ids):
        p = c.stream_params(i)
        slot = ex.slots.assign(p, c.prompt, c.min_ids)
        stops = frozenset(p.stop_token_ids) | (
            {ex.eos_token_id} if ex.eos_token_id is not None and not p.ignore_eos else set()
        )
        req = Request(rid, p, slot, len(c.prompt), stops, variant_rank(p))
        if ex.detokenize:
            req.text = OutputText(ex.tokenizer, p)
        reqs.append(req)
        ex.masks.add(slot, p, c.bad_words)
    try:
        ex.slots.flush()
        logits, prompt_lp = prefill(ex.model, c, [r.slot for r in reqs], ex.vocab_size)
        mask_slots = [r.slot for r in reqs if ex.masks.has(r.slot)]
        if mask_slots:
            ex._upload_masks(mask_slots)
        for r in reqs:
            if ex.spec is not None:
                ex.spec.admit(r, r.slot, c.prompt)
        logits = logits.to(ex.device)
        for r in reqs:
            _first_token(ex, r, logits, prompt_lp)
    except Exception as e:
        log.exception("admission of %r failed", c.request_id)
        for r in reqs:
            if r.request_id in ex._running:
                continue
            ex._free_slot(r)
            ex._pending.append(
                RequestOutput(
                    r.request_id,
                    None,
                    0,
                    r.params.seed,
                    finished=True,
                    finish_reason="error",
                    message=f"prefill failed: {e}",
                )  # fmt: skip
            )


def _first_token(ex, req: Request, logits: torch.Tensor, prompt_lp) -> None:
    out = ex._first[req.wants_logprobs]
    key = chunk_key([req], 1)
    first_token(logits, ex.slots, req.slot, out, key, ex.sampler)
    ex._copy_out(out, key, 0, 1)
    if ex.device.type == "cuda":
        torch.cuda.current_stream(ex.device).synchronize()
    ex._running[req.request_id] = req
    req.fresh = True
    ex._admitted += 1
    ex._retire_plan()  # it joins the decode rows at the next step
    plan = BatchPlan.build([req], (1,), ex.model.max_seq_len, ex.masks.has)
    plan.chunks = []  # no graph key: drawn at admission
    outs = list(ex._finish(plan))
    plan.retire()
    if prompt_lp is not None:
        outs[0].prompt_logprobs = prompt_lp
    ex._pending += outs
