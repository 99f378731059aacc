"""CPU tests of the verification benchmark: the torch rejection sampler of
verify_methods.py (greedy and one-hot targets, exactness on a tiny vocabulary), the
parameter tables, a tiny CPU run of bench_verify.py and plot_verify's summary."""

import glob
import json

import bench_verify  # noqa: E402
import plot_verify  # noqa: E402
import pytest
import torch
import verify_methods as vm  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: torch's intra-op threads only cost time (a lot on a loaded machine)."""


def test_tables_choose_their_variant_and_flatten_per_offset():
    import graphexec as gx

    for table in vm.TABLES:
        params = [gx.SamplingParams(seed=b, **p) for b, p in enumerate(vm.row_params(table, 7))]
        assert gx.choose_variant(params).value == table
    mixed = vm.row_params("top_k_top_p", 4)
    assert [p["temperature"] for p in mixed] == [0.7, 0.8, 0.9, 1.0]
    assert mixed[0] == dict(temperature=0.7, top_k=50, top_p=0.9)
    assert mixed[1] == dict(temperature=0.8, top_k=200, top_p=0.9)
    assert mixed[2] == dict(temperature=0.9, top_k=50)
    t = vm.flat_tensors(mixed, 3, 1000, "cpu")  # T = 3 offsets per row, off = V / 1.0
    assert t["top_k"].tolist() == [50] * 3 + [200] * 3 + [50] * 6
    assert t["top_p"].tolist() == pytest.approx([0.9] * 6 + [1.0] * 3 + [0.9] * 3)
    assert t["temperature"].tolist() == pytest.approx([0.7] * 3 + [0.8] * 3 + [0.9] * 3 + [1.0] * 3)
    assert all("top_k" not in p and "top_p" not in p for p in vm.row_params("no_filter", 5))
    with pytest.raises(ValueError, match="table"):
        vm.row_params("min_p", 1)


def _onehot_logits(B, T, V, target):
    x = torch.full((B, T, V), -30.0)
    return x.scatter_(2, target.unsqueeze(2), 30.0)


def test_onehot_target_accepts_exactly_the_matching_drafts():
    torch.manual_seed(0)
    B, K, V = 6, 4, 50
    target = torch.randint(0, V, (B, K + 1))
    drafts = target[:, :K].clone()
    first_miss = torch.tensor([0, 1, 2, 3, 4, 4])  # row 5: all match, row 4 too (K = 4)
    for b in range(B):
        if first_miss[b] < K and b != 5:
            drafts[b, first_miss[b]] = (target[b, first_miss[b]] + 1) % V
    first_miss[5] = K
    t = torch.full((B * (K + 1),), 0.8)
    for k, p in ((None, None), (torch.full_like(t, 5).int(), torch.full_like(t, 0.9))):
        tok, n_acc = vm.rejection_sample(_onehot_logits(B, K + 1, V, target), drafts, t, k, p)
        assert n_acc.tolist() == first_miss.tolist()
        for b in range(B):
            n = int(n_acc[b])
            # accepted drafts, then the target's token (recovered or bonus), then -1
            assert tok[b, :n].tolist() == drafts[b, :n].tolist()
            assert int(tok[b, n]) == int(target[b, n])
            assert (tok[b, n + 1 :] == -1).all()


def test_greedy_rows_accept_drafts_equal_to_the_argmax():
    torch.manual_seed(1)
    B, K, V = 4, 3, 40
    logits = torch.randn(B, K + 1, V)
    top = logits.argmax(dim=-1)
    drafts = top[:, :K].clone()
    drafts[1, 1] = (top[1, 1] + 3) % V
    drafts[2, 0] = -1  # no drafts: the argmax at offset 0
    drafts[2, 1:] = -1
    t = torch.zeros(B * (K + 1))
    tok, n_acc = vm.rejection_sample(logits, drafts, t, greedy=True)
    assert n_acc.tolist() == [3, 1, 0, 3]
    assert tok[0].tolist() == top[0].tolist() and tok[3].tolist() == top[3].tolist()
    assert tok[1].tolist() == [int(top[1, 0]), int(top[1, 1]), -1, -1]
    assert tok[2].tolist() == [int(top[2, 0]), -1, -1, -1]


def test_rejection_sampler_emits_the_target_distribution():
    """K = 1, V = 4, a draft drawn from q: the first emitted token is distributed as p,
    and the draft is accepted with probability sum(min(p, q))."""
    torch.manual_seed(2)
    n, V = 200_000, 4
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = p.log().expand(n, 2, V).contiguous()
    drafts = torch.multinomial(q, n, replacement=True).unsqueeze(1)
    tok, n_acc = vm.rejection_sample(logits, drafts, torch.ones(2 * n),
                                     draft_probs=q.expand(n, 1, V))  # fmt: skip
    freq = torch.bincount(tok[:, 0], minlength=V).float() / n
    assert torch.allclose(freq, p, atol=0.005)
    assert float(n_acc.float().mean()) == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.005)
    # top-k 2 of p: the emitted tokens are distributed as renormalised {0.3, 0.4}
    k = torch.full((2 * n,), 2, dtype=torch.int32)
    tok, _ = vm.rejection_sample(logits, drafts, torch.ones(2 * n), k, None,
                                 draft_probs=q.expand(n, 1, V))  # fmt: skip
    freq = torch.bincount(tok[:, 0], minlength=V).float() / n
    assert torch.allclose(freq, torch.tensor([0, 0, 3 / 7, 4 / 7]), atol=0.005)


def test_select_methods():
    assert vm.select_methods(None) == vm.DEFAULT_METHODS
    assert "graphexec.verify_rejection" not in vm.DEFAULT_METHODS
    assert vm.select_methods("flashinfer") == ["flashinfer.chain", "flashinfer.chain+onehot"]
    assert vm.select_methods("graphexec.verify_rejection") == ["graphexec.verify_rejection"]
    with pytest.raises(SystemExit):
        vm.select_methods("nope")


def test_cpu_run_writes_rows_and_summary(tmp_path, capsys):
    args = ["--device", "cpu", "--batch", "1,3", "--k", "2", "--vocab", "300", "--shapes",
            "randn3", "--methods", "torch,graphexec,flashinfer.chain", "--reps", "2", "--out",
            str(tmp_path), "--no-png"]  # fmt: skip
    assert bench_verify.main(args) == 0
    (path,) = glob.glob(str(tmp_path / "verify-cpu-*.json"))
    with open(path) as f:
        result = json.load(f)
    assert result["device"] == "cpu" and result["metric"] == "eager_us"
    assert {"torch", "triton", "flashinfer", "date"} <= set(result)
    rows = {bench_verify.row_key(r): r for r in result["rows"]}
    methods = ["graphexec.verify_strict", "graphexec.sample_step", "flashinfer.chain",
               "torch.rejection"]  # fmt: skip
    assert set(rows) == {(m, v, B, 2, 300, "randn3") for m in methods for v in vm.TABLES
                         for B in (1, 3)}  # fmt: skip
    for (m, _, B, K, V, _), r in rows.items():
        assert r["floor_us"] == pytest.approx(B * (K + 1) * V * 4 / 1e6 / result["bandwidth_TBps"],
                                              rel=1e-2, abs=2e-3)  # fmt: skip
        if m.startswith("flashinfer"):
            assert r["us"] is None and "CUDA" in r["error"]
            continue
        assert "error" not in r and "warning" not in r and r["us"] > 0
        if m == "graphexec.sample_step":
            assert r["emitted"] is None
        else:
            assert 1 <= r["emitted"] <= K + 1
    out = capsys.readouterr().out
    assert "strict/sample" in out and "verify_strict <= 1.3x sample_step" in out
    assert out.strip().splitlines()[-1].startswith("wrote ")


def _row(method, us, shape="peaked", B=128):
    return dict(method=method, variant="no_filter", B=B, K=3, V=128256, shape=shape, us=us,
                floor_us=10.0, emitted=2.0)  # fmt: skip


def test_summary_judges_ratios_shape_by_shape():
    rows = [_row("graphexec.verify_strict", 14.0), _row("graphexec.sample_step", 10.0),
            _row("flashinfer.chain", 42.0), _row("graphexec.verify_strict", 20.0, "flat"),
            _row("graphexec.sample_step", 12.5, "flat"), _row("flashinfer.chain", 30.0, "flat"),
            _row("torch.rejection", None, "flat") | {"error": "boom"}]  # fmt: skip
    res = dict(device="Test GPU", date="2026-01-01", rows=rows)
    head, table = plot_verify.summary_cells(res)
    cells = dict(zip(head, table[0], strict=True))
    assert cells["gx.strict"] == "20.0" and cells["fi.chain"] == "42.0"  # worst shapes
    assert cells["torch.rej"] == "error"
    assert cells["strict/sample"] == "1.60 flat over"  # 1.6 on flat, 1.4 on peaked
    assert cells["FI/gx"] == "1.50 flat"  # 1.5 on flat, 3.0 on peaked
    text = plot_verify.summary_table(res)
    assert "met at 0 of 1 points; worst 1.60x at no_filter V=128256 B=128 K=3 flat" in text
    assert "error torch.rejection: boom" in text
    md = plot_verify.summary_table(res, markdown=True)
    assert "| variant | V | B | K | floor |" in md


def test_resume_skips_complete_blocks_and_append_keeps_rows(tmp_path, capsys):
    base = ["--device", "cpu", "--k", "1", "--vocab", "200", "--shapes", "ties", "--methods",
            "torch", "--reps", "1", "--out", str(tmp_path), "--no-png"]  # fmt: skip
    assert bench_verify.main([*base, "--batch", "1"]) == 0
    (path,) = glob.glob(str(tmp_path / "verify-cpu-*.json"))
    assert bench_verify.main([*base, "--batch", "1,2", "--resume"]) == 0
    with open(path) as f:
        result = json.load(f)
    assert sorted({r["B"] for r in result["rows"]}) == [1, 2] and len(result["runs"]) == 2
    assert "--resume: 1 (V, B, K) blocks already in the file" in capsys.readouterr().out
