"""EngineConfig: the executor's options as one frozen dataclass, the same as keywords."""

from __future__ import annotations

import dataclasses

import pytest

import graphexec as gx
from tests.engine.scripted import drain, tokens

V = 300


def test_a_config_and_its_keywords_build_the_same_executor() -> None:
    cfg = gx.EngineConfig(max_batch_size=4, device="cpu", seed=3, buckets=(1, 4))
    runs = []
    for ex in (gx.DecodeExecutor(gx.models.TableModel(V, seed=0), cfg),
               gx.DecodeExecutor(gx.models.TableModel(V, seed=0), max_batch_size=4,
                                 device="cpu", seed=3, buckets=(1, 4))):  # fmt: skip
        assert ex.buckets == (1, 4) and ex.max_batch_size == 4
        ex.add_request("a", [1, 2], gx.SamplingParams(temperature=0.9, max_tokens=6))
        runs.append(tokens(drain(ex)["a"]))
    assert runs[0] == runs[1] and len(runs[0]) == 6


def test_keywords_override_the_config_and_it_stays_frozen() -> None:
    cfg = gx.EngineConfig(max_batch_size=4, device="cpu")
    ex = gx.DecodeExecutor(gx.models.TableModel(V, seed=0), cfg, max_batch_size=2)
    assert ex.max_batch_size == 2 and ex.buckets == (1, 2) and cfg.max_batch_size == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_batch_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_batch_size", 0), ("prefill_budget", True), ("backend", "bogus"),
     ("buckets", (0,)), ("speculative", "ngram"), ("blocking_wait", 1)],
)  # fmt: skip
def test_bad_options_name_their_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        gx.EngineConfig(**{field: value})


def test_blocking_wait_reaches_the_runner() -> None:
    for wait in (False, True):
        ex = gx.DecodeExecutor(gx.models.TableModel(V, seed=0), device="cpu", blocking_wait=wait)
        assert ex.runner.blocking_wait is wait
