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


@pytest.mark.parametrize("rows", [False, True], ids=["padded", "token_rows"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_prefill_and_decode_match_transformers(kind, rows, tmp_path) -> None:
    ref = make(kind)
    shard = {"max_shard_size": "50KB"} if kind == "mistral" else {}
    ref.save_pretrained(tmp_path, safe_serialization=True, **shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    m = HFTransformer.from_pretrained(tmp_path, max_seq_len=64)
    assert m.vocab_size == 300 and m.max_seq_len == 64
    m.bind(3, "cpu")
    m.prefill_rows = rows  # both prefill routes (CUDA takes token rows)
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


def windowed(kind: str):
    """A Mistral with a 4-key sliding window on every layer, or a Qwen2 with a 3-key
    window on its layers from max_window_layers = 1 (layer 0 full, layer 1 windowed)."""
    torch.manual_seed(1)
    if kind == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**BASE, sliding_window=4)
        )
    else:
        cfg = transformers.Qwen2Config(
            **BASE, use_sliding_window=True, sliding_window=3, max_window_layers=1
        )
        model = transformers.Qwen2ForCausalLM(cfg)
    return model.eval()


@pytest.mark.parametrize("rows", [False, True], ids=["padded", "token_rows"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_matches_transformers(kind, rows, tmp_path) -> None:
    ref = windowed(kind)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    m = HFTransformer.from_pretrained(tmp_path, max_seq_len=64)
    assert m.windows == ([4, 4] if kind == "mistral" else [None, 3])
    m.bind(3, "cpu")
    m.prefill_rows = rows
    prompt = [5, 17, 250, 3, 99, 42, 7, 8, 9]  # longer than the window
    ids = prompt + [11, 12, 13, 14, 15, 16]  # decode well past it
    want = reference(ref, ids)
    n = len(prompt)
    torch.testing.assert_close(m.prefill(1, torch.tensor(prompt), all_logits=True), want[:n],
                               **TOL)  # fmt: skip
    for t in range(n, len(ids)):
        got = m.decode(torch.tensor([ids[t], 0]), torch.tensor([t, 0]), torch.tensor([1, 2]))
        torch.testing.assert_close(got[0], want[t], **TOL)
    # chunks across the window's edge: the second chunk sees the first through the cache
    b = PrefillBatch.build([(0, 0, ids[:6]), (2, 0, PROMPTS[1])], "cpu", range(6))
    torch.testing.assert_close(m.prefill_batch(b), want[:6], **TOL)
    got = m.prefill_batch(PrefillBatch.build([(0, 6, ids[6:])], "cpu", range(len(ids) - 6)))
    torch.testing.assert_close(got, want[6:], **TOL)


def test_sliding_window_config() -> None:
    ref = make("mistral")
    sd, cfg = ref.state_dict(), ref.config.to_dict()
    # a window of max_seq_len or more hides nothing: dropped (MistralConfig's default 4096)
    assert HFTransformer(cfg, sd, max_seq_len=64).windows == [None, None]
    assert HFTransformer(dict(cfg, sliding_window=None), sd, max_seq_len=64).windows == [None] * 2
    with pytest.raises(ValueError, match="sliding_window"):
        HFTransformer(dict(cfg, sliding_window=0), sd)
    q = make("qwen2")
    qcfg, qsd = q.config.to_dict(), q.state_dict()
    # Qwen2: only with use_sliding_window (its configs carry a window that is off)
    off = dict(qcfg, use_sliding_window=False, sliding_window=8, layer_types=None)
    assert HFTransformer(off, qsd, max_seq_len=64).windows == [None, None]
    on = dict(off, use_sliding_window=True, max_window_layers=0)
    assert HFTransformer(on, qsd, max_seq_len=64).windows == [8, 8]
    with pytest.raises(ValueError, match="layer_types"):
        HFTransformer(dict(on, layer_types=["full_attention"]), qsd)


@pytest.mark.gpu
def test_cuda_decode_matches_cpu() -> None:
    """The Triton decode attention and the token-row prefill (CUDA) against the CPU
    route, fp32, with a window."""
    ref = windowed("mistral")
    # the CPU's padded-SDPA prefill (not invariant) against CUDA's token rows
    cpu = HFTransformer(ref, max_seq_len=64, batch_invariant=False)
    gpu = HFTransformer(ref, max_seq_len=64)
    cpu.bind(3, "cpu")
    gpu.bind(3, "cuda")
    prompt = [5, 17, 250, 3, 99, 42, 7, 8, 9]
    assert gpu.prefill_rows and not cpu.prefill_rows
    pre = [m.prefill(0, torch.tensor(prompt), all_logits=True) for m in (cpu, gpu)]
    torch.testing.assert_close(pre[1].cpu(), pre[0], **TOL)
    for m in (cpu, gpu):
        m.prefill(1, torch.tensor(prompt[:5]))
    for t in range(6):
        args = (torch.tensor([t + 1, t + 2]), torch.tensor([9 + t, 5 + t]), torch.tensor([0, 1]))
        want = cpu.decode(*args)
        got = gpu.decode(*(a.cuda() for a in args))
        torch.testing.assert_close(got.cpu(), want, **TOL)


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


def test_seeded_sampling_is_independent_of_the_batch() -> None:
    """A seeded request's sampled tokens are the same alone, beside others, at another row
    (fp32: the logits may move in their last bits with the batch, never a token here)."""
    ref = make("qwen2")
    probe = gx.SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=8, logprobs=2)

    def run(before: int, after: int) -> list[gx.RequestOutput]:
        ex = gx.DecodeExecutor(HFTransformer(ref, max_seq_len=64), max_batch_size=8,
                               device="cpu", seed=0)  # fmt: skip
        for i in range(before):
            ex.add_request(f"a{i}", [i + 1, 2], gx.SamplingParams(seed=i, max_tokens=3 + i))
        ex.add_request("probe", PROMPTS[0], probe)
        for i in range(after):
            ex.add_request(f"b{i}", [7, i], gx.SamplingParams(temperature=0.0, max_tokens=9))
        outs = []
        while not ex.idle:
            outs += [o for o in ex.step() if o.request_id == "probe"]
        return outs

    alone = run(0, 0)
    assert len(alone) == 8
    for before, after in [(1, 0), (3, 4)]:
        got = run(before, after)
        assert [o.token_id for o in got] == [o.token_id for o in alone]
        assert [o.logprob for o in got] == pytest.approx([o.logprob for o in alone], rel=1e-5)
