"""Speculation on the host: each chunk's draft allowances and per-offset token masks
before the step, and the acceptance counts once it is finished. The drafts themselves
are made on the device, inside the step (an n-gram match over the slot's device history,
or a draft model), so a step launches before the one before it is collected.

Per chunk (`prepare`): each row's allowance is min(K, tokens it may still emit - 1), with
the tokens of a step still in flight counted as the most it may emit (its allowance + 1),
so a run never passes max_tokens or the model's length. Rows with token masks get one
mask per offset (a grammar's matcher advanced over the n-gram drafts, which the host
also finds, from its own copy of the history, then rolled back; a draft the grammar
refuses ends the drafts, and the allowance with it). A pipelined step with such rows
splits (`StepRunner.launch_forward`): its allowances go up with the forward, which
matches the drafts, and its masks (`run_masks`) once the step before is finished, with
each row's cut, which ends the drafts in the draw instead. With a draft model (whose
drafts the host never sees) rows whose masks depend on the drafts (grammar, bad words) get no
drafts. An n-gram chunk's spec_k is K when one of its rows with an allowance found drafts
at the last step collected (or is new), else 0: an ordinary step, the same tokens, that
still reports whether each row would have found drafts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from graphexec.engine.plan import BatchPlan
from graphexec.request import GraphKey
from graphexec.speculative.ngram import TOKEN_WORD, TokenHistory
from graphexec.speculative.ngram_device import NgramHistory
from graphexec.speculative.spec_config import SpeculativeConfig


class Drafter:
    """The host side of one executor's speculation (see the module docstring).

    history: the n-gram drafter's device history (None with a draft model); prefilled:
    what the `Prefiller` fills beside the target model (the draft model or the history).
    drafted / accepted: drafts verified and drafts accepted since construction.
    """

    def __init__(self, config: SpeculativeConfig, model, slots, device: torch.device,
                 max_batch_size: int, largest: int) -> None:  # fmt: skip
        self.config = config
        self.k = config.num_draft_tokens
        self.slots = slots
        self.device = device
        self.draft = config.drafter if config.uses_model else None
        self.history = None
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
        else:
            self.history = NgramHistory(max_batch_size + 1, model.max_seq_len, device,
                                        config.ngram_max, config.ngram_min,
                                        config.ngram_window, device.type == "cuda")  # fmt: skip
        self.prefilled = self.draft if self.draft is not None else self.history
        self.spec_ks = (self.k,) if self.draft is not None else (0, self.k)
        pin = device.type == "cuda"
        # allowances staged at each chunk's first row; two sets, for alternate launches (a
        # launch's copy may still be queued when the next one is prepared)
        self._host_in = [torch.zeros(max_batch_size + largest, dtype=torch.int64,
                                     pin_memory=pin) for _ in range(2)]  # fmt: skip
        self._allow = np.zeros(max_batch_size, dtype=np.int64)
        self._found = np.ones(max_batch_size + 1, dtype=bool)  # per slot: drafts last time
        self.drafted = 0
        self.accepted = 0

    def admit(self, req, prompt: list[int], masked: bool) -> None:
        """A request with token masks under n-gram drafting keeps a host copy of its
        history, for the masks over its drafts; its device history is written as it is
        prefilled."""
        self._found[req.slot] = True
        if self.draft is None and masked:
            req.history = TokenHistory(prompt)

    def prepare(self, plan: BatchPlan, key: GraphKey, start: int, n: int, masks,
                inputs: dict[int, torch.Tensor], which: int) -> GraphKey:  # fmt: skip
        """Write the chunk's allowances into `inputs` (T -> the device allowances [N] of
        that run length; `which`: the launch's staging set), and its token masks per
        offset (masks None: a split step's forward, whose masks `run_masks` writes once
        the step before is finished); the chunk's key."""
        rows = plan.rows[start : start + n]
        span = slice(start, start + n)
        left = plan.limit[span] - plan.generated[span] - plan.inflight[span]
        allow = np.minimum(np.maximum(left - 1, 0), self.k)
        g_rows = [i - start for i in plan.mask_rows if start <= i < start + n]
        if g_rows and masks is not None:
            if self.draft is not None:  # their masks after each draft are not known before
                allow[g_rows] = 0
            kept = self._write_run_masks([rows[i] for i in g_rows], allow[g_rows], masks)
            if self.draft is None:
                allow[g_rows] = kept  # a refused draft ends the drafts
        go = allow > 0
        if self.draft is None:
            go &= self._found[plan.slots[span]]
            if masks is not None:
                go[g_rows] = allow[g_rows] > 0  # the host found these drafts itself
        spec_k = self.k if self.draft is not None or go.any() else 0
        if key.spec_k != spec_k:
            key = dataclasses.replace(key, spec_k=spec_k)
        self._allow[span] = allow if spec_k else 0
        host = self._host_in[which][start : start + key.bucket]
        host.zero_()
        host[:n] = torch.from_numpy(allow)
        inputs[spec_k + 1][: key.bucket].copy_(host, non_blocking=True)
        return key

    def run_masks(self, plan: BatchPlan, rows: list[int], masks, n: int) -> np.ndarray:
        """A split step's masks per offset for its mask rows `rows` (plan rows, live once
        the step before is finished: their host histories hold its tokens), over the
        drafts the device matched at the allowances `prepare` staged; the drafts each of
        the n rows may keep (K, or where its mask refused one)."""
        cut = np.full(n, self.k, dtype=np.int64)
        if rows:
            cut[rows] = self._write_run_masks([plan.rows[i] for i in rows], self._allow[rows],
                                              masks)  # fmt: skip
        return cut

    def _write_run_masks(self, reqs: list, allow: np.ndarray, masks) -> list[int]:
        """Write the masks per offset of requests `reqs` over the n-gram drafts their host
        histories give at allowances `allow` (the drafts the device matches; none where
        the allowance is 0) into the slot table; the drafts each mask kept."""
        cfg = self.config
        drafts = [r.history.drafts(int(a), cfg.ngram_max, cfg.ngram_min, self.history.window)
                  if a else [] for r, a in zip(reqs, allow.tolist(), strict=True)]  # fmt: skip
        slots = [r.slot for r in reqs]
        host, kept = masks.fill_runs(slots, drafts)
        idx = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        self.slots.write_masks(idx, host.to(self.device, non_blocking=True))
        return kept

    def inflight(self, n: int) -> np.ndarray:
        """The most tokens each row of the launch just prepared may emit, per row of its
        plan: its allowance + 1 (a new array)."""
        return self._allow[:n] + 1

    def extend(self, plan: BatchPlan, toks: np.ndarray, counts: np.ndarray) -> None:
        """Extend the host histories (rows with token masks, n-gram drafting) by a
        collected step's runs (`counts`: the tokens each row goes on with; a row that
        stops in its run ends, its history with it)."""
        if self.draft is None:
            for i in plan.mask_rows:
                if counts[i]:
                    plan.rows[i].history.extend(toks[i, : counts[i]].astype(TOKEN_WORD))

    def found(self, plan: BatchPlan, keys: list, host: dict, alive: np.ndarray) -> np.ndarray:
        """The drafts each row of a collected step verified (`host`: T -> its HostRuns,
        whose `drafts` the device wrote; `keys`: its chunks as launched, those that
        raised left out), and, n-gram, which rows found drafts (in a chunk of spec_k 0:
        would have found them), for the next chunks' spec_k."""
        used = np.zeros(len(plan.rows), dtype=np.int64)
        for key, start, n in keys:
            d = host[key.spec_k + 1].drafts[start : start + n].numpy()
            if self.draft is None:
                s = plan.slots[start : start + n]
                live = alive[start : start + n]
                self._found[s[live]] = d[live] > 0
            if key.spec_k:
                used[start : start + n] = d
        return used

    def count(self, used: np.ndarray, emitted: np.ndarray) -> None:
        """Count a finished step's drafts (`used`: `found`'s) and acceptances (`emitted`:
        each run's length)."""
        self.drafted += int(used.sum())
        self.accepted += int(np.maximum(emitted - 1, 0)[used > 0].sum())
