"""An aiohttp application served on 127.0.0.1 from a thread of its own, for tests whose code under test blocks the
caller's loop or runs elsewhere (litellm's synchronous client inside a server subprocess, a shell script):

    with Subclass() as app:      # serving once inside; app.url = "http://127.0.0.1:<port>"
        ...                      # stopped (runner cleaned up, loop stopped, thread joined) on leaving

A subclass gives ``routes()`` (aiohttp route definitions) and ``port`` (0: a free port the server binds itself)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web


class ThreadedApp:
    def __init__(self, port: int = 0) -> None:
        self.url, self.port = "", port
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name=type(self).__name__, daemon=True)

    def routes(self) -> list:
        raise NotImplementedError

    async def _start(self) -> str:
        app = web.Application()
        app.add_routes(self.routes())
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def __enter__(self) -> Any:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
