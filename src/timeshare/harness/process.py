"""A ``timeshare serve`` in a child process, for the demo and ``bench serve``: start it
with a config, wait (with a deadline) until it is ready, stop it with SIGTERM as an
operator would, and make sure nothing of it is left. Runs in the caller's process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from timeshare.errors import TimeshareError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(config) as server: ... server.url ...``; ``config`` is a
    parsed YAML document (a dict). The server's port is chosen here; its log goes to
    ``log_path`` (default: a temporary file, shown in errors)."""

    def __init__(self, config: dict, *, ready_timeout_s: float = 300.0, log_path: Path | None = None):
        self.port = free_port()
        # The demo's and benchmarks' own clients send no API key: a TIMESHARE_API_KEY exported
        # in the caller's environment must not lock them out (a config's own key still holds).
        config = {**config, "server": {"api_key_env": None, **config.get("server", {}), "host": "127.0.0.1",
                                       "http_port": self.port, "metrics_port": None}}
        self._dir = tempfile.TemporaryDirectory(prefix="timeshare-serve-")
        self.config_path = Path(self._dir.name) / "timeshare.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = log_path or Path(self._dir.name) / "server.log"
        self.ready_timeout_s = ready_timeout_s
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.children: list[int] = []

    def start(self, progress=None) -> ServerProcess:
        """Start the server and wait until it is ready; a second call (``start()``, then
        ``with``) returns the one already started rather than starting another."""
        from timeshare.harness.client import Client

        if self.proc is not None and self.proc.poll() is None:
            return self
        log = open(self.log_path, "wb")
        # The server stops by itself if this process dies without stopping it (serve.PARENT_ENV).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIMESHARE_PARENT_PID": str(os.getpid())}
        self.proc = subprocess.Popen([sys.executable, "-m", "timeshare", "serve", "--config", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        with Client(self.url, timeout_s=5) as client:
            try:
                wait_ready(self.proc, client.ready, self.ready_timeout_s, "the server", self.log_tail,
                           None if progress is None else lambda: progress(self.log_tail(1)))
            except TimeshareError:
                self.stop()
                raise
        self.children = _children(self.proc.pid)
        return self

    @property
    def pid(self) -> int:
        """The server's process id (once started)."""
        if self.proc is None:
            raise TimeshareError("the server has not been started")
        return self.proc.pid

    def stop(self, timeout_s: float = 180.0) -> int:
        """SIGTERM, wait for the drain, then SIGKILL if it is still there. Returns the
        exit code (0: clean)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.children = sorted(set(self.children) | set(_children(self.proc.pid)))
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.exit_code = self.proc.returncode
        return self.exit_code

    def leftovers(self, grace_s: float = 10.0) -> list[int]:
        """Child processes of the server still alive after it stopped (should be none).

        A child may outlive the server by a moment: multiprocessing's resource tracker
        exits only once it reads the end of its pipe from the dead parent. So this
        waits up to ``grace_s`` for them to go before calling them left over."""
        deadline = time.monotonic() + grace_s
        alive = [pid for pid in self.children if _alive(pid)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [pid for pid in alive if _alive(pid)]
        return alive

    @staticmethod
    def describe(pid: int) -> str:
        """``pid: command line`` of a process, for messages about leftovers."""
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "(gone)"
        return f"{pid}: {cmd[:200]}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float, what: str,
               log_tail: Callable[[], str], waiting: Callable[[], None] | None = None) -> None:
    """Poll ``ready`` (every 0.25 s, ``waiting`` called between) until it holds; an error
    naming ``what``, with its log, if ``proc`` exits first or ``timeout_s`` passes (the
    caller stops it)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise TimeshareError(f"{what} exited with code {proc.returncode} before it was ready; its log:\n"
                                 f"{log_tail()}")
        if time.monotonic() > deadline:
            raise TimeshareError(f"{what} was not ready within {timeout_s:.0f} s; its log:\n{log_tail()}")
        if waiting is not None:
            waiting()
        time.sleep(0.25)


def _children(pid: int, task: int | str | None = None) -> list[int]:
    """The children of ``pid``'s thread ``task`` (its main thread by default); none if it is gone."""
    try:
        text = Path(f"/proc/{pid}/task/{pid if task is None else task}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of any of its threads, theirs, and so on),
    for what they hold (the peer bench's memory of a server); those gone meanwhile are
    left out."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            children = _children(parent, task)
            out += children
            todo += children
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
