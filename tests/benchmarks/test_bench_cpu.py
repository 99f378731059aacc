"""The CPU route's benchmark against transformers (step_cpu.py): transformers' side runs
without deprecation warnings in the output."""

import warnings

import pytest

transformers = pytest.importorskip("transformers")

import step_cpu  # noqa: E402

from tests.text.test_hf_tokenizer import build_llama  # noqa: E402


def test_transformers_decode_warns_nothing(tmp_path) -> None:
    theirs = step_cpu.Theirs(build_llama(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning (past_key_values) fails the test
        assert theirs.decode([1, 5, 7, 9], 3) > 0
