"""One decoder layer's weights, as `HFTransformer` holds them after loading."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderLayer:
    """One layer's weights in nn.Linear's [out, in] layout, q/k/v and gate/up fused."""

    qkv: torch.Tensor  # [(H + 2 KV) * hd, D]
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) * hd] (Qwen2)
    o: torch.Tensor  # [D, H * hd]
    gate_up: torch.Tensor  # [2 I, D]: gate rows, then up rows
    down: torch.Tensor  # [D, I]
    ln1: torch.Tensor  # [D] input_layernorm
    ln2: torch.Tensor  # [D] post_attention_layernorm

    def paired(self, heads: int, kv_heads: int, inverse: bool = False) -> DecoderLayer:
        """q/k/v (and its bias) in `fused.pair_rotary_rows`' order (inverse: back)."""
        from graphexec.kernels.fused import pair_rotary_rows  # (triton: at bind only)

        def pair(t):
            return None if t is None else pair_rotary_rows(t, heads, kv_heads, inverse)

        return dataclasses.replace(self, qkv=pair(self.qkv), qkv_bias=pair(self.qkv_bias))
