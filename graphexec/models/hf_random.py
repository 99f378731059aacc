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

from graphexec.models.hf import HFTransformer


def param_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """transformers' parameter names and shapes for a Llama / Qwen2 / Mistral config (the
    tied lm_head left out, as `HFTransformer` expects)."""
    qwen2 = config.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (
        config.get("architectures") or ()
    )  # Qwen2 has q/k/v biases without saying so
    D, H = int(config["hidden_size"]), int(config["num_attention_heads"])
    KV = int(config.get("num_key_value_heads") or H)
    hd = int(config.get("head_dim") or D // H)
    V, inter = int(config["vocab_size"]), int(config["intermediate_size"])
    bias = bool(config.get("attention_bias", qwen2))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        for name, n in (("q", H * hd), ("k", KV * hd), ("v", KV * hd)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (n, D)
            if bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (n,)
        shapes[f"{p}self_attn.o_proj.weight"] = (D, H * hd)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, D)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, D)
        shapes[f"{p}mlp.down_proj.weight"] = (D, inter)
        shapes[f"{p}input_layernorm.weight"] = (D,)
        shapes[f"{p}post_attention_layernorm.weight"] = (D,)
    shapes["model.norm.weight"] = (D,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (V, D)
    return shapes


def random_state_dict(
    config: dict[str, Any],
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Seeded random weights for `config`, by transformers' names, made on `device`
    (default CPU; "meta" gives shapes only). The same seed on the same device type gives
    the same weights."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    std = float(config.get("initializer_range") or 0.02)
    gen = None
    if dev.type != "meta":
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(config).items():
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
