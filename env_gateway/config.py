"""Gateway configuration: the command line and ``--config gateway.yaml`` say the same things.

    python -m env_gateway --host 127.0.0.1 --port 8800 \\
        --env babyai=http://127.0.0.1:8001,http://127.0.0.1:8002 \\
        --env mysci:sciworld=http://10.0.0.5:8000 \\        # NAME:ADAPTER=URLS (adapter by name or pkg.mod:Class)
        --spawn textcraft='.venvs/textcraft/bin/python -m env_gateway.servers.textcraft --fd {fd}':2

The YAML file holds the same settings (flags given on the command line win)::

    host: 127.0.0.1
    port: 8800
    max_concurrency: 64            # per replica
    envs:
      babyai:
        urls: [http://127.0.0.1:8001]
      textcraft:
        spawn: {cmd: ".venvs/textcraft/bin/python -m env_gateway.servers.textcraft --fd {fd}", replicas: 2}
      sokoban:
        adapter: gym
        options: {env_name: verl_env/sokoban-v0, env_kwargs: {dim_room: [5, 5]}}
        max_concurrency: 16        # overrides the global per-replica cap for this env

Every mistake raises ``ConfigError`` with a message that names the setting and what to write instead.
"""

from __future__ import annotations

import ipaddress
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from env_gateway.adapters import GymChatAdapter, load_adapter


class ConfigError(ValueError):
    pass


@dataclass
class SpawnSpec:
    cmd: str  # must contain {fd} (the socket the gateway binds and passes) or {port}: env_gateway/spawn.py
    replicas: int = 1


@dataclass
class EnvConfig:
    name: str
    urls: list[str] = field(default_factory=list)
    adapter: str = ""  # default: the env name
    options: dict = field(default_factory=dict)
    max_concurrency: int | None = None
    spawn: SpawnSpec | None = None


def setting(default: Any, help: str) -> Any:
    """A scalar gateway setting, declared once: its type (the annotation), default and help. Its name is both the
    flag of ``python -m env_gateway`` (``max_body`` -> ``--max-body``) and the YAML key (``scalar_settings``)."""
    return field(default=default, metadata={"help": help})


@dataclass
class GatewayConfig:
    host: str = setting("127.0.0.1", "address to listen on; any but a loopback one (127.0.0.1, ::1, localhost) "
                                     "needs --auth-token-file")
    port: int = setting(8800, "port to listen on (0: any free port; the log's 'listening on' line says which)")
    max_sessions: int = setting(4096, "open sessions, all envs together")
    session_ttl: float = setting(900.0, "idle seconds before a session is closed")
    request_timeout: float = setting(60.0, "seconds per backend call")
    queue_timeout: float = setting(30.0, "longest wait for a replica slot before 503")
    max_concurrency: int = setting(64, "requests in flight per replica")
    max_queue: int = setting(4096, "queued requests per replica before immediate 503")
    health_interval: float = setting(5.0, "seconds between health checks")
    max_body: int = setting(1 << 20, "largest request body in bytes")
    max_action_bytes: int = setting(1 << 16, "largest action in bytes, as forwarded to the env server (UTF-8 JSON; "
                                             "env servers take bodies up to 1 MiB); a larger one gets 413")
    read_timeout: float = setting(10.0, "seconds a client has to send a request's headers, and again its body "
                                        "(408), and that an idle connection stays open (GatewayClient closes its "
                                        "own after 5 s)")
    auth_token_file: str | None = setting(None, "file (in .secrets/, mode 600, one line) with a token that "
                                                "/v1/sessions requests must carry as 'Authorization: Bearer TOKEN' "
                                                "(clients: COPE_GATEWAY_TOKEN_FILE); for a gateway other hosts can "
                                                "reach")
    max_answer_bytes: int = setting(8 << 20, "largest backend answer in bytes, as it comes on the wire; a larger "
                                             "one fails its call (502), read no further")
    envs: dict[str, EnvConfig] = field(default_factory=dict)

    def validate(self) -> "GatewayConfig":
        if not self.envs:
            raise ConfigError("no environments: give at least one --env NAME=URL, --spawn NAME=CMD:N, or 'envs:' "
                              "in --config")
        if not self.auth_token_file and not is_loopback(self.host):  # the sessions API would be open to the network
            raise ConfigError(f"--host {self.host} can be reached from other hosts, and this gateway has no token: "
                              "anyone who reaches it could open, step and close sessions. Give --auth-token-file "
                              "(a mode-600 file in .secrets/ holding one line, e.g. `openssl rand -hex 32`; clients "
                              "read it from COPE_GATEWAY_TOKEN_FILE), or listen on 127.0.0.1")
        for name in ("max_sessions", "max_concurrency", "max_queue", "max_body", "max_action_bytes",
                     "max_answer_bytes"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("session_ttl", "request_timeout", "queue_timeout", "health_interval", "read_timeout"):
            if float(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        for env in self.envs.values():
            env.adapter = env.adapter or env.name
            try:
                adapter = load_adapter(env.adapter)
            except ValueError as e:
                raise ConfigError(f"env {env.name!r}: {e}") from None
            if issubclass(adapter, GymChatAdapter):  # the backend's env name defaults to ours
                env.options.setdefault("env_name", env.name)
            if not env.urls and not env.spawn:
                raise ConfigError(f"env {env.name!r} has no backend: give it URLs or a spawn command")
            for url in env.urls:
                if not url.startswith(("http://", "https://")):
                    raise ConfigError(f"env {env.name!r}: backend URL {url!r} must start with http:// or https://")
            if env.spawn and "{port}" not in env.spawn.cmd and "{fd}" not in env.spawn.cmd:
                raise ConfigError(f"env {env.name!r}: the spawn command must contain {{fd}} (the socket the gateway "
                                  f"binds for the replica, e.g. '... -m env_gateway.servers.{env.name} --fd {{fd}}') "
                                  f"or {{port}} (the port it binds itself); got {env.spawn.cmd!r}")
            if env.spawn and env.spawn.replicas < 1:
                raise ConfigError(f"env {env.name!r}: spawn replicas must be >= 1")
            if env.max_concurrency is not None and env.max_concurrency < 1:
                raise ConfigError(f"env {env.name!r}: max_concurrency must be >= 1")
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address only this machine reaches (a name other than localhost may resolve to
    anything, and "" or 0.0.0.0 listen on every interface)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def scalar_settings() -> dict[str, type]:
    """{name: type} of every ``setting`` of GatewayConfig (an optional one: the type it takes when given)."""
    hints = typing.get_type_hints(GatewayConfig)
    return {f.name: next(t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None))
            for f in fields(GatewayConfig) if "help" in f.metadata}


def parse_env_flag(text: str) -> tuple[str, str, list[str]]:
    """``NAME[:ADAPTER]=URL[,URL...]`` -> (name, adapter, urls)."""
    name, sep, urls = text.partition("=")
    if not sep or not name or not urls:
        raise ConfigError(f"--env {text!r}: expected NAME=URL[,URL...], e.g. --env babyai=http://127.0.0.1:8001")
    name, _, adapter = name.partition(":")
    return name.strip(), adapter.strip(), [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]


def parse_spawn_flag(text: str) -> tuple[str, str, SpawnSpec]:
    """``NAME[:ADAPTER]=CMD:N`` -> (name, adapter, spec). CMD may itself contain colons."""
    name, sep, rest = text.partition("=")
    cmd, colon, count = rest.rpartition(":")
    if not sep or not name or not colon or not count.strip().isdigit() or not cmd.strip():
        raise ConfigError(f"--spawn {text!r}: expected NAME=CMD:N, e.g. --spawn "
                          "babyai='.venvs/babyai/bin/python -m env_gateway.servers.babyai --fd {fd}':2")
    name, _, adapter = name.partition(":")
    return name.strip(), adapter.strip(), SpawnSpec(cmd.strip(), int(count))


def _env_from_yaml(name: str, raw: Any) -> EnvConfig:
    if isinstance(raw, (str, list)):  # shorthand: babyai: http://... or a list of URLs
        raw = {"urls": raw}
    if not isinstance(raw, dict):
        raise ConfigError(f"envs.{name}: expected a mapping with 'urls' or 'spawn', got {raw!r}")
    unknown = set(raw) - {f.name for f in fields(EnvConfig)}
    if unknown:
        raise ConfigError(f"envs.{name}: unknown key(s) {sorted(unknown)}; known: urls, adapter, options, "
                          "max_concurrency, spawn")
    urls = raw.get("urls") or []
    urls = [urls] if isinstance(urls, str) else list(urls)
    spawn = raw.get("spawn")
    if spawn is not None:
        if not isinstance(spawn, dict) or "cmd" not in spawn:
            raise ConfigError(f"envs.{name}.spawn: expected {{cmd: '... --fd {{fd}}', replicas: N}}")
        spawn = SpawnSpec(str(spawn["cmd"]), int(spawn.get("replicas", 1)))
    return EnvConfig(name=name, urls=[str(u).rstrip("/") for u in urls], adapter=str(raw.get("adapter") or ""),
                     options=dict(raw.get("options") or {}), max_concurrency=raw.get("max_concurrency"), spawn=spawn)


def load_yaml(path: str) -> GatewayConfig:
    if not os.path.exists(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping at the top level")
    known = {f.name for f in fields(GatewayConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    envs = raw.pop("envs", None) or {}
    if not isinstance(envs, dict):
        raise ConfigError(f"--config {path}: 'envs' must map env names to settings")
    cfg, types = GatewayConfig(), scalar_settings()
    for name, value in raw.items():  # coerce to the setting's type, with a clear message when impossible
        try:
            setattr(cfg, name, types[name](value))
        except (TypeError, ValueError):
            raise ConfigError(f"--config {path}: {name} must be of type {types[name].__name__}, got {value!r}") from None
    cfg.envs = {name: _env_from_yaml(str(name), spec) for name, spec in envs.items()}
    return cfg
