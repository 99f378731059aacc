"""Tokenizer.from_pretrained: a byte-level BPE tokenizer.json trained here, on a tiny corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import graphexec as gx

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    '{"ok": true, "answer": false, "value": null}',
    "Grüße aus Köln! naïve café — 日本語のテキスト 🙂",
    "line one\nline two\n\tindented  double  spaces",
] * 20
TEXTS = ["hello world", "  two  spaces ", "a\nb\n\n", "Grüße 日本語 🙂 é", '{"ok": true}', ""]


def build(folder: Path, *, config: dict | None = None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    cfg = {"eos_token_id": eos} if config is None else config
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def build_llama(folder: Path, max_positions: int = 256) -> Path:
    """`build`'s tokenizer beside a tiny random Llama (2 layers, hidden 64, seed 0) saved by
    transformers, its EOS the tokenizer's <|endoftext|>: a checkpoint folder for tests."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    build(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=max_positions,
        eos_token_id=tok.token_to_id("<|endoftext|>"),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)  # overwrites config.json
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def tok(folder) -> gx.Tokenizer:
    return gx.Tokenizer.from_pretrained(folder)


def test_round_trips_and_matches_the_hf_tokenizer(tok, folder) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text == hf.decode(ids)
        stream = tok.decode_stream()
        assert "".join(stream.push(i) for i in ids) == text and not stream.pending


def test_eos_and_special_tokens(tok) -> None:
    eos = tok.encode("<|endoftext|>", allowed_special="all")
    assert eos == [tok.eos_token_id] and tok.eos_token_ids == (tok.eos_token_id,)
    assert tok.is_special(tok.eos_token_id) and tok.token_bytes(tok.eos_token_id)
    plain = tok.encode("a<|endoftext|>b")
    assert tok.eos_token_id not in plain and tok.decode(plain) == "a<|endoftext|>b"
    assert tok.decode([*tok.encode("hi"), tok.eos_token_id]) == "hi"
    assert tok.plain_texts[tok.eos_token_id] is None
    assert tok.plain_texts[tok.encode("h")[0]] == "h"


def test_eos_lookup_order(tmp_path) -> None:
    f = build(tmp_path / "a", config={})
    (f / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = gx.Tokenizer.from_pretrained(f)
    assert tok.eos_token_id == tok.encode("<|endoftext|>", allowed_special="all")[0]
    (f / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    tok = gx.Tokenizer.from_pretrained(f)
    assert tok.eos_token_id == 5 and tok.eos_token_ids == (5, 7)


def test_missing_folder_and_tokenizer_json(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gx.Tokenizer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        gx.Tokenizer.from_pretrained(tmp_path)


def test_json_schema_grammar_request_finishes_with_valid_json(tok) -> None:
    ex = gx.DecodeExecutor(gx.models.TableModel(tok.vocab_size, seed=0), device="cpu",
                           tokenizer=tok)  # fmt: skip
    schema = gx.Grammar.json_schema(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    )
    for seed in range(3):
        rid = f"r{seed}"
        params = gx.SamplingParams(temperature=1.0, seed=seed, max_tokens=128, grammar=schema)
        ex.add_request(rid, tok.encode("hello"), params)
        outs = []
        while not ex.idle:
            outs += [o for o in ex.step() if o.request_id == rid]
        assert outs[-1].finish_reason == "stop"
        text = tok.decode([o.token_id for o in outs if o.token_id is not None])
        obj = json.loads(text)
        assert isinstance(obj, dict) and isinstance(obj["ok"], bool), text


def test_eos_outside_the_vocabulary_is_an_error(tmp_path) -> None:
    f = build(tmp_path / "b", config={"eos_token_id": [0, 99999]})
    with pytest.raises(ValueError, match="99999"):
        gx.Tokenizer.from_pretrained(f)
