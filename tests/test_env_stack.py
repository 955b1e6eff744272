"""``cope_rlhf.local.env_stack.EnvStack``, the env side of a local run, on the real gateway and BabyAI server: it
reports the URL of a healthy gateway, writes the gateway's and the replica's output to the log it was given, and on
exit (clean, or a start that timed out) leaves no process and no open log behind. A gateway URL given by the user is
checked, and an unhealthy one refused with what to do."""

from __future__ import annotations

import os
import socket

import pytest

from cope_rlhf.local.env_stack import EnvStack, gateway_health
from tests.env_server_proc import require_venv


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_stack_serves_a_healthy_gateway_logs_where_asked_and_leaves_nothing(tmp_path):
    require_venv("babyai")
    log_path = tmp_path / "run" / "gateway.log"  # its folder does not exist yet
    with EnvStack("babyai", log_path=str(log_path)) as stack:
        health = gateway_health(stack.url)
        assert health is not None and "babyai" in str(health), health
        pgid = stack.proc.pid
        assert group_alive(pgid)
    assert stack.log.closed
    assert not group_alive(pgid), "the gateway or its replica outlived the stack"
    text = log_path.read_text(errors="replace")
    assert f"gateway listening on {stack.url}" in text and "babyai replica" in text, text[-2000:]


def test_a_start_that_times_out_stops_the_gateway_closes_the_log_and_names_it(tmp_path):
    require_venv("babyai")
    log_path = tmp_path / "gateway.log"
    stack = EnvStack("babyai", startup_timeout=0.01, log_path=str(log_path))
    with pytest.raises(TimeoutError, match=str(log_path)):
        stack.__enter__()
    assert stack.log.closed and stack.proc.poll() is not None
    assert not group_alive(stack.proc.pid)


def test_an_unhealthy_gateway_url_is_refused_with_what_to_do():
    with socket.socket() as bound:  # bound but not listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(ConnectionError, match="drop --local.gateway_url"):
            with EnvStack("babyai", url=url):
                pass
