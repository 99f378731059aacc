"""`python -m graphexec serve`: load the model, build the executor (graphs captured before
serving on CUDA), and run the app on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve subcommand's options."""
    from graphexec.model_choice import add_model_argument
    from graphexec.threads import add_threads_argument, positive_int

    add_model_argument(p)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the folder's or config's name, "
                   "smollm2, tinylm or table)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for remote clients)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--max-batch-size", type=positive_int, default=None,
                   help="slots (requests running at once); default 64 GPU, 16 CPU")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests that may wait for a slot (default 4x max batch size); "
                   "past it: 503 with Retry-After")  # fmt: skip
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="verify n-gram drafts in every step (strict: the same tokens)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds TinyLM's weights and the seeds drawn for unseeded requests "
                   "(default: weights seed 0, drawn seeds from OS entropy)")  # fmt: skip
    p.add_argument(
        "--no-capture",
        action="store_true",
        help="serve without capturing CUDA graphs first (steps run eagerly)",
    )
    p.add_argument("--capture-keys", nargs="+", default=None, metavar="KEY",
                   help="capture only these graphs, each VARIANT or VARIANT+logprobs (no_filter, "
                   "top_k_top_p, default), at every bucket; other steps run eagerly, with the "
                   "same tokens (default: every key)")  # fmt: skip
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health and "
                   "/metrics (default: $GRAPHEXEC_API_KEY, else none)")  # fmt: skip
    p.add_argument("--api-servers", type=int, default=1, metavar="M",
                   help="HTTP server processes sharing the port, each apart from the engine "
                   "processes (default 1); 0: the app and one engine in this process")  # fmt: skip
    p.add_argument("--data-parallel", type=positive_int, default=1, metavar="N",
                   help="engines, one per GPU (cuda:0..N-1), behind the same API servers; "
                   "requests go to the least-loaded one (default 1)")  # fmt: skip
    p.add_argument("--log-level", default="info")
    add_threads_argument(p)


def served_model(dm, path: str | None, name: str | None, max_seq_len: int):
    """The `ServedModel` of a `DemoModel` (its chat template and special tokens, read from
    the checkpoint's tokenizer_config by `choose_model`)."""
    from graphexec.serve.app import ServedModel
    from graphexec.serve.chat import ChatTemplate

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
    from graphexec.chat import read_tokenizer_config
    from graphexec.demo_model import bos_prefix
    from graphexec.model_choice import resolve_model
    from graphexec.serve.app import ServedModel
    from graphexec.serve.chat import ChatTemplate

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
    """(the executor, its `DemoModel`) of a `launch.EngineSpec`: the model loaded, graphs
    captured on CUDA unless `capture` is off. ModelChoiceError for a bad --model."""
    import torch

    import graphexec as gx
    from graphexec.demo_model import choose_model
    from graphexec.threads import configure_threads

    device = torch.device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configure_threads(str(device), spec.threads)
    kw = {} if spec.seed is None else {"seed": spec.seed}
    dm = choose_model(spec.model, device, spec.dtype, spec.max_seq_len, **kw)
    n = spec.max_batch_size or (64 if device.type == "cuda" else 16)
    draft = gx.SpeculativeConfig(drafter="ngram") if spec.speculative else None
    # the pipelined step: the engine loop's sends and reads overlap the device's next step
    ex = gx.DecodeExecutor(dm.make(), max_batch_size=n, device=device, tokenizer=dm.tokenizer,
                           seed=spec.seed, speculative=draft, overlap=True)  # fmt: skip
    if device.type == "cuda" and spec.capture:
        t1 = time.perf_counter()
        ex.capture(capture_keys(spec.capture_keys, ex))
        log.info("captured %d graphs in %.1f s", len(ex.graph_keys), time.perf_counter() - t1)
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


def engine_spec(args: argparse.Namespace):
    from graphexec.serve.launch import EngineSpec

    return EngineSpec(args.model, args.device, args.dtype, args.max_batch_size,
                      args.max_seq_len, args.seed, args.speculative, not args.no_capture,
                      args.max_queue, getattr(args, "threads", None), args.log_level,
                      tuple(args.capture_keys or ()))  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 2 for a model that cannot be loaded or bad
    options."""
    from graphexec.demo_model import ModelChoiceError
    from graphexec.model_choice import resolve_model

    if args.max_queue is not None and args.max_queue < 0:
        print("graphexec serve: --max-queue must be >= 0", file=sys.stderr)
        return 2
    if args.api_servers < 0:
        print("graphexec serve: --api-servers must be >= 0", file=sys.stderr)
        return 2
    if args.api_servers == 0 and args.data_parallel > 1:
        print("graphexec serve: --data-parallel needs --api-servers >= 1", file=sys.stderr)
        return 2
    try:
        resolve_model(args.model or "tiny")
        parse_capture_keys(args.capture_keys)
    except (ModelChoiceError, ValueError) as e:
        print(f"graphexec serve: {e}", file=sys.stderr)
        return 2
    if args.api_servers == 0:
        return _serve_in_process(args)
    from graphexec.serve.launch import ServerSpec, gpus_for, run

    try:
        gpus_for(args.device, args.data_parallel)
    except ValueError as e:
        print(f"graphexec serve: {e}", file=sys.stderr)
        return 2
    server = ServerSpec(
        args.model,
        args.served_model_name,
        args.api_key or os.environ.get("GRAPHEXEC_API_KEY"),
        args.log_level,
    )
    return run(engine_spec(args), server, args.host, args.port, args.data_parallel,
               args.api_servers)  # fmt: skip


def _serve_in_process(args: argparse.Namespace) -> int:
    import uvicorn

    from graphexec.demo_model import ModelChoiceError
    from graphexec.serve.app import build_app

    t0 = time.perf_counter()
    try:
        ex, dm = build_executor(engine_spec(args))
    except ModelChoiceError as e:
        print(f"graphexec serve: {e}", file=sys.stderr)
        return 2
    sm = served_model(dm, args.model, args.served_model_name, ex.model.max_seq_len)
    app = build_app(ex, sm, args.max_queue,
                    api_key=args.api_key or os.environ.get("GRAPHEXEC_API_KEY"))  # fmt: skip
    log.info("%s served as %r on http://%s:%d (max batch %d); ready in %.1f s", dm.name, sm.name,
             args.host, args.port, ex.max_batch_size, time.perf_counter() - t0)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
