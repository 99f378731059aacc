"""HFTransformer: Llama / Qwen2 / Mistral decoder-only checkpoints as a `DecodeModel`.

The forward is written here (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)
rather than wrapping transformers' modules, so the KV cache can be a static slot-indexed
tensor and `decode` graph-capturable, as in TinyLM: cache writes by index, no host sync.
Every op comes from `ops.ForwardOps` (the route map): by default the forward is
batch-invariant, so a row's logits are the same bits whatever else is in the call, and
`verify` is one forward over the B x (K + 1) rows. Sliding windows (Mistral's
`sliding_window`, Qwen2's `use_sliding_window` layers) are masks over absolute
positions: the cache is not a ring buffer. Weights come from a checkpoint folder
(config.json + safetensors, as `save_pretrained` writes them) or a transformers model
object; transformers itself is never imported. With `tp_group`, each rank holds its
Megatron-style shard and returns the logits of its vocabulary slice (`hf_shard`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphexec.checkpoints.hf_config import (
    DTYPES,
    model_type,
    param_shapes,
    rope_inv_freq,
    sliding_windows,
)
from graphexec.checkpoints.hf_folder import checkpoint_files, read_state
from graphexec.models.decoder_layer import DecoderLayer
from graphexec.models.hf_shard import TPShard, head_pieces
from graphexec.models.prefill_graphs import PrefillGraphs
from graphexec.models.protocol import PrefillBatch, SlotKVCache, tensors_to

if TYPE_CHECKING:  # these import triton: only when a model binds
    from graphexec.kernels.attention import AttentionConfig
    from graphexec.kernels.matmul_config import MatmulConfig
    from graphexec.kernels.ops import ForwardOps

logger = logging.getLogger(__name__)

PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class HFTransformer(SlotKVCache):
    """A Llama-family decoder with a static KV cache [layers, 2, slots, T, kv_heads, hd].

    Args:
        model_or_config: a transformers model object (its config and state_dict are
            taken), or a config dict (then `state_dict` is required).
        state_dict: weights by transformers' names (model.layers.N.self_attn.q_proj...).
        device: where the weights go now (`bind` moves them to the executor's device).
        dtype: weight/activation dtype (float32, bfloat16, float16); None = the config's
            dtype when one of those, else float32. Logits are always float32.
        max_seq_len: positions per slot; None = min(max_position_embeddings, 4096).
        batch_invariant: every op computes a row in an order fixed by the model's shapes
            (`ops` route map), so a row's logits do not depend on the batch and `verify`
            is one forward equal to K + 1 decodes. False: cuBLAS GEMMs (and torch's CPU
            GEMM), faster at some shapes, not invariant; `verify` is then K + 1 decodes.
        attention: tiles and splits of the CUDA attention kernel
            (`attention.AttentionConfig`); None = its default.
        matmul: tiles of the invariant GEMM (`matmul.MatmulConfig`); None = its default.
        fused: norms, rotary embeddings + cache writes and SwiGLU as the Triton kernels of
            `fused` (True), or as their torch references (False); None = the kernels on
            CUDA only. (True on the CPU needs TRITON_INTERPRET=1: for tests.)
        tp_group: a torch.distributed group of tensor-parallel ranks (None: one rank).
            Each rank keeps its shard of the weights (`hf_shard`: attention heads, the
            intermediate and the vocabulary split, o/down finishing one float32 tree of
            K parts across the ranks: the logits of one rank, bit for bit, at T = 1, 2, 4;
            `row_parallel`)
            and decode / verify / prefill return logits [.., V_r] of its vocabulary slice
            `vocab_slice` (`distributed.vocab_slices`), what `DecodeExecutor(...,
            tp_group=)` samples. `state_dict` may hold whole weights or this rank's parts.
            Then `heads` and `kv_heads` are this rank's; `vocab_size` is the whole V.
    """

    def __init__(
        self,
        model_or_config: Any,
        state_dict: dict[str, torch.Tensor] | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_seq_len: int | None = None,
        batch_invariant: bool = True,
        attention: AttentionConfig | None = None,
        matmul: MatmulConfig | None = None,
        fused: bool | None = None,
        tp_group: Any = None,
    ) -> None:
        if isinstance(model_or_config, dict):
            cfg = dict(model_or_config)
        elif hasattr(model_or_config, "config") and hasattr(model_or_config, "state_dict"):
            cfg = model_or_config.config.to_dict()
            if state_dict is None:
                state_dict = model_or_config.state_dict()
        else:
            raise ValueError("HFTransformer takes a transformers model or a config dict, got "
                             f"{type(model_or_config).__name__}")  # fmt: skip
        if state_dict is None:
            raise ValueError("HFTransformer(config) needs state_dict (or use from_pretrained)")
        self.model_type = model_type(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only 'silu')")
        if dtype is None:
            dtype = DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")), torch.float32)
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.dtype = dtype
        self.dim = D = int(cfg["hidden_size"])
        self.heads = H = int(cfg["num_attention_heads"])
        self.kv_heads = KV = int(cfg.get("num_key_value_heads") or H)
        if H % KV:
            raise ValueError(f"num_attention_heads ({H}) must be a multiple of "
                             f"num_key_value_heads ({KV})")  # fmt: skip
        self.head_dim = hd = int(cfg.get("head_dim") or D // H)
        self.tp = tp = TPShard.create(tp_group, cfg)  # ValueError if the heads do not divide
        self.heads, self.kv_heads = H // tp.world, KV // tp.world  # this rank's
        # the whole K of o and down: their split is chosen by the unsharded shape
        self._row_k = {"o": H * hd, "down": int(cfg["intermediate_size"])}
        self.row_splits: dict[str, Any] = {}  # "o" / "down" -> RowSplit | None, at bind
        self.vocab_slice = tp.vocab
        self.logits_dtype = dtype  # the float32 logits are this dtype's values, upcast
        self.num_layers = int(cfg["num_hidden_layers"])
        self.vocab_size = int(cfg["vocab_size"])
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        limit = int(cfg.get("max_position_embeddings", 4096))
        self.max_seq_len = int(max_seq_len or min(limit, 4096))
        # per layer; a window of max_seq_len or more hides nothing, so it is dropped
        windows = sliding_windows(cfg, self.model_type, self.num_layers)
        self.windows = [w if w is not None and w < self.max_seq_len else None for w in windows]
        self.scale = hd**-0.5
        self.batch_invariant = bool(batch_invariant)
        self.attention, self.matmul, self.fused = attention, matmul, fused
        tied = bool(cfg.get("tie_word_embeddings", False))
        self.inv_freq = rope_inv_freq(cfg, hd)
        shapes = param_shapes(cfg)
        bias = "model.layers.0.self_attn.q_proj.bias" in shapes
        dev = torch.device(device) if device is not None else torch.device("cpu")
        w: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            t = state_dict.get(name)
            if t is None:
                raise ValueError(f"missing weight {name!r} (expected shape {list(shape)})")
            w[name] = tp.take(name, t.detach(), shape).to(dev, dtype)
        self.embed = w["model.embed_tokens.weight"]
        lo, hi = tp.vocab  # a tied head: this rank's rows of the (replicated) embedding
        self.lm_head = self.embed[lo:hi] if tied else w["lm_head.weight"]  # [V_r, D]
        self.norm = w["model.norm.weight"]
        self.layers: list[DecoderLayer] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(DecoderLayer(
                qkv=torch.cat([w[f"{a}{n}_proj.weight"] for n in "qkv"]),
                qkv_bias=torch.cat([w[f"{a}{n}_proj.bias"] for n in "qkv"]) if bias else None,
                o=w[a + "o_proj.weight"],
                gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                down=w[p + "mlp.down_proj.weight"],
                ln1=w[p + "input_layernorm.weight"],
                ln2=w[p + "post_attention_layernorm.weight"],
            ))  # fmt: skip
        self.device = dev
        self._paired_qkv = False  # q/k/v rows in pair_rotary_rows' order (bind)
        self.kv_cache: torch.Tensor | None = None
        self.ops: ForwardOps | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_seq_len: int | None = None,
        **options: Any,
    ) -> HFTransformer:
        """From a checkpoint folder: config.json and model.safetensors (or shards listed in
        model.safetensors.index.json). `options`: the constructor's keyword arguments
        (batch_invariant, attention, matmul, fused, tp_group). With tp_group each rank
        reads only its parts of the weights (`hf_shard.TPShard.load`)."""
        folder = Path(path)
        cfg, files = checkpoint_files(folder)
        if options.get("tp_group") is not None:
            tp = TPShard.create(options["tp_group"], cfg)
            state = tp.load(folder, files, param_shapes(cfg))
        else:
            state = read_state(folder, files)
        return cls(cfg, state, device=device, dtype=dtype, max_seq_len=max_seq_len, **options)

    def bind(self, num_slots: int, device: torch.device | str) -> None:
        # imported here, not at the top: triton loads when a model binds, not on import
        from graphexec.kernels.ops import ForwardOps

        d = torch.device(device)
        self.ops = ForwardOps.select(d, self.batch_invariant, self.fused, self.matmul)
        self.device = d
        self.embed, self.norm = self.embed.to(d), self.norm.to(d)
        # o / down: a K split by the whole weight's shape whose tree the ranks share
        # (`row_parallel`), None on the routes that are not invariant
        split = self.ops.row_split
        self.row_splits = {n: split(self.dim, k, self.tp.world) if split else None
                           for n, k in self._row_k.items()}  # fmt: skip
        # each GEMM weight as the route reads it (the CPU's: K-major; a tied LM head then
        # gets its own copy, the embedding's rows staying contiguous for the lookup)
        w = self.ops.weight
        ow = self.ops.row_weight if self.row_splits["o"] else w
        dw = self.ops.row_weight if self.row_splits["down"] else w
        self.lm_head = w(self.lm_head.to(d))
        # the CPU route: the LM head a piece of its vocabulary slice a call (`head_pieces`)
        pieces = self.ops.column_pieces and head_pieces(self.vocab_size, *self.tp.vocab)
        self._head_kw = {"pieces": pieces} if pieces and len(pieces) > 1 else {}
        # (o / down back in the model's dtype first: a CPU bind may have kept float32)
        self.layers = [dataclasses.replace(layer, qkv=w(layer.qkv), o=ow(layer.o.to(self.dtype)),
                                           gate_up=w(layer.gate_up),
                                           down=dw(layer.down.to(self.dtype)))
                       for layer in (tensors_to(x, d) for x in self.layers)]  # fmt: skip
        if self.ops.paired_qkv != self._paired_qkv:  # rotary pairs as neighbours, or back
            self.layers = [layer.paired(self.heads, self.kv_heads, self._paired_qkv)
                           for layer in self.layers]  # fmt: skip
            self._paired_qkv = self.ops.paired_qkv
        if d.type == "cuda" and self.batch_invariant:
            self.ops = ForwardOps.select(d, True, self.fused, self._verified_matmul())
        shape = (self.num_layers, 2, num_slots, self.max_seq_len, self.kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=d)
        if self.row_splits["o"] is not None:  # decode and verify rows reduce in one kernel
            self.tp = self.tp.bind(d, min(max(512, 4 * num_slots), 2048), self.dim)
        # cos/sin tables [T, hd] computed in float32 (as transformers does), then cast
        t = torch.arange(self.max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(d, self.dtype)
        self._sin = emb.sin().to(d, self.dtype)
        self._key_positions = torch.arange(self.max_seq_len, device=d)
        self.padding_slot = num_slots - 1
        # prefill: every prompt token a row of the decode forward (ops.token_rows), on
        # CUDA replayed from graphs per token bucket (prefill_graphs.py), so a chunk costs
        # the host microseconds instead of ~240 kernel launches; a padded SDPA on the CPU
        # when the forward need not be invariant
        self.prefill_rows = self.ops.token_rows
        cuda = d.type == "cuda"
        self.prefill_graphs = PrefillGraphs(self._forward, self.padding_slot, d) if cuda else None

    def _verified_matmul(self) -> MatmulConfig:
        """The GEMM config with its large-M tiles (and a rank's shard tiles) checked on
        this device against the decode (whole weight's) tiles, bit for bit, on one
        layer's weights and the LM head; a shape that differs keeps its decode tile."""
        from graphexec.kernels.matmul import verify_large_tiles, verify_shard_tiles
        from graphexec.kernels.matmul_config import MatmulConfig
        from graphexec.kernels.row_parallel import verify_rank_tile

        cfg = self.matmul or MatmulConfig.default()
        first = self.layers[0]
        if self.tp.world > 1:  # column shards sum K as the whole weights do
            W = self.tp.world
            whole_qkv = (self.heads + 2 * self.kv_heads) * W * self.head_dim
            cfg = verify_shard_tiles(cfg, [(whole_qkv, first.qkv, False),
                                           (self._row_k["down"], first.gate_up, True),
                                           (self.vocab_size, self.lm_head, False)])  # fmt: skip
            self.row_splits = {n: verify_rank_tile(s, getattr(first, n), cfg)
                               for n, s in self.row_splits.items()}  # fmt: skip
        if not (cfg.large_tiles or cfg.wide_tiles or cfg.long_tiles):
            return cfg
        weights = [(first.qkv, False), (first.gate_up, True), (self.lm_head, False)]
        # o / down: the whole weight on one rank (a rank's shard keeps its decode tile)
        weights += [(getattr(first, n), False) for n, s in self.row_splits.items()
                    if s is None or s.world == 1]  # fmt: skip
        cfg = verify_large_tiles(cfg, weights)
        large, wide, long = ({(n, k) for n, k, _ in t}
                             for t in (cfg.large_tiles, cfg.wide_tiles, cfg.long_tiles))
        logger.info("large-M GEMM tiles: %d of this model's shapes verified bit-identical "
                    "to the decode tiles (and %d wide, %d prefill-sized ones)",
                    len(large & cfg.verified), len(wide & cfg.verified_wide),
                    len(long & cfg.verified_long))  # fmt: skip
        return cfg

    def prefill_batch(self, batch: PrefillBatch) -> torch.Tensor | None:
        """A ragged batch of prompt segments into their slots' caches (`PrefillBatch`).
        Token rows (`ops.token_rows`): every prompt token a row of `_forward`, so a
        token's K/V and logits are those of any other chunking or batch. Otherwise (the
        CPU, not invariant): projections over all N tokens at once, then each layer
        attends as a padded batch [R, Lmax] over its slots' cache rows [R, C] (C = the
        furthest position written), masked causally and by the layer's window."""
        self._check_bound("prefill_batch")
        ops = self.ops
        batch, C = batch.checked(self.max_seq_len, self.kv_cache.shape[2])
        if self.prefill_rows:
            return self._prefill_token_rows(batch)
        R, Lmax = batch.padded_tokens.shape
        H, KV, hd = self.heads, self.kv_heads, self.head_dim
        pos, slots, rows = batch.positions, batch.token_slots, batch.logit_rows
        # a padding row still sees key 0 (an all-masked row would be NaN); it is dropped
        key_pos, qpos = self._key_positions[:C], batch.padded_positions.view(R, 1, Lmax, 1)
        causal = key_pos <= qpos
        # windowed: p - w < j <= p; a padding row (p >= C) keeps key C - 1
        masks = {w: causal & (key_pos > qpos.clamp(max=C - 1) - w)
                 for w in set(self.windows) - {None}}  # fmt: skip
        masks[None] = causal
        qrows = batch.padded_tokens.view(-1)
        delta, res = self.embed[batch.token_ids], None
        # cuDNN's SDPA builds a plan per new shape (~50 ms each on an H200), and chunked
        # prefill keeps making new (Lmax, C): the other backends have no per-shape setup
        with sdpa_kernel(PREFILL_SDPA):
            for i, layer in enumerate(self.layers):
                kv_i = self.kv_cache[i]  # [2, S, T, KV, hd]
                h, res = ops.norm(delta, res, layer.ln1, self.eps)
                q = ops.qkv_rope(h, layer.qkv, layer.qkv_bias, pos, slots, self._cos, self._sin,
                                 kv_i, H)  # fmt: skip
                if i == self.num_layers - 1 and rows is None:
                    return None  # the last layer's K/V is all that is kept
                q = q.index_select(0, qrows).view(R, Lmax, H, hd).transpose(1, 2)
                keys, vals = kv_i[:, :, :C].index_select(1, batch.slot_ids).transpose(2, 3)
                g = H // KV  # grouped-query: each KV head serves g query heads
                keys, vals = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)
                a = F.scaled_dot_product_attention(q, keys, vals,
                                                   attn_mask=masks[self.windows[i]])  # fmt: skip
                a = a.transpose(1, 2).reshape(R * Lmax, H * hd).index_select(0, batch.padded_index)
                h, res = ops.norm(self._row(a, layer.o, "o"), res, layer.ln2, self.eps)
                delta = self._row(ops.linear_silu_mul(h, layer.gate_up), layer.down, "down")
        if rows is None:
            return None
        h, _ = ops.norm(delta.index_select(0, rows), res.index_select(0, rows), self.norm,
                        self.eps)  # fmt: skip
        return ops.linear(h, self.lm_head, **self._head_kw).float()

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """One token per row; each layer writes its K/V at (slot, pos), then attends over
        the row's live keys only, within the layer's sliding window if it has one.

        A layer is: norm (with the previous sublayer's residual add) -> q/k/v GEMM ->
        rotary + cache write -> attention -> o GEMM -> norm (+ residual add) -> gate/up
        GEMM + SwiGLU -> down GEMM; the last residual add goes into the final norm. On
        CUDA the q/k/v GEMM rotates and writes the cache in its epilogue (7 kernels;
        `ops` route map: which kernel runs each)."""
        self._check_bound("decode")
        return self._forward(input_ids, positions, slot_ids)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_ids: torch.Tensor, rows: torch.Tensor | None = None,
                 prefill: bool = False) -> torch.Tensor | None:  # fmt: skip
        """The forward over N token rows; logits [M, V] of `rows` (all rows when None,
        unless `prefill`: then None, and the last layer stops after its cache write).
        Every layer writes all rows' K/V before any attends, so prompt tokens of one slot
        (a prefill segment) and the tokens of a verify see each other causally."""
        args = (input_ids, positions, slot_ids, rows, prefill)
        if self.device.type == "cpu" and not torch.is_inference_mode_enabled():
            with torch.inference_mode():  # no autograd bookkeeping per op: ~8% of a decode
                return self._layers_forward(*args)
        return self._layers_forward(*args)

    def _layers_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        slot_ids: torch.Tensor, rows: torch.Tensor | None,
                        prefill: bool) -> torch.Tensor | None:  # fmt: skip
        ops = self.ops
        N, H, hd = input_ids.shape[0], self.heads, self.head_dim
        # a bad position never indexes out of the cache (the executor keeps them in range)
        pos = positions.clamp(0, self.max_seq_len - 1)
        # [N, D]: res = x, delta its next update; row-parallel partials are summed (_row)
        delta, res = self.embed[input_ids], None
        for i, layer in enumerate(self.layers):
            kv_i = self.kv_cache[i]  # [2, S, T, KV, hd]
            h, res = ops.norm(delta, res, layer.ln1, self.eps)
            q = ops.qkv_rope(h, layer.qkv, layer.qkv_bias, pos, slot_ids, self._cos, self._sin,
                             kv_i, H)  # fmt: skip
            if prefill and rows is None and i == self.num_layers - 1:
                return None  # the last layer's K/V is all that is kept
            a = ops.attend(q, kv_i, slot_ids, pos, self.scale, self.windows[i],
                           config=self.attention)  # fmt: skip
            h, res = ops.norm(self._row(a.reshape(N, H * hd), layer.o, "o"), res, layer.ln2,
                              self.eps)  # fmt: skip
            delta = self._row(ops.linear_silu_mul(h, layer.gate_up), layer.down, "down")
        if rows is not None:
            delta, res = delta.index_select(0, rows), res.index_select(0, rows)
        elif prefill:
            return None
        h, _ = ops.norm(delta, res, self.norm, self.eps)
        return ops.linear(h, self.lm_head, **self._head_kw).float()

    def _row(self, x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
        """A row-parallel layer (o, down) over all ranks: with a row split, each rank's
        float32 subtree sum and the tree finished in rank order (`row_parallel`: the bits
        of one rank at T = 1, 2, 4); otherwise rounded partials summed in rank order."""
        split, tp = self.row_splits[name], self.tp
        if split is None:
            return tp.reduce(self.ops.linear(x, w))
        if tp.world == 1:
            return self.ops.row_linear(x, w, split)
        out = tp.partial_out(0 if name == "o" else 1, x.shape[0])
        kw = {} if out is None else {"out": out}  # straight into the symmetric buffer
        return tp.reduce_tree(self.ops.row_linear(x, w, split, f32=True, **kw), x.dtype)
