"""benchmarks/sampler_phases.py: the phase arithmetic on synthetic clocks (CPU), and on a
GPU the clocked tail kernels give the unclocked ones' tokens, every row stamped."""

import pytest
import sampler_phases  # noqa: E402
import torch


def test_phases_are_the_gaps_between_stamps_in_timer_units() -> None:
    # row 0: 2 ns a cycle (2,000 ns over 1,000 cycles); row 1: 1 ns a cycle, skips stamps 2-8
    # (a ties row), so its draw-less time counts in `end`; row 2 has no clocks at all
    c = torch.zeros(3, 16, dtype=torch.int64)
    c[0, :10] = torch.tensor([100, 200, 250, 300, 400, 500, 500, 900, 1000, 1100])
    c[0, 14:] = torch.tensor([5000, 7000])
    c[1, [0, 1, 9]] = torch.tensor([10, 60, 110])
    c[1, 14:] = torch.tensor([0, 100])
    phases, totals = sampler_phases.phase_us(c)
    assert totals == [2.0, 0.1]
    assert phases[0] == pytest.approx([0.2, 0.1, 0.1, 0.2, 0.2, 0.0, 0.8, 0.2, 0.2])
    assert phases[1] == pytest.approx([0.05, 0, 0, 0, 0, 0, 0, 0, 0.05])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["top_k_top_p", "default"])
def test_clocked_tail_kernels_give_the_same_tokens(variant) -> None:
    from graphexec.params import SamplerVariant, SamplingParams
    from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import SamplerConfig, Workspace

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    B, V = 64, 128256
    g = torch.Generator("cuda").manual_seed(3)
    logits = torch.randn(B, V, device="cuda", generator=g) * 3
    params = [SamplingParams(temperature=0.8, top_k=[50, 0, 300][i % 3], top_p=0.9, seed=i)
              for i in range(B)]  # fmt: skip
    table = SamplingTensors.from_params(params, V, "cuda")
    pos = torch.arange(B, device="cuda")
    outs = []
    for clocked in (False, True):
        cfg = SamplerConfig.gpu().replace(phase_clock=clocked)
        ws = Workspace.allocate(B, V, "cuda", cfg)
        out = SamplerOutput.allocate(B, "cuda", None)
        launch.sample(logits, pos, pos, table, out, None, SamplerVariant(variant), config=cfg,
                      workspace=ws)  # fmt: skip
        outs.append(out.token_ids.clone())
    assert torch.equal(outs[0], outs[1])
    clock = ws.clock.cpu()
    assert (clock[:, 0] > 0).all() and (clock[:, 9] > clock[:, 0]).all()
    assert (clock[:, 15] >= clock[:, 14]).all()
