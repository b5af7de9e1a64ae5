"""The training process that ``test_memory_folder.py``'s kill test kills: a fork server plus the workload each child
runs.

Run as ``python tests/_memory_crash_child.py``. It imports torch and kvsearch once (one thread: fork() stays safe),
warms a training step, a save and a rollback up once, and reads one JSON command per line on stdin:

    {"path": memory folder, "acks": ack file (one per round), "seed": s, "mode": m, "delay": seconds,
     "mutant": false}

For each it forks a child that opens ``ProductKeyMemory(**CONFIG, folder=path)`` and, until it is killed, trains it
(SGD on random batches: the values, sub-keys, query map and norm move; ``hits`` / ``written`` / ``step`` count),
now and then freezes, unfreezes or edits slots, and saves it after every one to three steps; about one save in five
is followed by a rollback. It is killed by the server with SIGKILL after ``delay`` seconds (``mode="timer"``), or
by itself at a point of a save or rollback (the other modes, :data:`MODES`): right after the new generation's file
is written (``kvsearch.storage.memory_folder.write_state``: nothing switched), right after the manifest switched
(``switch``, in a save or a rollback), right after the unkept files were removed (``remove_unkept`` after a switch),
right after a rollback's switch (``rolled_back``).
The server answers one JSON line per command.

The child appends to its ack file, each line with one ``os.write`` on an ``O_APPEND`` descriptor and then
``os.fsync`` (a line written is kept when the process is killed right after):

    open <generation> <digest>      the memory as opened
    saving <digest>                 a save begins: the state it saves
    saved <generation> <digest>     it returned
    rolling <generation>            a rollback begins, to that generation
    rolled <generation> <digest>    it returned: the state it loaded
    error <message>                 the child failed (not killed): the test reports it

``<digest>`` is :func:`state_digest`: the SHA-256 of every tensor of the memory's ``state_dict()`` (names, dtypes,
shapes, bytes), so the test can tell saved states apart exactly.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import tempfile
import traceback
from collections.abc import Callable

import torch

torch.set_num_threads(1)  # no OpenMP pool in the server: fork() stays safe

from _fork_server import serve  # noqa: E402

import kvsearch  # noqa: E402
from kvsearch.storage import memory_folder  # noqa: E402

#: The memory every child and the test open: 64 slots, small enough that a save is a few milliseconds.
CONFIG = {"dim": 16, "num_keys": 8, "heads": 2, "k": 4, "key_dim": 8, "value_dim": 12}
MODES = ("timer", "written", "switched", "removed", "rolled_back")
BATCH = 8


def state_digest(memory: torch.nn.Module) -> str:
    """SHA-256 of the memory's state: every tensor's name, dtype, shape and bytes, by name."""
    digest = hashlib.sha256()
    for name, tensor in sorted(memory.state_dict().items()):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def open_memory(path: str) -> kvsearch.ProductKeyMemory:
    return kvsearch.ProductKeyMemory(**CONFIG, folder=path)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(mode: str, due: Callable[[], bool], mutant: bool = False) -> None:
    """Wrap the public steps of a save (module attributes of ``kvsearch.storage.memory_folder``) to kill at them.

    ``mutant=True`` breaks the order the folder's safety rests on: the generation's file is written in place after
    the manifest names it (not whole, before the switch). The test shows that its checks catch it.
    """
    switched = [False]
    late: list[tuple] = []  # the mutant's file, written after the switch

    def write_state(folder, generation, state, config):
        if mutant:
            from safetensors.torch import save

            blob = save({name: t.detach().cpu().contiguous() for name, t in state.items()})
            late.append((folder / memory_folder.file_name(generation), blob))
            return {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
        out = original["write_state"](folder, generation, state, config)
        if mode == "written" and due():
            _die()  # the new generation's file is whole; the manifest still names the old one
        return out

    def switch(folder, manifest):
        out = original["switch"](folder, manifest)
        switched[0] = True
        if mode == "switched" and due():
            _die()  # the manifest names the new generation; the unkept file is still there
        if mode == "rolled_back" and manifest["generation"] < manifest["latest"] and due():
            _die()  # a rollback's switch: the folder is back, the memory not yet loaded
        while late:
            path, blob = late.pop()
            path.write_bytes(blob)
        return out

    def remove_unkept(*args, **kwargs):
        out = original["remove_unkept"](*args, **kwargs)
        after_switch, switched[0] = switched[0], False  # a save also removes leftovers before it writes
        if mode == "removed" and after_switch and due():
            _die()
        return out

    original = {name: getattr(memory_folder, name) for name in ("write_state", "switch", "remove_unkept")}
    memory_folder.write_state, memory_folder.switch = write_state, switch
    memory_folder.remove_unkept = remove_unkept


def child(cmd: dict) -> None:
    """Open the memory and train, save and roll back until killed."""
    ack = os.open(cmd["acks"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(ack, (line + "\n").encode())
        os.fsync(ack)

    try:
        rng = random.Random(cmd["seed"])
        torch.manual_seed(cmd["seed"])
        countdown = [rng.randint(1, 3)]

        def due() -> bool:
            countdown[0] -= 1
            return countdown[0] <= 0

        install(cmd["mode"], due, cmd.get("mutant", False))
        memory = open_memory(cmd["path"]).train()
        note(f"open {memory.generation} {state_digest(memory)}")
        optimizer = torch.optim.SGD(memory.parameters(), lr=0.5)
        slots = memory.num_slots
        while True:
            for _ in range(rng.randint(1, 3)):
                inputs = torch.randn(BATCH, CONFIG["dim"])  # (batch, dim)
                targets = torch.randn(BATCH, CONFIG["value_dim"])  # (batch, value_dim)
                loss = (memory(inputs) - targets).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            edit = rng.random()
            if edit < 0.2:
                memory.slots.freeze(rng.sample(range(slots), 3))
            elif edit < 0.3:
                memory.slots.unfreeze(rng.sample(range(slots), 5))
            elif edit < 0.4:
                ids = rng.sample(range(slots), 2)
                memory.slots.update_values(ids, torch.randn(2, CONFIG["value_dim"]))
            note(f"saving {state_digest(memory)}")
            generation = memory.save()
            note(f"saved {generation} {state_digest(memory)}")
            if rng.random() < 0.2 and memory.folder.previous is not None:
                note(f"rolling {memory.folder.previous}")
                generation = memory.rollback()
                note(f"rolled {generation} {state_digest(memory)}")
    except BaseException as exc:  # not a kill: report it to the test
        message = " | ".join(traceback.format_exception_only(type(exc), exc)).replace("\n", " ")
        where = traceback.extract_tb(exc.__traceback__)[-1]
        note(f"error {message} (at {where.filename}:{where.lineno})")
        os._exit(1)


def warm_up() -> None:
    """One training step, save and rollback in a temporary folder, so that every child starts with the lazy imports
    done (the optimizer's first step imports torch._dynamo: a second of every round otherwise)."""
    with tempfile.TemporaryDirectory() as folder:
        memory = open_memory(os.path.join(folder, "memory"))
        optimizer = torch.optim.SGD(memory.parameters(), lr=0.5)
        memory(torch.randn(BATCH, CONFIG["dim"])).pow(2).mean().backward()
        optimizer.step()
        memory.save()
        memory.save()
        memory.rollback()
        state_digest(memory)


def main() -> None:
    warm_up()
    serve(child)


if __name__ == "__main__":
    main()
