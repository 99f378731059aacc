"""benchmarks/sampler_routes.py: the routes read back from one call (CPU, interpreter)."""

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import sampler_routes  # noqa: E402
import torch  # noqa: E402

import graphexec as gx  # noqa: E402
from graphexec.sampling.triton.sampler_config import R_DONE, SamplerConfig, Workspace  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_round_1_holds_exactly_the_rows_whose_candidate_was_out() -> None:
    """With the short route off, a top-p row whose candidate the filter rejects takes the
    selection (round 1's list) and one whose candidate is kept ends before it; the tokens
    are the reference's."""
    B, V = 8, 2048
    logits = sampler_routes.make_logits("flat", B, V, torch.float32, torch.device("cpu"))
    params = [gx.SamplingParams(seed=1000 + b, temperature=0.8, top_p=0.5) for b in range(B)]
    pos = torch.arange(B) + 7
    cfg = SamplerConfig.interpreter().replace(short_blocks=0)
    c = sampler_routes.census(logits, params, pos, cfg)
    out = [b for b in range(B) if not c.candidate_kept[b]]
    assert 0 < len(out) < B  # both kinds of row, so the list could be wrong either way
    assert c.round1 == out and c.round2 == []
    assert all(c.route[b] == int(R_DONE) for b in range(B) if c.candidate_kept[b])
    ref = gx.sample_logits(logits, params, pos, backend="torch")
    assert torch.equal(c.tokens, ref.token_ids)
    assert "round 1: " + ", ".join(f"{b} ({c.blocks[b]} blocks)" for b in out) in c.summary()


def test_the_command_line_prints_one_line(capsys) -> None:
    knobs = "programs=4,check_programs=4,late_programs=4"
    c = sampler_routes.main(["--shape", "peaked", "--batch", "2", "--vocab", "1024",
                             "--method", "min_p", "--device", "cpu", "--sampler-config", knobs])
    line = capsys.readouterr().out.strip()
    assert line.startswith("min_p peaked V=1024 B=2: 2 rows") and "round 1: " in line
    assert len(c.route) == 2


def test_a_variant_without_the_selection_lists_no_rows(monkeypatch) -> None:
    """top_k_top_p's launch never writes the row lists: a workspace whose memory held old
    lists still reads back none."""
    allocate = Workspace.allocate

    def stale(*args, **kw):
        ws = allocate(*args, **kw)
        ws.listed.fill_(1)  # one row listed: row 1
        ws.refine.fill_(1)
        return ws

    monkeypatch.setattr(Workspace, "allocate", stale)
    B, V = 2, 1024
    logits = sampler_routes.make_logits("peaked", B, V, torch.float32, torch.device("cpu"))
    params = [gx.SamplingParams(seed=b, temperature=0.8, top_k=50, top_p=0.9) for b in range(B)]
    c = sampler_routes.census(logits, params, torch.arange(B), SamplerConfig.interpreter())
    assert c.round1 == [] and c.round2 == []
