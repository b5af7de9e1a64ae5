"""The reshards that ``test_reshard.py`` kills: a fork server that runs ``kvsearch.reshard`` in forked children.

Run as ``python tests/_reshard_child.py``. It imports torch / FAISS / kvsearch once (one thread each, so that fork()
is safe), then reads one JSON command per line on stdin:

    {"src": folder, "dst": folder, "shards": n, "delay": seconds or null}

and for each forks a child that runs ``kvsearch.reshard(src, dst, num_shards=shards)`` and exits 0 (1 on an error,
printed). The server kills the child with SIGKILL ``delay`` seconds after the fork (null: it lets it finish) and
answers one JSON line: ``{"killed": bool, "status": exit status or null, "seconds": how long the child ran}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import faiss
import torch

torch.set_num_threads(1)  # no OpenMP pool in the server: fork() stays safe
faiss.omp_set_num_threads(1)

import kvsearch  # noqa: E402


def run_child(command: dict) -> None:
    try:
        kvsearch.reshard(command["src"], command["dst"], num_shards=command["shards"])
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def main() -> None:
    for line in sys.stdin:
        command = json.loads(line)
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            run_child(command)
        delay = command.get("delay")
        killed = False
        if delay is None:
            _, status = os.waitpid(pid, 0)
        else:
            deadline = started + float(delay)
            while time.perf_counter() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.002)
            else:
                os.kill(pid, signal.SIGKILL)
                killed = True
                _, status = os.waitpid(pid, 0)
        seconds = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"killed": killed, "status": code, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
