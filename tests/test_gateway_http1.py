"""The gateway's keep-alive HTTP/1.1 client (env_gateway/http1.py) against real servers on 127.0.0.1: aiohttp
answers (sized and chunked), raw answers that close the connection, keep-alive reuse, timeouts, dead ports; and
against broken servers: answers in one-byte chunks (linear time), over the size limit, malformed, interim, doubled."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from env_gateway.http1 import Http1Pool, HttpError
from tests.env_server_proc import refusing_port
from tests.test_gateway import run

pytestmark = pytest.mark.timeout(30)


async def aiohttp_server():
    seen = {"peers": set()}

    async def echo(request: web.Request) -> web.Response:
        seen["peers"].add(request.transport.get_extra_info("peername"))
        return web.json_response({"path": request.path_qs, "body": (await request.read()).decode()})

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for part in (b'{"parts": ', b'[1, 2, ', b'3]}'):
            await resp.write(part)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.post("/echo", echo), web.get("/echo", echo), web.get("/chunked", chunked),
                    web.post("/slow", slow)])
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen


def test_sized_and_chunked_answers_and_keep_alive():
    async def main():
        runner, url, seen = await aiohttp_server()
        pool = Http1Pool()
        try:
            for i in range(5):
                status, body = await pool.request("POST", url, f"/echo?i={i}", json.dumps({"i": i}).encode(), 5)
                assert status == 200 and json.loads(body) == {"path": f"/echo?i={i}", "body": f'{{"i": {i}}}'}
            assert len(seen["peers"]) == 1  # one connection, reused
            status, body = await pool.request("GET", url, "/chunked", None, 5)
            assert status == 200 and json.loads(body) == {"parts": [1, 2, 3]}
            status, body = await pool.request("GET", url, "/nope", None, 5)
            assert status == 404
            stale = Http1Pool(idle_timeout=0.05)  # an idle connection past its time is not reused
            await stale.request("GET", url, "/echo", None, 5)
            await asyncio.sleep(0.1)
            await stale.request("GET", url, "/echo", None, 5)
            stale.close()
            assert len(seen["peers"]) == 3
            results = await asyncio.gather(*(pool.request("POST", url, "/echo", str(i).encode(), 5) for i in range(50)))
            assert [json.loads(b)["body"] for _, b in results] == [str(i) for i in range(50)]  # no mixed-up answers
        finally:
            pool.close()
            await runner.cleanup()
    run(main())


def test_timeout_drops_the_connection_and_dead_ports_say_not_connected():
    async def main():
        runner, url, seen = await aiohttp_server()
        pool = Http1Pool()
        try:
            with pytest.raises(HttpError, match="timed out after 0.2s") as e:
                await pool.request("POST", url, "/slow", b"{}", 0.2)
            assert e.value.timed_out and e.value.connected
            assert not any(pool._idle.values())  # never reused: its late answer would reach the next request
            status, _ = await pool.request("GET", url, "/echo", None, 5)
            assert status == 200
            with refusing_port() as dead, pytest.raises(HttpError, match="cannot connect") as e:
                await pool.request("GET", f"http://127.0.0.1:{dead.getsockname()[1]}", "/", None, 5)
            assert not e.value.connected and not e.value.timed_out
        finally:
            pool.close()
            await runner.cleanup()
    run(main())


def test_raw_answers_connection_close_read_to_close_and_lost_connections():
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n[1, 2]",  # no length: read to the close
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"cut",  # cut short: an error, not a hang
    ]

    async def main():
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answers.pop(0))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = Http1Pool()
        try:
            assert await pool.request("GET", url, "/", None, 5) == (200, b"{}")
            assert await pool.request("GET", url, "/", None, 5) == (200, b"[1, 2]")
            with pytest.raises(HttpError, match="connection lost") as e:
                await pool.request("GET", url, "/", None, 5)
            assert e.value.connected and not e.value.timed_out
            assert not any(pool._idle.values())
        finally:
            pool.close()
            server.close()
            await server.wait_closed()
    run(main())


async def raw_server(answer) -> tuple[asyncio.AbstractServer, str]:
    """A server that reads each request's head and answers with ``await answer(writer)``, keeping the connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_an_answer_in_one_byte_chunks_costs_linear_time():
    """Was quadratic: 100K / 200K / 400K / 800K one-byte chunks took 0.26 / 0.70 / 2.26 / 9.46 s (every read re-parsed
    every chunk so far), the event loop stalled throughout. Timed in CPU time (this process's: the test's server and
    the client), which other load on the machine skews far less than wall time."""
    async def main():
        async def one_byte_chunks(writer: asyncio.StreamWriter) -> None:
            n = int(sizes.pop(0))
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * n + b"0\r\n\r\n")
            await writer.drain()

        sizes = [1000, 200_000, 800_000, 200_000, 800_000]
        server, url = await raw_server(one_byte_chunks)
        pool = Http1Pool()
        took = []
        try:
            for n in list(sizes):
                t0 = time.process_time()
                status, body = await pool.request("GET", url, "/", None, 60)
                took.append(time.process_time() - t0)
                assert (status, body) == (200, b"x" * n)
            small, large = min(took[1], took[3]), min(took[2], took[4])  # the faster of two: less noise
            assert large < 8 * small, took  # 4x the size: ~4-5x the time (quadratic: ~16x; 100K -> 400K took ~10x)
        finally:
            pool.close()
            server.close()
    run(main(), timeout=60)


def test_an_answer_over_the_limit_fails_as_answered_and_is_not_read_on():
    """Was: an answer of any size was read whole (100 MB: the gateway's memory 45 -> 444 MB)."""
    async def main():
        written = []

        async def huge(writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50000000\r\n\r\n")
            for _ in range(500):
                writer.write(b"x" * 100_000)
                await writer.drain()
                written.append(1)

        server, url = await raw_server(huge)
        pool = Http1Pool(max_answer_bytes=200_000)
        try:
            with pytest.raises(HttpError, match=r"the answer is over 200000 bytes \(the gateway's --max-answer-bytes\)"
                               ) as e:
                await pool.request("GET", url, "/", None, 30)
            assert e.value.answered and e.value.connected and not e.value.timed_out
            await asyncio.sleep(0.2)
            assert len(written) < 100 and not any(pool._idle.values())
        finally:
            pool.close()
            server.close()
    run(main())


@pytest.mark.parametrize("answer", [b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n{}", b"SSH-2.0-OpenSSH\r\n\r\n",
                                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"])
def test_a_malformed_answer_fails_as_answered_and_drops_the_connection(answer):
    async def main():
        async def malformed(writer: asyncio.StreamWriter) -> None:
            writer.write(answer)

        server, url = await raw_server(malformed)
        pool = Http1Pool()
        try:
            with pytest.raises(HttpError, match="not a valid HTTP answer") as e:
                await pool.request("GET", url, "/", None, 5)
            assert e.value.answered and e.value.connected and not any(pool._idle.values())
        finally:
            pool.close()
            server.close()
    run(main())


def test_an_interim_100_answer_is_skipped_and_bytes_after_an_answer_drop_the_connection():
    async def main():
        answers = [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
                   b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
                   b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"]

        async def scripted(writer: asyncio.StreamWriter) -> None:
            writer.write(answers.pop(0))

        server, url = await raw_server(scripted)
        pool = Http1Pool()
        try:
            assert await pool.request("GET", url, "/", None, 5) == (200, b"{}")
            assert len(pool._idle[("http", "127.0.0.1", int(url.rsplit(":", 1)[1]))]) == 1
            assert await pool.request("GET", url, "/", None, 5) == (200, b"[]")  # a second answer came with it:
            assert not any(pool._idle.values())  # the connection is not reused
            assert await pool.request("GET", url, "/", None, 5) == (200, b"next")
        finally:
            pool.close()
            server.close()
    run(main())
