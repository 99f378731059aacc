"""What an engine and an API server are built from: the executor of an `EngineSpec` (model
loaded, graphs captured), and the `ServedModel` the routes answer for (its tokenizer, BOS
prefix and chat template; an API server reads them without the weights)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def served_model(dm, path: str | None, name: str | None, max_seq_len: int):
    """The `ServedModel` of a `DemoModel` (its chat template and special tokens, read from
    the checkpoint's tokenizer_config by `choose_model`)."""
    from graphexec.serve.chat import ChatTemplate
    from graphexec.serve.prompts import ServedModel

    default = _default_name(dm.spec, path)
    aliases = tuple(a for a in (path, dm.name) if a)
    return ServedModel(name or default, dm.tokenizer, max_seq_len, tuple(dm.prompt_prefix),
                       ChatTemplate(dm.chat_template, dict(dm.special_tokens)),
                       aliases)  # fmt: skip


def _default_name(spec, path: str | None) -> str:
    folder = path if path and Path(path).is_dir() else None
    if folder:
        return Path(folder).resolve().name
    return "tinylm" if spec.kind == "tiny" else spec.name


def front_model(path: str | None, name: str | None, max_seq_len: int, engine_name: str):
    """An API server's `ServedModel`, read without the weights: the tokenizer, BOS prefix
    and chat template of the checkpoint (cl100k and no template for random weights)."""
    import graphexec as gx
    from graphexec.models.choice import resolve_model
    from graphexec.models.demo_model import bos_prefix
    from graphexec.serve.chat import ChatTemplate
    from graphexec.serve.prompts import ServedModel
    from graphexec.text.chat_template import read_tokenizer_config

    spec = resolve_model(path or "tiny")
    if spec.kind in ("checkpoint", "smollm2"):
        tok, prefix = gx.Tokenizer.from_pretrained(spec.folder), bos_prefix(spec.folder)
        template, special = read_tokenizer_config(spec.folder)
    else:
        tok, prefix, template, special = gx.Tokenizer.cl100k(), (), None, {}
    aliases = tuple(a for a in (path, engine_name) if a)
    return ServedModel(name or _default_name(spec, path), tok, max_seq_len, prefix,
                       ChatTemplate(template, dict(special)), aliases)  # fmt: skip


def build_executor(spec):
    """(the executor, its `DemoModel`) of a `processes.EngineSpec`: the model loaded, graphs
    captured (emulated on the CPU) unless `capture` is off. ModelChoiceError for a bad --model."""
    import torch

    import graphexec as gx
    from graphexec.models.choice import resolve_model
    from graphexec.models.demo_model import DTYPES, choose_dtype, choose_model
    from graphexec.runtime.threads import configure_threads
    from graphexec.serve.context import context_length, free_memory

    device = torch.device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # the count `server.resolve_threads` fixed and logged (set as is, said once)
    configure_threads(str(device), spec.threads, quiet=spec.threads is not None)
    kw = {} if spec.seed is None else {"seed": spec.seed}
    n = spec.max_batch_size or (64 if device.type == "cuda" else 16)
    chosen = resolve_model(spec.model or "tiny")
    max_seq_len = spec.max_seq_len
    if max_seq_len is None and chosen.config is not None:  # the model's own, memory allowing
        cfg = chosen.config
        dt = choose_dtype(spec.dtype, device) or DTYPES.get(
            str(cfg.get("torch_dtype") or cfg.get("dtype")), torch.bfloat16)  # fmt: skip
        max_seq_len, note = context_length(cfg, dt.itemsize, n + 1, free_memory(device),
                                           spec.engines)  # fmt: skip
        log.info("%s", note)
    dm = choose_model(chosen, device, spec.dtype, max_seq_len, **kw)
    draft = gx.SpeculativeConfig(drafter="ngram") if spec.speculative else None
    # on CUDA the pipelined step (the default there): the engine loop's sends and reads
    # overlap the device's next step
    ex = gx.DecodeExecutor(dm.make(), max_batch_size=n, device=device, tokenizer=dm.tokenizer,
                           seed=spec.seed, speculative=draft)  # fmt: skip
    # the library's default on every device, as the demo: captured keys replay (on the
    # CPU the capture is emulated: each key's recorded call on the same static buffers,
    # the same tokens as eager), so graph_replays_total counts them there too
    if spec.capture:
        t1 = time.perf_counter()
        ex.capture(capture_keys(spec.capture_keys, ex))
        how = "" if device.type == "cuda" else " (emulated: no CUDA)"
        log.info("captured %d graphs%s in %.1f s", len(ex.graph_keys), how,
                 time.perf_counter() - t1)  # fmt: skip
    return ex, dm


def parse_capture_keys(names) -> list[tuple[str, bool]]:
    """(variant, logprobs) of each --capture-keys name; ValueError naming the flag."""
    from graphexec.params import SamplerVariant

    out = []
    for name in names or ():
        variant, _, lp = name.partition("+")
        if variant not in {v.value for v in SamplerVariant} or lp not in ("", "logprobs"):
            names = ", ".join(v.value for v in SamplerVariant)
            raise ValueError(f"--capture-keys: {name!r} is not VARIANT or VARIANT+logprobs "
                             f"(variants: {names})")  # fmt: skip
        out.append((variant, bool(lp)))
    return out


def capture_keys(names, ex) -> list | None:
    """The GraphKeys of --capture-keys at every bucket and speculative width of `ex`;
    None (every key) without names."""
    from graphexec.params import SamplerVariant
    from graphexec.request import GraphKey

    if not names:
        return None
    return [GraphKey(SamplerVariant(v), b, lp, k) for v, lp in parse_capture_keys(names)
            for b in ex.buckets for k in ex.runner.spec_ks]  # fmt: skip
