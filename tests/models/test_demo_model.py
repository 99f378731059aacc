"""`graphexec demo --model PATH`: the demo's workload on a checkpoint folder (a tiny random
Llama saved by transformers, with a byte-level BPE tokenizer.json trained here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from graphexec.app import cli
from graphexec.models.demo_model import chat_template, choose_model, render_chat
from tests.text.test_hf_tokenizer import build_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("llama"))


def test_demo_runs_the_workload_on_a_checkpoint(checkpoint, capsys, restore_threads) -> None:
    rc = cli.main(["demo", "--model", str(checkpoint), "--device", "cpu", "--requests", "9",
                   "--max-batch-size", "4", "--latency-steps", "1", "--threads", "1",
                   "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "llama checkpoint" in out and "vocabulary 392" in out, out
    assert "determinism check (replay vs eager, tokens and logprobs bit for bit): PASS" in out
    # the n-gram run and the draft model (a truncated copy), streams equal to the ones without
    assert re.search(r"n-gram: .* tokens equal the non-speculative run's: PASS", out), out
    assert re.search(r"draft model \(its first 2 of 2 layers\): .* run's: PASS", out), out
    parsed = re.findall(r"json schema .* parsed JSON: (.*)", out)
    dates = re.findall(r"regex date .* regex matches: '(.*)'", out)
    assert parsed and dates, out
    assert "NOT JSON" not in out and "DOES NOT MATCH" not in out
    for d in dates:
        assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", d)


def test_prompts_use_the_checkpoint_tokenizer_and_its_bos(checkpoint, tmp_path) -> None:
    from tokenizers import Tokenizer, processors

    dm = choose_model(str(checkpoint), torch.device("cpu"))
    assert dm.prompt_prefix == () and not dm.random_weights
    text = "The quick brown fox"
    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids
    assert dm.encode(text) == tuple(ids) and dm.tokenizer.eos_token_ids == (0,)
    assert dm.make() is dm.make()  # the weights are read once
    # a tokenizer.json whose post-processor adds BOS (Llama, Mistral): prompts start with it
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    dm = choose_model(str(tmp_path), torch.device("cpu"), dtype="bfloat16", max_seq_len=64)
    assert dm.prompt_prefix == (0,) and dm.encode(text) == (0, *ids)
    m = dm.make()
    assert m.dtype == torch.bfloat16 and m.max_seq_len == 64


def test_bad_model_folders_exit_2_naming_the_problem(
    checkpoint, tmp_path, capsys, restore_threads
) -> None:
    def demo(path: Path) -> str:
        assert cli.main(["demo", "--model", str(path), "--device", "cpu", "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and str(path) in err, err
        return err.strip().splitlines()[-1]

    assert "does not exist" in demo(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    assert "is not a folder" in demo(tmp_path / "file")
    assert "no config.json" in demo(tmp_path)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert "unsupported architecture" in demo(gpt2)
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "awq"}})
    )
    assert "quantized checkpoints (awq)" in demo(gpt2)
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    assert "tokenizer.json" in demo(no_tok)
    (no_tok / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    assert "safetensors" in demo(no_tok)


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def test_a_chat_template_gives_the_demo_chat_prompts(
    checkpoint, tmp_path, capsys, restore_threads
) -> None:
    folder = tmp_path / "chat"
    folder.mkdir()
    for p in checkpoint.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "bos_token": {"content": "<|endoftext|>"},
        "eos_token": "<|endoftext|>",
    }))  # fmt: skip
    dm = choose_model(str(folder), torch.device("cpu"))
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    assert dm.chat_template == TEMPLATE and dm.special_tokens == special
    msgs = [{"role": "user", "content": "hi"}]
    text = render_chat(TEMPLATE, msgs, dm.special_tokens)
    assert text == "<|endoftext|><|im_start|>user\nhi<|endoftext|>\n<|im_start|>assistant\n"
    ids = dm.encode_chat(msgs)
    assert ids == tuple(dm.tokenizer.encode(text, allowed_special="all")) and ids[0] == 0
    # transformers 5 keeps the template in chat_template.jinja
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert chat_template(folder) == TEMPLATE
    assert choose_model(str(checkpoint), torch.device("cpu")).chat_template is None

    rc = cli.main(["demo", "--model", str(folder), "--device", "cpu", "--requests", "3",
                   "--max-batch-size", "2", "--latency-steps", "1", "--threads", "1",
                   "--quiet"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "chat prompts (the model's chat template)" in out
    assert "r0 asked: 'What is the capital of France?" in out
    assert "determinism check (replay vs eager, tokens and logprobs bit for bit): PASS" in out
    assert re.search(r"n-gram: .* tokens equal the non-speculative run's: PASS", out), out
