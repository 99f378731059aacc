"""The load test's HTTP client: one keep-alive HTTP/1.1 connection per simulated user,
written and read with asyncio streams, no client library.

Why not httpx: at 1,024 streams on one 16-core host (the engine, the API servers and the
client processes together) httpx's per-request and per-chunk work saturated the clients,
and requests waited in their own connection pool before a byte went out: the test
measured its clients. This does only what the test needs: write a POST with a JSON body,
read the status and headers, then the chunked body's server-sent-event lines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A response other than 200, or a malformed one."""


class Connection:
    """A keep-alive connection to `base_url` (http://host:port), (re)opened on demand."""

    def __init__(self, base_url: str) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"base_url must be http://host[:port], got {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None
        self.opened = 0  # connections opened so far

    async def close(self) -> None:
        if self._w is not None:
            self._w.close()
            try:
                await self._w.wait_closed()
            except (ConnectionError, OSError):
                pass
        self._r = self._w = None

    async def post_events(self, path: str, body: bytes, stamps: dict) -> AsyncIterator[str]:
        """POST `body` (JSON) to `path`; yield each `data: ` line's payload of the event
        stream. `stamps` gets "connected" (a connection was opened for it), "wrote" (the
        request handed to the socket) and "headers" (the response's headers read), as
        time.monotonic(). HTTPError on a status other than 200; a broken connection
        raises and is reopened by the next call."""
        if self._w is None:
            self._r, self._w = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
            self.opened += 1
            stamps["connected"] = True
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        error = None
        try:
            self._w.write(head.encode() + body)
            await self._w.drain()
            stamps["wrote"] = time.monotonic()
            status, headers = await self._head()
            stamps["headers"] = time.monotonic()
            if status != 200:  # read whole, so the connection stays usable
                n = int(headers.get("content-length", "0"))
                error = HTTPError(f"HTTP {status}: {(await self._r.readexactly(n))[:200]!r}")
            elif headers.get("transfer-encoding", "").lower() != "chunked":
                raise HTTPError("expected a chunked event stream")
            else:
                async for line in self._lines():
                    if line.startswith("data: "):
                        yield line[6:]
            if headers.get("connection", "").lower() == "close":
                await self.close()
        except BaseException:
            await self.close()  # a half-read response leaves the connection unusable
            raise
        if error is not None:
            raise error

    async def _head(self) -> tuple[int, dict[str, str]]:
        status_line = await self._r.readuntil(b"\r\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise HTTPError(f"bad status line {status_line[:80]!r}")
        headers = {}
        while (line := await self._r.readuntil(b"\r\n")) != b"\r\n":
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return int(parts[1]), headers

    async def _lines(self) -> AsyncIterator[str]:
        """The chunked body's lines (an event may span chunks, a chunk hold several)."""
        rest = b""
        while size := int((await self._r.readuntil(b"\r\n")).split(b";")[0], 16):
            data = rest + (await self._r.readexactly(size + 2))[:-2]
            *lines, rest = data.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        while await self._r.readuntil(b"\r\n") != b"\r\n":  # trailers, then the end
            pass
        if rest:
            yield rest.rstrip(b"\r").decode()
