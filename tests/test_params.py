"""SamplingParams validation, check_vocab, choose_variant and SamplerVariant.serves."""

from __future__ import annotations

import re

import pytest

from graphexec import SamplerVariant, SamplingParams, choose_variant
from graphexec.params import TOP_K_FIRST_MAX

NAN = float("nan")
INF = float("inf")

# (field named in the message, kwargs) for every invalid value of every field
INVALID = [
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=-1e-30)),
    ("temperature", dict(temperature=NAN)),
    ("temperature", dict(temperature=INF)),
    ("temperature", dict(temperature=-INF)),
    ("temperature", dict(temperature="hot")),
    ("temperature", dict(temperature=None)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=-100)),
    ("top_k", dict(top_k=5.0)),
    ("top_k", dict(top_k=2.5)),
    ("top_k", dict(top_k="5")),
    ("top_k", dict(top_k=True)),
    ("top_k", dict(top_k=False)),
    ("top_k", dict(top_k=None)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=-0.5)),
    ("top_p", dict(top_p=1.0000001)),
    ("top_p", dict(top_p=2.0)),
    ("top_p", dict(top_p=NAN)),
    ("top_p", dict(top_p=INF)),
    ("min_p", dict(min_p=-1e-9)),
    ("min_p", dict(min_p=1.5)),
    ("min_p", dict(min_p=NAN)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**63)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=1.0)),
    ("seed", dict(seed=7.5)),
    ("seed", dict(seed="7")),
    ("seed", dict(seed=True)),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=1000)),
    ("logprobs", dict(logprobs=2.0)),
    ("logprobs", dict(logprobs=True)),
    ("logprobs_mode", dict(logprobs_mode="logits")),
    ("logprobs_mode", dict(logprobs_mode="RAW")),
    ("logprobs_mode", dict(logprobs_mode=None)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=INF)),
    ("repetition_penalty", dict(repetition_penalty=NAN)),
    ("presence_penalty", dict(presence_penalty=-2.01)),
    ("presence_penalty", dict(presence_penalty=2.01)),
    ("presence_penalty", dict(presence_penalty=NAN)),
    ("presence_penalty", dict(presence_penalty=INF)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=3.0)),
    ("frequency_penalty", dict(frequency_penalty=NAN)),
    ("frequency_penalty", dict(frequency_penalty=-INF)),
    ("logit_bias", dict(logit_bias={"x3": 1.0})),
    ("logit_bias", dict(logit_bias={"-3": 1.0})),
    ("logit_bias", dict(logit_bias={3: "1.0"})),
    ("logit_bias", dict(logit_bias={3: True})),
    ("logit_bias", dict(logit_bias={3: 1.0, "3": 2.0})),
    ("logit_bias", dict(logit_bias={3.0: 1.0})),
    ("logit_bias", dict(logit_bias={True: 1.0})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={3: NAN})),
    ("logit_bias", dict(logit_bias={3: "high"})),
    ("logit_bias", dict(logit_bias=[(3, 1.0)])),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-5)),
    ("max_tokens", dict(max_tokens=2.0)),
    ("max_tokens", dict(max_tokens=True)),
    ("stop_token_ids", dict(stop_token_ids=(0, -1))),
    ("stop_token_ids", dict(stop_token_ids=(1.0,))),
    ("stop_token_ids", dict(stop_token_ids=("a",))),
    # DESIGN.md: bad input gets a ValueError naming the field, not a TypeError
    ("stop_token_ids", dict(stop_token_ids=5)),
    # strict types: bools and numeric strings are not numbers
    ("temperature", dict(temperature="0.7")),
    ("temperature", dict(temperature=True)),
    ("top_p", dict(top_p="0.9")),
    ("min_p", dict(min_p=False)),
    ("presence_penalty", dict(presence_penalty="1")),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=21)),
    ("prompt_logprobs", dict(prompt_logprobs=True)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17)),  # above the default max_tokens=16
    ("min_tokens", dict(min_tokens=2.0)),
    ("ignore_eos", dict(ignore_eos=1)),
    ("ignore_eos", dict(ignore_eos="yes")),
    ("include_stop_str_in_output", dict(include_stop_str_in_output=None)),
    ("skip_special_tokens", dict(skip_special_tokens=0)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=[3])),
    ("stop", dict(stop=5)),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[1.0, 2.0])),
    ("allowed_token_ids", dict(allowed_token_ids=[-1])),
    ("allowed_token_ids", dict(allowed_token_ids="12")),
    ("bad_words", dict(bad_words="word")),
    ("bad_words", dict(bad_words=[""])),
    ("bad_words", dict(bad_words=[[]])),
    ("bad_words", dict(bad_words=[[1, 2.5]])),
    ("n", dict(n=0)),
    ("n", dict(n=2.0)),
    ("n", dict(n=True)),
    ("grammar", dict(grammar="json")),
]


def _names(field: str) -> str:
    # the field name as a whole word: "logprobs" must not match inside "logprobs_mode"
    return rf"(?<![A-Za-z0-9_]){re.escape(field)}(?![A-Za-z0-9_])"


@pytest.mark.parametrize(
    "field,kwargs", INVALID, ids=[f"{f}={next(iter(k.values()))!r}" for f, k in INVALID]
)
def test_invalid_field_raises_value_error_naming_it(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=_names(field)):
        SamplingParams(**kwargs)


VALID_EDGES = [
    dict(temperature=0.0),
    dict(temperature=1e-3),
    dict(temperature=100.0),
    dict(top_k=-1),
    dict(top_k=0),
    dict(top_k=1),
    dict(top_p=1.0),
    dict(top_p=1e-6),
    dict(min_p=0.0),
    dict(min_p=1.0),
    dict(seed=0),
    dict(seed=2**63 - 1),
    dict(logprobs=None),
    dict(logprobs=0),
    dict(logprobs=20),
    dict(logprobs_mode="raw"),
    dict(logprobs_mode="processed"),
    dict(repetition_penalty=1e-3),
    dict(repetition_penalty=50.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0),
    dict(presence_penalty=2.0, frequency_penalty=-2.0),
    dict(logit_bias={}),
    dict(logit_bias={0: -100.0, 5: 100.0}),
    dict(max_tokens=1),
    dict(stop_token_ids=[0, 7]),
    dict(min_tokens=16),
    dict(prompt_logprobs=0),
    dict(ignore_eos=True),
    dict(n=4),
]


@pytest.mark.parametrize("kwargs", VALID_EDGES, ids=[repr(k) for k in VALID_EDGES])
def test_valid_edge_values_are_accepted(kwargs: dict) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        got = getattr(p, name)
        if name in ("stop_token_ids", "allowed_token_ids"):
            assert got == tuple(value)
        elif isinstance(value, float):
            assert got == value and isinstance(got, float)
        else:
            assert got == value


def test_params_are_frozen() -> None:
    p = SamplingParams(seed=1)
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_numbers_are_normalised_to_float() -> None:
    p = SamplingParams(temperature=1, top_p=1, min_p=0, presence_penalty=1, logit_bias={3: 2})
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert isinstance(p.top_p, float) and isinstance(p.min_p, float)
    assert isinstance(p.presence_penalty, float)
    assert p.logit_bias == {3: 2.0} and isinstance(p.logit_bias[3], float)


def test_with_seed() -> None:
    p = SamplingParams(temperature=0.7, top_k=5)
    q = p.with_seed(123)
    assert q.seed == 123 and p.seed is None
    assert (q.temperature, q.top_k) == (0.7, 5)
    with pytest.raises(ValueError, match=_names("seed")):
        p.with_seed(-3)


# --------------------------------------------------------------------------- check_vocab


@pytest.mark.parametrize("top_k", [-1, 0, 1, 31, 32])
def test_check_vocab_accepts_top_k_up_to_v(top_k: int) -> None:
    SamplingParams(top_k=top_k).check_vocab(32)


@pytest.mark.parametrize("top_k", [33, 1000])
def test_check_vocab_rejects_top_k_above_v(top_k: int) -> None:
    with pytest.raises(ValueError, match=_names("top_k")):
        SamplingParams(top_k=top_k).check_vocab(32)


def test_check_vocab_logit_bias_ids() -> None:
    SamplingParams(logit_bias={0: 1.0, 31: -1.0}).check_vocab(32)
    for bad in (32, 33, 10**6):
        with pytest.raises(ValueError, match=_names("logit_bias")):
            SamplingParams(logit_bias={0: 1.0, bad: -1.0}).check_vocab(32)


def test_check_vocab_without_vocab_fields() -> None:
    SamplingParams().check_vocab(1)
    SamplingParams(logit_bias=None, top_k=1).check_vocab(1)


# ------------------------------------------------------------------- off values, variants

GREEDY_WITH_FILTERS = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3)


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(),
        SamplingParams(top_k=-1),
        SamplingParams(top_k=0),
        SamplingParams(top_p=1.0),
        SamplingParams(min_p=0.0),
        SamplingParams(top_k=0, top_p=1.0, min_p=0.0, temperature=0.3),
        GREEDY_WITH_FILTERS,
        SamplingParams(temperature=0.0, min_p=1.0),
    ],
)
def test_off_values_count_as_unused(p: SamplingParams) -> None:
    assert not p.uses_top_k and not p.uses_top_p and not p.uses_min_p
    assert choose_variant([p]) is SamplerVariant.NO_FILTER
    assert all(v.serves(p) for v in SamplerVariant)


def test_uses_flags() -> None:
    assert SamplingParams(top_k=1).uses_top_k
    assert SamplingParams(top_p=0.999).uses_top_p
    assert SamplingParams(min_p=1e-6).uses_min_p
    assert not SamplingParams(top_k=1).uses_top_p
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-6).greedy
    assert GREEDY_WITH_FILTERS.greedy
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties
    assert SamplingParams(frequency_penalty=0.5).uses_penalties


PLAIN = SamplingParams(temperature=0.8)
TOPK = SamplingParams(top_k=40)
TOPP = SamplingParams(top_p=0.9)
TOPKP = SamplingParams(top_k=40, top_p=0.9)
MINP = SamplingParams(min_p=0.1)
BIGK = SamplingParams(top_k=TOP_K_FIRST_MAX + 1, top_p=0.9)  # past top-k first's bound
MAXK = SamplingParams(top_k=TOP_K_FIRST_MAX)
ALL = SamplingParams(top_k=40, top_p=0.9, min_p=0.1)
PEN = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, logit_bias={1: 2.0})


@pytest.mark.parametrize(
    "p,serving",
    [
        (PLAIN, {"no_filter", "top_k_top_p", "default"}),
        (PEN, {"no_filter", "top_k_top_p", "default"}),
        (GREEDY_WITH_FILTERS, {"no_filter", "top_k_top_p", "default"}),
        (TOPK, {"top_k_top_p", "default"}),
        (TOPP, {"default"}),  # top_k_top_p filters top-k first
        (TOPKP, {"top_k_top_p", "default"}),
        (MAXK, {"top_k_top_p", "default"}),
        (BIGK, {"default"}),
        (MINP, {"default"}),
        (ALL, {"default"}),
    ],
)
def test_serves(p: SamplingParams, serving: set[str]) -> None:
    assert {v.value for v in SamplerVariant if v.serves(p)} == serving


@pytest.mark.parametrize(
    "batch,expected",
    [
        ([], "no_filter"),
        ([PLAIN], "no_filter"),
        ([PLAIN, PEN, GREEDY_WITH_FILTERS], "no_filter"),
        ([PLAIN, TOPK], "top_k_top_p"),
        ([TOPP, PLAIN, GREEDY_WITH_FILTERS], "default"),
        ([TOPK, PLAIN, GREEDY_WITH_FILTERS], "top_k_top_p"),
        ([TOPKP, PEN], "top_k_top_p"),
        ([PLAIN, MINP], "default"),
        ([TOPK, TOPP, MINP, PLAIN], "default"),
        ([GREEDY_WITH_FILTERS, ALL], "default"),
        ([ALL], "default"),
    ],
)
def test_choose_variant(batch: list[SamplingParams], expected: str) -> None:
    v = choose_variant(batch)
    assert v is SamplerVariant(expected)
    assert all(v.serves(p) for p in batch)
    # the cheapest: no variant earlier in the order serves the whole batch
    order = [SamplerVariant.NO_FILTER, SamplerVariant.TOP_K_TOP_P, SamplerVariant.DEFAULT]
    for cheaper in order[: order.index(v)]:
        assert not all(cheaper.serves(p) for p in batch)


def test_variant_values() -> None:
    assert {v.value for v in SamplerVariant} == {"no_filter", "top_k_top_p", "default"}
    assert SamplerVariant("default") is SamplerVariant.DEFAULT


def test_logit_bias_takes_openai_string_keys_and_clamps_to_100() -> None:
    p = SamplingParams(logit_bias={"5": 1e39, 7: -INF, "9": 3.5})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 3.5}


def test_float_and_tensor_token_ids_are_refused_ints_accepted() -> None:
    import numpy as np
    import torch

    from graphexec.params import token_ids

    assert token_ids("x", np.array([3, 1])) == (3, 1)
    assert token_ids("x", torch.tensor([4, 2])) == (4, 2)
    for bad in ([1.0], np.array([1.0]), torch.tensor([1.5]), [True], "12"):
        with pytest.raises(ValueError, match="x"):
            token_ids("x", bad)


def test_stop_and_allowed_ids_are_normalised() -> None:
    p = SamplingParams(stop="END", allowed_token_ids=[5, 1, 5], bad_words=["no", (3, 4)])
    assert p.stop == ("END",)
    assert p.allowed_token_ids == (1, 5)
    assert p.bad_words == ("no", (3, 4))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        p.check_vocab(4)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[(3, 9)]).check_vocab(8)


def test_stream_seeds_differ_per_stream_and_from_neighbouring_seeds() -> None:
    from graphexec.params import stream_seed

    seeds = {stream_seed(s, i) for s in range(50) for i in range(8)}
    assert len(seeds) == 400 and all(0 <= x < 2**63 for x in seeds)
    p = SamplingParams(seed=7, n=3).stream(2)
    assert p.n == 1 and p.seed == stream_seed(7, 2)
    # stream 0 is the request itself: its seed replays it with n = 1
    assert stream_seed(7, 0) == 7 and SamplingParams(seed=7, n=3).stream(0).seed == 7
