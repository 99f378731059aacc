"""The executor's speculative side on the host: drafts and masks in, runs of tokens out.

Per chunk of a step (`prepare`): each row's allowance is min(K, tokens it may still emit
- 1), so a run never passes max_tokens or the model's length; n-gram drafts come from its
history; rows with token masks get one mask per offset (a grammar's matcher advanced
over the drafts, then rolled back; a draft the grammar refuses ends the drafts) and,
with a draft model (whose drafts the host never sees), rows whose masks depend on the
drafts (grammar, bad words) get no drafts. The key's spec_k is K, or 0 when no row of the
chunk has a draft (the n-gram drafter found nothing): a one-token step, the same tokens.

After the step (`finish`): each row's emitted run is reported token by token, in
position order; a stop id, EOS, grammar termination or the token limit inside the run
truncates it and finishes the request. Every key runs `step.spec_step`; spec_k = 0 is
ordinary decoding through the same path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from graphexec.batch import CHUNK_FAILED, BatchPlan, Finished, error_message
from graphexec.graphs import GraphKey
from graphexec.params import MAX_TOP_LOGPROBS
from graphexec.request import RequestOutput
from graphexec.speculative.config import SpeculativeConfig
from graphexec.speculative.ngram import TokenHistory
from graphexec.speculative.step import SpecBuffers, spec_step


@dataclass
class HostRuns:
    """Pinned host copies of a `VerifyOutput`'s fields, one row per plan row."""

    token_ids: torch.Tensor  # i64 [N, T]
    num_tokens: torch.Tensor  # i64 [N]
    logprobs: torch.Tensor  # f32 [N, T]
    ranks: torch.Tensor  # i64 [N, T]
    top_logprobs: torch.Tensor  # f32 [N, T, 20]
    top_token_ids: torch.Tensor  # i64 [N, T, 20]

    @classmethod
    def allocate(cls, rows: int, t: int, pin: bool) -> HostRuns:
        def e(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        n = MAX_TOP_LOGPROBS
        i64, f32 = torch.int64, torch.float32
        return cls(e(rows, t, dtype=i64), e(rows, dtype=i64), e(rows, t, dtype=f32),
                   e(rows, t, dtype=i64), e(rows, t, n, dtype=f32),
                   e(rows, t, n, dtype=i64))  # fmt: skip


class SpecRunner:
    """Speculation for one `DecodeExecutor` (see the module docstring).

    drafted / accepted: drafts verified and drafts accepted since construction.
    """

    def __init__(self, config: SpeculativeConfig, model, slots, device: torch.device,
                 largest: int, max_batch_size: int) -> None:  # fmt: skip
        self.config = config
        self.k = config.num_draft_tokens
        self.model = model
        self.slots = slots
        self.device = device
        self.draft = config.drafter if config.uses_model else None
        if self.draft is not None:
            if int(self.draft.vocab_size) != int(model.vocab_size):
                raise ValueError(
                    f"speculative.drafter has vocab_size {self.draft.vocab_size}, the model "
                    f"{model.vocab_size}: a draft model must share the vocabulary"
                )
            if int(self.draft.max_seq_len) < int(model.max_seq_len):
                raise ValueError(
                    f"speculative.drafter's max_seq_len ({self.draft.max_seq_len}) is below "
                    f"the model's ({model.max_seq_len})"
                )
            self.draft.bind(max_batch_size + 1, device)
        self.spec_ks = (self.k,) if self.draft is not None else (0, self.k)
        self.buffers = {k: SpecBuffers.allocate(largest, k, device) for k in self.spec_ks}
        pin = device.type == "cuda"
        n = max_batch_size + largest
        self._host_in = torch.empty((n, 1 + self.k), dtype=torch.int64, pin_memory=pin)
        self._host = {k: HostRuns.allocate(max_batch_size, k + 1, pin) for k in self.spec_ks}
        self._allow = np.zeros(max_batch_size, dtype=np.int64)
        self.drafted = 0
        self.accepted = 0

    # ---- admission ---------------------------------------------------------------------
    def admit(self, req, prompt: list[int]) -> None:
        """n-gram drafting keeps the request's history (a draft model is prefilled with
        the target, by the executor's `Prefiller`)."""
        if self.draft is None:
            req.history = TokenHistory(prompt, len(prompt) + req.params.max_tokens + 1)

    # ---- the step ----------------------------------------------------------------------
    def step_fn(self, key: GraphKey, slot_ids: torch.Tensor):
        spec_in, out = self.buffers[key.spec_k].view(key)
        model, slots, draft, method = self.model, self.slots, self.draft, self.config.verify
        sampler = self.sampler
        return lambda: spec_step(model, slots, slot_ids, spec_in, out, key, sampler, draft, method)

    def prepare(self, plan: BatchPlan, key: GraphKey, start: int, n: int, masks) -> GraphKey:
        """Write the chunk's allowances and drafts (and token masks); its key."""
        rows = plan.rows[start : start + n]
        left = plan.limit[start : start + n] - plan.generated[start : start + n]
        allow = np.clip(left - 1, 0, self.k)
        g_rows = [i - start for i in plan.mask_rows if start <= i < start + n]
        if self.draft is None:
            cfg = self.config
            drafts = [
                r.history.drafts(int(a), cfg.ngram_max, cfg.ngram_min) if a else []
                for r, a in zip(rows, allow.tolist(), strict=True)
            ]
        else:
            drafts = [[] for _ in rows]
            # their masks after each draft are not known before the step
            allow[[i for i in g_rows if masks.dynamic(rows[i].slot)]] = 0
        if g_rows:
            slots = [rows[i].slot for i in g_rows]
            host, kept = masks.fill_runs(slots, [drafts[i] for i in g_rows])
            for i, m in zip(g_rows, kept, strict=True):
                drafts[i] = drafts[i][:m]
            idx = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
            self.slots.bitmask.index_copy_(0, idx, host.to(self.device, non_blocking=True))
        if self.draft is None:
            allow = np.array([len(d) for d in drafts], dtype=np.int64)
        spec_k = self.k if self.draft is not None or allow.any() else 0
        key = dataclasses.replace(key, spec_k=spec_k)
        host = self._host_in[start : start + key.bucket]
        host[:, 0] = 0
        host[:, 1:] = -1
        host[:n, 0] = torch.from_numpy(allow)
        rows_np = host.numpy()  # the pinned buffer's memory: no tensor per row
        for i, d in enumerate(drafts):
            if d:
                rows_np[i, 1 : 1 + len(d)] = d
        dev = self.buffers[spec_k].spec_in
        dev[: key.bucket].copy_(host[:, : dev.shape[1]], non_blocking=True)
        self._allow[start : start + n] = allow
        return key

    def copy_out(self, key: GraphKey, start: int, n: int) -> None:
        """Queue the copy of the chunk's runs to the host rows at `start`."""
        out, h = self.buffers[key.spec_k].out, self._host[key.spec_k]
        h.token_ids[start : start + n].copy_(out.token_ids[:n], non_blocking=True)
        h.num_tokens[start : start + n].copy_(out.num_tokens[:n], non_blocking=True)
        if key.logprobs:
            for f in ("logprobs", "ranks", "top_logprobs", "top_token_ids"):
                getattr(h, f)[start : start + n].copy_(getattr(out, f)[:n], non_blocking=True)

    def fail_rows(self, errors: dict[int, str], keys) -> None:
        """Rows of chunks whose step raised emit nothing (`CHUNK_FAILED`)."""
        for key, start, n in keys:
            if start in errors:
                h = self._host[key.spec_k]
                h.num_tokens[start : start + n] = 0
                h.token_ids[start : start + n, 0] = CHUNK_FAILED

    def finish(self, plan: BatchPlan, masks, errors: dict[int, str]):
        """(outputs in row then position order, rows that finished) after the step."""
        outs: list[RequestOutput] = []
        ended: list[Finished] = []
        for key, start, n in plan.chunks:
            h = self._host[key.spec_k]
            ntok = h.num_tokens[start : start + n].tolist()
            toks = h.token_ids[start : start + n].tolist()
            for i in range(n):
                r = start + i
                if self._run(plan, r, key, ntok[i], toks[i], h, masks, outs, errors):
                    ended.append(Finished(r, outs[-1].finish_reason))
                if key.spec_k:
                    self.drafted += int(self._allow[r])
                    self.accepted += max(0, ntok[i] - 1)
        return outs, ended

    def _run(self, plan, r, key, n, toks, h, masks, outs, errors) -> bool:
        """Report row r's run; True when the request ended inside it."""
        req = plan.rows[r]
        pos0 = int(plan.generated[r])
        if n == 0:
            msg = error_message(min(toks[0], -1), r, plan.chunks, errors)
            outs.append(RequestOutput(req.request_id, None, pos0, req.params.seed, finished=True,
                                      finish_reason="error", message=msg, key=key))  # fmt: skip
            return True
        has_mask = masks.has(req.slot)
        k = req.params.logprobs
        emitted = []
        reason = stop_reason = None
        for j in range(n):
            t = toks[j]
            emitted.append(t)
            g = pos0 + j + 1  # tokens generated with this one
            text, hit = req.text.push(t, g) if req.text is not None else (None, False)
            if t in req.stop_ids:
                reason = "stop"
                stop_reason = t if t in req.params.stop_token_ids else None
            elif has_mask and masks.accept(req.slot, t):
                reason = "stop"
            elif hit:
                reason, stop_reason = "stop", req.text.stop_reason
            elif g >= plan.limit[r]:
                reason = "length"
            if text is not None and reason is not None and not hit:
                text += req.text.flush()
            lp = rank = top = None
            if k is not None:
                lp, rank = float(h.logprobs[r, j]), int(h.ranks[r, j])
                top = list(zip(h.top_token_ids[r, j, :k].tolist(),
                               h.top_logprobs[r, j, :k].tolist(), strict=True))  # fmt: skip
            outs.append(RequestOutput(req.request_id, t, pos0 + j, req.params.seed, lp, rank, top,
                                      reason is not None, reason, key=key, text=text,
                                      stop_reason=stop_reason,
                                      prompt_logprobs=req.prompt_logprobs if pos0 + j == 0
                                      else None))  # fmt: skip
            if reason is not None:
                break
        plan.generated[r] += len(emitted)
        if req.history is not None and reason is None:
            req.history.extend(emitted)
        return reason is not None
