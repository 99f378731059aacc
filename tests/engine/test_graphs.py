"""Graph keys, buckets and the per-step plan (host-side decisions only)."""

from __future__ import annotations

import pytest

import graphexec as gx
from graphexec.engine.graphs import (
    GraphKey,
    all_keys,
    check_buckets,
    default_buckets,
    pick_bucket,
    plan_step,
)
from graphexec.params import TOP_K_FIRST_MAX, SamplerVariant

P = gx.SamplingParams


def test_default_buckets() -> None:
    assert default_buckets(256) == (1, 2, 4, 8) + tuple(range(16, 257, 16))
    assert default_buckets(1) == (1,)
    assert default_buckets(5) == (1, 2, 4, 5)
    assert default_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    with pytest.raises(ValueError, match="max_batch_size"):
        default_buckets(0)


def test_pick_bucket_is_smallest_that_fits() -> None:
    b = default_buckets(64)
    assert [pick_bucket(n, b) for n in (1, 2, 3, 5, 8, 9, 16, 17, 64)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 64,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="batch_size"):
        pick_bucket(65, b)
    with pytest.raises(ValueError, match="batch_size"):
        pick_bucket(0, b)


def test_check_buckets_names_the_field() -> None:
    assert check_buckets([8, 1, 8, 4]) == (1, 4, 8)
    for bad in ([], [0], [2, -1], [1.5], [True]):
        with pytest.raises(ValueError, match="buckets"):
            check_buckets(bad)


def test_plan_picks_variant_bucket_and_logprobs() -> None:
    b = default_buckets(16)
    plan = plan_step([P(seed=1), P(temperature=0.0, seed=2)], b)
    assert plan == [(GraphKey(SamplerVariant.NO_FILTER, 2, False), slice(0, 2))]
    plan = plan_step([P(seed=1), P(top_k=5, seed=2), P(seed=3, logprobs=0)], b)
    assert plan == [(GraphKey(SamplerVariant.TOP_K_TOP_P, 4, True), slice(0, 3))]
    plan = plan_step([P(top_p=0.5, seed=1), P(min_p=0.1, seed=2)], b)
    assert plan[0][0].variant is SamplerVariant.DEFAULT
    # top_k_top_p filters top-k first: top-p alone, or a top-k past its bound, is default's
    for rows in ([P(top_p=0.9, seed=1)], [P(top_k=TOP_K_FIRST_MAX + 1, top_p=0.9, seed=1)]):
        assert plan_step(rows, b)[0][0].variant is SamplerVariant.DEFAULT
    top = plan_step([P(seed=1), P(top_k=TOP_K_FIRST_MAX, top_p=0.9, seed=2)], b)
    assert top[0][0].variant is SamplerVariant.TOP_K_TOP_P


def test_plan_splits_batches_larger_than_the_largest_bucket() -> None:
    b = (1, 2, 4, 8)
    params = [P(seed=i) for i in range(8)] + [P(seed=8, min_p=0.1), P(seed=9, logprobs=2)]
    plan = plan_step(params, b)
    assert [s for _, s in plan] == [slice(0, 8), slice(8, 10)]
    assert plan[0][0] == GraphKey(SamplerVariant.NO_FILTER, 8, False)
    assert plan[1][0] == GraphKey(SamplerVariant.DEFAULT, 2, True)


def test_all_keys_largest_bucket_first_and_complete() -> None:
    keys = all_keys((1, 4, 2))
    assert len(keys) == len(set(keys)) == 3 * 3 * 2
    assert [k.bucket for k in keys][:6] == [4] * 6 and keys[-1].bucket == 1


def test_all_keys_cover_every_variant_bucket_logprobs_and_width() -> None:
    keys = all_keys((1, 4, 2), (0, 3))
    assert len(keys) == len(set(keys)) == 3 * 3 * 2 * 2
    assert set(keys) == {GraphKey(v, b, lp, k) for v in SamplerVariant for b in (1, 2, 4)
                         for lp in (False, True) for k in (0, 3)}  # fmt: skip
    assert len(all_keys(default_buckets(256))) == 20 * 3 * 2


def test_graph_key_is_frozen_and_validated() -> None:
    k = GraphKey(SamplerVariant.DEFAULT, 4, False)
    with pytest.raises(AttributeError):
        k.bucket = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="bucket"):
        GraphKey(SamplerVariant.DEFAULT, 0, False)
    with pytest.raises(ValueError, match="variant"):
        GraphKey("default", 1, False)  # type: ignore[arg-type]
