"""One way to name a model: the `--model` values every tool and subcommand takes (`demo`,
`serve`, `inspect`, `determinism`, tools/*.py, and the benchmarks' scripts).

    smollm2   SmolLM2-135M-Instruct, set up by `python -m graphexec models smollm2`
              (`graphexec.checkpoints.smollm2`)
    PATH      a Llama / Qwen2 / Mistral checkpoint folder (config.json, *.safetensors,
              tokenizer.json), or a config .json file (random weights at its shape)
    CONFIG    a config by name in benchmarks/configs/ of a source checkout (qwen2.5-0.5b,
              llama-3.2-1b): seeded random weights at a real model's shape
    tiny      TinyLM: a small transformer with random weights, the bundled cl100k tokenizer
    table     TableModel: logits that depend only on (position, last token), for tests

`resolve_model` turns a value into a `ModelSpec` (what it names; no weights read) and is
the only place that does; `add_model_argument` adds the flag with the one help text.
A value it cannot resolve raises `ModelChoiceError`, one line that names `--model` and
lists the accepted values.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Kind = Literal["smollm2", "checkpoint", "config", "tiny", "table"]
KINDS: tuple[Kind, ...] = ("smollm2", "checkpoint", "config", "tiny", "table")
# the --model values that are names, not paths ("checkpoint" and "config" are PATH / CONFIG)
NAMES = ("smollm2", "tiny", "table")
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
MODEL_HELP = (
    "smollm2 (SmolLM2-135M-Instruct; set it up once: python -m graphexec models smollm2); PATH: a "
    "Llama / Qwen2 / Mistral checkpoint folder (config.json, *.safetensors, tokenizer.json) "
    "or a config .json; CONFIG: a config in benchmarks/configs (qwen2.5-0.5b, llama-3.2-1b; "
    "random weights at that shape); tiny (TinyLM, random weights, cl100k); table "
    "(TableModel: logits from position and last token, for tests)"
)


class ModelChoiceError(Exception):
    """A --model value that names no model this tool can run; the message says why and
    lists the accepted values."""


@dataclass(frozen=True)
class ModelSpec:
    """What a --model value names; nothing is loaded.

    kind: one of `KINDS`. name: for headers, result files and the served model id (the
    folder's or config's name, "smollm2", "tiny", "table"). folder: the checkpoint folder
    (smollm2: the converted cache folder). config: the model's config.json as a dict
    (checkpoint, smollm2 and config kinds), else None.
    """

    kind: Kind
    name: str
    folder: Path | None = None
    config: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def random_weights(self) -> bool:
        return self.kind in ("config", "tiny", "table")


def config_names(configs: Path = CONFIGS) -> list[str]:
    """The config names in benchmarks/configs (none outside a source checkout)."""
    return sorted(p.stem for p in configs.glob("*.json")) if configs.is_dir() else []


def accepted(accept: Collection[str] = KINDS, configs: Path = CONFIGS) -> str:
    """The accepted values, for error messages: names first, then PATH and CONFIG."""
    parts = [n for n in NAMES if n in accept]
    if "checkpoint" in accept:
        parts.append("a checkpoint folder PATH" + (" or a config .json" * ("config" in accept)))
    if "config" in accept:
        names = config_names(configs)
        parts.append(f"a config name ({', '.join(names)})" if names else
                     "a config name (benchmarks/configs of a source checkout)")  # fmt: skip
    return ", ".join(parts)


def add_model_argument(p: argparse.ArgumentParser, default: str | None = "tiny",
                       default_help: str | None = None) -> None:  # fmt: skip
    """--model with the one help text; `default_help` says what the default is when it is
    not a plain value (e.g. the demo's "smollm2 if installed, else tiny")."""
    say = default_help or default
    p.add_argument("--model", default=default, metavar="smollm2|PATH|CONFIG|tiny|table",
                   help=f"{MODEL_HELP}; default: {say}")  # fmt: skip


def resolve_model(value: str, accept: Collection[str] = KINDS,
                  configs: Path = CONFIGS) -> ModelSpec:  # fmt: skip
    """The model that `value` names (`ModelSpec`), among the kinds in `accept`.

    Order: tiny and table; smollm2 (unless a folder of that name exists here), the
    checkpoint that `python -m graphexec models smollm2` set up (`smollm2.checkpoint()`); an
    existing folder (checked for config.json, a supported architecture and unquantized
    weights before any weight is read); a .json file; a name in `configs`. Raises
    `ModelChoiceError`."""

    def refuse(why: str) -> ModelChoiceError:
        return ModelChoiceError(f"--model {value!r}: {why}; accepted: {accepted(accept, configs)}")

    spec = _resolve(value, configs, refuse)
    if spec.kind not in accept:
        raise refuse(f"a {spec.kind} model is not supported by this tool")
    return spec


def _resolve(value: str, configs: Path, refuse) -> ModelSpec:
    if value in ("tiny", "table"):
        return ModelSpec(value, value)
    path = Path(value).expanduser()
    if value == "smollm2" and not path.exists():
        from graphexec.checkpoints import smollm2

        try:
            folder = smollm2.checkpoint()
        except smollm2.MissingExtraError as e:
            raise ModelChoiceError(f"--model smollm2: {e}") from None
        return ModelSpec("smollm2", "smollm2", folder, read_config(folder / "config.json"))
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise refuse(f"no config.json in checkpoint folder {str(path)!r}")
        return ModelSpec("checkpoint", path.resolve().name, path, read_config(cfg_path))
    if path.suffix == ".json" and path.is_file():
        return ModelSpec("config", path.stem, None, read_config(path))
    if (configs / f"{value}.json").is_file() and "/" not in value:
        return ModelSpec("config", value, None, read_config(configs / f"{value}.json"))
    if path.exists():
        raise refuse(f"{str(path)!r} is not a folder (a checkpoint folder holds config.json, "
                     "*.safetensors and tokenizer.json) nor a config .json")  # fmt: skip
    if "/" in value or "\\" in value or value.startswith((".", "~")):
        raise refuse(f"checkpoint folder {str(path)!r} does not exist")
    raise refuse("no model of that name")


def read_config(path: Path) -> dict[str, Any]:
    """A config.json as a dict, checked for what HFTransformer runs: a supported
    architecture and unquantized weights (`ModelChoiceError` naming the file otherwise)."""
    from graphexec.checkpoints.hf_config import model_type

    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        model_type(cfg)
    except (OSError, ValueError) as e:  # unreadable, bad JSON, an unsupported architecture
        raise ModelChoiceError(f"{path}: {e}") from None
    quant = cfg.get("quantization_config")
    if quant:  # its packed weights or scales would be read as plain ones, or be missing
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelChoiceError(f"{path}: quantized checkpoints ({method}) are not "
                               "supported (float32, bfloat16 or float16 weights only)")  # fmt: skip
    return cfg
