"""TinyLM: a small seeded-random transformer with a static KV cache indexed by slot.

It exists to give the executor a real decode forward to capture: embeddings, attention
over a per-slot cache, an MLP and an LM head, at the bundled tokenizer's vocabulary.
Its weights are random (seeded), so its text is noise; what matters is the shape of the
work. `decode` is graph-capturable: static shapes, cache writes by index, attention over
the whole cache row with a position mask, no host sync. `verify` runs its T tokens as T
decode calls: the same kernels at the same shapes, so its logits are bitwise those of
decode and speculation never moves a token by a rounding difference (a real model's
batched verify forward agrees with its decode only to rounding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class TinyLM:
    """A pre-norm decoder-only transformer with learned absolute positions.

    Args:
        vocab_size: V (the bundled cl100k tokenizer has 100277).
        seed: weights come from this seed (CPU generator, then moved), so every device
            and run builds the same model.
        dim, layers, heads: model size.
        max_seq_len: positions per slot (prompt + output).
        logit_scale: spread of the logits (their std over a row is about this).
        dtype: weight and activation dtype; logits are returned as float32.
    """

    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        dim: int = 128,
        layers: int = 2,
        heads: int = 4,
        max_seq_len: int = 256,
        logit_scale: float = 3.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.dim, self.heads, self.num_layers = dim, heads, layers
        self.logit_scale = logit_scale
        self.dtype = dtype
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * std).to(dtype)

        s = 1.0 / math.sqrt(dim)
        self.embed = w(vocab_size, dim, std=1.0)
        self.pos_embed = w(max_seq_len, dim, std=0.5)
        self.lm_head = w(vocab_size, dim, std=1.0)  # untied: a tied head repeats its input
        self.layers = [
            dict(
                qkv=w(dim, 3 * dim, std=s),
                out=w(dim, dim, std=s),
                up=w(dim, 4 * dim, std=s),
                down=w(4 * dim, dim, std=0.5 * s),
            )
            for _ in range(layers)
        ]
        self.device = torch.device("cpu")
        self.k_cache: torch.Tensor | None = None  # [L, S, T, H, hd]
        self.v_cache: torch.Tensor | None = None

    def bind(self, num_slots: int, device: torch.device | str) -> None:
        d = torch.device(device)
        self.device = d
        self.embed = self.embed.to(d)
        self.pos_embed = self.pos_embed.to(d)
        self.lm_head = self.lm_head.to(d)
        self.layers = [{k: v.to(d) for k, v in layer.items()} for layer in self.layers]
        hd = self.dim // self.heads
        shape = (self.num_layers, num_slots, self.max_seq_len, self.heads, hd)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=d)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=d)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (self.dim,))
        return (h @ self.lm_head.T).float() * (self.logit_scale / math.sqrt(self.dim))

    def _qkv(self, layer: dict, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hd = self.dim // self.heads
        q, k, v = (F.rms_norm(x, (self.dim,)) @ layer["qkv"]).split(self.dim, dim=-1)
        return tuple(t.reshape(*t.shape[:-1], self.heads, hd) for t in (q, k, v))

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.rms_norm(x, (self.dim,)) @ layer["up"]) @ layer["down"]

    def fork(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy the cache of the first `length` positions (n streams of one prompt)."""
        self.k_cache[:, dst_slot, :length] = self.k_cache[:, src_slot, :length]
        self.v_cache[:, dst_slot, :length] = self.v_cache[:, src_slot, :length]

    def prefill(self, slot: int, token_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        if self.k_cache is None:
            raise RuntimeError("TinyLM.bind(num_slots, device) must run before prefill")
        ids = token_ids.reshape(-1).to(self.device)
        n = int(ids.numel())
        if not 0 < n <= self.max_seq_len:
            raise ValueError(f"prompt length must be in [1, {self.max_seq_len}], got {n}")
        x = self.embed[ids] + self.pos_embed[:n]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)  # [n, H, hd]
            self.k_cache[i, slot, :n] = k
            self.v_cache[i, slot, :n] = v
            a = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            )  # [H, n, hd]
            x = x + a.transpose(0, 1).reshape(n, self.dim) @ layer["out"]
            x = x + self._mlp(layer, x)
        return self._head(x if all_logits else x[-1])

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        T = self.max_seq_len
        # a bad position never indexes out of the cache (the executor keeps them in range)
        pos = positions.clamp(0, T - 1)
        x = self.embed[input_ids] + self.pos_embed[pos]  # [B, D]
        visible = torch.arange(T, device=self.device)[None, :] <= pos[:, None]  # [B, T]
        hd = self.dim // self.heads
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x)  # [B, H, hd]
            self.k_cache[i, slot_ids, pos] = k
            self.v_cache[i, slot_ids, pos] = v
            keys = self.k_cache[i, slot_ids]  # [B, T, H, hd]
            vals = self.v_cache[i, slot_ids]
            scores = torch.einsum("bhd,bthd->bht", q, keys) / math.sqrt(hd)
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            a = torch.einsum("bht,bthd->bhd", scores.softmax(-1), vals)
            x = x + a.reshape(-1, self.dim) @ layer["out"]
            x = x + self._mlp(layer, x)
        return self._head(x)

    def verify(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        steps = [self.decode(input_ids[:, t], positions + t, slot_ids)
                 for t in range(input_ids.shape[1])]  # fmt: skip
        return torch.stack(steps, dim=1)
