"""Grammar compilation and per-slot matchers over the bundled cl100k tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

import graphexec as gx
from graphexec.sampling.processing import unpack_bitmask
from graphexec.text.grammar import GrammarCompiler, GrammarSlots


@pytest.fixture(scope="module")
def tok() -> gx.Tokenizer:
    return gx.Tokenizer.cl100k()


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size + 23)  # a model vocab padded past the tokenizer


def greedy_walk(slots: GrammarSlots, slot: int, tok, scores: torch.Tensor, limit=200) -> str:
    """Take the allowed token with the highest score until the grammar terminates."""
    V = scores.shape[0]
    out = []
    for _ in range(limit):
        allowed = unpack_bitmask(slots.fill([slot]), V)[0]
        t = int(torch.where(allowed, scores, -torch.inf).argmax())
        assert allowed[t]
        if slots.accept(slot, t):
            break
        out.append(t)
    else:
        pytest.fail("grammar did not terminate")
    return tok.decode(out)


def test_compile_is_cached_and_bad_grammars_name_themselves(compiler) -> None:
    g = gx.Grammar.regex("[0-9]{3}")
    assert compiler.compile(g) is compiler.compile(gx.Grammar.regex("[0-9]{3}"))
    with pytest.raises(ValueError, match="grammar"):
        compiler.compile(gx.Grammar.json_schema("{not json"))


def test_matchers_produce_text_the_grammar_accepts(compiler, tok) -> None:
    slots = GrammarSlots(compiler, max_rows=4)
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}},
              "required": ["c"], "additionalProperties": False}  # fmt: skip
    slots.add(0, gx.Grammar.json_schema(schema))
    slots.add(2, gx.Grammar.regex("(yes|no)-[0-9]{2}"))
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(compiler.vocab_size, generator=gen)
    assert json.loads(greedy_walk(slots, 0, tok, scores))["c"] in ("red", "green")
    text = greedy_walk(slots, 2, tok, scores)
    assert text[:3] in ("yes", "no-") and text[-2:].isdigit()


def test_rows_without_grammar_allow_everything_and_padding_never(compiler, tok) -> None:
    slots = GrammarSlots(compiler, max_rows=3)
    slots.add(1, gx.Grammar.regex("a+"))
    rows = slots.fill([0, 1, 5])
    assert rows.shape == (3, slots.words)
    assert (rows[0] == -1).all() and (rows[2] == -1).all()
    allowed = unpack_bitmask(rows, compiler.vocab_size)
    assert 0 < allowed[1].sum() < 1000
    assert not allowed[1, tok.vocab_size :].any()  # ids past the tokenizer: never
    slots.remove(1)
    assert not slots.has(1) and (slots.fill([1])[0] == -1).all()


def test_grammar_requests_finish_with_text_their_grammar_accepts() -> None:
    import re

    from graphexec.app import workload as wl

    tok = gx.Tokenizer.cl100k()
    ex = gx.DecodeExecutor(gx.models.TableModel(tok.vocab_size, seed=2), max_batch_size=8,
                           device="cpu", tokenizer=tok)  # fmt: skip
    ex.capture(progress=False)
    schema = gx.Grammar.json_schema(wl.ANSWER_SCHEMA)
    date = gx.Grammar.regex(wl.DATE_REGEX)
    P = gx.SamplingParams
    for i in range(4):
        ex.add_request(f"j{i}", [1, i], P(temperature=1.0, seed=i, max_tokens=64, grammar=schema))
        ex.add_request(f"d{i}", [2, i], P(top_k=20, seed=i, max_tokens=64, grammar=date,
                                          presence_penalty=1.0))  # fmt: skip
    outs: dict[str, list] = {}
    while not ex.idle:
        for o in ex.step():
            outs.setdefault(o.request_id, []).append(o)
    assert sum(ex.stats.replays.values()) > 0
    for rid, os_ in outs.items():
        assert os_[-1].finish_reason == "stop", rid
        text = tok.decode([o.token_id for o in os_ if o.token_id != tok.eos_token_id])
        if rid.startswith("j"):
            obj = json.loads(text)
            assert obj["answer"] in ("yes", "no", "maybe") and isinstance(obj["confident"], bool)
        else:
            assert re.fullmatch(wl.DATE_REGEX, text), text


def test_json_grammar_does_not_allow_unbounded_whitespace(compiler, tok) -> None:
    """xgrammar's builtin JSON grammar lets a model emit whitespace until max_tokens."""
    ws = torch.tensor(
        [bool(b) and not b.strip() for b in map(tok.token_bytes, range(tok.vocab_size))]
    )
    slots = GrammarSlots(compiler, max_rows=1)
    slots.add(0, gx.Grammar.json())
    assert not slots.accept(0, tok.encode("{")[0])
    taken = 0
    while taken < 16:
        allowed = unpack_bitmask(slots.fill([0]), compiler.vocab_size)[0, : tok.vocab_size]
        run = torch.nonzero(allowed & ws).flatten()
        if len(run) == 0:
            break
        assert not slots.accept(0, int(run[0]))
        taken += 1
    assert taken < 16, "whitespace-only tokens are still allowed after 16 of them"
    assert not slots.accept(0, tok.encode('"')[0])  # and the object goes on


@pytest.mark.parametrize("text", ['{"a": [1, 2]}', '[{"k": null, "s": "x y"}, -1.5, true]', "{}"])
def test_json_grammar_accepts_ordinary_json_token_by_token(compiler, tok, text) -> None:
    m = compiler.matcher(gx.Grammar.json())
    for t in tok.encode(text):
        assert m.accept_token(t) and not m.is_terminated(), tok.decode([t])
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()


def test_a_tokenizer_without_eos_compiles_grammars() -> None:
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)}
    enc = tiktoken.Encoding("bytes", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    tok = gx.Tokenizer(enc)
    assert tok.eos_token_id is None
    compiler = GrammarCompiler(tok, 256)
    m = compiler.matcher(gx.Grammar.regex("ab+"))
    assert all(m.accept_token(t) for t in b"abb") and not m.accept_token(ord("c"))
    # with no EOS to end it, a request stops where its grammar is first complete
    slots = GrammarSlots(compiler, max_rows=1)
    slots.add(0, gx.Grammar.regex("ab+"))
    assert [slots.accept(0, t) for t in b"ab"] == [False, True]


def test_refused_drafts_end_the_run_without_a_library_warning(compiler, tok, capfd) -> None:
    """fill_runs stops a row's drafts at the first one its mask refuses, a special token
    or a token past the vocabulary included, before the matcher sees it (xgrammar logs
    each refused token to stderr, which a user cannot act on); the masks before it and
    the matcher's state are kept."""
    special = next(i for i in range(tok.vocab_size - 1, 0, -1)
                   if tok.is_special(i) and i not in tok.eos_token_ids)  # fmt: skip
    brace = tok.encode("{")
    slots = GrammarSlots(compiler, max_rows=2, offsets=4)
    slots.add(0, gx.Grammar.json())
    slots.add(1, gx.Grammar.json())
    capfd.readouterr()
    rows, kept = slots.fill_runs([0, 1], [[*brace, special, *brace], [10**9]])
    assert kept == [len(brace), 0]
    assert "cannot accept" not in capfd.readouterr().err
    allowed = unpack_bitmask(rows[0, len(brace)].unsqueeze(0), compiler.vocab_size)[0]
    assert not allowed[special] and allowed.any()
    # rolled back: the matcher still starts the object
    assert not slots.accept(0, brace[0])
