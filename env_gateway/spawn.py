"""Replicas the gateway starts itself (``--spawn NAME=CMD:N``), restarted when they die.

CMD is split like a shell would and run without a shell, in the gateway's working directory, inheriting its
stdout/stderr. Each replica keeps one port of 127.0.0.1 across restarts, so its URL in the pool never changes:

- ``{fd}`` in CMD (the built-in servers' ``--fd {fd}``): the gateway binds the socket itself (port 0: the kernel
  picks a free one), holds it for its lifetime and passes it to every start of the replica as an inherited file
  descriptor, whose number replaces ``{fd}`` (and the port ``{port}``, if also there). No other process can take
  the port at any time. While a replica is down its socket stays open in the gateway: a request sent meanwhile
  waits in the socket's queue for the restarted replica (within the request's timeout).
- ``{port}`` only (a server that can only bind a port itself): the port of a socket bound and closed just before
  the first start. Another process could take it in between; the replica then fails to start and is restarted
  (back-off below) while its health check keeps it out of rotation.

A replica that exits is restarted after a back-off (1 s, doubling up to 30 s, reset once it has run 60 s); while
it is down, the gateway's health checks keep it out of rotation; the sessions it held fail on their next step (the
restarted replica does not know their instances).
On Linux a replica also dies with the gateway, even when the gateway is killed with SIGKILL and cannot stop it:
it starts through a one-line launcher that asks the kernel for SIGTERM on its parent's death
(``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``) and then ``exec``s CMD under the same pid.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import socket
import sys
import time

from env_gateway.server import Replica

log = logging.getLogger("env_gateway.spawn")


# argv[1]: the gateway's pid (if it died before prctl took effect, nobody would signal us: leave); argv[2:]: CMD
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(0); os.execvp(sys.argv[2], sys.argv[2:])")


class Supervisor:
    def __init__(self) -> None:
        self.children: list[tuple[str, list[str], Replica]] = []
        self.procs: dict[Replica, asyncio.subprocess.Process] = {}
        self.sockets: dict[Replica, socket.socket] = {}  # the ``{fd}`` replicas' sockets, held until stop
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @staticmethod
    def plan(cmd: str, replicas: int) -> list[tuple[str, list[str], socket.socket | None]]:
        """(url, argv, the socket to pass or None) for each replica to start."""
        out = []
        for _ in range(replicas):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if "{fd}" not in cmd:  # {port}: the replica binds it itself ({fd}: _launch passes it, pass_fds)
                sock.close()
                sock = None
            argv = shlex.split(cmd.replace("{port}", str(port)).replace("{fd}", str(sock.fileno()) if sock else ""))
            out.append((f"http://127.0.0.1:{port}", argv, sock))
        return out

    def add(self, env: str, argv: list[str], replica: Replica, sock: socket.socket | None = None) -> None:
        self.children.append((env, argv, replica))
        if sock is not None:
            self.sockets[replica] = sock

    async def start(self, app: object = None) -> None:
        for env, argv, replica in self.children:
            await self._launch(env, argv, replica)
            self._tasks.append(asyncio.ensure_future(self._watch(env, argv, replica)))

    async def _launch(self, env: str, argv: list[str], replica: Replica) -> None:
        # Own process group: a terminal's Ctrl-C reaches the gateway, which then stops children in order.
        launch = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv] if sys.platform == "linux" else argv
        sock = self.sockets.get(replica)
        proc = await asyncio.create_subprocess_exec(*launch, start_new_session=True,
                                                    pass_fds=(sock.fileno(),) if sock else ())
        self.procs[replica], replica.pid = proc, proc.pid
        log.info("%s replica %s started (pid %d): %s", env, replica.url, proc.pid, shlex.join(argv))

    async def _watch(self, env: str, argv: list[str], replica: Replica) -> None:
        backoff = 1.0
        while True:
            started = time.monotonic()
            code = await self.procs[replica].wait()
            if self._stopping:
                return
            if time.monotonic() - started > 60:
                backoff = 1.0
            replica.healthy, replica.last_error = False, f"process exited with {code}; restarting in {backoff:g}s"
            log.warning("%s replica %s (pid %s) exited with %s; restarting in %gs", env, replica.url, replica.pid,
                        code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
            try:
                await self._launch(env, argv, replica)
                replica.restarts += 1
            except OSError as e:  # the command itself is broken: keep trying, but say so
                replica.last_error = f"cannot start {argv[0]}: {e}"
                log.error("%s replica %s: %s", env, replica.url, replica.last_error)
                await asyncio.sleep(backoff)

    async def stop(self, app: object = None) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for proc in self.procs.values():
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        for sock in self.sockets.values():
            sock.close()
