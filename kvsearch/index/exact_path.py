"""Which kernel an exact search runs, per call: the path choice of the default exact index (``index="Flat"``).

This module owns the rule that picks, for one search call, between

- ``"float32"``: the chunked float32 scan in torch (``q @ K.T`` a chunk of keys at a time, then ``torch.topk``):
  the same kernels as the bare-torch baseline, so the default index never does worse than it;
- ``"bfloat16"`` / ``"float16"``: a half-precision scan of a half-size copy of the keys, then the best ``k'``
  candidates rescored exactly in float32 and checked against a proven error bound (see
  :class:`kvsearch.index.torch_index.TorchIndex`): float32's ids, faster where the hardware runs half-precision
  matmuls fast *and* the bound settles the queries on these keys;
- ``"faiss"``: FAISS's exhaustive BLAS search (``faiss.knn``) over the same key memory -- only when forced.

The half-precision path is a bet on the data as much as on the hardware: on unnormalised keys (the activations a
model makes) the bound ``E ~ 3 u |q| max|k|`` can exceed the gap between the k-th score and the rest, and then
every query is rescored wider or searched again in float32 (2.8-6x the float32 time, issue 21). So the choice is
*measured*, per index and per class of call (batch size and key count, each to the next power of two), by
:class:`PathChooser`: the first calls of a class time float32 and the half path (:data:`TRIALS` each), the half
path is then kept only where its median time per query was at most :data:`HALF_MARGIN` of float32's, and every
:data:`RETRY_EVERY` calls the path not taken is timed once more (the keys or the load may have changed). A class of
twice as many keys as a decided one (the same batch size: a memory that grew) starts on that class's path instead
of timing both afresh, and is timed on the other one at the retries only: a kNN memory growing from empty would
otherwise time the half path (2-3x float32's time on unnormalised keys) at every doubling. Every path returns the
same ids, so the choice changes speed only.

- fewer than :data:`HALF_MIN_BATCH` queries, or no fast half type on the device: float32, untimed (the chooser is
  out of the way: :meth:`PathChooser.times` says so before a call, which then reads no clock);
- CUDA: float16 (tensor cores) against float32; CPU with ``avx512_bf16`` / ``amx_bf16``: bfloat16 against float32.

float16 is never tried on a CPU without fast float16 arithmetic (``avx512_fp16`` or ``amx_fp16``): there a 64-query
float16 matmul ran ~4x slower than float32. FAISS is never chosen by the rule: its OpenMP threads keep spinning after
a call and slowed the torch ops that followed it (the rest of the model) 10-30x on 2 cores.

Override (deterministic tests, benchmarks): :func:`set_exact_path` in the process, or the environment variable
``KVSEARCH_EXACT_PATH`` (``auto``, ``float32``, ``bfloat16``, ``float16``, ``faiss``). A forced path that
cannot run a call (``faiss`` on CUDA, for L2 / cosine over raw keys, or filtered) runs float32 instead.
"""

from __future__ import annotations

import functools
import os
import statistics
from collections import Counter, deque
from typing import Literal

import torch

from kvsearch.errors import UnknownOptionError

__all__ = [
    "ExactPath",
    "EXACT_PATHS",
    "HALF_MIN_BATCH",
    "TRIALS",
    "RETRY_EVERY",
    "HALF_MARGIN",
    "ENV_VAR",
    "PathChooser",
    "fast_half_dtypes",
    "set_exact_path",
    "forced_path",
]

ExactPath = Literal["float32", "bfloat16", "float16", "faiss"]
#: The paths, and ``"auto"`` (the rule above), by name.
EXACT_PATHS = ("auto", "float32", "bfloat16", "float16", "faiss")
#: Below this many queries per call the half-precision scan is not tried (a matrix-vector product reads the keys at
#: memory speed in float32; the half copy, the rescoring and the check cannot pay).
HALF_MIN_BATCH = 16
#: Calls of each path a class of calls times before the faster one is kept.
TRIALS = 2
#: Every this many calls of a class, the path not taken is timed once more.
RETRY_EVERY = 64
#: The half path is kept only where its median time per query is at most this fraction of float32's.
HALF_MARGIN = 0.85
#: The environment variable that forces a path (read at each call, after :func:`set_exact_path`).
ENV_VAR = "KVSEARCH_EXACT_PATH"

_forced: str | None = None


def _check_path(path: object) -> str:
    if path not in EXACT_PATHS:
        raise UnknownOptionError(f"expected an exact search path among {EXACT_PATHS}, got {path!r}")
    return str(path)


def set_exact_path(path: str | None) -> None:
    """Force the path of every exact ``"Flat"`` search in this process (None or ``"auto"``: the rule).

    Args:
        path: one of :data:`EXACT_PATHS`, or None.

    Raises:
        UnknownOptionError: an unknown path.
    """
    global _forced
    _forced = None if path is None else _check_path(path)


def forced_path() -> str:
    """The path forced now: :func:`set_exact_path`'s, else ``$KVSEARCH_EXACT_PATH``'s, else ``"auto"``.

    Raises:
        UnknownOptionError: the environment variable names an unknown path.
    """
    if _forced is not None:
        return _forced
    return _check_path(os.environ.get(ENV_VAR, "auto") or "auto")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_half_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """The half-precision types a matmul on ``device`` runs faster than float32, fastest first.

    Args:
        device: where the keys are.

    Returns:
        CUDA: (float16, bfloat16). CPU: bfloat16 with ``avx512_bf16`` / ``amx_bf16``, float16 with
        ``avx512_fp16`` / ``amx_fp16``; empty otherwise.
    """
    if device.type == "cuda":
        return (torch.float16, torch.bfloat16)
    if device.type != "cpu":
        return ()
    flags = _cpu_flags()
    found = []
    if flags & {"avx512_bf16", "amx_bf16"}:
        found.append(torch.bfloat16)
    if flags & {"avx512_fp16", "amx_fp16"}:
        found.append(torch.float16)
    return tuple(found)


class PathChooser:
    """Picks the path of each exact search call of one index from timings of its own recent calls.

    Calls are grouped in classes by batch size and key count (each to the next power of two); per class and path
    it keeps the last 5 times per query and key. See the module docstring for the rule; :meth:`record` is told
    what each call took.
    """

    def __init__(self) -> None:
        self._times: dict[tuple[int, int, str], deque[float]] = {}
        self._calls: Counter[tuple[int, int]] = Counter()
        self._taken_over: dict[tuple[int, int], ExactPath | None] = {}  # class -> the path of the class below it

    def choose(self, batch: int, rows: int, device: torch.device, *, faiss_ok: bool) -> ExactPath:
        """The path of one call.

        Args:
            batch: queries in the call.
            rows: keys searched.
            device: the keys' device.
            faiss_ok: FAISS's exhaustive search can answer this call (CPU float32 inner product, no per-key
                factor, no filter); used only when ``"faiss"`` is forced.

        Returns:
            The forced path (see :func:`forced_path`; ``"faiss"`` where it cannot run becomes ``"float32"``), else
            float32 or the device's fast half type, by the timings (module docstring).

        Raises:
            UnknownOptionError: ``$KVSEARCH_EXACT_PATH`` names an unknown path.
        """
        forced = forced_path()
        if forced != "auto":
            if forced == "faiss" and not (faiss_ok and device.type == "cpu"):
                return "float32"
            return forced  # type: ignore[return-value]
        if batch < HALF_MIN_BATCH:  # nothing to choose: asked before the device's half types
            return "float32"
        half = fast_half_dtypes(device)
        if not half:
            return "float32"
        alt: ExactPath = "float16" if half[0] == torch.float16 else "bfloat16"
        cls = (batch.bit_length(), rows.bit_length())
        calls = self._calls[cls]
        self._calls[cls] += 1
        retry = calls % RETRY_EVERY == RETRY_EVERY - 1
        fast = self._kept(cls, alt)
        if fast is None:  # not timed on both paths yet: twice as many keys as a decided class (a memory grown)
            fast = self._taken_over[cls] = self._kept((cls[0], cls[1] - 1), alt)  # takes its path over, or None
        if fast is None:
            t32 = self._times.get((*cls, "float32"), ())
            return "float32" if len(t32) < TRIALS else alt
        if retry:  # time the other path again
            return "float32" if fast == alt else alt
        return fast

    def _kept(self, cls: tuple[int, int], alt: ExactPath) -> ExactPath | None:
        """The path a class keeps: by its own times of both paths, else the one it took over; None: undecided."""
        t32, t_half = self._times.get((*cls, "float32"), ()), self._times.get((*cls, alt), ())
        if len(t32) < TRIALS or len(t_half) < TRIALS:
            return self._taken_over.get(cls)
        return alt if statistics.median(t_half) <= HALF_MARGIN * statistics.median(t32) else "float32"

    @staticmethod
    def times(batch: int, device: torch.device) -> bool:
        """Whether a call of ``batch`` queries on ``device`` is timed (:meth:`record`): only where there is a path to
        choose (no path forced, at least :data:`HALF_MIN_BATCH` queries, a fast half type on the device); the other
        calls run float32 without a clock read or a record.

        Raises:
            UnknownOptionError: ``$KVSEARCH_EXACT_PATH`` names an unknown path.
        """
        return batch >= HALF_MIN_BATCH and forced_path() == "auto" and bool(fast_half_dtypes(device))

    def record(self, batch: int, rows: int, path: str, seconds: float) -> None:
        """Note that a call of ``batch`` queries over ``rows`` keys on ``path`` took ``seconds`` (all its
        rescoring and searching again included)."""
        if batch < 1 or rows < 1:
            return
        cls = (batch.bit_length(), rows.bit_length())
        self._times.setdefault((*cls, path), deque(maxlen=5)).append(seconds / (batch * rows))
