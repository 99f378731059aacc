"""The demo's model and tokenizer: TinyLM at the bundled cl100k vocabulary, or a Hugging Face
checkpoint folder (`--model PATH`: config.json, *.safetensors, tokenizer.json).

Problems with the folder (missing, no config.json, an architecture HFTransformer does not
support, quantized weights, no tokenizer.json, a tokenizer larger than the model's
vocabulary) raise
`ModelChoiceError` with one line naming it, before any weights are read where possible.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import graphexec as gx

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
    """

    name: str
    tokenizer: gx.Tokenizer
    make: Callable[[], object]
    draft: Callable[[], object] | None
    prompt_prefix: tuple[int, ...] = ()
    random_weights: bool = True

    def encode(self, text: str) -> tuple[int, ...]:
        return (*self.prompt_prefix, *self.tokenizer.encode(text))


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
    """TinyLM when `path` is None, else the checkpoint in folder `path`."""
    dt = choose_dtype(dtype, device)
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
    return DemoModel(
        name=f"{arch} checkpoint {folder.resolve().name} ({model.num_layers} layers, "
        f"{str(model.dtype).removeprefix('torch.')}, max_seq_len {model.max_seq_len})",
        tokenizer=tok,
        make=lambda: model,
        draft=None,
        prompt_prefix=prefix,
        random_weights=False,
    )


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
