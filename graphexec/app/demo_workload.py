"""What the demo runs: its prompts (`PROMPTS`, the chat questions `CHATS`) and how much of
it runs on this device and model (`DemoPlan`).

On a GPU the demo runs the full workload (24 mixed requests or one per chat question,
batch 64, both speculative runs). On the CPU a step costs far more (the sampler over a
100k vocabulary, a real model's forward), so the plan is proportionate: 8 mixed
requests of 6-16 tokens at batch 8 for TinyLM, and for a checkpoint 3 chat questions
(greedy and top-k / top-p answers of at most 64 tokens, and JSON, until it closes) at
batch 2.
Explicit flags override the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import graphexec as gx
from graphexec.app import workload as wl
from graphexec.models.demo_model import DemoModel

PROMPTS = [
    "The quick brown fox", "Once upon a time", "In a distant galaxy", "The recipe calls for",
    "Answer yes or no:", "The meeting is on", "def main():", "Dear committee,",
]  # fmt: skip
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}  # fmt: skip
# (kind, user message, parameters): the chat workload of a model with a chat template
CHATS = [
    ("greedy", "What is the capital of France? Answer in one sentence.",
     gx.SamplingParams(temperature=0.0, max_tokens=32)),
    ("greedy", "Rewrite this sentence in the past tense: The cat sits on the mat and "
     "watches the birds in the garden.", gx.SamplingParams(temperature=0.0, max_tokens=40)),
    ("top-k top-p", "Write a haiku about the ocean.",
     gx.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_tokens=40)),
    ("greedy", "Give me three tips for staying focused while studying.",
     gx.SamplingParams(temperature=0.0, max_tokens=64)),
    ("json schema", "Alice is 30 years old and lives in Paris. Give her name, age and city "
     "as JSON.", gx.SamplingParams(temperature=0.0, max_tokens=48,
                                   grammar=gx.Grammar.json_schema(PERSON_SCHEMA))),
]  # fmt: skip


# the CPU's chat questions for a checkpoint (indices into CHATS): greedy, top-k / top-p, JSON
CPU_CHATS = (0, 2, 4)
CPU_CHAT_MAX_TOKENS = 64
SPECULATIVE = ("all", "ngram", "draft", "none")


@dataclass(frozen=True)
class DemoPlan:
    """How much the demo runs.

    requests: workload size. max_tokens: the mixed workload's range. chats: indices
    into CHATS (chat models). chat_max_tokens: a cap on chat answers, or None. batch:
    max_batch_size. latency_batch / latency_steps: the step-latency measurement.
    speculative: the runs with speculation ("ngram", "draft").
    """

    requests: int
    max_tokens: tuple[int, int]
    chats: tuple[int, ...]
    chat_max_tokens: int | None
    batch: int
    latency_batch: int
    latency_steps: int
    speculative: tuple[str, ...]


def plan_for(dm: DemoModel, cuda: bool, requests: int | None = None,
             batch: int | None = None, latency_steps: int | None = None,
             speculative: str | None = None) -> DemoPlan:  # fmt: skip
    """The plan for `dm` on CUDA or the CPU; the arguments given override it
    (`speculative`: one of SPECULATIVE)."""
    chat = dm.chat_template is not None
    real_cpu = not cuda and not dm.random_weights
    if cuda:
        chats, n = tuple(range(len(CHATS))), requests or (len(CHATS) if chat else 24)
    elif chat:
        chats = CPU_CHATS if requests is None else tuple(range(len(CHATS)))
        n = requests or len(CPU_CHATS)
    else:
        chats, n = tuple(range(len(CHATS))), requests or 8
    b = batch or (64 if cuda else 8 if dm.random_weights else 2)
    runs = {"all": ("ngram", "draft"), "ngram": ("ngram",), "draft": ("draft",), "none": ()}
    return DemoPlan(
        requests=n,
        max_tokens=(8, 24) if cuda else (6, 16),
        chats=chats,
        chat_max_tokens=CPU_CHAT_MAX_TOKENS if real_cpu else None,
        batch=b,
        latency_batch=min(8 if cuda or dm.random_weights else 2, b),
        latency_steps=latency_steps or (10 if cuda else 3),
        speculative=runs[speculative or "all"],
    )


def build_workload(dm: DemoModel, plan: DemoPlan,
                   seed: int) -> tuple[list[wl.WorkItem], dict[str, str]]:  # fmt: skip
    """The chat workload for a model with a chat template (`CHATS` by `plan.chats`, one
    arriving a step) and its questions by request id, else the mixed workload with
    `PROMPTS` and no questions; prompts encoded by the model's own tokenizer."""
    if dm.chat_template is not None:
        items, questions = [], {}
        for i in range(plan.requests):
            kind, text, params = CHATS[plan.chats[i % len(plan.chats)]]
            prompt = dm.encode_chat([{"role": "user", "content": text}])
            # a grammar's answer is left whole: it stops where the grammar ends
            cap = params.max_tokens if params.grammar else plan.chat_max_tokens or 10**9
            params = dataclasses.replace(params, seed=seed + i,
                                         max_tokens=min(params.max_tokens, cap))  # fmt: skip
            items.append(wl.WorkItem(f"r{i}", prompt, params, arrive=i, kind=kind))
            questions[f"r{i}"] = text
        return items, questions
    items = wl.mixed_workload(plan.requests, dm.tokenizer.vocab_size, seed=seed,
                              grammars=True, max_tokens=plan.max_tokens)  # fmt: skip
    items = [dataclasses.replace(it, prompt=dm.encode(PROMPTS[i % len(PROMPTS)]))
             for i, it in enumerate(items)]  # fmt: skip
    return items, {}
