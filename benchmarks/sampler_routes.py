"""Which route each row of one sampler call took: the call run on a persistent workspace,
then read back. A batch waits for its slowest row at every launch of the default variant's
chain, so one row on round 1's list (the selection: select, kept and finish) costs the
whole batch those three launches' work; this says which rows those are and why (the
blocks their plan lists, whether their candidate was kept).

    python benchmarks/sampler_routes.py [--shape real] [--batch 128] [--vocab 128256]
        [--method top_p] [--device cuda] [--sampler-config K=V,...]

The rows are bench_sampler's (`sampler_shapes.py`): its logits shapes, T 0.8 and the
method's filter (top_p: top-p 0.9; min_p: min-p 0.05; top_k_top_p: top-k 50, top-p 0.9),
seeds 1000 + b, positions b + 7, the variant `choose_variant` picks. On a CPU the kernels
run under TRITON_INTERPRET=1 (set here) with the GPU preset unless --sampler-config says
otherwise: minutes at a real vocabulary. No timing: `bench_sampler.py` times the call.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_shapes import MIN_P, REAL_V, TEMPERATURE, TOP_K, TOP_P, make_logits  # noqa: E402

FILTERS = {"top_p": dict(top_p=TOP_P), "min_p": dict(min_p=MIN_P),
           "top_k_top_p": dict(top_k=TOP_K, top_p=TOP_P)}  # fmt: skip


@dataclass(frozen=True)
class Census:
    """One call's rows: `route` the last route each row took (`sampler_config.R_*`),
    `candidate_kept` whether its candidate (the unfiltered draw) was the token, `blocks` the
    blocks its plan listed, `round1` / `round2` the rows on those lists, `tokens` the
    call's tokens."""

    route: list[int]
    candidate_kept: list[bool]
    blocks: list[int]
    round1: list[int]
    round2: list[int]
    tokens: torch.Tensor

    def summary(self) -> str:
        from graphexec.sampling.triton.sampler_config import R_EXACT

        def rows(lst: list[int]) -> str:
            return ", ".join(f"{r} ({self.blocks[r]} blocks)" for r in lst) or "none"

        exact = [r for r, route in enumerate(self.route) if route == int(R_EXACT)]
        return (f"{len(self.route)} rows, candidate kept in {sum(self.candidate_kept)}; "
                f"round 1: {rows(self.round1)}; round 2: {rows(self.round2)}; "
                f"exact search: {exact or 'none'}")  # fmt: skip


def census(logits: torch.Tensor, params, positions: torch.Tensor, config=None) -> Census:
    """Run one sampler call (the variant `choose_variant` picks) and read its routes back."""
    import graphexec as gx
    from graphexec.sampling.tensors import SamplerOutput, SamplingTensors
    from graphexec.sampling.triton import launch
    from graphexec.sampling.triton.sampler_config import (
        I_CAND,
        I_NLIST,
        I_ROUTE,
        SamplerConfig,
        Workspace,
    )

    B, V = logits.shape
    cfg = config or SamplerConfig.default()
    table = SamplingTensors.from_params(params, V, logits.device)
    out = SamplerOutput.allocate(B, logits.device, None)
    ws = Workspace.allocate(B, V, logits.device, cfg)
    # the default variant's tail empties both lists at each call; the others never touch them
    ws.listed.zero_()
    ws.refine.zero_()
    launch.sample(logits, torch.arange(B, device=logits.device), positions, table, out, None,
                  gx.choose_variant(params), config=cfg, workspace=ws)  # fmt: skip
    ri = ws.rowi.cpu()
    listed, refine = ws.listed.cpu(), ws.refine.cpu()
    return Census(route=ri[:, int(I_ROUTE)].tolist(),
                  candidate_kept=[int(c) >= 0 and int(c) == int(t) for c, t in
                                  zip(ri[:, int(I_CAND)], out.token_ids.cpu(), strict=True)],
                  blocks=ri[:, int(I_NLIST)].tolist(),
                  round1=listed[1 : 1 + int(listed[0])].tolist(),
                  round2=refine[1 : 1 + int(refine[0])].tolist(),
                  tokens=out.token_ids.cpu())  # fmt: skip


def main(argv: list[str] | None = None) -> Census:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="real", help="a sampler_shapes shape (default real)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128256, help="(the real rows: 49152 always)")
    ap.add_argument("--method", default="top_p", choices=sorted(FILTERS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sampler-config", default="", metavar="K=V,...",
                    help="integer SamplerConfig fields instead of the GPU preset's")  # fmt: skip
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is imported)
    import graphexec as gx
    from graphexec.sampling.triton.sampler_config import SamplerConfig

    knobs = {k: int(v) for k, v in (kv.split("=") for kv in args.sampler_config.split(",") if kv)}
    V = REAL_V if args.shape == "real" else args.vocab
    device = torch.device(args.device)
    B = args.batch
    logits = make_logits(args.shape, B, V, torch.float32, device)
    params = [gx.SamplingParams(seed=1000 + b, temperature=TEMPERATURE, **FILTERS[args.method])
              for b in range(B)]  # fmt: skip
    result = census(logits, params, torch.arange(B, device=device) + 7,
                    SamplerConfig.gpu().replace(**knobs))  # fmt: skip
    print(f"{args.method} {args.shape} V={V} B={B}: {result.summary()}")
    return result


if __name__ == "__main__":
    main()
