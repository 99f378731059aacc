"""HFTransformer: Llama / Qwen2 / Mistral decoder-only checkpoints as a `DecodeModel`.

The forward is written here (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)
rather than wrapping transformers' modules, so the KV cache can be a static slot-indexed
tensor and `decode` graph-capturable, as in TinyLM: cache writes by index, no host sync.
Decode attention reads only each row's live keys (`attention.decode_attention`, a
split-KV Triton kernel) on CUDA, and is torch SDPA with a position mask elsewhere
(`attention.decode_attention_reference`). Sliding windows (Mistral's `sliding_window`,
Qwen2's `use_sliding_window` layers) are masks over absolute positions: the cache is
not a ring buffer. Weights come from a checkpoint folder (config.json + safetensors, as
`save_pretrained` writes them) or a transformers model object; transformers itself is
never imported.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphexec.models.prefill_graphs import PrefillGraphs
from graphexec.models.protocol import PrefillBatch, SlotKVCache

if TYPE_CHECKING:  # attention imports triton: only when a model binds
    from graphexec.models.attention import AttentionConfig

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "MistralForCausalLM": "mistral"}  # fmt: skip
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rope_inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
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


def _sliding_windows(cfg: dict[str, Any], model_type: str, layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), as transformers reads
    the config: Mistral's `sliding_window` holds for every layer; Qwen2's only with
    `use_sliding_window`, on the layers `layer_types` marks "sliding_attention" (when
    absent: layers >= `max_window_layers`); Llama has none."""
    if model_type == "mistral":
        return [_window(cfg.get("sliding_window"), "sliding_window")] * layers
    if model_type != "qwen2" or not cfg.get("use_sliding_window", False):
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


def _model_type(cfg: dict[str, Any]) -> str:
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
    qwen2 = _model_type(config) == "qwen2"  # Qwen2 has q/k/v biases without saying so
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
        attention: tiles and splits of the CUDA decode-attention kernel
            (`attention.AttentionConfig`); None = its default.
        fused: decode's norms, rotary embeddings + cache writes and SwiGLU as the Triton
            kernels of `fused` (True), or as their torch references (False); None = the
            kernels on CUDA only. (True on the CPU needs TRITON_INTERPRET=1: for tests.)
    """

    def __init__(
        self,
        model_or_config: Any,
        state_dict: dict[str, torch.Tensor] | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_seq_len: int | None = None,
        attention: AttentionConfig | None = None,
        fused: bool | None = None,
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
        self.model_type = _model_type(cfg)
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
        self.num_layers = int(cfg["num_hidden_layers"])
        self.vocab_size = int(cfg["vocab_size"])
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        limit = int(cfg.get("max_position_embeddings", 4096))
        self.max_seq_len = int(max_seq_len or min(limit, 4096))
        # per layer; a window of max_seq_len or more hides nothing, so it is dropped
        windows = _sliding_windows(cfg, self.model_type, self.num_layers)
        self.windows = [w if w is not None and w < self.max_seq_len else None for w in windows]
        self.scale = hd**-0.5
        self.attention = attention
        self.fused = fused
        tied = bool(cfg.get("tie_word_embeddings", False))
        self.inv_freq = _rope_inv_freq(cfg, hd)
        shapes = param_shapes(cfg)
        bias = "model.layers.0.self_attn.q_proj.bias" in shapes
        dev = torch.device(device) if device is not None else torch.device("cpu")
        w: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            t = state_dict.get(name)
            if t is None:
                raise ValueError(f"missing weight {name!r} (expected shape {list(shape)})")
            if tuple(t.shape) != shape:
                raise ValueError(f"weight {name!r} has shape {list(t.shape)}; the config "
                                 f"expects {list(shape)}")  # fmt: skip
            w[name] = t.detach().to(dev, dtype)
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if tied else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = [w[f"{a}{n}_proj.weight"] for n in "qkv"]
            # fused, transposed projections: one matmul for q/k/v and one for gate/up
            self.layers.append(dict(
                qkv=torch.cat(qkv).T.contiguous(),
                qkv_bias=torch.cat([w[f"{a}{n}_proj.bias"] for n in "qkv"]) if bias else None,
                o=w[a + "o_proj.weight"].T.contiguous(),
                gate_up=torch.cat([w[p + "mlp.gate_proj.weight"],
                                   w[p + "mlp.up_proj.weight"]]).T.contiguous(),
                down=w[p + "mlp.down_proj.weight"].T.contiguous(),
                ln1=w[p + "input_layernorm.weight"],
                ln2=w[p + "post_attention_layernorm.weight"],
            ))  # fmt: skip
        self.device = dev
        self.kv_cache: torch.Tensor | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_seq_len: int | None = None,
        attention: AttentionConfig | None = None,
        fused: bool | None = None,
    ) -> HFTransformer:
        """From a checkpoint folder: config.json and model.safetensors (or shards listed in
        model.safetensors.index.json)."""
        from safetensors import safe_open
        from tqdm.auto import tqdm

        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {str(folder)!r}")
        cfg = json.loads((folder / "config.json").read_text())
        _model_type(cfg)  # fail on the architecture before reading any weights
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            if not (folder / f).is_file():
                raise FileNotFoundError(f"weight shard {f!r} missing from {str(folder)!r}")
        with tqdm(desc="loading weights", unit="tensor", disable=None) as bar:
            for f in files:
                with safe_open(str(folder / f), framework="pt") as sf:
                    for k in sf.keys():
                        state[k] = sf.get_tensor(k)
                        bar.update()
        return cls(cfg, state, device=device, dtype=dtype, max_seq_len=max_seq_len,
                   attention=attention, fused=fused)  # fmt: skip

    def bind(self, num_slots: int, device: torch.device | str) -> None:
        d = torch.device(device)
        self.device = d
        self.embed, self.norm = self.embed.to(d), self.norm.to(d)
        self.lm_head = self.lm_head.to(d)
        self.layers = [{k: None if v is None else v.to(d) for k, v in layer.items()}
                       for layer in self.layers]  # fmt: skip
        shape = (self.num_layers, 2, num_slots, self.max_seq_len, self.kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=d)
        # cos/sin tables [T, hd] computed in float32 (as transformers does), then cast
        t = torch.arange(self.max_seq_len, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(d, self.dtype)
        self._sin = emb.sin().to(d, self.dtype)
        self._key_positions = torch.arange(self.max_seq_len, device=d)
        # imported here, not at the top: triton loads when a model binds, not on import
        from graphexec.models import attention, fused

        cuda = d.type == "cuda"
        self._attend = attention.decode_attention if cuda else attention.decode_attention_reference
        kernels = cuda if self.fused is None else self.fused
        ops = ("residual_rms_norm", "rope_kv_write", "silu_mul")
        self._norm, self._rope_kv, self._silu_mul = (
            getattr(fused, op if kernels else op + "_reference") for op in ops)  # fmt: skip
        # prefill route: on CUDA every prompt token is a row of the decode forward (the
        # attention kernel reads only keys 0..pos of its slot); elsewhere a padded SDPA,
        # as the reference attention would gather a whole cache row per token
        self.prefill_rows = cuda
        # ... replayed from CUDA graphs per token bucket (prefill_graphs.py), so a chunk
        # costs the host microseconds instead of ~240 kernel launches
        self.prefill_graphs = PrefillGraphs(self._forward, num_slots - 1, d) if cuda else None

    def prefill_batch(self, batch: PrefillBatch) -> torch.Tensor | None:
        """A ragged batch of prompt segments into their slots' caches (`PrefillBatch`):
        projections over all N tokens at once (the same norm, rotary + cache write and
        silu kernels as `decode`); each layer writes every token's K/V, then
        attends as a padded batch [R, Lmax] over its slot's cache rows [R, C] (C = the
        furthest position written), masked causally (and by the layer's sliding window),
        so chunks see earlier chunks."""
        if self.kv_cache is None:
            raise RuntimeError("HFTransformer.bind(num_slots, device) must run first")
        batch, C = batch.checked(self.max_seq_len, self.kv_cache.shape[2])
        if self.prefill_rows:
            run = self.prefill_graphs or partial(self._forward, prefill=True)
            return run(batch.token_ids, batch.positions, batch.token_slots, batch.logit_rows)
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
        delta, res = self.embed.index_select(0, batch.token_ids), None
        # cuDNN's SDPA builds a plan per new shape (~50 ms each on an H200), and chunked
        # prefill keeps making new (Lmax, C): the other backends have no per-shape setup
        with sdpa_kernel(PREFILL_SDPA):
            for i, layer in enumerate(self.layers):
                h, res = self._norm(delta, res, layer["ln1"], self.eps)
                qkv = h @ layer["qkv"] if layer["qkv_bias"] is None else torch.addmm(
                    layer["qkv_bias"], h, layer["qkv"])  # fmt: skip
                kv_i = self.kv_cache[i]  # [2, S, T, KV, hd]
                q = self._rope_kv(qkv, pos, slots, self._cos, self._sin, kv_i, H)  # [N, H, hd]
                if i == self.num_layers - 1 and rows is None:
                    return None  # the last layer's K/V is all that is kept
                q = q.index_select(0, qrows).view(R, Lmax, H, hd).transpose(1, 2)
                keys, vals = kv_i[:, :, :C].index_select(1, batch.slot_ids).transpose(2, 3)
                g = H // KV  # grouped-query: each KV head serves g query heads
                keys, vals = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)
                a = F.scaled_dot_product_attention(q, keys, vals,
                                                   attn_mask=masks[self.windows[i]])  # fmt: skip
                a = a.transpose(1, 2).reshape(R * Lmax, H * hd).index_select(0, batch.padded_index)
                delta = a @ layer["o"]
                h, res = self._norm(delta, res, layer["ln2"], self.eps)
                delta = self._silu_mul(h @ layer["gate_up"]) @ layer["down"]
        if rows is None:
            return None
        h, _ = self._norm(delta.index_select(0, rows), res.index_select(0, rows), self.norm,
                          self.eps)  # fmt: skip
        return (h @ self.lm_head.T).float()

    def decode(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """One token per row; each layer writes its K/V at (slot, pos), then attends over
        the row's live keys only (`attention.decode_attention` on CUDA, the torch
        reference elsewhere), within the layer's sliding window if it has one.

        A layer is: norm (with the previous sublayer's residual add) -> q/k/v GEMM ->
        rotary + cache write -> attention -> o GEMM -> norm (+ residual add) -> gate/up
        GEMM -> silu * up -> down GEMM; the last residual add goes into the final norm
        (`fused`: Triton kernels on CUDA, their torch references elsewhere)."""
        return self._forward(input_ids, positions, slot_ids)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_ids: torch.Tensor, rows: torch.Tensor | None = None,
                 prefill: bool = False) -> torch.Tensor | None:  # fmt: skip
        """`decode` over N token rows; logits [M, V] of `rows` (all rows when None, unless
        `prefill`: then None, and the last layer stops after its cache write). Every
        layer writes all rows' K/V before any attends, so prompt tokens of one slot
        (a prefill segment) see each other causally."""
        B, H, hd = input_ids.shape[0], self.heads, self.head_dim
        # a bad position never indexes out of the cache (the executor keeps them in range)
        pos = positions.clamp(0, self.max_seq_len - 1)
        delta, res = self.embed[input_ids], None  # [B, D]: res = x, delta its next update
        for i, layer in enumerate(self.layers):
            h, res = self._norm(delta, res, layer["ln1"], self.eps)
            qkv = h @ layer["qkv"] if layer["qkv_bias"] is None else torch.addmm(
                layer["qkv_bias"], h, layer["qkv"])  # fmt: skip
            kv_i = self.kv_cache[i]  # [2, S, T, KV, hd]
            q = self._rope_kv(qkv, pos, slot_ids, self._cos, self._sin, kv_i, H)
            if prefill and rows is None and i == self.num_layers - 1:
                return None  # the last layer's K/V is all that is kept
            a = self._attend(q, kv_i, slot_ids, pos, self.scale, self.windows[i],
                             config=self.attention)  # fmt: skip
            delta = a.reshape(B, H * hd) @ layer["o"]
            h, res = self._norm(delta, res, layer["ln2"], self.eps)
            delta = self._silu_mul(h @ layer["gate_up"]) @ layer["down"]
        if rows is not None:
            delta, res = delta.index_select(0, rows), res.index_select(0, rows)
        elif prefill:
            return None
        h, _ = self._norm(delta, res, self.norm, self.eps)
        return (h @ self.lm_head.T).float()
