"""TinyLM: a small seeded-random transformer with a static KV cache indexed by slot.

It exists to give the executor a real decode forward to capture: embeddings, attention
over a per-slot cache, an MLP and an LM head, at the bundled tokenizer's vocabulary.
Its weights are random (seeded), so its text is noise; what matters is the shape of the
work. Its forward runs on token rows, as HFTransformer's does, through the same
`ops.ForwardOps` route (batch-invariant by default): `decode` is one token per row,
`verify` one forward over the B x (K + 1) tokens, `prefill_batch` one row per prompt
token (replayed from CUDA graphs per token bucket on CUDA). Each layer writes every
row's K/V before any row attends, so chunks, drafts and prompts see their earlier
tokens through the cache, and a row's logits are the same bits in any batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from graphexec.models.prefill_graphs import PrefillGraphs
from graphexec.models.protocol import PrefillBatch, SlotKVCache, tensors_to
from graphexec.models.table import _slice

if TYPE_CHECKING:  # these import triton: only when a model binds
    from graphexec.kernels.matmul_config import MatmulConfig
    from graphexec.kernels.ops import ForwardOps


@dataclass(frozen=True)
class TinyLayer:
    """One layer's weights in nn.Linear's [out, in] layout."""

    qkv: torch.Tensor  # [3 D, D]: q, k, v rows
    out: torch.Tensor  # [D, D]
    up: torch.Tensor  # [4 D, D]
    down: torch.Tensor  # [D, 4 D]


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
        batch_invariant, matmul, fused: as `HFTransformer`'s (`ops` route map).
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
        *,
        batch_invariant: bool = True,
        matmul: MatmulConfig | None = None,
        fused: bool | None = None,
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
        self.batch_invariant, self.matmul, self.fused = bool(batch_invariant), matmul, fused
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
        # drawn as [in, out] (the seeded values of earlier versions), kept as [out, in]
        self.layers = [
            TinyLayer(*(m.T.contiguous() for m in (
                w(dim, 3 * dim, std=s), w(dim, dim, std=s), w(dim, 4 * dim, std=s),
                w(4 * dim, dim, std=0.5 * s))))
            for _ in range(layers)
        ]  # fmt: skip
        self.device = torch.device("cpu")
        # one tensor [L, 2, S, T, H, hd] holds both (one op writes or reads a layer's K
        # and V); k_cache and v_cache are its halves [L, S, T, H, hd]
        self.kv_cache: torch.Tensor | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.ops: ForwardOps | None = None

    def bind(self, num_slots: int, device: torch.device | str) -> None:
        # imported here, not at the top: triton loads when a model binds, not on import
        from graphexec.kernels.ops import ForwardOps

        d = torch.device(device)
        self.ops = ForwardOps.select(d, self.batch_invariant, self.fused, self.matmul)
        self.device = d
        self.embed = self.embed.to(d)
        self.pos_embed = self.pos_embed.to(d)
        self.lm_head = self.lm_head.to(d)
        self.layers = [tensors_to(layer, d) for layer in self.layers]
        hd = self.dim // self.heads
        shape = (self.num_layers, 2, num_slots, self.max_seq_len, self.heads, hd)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=d)
        self.k_cache, self.v_cache = self.kv_cache[:, 0], self.kv_cache[:, 1]
        self._ones = torch.ones(self.dim, dtype=self.dtype, device=d)  # the norms' weight
        self._eps = torch.finfo(self.dtype).eps  # F.rms_norm's default
        self.padding_slot = num_slots - 1
        cuda = d.type == "cuda"
        self.prefill_graphs = PrefillGraphs(self._forward, self.padding_slot, d) if cuda else None

    def prefill_batch(self, batch: PrefillBatch) -> torch.Tensor | None:
        """A ragged batch of prompt segments into their slots' caches (`PrefillBatch`):
        every prompt token a row of the forward (a chunk continues at its start, seeing
        its slot's earlier chunks through the cache); logits of `batch.logit_rows`, or
        None (then the last layer stops after its K/V). Shapes come from the host
        tuples: no sync."""
        self._check_bound("prefill_batch")
        batch, _ = batch.checked(self.max_seq_len, self.kv_cache.shape[2])
        return self._prefill_token_rows(batch)

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        self._check_bound("decode")
        return self._forward(input_ids, positions, slot_ids)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_ids: torch.Tensor, rows: torch.Tensor | None = None,
                 prefill: bool = False) -> torch.Tensor | None:  # fmt: skip
        """N token rows: logits [M, V] of `rows` (all rows when None, unless `prefill`:
        then None). A layer: norm -> q/k/v GEMM -> K/V written at (slot, pos) for every
        row -> attention over the row's keys 0..pos -> out GEMM (+ residual, fused into
        the next norm) -> up GEMM -> GELU -> down GEMM."""
        ops = self.ops
        N, D, H = input_ids.shape[0], self.dim, self.heads
        # a bad position never indexes out of the cache (the executor keeps them in range)
        pos = positions.clamp(0, self.max_seq_len - 1)
        delta = self.embed[input_ids] + self.pos_embed[pos]  # [N, D]
        res, scale = None, 1.0 / math.sqrt(D // H)
        for i, layer in enumerate(self.layers):
            h, res = ops.norm(delta, res, self._ones, self._eps)
            qkv = ops.linear(h, layer.qkv).view(N, 3, H, D // H)
            kv_i = self.kv_cache[i]  # [2, S, T, H, hd]
            kv_i[:, slot_ids, pos] = qkv[:, 1:].transpose(0, 1)
            if prefill and rows is None and i == self.num_layers - 1:
                return None  # the last layer's K/V is all that is kept
            a = ops.attend(qkv[:, 0], kv_i, slot_ids, pos, scale).reshape(N, D)
            h, res = ops.norm(ops.linear(a, layer.out), res, self._ones, self._eps)
            delta = ops.linear(F.gelu(ops.linear(h, layer.up)), layer.down)
        if rows is not None:
            delta = delta.index_select(0, rows)
            res = None if res is None else res.index_select(0, rows)  # (a model of no layers)
        elif prefill:
            return None
        h, _ = ops.norm(delta, res, self._ones, self._eps)
        return ops.linear(h, self.lm_head).float() * (self.logit_scale / math.sqrt(D))
