"""The model and tokenizer a tool runs (`DemoModel`), built from a --model value
(`graphexec.models.choice`: smollm2, a checkpoint folder PATH, a config, tiny, table).

TinyLM and TableModel run at the bundled cl100k vocabulary; a config gets seeded random
weights at its shape (`models.hf_random`) and the cl100k tokenizer too; a checkpoint
folder (smollm2 is one, converted from its GGUF) its own tokenizer.json, BOS and
chat template. Every kind has a draft model for speculative runs: a 1-layer TinyLM, the
same TableModel, a 2-layer model of the config's shape, and for a checkpoint a truncated
copy of itself (its first `DRAFT_LAYERS` decoder layers, its final norm and its head).

A checkpoint's chat template and its BOS / EOS strings come from tokenizer_config.json (the
template from chat_template.jinja when only that holds it); `render_chat` renders a
conversation with them as transformers' `apply_chat_template` does.

Problems with the value or the folder raise `ModelChoiceError` with one line naming it,
before any weights are read where possible; so does `smollm2` before it is set up
(the message gives the one command to run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphexec.models.choice import ModelChoiceError, ModelSpec, resolve_model
from graphexec.models.table import TableModel
from graphexec.models.tiny_lm import TinyLM
from graphexec.text.chat_template import ChatTemplate, read_tokenizer_config
from graphexec.text.tokenizer import Tokenizer

__all__ = ["DemoModel", "ModelChoiceError", "choose_model", "choose_dtype", "render_chat"]

# a modest cache on the CPU for Hugging Face models: their forward's cost grows with it
CPU_MAX_SEQ_LEN = 1024
# a checkpoint's draft model: its first layers (of SmolLM2's 30), its norm and head
DRAFT_LAYERS = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DemoModel:
    """What a tool runs.

    name: for the header. spec: the --model value resolved. tokenizer: encodes the
    prompts; its EOS ids stop requests. make: a model for a new executor (a fresh TinyLM
    each call; the one loaded checkpoint again, so its weights are read once; bind it to
    one live executor at a time). draft: a draft model for speculative runs, made on call.
    draft_name: what that draft is, for output. prompt_prefix: ids put before every prompt
    (the checkpoint tokenizer's BOS, as its post-processor adds it).
    random_weights: the free text is noise.
    chat_template: the checkpoint's Jinja chat template (tokenizer_config.json), or None.
    special_tokens: its "bos_token" / "eos_token" strings (tokenizer_config.json), which
        chat templates may use; empty where there are none.
    """

    name: str
    spec: ModelSpec
    tokenizer: Tokenizer
    make: Callable[[], object]
    draft: Callable[[], object]
    draft_name: str
    prompt_prefix: tuple[int, ...] = ()
    random_weights: bool = True
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    def encode(self, text: str) -> tuple[int, ...]:
        return (*self.prompt_prefix, *self.tokenizer.encode(text))

    def encode_chat(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        """The ids of `messages` rendered by the chat template with the generation prompt
        (the template writes any BOS itself, so no prefix; its control tokens are tokens)."""
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template")
        text = render_chat(self.chat_template, messages, self.special_tokens)
        return tuple(self.tokenizer.encode(text, allowed_special="all"))


def choose_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """--dtype: "auto" is the checkpoint config's dtype on CUDA (None lets the model read
    it) and float32 on the CPU."""
    if name == "auto":
        return None if device.type == "cuda" else torch.float32
    return DTYPES[name]


def choose_model(
    model: str | ModelSpec | None, device: torch.device, dtype: str = "auto",
    max_seq_len: int | None = None, seed: int = 0,
) -> DemoModel:  # fmt: skip
    """The `DemoModel` of a --model value (`resolve_model`; None is tiny) or a resolved
    spec. On the CPU a Hugging Face model's max_seq_len is at most `CPU_MAX_SEQ_LEN` by
    default (its max_position_embeddings when smaller)."""
    spec = model if isinstance(model, ModelSpec) else resolve_model(model or "tiny")
    dt = choose_dtype(dtype, device)
    if spec.config is not None and device.type == "cpu" and max_seq_len is None:
        limit = int(spec.config.get("max_position_embeddings", 4096))
        max_seq_len = min(limit, CPU_MAX_SEQ_LEN)
    if spec.kind in ("tiny", "table"):
        return _toy(spec, dt or torch.float32, max_seq_len, seed)
    if spec.kind == "config":
        return _random(spec, device, dt, max_seq_len, seed)
    return _checkpoint(spec, device, dt, max_seq_len)


def _toy(spec: ModelSpec, dt: torch.dtype, max_seq_len: int | None, seed: int) -> DemoModel:
    tok = Tokenizer.cl100k()
    if spec.kind == "table":
        n = max_seq_len or 4096
        return DemoModel(
            name="TableModel", spec=spec, tokenizer=tok,
            make=lambda: TableModel(tok.vocab_size, seed=seed, max_seq_len=n),
            draft=lambda: TableModel(tok.vocab_size, seed=seed, max_seq_len=n),
            draft_name="the same TableModel",
        )  # fmt: skip
    kw = dict(dtype=dt, max_seq_len=max_seq_len or 256)
    return DemoModel(
        name="TinyLM", spec=spec, tokenizer=tok,
        make=lambda: TinyLM(tok.vocab_size, seed=seed, **kw),
        draft=lambda: TinyLM(tok.vocab_size, seed=seed, layers=1, **kw),
        draft_name="1-layer TinyLM",
    )  # fmt: skip


def _random(spec: ModelSpec, device: torch.device, dt: torch.dtype | None,
            max_seq_len: int | None, seed: int) -> DemoModel:  # fmt: skip
    from graphexec.models.hf_random import random_model

    cfg = spec.config
    tok = Tokenizer.cl100k()
    if int(cfg["vocab_size"]) < tok.vocab_size:
        raise ModelChoiceError(f"--model {spec.name!r}: its vocab_size {cfg['vocab_size']} is "
                               f"smaller than the cl100k tokenizer's {tok.vocab_size} "
                               "(random weights run with cl100k prompts)")  # fmt: skip
    dtype = dt or DTYPES.get(str(cfg.get("torch_dtype")), torch.float32)

    def build(layers: int | None = None, s: int = seed):
        c = cfg if layers is None else dict(cfg, num_hidden_layers=layers)
        return random_model(c, seed=s, device=device, dtype=dtype, max_seq_len=max_seq_len)

    model = build()
    return DemoModel(
        name=f"{spec.name} (random weights, {model.num_layers} layers, "
        f"{str(model.dtype).removeprefix('torch.')}, max_seq_len {model.max_seq_len})",
        spec=spec, tokenizer=tok, make=lambda: model,
        draft=lambda: build(layers=2, s=seed + 1), draft_name="2-layer model of its shape",
    )  # fmt: skip


def _checkpoint(spec: ModelSpec, device: torch.device, dtype: torch.dtype | None,
                max_seq_len: int | None) -> DemoModel:  # fmt: skip
    from graphexec.checkpoints.hf_config import model_type
    from graphexec.models.hf import HFTransformer

    folder = spec.folder
    where = repr(str(folder))
    try:  # the tokenizer first: it is quick, the weights may take minutes
        tok = Tokenizer.from_pretrained(folder)
        prefix = bos_prefix(folder)
        model = HFTransformer.from_pretrained(folder, device=device, dtype=dtype,
                                              max_seq_len=max_seq_len)  # fmt: skip
    except (OSError, ValueError) as e:
        raise ModelChoiceError(f"checkpoint {where}: {e}") from None
    if tok.vocab_size > model.vocab_size:
        raise ModelChoiceError(f"checkpoint {where}: its tokenizer has {tok.vocab_size} ids, "
                               f"more than the model's vocab_size {model.vocab_size}")  # fmt: skip
    template, special = read_tokenizer_config(folder)
    n = min(DRAFT_LAYERS, model.num_layers)
    return DemoModel(
        name=f"{model_type(spec.config)} checkpoint {folder.resolve().name} ({model.num_layers} "
        f"layers, {str(model.dtype).removeprefix('torch.')}, max_seq_len {model.max_seq_len})",
        spec=spec,
        tokenizer=tok,
        make=lambda: model,
        draft=lambda: truncated(spec, n, model.dtype, model.max_seq_len),
        draft_name=f"its first {n} of {model.num_layers} layers",
        prompt_prefix=prefix,
        random_weights=False,
        chat_template=template,
        special_tokens=special,
    )


def truncated(spec: ModelSpec, layers: int, dtype: torch.dtype, max_seq_len: int):
    """A draft model from checkpoint `spec`: its first `layers` decoder layers, with its
    own embedding, final norm and LM head (only those tensors are read)."""
    from safetensors import safe_open

    from graphexec.checkpoints.hf_config import param_shapes
    from graphexec.models.hf import HFTransformer

    cfg = dict(spec.config, num_hidden_layers=layers)
    need = set(param_shapes(cfg))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(spec.folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in need.intersection(sf.keys()):
                state[k] = sf.get_tensor(k)
    return HFTransformer(cfg, state, dtype=dtype, max_seq_len=max_seq_len)


def chat_template(folder: Path) -> str | None:
    """The folder's chat template, or None (`chat_template.read_tokenizer_config`)."""
    return read_tokenizer_config(folder)[0]


def special_tokens(folder: Path) -> dict[str, str]:
    """The folder's "bos_token" / "eos_token" strings (`read_tokenizer_config`)."""
    return read_tokenizer_config(folder)[1]


def render_chat(template: str, messages: list[dict[str, str]],
                special: dict[str, str] | None = None) -> str:  # fmt: skip
    """`messages` rendered by the Jinja chat `template` with the generation prompt
    (`graphexec.text.chat_template.ChatTemplate`)."""
    return ChatTemplate(template, dict(special or {})).render(messages)


def bos_prefix(folder: Path) -> tuple[int, ...]:
    """The ids the tokenizer.json post-processor puts before a text's own (Llama's and
    Mistral's BOS; none for Qwen2), as `tokenizer(text)` in transformers would add them."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    plain = hf.encode("a", add_special_tokens=False).ids
    full = hf.encode("a", add_special_tokens=True).ids
    for k in range(len(full) - len(plain) + 1):
        if full[k : k + len(plain)] == plain:
            return tuple(full[:k])
    return ()
