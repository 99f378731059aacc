"""Speculation on the host: each chunk's draft allowances, n-gram drafts and per-offset
token masks before the step; the n-gram histories once its runs are collected (before
the next launch: it needs them) and the acceptance counts once it is finished.

Per chunk (`prepare`): each row's allowance is min(K, tokens it may still emit - 1), so
a run never passes max_tokens or the model's length; n-gram drafts come from its
history; rows with token masks get one mask per offset (a grammar's matcher advanced
over the drafts, then rolled back; a draft the grammar refuses ends the drafts) and,
with a draft model (whose drafts the host never sees), rows whose masks depend on the
drafts (grammar, bad words) get no drafts. The chunk's spec_k is K, or 0 when no row of
it has a draft (the n-gram drafter found nothing): an ordinary step, the same tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from graphexec.engine.plan import BatchPlan
from graphexec.request import GraphKey
from graphexec.speculative.ngram import TOKEN_WORD, TokenHistory
from graphexec.speculative.spec_config import SpeculativeConfig


class Drafter:
    """The host side of one executor's speculation (see the module docstring).

    drafted / accepted: drafts verified and drafts accepted since construction.
    """

    def __init__(self, config: SpeculativeConfig, model, slots, device: torch.device,
                 max_batch_size: int, largest: int) -> None:  # fmt: skip
        self.config = config
        self.k = config.num_draft_tokens
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
        pin = device.type == "cuda"
        self._host_in = torch.empty((max_batch_size + largest, 1 + self.k), dtype=torch.int64,
                                    pin_memory=pin)  # fmt: skip
        self._host_np = self._host_in.numpy()  # the same pinned memory
        self._allow = np.zeros(max_batch_size, dtype=np.int64)
        self.drafted = 0
        self.accepted = 0

    def admit(self, req, prompt: list[int]) -> None:
        """n-gram drafting keeps the request's history (a draft model is prefilled with
        the target, by the `Prefiller`)."""
        if self.draft is None:
            req.history = TokenHistory(prompt)

    def prepare(self, plan: BatchPlan, key: GraphKey, start: int, n: int, masks,
                inputs: dict[int, torch.Tensor]) -> GraphKey:  # fmt: skip
        """Write the chunk's allowances and drafts into `inputs` (T -> the device input
        [N, T] of that run length), and its token masks per offset; the chunk's key."""
        rows = plan.rows[start : start + n]
        left = plan.limit[start : start + n] - plan.generated[start : start + n]
        allow = np.minimum(np.maximum(left - 1, 0), self.k)
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
            self.slots.write_masks(idx, host.to(self.device, non_blocking=True))
        if self.draft is None:
            allow = np.array([len(d) for d in drafts], dtype=np.int64)
        spec_k = self.k if self.draft is not None or allow.any() else 0
        if key.spec_k != spec_k:
            key = dataclasses.replace(key, spec_k=spec_k)
        self._allow[start : start + n] = allow if spec_k else 0
        if spec_k == 0:
            return key
        rows_np = self._host_np[start : start + key.bucket]  # numpy: no tensor op per row
        rows_np[:, 0] = 0
        rows_np[:, 1:] = -1
        rows_np[:n, 0] = allow
        for i, d in enumerate(drafts):
            if d:
                rows_np[i, 1 : 1 + len(d)] = d
        inputs[spec_k + 1][: key.bucket].copy_(self._host_in[start : start + key.bucket],
                                               non_blocking=True)  # fmt: skip
        return key

    def allowances(self, n: int) -> np.ndarray:
        """The drafts of the launch just prepared, per row of its plan (a copy)."""
        return self._allow[:n].copy()

    def extend(self, plan: BatchPlan, toks: np.ndarray, counts: np.ndarray) -> None:
        """Extend the n-gram histories by a collected step's runs (`counts`: the tokens
        each row goes on with; a row that stops in its run ends, its history with it)."""
        if self.draft is None:
            words = toks.astype(TOKEN_WORD)  # each row's new tokens as the history's bytes
            for i in np.flatnonzero(counts).tolist():
                plan.rows[i].history.extend(words[i, : counts[i]])

    def count(self, allow: np.ndarray, emitted: np.ndarray) -> None:
        """Count a finished step's drafts (`allow`: its `allowances`) and acceptances
        (`emitted`: each run's length)."""
        self.drafted += int(allow.sum())
        self.accepted += int(np.maximum(emitted - 1, 0)[allow > 0].sum())
