"""Reading a Llama / Qwen2 / Mistral config.json: architecture, rotary scaling, sliding
windows and the parameter names and shapes `HFTransformer` expects."""

from __future__ import annotations

import math
from typing import Any

import torch

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "MistralForCausalLM": "mistral"}  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rope_inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] (float32), scaled as the config says."""
    # transformers 5 writes rope_parameters; older configs rope_theta + rope_scaling
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor, lo, hi = (float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling {rope!r}: HFTransformer supports none, "
                     "'linear' and 'llama3'")  # fmt: skip


def _window(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be null or an integer >= 1, got {value!r}")
    return value


def sliding_windows(cfg: dict[str, Any], kind: str, layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as transformers reads
    the config: Mistral's `sliding_window` holds for every layer; Qwen2's only with
    `use_sliding_window`, on the layers `layer_types` marks "sliding_attention" (when
    absent: layers >= `max_window_layers`); Llama has none."""
    if kind == "mistral":
        return [_window(cfg.get("sliding_window"), "sliding_window")] * layers
    if kind != "qwen2" or not cfg.get("use_sliding_window", False):
        return [None] * layers
    window = _window(cfg.get("sliding_window"), "sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must list 'sliding_attention' or 'full_attention' for "
                         f"each of the {layers} layers, got {types!r}")  # fmt: skip
    return [window if t == "sliding_attention" else None for t in types]


def model_type(cfg: dict[str, Any]) -> str:
    mt = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if mt in ARCHITECTURES.values():
        return mt
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    raise ValueError(f"unsupported architecture (model_type {mt!r}, architectures {archs}): "
                     f"HFTransformer supports {sorted(ARCHITECTURES)}")  # fmt: skip


def param_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """transformers' parameter names and shapes for a Llama / Qwen2 / Mistral config (the
    tied lm_head left out, as `HFTransformer` expects)."""
    qwen2 = model_type(config) == "qwen2"  # Qwen2 has q/k/v biases without saying so
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
