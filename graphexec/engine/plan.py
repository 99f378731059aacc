"""The step plan: the ordered decode rows of a step, cut into chunks of at most the
largest bucket, each with its `GraphKey` (the variant: `choose_variant`'s choice routed to
the graph that serves it on the sampler backend, `variants.served_by`).

It is rebuilt only when a request is admitted, finishes or is aborted. Its per-row
counters (tokens generated, token limit) are numpy columns, so a step touches no
per-request Python object unless that request ends, has a token mask, its own stop ids,
or its text is detokenised. The counters are the requests' `generated` while the plan
lives: `retire` writes them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from graphexec.engine.graphs import chunks
from graphexec.engine.variants import served_by
from graphexec.params import VARIANT_ORDER
from graphexec.request import GraphKey, Request


def chunk_key(rows: list[Request], bucket: int, backend: str) -> GraphKey:
    """The key of a chunk of rows: `choose_variant`'s choice, from the ranks cached at
    admission (no per-step scan of the parameters), served by its graph on `backend`."""
    variant = served_by(VARIANT_ORDER[max(r.variant_rank for r in rows)], backend)
    return GraphKey(variant, bucket, any(r.params.logprobs is not None for r in rows))


@dataclass
class BatchPlan:
    rows: list[Request]
    chunks: list[tuple[GraphKey, int, int]]  # (key, first row, rows); spec_k 0 until launch
    generated: np.ndarray  # i64 [n]: tokens each request has produced
    limit: np.ndarray  # i64 [n]: min(max_tokens, room left in the model's sequence)
    own_stops: list[int]  # rows with stop_token_ids of their own
    eos_stops: np.ndarray  # bool [n]: EOS stops the row (not ignore_eos)
    mask_rows: list[int]  # rows with a host-written token mask (grammar, allowed, bad words)
    has_text: np.ndarray  # bool [n]: the row's output text is detokenised
    text_slow: np.ndarray  # bool [n]: its next token needs the decoder (OutputText.needs_push)
    logprobs: bool  # some row asked for logprobs
    uploaded: bool = False  # the device slot ids hold this plan's only chunk

    @classmethod
    def build(cls, rows: list[Request], buckets: Sequence[int], max_seq_len: int,
              has_mask, backend: str) -> BatchPlan:  # fmt: skip
        return cls(
            rows=rows,
            chunks=[
                (chunk_key(rows[start : start + n], bucket, backend), start, n)
                for start, n, bucket in chunks(len(rows), buckets)
            ],
            generated=np.array([r.generated for r in rows], dtype=np.int64),
            limit=np.array(
                [min(r.params.max_tokens, max_seq_len - r.prompt_len) for r in rows],
                dtype=np.int64,
            ),
            own_stops=[i for i, r in enumerate(rows) if r.params.stop_token_ids],
            eos_stops=np.array([not r.params.ignore_eos for r in rows], dtype=bool),
            mask_rows=[i for i, r in enumerate(rows) if has_mask(r.slot)],
            has_text=np.array([r.text is not None for r in rows], dtype=bool),
            text_slow=np.array(
                [r.text is not None and r.text.needs_push for r in rows], dtype=bool
            ),  # fmt: skip
            logprobs=any(r.params.logprobs is not None for r in rows),
        )

    def retire(self) -> None:
        """Write the counters back to the requests (the plan is about to be rebuilt)."""
        for r, g in zip(self.rows, self.generated.tolist(), strict=True):
            r.generated = g
