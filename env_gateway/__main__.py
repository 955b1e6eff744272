"""``python -m env_gateway``: run the gateway (see env_gateway/config.py for every setting)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
from dataclasses import fields

from aiohttp import web

from env_gateway.config import (ConfigError, EnvConfig, GatewayConfig, load_yaml, parse_env_flag, parse_spawn_flag,
                                scalar_settings)
from env_gateway.server import Gateway
from env_gateway.servers._base import bound_socket
from env_gateway.spawn import Supervisor

log = logging.getLogger("env_gateway")
GC_THRESHOLD = 50_000  # allocations between young-generation collections (Python's default: 700)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m env_gateway", description="Async gateway between agent funcs and "
                                "environment servers (AgentGym and gym-style chat protocols).")
    p.add_argument("--config", help="YAML file with the same settings (flags given here win)")
    p.add_argument("--env", action="append", default=[], metavar="NAME[:ADAPTER]=URL[,URL...]",
                   help="an environment and its replica URLs; the name picks the protocol adapter unless ADAPTER "
                        "is given (a registered name or package.module:Class)")
    p.add_argument("--spawn", action="append", default=[], metavar="NAME[:ADAPTER]=CMD:N",
                   help="start N replicas of CMD and restart any that die; CMD contains {fd} (a socket the gateway "
                        "binds and passes, e.g. '... -m env_gateway.servers.babyai --fd {fd}') or {port} (a free port "
                        "the server binds itself)")
    for f in fields(GatewayConfig):
        if "help" in f.metadata:  # every scalar setting (config.setting); flags override --config where given
            p.add_argument("--" + f.name.replace("_", "-"), type=scalar_settings()[f.name], default=None,
                           help=f"{f.metadata['help']} (default {f.default})")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--no-uvloop", action="store_true", help="use asyncio's own event loop even if uvloop is installed")
    return p


def make_config(args: argparse.Namespace) -> GatewayConfig:
    cfg = load_yaml(args.config) if args.config else GatewayConfig()
    for name in scalar_settings():
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    for flag in args.env:
        name, adapter, urls = parse_env_flag(flag)
        env = cfg.envs.setdefault(name, EnvConfig(name=name))
        env.urls += urls
        env.adapter = adapter or env.adapter
    for flag in args.spawn:
        name, adapter, spec = parse_spawn_flag(flag)
        env = cfg.envs.setdefault(name, EnvConfig(name=name))
        env.spawn, env.adapter = spec, adapter or env.adapter
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    supervisor = Supervisor()
    try:
        cfg = make_config(args)
        planned = {}
        for env in cfg.envs.values():  # spawned replicas join the pool as ordinary URLs
            if env.spawn:
                planned[env.name] = Supervisor.plan(env.spawn.cmd, env.spawn.replicas)
                env.urls += [url for url, _, _ in planned[env.name]]
        gateway = Gateway(cfg)
    except ConfigError as e:
        parser.error(str(e))
    for name, children in planned.items():
        for url, argv_, sock in children:
            supervisor.add(name, argv_, next(r for r in gateway.pools[name].replicas if r.url == url), sock)
    app = gateway.app()
    app.on_startup.insert(0, supervisor.start)
    app.on_cleanup.append(supervisor.stop)
    loop = None
    if not args.no_uvloop:
        try:
            import uvloop
            loop = uvloop.new_event_loop()
        except ImportError:
            pass
    loop = loop or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    # Every request allocates a few dozen short-lived containers, so with the default threshold (700) the
    # collector runs every few requests and walks all of them in flight; the start-up objects (modules,
    # app, pools) are frozen out of its walks. Cuts the gateway's CPU per request by about 5%
    # (benchmarks/gateway_bench.py); garbage cycles are still collected, just in larger batches.
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 20, 20)
    envs = ", ".join(f"{p.name}[{p.adapter_cls.name}]x{len(p.replicas)}" for p in gateway.pools.values())
    # A deep accept backlog: a rollout opens hundreds of connections at once, and SYNs dropped from a
    # short queue come back only after a 1 s retransmit.
    sock, port = bound_socket(cfg.host, cfg.port)  # the log names the port --port 0 got
    # keepalive_timeout: aiohttp closes a connection that has not sent a whole request's headers by then (a fresh
    # one, an idle keep-alive one, or a slow sender); read_json bounds the body.
    web.run_app(app, sock=sock, loop=loop, access_log=None, backlog=4096, keepalive_timeout=cfg.read_timeout,
                print=lambda *_: log.info("gateway listening on http://%s:%d (%s)", cfg.host, port, envs))


if __name__ == "__main__":
    main(sys.argv[1:])
