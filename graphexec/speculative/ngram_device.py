"""n-gram drafts on the device: each slot's token history, and `ngram_drafts` over it
inside the captured step.

A speculative step that takes its drafts from the host needs the step before it
collected (its tokens are the suffix to match), so the GPU waits for the host between
the two. Here the history lives on the device: the prompt is written as it is prefilled
(this object follows the model through the `Prefiller`, like a draft model), a step
writes the last token at its start and the run it emitted at its end, and the drafts are
matched in the step itself, so step N + 1 launches before N is collected, as ordinary
decoding does.

The match (`drafts`), over each row's last W tokens w[0..W-1] (W = the window; columns
before the sequence start hold -1): for every end i <= W - 2 (a token follows it), the
length of the run of t = 0, 1, .. with w[i - t] == w[W - 1 - t], up to ngram_max; the
longest run, then its latest end i*; drafts w[i* + 1 ..], at most the row's allowance and
the tokens left in the window, none when the run is shorter than ngram_min. The same
drafts as `ngram.ngram_drafts(history, k, ngram_max, ngram_min, W)`; static shapes, no
host sync, [b, W, ngram_max] work per step. `match` runs it: on CUDA as one Triton kernel
(`ngram_kernel`), elsewhere as the torch below, its reference.
"""

from __future__ import annotations

import torch

from graphexec.models.protocol import PrefillBatch


class NgramHistory:
    """Every slot's prompt and output, on the device (see the module docstring).

    tokens: i32 [S, M + 1]: slot s's token at sequence index i in column i (M = the
        model's max_seq_len); column M takes the writes of tokens past a run.
    kernels: `match` by the Triton kernel (CUDA), else by the torch reference.
    """

    def __init__(self, slots: int, max_seq_len: int, device: torch.device, ngram_max: int,
                 ngram_min: int, window: int, kernels: bool = False) -> None:  # fmt: skip
        self.max_seq_len = int(max_seq_len)
        self.tokens = torch.zeros((slots, self.max_seq_len + 1), dtype=torch.int32, device=device)
        self.window = min(window, self.max_seq_len)
        # a run ends at i <= W - 2, so it is never longer than W - 1
        self.ngram_max, self.ngram_min = min(ngram_max, self.window - 1), ngram_min
        self.kernels = kernels

    # ---- the prompt, written as the Prefiller prefills it -----------------------------
    def prefill_batch(self, batch: PrefillBatch) -> None:
        slots = batch.slot_ids[batch.segment_ids]
        self.tokens[slots, batch.positions] = batch.token_ids.to(torch.int32)

    def prefill(self, slot: int, token_ids: torch.Tensor, all_logits: bool = False) -> None:
        del all_logits
        ids = token_ids.to(self.tokens.device, torch.int32)
        self.tokens[slot, : ids.shape[0]] = ids

    def fork(self, src_slot: int, dst_slot: int, length: int) -> None:
        self.tokens[dst_slot, :length] = self.tokens[src_slot, :length]

    # ---- inside the step -----------------------------------------------------------------
    def match(self, slot_ids: torch.Tensor, model_pos: torch.Tensor, last: torch.Tensor,
              allow: torch.Tensor, k: int) -> torch.Tensor:  # fmt: skip
        """A step's drafting: each row's last token into its history, then its [b, k] i64
        drafts (-1 past them); `allow` [b] i64, its allowance, becomes the drafts' count."""
        if self.kernels:
            from graphexec.speculative.ngram_kernel import ngram_match  # triton: CUDA only

            return ngram_match(self.tokens, slot_ids, model_pos, last, allow, k, self.window,
                               self.ngram_max, self.ngram_min)  # fmt: skip
        self.write_last(slot_ids, model_pos, last)
        drafts, used = self.drafts(slot_ids, model_pos + 1, allow, k)
        allow.copy_(used)
        return drafts

    def write_last(self, slot_ids: torch.Tensor, model_pos: torch.Tensor,
                   last: torch.Tensor) -> None:  # fmt: skip
        """Each row's last token (the step's input) at its sequence index `model_pos`
        (padding rows: -1, their own slot's column 0)."""
        self.tokens[slot_ids, model_pos.clamp(min=0)] = last.to(torch.int32)

    def write_runs(self, slot_ids: torch.Tensor, model_pos: torch.Tensor,
                   token_ids: torch.Tensor, emitted: torch.Tensor) -> None:  # fmt: skip
        """The runs a step emitted: token j of row r at model_pos + 1 + j where j <
        emitted[r] (token_ids [b, T]); the rest go to the dump column."""
        t = token_ids.shape[1]
        j = torch.arange(t, device=slot_ids.device).unsqueeze(0)
        col = torch.where(j < emitted.unsqueeze(1), model_pos.unsqueeze(1) + 1 + j,
                          self.max_seq_len).clamp(0, self.max_seq_len)  # fmt: skip
        rows = slot_ids.unsqueeze(1).expand_as(col)
        self.tokens[rows, col] = token_ids.clamp(min=0).to(torch.int32)

    def drafts(self, slot_ids: torch.Tensor, length: torch.Tensor, allow: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """([b, k] i64 drafts, -1 past each row's count; [b] i64 counts) for rows whose
        histories hold `length` [b] tokens, at most `allow` [b] each."""
        b, W, nmax = slot_ids.shape[0], self.window, self.ngram_max
        dev = slot_ids.device
        col = length.unsqueeze(1) - W + torch.arange(W, device=dev)  # [b, W]
        w = self.tokens[slot_ids.unsqueeze(1), col.clamp(min=0)].to(torch.int64)
        w = torch.where(col >= 0, w, -1)
        # suffix token t = w[W - 1 - t]; before the sequence start -2, equal to nothing
        tail = w[:, W - nmax :].flip(1)
        suffix = torch.where(tail >= 0, tail, -2)
        # at end i: w[i - t] for t < nmax (-1 before the window)
        padded = torch.cat([w.new_full((b, nmax - 1), -1), w[:, : W - 1]], dim=1)
        ends = padded.unfold(1, nmax, 1).flip(2)  # [b, W - 1, nmax]
        run = (ends == suffix.unsqueeze(1)).to(torch.int32).cumprod(2).sum(2)  # [b, W - 1]
        best = run.max(1).values
        at = torch.arange(W - 1, device=dev)
        end = torch.where(run == best.unsqueeze(1), at, -1).max(1).values
        count = torch.minimum(allow, W - 1 - end)
        count = torch.where(best >= self.ngram_min, count, 0).clamp(min=0)
        j = torch.arange(k, device=dev)
        d = w.gather(1, (end.unsqueeze(1) + 1 + j).clamp(max=W - 1))
        return torch.where(j < count.unsqueeze(1), d, -1), count
