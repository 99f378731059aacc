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
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health and "
                   "/metrics (default: $GRAPHEXEC_API_KEY, else none)")  # fmt: skip
    p.add_argument("--log-level", default="info")
    add_threads_argument(p)


def served_model(dm, path: str | None, name: str | None, max_seq_len: int):
    """The `ServedModel` of a `DemoModel` (its chat template and special tokens, read from
    the checkpoint's tokenizer_config by `choose_model`)."""
    from graphexec.serve.app import ServedModel
    from graphexec.serve.chat import ChatTemplate

    folder = path if path and Path(path).is_dir() else None
    default = (
        Path(path).resolve().name
        if folder
        else ("tinylm" if dm.spec.kind == "tiny" else dm.spec.name)
    )
    aliases = tuple(a for a in (path, dm.name) if a)
    return ServedModel(name or default, dm.tokenizer, max_seq_len, tuple(dm.prompt_prefix),
                       ChatTemplate(dm.chat_template, dict(dm.special_tokens)),
                       aliases)  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 2 for a model that cannot be loaded."""
    import torch
    import uvicorn

    import graphexec as gx
    from graphexec.demo_model import ModelChoiceError, choose_model
    from graphexec.serve.app import build_app

    t0 = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        kw = {} if args.seed is None else {"seed": args.seed}
        dm = choose_model(args.model, device, args.dtype, args.max_seq_len, **kw)
    except ModelChoiceError as e:
        print(f"graphexec serve: {e}", file=sys.stderr)
        return 2
    if args.max_queue is not None and args.max_queue < 0:
        print("graphexec serve: --max-queue must be >= 0", file=sys.stderr)
        return 2
    n = args.max_batch_size or (64 if device.type == "cuda" else 16)
    spec = gx.SpeculativeConfig(drafter="ngram") if args.speculative else None
    model = dm.make()
    ex = gx.DecodeExecutor(model, max_batch_size=n, device=device, tokenizer=dm.tokenizer,
                           seed=args.seed, speculative=spec)  # fmt: skip
    if device.type == "cuda" and not args.no_capture:
        t1 = time.perf_counter()
        ex.capture()
        log.info("captured %d graphs in %.1f s", len(ex.graph_keys), time.perf_counter() - t1)
    sm = served_model(dm, args.model, args.served_model_name, model.max_seq_len)
    app = build_app(ex, sm, args.max_queue,
                    api_key=args.api_key or os.environ.get("GRAPHEXEC_API_KEY"))  # fmt: skip
    log.info("%s served as %r on http://%s:%d (max batch %d); ready in %.1f s", dm.name,
             sm.name, args.host, args.port, n, time.perf_counter() - t0)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
