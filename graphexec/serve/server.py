"""`python -m graphexec serve`: fix the engines' torch threads, load the model, build the
executor (graphs captured before serving; emulated on the CPU), and run the app on
uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serve subcommand's options."""
    from graphexec.models.choice import add_model_argument
    from graphexec.runtime.threads import add_threads_argument, positive_int
    from graphexec.serve.prompts import MAX_BODY_BYTES

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
    p.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N",
                   help="positions per request, prompt + output (default: the model's own "
                   "context, max_position_embeddings, capped so the KV cache takes at most "
                   "half the free memory; the log says which; TinyLM 256)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None,
                   help="seeds TinyLM's weights and the seeds drawn for unseeded requests "
                   "(default: weights seed 0, drawn seeds from OS entropy)")  # fmt: skip
    p.add_argument(
        "--no-capture",
        action="store_true",
        help="serve without capturing graphs first (CUDA graphs; on the CPU their emulation, "
        "the library's default too): steps run eagerly, the same tokens",
    )
    p.add_argument("--capture-keys", nargs="+", default=None, metavar="KEY",
                   help="capture only these graphs, each VARIANT or VARIANT+logprobs (no_filter, "
                   "top_k_top_p, default), at every bucket; other steps run eagerly, with the "
                   "same tokens (default: every key)")  # fmt: skip
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health and "
                   "/metrics (default: $GRAPHEXEC_API_KEY, else none)")  # fmt: skip
    p.add_argument("--max-body-bytes", type=positive_int, default=MAX_BODY_BYTES, metavar="N",
                   help="the largest request body taken; past it: 413 (default "
                   f"{MAX_BODY_BYTES}, 4 MiB)")  # fmt: skip
    p.add_argument("--api-servers", type=int, default=1, metavar="M",
                   help="HTTP server processes sharing the port, each apart from the engine "
                   "processes (default 1); 0: the app and one engine in this process")  # fmt: skip
    p.add_argument("--data-parallel", type=positive_int, default=1, metavar="N",
                   help="engines, one per GPU (cuda:0..N-1), behind the same API servers; "
                   "requests go to the least-loaded one (default 1)")  # fmt: skip
    p.add_argument("--engine-nice", type=int, default=0, metavar="N",
                   help="run the engine processes at nice N, e.g. -10: the step loop is "
                   "scheduled ahead of API servers and other work on a busy host (below "
                   "0 needs CAP_SYS_NICE; refused: a warning) (default 0: as started)")  # fmt: skip
    p.add_argument("--log-level", default="info")
    add_threads_argument(p, serve=True)


def resolve_threads(args: argparse.Namespace) -> str | None:
    """Fix serve's torch thread count in `args.threads` before any engine starts, and say
    where it came from (None: not set, a GPU engine without --threads keeps torch's):
    --threads, else on the CPU the cores this process may use split among the
    --data-parallel engines (`threads.engine_threads`). Each engine sets this number as it
    is; the launcher logs it once."""
    import torch

    from graphexec.runtime.threads import available_cores, engine_threads

    if args.threads is not None:
        return "--threads"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != "cpu":
        return None
    engines = getattr(args, "data_parallel", 1) or 1
    args.threads = engine_threads(engines)
    per = f" / {engines} engines" if engines > 1 else ""
    return f"the {available_cores()} cores this process may use{per}; --threads sets it"


def engine_spec(args: argparse.Namespace):
    from graphexec.serve.processes import EngineSpec

    return EngineSpec(args.model, args.device, args.dtype, args.max_batch_size,
                      args.max_seq_len, args.seed, args.speculative, not args.no_capture,
                      args.max_queue, getattr(args, "threads", None), args.log_level,
                      tuple(args.capture_keys or ()),
                      engine_nice=getattr(args, "engine_nice", 0))  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; 2 for a model that cannot be loaded or bad
    options."""
    from graphexec.models.choice import resolve_model
    from graphexec.models.demo_model import ModelChoiceError
    from graphexec.serve.served import parse_capture_keys

    if args.max_queue is not None and args.max_queue < 0:
        print("graphexec serve: --max-queue must be >= 0", file=sys.stderr)
        return 2
    if args.api_servers < 0:
        print("graphexec serve: --api-servers must be >= 0", file=sys.stderr)
        return 2
    if args.api_servers == 0 and args.data_parallel > 1:
        print("graphexec serve: --data-parallel needs --api-servers >= 1", file=sys.stderr)
        return 2
    if args.api_servers == 0 and getattr(args, "engine_nice", 0):
        print("graphexec serve: --engine-nice needs --api-servers >= 1 (an engine process "
              "of its own)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        resolve_model(args.model or "tiny")
        parse_capture_keys(args.capture_keys)
    except (ModelChoiceError, ValueError) as e:
        print(f"graphexec serve: {e}", file=sys.stderr)
        return 2
    why = resolve_threads(args)
    if why is not None:
        log.info("torch intra-op threads: %d per engine (%s)", args.threads, why)
    if args.api_servers == 0:
        return _serve_in_process(args)
    from graphexec.serve.processes import ServerSpec, gpus_for, run

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
        args.max_body_bytes,
    )
    return run(engine_spec(args), server, args.host, args.port, args.data_parallel,
               args.api_servers)  # fmt: skip


def _serve_in_process(args: argparse.Namespace) -> int:
    import uvicorn

    from graphexec.models.demo_model import ModelChoiceError
    from graphexec.serve.app import build_app
    from graphexec.serve.served import build_executor, served_model

    t0 = time.perf_counter()
    try:
        ex, dm = build_executor(engine_spec(args))
    except ModelChoiceError as e:
        print(f"graphexec serve: {e}", file=sys.stderr)
        return 2
    sm = served_model(dm, args.model, args.served_model_name, ex.model.max_seq_len)
    app = build_app(ex, sm, args.max_queue,
                    api_key=args.api_key or os.environ.get("GRAPHEXEC_API_KEY"),
                    max_body_bytes=args.max_body_bytes)  # fmt: skip
    log.info("%s served as %r on http://%s:%d (max batch %d); ready in %.1f s", dm.name, sm.name,
             args.host, args.port, ex.max_batch_size, time.perf_counter() - t0)  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
