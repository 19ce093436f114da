"""Start `strata serve` in a subprocess on a free loopback port, wait until /health says 200; at
the end, SIGTERM must stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: list[str], log: Path, timeout_s: float = 300) -> Iterator[str]:
    """Yields the base URL; stops the server afterwards. `args` follow `strata serve`."""
    port = free_port()
    cmd = [sys.executable, "-m", "strata_mgpu", "serve", *args, "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server did not become healthy: " + log.read_text()
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        status = proc.wait(timeout=30)
    assert status == 128 + signal.SIGTERM, f"SIGTERM did not stop the server cleanly ({status}): " + log.read_text()
