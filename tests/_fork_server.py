"""The fork server of the kill tests' training processes (``_finetune_crash_child.py``, ``_memory_crash_child.py``).

A child script imports torch and kvsearch once, warms up, then calls :func:`serve` with its workload: for each JSON
command read on stdin (one per line, with ``"delay"`` in seconds) a forked child runs the workload until it is killed
— by the server with SIGKILL once ``delay`` has passed, or by itself — and the server answers one JSON line:
``{"pid", "killed_by": "server" | "self", "signal", "exit", "seconds"}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any


def serve(workload: Callable[[dict[str, Any]], None]) -> None:
    """Say ready, then fork ``workload(cmd)`` for each command on stdin and report how it ended."""
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                workload(cmd)
            finally:
                os._exit(1)
        killed_by = "self"
        started = time.monotonic()
        deadline = started + cmd["delay"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                killed_by = "server"
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.002)
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        reply = {"pid": pid, "killed_by": killed_by, "signal": signum, "exit": code}
        print(json.dumps({**reply, "seconds": round(time.monotonic() - started, 3)}), flush=True)
