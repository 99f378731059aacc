"""Seeded mixed workloads, a runner that drives an executor through one, and a comparer.

The demo, `tools/determinism_check.py`, the step benchmark and the tests all use these,
so "the same workload in replay and in eager mode" means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from graphexec.engine.graphs import GraphKey
from graphexec.params import SamplingParams
from graphexec.request import RequestOutput
from graphexec.text.grammar import Grammar

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
    "additionalProperties": False,
}
DATE_REGEX = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"


def request_kinds(grammars: bool) -> list[tuple[str, SamplingParams]]:
    """One SamplingParams per kind of request the workloads mix (seeds set later)."""
    P = SamplingParams
    kinds = [
        ("greedy", P(temperature=0.0, logprobs=3)),
        ("top-k/top-p", P(temperature=0.8, top_k=50, top_p=0.9)),
        ("top-p", P(temperature=1.0, top_p=0.95, logprobs=0)),
        ("min-p", P(temperature=1.1, min_p=0.05, logprobs=5, logprobs_mode="processed")),
        ("penalties", P(temperature=0.7, presence_penalty=0.6, frequency_penalty=0.4,
                        repetition_penalty=1.3)),
        ("logit bias", P(temperature=0.9, logit_bias={15: 4.0, 16: 4.0, 17: 4.0})),
        ("plain", P()),
    ]  # fmt: skip
    if grammars:
        kinds += [
            ("json schema", P(temperature=0.8, grammar=Grammar.json_schema(ANSWER_SCHEMA))),
            ("regex date", P(temperature=1.0, top_k=20, grammar=Grammar.regex(DATE_REGEX))),
        ]
    return kinds


@dataclass(frozen=True)
class WorkItem:
    """A request and the step at which it arrives."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrive: int
    kind: str


def mixed_workload(
    n: int,
    vocab_size: int,
    seed: int = 0,
    grammars: bool = False,
    max_tokens: tuple[int, int] = (4, 32),
    spread: int = 8,
    unseeded_every: int = 5,
    prompt_tokens: tuple[int, int] = (1, 12),
) -> list[WorkItem]:
    """`n` requests cycling through `request_kinds`, arriving over `spread` steps, with
    prompts of `prompt_tokens` (lo, hi) seeded random tokens.

    Every `unseeded_every`-th request has no seed (the executor draws one; give it
    `seed=` to make those draws reproducible). Grammar requests get room to finish.
    """
    rng = random.Random(seed)
    kinds = request_kinds(grammars)
    items = []
    for i in range(n):
        kind, p = kinds[i % len(kinds)]
        limit = 48 if p.grammar is not None else rng.randint(*max_tokens)
        s = None if unseeded_every and i % unseeded_every == unseeded_every - 1 else seed + i
        length = rng.randint(*prompt_tokens)
        prompt = tuple(rng.randrange(min(vocab_size, 50_000)) for _ in range(length))
        params = dataclasses.replace(p, seed=s, max_tokens=limit)
        items.append(WorkItem(f"r{i}", prompt, params, rng.randrange(spread + 1), kind))
    return sorted(items, key=lambda it: it.arrive)


@dataclass
class Trace:
    """Everything a run reported: outputs per request in order, and timings."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0

    def token_ids(self, request_id: str) -> list[int]:
        return [o.token_id for o in self.outputs[request_id] if o.token_id is not None]

    def final(self, request_id: str) -> RequestOutput:
        return self.outputs[request_id][-1]


def run(ex, items: list[WorkItem], mode: str | None = None, max_steps: int = 100_000) -> Trace:
    """Admit each item at its arrival step (or as soon as a slot frees), step until all
    are finished; returns the trace."""
    trace = Trace()
    queue = sorted(items, key=lambda it: it.arrive)
    t0 = time.perf_counter()
    step = 0
    while queue or not ex.idle:
        while queue and queue[0].arrive <= step and ex.free_slots > 0:
            it = queue.pop(0)
            ex.add_request(it.request_id, list(it.prompt), it.params)
        for o in ex.step(mode):
            trace.outputs.setdefault(o.request_id, []).append(o)
            trace.tokens += o.token_id is not None
        step += 1
        if step > max_steps:
            raise RuntimeError(f"workload did not finish in {max_steps} steps")
    trace.steps = step
    trace.seconds = time.perf_counter() - t0
    return trace


def replay_and_eager(ex, items: list[WorkItem]) -> tuple[Trace, Trace]:
    """`items` run as the executor chooses (replay where captured), then again eagerly
    with the seeds the first run reported: the two traces a determinism check compares."""
    replayed = run(ex, items)
    return replayed, run(ex, with_reported_seeds(items, replayed), mode="eager")


def compositions(ex, items: list[WorkItem], waves: int = 4) -> dict[str, Trace]:
    """The same seeded requests on `ex` as a serving engineer checks reproducibility:
    "one batch" (all admitted at step 0), "alone" (one request at a time), "waves"
    (`waves` consecutive groups, one after the other) and "reversed" (one batch admitted
    in reverse order, so every request sits at another row and slot). Unseeded items get
    the seeds the first run reported. On a batch-invariant model every trace equals the
    first, bit for bit (`compare`)."""
    together = [dataclasses.replace(it, arrive=0) for it in items]
    first = run(ex, together)
    together = with_reported_seeds(together, first)
    size = -(-len(together) // waves)
    groups = {"alone": [[it] for it in together],
              "waves": [together[i : i + size] for i in range(0, len(together), size)]}  # fmt: skip
    out = {"one batch": first}
    for name, parts in groups.items():
        merged = Trace()
        for part in parts:
            t = run(ex, part)
            merged.outputs.update(t.outputs)
            merged.steps, merged.tokens = merged.steps + t.steps, merged.tokens + t.tokens
        out[name] = merged
    out["reversed"] = run(ex, together[::-1])
    return out


def batch_invariance(
    make,
    items: list[WorkItem],
    speculative: dict | None = None,
    budgets: tuple[int, ...] = (),
    waves: int = 4,
) -> dict[str, list[Mismatch]]:
    """Every comparison of a batch-invariance check, each against one reference: `items`
    in one batch, replayed, on `make()` (an executor built and captured by the caller;
    `make(**options)` passes DecodeExecutor options). Returns {comparison: mismatches}:

    - "alone", "waves", "reversed" (`compositions`), and "eager": the reference's run
      without graphs;
    - "speculative NAME" and "speculative NAME, eager": with `speculative[NAME]` (a
      SpeculativeConfig; strict verification emits exactly the stream without it);
    - "prefill budget N": with prefill_budget=N (prompts chunked across steps).
    """
    ex = make()
    traces = compositions(ex, items, waves)
    ref = traces.pop("one batch")
    seeded = with_reported_seeds([dataclasses.replace(it, arrive=0) for it in items], ref)
    out = {name: compare(ref, t) for name, t in traces.items()}
    out["eager"] = compare(ref, run(ex, seeded, mode="eager"))
    for name, spec in (speculative or {}).items():
        spec_ex = make(speculative=spec)
        out[f"speculative {name}"] = compare(ref, run(spec_ex, seeded))
        out[f"speculative {name}, eager"] = compare(ref, run(spec_ex, seeded, mode="eager"))
    for budget in budgets:
        out[f"prefill budget {budget}"] = compare(ref, run(make(prefill_budget=budget), seeded))
    return out


def with_reported_seeds(items: list[WorkItem], trace: Trace) -> list[WorkItem]:
    """The same items, each with the seed `trace` reports for it (the executor draws one
    for unseeded requests), so a second run replays the same streams."""
    return [
        dataclasses.replace(it, params=it.params.with_seed(trace.outputs[it.request_id][0].seed))
        for it in items
    ]


@dataclass(frozen=True)
class Mismatch:
    request_id: str
    position: int
    key: GraphKey | None
    what: str  # "token", "logprob", "top_logprobs", "finish", "length"


def _same_float(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def compare(a: Trace, b: Trace) -> list[Mismatch]:
    """Every difference between two traces: tokens exactly, logprobs bitwise."""
    bad = []
    for rid in sorted(set(a.outputs) | set(b.outputs)):
        xs, ys = a.outputs.get(rid, []), b.outputs.get(rid, [])
        if len(xs) != len(ys):
            bad.append(Mismatch(rid, min(len(xs), len(ys)), None, "length"))
        for x, y in zip(xs, ys, strict=False):
            key = x.key or y.key
            if x.token_id != y.token_id:
                bad.append(Mismatch(rid, x.position, key, "token"))
            elif not _same_float(x.logprob, y.logprob) or x.rank != y.rank:
                bad.append(Mismatch(rid, x.position, key, "logprob"))
            elif (x.top_logprobs is None) != (y.top_logprobs is None) or any(
                i != j or not _same_float(u, v)
                for (i, u), (j, v) in zip(x.top_logprobs or [], y.top_logprobs or [], strict=True)
            ):
                bad.append(Mismatch(rid, x.position, key, "top_logprobs"))
            elif x.finish_reason != y.finish_reason:
                bad.append(Mismatch(rid, x.position, key, "finish"))
    return bad


def outputs_per_key(trace: Trace) -> Counter:
    """How many tokens each key drew in `trace` (None: first tokens, drawn at admission)."""
    return Counter(o.key for outs in trace.outputs.values() for o in outs if o.token_id is not None)


def key_workload(key: GraphKey, buckets: tuple[int, ...], steps: int, seed: int = 0,
                 grammar: Grammar | None = None) -> list[WorkItem]:  # fmt: skip
    """Requests that make every one of `steps` decode steps run `key`: as many rows as
    the smallest batch `key.bucket` serves (so the bucket has padding rows), each for
    steps + 1 tokens, with parameters that call for exactly key.variant and logprobs on
    row 0 iff key.logprobs. `grammar` (optional) goes on the last row; it may end early."""
    from graphexec.params import SamplerVariant as SV

    i = buckets.index(key.bucket)
    n = buckets[i - 1] + 1 if i else 1
    P = SamplingParams
    items = []
    for r in range(n):
        if key.variant is SV.NO_FILTER:
            p = P(temperature=0.0 if r % 3 == 1 else 0.8, presence_penalty=0.3 * (r % 2))
        elif key.variant is SV.TOP_K_TOP_P:  # top-k on, at most 512 (top-p alone: default)
            p = P(temperature=0.9, top_k=40 if r % 2 == 0 else 300, top_p=0.9 if r % 2 else 1.0)
        else:
            p = P(temperature=1.0, min_p=0.05 if r == 0 else 0.0, top_k=20 * (r % 2))
        lp = 5 if key.logprobs and r == 0 else None
        g = grammar if r == n - 1 and n > 1 else None
        p = dataclasses.replace(p, seed=seed + r, max_tokens=steps + 1, logprobs=lp, grammar=g)
        items.append(WorkItem(f"{key}-{r}", tuple(range(1, 2 + r % 5)), p, 0, str(key)))
    return items
