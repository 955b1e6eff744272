"""The gateway benchmark (run by hand) still runs: a tiny configuration, every method, two paired runs.

Guards the script itself against rot: the real gateway, the bare reference proxy, the gateway on aiohttp's client and
the fake backend start as processes, every method completes its episodes with the backend's call counts matching,
and the ratios are printed as medians over the paired runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("gateway", "direct", "requests", "fresh", "bare", "aiohttp")


@pytest.mark.timeout(180)
def test_tiny_benchmark_runs_every_method_twice(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gateway_bench.py"), "--concurrency", "2", "--waves", "1",
         "--min-episodes", "4", "--steps", "3", "--delays", "0", "--repeats", "2", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((r["method"], r["rep"]) for r in rows) == sorted((m, rep) for m in METHODS for rep in (0, 1))
    for r in rows:
        assert r["episodes"] == 4 and r["eps_per_s"] > 0 and r["p50_ms"] > 0, r
    assert all(r["gw_overhead_p50_ms"] > 0 for r in rows if r["method"] == "gateway")
    ratios = next(line for line in proc.stdout.splitlines() if "conc=   2:" in line)
    for label in ("a/b", "a/c", "a/d", "a/e", "a/f"):
        assert f"{label} = " in ratios and "[" in ratios, ratios  # median [min-max] over the two runs
    decision = proc.stdout.split("backend transport: env_gateway/http1.py (llhttp via httptools) against aiohttp's "
                                 "client (f) (median over 2 paired runs [min-max]):\n", 1)[1].splitlines()[0]
    assert "conc=   2: episodes/s a/f = " in decision and "gateway CPU per backend request f/a = " in decision
    assert "no request lost or duplicated" in proc.stdout


def test_aiohttp_alternative_keeps_the_transport_contract():
    """Method (f) compares transports, so its aiohttp pool must do what env_gateway/http1.py does for the gateway:
    the body bytes of sized and chunked answers, and HttpError's connected / timed_out on a slow server and a dead
    port (the gateway's retry and failure handling read them)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from aiohttp_gateway import AiohttpPool

    from env_gateway.http1 import HttpError
    from tests.env_server_proc import refusing_port
    from tests.test_gateway import run
    from tests.test_gateway_http1 import aiohttp_server

    async def main():
        runner, url, _ = await aiohttp_server()
        pool = AiohttpPool()
        try:
            status, body = await pool.request("POST", url, "/echo?x=1", b'{"a": 1}', 5)
            assert status == 200 and json.loads(body) == {"path": "/echo?x=1", "body": '{"a": 1}'}
            assert json.loads((await pool.request("GET", url, "/chunked", None, 5))[1]) == {"parts": [1, 2, 3]}
            with pytest.raises(HttpError, match="timed out after 0.2s") as e:
                await pool.request("POST", url, "/slow", b"{}", 0.2)
            assert e.value.timed_out and e.value.connected
            with refusing_port() as dead, pytest.raises(HttpError, match="cannot connect") as e:
                await pool.request("GET", f"http://127.0.0.1:{dead.getsockname()[1]}", "/", None, 5)
            assert not e.value.connected and not e.value.timed_out
        finally:
            session = pool.session
            pool.close()
            await asyncio.sleep(0.01)
            assert session.closed
            await runner.cleanup()
    run(main())


def test_a_ratio_with_a_zero_denominator_is_left_out_and_said():
    """A tiny cell's gateway CPU time can be 0 (under the clock tick): the CPU ratio f/a divided by it (seen failing
    the tiny run above with ZeroDivisionError)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gateway_bench

    def row(cpu_gw: float) -> dict:
        return {"cpu_us": [1.0, cpu_gw, 1.0], "eps_per_s": 2.0}

    def cpu(a: dict, o: dict) -> float:
        return o["cpu_us"][1] / a["cpu_us"][1]

    by = {(0, 2, 0, "gateway"): row(0.0), (0, 2, 0, "aiohttp"): row(300.0),
          (0, 2, 1, "gateway"): row(100.0), (0, 2, 1, "aiohttp"): row(300.0),
          (0, 2, 2, "gateway"): row(100.0), (0, 2, 2, "aiohttp"): row(200.0)}
    assert gateway_bench.paired_median(by, 3, 0, 2, "aiohttp", cpu) == "2.50 [2.00-3.00] (1 run with a zero denominator left out)"
    assert gateway_bench.paired_median(by, 1, 0, 2, "aiohttp", cpu) == "n/a (1 run with a zero denominator left out)"
    assert gateway_bench.paired_median(by, 3, 0, 2, "direct", cpu) == ""
