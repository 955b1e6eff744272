"""Every protocol adapter, end to end: gateway -> a fake backend speaking that variant (adapters.py) -> the same
normalised answers ({observation, reward, done, info}) for the agent func."""

from __future__ import annotations

import pytest

from env_gateway.adapters import ADAPTERS, Adapter, load_adapter
from env_gateway.client import BadRequest, GatewayClient, Overloaded
from env_gateway.config import ConfigError, EnvConfig, GatewayConfig
from env_gateway.fake_backend import expected_action, running
from tests.test_gateway import gateway, run

pytestmark = pytest.mark.timeout(60)

# gateway env name (picks the adapter) -> fake backend variant
CASES = {"babyai": "agentgym", "textcraft": "agentgym", "sciworld": "sciworld", "alfworld": "alfworld",
         "searchqa": "searchqa", "webshop": "webshop", "webarena": "webarena", "sokoban": "gym"}


@pytest.mark.parametrize("env,variant", CASES.items())
def test_adapter_full_episode(env, variant):
    n, item = 3, 11

    async def main():
        async with running(variant, episode_len=n) as (backend, burl):
            urls = {env: [burl]}
            async with gateway(urls) if env != "sokoban" else gym_gateway(burl) as (gw, url):
                async with GatewayClient(url) as client:
                    async with client.session(env, item) as s:
                        first = s.observation
                        rewards = []
                        while not s.done:
                            r = await s.step(expected_action(item, s.steps))
                            rewards.append(r.reward)
                        info = r.info
                    assert backend.counts["close"] == (0 if variant == "webshop" else 1)
                    assert backend.counts["step"] == n
        return first, rewards, info, backend

    first, rewards, info, backend = run(main())
    text = first[0]["content"] if variant == "gym" else first  # gym: chat messages
    assert text == f"item {item} step 0: say '{expected_action(item, 0)}'"
    if variant == "sciworld":  # the agent sees the cumulative score, the delta stays in info
        assert rewards == [33.0, 67.0, 100.0] and info["env_reward"] == 33
    else:
        assert rewards == [0.0] * (n - 1) + [1.0]
    if variant == "alfworld":
        assert info["available_actions"] == ["move 0", "move 1", "move 2", "move 3"]
    if variant == "webarena":
        assert info["terminated"] is True and info["truncated"] is False
    if variant == "gym":
        assert info["truncated"] is False


def gym_gateway(burl: str):
    return gateway({"sokoban": EnvConfig("sokoban", [burl], adapter="gym", options={"env_name": "fake/sokoban-v0"})})


def test_gym_adapter_takes_openai_messages_and_rejects_other_objects():
    async def main():
        async with running("gym", episode_len=2) as (backend, burl), gym_gateway(burl) as (gw, url):
            async with GatewayClient(url) as client:
                async with client.session("sokoban", 4) as s:
                    r = await s.step({"role": "assistant", "content": expected_action(4, 0)})
                    assert r.observation == [{"role": "user", "content": "item 4 step 1: say 'move 1'"}]
                    with pytest.raises(BadRequest, match="assistant message"):
                        await s.step({"tool": "x"})
    run(main())


def test_tau2_items_are_strings_and_agentgym_items_are_integers():
    async def main():
        async with running("webshop") as (backend, burl), gateway({"tau2": [burl], "babyai": [burl]}) as (gw, url):
            async with GatewayClient(url) as client:
                with pytest.raises(BadRequest, match="integer"):
                    await client.create("babyai", "retail_7")
                assert gw.pools["tau2"].adapter.item("retail_7") == "retail_7"
                assert gw.pools["babyai"].adapter.item("12") == 12
    run(main())


def test_adapter_lookup_and_config_errors():
    assert set(CASES) - {"sokoban"} <= set(ADAPTERS)
    assert load_adapter("env_gateway.adapters:SciWorldAdapter") is ADAPTERS["sciworld"]
    with pytest.raises(ValueError, match="known: agentgym"):
        load_adapter("nethack")
    with pytest.raises(ValueError, match="not a subclass"):
        load_adapter("env_gateway.config:GatewayConfig")
    with pytest.raises(ConfigError, match="no adapter named 'nethack'"):
        GatewayConfig(envs={"nethack": EnvConfig("nethack", ["http://127.0.0.1:1"])}).validate()
    with pytest.raises(ConfigError, match="http://"):
        GatewayConfig(envs={"babyai": EnvConfig("babyai", ["127.0.0.1:1"])}).validate()
    assert issubclass(load_adapter("gym"), Adapter)


def test_yaml_config_errors_name_the_setting(tmp_path):
    from env_gateway.config import load_yaml

    def write(text):
        path = tmp_path / "gw.yaml"
        path.write_text(text)
        return str(path)

    with pytest.raises(ConfigError, match="port must be of type int, got 'abc'"):
        load_yaml(write("port: abc\n"))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['prot'\]"):
        load_yaml(write("prot: 1\n"))
    with pytest.raises(ConfigError, match=r"envs.babyai: unknown key\(s\) \['url'\]"):
        load_yaml(write("envs:\n  babyai:\n    url: http://x\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(write("envs: [\n"))
    cfg = load_yaml(write("session_ttl: 30\nenvs:\n  babyai: http://127.0.0.1:9\n  sok:\n    adapter: gym\n"
                          "    urls: [http://127.0.0.1:8]\n")).validate()
    assert cfg.session_ttl == 30.0 and cfg.envs["babyai"].urls == ["http://127.0.0.1:9"]
    assert cfg.envs["sok"].options["env_name"] == "sok"  # the gym backend's env name defaults to ours


class FakeAppWorld:
    """Stand-in for ``appworld serve environment`` (its task data needs the internet): worlds keyed by task id;
    code ``answer X`` completes the task; 2 tests, the second passes when X is the task id."""

    def __init__(self):
        self.worlds: dict[str, str | None] = {}

    def app(self):
        from aiohttp import web

        async def initialize(request):
            task = (await request.json())["task_id"]
            self.worlds[task] = None
            return web.json_response({"output": {"task_id": task, "instruction": f"Answer with {task}.",
                                                 "supervisor": {"first_name": "Ada", "last_name": "Lovelace",
                                                                "email": "ada@example.com", "phone_number": "555"}}})

        async def execute(request):
            body = await request.json()
            if body["code"].startswith("answer "):
                self.worlds[body["task_id"]] = body["code"][7:]
            return web.json_response({"output": f"ran {body['code']}"})

        async def completed(request):
            return web.json_response({"output": self.worlds[(await request.json())["task_id"]] is not None})

        async def evaluate(request):
            task = (await request.json())["task_id"]
            ok = self.worlds[task] == task
            return web.json_response({"output": {"success": ok, "num_tests": 2, "passes": [1] + [2] * ok,
                                                 "failures": [] if ok else [2]}})

        async def close(request):
            self.worlds.pop((await request.json())["task_id"])
            return web.json_response({"output": None})

        app = web.Application()
        app.add_routes([web.post("/initialize", initialize), web.post("/execute", execute),
                        web.post("/task_completed", completed), web.post("/evaluate", evaluate),
                        web.post("/close", close)])
        return app


def test_appworld_adapter_episode_and_one_world_per_task_and_replica():
    from aiohttp import web

    async def serve(app):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def main():
        fakes = [FakeAppWorld(), FakeAppWorld()]
        servers = [await serve(f.app()) for f in fakes]
        try:
            async with gateway({"appworld": [u for _, u in servers]}) as (gw, url):
                async with GatewayClient(url, retry_overloaded=False) as client:
                    a = await client.create("appworld", "t_1")
                    assert "Ada Lovelace" in a.observation and "Answer with t_1." in a.observation
                    b = await client.create("appworld", "t_1")  # same task: the other replica
                    assert {a.backend, b.backend} == {u for _, u in servers}
                    with pytest.raises(Overloaded, match="already open on this AppWorld server") as e:
                        await client.create("appworld", "t_1")  # busy, not broken: retry later
                    assert e.value.status == 503 and e.value.retry_after == 1
                    r = await client.step(a.session_id, "print(1)")
                    assert (r.observation, r.reward, r.done) == ("ran print(1)", 0.0, False)
                    r = await client.step(a.session_id, "answer t_1")
                    assert (r.reward, r.done, r.info["evaluation"]["success"]) == (1.0, True, True)
                    r = await client.step(b.session_id, "answer nope")
                    assert (r.reward, r.done) == (0.5, True)
                    await client.close(a.session_id)
                    await client.create("appworld", "t_1")  # its replica is free for the task again
        finally:
            for runner, _ in servers:
                await runner.cleanup()
    run(main())
