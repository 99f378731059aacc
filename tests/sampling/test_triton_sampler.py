"""The Triton sampler end to end (CPU interpreter) against the torch reference, token for
token, under both presets: every route, dtype, variant, slot layout and split."""

from __future__ import annotations

from tests.interpreter import ensure_interpreter

ensure_interpreter()

import pytest  # noqa: E402
import torch  # noqa: E402

from graphexec.params import SamplerVariant  # noqa: E402
from graphexec.sampling import reference  # noqa: E402
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import launch  # noqa: E402
from graphexec.sampling.triton.sampler_config import (  # noqa: E402
    R_CUT,
    R_DONE,
    R_SELECT,
    SamplerConfig,
    Workspace,
)  # fmt: skip
from tests.sampling.triton_cases import (  # noqa: E402
    CONFIGS,
    P,
    assert_same,
    extras,
    logits_of,
    mixed,
    run_both,
)  # fmt: skip

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("name", ["interp16", "gpu_preset", "interp16_short"])
def test_mixed_batch_equals_reference(name: str) -> None:
    # rows of 750 ids take the same routes as of 1500 (half the interpreter's time); the
    # short route serves every row of 750, so its config keeps 1500 (two rows left to others)
    # 10 rows (each kind of `mixed` once, with the NaN, +inf, -inf and tied rows) take the
    # routes their first 10 of 20 took; the short config keeps 20, as its rows 15 and 16
    # are the two it leaves to the cut and the selection
    short = CONFIGS[name].short_blocks > 0
    B, V = (20, 1500) if short else (10, 750)
    logits = logits_of("mixed", B, V, seed=1)
    counts, prompt, bitmask = extras(B, V, seed=1)
    both = run_both(mixed(B, V=V), logits, CONFIGS[name], counts=counts, prompt=prompt,
                    bitmask=bitmask, num_top=3)  # fmt: skip
    assert not both.ref.valid[6] and both.ref.token_ids[6] == -1
    assert 10 <= both.ref.token_ids[3] < 13
    assert_same(both.ref, both.tri)
    if CONFIGS[name].short_blocks == 0:  # else the short route may serve every row
        assert {int(R_DONE), int(R_CUT), int(R_SELECT)} <= set(both.routes)


@pytest.mark.parametrize("shape", ["randn3", "peaked", "flat", "ties"])
def test_every_shape_on_the_gpu_preset(shape: str) -> None:
    B, V = 8, 2048  # was 4096: 16 blocks of 128, two tiles a row; select and done rows
    params = [P(seed=i, temperature=0.8, **f) for i, f in enumerate(
        [dict(), dict(top_k=50), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=50, top_p=0.9),
         dict(top_p=0.9, min_p=0.05), dict(top_k=1000, top_p=0.95), dict(top_k=7)])]  # fmt: skip
    both = run_both(params, logits_of(shape, B, V, seed=2), CONFIGS["gpu_short"])
    assert_same(both.ref, both.tri)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    B, V = 10, 700
    logits = logits_of("mixed", B, V, seed=3).to(dtype)
    counts, prompt, bitmask = extras(B, V, seed=3)
    both = run_both(mixed(B, 1, V=V), logits, CONFIGS["interp16"], counts=counts, prompt=prompt,
                    bitmask=bitmask)  # fmt: skip
    assert_same(both.ref, both.tri)


@pytest.mark.parametrize("variant", [SamplerVariant.NO_FILTER, SamplerVariant.TOP_K_TOP_P])
def test_variants_give_the_default_token(variant: SamplerVariant) -> None:
    V = 600
    params = [p for p in mixed(30, 2, V=V) if variant.serves(p)][:8]
    logits = logits_of("mixed", len(params), V, seed=4)
    cfg = CONFIGS["interp16"]
    fast = run_both(params, logits, cfg, variant=variant)
    dflt = run_both(params, logits, cfg)
    assert torch.equal(fast.tri.token_ids, dflt.tri.token_ids)
    assert_same(fast.ref, fast.tri)


def test_slots_of_a_larger_table() -> None:
    """Rows read their parameters through slot ids: tokens follow the slot, not the row."""
    B, V = 6, 500
    logits = logits_of("randn3", B, V, seed=5)
    params = mixed(10, 3, V=V)
    slots = torch.tensor([9, 2, 5, 0, 7, 3])
    both = run_both(params, logits, CONFIGS["interp16"], slots=slots, positions=torch.arange(B))
    assert_same(both.ref, both.tri)
    alone = run_both([params[9]], logits[:1], CONFIGS["interp16"], positions=torch.zeros(1))
    assert alone.tri.token_ids[0] == both.tri.token_ids[0]


def test_batch_position_and_split_change_no_token() -> None:
    """A permuted batch, and a split of each row over 1 or many programs, draw the same
    tokens (the programs of a row hand the row to its last one, whichever it is)."""
    B, V = 8, 3000
    logits = logits_of("mixed", B, V, seed=6)
    params = mixed(B, 4, V=V)
    pos = torch.arange(B)
    outs = []
    for programs in (1, 64):
        cfg = SamplerConfig.interpreter().replace(programs=programs)
        outs.append(run_both(params, logits, cfg, positions=pos).tri.token_ids)
    assert torch.equal(outs[0], outs[1])
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    shuf = run_both([params[i] for i in perm], logits[perm], SamplerConfig.interpreter(),
                    positions=pos[perm])  # fmt: skip
    assert torch.equal(shuf.tri.token_ids, outs[0][perm])


def test_rows_with_bad_data() -> None:
    """+inf in several blocks, NaN, masked blocks, nothing or one token samplable, in every
    route: equal to the reference; an +inf row draws among its +inf tokens only."""
    B, V = 8, 400
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(B, V, generator=g) * 3
    logits[0, [3, 40, 41, 199]] = float("inf")
    logits[1, 100] = float("inf")
    logits[2, ::3] = float("nan")
    logits[3, 16:48] = float("-inf")
    logits[4, :] = float("-inf")
    logits[5, :] = float("-inf")
    logits[5, 150] = 2.0
    logits[6, [3, 40, 41, 199]] = float("inf")
    logits[7, :] = float("nan")
    params = [P(seed=40 + i, temperature=0.5 + 0.1 * i, **f) for i, f in enumerate(
        [dict(), dict(top_k=3), dict(top_p=0.7), dict(min_p=0.1), dict(top_k=5), dict(top_p=0.5),
         dict(top_p=0.6, top_k=2), dict()])]  # fmt: skip
    both = run_both(params, logits, CONFIGS["interp16"])
    assert both.ref.token_ids[0].item() in (3, 40, 41, 199) and both.ref.token_ids[1] == 100
    assert not both.ref.valid[4] and both.ref.token_ids[5] == 150 and not both.ref.valid[7]
    assert_same(both.ref, both.tri)


def test_raw_logprobs_writer_alone_serves_raw_rows(monkeypatch) -> None:
    """With the general logprobs kernel off, the writer that works from the stats pass's
    raw block stats gives raw-mode rows the reference's logprobs, ranks and top-N."""
    B, V = 8, 500
    logits = logits_of("randn3", B, V, seed=11)
    logits[1, 17] = float("nan")
    logits[2, 40:80] = float("-inf")
    logits[3, [5, 50, 150]] = logits[3].max()  # a tied max: ties to the lower id
    params = [P(seed=i, logprobs=4, temperature=0.6 + 0.1 * i, top_k=(0, 5)[i % 2])
              for i in range(B)]  # fmt: skip
    params[4] = P(seed=4, logprobs=None)  # a row that did not ask is written too
    monkeypatch.setattr(launch, "write_logprobs", lambda *a, **k: None)
    both = run_both(params, logits, CONFIGS["interp16"], num_top=4)
    assert_same(both.ref, both.tri)


def test_rows_past_the_logprobs_cap_go_to_the_general_writer(monkeypatch) -> None:
    B, V = 8, 500
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(B, V, generator=g) * torch.linspace(0.2, 4.0, B)[:, None]
    params = [P(seed=i, logprobs=4, top_k=(0, 7)[i % 2]) for i in range(B)]
    done = []
    real = launch.write_logprobs

    def spy(*a, **k):
        done.append(k["done"].clone())
        return real(*a, **k)

    monkeypatch.setattr(launch, "write_logprobs", spy)
    both = run_both(params, logits, CONFIGS["interp16"].replace(logprobs_cap=4), num_top=4)
    assert_same(both.ref, both.tri)
    assert len(done) == 1 and 0 < int(done[0].sum()) < B  # both writers served rows


def test_workspace_is_reused_and_checked() -> None:
    """A persistent workspace serves calls of fewer rows (its counters reset by each pass's
    last program); one of another vocabulary or config is refused, naming it."""
    B, V = 6, 400
    cfg = CONFIGS["interp16"]
    ws = Workspace.allocate(8, V, "cpu", cfg)
    params = mixed(B, 5, V=V)
    table = SamplingTensors.from_params(params, V, "cpu")
    logits = logits_of("mixed", B, V, seed=13)
    first = SamplerOutput.allocate(B, "cpu", None)
    again = SamplerOutput.allocate(B, "cpu", None)
    for out in (first, again):
        launch.sample(logits, torch.arange(B), torch.arange(B), table, out, config=cfg,
                      workspace=ws)  # fmt: skip
    assert torch.equal(first.token_ids, again.token_ids) and not ws.arrive.any()
    with pytest.raises(ValueError, match="workspace"):
        launch.sample(logits, torch.arange(B), torch.arange(B), table, first, workspace=ws,
                      config=cfg.replace(bins=64))  # fmt: skip
    ref = SamplerOutput.allocate(B, "cpu", None)
    reference.sample(logits, torch.arange(B), torch.arange(B), table, ref, draw_block=16)
    assert_same(ref, first)


def test_tied_rows_get_their_top_n_from_the_raw_writer(monkeypatch) -> None:
    """Rows whose max is held by N blocks or more (all ties) take their top-N from the
    first N such blocks: served without the general writer, as the reference."""
    B, V = 3, 600
    logits = torch.full((B, V), 0.5)
    logits[1, ::7] = float("-inf")
    logits[2, 100:] = -1.0  # the max held by the first blocks only
    params = [P(seed=i, logprobs=5, top_k=(0, 9)[i % 2]) for i in range(B)]
    monkeypatch.setattr(launch, "write_logprobs", lambda *a, **k: None)
    both = run_both(params, logits, CONFIGS["interp16"], num_top=5)
    assert_same(both.ref, both.tri)
