"""Random weights for `HFTransformer` from a config alone, for benchmarks and tests.

A Llama / Qwen2 / Mistral config (a config.json as a dict) is enough to build a model of
that shape: `random_state_dict` makes every weight under transformers' parameter names,
on the device it will run on (a seeded `torch.Generator` of that device: a 1B-parameter
model takes well under a second on a GPU), so the same dict loads into transformers' own
model (`load_state_dict`) for side-by-side runs. Matrices are normal(0,
initializer_range), norms ones, biases normal(0, initializer_range / 10).
"""

from __future__ import annotations

from typing import Any

import torch

from graphexec.checkpoints.hf_config import param_shapes
from graphexec.models.hf import HFTransformer
from graphexec.models.hf_shard import TPShard

__all__ = ["param_shapes", "random_model", "random_state_dict"]


def random_state_dict(
    config: dict[str, Any],
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    shard: TPShard | None = None,
) -> dict[str, torch.Tensor]:
    """Seeded random weights for `config`, by transformers' names, made on `device`
    (default CPU; "meta" gives shapes only). The same seed on the same device type gives
    the same weights. `shard`: only that tensor-parallel rank's part of each weight
    (`TPShard.shape`), for models whose whole state does not fit one device; the parts
    are not those of the whole dict (each is drawn on its own)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    std = float(config.get("initializer_range") or 0.02)
    gen = None
    if dev.type != "meta":
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(config).items():
        if shard is not None:
            shape = shard.shape(name, shape)
        t = torch.empty(shape, device=dev, dtype=dtype)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std if len(shape) == 2 else std / 10, generator=gen)
        out[name] = t
    return out


def random_model(
    config: dict[str, Any],
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_seq_len: int | None = None,
) -> HFTransformer:
    """An `HFTransformer` of `config`'s shape with `random_state_dict(config, seed=seed,
    device=device, dtype=dtype)` weights (made where they will run: no host copy)."""
    state = random_state_dict(config, seed=seed, device=device, dtype=dtype)
    return HFTransformer(config, state, device=device, dtype=dtype, max_seq_len=max_seq_len)
