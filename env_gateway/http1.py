"""A small keep-alive HTTP/1.1 client for the gateway's JSON calls to its backends, parsing with llhttp.

Why not aiohttp's client here: the gateway makes one backend call per agent request, and on the small JSON
messages of env servers aiohttp's client costs more CPU than the bytes it moves (benchmarks/gateway_bench.py method
(f); docs/results/gateway_bench.md). This client is an ``asyncio.Protocol`` that writes a request in one call and
hands every byte of the answer to llhttp (Node.js's HTTP parser, through ``httptools``, as uvicorn uses it): framing
(``Content-Length``, chunked, to the close), stray bytes and malformed answers are the maintained parser's to judge,
not ours. It replaced a hand-written parser that re-scanned a chunked answer on every read (quadratic time), read
answers of any size, and handed a stray CRLF after one answer to the next request on the connection.

Contract: ``await pool.request(method, url, path, body=None, timeout=s)`` -> ``(status, body bytes)``.
- One request per connection at a time; idle connections are reused per (scheme, host, port) for at most
  ``idle_timeout`` seconds (below uvicorn's 5 s keep-alive, so a server rarely closes one under us). A connection
  is reused only when llhttp says it may be kept alive and nothing but the answer came on it: bytes that arrive
  after an answer (or between requests) drop the connection, so they can never reach another request.
- ``timeout`` bounds the whole request, however slowly the answer trickles in; an answer of more than
  ``max_answer_bytes`` bytes on the wire (head, framing and body) is refused as soon as it passes that size, so
  neither time nor memory per request depends on what a backend sends.
- Every failure raises ``HttpError`` with ``connected`` (False: the request never left, safe to retry anywhere),
  ``timed_out``, and ``answered`` (True: the server answered, with something that is not a usable HTTP answer:
  malformed, or over the size limit; the server is up). A failed connection is dropped, never reused.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from urllib.parse import urlsplit

import httptools

DEFAULT_MAX_ANSWER = 8 << 20  # bytes: far above any env server's answer (observations are text, a few KB)
_FRAMING = (b"content-length", b"transfer-encoding")


class HttpError(Exception):
    def __init__(self, message: str, *, connected: bool, timed_out: bool = False, answered: bool = False):
        super().__init__(message)
        self.connected, self.timed_out, self.answered = connected, timed_out, answered


class _Connection(asyncio.Protocol):
    """One connection: llhttp's callbacks (``on_*``) collect the answer of the request in flight (``waiter``)."""

    def __init__(self, max_answer: int = DEFAULT_MAX_ANSWER) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0
        self.max_answer = max_answer
        self.start(None)

    def start(self, waiter: asyncio.Future | None) -> None:
        """Expect a new answer, for ``waiter``."""
        self.waiter = waiter
        self.received = 0  # bytes of this answer so far, on the wire
        self.body = bytearray()  # appended to in place: an answer in many small reads costs linear time
        self.headers_done = self.framed = self.complete = False
        self.reusable = True

    # ---- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self.headers_done and not self.framed:  # neither a length nor chunks: the body runs to the close
            waiter.set_result((self.parser.get_status_code(), bytes(self.body)))
        else:
            waiter.set_exception(HttpError(f"connection lost ({exc or 'closed by the server'})", connected=True))

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():  # bytes no request asked for: the connection is out of step
            self.drop()
            return
        self.received += len(data)
        if self.received > self.max_answer:
            waiter.set_exception(HttpError(f"the answer is over {self.max_answer} bytes (the gateway's "
                                           "--max-answer-bytes)", connected=True, answered=True))
            self.drop()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.drop()
            if not waiter.done():
                waiter.set_exception(HttpError(f"not a valid HTTP answer ({e})", connected=True, answered=True))

    # ---- llhttp callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: whatever it is, this connection is not to be trusted
            self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.framed and name.lower() in _FRAMING:
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, data: bytes) -> None:
        if not self.complete:
            self.body += data

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if self.complete or status < 200:  # a stray second answer, or an interim 1xx: not the answer
            self.headers_done = self.framed = False
            return
        self.complete = True
        self.reusable = self.reusable and self.parser.should_keep_alive()
        self.waiter.set_result((status, bytes(self.body)))

    def drop(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()


class Http1Pool:
    def __init__(self, idle_timeout: float = 4.0, max_idle_per_host: int = 1024,
                 max_answer_bytes: int = DEFAULT_MAX_ANSWER):
        self.idle_timeout, self.max_idle, self.max_answer = idle_timeout, max_idle_per_host, max_answer_bytes
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
                lambda: _Connection(self.max_answer), host, port, ssl=self._ssl if scheme == "https" else None),
                max(deadline - now, 0.001))
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
        waiter = loop.create_future()
        conn.start(waiter)
        timer = loop.call_later(max(deadline - time.monotonic(), 0.001), lambda: waiter.done() or waiter.set_exception(
            HttpError(f"{method} {path} timed out after {timeout:g}s", connected=True, timed_out=True)))
        try:
            conn.transport.write(head + body if body else head)
            status, data = await waiter
        except BaseException:
            conn.drop()  # a half-read answer must never reach the next request
            raise
        finally:
            timer.cancel()
            conn.waiter = None
        if conn.closed or not conn.reusable:
            conn.drop()
        else:
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
