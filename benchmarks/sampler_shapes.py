"""The sampler benchmark's cases: the per-row parameters every method takes and the logits
shapes it is timed on (`bench_sampler.py --shapes`, `--sweep`, `--real`).

SHAPES are synthetic and run at any V; SWEEP (`--sweep`) adds randn * s at temperature t;
REAL is rows of a real model's logits (SmolLM2-135M-Instruct, `data/smollm2-logits.pt`,
written by `real_logits.py`), so it runs at that model's vocabulary only (REAL_V).
make_logits(shape, B, V, dtype, device, seed) builds any of them.
"""

from __future__ import annotations

import functools
import os

import torch

TEMPERATURE, TOP_K, TOP_P, MIN_P, NUM_LOGPROBS = 0.8, 50, 0.9, 0.05, 20

SHAPES = {
    "peaked": "logit_i = -2 ln(rank_i), ranks permuted per row (Zipf-like, as a real model's)",
    "randn3": "randn * 3",
    "flat": "randn * 0.25: top-p 0.9 and min-p 0.05 keep more than half of the vocabulary",
    "ties": "every logit equal",
}

# --sweep: randn * s at temperature t, for every (s, t); rows of these shapes also mix
# their top-p (SWEEP_TOP_P, cycled over the rows) in every method that takes one
SWEEP_SCALES = (0.3, 1.0, 3.0, 10.0)
SWEEP_TEMPERATURES = (0.5, 1.0, 1.5)
SWEEP_TOP_P = (0.5, 0.8, 0.9, 0.95, 0.99)
SWEEP = {f"randn{s:g}@T{t:g}": f"randn * {s:g} at temperature {t:g} (the methods' "
         f"temperature {TEMPERATURE:g} over logits scaled by {TEMPERATURE:g} / {t:g}); per-row "
         f"top-p cycling {SWEEP_TOP_P}"
         for s in SWEEP_SCALES for t in SWEEP_TEMPERATURES}  # fmt: skip

# --real: a real model's rows, at its vocabulary only
REAL_V = 49152
REAL_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "smollm2-logits.pt")
REAL = {"real": f"raw logits rows of SmolLM2-135M-Instruct (V = {REAL_V}) at decode positions "
        "of sampled chat replies (data/smollm2-logits.pt, written by real_logits.py), row b = "
        "stored row b mod their number"}  # fmt: skip


def row_top_p(shape: str, B: int, device: torch.device) -> torch.Tensor:
    """[B] f32 top-p of the rows: TOP_P, or SWEEP_TOP_P cycled on sweep shapes."""
    if shape in SWEEP:
        vals = [SWEEP_TOP_P[b % len(SWEEP_TOP_P)] for b in range(B)]
        return torch.tensor(vals, dtype=torch.float32, device=device)
    return torch.full((B,), TOP_P, dtype=torch.float32, device=device)


@functools.cache
def load_real(path: str = REAL_PATH) -> dict:
    """The saved real rows: {"logits": [N, REAL_V] fp16, "meta": {...}} (see real_logits.py)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: python benchmarks/real_logits.py writes it")
    data = torch.load(path, map_location="cpu", weights_only=True)
    if data["logits"].shape[1] != REAL_V:
        raise ValueError(f"{path}: rows of {data['logits'].shape[1]} logits, not {REAL_V}")
    return data


def make_logits(shape: str, B: int, V: int, dtype: torch.dtype, device: torch.device,
                seed: int = 0) -> torch.Tensor:  # fmt: skip
    """[B, V] logits of one of SHAPES, SWEEP or REAL, generated on the device (REAL: the
    saved rows, tiled to B rows; V must be REAL_V)."""
    g = torch.Generator(device).manual_seed(seed)
    if shape in SWEEP:
        s, t = (float(v) for v in shape[len("randn") :].split("@T"))
        x = torch.randn(B, V, device=device, generator=g) * (s * TEMPERATURE / t)
    elif shape == "peaked":
        ranks = torch.argsort(torch.rand(B, V, device=device, generator=g), dim=1) + 1
        x = -2.0 * torch.log(ranks.float())
    elif shape == "randn3":
        x = torch.randn(B, V, device=device, generator=g) * 3
    elif shape == "flat":
        x = torch.randn(B, V, device=device, generator=g) * 0.25
    elif shape == "ties":
        x = torch.full((B, V), 1.0, device=device)
    elif shape == "real":
        if V != REAL_V:
            raise ValueError(f"shape 'real' has V = {REAL_V} (SmolLM2's vocabulary), not {V}")
        rows = load_real()["logits"]
        x = rows[torch.arange(B) % rows.shape[0]].to(device)
    else:
        raise ValueError(f"shape must be one of {[*SHAPES, *SWEEP, *REAL]}, got {shape!r}")
    return x.to(dtype).contiguous()
