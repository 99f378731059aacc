"""HFTransformer: its logits and greedy tokens match transformers' own forward."""

from __future__ import annotations

import json

import pytest
import torch

import graphexec as gx
from graphexec.models import HFTransformer, PrefillBatch

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-4, atol=1e-4)
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, intermediate_size=128, max_position_embeddings=128)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


def make(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**BASE, rope_scaling=LLAMA3, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**BASE, tie_word_embeddings=True)
        )
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**BASE))
    return model.eval()


PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [1, 2, 3]]


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_prefill_and_decode_match_transformers(kind, tmp_path) -> None:
    ref = make(kind)
    shard = {"max_shard_size": "50KB"} if kind == "mistral" else {}
    ref.save_pretrained(tmp_path, safe_serialization=True, **shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    m = HFTransformer.from_pretrained(tmp_path, max_seq_len=64)
    assert m.vocab_size == 300 and m.max_seq_len == 64
    m.bind(3, "cpu")
    ids = PROMPTS[0] + [11, 12, 13]
    want = reference(ref, ids)
    n = len(PROMPTS[0])
    torch.testing.assert_close(m.prefill(1, torch.tensor(PROMPTS[0]), all_logits=True),
                               want[:n], **TOL)  # fmt: skip
    for t in range(n, len(ids)):
        got = m.decode(torch.tensor([ids[t]]), torch.tensor([t]), torch.tensor([1]))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got[0], want[t], **TOL)
    # verify from the prompt's end, in a forked slot, gives the same rows
    m.fork(1, 2, n)
    v = m.verify(torch.tensor([ids[n:]]), torch.tensor([n]), torch.tensor([2]))
    torch.testing.assert_close(v[0], want[n:], **TOL)
    # a chunked ragged prefill_batch continues at its start
    b = PrefillBatch.build([(0, 0, ids[:4]), (2, 0, PROMPTS[1])], "cpu", range(7))
    m.prefill_batch(b)
    got = m.prefill_batch(PrefillBatch.build([(0, 4, ids[4:])], "cpu", range(len(ids) - 4)))
    torch.testing.assert_close(got, want[4:], **TOL)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_model_object_and_greedy_generate_match(kind) -> None:
    ref = make(kind)
    m = HFTransformer(ref, max_seq_len=64)
    m.bind(2, "cpu")
    torch.testing.assert_close(m.prefill(0, torch.tensor(PROMPTS[0]), all_logits=True),
                               reference(ref, PROMPTS[0]), **TOL)  # fmt: skip
    ex = gx.DecodeExecutor(HFTransformer(ref, max_seq_len=64), max_batch_size=2, device="cpu",
                           seed=0)  # fmt: skip
    params = gx.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        ex.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    while not ex.idle:
        for o in ex.step():
            if o.token_id is not None:
                outs.setdefault(o.request_id, []).append(o.token_id)
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6,
                               min_new_tokens=6, pad_token_id=0)  # fmt: skip
        assert outs[str(i)] == gen[0, len(p) :].tolist()


def test_bad_folders_and_weights_are_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTransformer.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFTransformer.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
        HFTransformer.from_pretrained(tmp_path)
    ref = make("mistral")
    sd = ref.state_dict()
    cfg = ref.config.to_dict()
    with pytest.raises(ValueError, match=r"model.norm.weight"):
        HFTransformer(cfg, {k: v for k, v in sd.items() if k != "model.norm.weight"})
    bad = dict(sd, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"up_proj.*\[64, 64\].*\[128, 64\]"):
        HFTransformer(cfg, bad)
    with pytest.raises(ValueError, match="rope_scaling"):
        HFTransformer(dict(cfg, rope_parameters={"rope_type": "yarn", "factor": 2.0}), sd)
