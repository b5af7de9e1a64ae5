"""The fork server of the kill tests' writing processes (``_crash_writer.py``, ``_finetune_crash_child.py``,
``_memory_crash_child.py``), and how a test starts one.

A server script imports torch and kvsearch once, warms up, then calls :func:`serve` with its workload: for each JSON
command read on stdin (one per line, with ``"delay"`` in seconds) a forked child runs the workload until it is killed
— by the server with SIGKILL once ``delay`` has passed, or by itself — and the server answers one JSON line:
``{"pid", "killed_by": "server" | "self", "signal", "exit", "seconds"}``. A test starts it with :func:`start_server`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def start_server(script: Path) -> subprocess.Popen:
    """Start the server ``script`` (one OpenMP thread: fork() stays safe), its stdin and stdout as text pipes."""
    return subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def serve(workload: Callable[[dict[str, Any]], None], ready: bool = True) -> None:
    """Say ready (unless ``ready`` is False), then fork ``workload(cmd)`` for each command on stdin and report how
    it ended. A workload that raises exits 1 with its traceback on stderr (the test then fails on the exit)."""
    if ready:
        print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                workload(cmd)
            except BaseException:
                traceback.print_exc()
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
