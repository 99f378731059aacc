"""TinyLM: a small seeded-random transformer with a static KV cache indexed by slot.

It exists to give the executor a real decode forward to capture: embeddings, attention
over a per-slot cache, an MLP and an LM head, at the bundled tokenizer's vocabulary.
Its weights are random (seeded), so its text is noise; what matters is the shape of the
work. `prefill_batch` runs a ragged batch of prompts and chunks in one pass (one matmul
per projection over all their tokens, padded attention over each slot's cache); `prefill`
is its one-segment case. `decode` is graph-capturable: static shapes, cache writes by
index, attention over the whole cache row with a position mask, no host sync. `verify`
runs its T tokens as T decode calls: the same kernels at the same shapes, so its logits
are bitwise those of decode and speculation never moves a token by a rounding
difference (a real model's batched verify forward agrees with its decode only to
rounding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from graphexec.models.protocol import PrefillBatch, SlotKVCache
from graphexec.models.table import _slice


class TinyLM(SlotKVCache):
    """A pre-norm decoder-only transformer with learned absolute positions.

    Args:
        vocab_size: V (the bundled cl100k tokenizer has 100277).
        seed: weights come from this seed (CPU generator, then moved), so every device
            and run builds the same model.
        dim, layers, heads: model size.
        max_seq_len: positions per slot (prompt + output).
        logit_scale: spread of the logits (their std over a row is about this).
        dtype: weight and activation dtype; logits are returned as float32.
        shard: (rank, world): the LM head keeps only the rank's vocabulary slice
            (`distributed.vocab_slices`), so logits are [.., hi - lo], the unsharded
            model's columns lo..hi (for `DecodeExecutor(tp_group=)`).
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
        shard: tuple[int, int] | None = None,
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
        # a vocabulary-parallel head: this rank's rows of the same seeded weights
        self.vocab_slice = _slice(vocab_size, shard)
        self.lm_head = self.lm_head[slice(*self.vocab_slice)].clone()
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
        # one tensor [L, 2, S, T, H, hd] holds both (one op writes or reads a layer's K
        # and V); k_cache and v_cache are its halves [L, S, T, H, hd]
        self.kv_cache: torch.Tensor | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind(self, num_slots: int, device: torch.device | str) -> None:
        d = torch.device(device)
        self.device = d
        self.embed = self.embed.to(d)
        self.pos_embed = self.pos_embed.to(d)
        self.lm_head = self.lm_head.to(d)
        self.layers = [{k: v.to(d) for k, v in layer.items()} for layer in self.layers]
        hd = self.dim // self.heads
        shape = (self.num_layers, 2, num_slots, self.max_seq_len, self.heads, hd)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=d)
        self.k_cache, self.v_cache = self.kv_cache[:, 0], self.kv_cache[:, 1]
        # per layer, its K and V as [2, S, T, D] (prefill_batch's view)
        self._kv_layers = [kv.flatten(3) for kv in self.kv_cache]
        # constants of prefill_batch's mask
        self._key_positions = torch.arange(self.max_seq_len, device=d)
        self._zero = torch.zeros((), dtype=self.dtype, device=d)
        self._ninf = torch.full((), float("-inf"), dtype=self.dtype, device=d)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, (self.dim,))
        return (h @ self.lm_head.T).float() * (self.logit_scale / math.sqrt(self.dim))

    def _qkv(self, layer: dict, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hd = self.dim // self.heads
        q, k, v = (F.rms_norm(x, (self.dim,)) @ layer["qkv"]).split(self.dim, dim=-1)
        return tuple(t.reshape(*t.shape[:-1], self.heads, hd) for t in (q, k, v))

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.rms_norm(x, (self.dim,)) @ layer["up"]) @ layer["down"]

    def prefill_batch(self, batch: PrefillBatch) -> torch.Tensor | None:
        """A ragged batch of prompt segments into their slots' caches (`PrefillBatch`).

        Projections and MLP run once over the concatenated N tokens; each layer writes
        their K/V into the cache by (slot, position), then attends as a padded batch:
        queries [R, Lmax] against their slot's cache rows [R, C] (C = the furthest
        position written), masked causally, so a chunk sees its slot's earlier chunks.
        A layer writes every token's K/V before any attends, so two chunks of one slot
        may even share a batch. Shapes come from the host tuples: no sync. With
        `logit_rows` None the last layer stops after its K/V (nothing after it is read)
        and there is no LM head; with rows, its out-projection and MLP run on them alone.

        Few ops, since at prefill sizes the host launching them is the cost: the
        padded layout's indices come with the batch (`PrefillBatch.build`; a batch made
        by hand gets them by `with_layout`), the additive mask is made once for every
        layer, and a layer is 13 launches: norm, QKV matmul, one indexed write of its K
        and V, one gather each of the padded queries, its slots' K and V and the
        unpadded output, attention, out-projection and MLP (each matmul and residual add
        one in-place addmm_).
        """
        if self.k_cache is None:
            raise RuntimeError("TinyLM.bind(num_slots, device) must run before prefill_batch")
        batch, C = batch.checked(self.max_seq_len, self.kv_cache.shape[2])
        R, Lmax = batch.padded_tokens.shape
        D, H, hd, norm = self.dim, self.heads, self.dim // self.heads, (self.dim,)
        pos, slots, rows = batch.positions, batch.token_slots, batch.logit_rows
        key_pos = self._key_positions.narrow(0, 0, C)
        # additive mask [R, 1, Lmax, C], rows padded to 16 elements (so SDPA's
        # memory-efficient kernel takes it as is); a padding row (j >= lengths[r]) still
        # sees key 0 (an all-masked row would be NaN); its output is dropped
        width = -(-C // 16) * 16
        mask = torch.empty((R, 1, Lmax, width), dtype=self.dtype, device=self.device)
        mask = mask.narrow(3, 0, C)
        visible = key_pos <= batch.padded_positions.view(R, 1, Lmax, 1)
        torch.where(visible, self._zero, self._ninf, out=mask)
        x = self.embed.index_select(0, batch.token_ids) + self.pos_embed.index_select(0, pos)
        qrows = batch.padded_tokens.view(-1)  # [R * Lmax]
        # [R, H, Lmax | C, hd] views of index_select's contiguous [R * (Lmax | C), D]
        q_shape, q_stride = (R, H, Lmax, hd), (Lmax * D, hd, D, 1)
        k_shape, k_stride = (R, H, C, hd), (C * D, hd, D, 1)
        last = self.num_layers - 1
        for i, layer in enumerate(self.layers):
            kv_i = self._kv_layers[i]  # [2, S, T, D]
            qkv = torch.rms_norm(x, norm).mm(layer["qkv"]).view(-1, 3, D)  # [N, 3, D]
            kv_i[:, slots, pos] = qkv.narrow(1, 1, 2).transpose(0, 1)
            if i == last and rows is None:
                return None
            q = qkv.select(1, 0).index_select(0, qrows).as_strided(q_shape, q_stride)
            k, v = kv_i.narrow(2, 0, C).index_select(1, batch.slot_ids).unbind(0)  # [R, C, D]
            k, v = k.as_strided(k_shape, k_stride), v.as_strided(k_shape, k_stride)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [R, H, Lmax, hd]
            a = a.transpose(1, 2).reshape(R * Lmax, D)
            if i == last:  # only the logit rows go on to the head
                x, a = x.index_select(0, rows), a.index_select(0, batch.logit_padded)
            else:
                a = a.index_select(0, batch.padded_index)
            x.addmm_(a, layer["out"])  # x is this call's own tensor: in place
            x.addmm_(F.gelu(torch.rms_norm(x, norm).mm(layer["up"])), layer["down"])
        if rows is None:  # a model of no layers
            return None
        return self._head(x if self.num_layers else x[rows])

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
