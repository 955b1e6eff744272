"""A small keep-alive HTTP/1.1 client for the gateway's JSON calls to its backends.

Why not aiohttp's client here: the gateway makes one backend call per agent request, and on the small
JSON messages of env servers aiohttp's client costs more CPU than the bytes it moves. Measured with the
gateway itself on each transport (benchmarks/gateway_bench.py method (f), 256 concurrent episodes, 2 cores):
on aiohttp's client the gateway spent 1.8x the CPU per backend request and served 1.3x fewer episodes/s
(docs/results/gateway_bench.md). This client is an ``asyncio.Protocol`` that writes a request in one call
and parses the answer with a few ``bytes`` operations.

Contract: ``await pool.request(method, url, path, body=None, timeout=s)`` -> ``(status, body bytes)``.
- One request per connection at a time; idle connections are reused per (scheme, host, port) for at most
  ``idle_timeout`` seconds (below uvicorn's 5 s keep-alive, so a server rarely closes one under us).
- Answers are read by ``Content-Length`` or ``Transfer-Encoding: chunked`` (or to the close, when neither);
  ``Connection: close`` answers close the connection afterwards.
- Every failure raises ``HttpError`` with ``connected`` (False: the request never left, safe to retry
  anywhere) and ``timed_out``; a timed-out or failed connection is dropped, never reused.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from urllib.parse import urlsplit


class HttpError(Exception):
    def __init__(self, message: str, *, connected: bool, timed_out: bool = False):
        super().__init__(message)
        self.connected, self.timed_out = connected, timed_out


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0
        self._head: tuple[int, int, int | None, bool, bool] | None = None  # status, body start, length, chunked, close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            if self._head is not None and self._head[2] is None and not self._head[3]:  # body runs to the close
                self._finish(len(self.buf))
            else:
                self.waiter.set_exception(HttpError(f"connection lost ({exc or 'closed by the server'})",
                                                    connected=True))

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is None or self.waiter.done():
            return
        if self._head is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).split(b"\r\n")
            try:
                status = int(lines[0].split(b" ", 2)[1])
            except (IndexError, ValueError):
                self.waiter.set_exception(HttpError(f"not an HTTP answer: {lines[0][:80]!r}", connected=True))
                return
            length, chunked, close = None, False, lines[0].startswith(b"HTTP/1.0")
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif name == b"connection":
                    close = value.strip().lower() == b"close"
            if status in (204, 304) or 100 <= status < 200:
                length = 0
            self._head = (status, end + 4, length, chunked, close)
        status, start, length, chunked, close = self._head
        if chunked:
            self._read_chunked(start)
        elif length is not None and len(self.buf) - start >= length:
            self._finish(start + length)

    def _read_chunked(self, start: int) -> None:
        pos, parts = start, []
        while True:
            eol = self.buf.find(b"\r\n", pos)
            if eol < 0:
                return
            size = int(bytes(self.buf[pos:eol]).split(b";")[0], 16)
            if size == 0:
                if self.buf.find(b"\r\n", eol + 2) < 0:  # trailers end with an empty line
                    return
                body = b"".join(parts)
                self.buf = bytearray(body)
                self._head = (self._head[0], 0, len(body), False, self._head[4])
                self._finish(len(body))
                return
            if len(self.buf) < eol + 2 + size + 2:
                return
            parts.append(bytes(self.buf[eol + 2:eol + 2 + size]))
            pos = eol + 2 + size + 2

    def _finish(self, end: int) -> None:
        status, start, _, _, close = self._head
        body = bytes(self.buf[start:end])
        del self.buf[:end]
        self._head = None
        if close:
            self.closed = True
            self.transport.close()
        self.waiter.set_result((status, body))


class Http1Pool:
    def __init__(self, idle_timeout: float = 4.0, max_idle_per_host: int = 1024):
        self.idle_timeout, self.max_idle = idle_timeout, max_idle_per_host
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._urls: dict[str, tuple[tuple[str, str, int], str]] = {}

    async def _connect(self, key: tuple[str, str, int], deadline: float) -> _Connection:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # most recent first: the least likely to have been closed by the server
            if not conn.closed and now - conn.idle_since < self.idle_timeout:
                return conn
            conn.transport.close()
        scheme, host, port = key
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                _Connection, host, port, ssl=self._ssl if scheme == "https" else None), max(deadline - now, 0.001))
        except asyncio.TimeoutError:
            raise HttpError(f"connecting to {host}:{port} timed out", connected=False, timed_out=True) from None
        except OSError as e:
            raise HttpError(f"cannot connect to {host}:{port} ({e.strerror or e})", connected=False) from None
        return conn

    def _key(self, url: str) -> tuple[tuple[str, str, int], str]:
        parsed = self._urls.get(url)
        if parsed is None:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            parsed = self._urls[url] = ((parts.scheme, parts.hostname or "127.0.0.1", port), parts.netloc)
        return parsed

    async def request(self, method: str, url: str, path: str, body: bytes | None = None,
                      timeout: float = 60.0) -> tuple[int, bytes]:
        key, netloc = self._key(url)
        deadline = time.monotonic() + timeout
        conn = await self._connect(key, deadline)
        loop = asyncio.get_running_loop()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\nAccept: application/json\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body) if body else 0}\r\n\r\n").encode()
        waiter = conn.waiter = loop.create_future()
        timer = loop.call_later(max(deadline - time.monotonic(), 0.001), lambda: waiter.done() or waiter.set_exception(
            HttpError(f"{method} {path} timed out after {timeout:g}s", connected=True, timed_out=True)))
        try:
            conn.transport.write(head + body if body else head)
            status, data = await waiter
        except BaseException:
            conn.closed = True  # a half-read answer must never reach the next request
            conn.transport.abort()
            raise
        finally:
            timer.cancel()
            conn.waiter = None
        if not conn.closed:
            conn.idle_since = time.monotonic()
            idle = self._idle.setdefault(key, collections.deque())
            if len(idle) < self.max_idle:
                idle.append(conn)
            else:
                conn.transport.close()
        return status, data

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.transport.close()
        self._idle.clear()
