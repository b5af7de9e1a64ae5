"""Shared helpers of the benchmarks: data sets (cached under benchmarks/.cache), timing, peak memory measured
in a fresh process, machine description, and the Markdown tables appended to benchmarks/RESULTS.md.

Data sets (all float32, rows L2-normalised, seeded):

- ``random``: Gaussian vectors normalised to the unit sphere — no neighbourhoods, for exact-search speed.
- ``clustered``: a mixture of Gaussians (``m // 1000`` centres, spread 0.5 / sqrt(dim) per coordinate around
  unit centres), queries = data points perturbed by noise of the same spread — for ANN recall.
- ``names``: MiniLM (all-MiniLM-L6-v2, offline) embeddings of every surname and first name in the ``names``
  PyPI package (~94k real strings); queries = embeddings of misspelt names (one letter changed).

Workers: every measured configuration runs in its own ``python <script> --worker NAME --kwargs JSON`` process so
that its peak memory is its own. Peak memory is the kernel's high-water mark (``VmHWM``) after resetting it via
``/proc/self/clear_refs`` just before the measured call; "extra" is that peak minus the resident size at the
reset (the data already loaded).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
CACHE = ROOT / ".cache"
RESULTS = ROOT / "RESULTS.md"
DIM = 384

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# --------------------------------------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    """nproc, memory, CPU model, load average, date and library versions of this run."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "python": platform.python_version()}
    try:
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
    except OSError:
        info["memory_gib"] = None
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["cpu"] = model
    info["load_average"] = tuple(round(x, 2) for x in os.getloadavg())
    info["date"] = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = {}
    for name in ("torch", "faiss", "numpy", "sentence_transformers", "chromadb"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # not installed (chromadb is optional)
            versions[name] = "-"
    info["versions"] = versions
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def describe_machine(info: dict[str, Any]) -> str:
    """One Markdown paragraph describing the machine of a run."""
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
    return (
        f"{info['date']} — {info['nproc']} cores ({info['cpu']}), {info['memory_gib']} GiB, "
        f"torch threads {info.get('torch_threads')}, load average at start {info['load_average']} "
        f"(the machine is shared: timings are perturbed by other work), Python {info['python']}, {versions}."
    )


# --------------------------------------------------------------------------------------------- timing / memory


def timeit(fn: Callable[[], Any], repeat: int = 3, warmup: int = 1, budget: float | None = None) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` calls; fewer repeats if one call exceeds budget."""
    for _ in range(warmup):
        start = time.perf_counter()
        fn()
        if budget is not None and time.perf_counter() - start > budget:
            repeat = 1
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.extra_mib``: the high-water mark above the start.

    Resets the kernel's peak RSS (``echo 5 > /proc/self/clear_refs``) on entry and reads ``VmHWM`` on exit.
    """

    def __enter__(self) -> PeakMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.start_kib = status_kib("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_kib = status_kib("VmHWM")
        self.extra_mib = max(0.0, (self.peak_kib - self.start_kib) / 1024)
        self.peak_mib = self.peak_kib / 1024


def run_fresh(script: str, worker: str, kwargs: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """Run ``worker(**kwargs)`` of ``script`` in a fresh Python process; its JSON result (or an error)."""
    cmd = [sys.executable, script, "--worker", worker, "--kwargs", json.dumps(kwargs)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail[:200]}"}


def worker_main(workers: dict[str, Callable[..., dict[str, Any]]]) -> bool:
    """If this process was started by :func:`run_fresh`, run the worker, print its JSON and return True."""
    if "--worker" not in sys.argv:
        return False
    name = sys.argv[sys.argv.index("--worker") + 1]
    kwargs = json.loads(sys.argv[sys.argv.index("--kwargs") + 1])
    result = workers[name](**kwargs)
    print(json.dumps(result), flush=True)
    return True


# --------------------------------------------------------------------------------------------- data


def _cached(name: str, make: Callable[[], np.ndarray]) -> np.ndarray:
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{name}.npy"
    if path.exists():
        try:
            return np.load(path, mmap_mode="r")
        except ValueError:
            path.unlink()  # a torn file from an interrupted run
    data = np.ascontiguousarray(make(), dtype=np.float32)
    tmp = CACHE / f"{name}.tmp.npy"
    np.save(tmp, data)
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def read_rows(cached: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Rows ``lo:hi`` of a cached (memory-mapped) array, read from its file into a new array.

    Unlike a slice of the map, the rows read leave no page of the file mapped into the process: a peak memory
    measured around the reads counts the copies the caller keeps, not the pages of the input file.
    """
    width = int(np.prod(cached.shape[1:]))
    start = cached.offset + lo * width * cached.dtype.itemsize
    rows = np.fromfile(cached.filename, dtype=cached.dtype, count=(hi - lo) * width, offset=start)
    return rows.reshape(hi - lo, *cached.shape[1:])


def _normalise(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def _randn(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    out = np.empty((n, dim), dtype=np.float32)
    for start in range(0, n, 1 << 17):
        stop = min(n, start + (1 << 17))
        out[start:stop] = rng.standard_normal((stop - start, dim), dtype=np.float32)
    return out


def random_vectors(m: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    """(m, dim) random unit vectors (memory-mapped from the cache)."""
    return _cached(f"random_{m}_{dim}_{seed}", lambda: _normalise(_randn(np.random.default_rng(seed), m, dim)))


def random_queries(nq: int, dim: int = DIM, seed: int = 1) -> np.ndarray:
    """(nq, dim) random unit query vectors."""
    return _normalise(_randn(np.random.default_rng(seed), nq, dim))


def clustered(m: int, nq: int, dim: int = DIM, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A mixture of Gaussians: data (m, dim) and queries (nq, dim) perturbed from data points, unit rows."""
    spread = 0.5 / np.sqrt(dim)

    def make() -> np.ndarray:
        rng = np.random.default_rng(seed)
        centres = _normalise(_randn(rng, max(1, m // 1000), dim))
        data = _randn(rng, m, dim) * spread
        data += centres[rng.integers(0, len(centres), m)]
        return _normalise(data)

    data = _cached(f"clustered_{m}_{dim}_{seed}", make)
    rng = np.random.default_rng(seed + 1)
    picks = rng.integers(0, m, nq)
    queries = np.asarray(data[picks]) + _randn(rng, nq, dim) * spread
    return data, _normalise(queries)


def name_list() -> list[str]:
    """Every surname and first name of the ``names`` package, unique, in file order (~94k)."""
    import names

    folder = Path(names.__file__).parent
    seen: dict[str, None] = {}
    for file in ("dist.all.last", "dist.female.first", "dist.male.first"):
        for line in (folder / file).read_text().splitlines():
            if line.strip():
                seen.setdefault(line.split()[0].capitalize(), None)
    return list(seen)


def name_embeddings(nq: int = 1024, seed: int = 0) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Real data: names, their MiniLM embeddings (n, 384) and embeddings of nq misspelt names (nq, 384)."""
    texts = name_list()
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(texts), nq)
    letters = "abcdefghijklmnopqrstuvwxyz"
    typos = []
    for i in picks:
        word = texts[i]
        pos = int(rng.integers(1, len(word))) if len(word) > 1 else 0
        typos.append(word[:pos] + letters[int(rng.integers(0, 26))] + word[pos + 1 :])

    def encode(batch: list[str]) -> Callable[[], np.ndarray]:
        def run() -> np.ndarray:
            import torch

            from kvsearch import SentenceEncoder

            with torch.no_grad():
                return SentenceEncoder().encode(batch, batch_size=512).numpy()

        return run

    data = _cached(f"names_minilm_{len(texts)}", encode(texts))
    queries = _cached(f"names_minilm_typos_{nq}_{seed}", encode(typos))
    return texts, data, np.asarray(queries)


def exact_topk(data: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Ground truth ids (nq, k) by inner product, computed exactly in torch, a block of queries at a time."""
    import torch

    from kvsearch.index.torch_index import TorchIndex

    index = TorchIndex(data.shape[1])
    index.build(torch.arange(len(data)), torch.from_numpy(np.ascontiguousarray(data)))
    return index.search(torch.from_numpy(np.ascontiguousarray(queries)), k).ids.numpy()


def recall_at(found: np.ndarray, truth: np.ndarray, k: int = 10) -> float:
    """Mean fraction of the true top-k found among the first k results."""
    hits = [len(set(f[:k].tolist()) & set(t[:k].tolist())) for f, t in zip(found, truth)]
    return float(np.mean(hits)) / k


# --------------------------------------------------------------------------------------------- tables


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table."""

    def cell(x: Any) -> str:
        if isinstance(x, float):
            if x != x:
                return "-"
            return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def report(title: str, command: str, info: dict[str, Any], sections: Sequence[tuple[str, str]], append: bool) -> str:
    """Print the tables and (unless told not to) append them to RESULTS.md under a dated heading."""
    end = machine()["load_average"]
    text = [
        f"## {title} — {info['date']}",
        "",
        f"`{command}`",
        "",
        describe_machine(info) + f" Load average at the end: {end}.",
        "",
    ]
    for heading, body in sections:
        text += [f"### {heading}", "", body, ""]
    out = "\n".join(text)
    print(out)
    if append:
        with open(RESULTS, "a") as f:
            f.write("\n" + out)
    return out


def command_line() -> str:
    """How this script was run, for the results."""
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
