"""A GGUF file (llama.cpp's format) of a Llama-architecture model with a GPT-2 byte-level BPE
vocabulary (SmolLM2's) -> a float32 Hugging Face checkpoint folder that `HFTransformer`,
`gx.Tokenizer.from_pretrained` and transformers read: config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json (with the chat template).

Needs only the `gguf` package (its reader and numpy dequantizers) besides numpy,
safetensors and tokenizers. It writes what transformers' own GGUF loader writes
(`from_pretrained(dir, gguf_file=...)` + `save_pretrained`), verified equal on
SmolLM2-135M-Instruct: every tensor bit for bit, and the token ids of test texts (ASCII,
unicode, code, chat markup). It takes ~7 s on two cores where transformers takes ~35 s.

Two things a GGUF holds differently from a Hugging Face checkpoint:

- llama.cpp's converter permutes the rows of q_proj and k_proj (per head, the two rotary
  halves [x0..x31, x32..x63] are interleaved to [x0, x32, x1, x33, ...], its rotary
  pairs adjacent elements); `unpermute` undoes it.
- The tokenizer is metadata (tokenizer.ggml.tokens / merges / token_type, special ids,
  tokenizer.chat_template); `build_tokenizer` rebuilds the byte-level BPE from it, with
  control tokens as special added tokens, and the pre-tokenizer transformers gives it
  (ByteLevel's GPT-2 regex; llama.cpp's "smollm" pre-tokenizer would split digits too).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# gguf.TokenType values
CONTROL, USER_DEFINED = 3, 4


class UnsupportedGGUFError(ValueError):
    """The GGUF holds something this converter does not handle; the message says what."""


def read_metadata(reader: Any) -> dict[str, Any]:
    """The key-value fields of a `gguf.GGUFReader` as Python values (strings decoded,
    arrays as lists), without the reader's own GGUF.* header fields."""
    from gguf import GGUFValueType

    def value(field: Any) -> Any:
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            if field.types[-1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [v for i in field.data for v in field.parts[i].tolist()]
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode("utf-8")
        return field.parts[-1].tolist()[0]

    return {k: value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k weight [n_head * head_dim, ...]:
    per head it stored rows as (head_dim/2, 2) where Hugging Face has (2, head_dim/2)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise UnsupportedGGUFError(f"{rows} rows do not split into {n_head} heads of pairs")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM from the GGUF's llama.* metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedGGUFError(f"architecture {arch!r}: this converter reads llama only")
    if any(k.startswith("llama.rope.scaling") for k in meta):
        raise UnsupportedGGUFError("rope scaling metadata: this converter handles plain rope")

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"llama.{key}", default)
        if v is None:
            raise UnsupportedGGUFError(f"the GGUF has no llama.{key}")
        return v

    H, D = int(get("attention.head_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length", D // H))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedGGUFError("partial rotary (rope.dimension_count < head_dim)")
    theta = float(get("rope.freq_base", 10000.0))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    ids = {
        f"{name}_token_id": meta.get(f"tokenizer.ggml.{key}_token_id")
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
    }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": D,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": H,
        "num_key_value_heads": int(get("attention.head_count_kv", H)),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,  # transformers 4; 5 reads rope_parameters
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "vocab_size": int(get("vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "dtype": "float32",
        **{k: v for k, v in ids.items() if v is not None},
    }


def tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array in its shape) for each tensor of the GGUF."""
    from gguf.quants import dequantize

    heads = {"attn_q.weight": config["num_attention_heads"],
             "attn_k.weight": config["num_key_value_heads"]}  # fmt: skip
    for t in reader.tensors:
        if t.name in TOP_NAMES:
            name, kind = TOP_NAMES[t.name], ""
        else:
            blk, layer, kind = (t.name.split(".", 2) + ["", ""])[:3]
            if blk != "blk" or not layer.isdigit() or kind not in LAYER_NAMES:
                raise UnsupportedGGUFError(f"tensor {t.name!r} has no Llama counterpart")
            name = f"model.layers.{layer}.{LAYER_NAMES[kind]}"
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists inner first
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if kind in heads:
            w = unpermute(w, heads[kind])
        yield name, np.ascontiguousarray(w)


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` of a GGUF's GPT-2 byte-level BPE metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedGGUFError(f"tokenizer model {kind!r}: this converter reads gpt2 "
                                   "(byte-level BPE) only")  # fmt: skip
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    if any(len(m) != 2 for m in merges):
        raise UnsupportedGGUFError("a merge that is not two space-separated tokens")
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                     byte_fallback=False)  # fmt: skip
    tok = Tokenizer(bpe)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]}:0 $A:0", pair=f"{tokens[bos]}:0 $A:0 $B:1",
            special_tokens=[(tokens[bos], bos)])  # fmt: skip
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    added = lambda kind: [AddedToken(t, special=kind == CONTROL, normalized=False)
                          for t, k in zip(tokens, types, strict=True) if k == kind]  # fmt: skip
    tok.add_special_tokens(added(CONTROL))
    tok.add_tokens(added(USER_DEFINED))
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens' strings and the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None:
            cfg[f"{name}_token"] = tokens[i]
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert(gguf_file: str | Path, out: str | Path) -> None:
    """Dequantize the GGUF at `gguf_file` into a float32 checkpoint folder `out` (existing,
    empty). Raises `UnsupportedGGUFError` for what it cannot convert faithfully."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    out = Path(out)
    t0 = time.perf_counter()
    reader = GGUFReader(str(gguf_file))
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = llama_config(meta, tied="output.weight" not in names)
    log.info("read %s (%d tensors) in %.1f s", Path(gguf_file).name, len(names),
             time.perf_counter() - t0)  # fmt: skip
    t0 = time.perf_counter()
    weights = dict(tqdm(tensors(reader, config), total=len(names), desc="dequantizing",
                        unit="tensor", disable=None))  # fmt: skip
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    log.info("dequantized and wrote %d tensors (%.0f MB float32) in %.1f s", len(weights),
             sum(w.nbytes for w in weights.values()) / 1e6, time.perf_counter() - t0)  # fmt: skip
    del weights
    t0 = time.perf_counter()
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta))
    _write_json(out / "config.json", config)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out / "generation_config.json", {"_from_model_config": True, **gen})
    log.info("wrote the tokenizer and configs in %.1f s", time.perf_counter() - t0)
