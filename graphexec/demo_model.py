"""The demo's model and tokenizer: TinyLM at the bundled cl100k vocabulary, a Hugging Face
checkpoint folder (`--model PATH`: config.json, *.safetensors, tokenizer.json), or
`--model smollm2`: SmolLM2-135M-Instruct from the `models` extra (`models/smollm2.py`).

A checkpoint's chat template and its BOS / EOS strings come from tokenizer_config.json (the
template from chat_template.jinja when only that holds it); `render_chat` renders a
conversation with them as transformers' `apply_chat_template` does.

Problems with the folder (missing, no config.json, an architecture HFTransformer does not
support, quantized weights, no tokenizer.json, a tokenizer larger than the model's
vocabulary) raise
`ModelChoiceError` with one line naming it, before any weights are read where possible;
so does `smollm2` without the models extra (the message gives the install command).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import graphexec as gx
from graphexec.chat import ChatTemplate, read_tokenizer_config

# --model names that are not folders (each resolves to a converted checkpoint folder)
ALIASES = ("smollm2",)
# a modest cache on the CPU: its forward's cost grows with max_seq_len
CPU_MAX_SEQ_LEN = 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelChoiceError(Exception):
    """The --model folder cannot be run; the message names the folder and the problem."""


@dataclass
class DemoModel:
    """What the demo runs.

    name: for the header. tokenizer: encodes the prompts; its EOS ids stop requests.
    make: a model for a new executor (a fresh TinyLM each call; the one loaded checkpoint
        again, so its weights are read once). draft: a draft model for the speculative
        run, or None where there is none (checkpoints). prompt_prefix: ids put before every
        prompt (the checkpoint tokenizer's BOS, as its post-processor adds it).
    random_weights: the free text is noise.
    chat_template: the checkpoint's Jinja chat template (tokenizer_config.json), or None.
    special_tokens: its "bos_token" / "eos_token" strings (tokenizer_config.json), which
        chat templates may use; empty where there are none.
    """

    name: str
    tokenizer: gx.Tokenizer
    make: Callable[[], object]
    draft: Callable[[], object] | None
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
    path: str | None, device: torch.device, dtype: str = "auto", max_seq_len: int | None = None,
    seed: int = 0,
) -> DemoModel:  # fmt: skip
    """TinyLM when `path` is None; SmolLM2-135M-Instruct for "smollm2" (unless a folder of
    that name exists), converted once from the models extra's GGUF, with max_seq_len
    `CPU_MAX_SEQ_LEN` by default on the CPU; else the checkpoint in folder `path`."""
    dt = choose_dtype(dtype, device)
    if path in ALIASES and not Path(path).exists():
        from graphexec.models import smollm2

        try:
            folder = smollm2.checkpoint()
        except smollm2.MissingExtraError as e:
            raise ModelChoiceError(f"--model {path}: {e}") from None
        if device.type == "cpu":
            max_seq_len = max_seq_len or CPU_MAX_SEQ_LEN
        return _checkpoint(folder, device, dt, max_seq_len)
    if path is None:
        tok = gx.Tokenizer.cl100k()
        kw = dict(dtype=dt or torch.float32, max_seq_len=max_seq_len or 256)
        return DemoModel(
            name="TinyLM",
            tokenizer=tok,
            make=lambda: gx.models.TinyLM(tok.vocab_size, seed=seed, **kw),
            draft=lambda: gx.models.TinyLM(tok.vocab_size, seed=seed, layers=1, **kw),
        )
    return _checkpoint(Path(path), device, dt, max_seq_len)


def _checkpoint(
    folder: Path, device: torch.device, dtype: torch.dtype | None, max_seq_len: int | None
) -> DemoModel:
    from graphexec.models.hf import HFTransformer
    from graphexec.models.hf_config import model_type

    where = repr(str(folder))
    if not folder.exists():
        raise ModelChoiceError(f"checkpoint folder {where} does not exist")
    if not folder.is_dir():
        raise ModelChoiceError(f"--model {where} is not a folder (a checkpoint folder holds "
                               "config.json, *.safetensors and tokenizer.json)")  # fmt: skip
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelChoiceError(f"no config.json in checkpoint folder {where}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        arch = model_type(cfg)
    except ValueError as e:  # bad JSON or an unsupported architecture
        raise ModelChoiceError(f"{cfg_path}: {e}") from None
    quant = cfg.get("quantization_config")
    if quant:  # its packed weights or scales would be read as plain ones, or be missing
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelChoiceError(f"{cfg_path}: quantized checkpoints ({method}) are not "
                               "supported (float32, bfloat16 or float16 weights only)")  # fmt: skip
    try:  # the tokenizer first: it is quick, the weights may take minutes
        tok = gx.Tokenizer.from_pretrained(folder)
        prefix = bos_prefix(folder)
        model = HFTransformer.from_pretrained(folder, device=device, dtype=dtype,
                                              max_seq_len=max_seq_len)  # fmt: skip
    except (OSError, ValueError) as e:
        raise ModelChoiceError(f"checkpoint {where}: {e}") from None
    if tok.vocab_size > model.vocab_size:
        raise ModelChoiceError(f"checkpoint {where}: its tokenizer has {tok.vocab_size} ids, "
                               f"more than the model's vocab_size {model.vocab_size}")  # fmt: skip
    template, special = read_tokenizer_config(folder)
    return DemoModel(
        name=f"{arch} checkpoint {folder.resolve().name} ({model.num_layers} layers, "
        f"{str(model.dtype).removeprefix('torch.')}, max_seq_len {model.max_seq_len})",
        tokenizer=tok,
        make=lambda: model,
        draft=None,
        prompt_prefix=prefix,
        random_weights=False,
        chat_template=template,
        special_tokens=special,
    )


def chat_template(folder: Path) -> str | None:
    """The folder's chat template, or None (`graphexec.chat.read_tokenizer_config`)."""
    return read_tokenizer_config(folder)[0]


def special_tokens(folder: Path) -> dict[str, str]:
    """The folder's "bos_token" / "eos_token" strings (`read_tokenizer_config`)."""
    return read_tokenizer_config(folder)[1]


def render_chat(template: str, messages: list[dict[str, str]],
                special: dict[str, str] | None = None) -> str:  # fmt: skip
    """`messages` rendered by the Jinja chat `template` with the generation prompt
    (`graphexec.chat.ChatTemplate`)."""
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
