"""The model benchmark (bench_step.py --model, step_model.py) and the random weights it
runs on (graphexec.models.hf_random): the bundled configs load in transformers and give
the parameter names and shapes of transformers' own models; random weights load into
both models and give the same logits; the bench runs end to end on the CPU with a tiny
config (its numbers are not performance, only its rows and columns)."""

import json
import sys
import time

from tests.interpreter import ensure_interpreter

ensure_interpreter()  # bench_step imports triton: set the interpreter first (no CUDA here)

import bench_step  # noqa: E402
import pytest
import step_model  # noqa: E402
import step_transformers
import torch

from graphexec.models import HFTransformer
from graphexec.models.hf_random import param_shapes, random_model, random_state_dict

transformers = pytest.importorskip("transformers")

NAMES = ("qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b")
# transformers' parameter counts of the public models (tied embeddings counted once)
PARAMS = {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400,
          "llama-3.1-8b": 8_030_261_248}  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=300, bos_token_id=1,
            eos_token_id=2, max_position_embeddings=256)  # fmt: skip


def config(name: str, **over) -> dict:
    return dict(step_model.resolve(name)[1], **over)


@pytest.mark.parametrize("name", NAMES)
def test_configs_load_in_transformers_and_match_its_parameters(name):
    cfg = config(name)
    t0 = time.perf_counter()
    c = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        ref = transformers.AutoModelForCausalLM.from_config(c)
    assert time.perf_counter() - t0 < 30
    assert type(ref).__name__ == cfg["architectures"][0]
    tied = cfg["tie_word_embeddings"]
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()
            if k != "lm_head.weight" or not tied}  # fmt: skip
    assert tied == (ref.lm_head.weight is ref.model.embed_tokens.weight)
    assert param_shapes(cfg) == want
    assert sum(p.numel() for p in ref.parameters()) == PARAMS[name]
    # HFTransformer accepts every shape (on the meta device: no memory)
    state = random_state_dict(cfg, device="meta")
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    m = HFTransformer(cfg, state, device="meta", max_seq_len=64)
    assert m.dtype == torch.bfloat16 and m.vocab_size == cfg["vocab_size"]


def test_public_config_facts():
    q, ll = config("qwen2.5-0.5b"), config("llama-3.2-1b")
    assert (q["hidden_size"], q["num_hidden_layers"], q["num_attention_heads"],
            q["num_key_value_heads"], q["intermediate_size"], q["vocab_size"],
            q["rope_theta"], q["rms_norm_eps"], q["max_position_embeddings"]) == (
        896, 24, 14, 2, 4864, 151936, 1e6, 1e-6, 32768)  # fmt: skip
    assert "q_proj.bias" in " ".join(param_shapes(q))
    assert (ll["hidden_size"], ll["num_hidden_layers"], ll["num_attention_heads"],
            ll["num_key_value_heads"], ll["head_dim"], ll["intermediate_size"],
            ll["vocab_size"], ll["rope_theta"], ll["rms_norm_eps"]) == (
        2048, 16, 32, 8, 64, 8192, 128256, 500000.0, 1e-5)  # fmt: skip
    assert ll["rope_scaling"] == {"factor": 32.0, "high_freq_factor": 4.0,
                                  "low_freq_factor": 1.0, "rope_type": "llama3",
                                  "original_max_position_embeddings": 8192}  # fmt: skip
    assert "bias" not in " ".join(param_shapes(ll))
    e = config("llama-3.1-8b")
    assert (e["hidden_size"], e["num_hidden_layers"], e["num_attention_heads"],
            e["num_key_value_heads"], e["intermediate_size"], e["vocab_size"], e["rope_theta"],
            e["tie_word_embeddings"]) == (
        4096, 32, 32, 8, 14336, 128256, 500000.0, False)  # fmt: skip


def test_random_state_dict_is_seeded_and_shaped():
    cfg = config("qwen2.5-0.5b", **TINY)
    a, b = random_state_dict(cfg, seed=3), random_state_dict(cfg, seed=3)
    c = random_state_dict(cfg, seed=4, dtype=torch.float32)
    assert a.keys() == b.keys() == c.keys() == param_shapes(cfg).keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"].float(), c["model.embed_tokens.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert c["model.layers.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    untied = random_state_dict(dict(cfg, tie_word_embeddings=False))
    assert untied["lm_head.weight"].shape == (300, 64)


@pytest.mark.parametrize("name", NAMES)
def test_random_weights_give_transformers_logits(name):
    cfg = config(name, **TINY)
    m = random_model(cfg, seed=1, dtype=torch.float32, max_seq_len=32)
    state = random_state_dict(cfg, seed=1, dtype=torch.float32)
    ref = step_transformers.build_transformers(cfg, state, None, "cpu", torch.float32)
    m.bind(1, "cpu")
    ids = [5, 17, 250, 3, 99]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = m.prefill(0, torch.tensor(ids), all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_resolve_names_paths_and_folders(tmp_path):
    name, cfg, folder = step_model.resolve("llama-3.2-1b")
    assert (name, folder, cfg["model_type"]) == ("llama-3.2-1b", None, "llama")
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps(cfg))
    assert step_model.resolve(str(p))[:1] == ("tiny",) and step_model.resolve(str(p))[2] is None
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(SystemExit, match="without config.json"):
        step_model.resolve(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    assert step_model.resolve(str(tmp_path / "ckpt"))[::2] == ("ckpt", tmp_path / "ckpt")
    with pytest.raises(SystemExit, match="qwen2.5-0.5b"):
        step_model.resolve("gpt-17")


def run_bench(tmp_path, *extra: str) -> tuple[dict, str]:
    p = tmp_path / "tiny-qwen.json"
    p.write_text(json.dumps(config("qwen2.5-0.5b", **TINY)))
    bench_step.main(["--device", "cpu", "--model", str(p), "--batches", "1", "2", "--steps",
                     "3", "--max-seq-len", "96", "--hf-tokens", "2", "16", "--hf-reps", "1",
                     "--out", str(tmp_path), *extra])  # fmt: skip
    (path,) = tmp_path.glob("step-model-tiny-qwen-cpu-*.json")
    return json.loads(path.read_text()), path


def test_model_bench_runs_end_to_end_on_the_cpu(tmp_path, capsys, one_thread):
    result, _ = run_bench(tmp_path)
    assert result["scenario"] == "model" and result["device"] == "cpu"
    assert result["transformers_version"] == transformers.__version__
    assert result["model"]["name"] == "tiny-qwen" and result["model"]["dtype"] == "bfloat16"
    assert result["model"]["config"]["hidden_size"] == 64 and result["model"]["params"] > 0
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["replay"]["wall_us"] > 0 and r["eager"]["wall_us"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["replay"]["wall_us"] * 1e6)
        # the cuBLAS route beside it, and the speculative step (every draft accepted)
        cub = r["cublas"]  # from the interleaved steps of both routes
        assert r["invariant_cost"] == pytest.approx(cub["invariant_wall_us"] / cub["wall_us"])
        sp = r["spec"]  # one draft a step, accepted, and the bonus token
        assert sp["k"] == 3 and sp["tokens_per_step"] == 2 * r["batch"]
        assert sp["spec_key_steps"] == sp["steps"] == 3
        assert r["spec"]["vs_plain"] == pytest.approx(r["spec"]["wall_us"]
                                                      / r["replay"]["wall_us"])  # fmt: skip
        sm = sp["masked"]  # the same with a token mask on every row: the same tokens
        assert sm["tokens_per_step"] == sp["tokens_per_step"] and sm["spec_key_steps"] == 3
        assert sm["vs_plain"] == pytest.approx(sm["wall_us"] / r["replay"]["wall_us"])
        for mode in ("default", "eager"):
            hf = r["transformers"][mode]
            assert hf["compiled"] is False  # transformers compiles on CUDA only
            assert hf["max_cache_len"] == 96 and hf["t1_s"] > 0 and hf["t2_s"] > 0
            if "error" in hf:  # one call each: on a loaded CPU t(N2) can come out below t(N1)
                assert hf["error"].startswith("t(N2) <= t(N1)") and hf["t2_s"] <= hf["t1_s"], hf
                continue
            assert hf["tokens_per_s"] > 0
            assert r["vs_transformers"][mode] == pytest.approx(
                r["tokens_per_s"] / hf["tokens_per_s"]
            )
    assert not result["ours"]["capture_failed"] and result["ours"]["replays"]
    assert set(result["met"]["values"]) == set(step_model.TARGETS)
    assert result["met"]["met"]["vs_transformers_b32"] is None  # no B=32 row
    out = capsys.readouterr().out
    head = (
        "| B | replay us | cuBLAS replay us | invariant/cuBLAS | spec K=3 step us | spec/plain "
        "| eager us | host us | idle us on quiet/loaded | idle us off quiet/loaded | graph us "
        "| forward us | floor us | forward/floor | our tok/s | transformers tok/s |"
    )
    assert head in out
    # no CUDA: no device measures, and host_us is the executor's host work
    assert result["read_gb_s"] is None and "| - | - | - | - | - | - |" in out
    for r in result["rows"]:
        assert "graph_us" not in r["replay"] and "floor_us" not in r
        assert r["replay"]["host_us"] == r["replay"]["host_work_us"] > 0
    assert "B=32 tokens/s >= 2x transformers generate (static cache): not measured" in out


def test_model_bench_without_transformers_keeps_our_rows(tmp_path, monkeypatch, one_thread):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    result, _ = run_bench(tmp_path, "--batches", "1", "--hf-modes", "default")
    assert "not importable" in result["transformers"]["error"]
    assert result["transformers_version"] is None
    (row,) = result["rows"]
    assert row["replay"]["wall_us"] > 0 and "transformers" not in row
    assert "| - | - |" in step_model.markdown(result)


def test_targets_are_judged():
    def row(B, speedup, host, cost, spec=None, vs=None):
        r = dict(batch=B, speedup=speedup, replay=dict(wall_us=10.0, host_us=host),
                 eager=dict(wall_us=10.0 * speedup), tokens_per_s=B * 1e5,
                 invariant_cost=cost)  # fmt: skip
        if spec:
            r["spec"] = dict(vs_plain=spec)
        return dict(r, vs_transformers=dict(default=vs)) if vs else r

    res = dict(rows=[row(1, 3.5, 20.0, 1.05, spec=1.2), row(32, 1.0, 30.0, 1.02, 1.6, vs=1.5),
                     row(128, 1.0, 120.0, 1.08)])  # fmt: skip
    j = step_model.judge(res)
    assert j["values"] == dict(invariant_cost=1.08, spec_vs_plain=1.6, replay_speedup_b1=3.5,
                               vs_transformers_b32=1.5, host_us_b128=120.0)  # fmt: skip
    assert j["met"] == dict(invariant_cost=True, spec_vs_plain=False, replay_speedup_b1=True,
                            vs_transformers_b32=False, host_us_b128=False)  # fmt: skip


def test_short_max_seq_len_and_bad_options_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="too short"):
        bench_step.main(["--device", "cpu", "--model", "qwen2.5-0.5b", "--max-seq-len", "64",
                         "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--model", "x", "--hf-modes", "compiled"])
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--model", "x", "--hf-tokens", "5", "5"])
    assert bench_step.parse_args(["--model", "x"]).batches == [1, 8, 32, 128, 256]
    assert bench_step.parse_args([]).batches == [1, 8, 32, 128, 256]
    assert bench_step.parse_args(["--hf-modes", "off"]).hf_modes == []


def test_model_bench_reads_a_checkpoint_folder(tmp_path, one_thread):
    cfg = config("llama-3.2-1b", **TINY)
    ref = step_transformers.build_transformers(cfg, random_state_dict(cfg, seed=2), None, "cpu",
                                               torch.bfloat16)  # fmt: skip
    ref.save_pretrained(tmp_path / "ckpt")
    ckpt = str(tmp_path / "ckpt")
    bench_step.main(["--device", "cpu", "--model", ckpt, "--batches", "1", "--steps", "2",
                     "--max-seq-len", "80", "--hf-modes", "eager", "--hf-tokens", "2", "16",
                     "--hf-reps", "1", "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("step-model-ckpt-cpu-*.json")
    result = json.loads(path.read_text())
    assert result["model"]["source"] == ckpt
    assert result["model"]["config"]["model_type"] == "llama"
    (row,) = result["rows"]
    assert row["tokens_per_s"] > 0 and row["transformers"]["eager"]["tokens_per_s"] > 0
    assert set(row["transformers"]) == {"eager"}


def test_a_failing_batch_keeps_the_others(tmp_path, one_thread):
    def measure(ex, B, make, steps, mode, prompts=None):
        if B == 2:
            raise torch.cuda.OutOfMemoryError("no room")
        return bench_step.measure(ex, B, make, steps, mode, prompts=prompts)

    p = tmp_path / "tiny.json"
    p.write_text(json.dumps(config("qwen2.5-0.5b", **TINY)))
    args = bench_step.parse_args(["--device", "cpu", "--model", str(p), "--batches", "2", "1",
                                  "--steps", "2", "--max-seq-len", "64", "--hf-modes", "eager",
                                  "--hf-tokens", "2", "16", "--hf-reps", "1",
                                  "--out", str(tmp_path)])  # fmt: skip
    _, result = step_model.run(args, measure, bench_step.header("cpu"))
    bad, good = result["rows"]
    assert bad == dict(batch=2, error="OutOfMemoryError: no room", transformers=bad["transformers"])
    assert good["batch"] == 1 and good["tokens_per_s"] > 0 and good["vs_transformers"]["eager"]
    assert "invariant_cost" in good and "invariant_cost" not in bad
    assert "| 2 | error: OutOfMemoryError: no room |" in step_model.markdown(result)
    assert result["met"]["values"]["replay_speedup_b1"] == good["speedup"]


def test_cpu_scenario_compares_both_sides_on_a_checkpoint(tmp_path, one_thread):
    cfg = config("llama-3.2-1b", **TINY)
    ref = step_transformers.build_transformers(cfg, random_state_dict(cfg, seed=2), None, "cpu",
                                               torch.float32)  # fmt: skip
    ref.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(SystemExit, match="--scenario cpu needs --model"):
        bench_step.main(["--scenario", "cpu"])
    bench_step.main(["--scenario", "cpu", "--model", str(tmp_path / "ckpt"), "--threads", "1",
                     "--decode-tokens", "2", "--prefill-len", "8", "--reps", "1",
                     "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("step-cpu-ckpt-*.json")
    result = json.loads(path.read_text())
    g, t = result["median"]["graphexec"], result["median"]["transformers"]
    assert result["threads"] == 1 and result["prefill_len"] == 8
    assert min(g.values()) > 0 and min(t.values()) > 0
    assert result["ratio"]["decode"] == pytest.approx(g["decode_tok_s"] / t["decode_tok_s"])
    assert result["ratio"]["prefill"] == pytest.approx(t["prefill_s"] / g["prefill_s"])


def test_profile_names_every_kernel_by_its_op_and_layer(one_thread):
    """The profile scenario's bookkeeping on the CPU (its timing needs CUDA): one forward
    through the recording ops lists each layer's ops in order with their layers and
    bytes, and kernels named as the CUDA route names them are matched to those ops, the
    unknown ones being glue."""
    import step_profile

    cfg = config("llama-3.2-1b", **TINY)
    model, _ = step_model.load(cfg, None, "cpu", torch.float32, 64)
    model.bind(3, "cpu")
    calls: list = []
    ops = model.ops
    model.ops = step_profile.recording_ops(model, calls)
    B = 2
    model._forward(torch.tensor([5, 7]), torch.tensor([3, 9]), torch.arange(B))
    model.ops = ops
    step_profile.assign_layers(calls)
    # rotary in the q/k/v GEMM (its epilogue on the CUDA route)
    layer_ops = ["norm", "qkv", "attention", "o", "norm", "gate_up", "down"]
    assert [c.op for c in calls] == layer_ops * 2 + ["norm", "lm_head"]
    assert [c.layer for c in calls] == [0] * 7 + [1] * 7 + [None, None]
    D, inter, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    assert calls[5].bytes == (2 * inter * D + B * D + B * inter) * 4  # gate_up: w, x, out
    assert calls[-1].bytes == (V * D + B * D + B * V) * 4
    kv = model.kv_cache.shape
    assert calls[2].bytes == ((3 + 1) + (9 + 1)) * 2 * kv[-2] * kv[-1] * 4 + 2 * (
        B * model.heads * model.head_dim * 4
    )  # keys and values of live positions, q, out
    names = {"norm": "_residual_rms_norm_kernel", "qkv": "_linear_kernel",
             "o": "_linear_kernel", "gate_up": "_linear_kernel", "down": "_linear_kernel",
             "lm_head": "_linear_kernel"}  # fmt: skip
    kernels = ["indexSelectSmallIndex"]
    for c in calls:
        kernels += ["_decode_attention_kernel"] if c.op == "attention" else [names[c.op]]
    kernels.append("elementwise_kernel")
    labels = step_profile.label(kernels, calls)
    assert labels[0] == ("other", None, 0) and labels[-1] == ("other", None, 0)
    assert [(op, layer) for op, layer, b in labels[1:-1] if b] == [(c.op, c.layer) for c in calls]
    assert labels[3] == ("attention", 0, calls[2].bytes)


def test_profile_table_gives_each_ops_own_time() -> None:
    """With dependent launches kernel spans overlap: the table gives each op's own time
    (what it adds to the replay) and its share of the step beside the span sum."""
    import step_profile

    row = dict(batch=1, step_us=100.0, kernels_sum_us=130.0, gap_us=-30.0, floor_us=50.0,
               floor_bytes=1e9, step_over_floor=2.0, kernels_per_layer=7.0,
               by_op={"o": dict(kernels=2, us=60.0, own_us=30.0, bytes=2e8, gb_s=3333.0),
                      "norm": dict(kernels=3, us=70.0, own_us=5.0, bytes=0, gb_s=None)})
    table = step_profile.markdown(dict(model="m", route="invariant", read_gb_s=3800.0,
                                       rows=[row])).splitlines()  # fmt: skip
    assert "| norm | 3 | 70 | 5 | 5% | 0.000 | - |" in table
    assert "| o | 2 | 60 | 30 | 30% | 0.200 | 3333 |" in table
    assert "prefetch_k" not in table[0]
    swept = step_profile.markdown(dict(model="m", route="invariant", read_gb_s=3800.0,
                                       rows=[dict(row, prefetch_k=2048)])).splitlines()
    assert swept[0].startswith("m (invariant, prefetch_k 2048), B = 1: step 100 us")


def test_measure_waits_until_every_request_decodes() -> None:
    """B prompts longer than a few steps' prefill budget: the timed steps start only once
    all B requests decode (it asserted len(outs) == B after 3 warm steps, and failed at
    B = 128 with bench_tp_step's prompts)."""
    import graphexec as gx

    ex = gx.DecodeExecutor(gx.models.TableModel(512, seed=0), max_batch_size=24, device="cpu",
                           prefill_budget=64)  # fmt: skip
    prompts = [[1 + (i + j) % 500 for j in range(40)] for i in range(24)]  # 15 budgets' worth
    r = bench_step.measure(ex, 24, lambda i: gx.SamplingParams(temperature=0.0, seed=i), 2,
                           "eager", prompts)  # fmt: skip
    assert r["wall_us"] > 0 and ex.idle


def test_spec_scenario_prints_the_speculative_step_alone(tmp_path, capsys, one_thread):
    """--scenario spec: the model scenario's speculative rows alone (every draft accepted),
    printed, nothing written."""
    p = tmp_path / "tiny-qwen.json"
    p.write_text(json.dumps(config("qwen2.5-0.5b", **TINY)))
    with pytest.raises(SystemExit, match="--model"):
        bench_step.main(["--scenario", "spec", "--device", "cpu"])
    bench_step.main(["--scenario", "spec", "--device", "cpu", "--model", str(p), "--batches",
                     "1", "2", "64", "--steps", "3", "--max-seq-len", "96", "--out",
                     str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    assert "tiny-qwen: the speculative step (K = 3, n-gram) at B = [1, 2]" in out
    assert "spec   B=   1 K=3" in out and "spec   B=   2 K=3" in out and "B=  64" not in out
    assert [x.name for x in tmp_path.iterdir()] == ["tiny-qwen.json"]  # nothing written
