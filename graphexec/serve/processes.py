"""`serve` as processes: `--data-parallel N` engine processes (engine i on GPU i), each
an `EngineCore` stepping its own executor, and `--api-servers M` HTTP processes on one
port, each an app over `RemoteEngines`. They talk over ZeroMQ ipc
sockets in a private folder; the parent starts the engines, waits until every one has
loaded (and captured), starts the API servers, and ends them all when any one ends.

Every engine runs the same model with the same weights, and the forward is
batch-invariant: a seeded request's tokens do not depend on which engine ran it (on GPUs
of one kind).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger(__name__)
LOG_FORMAT = "%(asctime)s %(processName)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process builds: the serve options that shape the executor."""

    model: str | None
    device: str | None
    dtype: str
    max_batch_size: int | None
    max_seq_len: int | None
    seed: int | None
    speculative: str | None
    capture: bool
    max_queue: int | None
    threads: int | None
    log_level: str = "info"
    capture_keys: tuple[str, ...] = ()  # --capture-keys; empty: every key
    engines: int = 1  # engine processes sharing the host's memory (--data-parallel)
    engine_nice: int = 0  # --engine-nice; 0: as started


@dataclass(frozen=True)
class ServerSpec:
    """What an API server process needs besides the engines' answers."""

    model: str | None
    served_model_name: str | None
    api_key: str | None
    log_level: str = "info"
    max_body_bytes: int = 4 * 1024 * 1024  # serve.prompts.MAX_BODY_BYTES


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def engine_main(spec: EngineSpec, index: int, gpu: int | None, addr: str,
                server_addrs: list[str], ready: Any) -> None:  # fmt: skip
    """An engine process: build the executor, report ready (or the error), then loop."""
    if gpu is not None:  # before CUDA starts: this process sees its one GPU as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    _logging(spec.log_level)
    if spec.engine_nice:  # first: the threads started later inherit it
        from graphexec.runtime.threads import set_nice

        try:
            set_nice(spec.engine_nice)
        except PermissionError as e:
            log.warning("engine %d: --engine-nice %d not applied: %s", index,
                        spec.engine_nice, e)  # fmt: skip
    import zmq

    from graphexec.serve.engine_core import EngineCore
    from graphexec.serve.served import build_executor
    from graphexec.serve.wire import pull_socket, push_socket

    try:
        ex, dm = build_executor(spec)
    except Exception as e:  # noqa: BLE001 (the parent reports it)
        log.exception("engine %d failed to start", index)
        ready.put((index, None, f"{type(e).__name__}: {e}"))
        return
    ctx = zmq.Context()
    inbox = pull_socket(ctx, addr)
    outboxes = [push_socket(ctx, a) for a in server_addrs]
    info = (ex.max_batch_size, ex.model.vocab_size, ex.model.max_seq_len)
    ready.put((index, (info, dm.name), None))
    queue_len = 4 * ex.max_batch_size if spec.max_queue is None else spec.max_queue
    try:
        EngineCore(ex, index, queue_len, inbox, outboxes).run()
    except KeyboardInterrupt:
        pass


def server_main(spec: ServerSpec, index: int, sock: socket.socket, addr: str,
                engine_addrs: list[str], infos: list[tuple], name: str) -> None:  # fmt: skip
    """An API server process: the app over the engines, on the shared socket."""
    _logging(spec.log_level)
    import uvicorn

    from graphexec.serve.app import app_over
    from graphexec.serve.metrics import ServerMetrics
    from graphexec.serve.remote import EngineInfo, RemoteEngines
    from graphexec.serve.served import front_model

    model = front_model(spec.model, spec.served_model_name, infos[0][2], name)
    metrics = ServerMetrics(api_server=index)
    engines = RemoteEngines(index, addr, engine_addrs, [EngineInfo(*i) for i in infos],
                            on_admitted=metrics.queue.observe)  # fmt: skip
    app = app_over(engines, model, metrics, spec.api_key, spec.max_body_bytes)
    config = uvicorn.Config(app, log_level=spec.log_level, timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass


def gpus_for(device: str | None, engines: int) -> list[int | None]:
    """Engine i's GPU: i on CUDA (ValueError when there are fewer), None on the CPU."""
    import torch

    cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if not cuda:
        return [None] * engines
    have = torch.cuda.device_count()
    if engines > have:
        raise ValueError(f"--data-parallel {engines} needs {engines} GPUs; {have} visible")
    return list(range(engines))


def run(engine: EngineSpec, server: ServerSpec, host: str, port: int, engines: int,
        api_servers: int) -> int:  # fmt: skip
    """Start everything, serve until a signal or a process ends; the exit code."""
    gpus = gpus_for(engine.device, engines)
    if gpus[0] is None and engines > 1:  # one host's memory, shared (threads: `serve`)
        engine = replace(engine, engines=engines)
    ctx = multiprocessing.get_context("spawn")
    folder = tempfile.mkdtemp(prefix="graphexec-serve-")
    e_addrs = [f"ipc://{folder}/engine-{i}" for i in range(engines)]
    s_addrs = [f"ipc://{folder}/server-{j}" for j in range(api_servers)]
    procs: list[multiprocessing.process.BaseProcess] = []
    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        ready = ctx.Queue()
        for i in range(engines):
            p = ctx.Process(target=engine_main, name=f"engine-{i}",
                            args=(engine, i, gpus[i], e_addrs[i], s_addrs, ready))  # fmt: skip
            p.start()
            procs.append(p)
        got = _wait_ready(ready, procs, engines, stop)
        if got is None:
            return 2 if stop["signal"] is None else 0
        infos = [got[i][0] for i in range(engines)]
        socks = listen_sockets(host, port, api_servers)
        for j in range(api_servers):
            p = ctx.Process(target=server_main, name=f"api-server-{j}",
                            args=(server, j, socks[j % len(socks)], s_addrs[j], e_addrs,
                                  infos, got[0][1]))  # fmt: skip
            p.start()
            procs.append(p)
        for sock in socks:
            sock.close()
        log.info("serving on http://%s:%d: %d engine(s), %d API server(s)", host, port,
                 engines, api_servers)  # fmt: skip
        while stop["signal"] is None:
            done = multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.5)
            if done:
                p = next(p for p in procs if p.sentinel in done)
                log.error("%s exited (code %s); stopping the server", p.name, p.exitcode)
                return 1
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop_all(procs)
        shutil.rmtree(folder, ignore_errors=True)


def listen_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """Listening sockets on (host, port) for n API servers: on Linux one per server, with
    SO_REUSEPORT, so the kernel spreads connections evenly over them; elsewhere (or n = 1)
    one socket they share. (With a shared socket the idle processes race to accept: 1,024
    connections opened at once landed 99 / 179 / 332 / 414 on four processes here, and a
    process holding 400 keep-alive streams falls seconds behind; with SO_REUSEPORT 242 /
    273 / 273 / 236.) Port 0: one free port, the same for all."""
    per_server = n > 1 and hasattr(socket, "SO_REUSEPORT") and os.uname().sysname == "Linux"
    socks: list[socket.socket] = []
    try:
        for _ in range(n if per_server else 1):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if per_server:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(2048)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def _wait_ready(ready, procs, n: int, stop: dict) -> dict[int, tuple] | None:
    got: dict[int, tuple] = {}
    while len(got) < n:
        if stop["signal"] is not None:
            return None
        try:
            i, info, err = ready.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode is not None]
            if dead:
                log.error("%s exited (code %s) before it was ready", dead[0].name,
                          dead[0].exitcode)  # fmt: skip
                return None
            continue
        if err is not None:
            log.error("engine %d could not start: %s", i, err)
            return None
        got[i] = info
    return got


def _stop_all(procs, grace_s: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    t = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, t - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
