"""A Hugging Face checkpoint folder: config.json and its safetensors weights (one file, or
shards listed in model.safetensors.index.json), checked before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from graphexec.checkpoints.hf_config import model_type


def checkpoint_files(folder: Path) -> tuple[dict[str, Any], list[str]]:
    """(the config, the weight files) of a checkpoint folder; FileNotFoundError naming
    what is missing, ValueError for an architecture that is not supported."""
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(folder)!r}")
    cfg = json.loads((folder / "config.json").read_text())
    model_type(cfg)  # fail on the architecture before reading any weights
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}")
    for f in files:
        if not (folder / f).is_file():
            raise FileNotFoundError(f"weight shard {f!r} missing from {str(folder)!r}")
    return cfg, files


def read_state(folder: Path, files: list[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the weight files, by name, with a progress bar."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    state: dict[str, torch.Tensor] = {}
    with tqdm(desc="loading weights", unit="tensor", disable=None) as bar:
        for f in files:
            with safe_open(str(folder / f), framework="pt") as sf:
                for k in sf.keys():
                    state[k] = sf.get_tensor(k)
                    bar.update()
    return state
