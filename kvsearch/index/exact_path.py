"""Which kernel an exact search runs, per call: the path choice of the default exact index (``index="Flat"``).

This module owns the rule that picks, for one search call, between

- ``"float32"``: the chunked float32 scan (numpy's BLAS on the CPU): a matrix-vector product for a few queries
  reads the keys at full memory bandwidth;
- ``"bfloat16"`` / ``"float16"``: a half-precision scan of a half-size copy of the keys, then the best ``k'``
  candidates rescored exactly in float32 and checked against a proven error bound (see
  :class:`kvsearch.index.torch_index.TorchIndex`): float32's ids at half precision's speed;
- ``"faiss"``: FAISS's exhaustive BLAS search (``faiss.knn``: blocked sgemm + heaps) over the same key memory,

from the batch size, the device and what the hardware runs fast. It knows nothing of the keys themselves.

The rule (measured on a 2-core AMD EPYC with AVX512-BF16, m = 300k and 1M x 384, benchmarks/RESULTS.md):

- CUDA: float32 below :data:`HALF_MIN_BATCH` queries, float16 from there (tensor cores; no measurement here);
- CPU, fewer than :data:`HALF_MIN_BATCH` queries: float32 (1 query: 31 ms float32 vs 64 ms bfloat16 at 300k);
- CPU with fast bfloat16 (``avx512_bf16`` or ``amx_bf16``): bfloat16 (16 queries: 112 vs 159 ms; 64: 285 vs
  385 ms; 1M x 64: 244 ms vs FAISS tuned 469 ms);
- CPU without it: FAISS from ``FAISS_MIN_BATCH`` (32) queries where it applies (inner product, no per-key
  factor, no filter), else float32.

float16 is never chosen on a CPU without fast float16 arithmetic (``avx512_fp16`` or ``amx_fp16``): there a
64-query float16 matmul ran ~4x slower than float32.

Override (deterministic tests, benchmarks): :func:`set_exact_path` in the process, or the environment variable
``KVSEARCH_EXACT_PATH`` (``auto``, ``float32``, ``bfloat16``, ``float16``, ``faiss``). A forced path that
cannot run a call (``faiss`` on CUDA, for L2 / cosine over raw keys, or filtered) runs float32 instead.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from kvsearch.errors import UnknownOptionError

__all__ = [
    "ExactPath",
    "EXACT_PATHS",
    "HALF_MIN_BATCH",
    "FAISS_MIN_BATCH",
    "ENV_VAR",
    "choose_path",
    "fast_half_dtypes",
    "set_exact_path",
    "forced_path",
]

ExactPath = Literal["float32", "bfloat16", "float16", "faiss"]
#: The paths, and ``"auto"`` (the rule above), by name.
EXACT_PATHS = ("auto", "float32", "bfloat16", "float16", "faiss")
#: From this many queries per call a half-precision scan (where the hardware runs one fast) beats float32.
HALF_MIN_BATCH = 16
#: From this many queries per call, FAISS's blocked BLAS search beats the float32 chunked scan (CPU, float32).
FAISS_MIN_BATCH = 32
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


def choose_path(batch: int, device: torch.device, *, faiss_ok: bool) -> ExactPath:
    """The path of one exact search call.

    Args:
        batch: queries in the call.
        device: the keys' device.
        faiss_ok: FAISS's exhaustive search can answer this call (CPU float32 inner product, no per-key factor,
            no filter).

    Returns:
        The forced path (see :func:`forced_path`; ``"faiss"`` where it cannot run becomes ``"float32"``), else
        the rule's choice (module docstring).

    Raises:
        UnknownOptionError: ``$KVSEARCH_EXACT_PATH`` names an unknown path.
    """
    forced = forced_path()
    if forced != "auto":
        if forced == "faiss" and not (faiss_ok and device.type == "cpu"):
            return "float32"
        return forced  # type: ignore[return-value]
    if batch < HALF_MIN_BATCH:
        return "float32"
    half = fast_half_dtypes(device)
    if half:
        return "float16" if half[0] == torch.float16 else "bfloat16"
    if device.type == "cpu" and faiss_ok and batch >= FAISS_MIN_BATCH:
        return "faiss"
    return "float32"
