"""Small models and a byte tokenizer for executor tests that need exact control."""

from __future__ import annotations

import tiktoken
import torch

import graphexec as gx

EOS = 256


def byte_tokenizer() -> gx.Tokenizer:
    """One token per byte (ids 0..255) and <|endoftext|> = 256: every multi-byte character
    and every stop string spans several tokens."""
    enc = tiktoken.Encoding(
        name="bytes", pat_str=r"[\s\S]", mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": EOS},
    )  # fmt: skip
    return gx.Tokenizer(enc)


class ScriptModel:
    """Greedy-friendly logits: the token at sequence position p scores `high` where
    `script[p - 1]` is (p - 1 indexes the output of a one-token prompt), `second` on
    `runner_up` (when given), 0 elsewhere. Stateless, so any slot, batch or path gives the
    same rows. Counts prefills."""

    def __init__(
        self,
        vocab_size: int,
        script: list[int],
        runner_up: int | None = None,
        high: float = 10.0,
        second: float = 5.0,
        max_seq_len: int = 512,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.script = torch.tensor(script, dtype=torch.int64)
        self.runner_up, self.high, self.second = runner_up, high, second
        self.prefills = 0
        self.device = torch.device("cpu")

    def bind(self, num_slots: int, device) -> None:
        self.device = torch.device(device)
        self.script = self.script.to(self.device)

    def _rows(self, next_pos: torch.Tensor) -> torch.Tensor:
        idx = (next_pos - 1).clamp(min=0) % self.script.numel()
        out = torch.zeros((next_pos.numel(), self.vocab_size), device=self.device)
        if self.runner_up is not None:
            out[:, self.runner_up] = self.second
        out.scatter_(1, self.script[idx].unsqueeze(1), self.high)
        return out

    def prefill(self, slot, token_ids, all_logits: bool = False):
        self.prefills += 1
        n = token_ids.numel()
        rows = self._rows(torch.arange(1, n + 1, device=self.device))
        return rows if all_logits else rows[-1]

    def fork(self, src_slot, dst_slot, length) -> None:
        pass

    def decode(self, input_ids, positions, slot_ids):
        return self._rows(positions + 1)

    def verify(self, input_ids, positions, slot_ids):
        b, t = input_ids.shape
        pos = positions.unsqueeze(1) + torch.arange(1, t + 1, device=positions.device)
        return self._rows(pos.reshape(-1)).view(b, t, -1)


def drain(ex: gx.DecodeExecutor, mode: str | None = None) -> dict[str, list[gx.RequestOutput]]:
    """Step until the executor is idle: every request's outputs, in order."""
    outs: dict[str, list[gx.RequestOutput]] = {}
    while not ex.idle:
        for o in ex.step(mode):
            outs.setdefault(o.request_id, []).append(o)
    return outs


def next_outputs(ex: gx.DecodeExecutor, mode: str | None = None, limit: int = 50):
    """Step until a call reports outputs, and return them (with overlap, the default, the
    call that launches a step reports the one before it: none after the first launch)."""
    for _ in range(limit):
        outs = ex.step(mode)
        if len(outs):
            return outs
    raise AssertionError(f"no outputs in {limit} steps")


def tokens(outs: list[gx.RequestOutput]) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]
