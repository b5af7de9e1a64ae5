"""Shared helpers of the benchmarks: data sets (cached under benchmarks/.cache), timing, peak memory measured
in a fresh process, machine description, and the sections of benchmarks/RESULTS.md (each script replaces its own).

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

Results: :func:`report` prints a run's tables and, unless told not to, REPLACES the script's own section of
``RESULTS.md`` (between ``<!-- section: NAME -->`` and ``<!-- end: NAME -->``; the other sections untouched, the
sections kept in the order of :data:`SECTIONS`, the contents at the top of the file rewritten), writes the run's
tables and points as JSON to ``results/NAME.json`` and draws its plots (``plots.py``) into ``plots/``. The
environment variable ``KVSEARCH_BENCH_OUT`` sends all three to another folder (a trial run that leaves the
committed files alone).
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import platform
import re
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
        head = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=REPO)
        info["commit"] = head.stdout.strip() or "-"
    except OSError:
        info["commit"] = "-"
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
        f"(the machine is shared: timings are perturbed by other work), Python {info['python']}, {versions}, "
        f"kvsearch at commit {info.get('commit', '-')}."
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


class Table(str):
    """A Markdown table (a ``str``) that also keeps its headers and rows, so a report can save them as JSON."""

    headers: list[str]
    rows: list[list[Any]]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """A Markdown table; ``.headers`` and ``.rows`` hold the values it was made of."""

    def cell(x: Any) -> str:
        if isinstance(x, float):
            if x != x:
                return "-"
            return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
        return str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    out = Table("\n".join(lines))
    out.headers, out.rows = [str(h) for h in headers], [list(row) for row in rows]
    return out


#: The sections of RESULTS.md, in the order they appear (as benchmarks/README.md describes the scripts): name ->
#: the script that writes it. A name not listed goes after these.
SECTIONS: dict[str, str] = {
    "bench_search": "bench_search.py",
    "bench_exact_path": "bench_exact_path.py",
    "bench_attention": "bench_attention.py",
    "bench_attention-ann": "bench_attention.py --ann-only",
    "bench_layer-cpu": "bench_layer.py",
    "bench_layer-cuda": "bench_layer.py --device cuda",
    "bench_memory": "bench_memory.py",
    "bench_serving": "bench_serving.py",
    "bench_ingest": "bench_ingest.py",
    "bench_index_storage": "bench_index_storage.py",
    "bench_readers": "bench_readers.py",
    "bench_chroma": "bench_chroma.py",
    "bench_distributed": "bench_distributed.py",
    "bench_shards_open": "bench_shards_open.py",
    "bench_finetune": "bench_finetune.py",
    "bench_finetune-headline": "bench_finetune.py --headline",
    "bench_finetune-study": "bench_finetune.py --study",
    "bench_semantic": "bench_semantic.py",
    "bench_encode": "bench_encode.py",
}
_SECTION = re.compile(r"<!-- section: (\S+) -->\n.*?<!-- end: \1 -->\n?", re.S)
_CONTENTS = re.compile(r"<!-- contents -->\n.*?<!-- end: contents -->\n?", re.S)


def out_folder() -> Path:
    """Where RESULTS.md, results/ and plots/ are written: this folder, or ``$KVSEARCH_BENCH_OUT``."""
    return Path(os.environ.get("KVSEARCH_BENCH_OUT") or ROOT)


def results_file() -> Path:
    """The RESULTS.md that :func:`write_section` edits."""
    return RESULTS if "KVSEARCH_BENCH_OUT" not in os.environ else out_folder() / "RESULTS.md"


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def contents(text: str) -> str:
    """The contents block of RESULTS.md: a link to each section present, and to its plots."""
    lines = ["<!-- contents -->"]
    for match in _SECTION.finditer(text):
        name = match.group(1)
        heading = next((ln[3:] for ln in match.group(0).splitlines() if ln.startswith("## ")), name)
        date = re.search(r"\d{4}-\d\d-\d\d( \d\d:\d\d(-\d\d:\d\d)? UTC)?", match.group(0))
        line = f"- [{heading}](#{anchor(heading)})" + (f" — {date.group(0)}" if date else "")
        plots = sorted((out_folder() / "plots").glob(f"{name}*.png"))
        if plots:
            line += "; plots: " + ", ".join(f"[{p.stem}](plots/{p.name})" for p in plots)
        lines.append(line)
    return "\n".join(lines + ["<!-- end: contents -->", ""])


def place_section(text: str, name: str, body: str) -> str:
    """``text`` (a RESULTS.md) with the section ``name`` replaced by ``body`` (or inserted at its place in
    :data:`SECTIONS`), the other sections as they were and the contents block rewritten."""
    block = f"<!-- section: {name} -->\n{body.strip()}\n<!-- end: {name} -->\n"
    order = list(SECTIONS)
    rank = order.index(name) if name in order else len(order)
    found = {m.group(1): m for m in _SECTION.finditer(text)}
    if name in found:
        m = found[name]
        text = text[: m.start()] + block + text[m.end() :]
    else:
        later = [m for key, m in found.items() if (order.index(key) if key in order else len(order)) > rank]
        at = min((m.start() for m in later), default=None)
        if at is None:
            text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + block
        else:
            text = text[:at] + block + "\n" + text[at:]
    if _CONTENTS.search(text):
        text = _CONTENTS.sub(lambda _: contents(text), text, count=1)
    return text


def write_section(name: str, body: str) -> Path:
    """Replace the section ``name`` of RESULTS.md by ``body`` (a file lock keeps two runs that end together from
    losing one another's section). Returns the file written."""
    path = results_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    with open(path, "r+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = place_section(f.read(), name, body)
        f.seek(0)
        f.write(text)
        f.truncate()
    return path


def section_name(title: str) -> str:
    """The section a script's report replaces by default: the script's file name (``bench_search``)."""
    stem = Path(sys.argv[0]).stem
    return stem if stem.startswith("bench_") else re.sub(r"\W+", "_", title).strip("_").lower()


def save_points(name: str, record: dict[str, Any]) -> Path:
    """Write ``record`` (a run's machine, tables and points) to ``results/NAME.json``."""
    folder = out_folder() / "results"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def report(
    title: str,
    command: str,
    info: dict[str, Any],
    sections: Sequence[tuple[str, str]],
    append: bool,
    *,
    name: str | None = None,
    points: dict[str, Any] | None = None,
) -> str:
    """Print a run's tables; unless ``append`` is false, make them the script's section of RESULTS.md.

    Args:
        title: the section's heading (``## title``; kept stable so that links to it keep working).
        command: the command line of the run (:func:`command_line`).
        info: :func:`machine` taken at the start of the run.
        sections: (sub-heading, Markdown) pairs; a body made by :func:`table` is saved as values in the JSON.
        append: False: print only (``--no-append``). True: replace the section ``name`` of RESULTS.md, write
            ``results/NAME.json`` and draw the run's plots (``plots.py``) into ``plots/``.
        name: the section replaced (default: the script's file name, see :data:`SECTIONS`).
        points: extra values for the plots (saved in the JSON under ``"points"``).

    Returns:
        The section's Markdown.
    """
    name = name or section_name(title)
    now = machine()
    end = now["load_average"]
    text = [
        f"## {title}",
        "",
        f"`{command}`",
        "",
        describe_machine(info) + f" Ended {now['date']}, load average at the end {end}.",
        "",
    ]
    for heading, body in sections:
        text += [f"### {heading}", "", body, ""]
    plot_files = _plots_of(name)
    if plot_files:
        text += ["Plots: " + ", ".join(f"[{p.stem}](plots/{p.name})" for p in plot_files), ""]
    out = "\n".join(text)
    print(out)
    if not append:
        return out
    tables = [
        {"heading": heading, "headers": body.headers, "rows": body.rows}
        for heading, body in sections
        if isinstance(body, Table)
    ]
    record = {"name": name, "title": title, "command": command, "machine": info, "load_end": end}
    save_points(name, {**record, "tables": tables, "points": points or {}})
    try:
        import plots

        plots.draw(name, out_folder())
    except Exception as exc:  # a plot that fails must not lose the run's tables
        print(f"plots of {name} failed: {exc!r}", file=sys.stderr)
    print(f"section {name} of {write_section(name, out)} replaced", file=sys.stderr)
    return out


def _plots_of(name: str) -> list[Path]:
    """The PNGs that plots.py draws for section ``name`` (none for a section without plots)."""
    try:
        import plots
    except ImportError:
        return []
    return [out_folder() / "plots" / f"{stem}.png" for stem in plots.PLOTS.get(name, ())]


def command_line() -> str:
    """How this script was run, for the results."""
    return "python " + " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
