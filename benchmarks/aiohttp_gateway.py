"""The gateway with aiohttp's client as its backend transport: the alternative to env_gateway/http1.py, for
benchmarks/gateway_bench.py's method (f).

Everything but the transport is the production gateway (``python -m env_gateway``'s ``main``, the same flags); the
``Http1Pool`` the gateway builds at start-up is replaced by ``AiohttpPool``, which keeps http1's contract on one
keep-alive ``aiohttp.ClientSession`` (no per-host connection cap: the gateway's admission control bounds them):

    await pool.request(method, url, path, body=None, timeout=s) -> (status, body bytes)
    every failure raises env_gateway.http1.HttpError: connected=False when the request never left (connect refused
    or timed out), timed_out=True when the deadline passed, answered=True for an answer aiohttp cannot parse or one
    over ``max_answer_bytes`` (read no further: the same bound as http1's)

    .venv/bin/python benchmarks/aiohttp_gateway.py <python -m env_gateway's flags>
"""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from env_gateway import __main__ as gateway_main  # noqa: E402
from env_gateway import server  # noqa: E402
from env_gateway.http1 import DEFAULT_MAX_ANSWER, HttpError  # noqa: E402

HEADERS = {"Accept": "application/json", "Content-Type": "application/json"}


class AiohttpPool:
    def __init__(self, max_answer_bytes: int = DEFAULT_MAX_ANSWER) -> None:
        self.session: aiohttp.ClientSession | None = None  # made on the first request, inside the gateway's loop
        self.max_answer = max_answer_bytes

    async def request(self, method: str, url: str, path: str, body: bytes | None = None,
                      timeout: float = 60.0) -> tuple[int, bytes]:
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=HEADERS,
                                                 skip_auto_headers=("User-Agent",))
        try:
            async with self.session.request(method, url + path, data=body,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if (resp.content_length or 0) > self.max_answer:
                    raise HttpError(f"the answer is over {self.max_answer} bytes", connected=True, answered=True)
                data = bytearray()
                async for chunk in resp.content.iter_any():
                    data += chunk
                    if len(data) > self.max_answer:
                        raise HttpError(f"the answer is over {self.max_answer} bytes", connected=True, answered=True)
                return resp.status, bytes(data)
        except aiohttp.ConnectionTimeoutError:
            raise HttpError(f"connecting to {url} timed out", connected=False, timed_out=True) from None
        except asyncio.TimeoutError:
            raise HttpError(f"{method} {path} timed out after {timeout:g}s", connected=True, timed_out=True) from None
        except aiohttp.ClientConnectorError as e:
            raise HttpError(f"cannot connect to {url} ({e})", connected=False) from None
        except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError) as e:
            raise HttpError(f"not a valid HTTP answer ({e})", connected=True, answered=True) from None
        except aiohttp.ClientError as e:
            raise HttpError(f"{method} {path} failed ({e})", connected=True) from None

    def close(self) -> None:
        if self.session is not None and not self.session.closed:
            asyncio.get_event_loop().create_task(self.session.close())


if __name__ == "__main__":
    server.Http1Pool = AiohttpPool  # the name Gateway's start-up builds its transport from
    gateway_main.main(sys.argv[1:])
