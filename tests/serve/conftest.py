"""The serve tests' checkpoint (a tiny random Llama with a trained byte-level BPE
tokenizer and a chat template) and a server subprocess on a free port (`shared_server`:
one a worker, kept up between the runs of its module's tests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.text.test_hf_tokenizer import build_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("openai")

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('no tools here') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    folder = build_llama(tmp_path_factory.mktemp("serve_llama"), max_positions=2048)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
    }))  # fmt: skip
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `python -m graphexec serve` subprocess; `url` is its base URL."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "graphexec", "serve", "--model", str(folder), "--device",
               "cpu", "--port", str(self.port), "--threads", "1", "--seed", "0",
               "--log-level", "warning", *args]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would block it
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"the server exited: {self.log.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not become healthy in 90 s")

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_for(self, pred, timeout: float = 10.0) -> dict:
        """/health once pred(health) holds (asserts that it does in time)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if pred(h) or time.monotonic() > deadline:
                assert pred(h), h
                return h
            time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


_SHARED: dict[tuple[str, ...], Server] = {}


def shared_server(folder: Path, *args: str) -> Server:
    """The server of these arguments, started once: it stays up (idle, it takes no CPU)
    until another one is asked for or the session ends. xdist's worksteal can interleave a
    module's tests with other modules' on a worker, and a module-scoped fixture then starts
    its server again for each run of them; this keeps one server a worker at a time."""
    key = (str(folder), *args)
    s = _SHARED.get(key)
    if s is None or s.proc.poll() is not None:
        stop_shared()
        s = _SHARED[key] = Server(folder, *args)
    return s


def stop_shared() -> None:
    while _SHARED:
        _SHARED.popitem()[1].stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_servers():
    yield
    stop_shared()
