"""The benchmarks' plots: PNGs drawn with matplotlib from the JSON a run leaves in ``results/``, into ``plots/``.

    python benchmarks/plots.py                      # redraw every plot from results/*.json
    python benchmarks/plots.py bench_layer-cpu      # one section's plots
    python benchmarks/plots.py --from-results-md bench_layer-cpu   # first make its JSON from RESULTS.md's tables

``common.report`` calls :func:`draw` at the end of every run that writes its section, so the PNGs committed beside
RESULTS.md are those of the run whose tables it shows. The plots (see :data:`PLOTS`):

- ``bench_serving-qps-recall``: single-query QPS (log scale) against recall@10 on the MiniLM names, one line per
  store and build, one point per search setting (efSearch, expansion_search, ef, ...); the stores with one
  setting (exact scans, Chroma at its defaults) are single points.
- ``bench_layer-<device>-layer``: ``KVAttention`` forward + backward time against the batch size beside the same
  top-k attention in bare torch (left), and their ratio (right).
- ``bench_layer-<device>-memory``: a kNN memory's time per training step, kvsearch beside bare torch (and any
  other peer whose column the table has), growing and with a capacity.
- ``bench_layer-<device>-candidates``: ``Database(None).candidates(q, k)`` against the batch size beside bare
  ``torch.topk(q @ K.T, k)`` (one kind of keys, per dim), and the speed-up for every kind of keys.
- ``bench_memory-memorisation``: the facts a small model answers right against training steps, with a
  ``ProductKeyMemory`` layer and with dense FFNs of the same FLOPs per fact (left); ``ProductKeyMemory`` forward +
  backward beside lucidrains' ``PKM`` per size (right).

This module knows the tables' column names and the serving JSON's points; it knows nothing of kvsearch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent

#: Section name -> the PNGs (stems) drawn for it.
PLOTS: dict[str, tuple[str, ...]] = {
    "bench_serving": ("bench_serving-qps-recall",),
    "bench_layer-cpu": ("bench_layer-cpu-layer", "bench_layer-cpu-memory", "bench_layer-cpu-candidates"),
    "bench_layer-cuda": ("bench_layer-cuda-layer", "bench_layer-cuda-memory", "bench_layer-cuda-candidates"),
    "bench_memory": ("bench_memory-memorisation",),
}
RECALL_TARGET = 0.97


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(record: dict[str, Any]) -> str:
    """The run's date, machine and load, for a figure's caption."""
    info = record.get("machine", {})
    load = info.get("load_average", ("?",))
    end = record.get("load_end", ("?",))
    return (
        f"{info.get('date', '?')}; {info.get('nproc', '?')} cores ({info.get('cpu', '?')}), "
        f"{info.get('memory_gib', '?')} GiB; load {load[0]} -> {end[0]}\n{record.get('command', '')}"
    )


def _find_table(record: dict[str, Any], column: str) -> dict[str, Any] | None:
    """The first table of the run with a column whose name holds ``column``."""
    for t in record.get("tables", []):
        if any(column in h for h in t["headers"]):
            return t
    return None


def _column(t: dict[str, Any], name: str) -> int:
    return next(i for i, h in enumerate(t["headers"]) if name in h)


def _number(x: Any) -> float:
    if isinstance(x, bool):
        return float("nan")
    if isinstance(x, int | float):
        return float(x)
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return float("nan")


# --------------------------------------------------------------------------------------------- bench_serving


def serving(record: dict[str, Any], folder: Path) -> list[Path]:
    """QPS (log) against recall@10, one line per store and build (bench_serving's figure 3)."""
    runs = record.get("points", {}).get("qps", [])
    runs = [r for r in runs if not math.isnan(_number(r.get("recall"))) and r.get("us")]
    if not runs:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 6.2))
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["key"], []).append(r)
    colours = plt.get_cmap("tab20").colors  # 20 distinct colours: one per store and build
    for i, (key, rs) in enumerate(groups.items()):
        rs = sorted(rs, key=lambda r: (r["setting"] is None, r["setting"] or 0))
        x = [r["recall"] for r in rs]
        y = [1e6 / r["us"] for r in rs]
        ours = key.startswith("kv")
        style = dict(marker="o" if ours else "s", linewidth=2.2 if ours else 1.2, markersize=5 if len(rs) > 1 else 8)
        style["color"] = colours[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]
        ax.plot(x, y, label=rs[0].get("store", key), linestyle="-" if ours else "--", **style)
        for r in rs if len(rs) > 1 else ():
            ax.annotate(str(r["setting"]), (r["recall"], 1e6 / r["us"]), fontsize=6, alpha=0.6,
                        xytext=(2, 2), textcoords="offset points")  # fmt: skip
    ax.axvline(RECALL_TARGET, color="grey", linewidth=0.8, linestyle=":")
    ax.annotate(f"recall@10 = {RECALL_TARGET}", (RECALL_TARGET, 1), xycoords=("data", "axes fraction"),
                xytext=(3, -12), textcoords="offset points", fontsize=7, color="grey")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("recall@10 (misspelt-name queries against exact search)")
    ax.set_ylabel("single-query QPS (one query per call, log scale)")
    n = record.get("points", {}).get("n")
    ax.set_title(f"QPS vs recall@10, {n:,} MiniLM name embeddings (d=384, k=10)" if n else "QPS vs recall@10")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.text(0.01, 0.005, _subtitle(record), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return [_save(fig, folder, "bench_serving-qps-recall")]


# --------------------------------------------------------------------------------------------- bench_layer


def layer(record: dict[str, Any], folder: Path) -> list[Path]:
    """KVAttention fwd+bwd against batch size beside bare torch; the kNN memory per step beside its peers."""
    device = record["name"].removeprefix("bench_layer-")
    out = []
    t = _find_table(record, "KVAttention ms")
    if t is not None:
        out.append(_layer_plot(record, t, folder, f"bench_layer-{device}-layer"))
    t = _find_table(record, "candidates ms")
    if t is not None:
        out.append(_candidates_plot(record, t, folder, f"bench_layer-{device}-candidates"))
    t = _find_table(record, "ms / step")
    if t is not None:
        out.append(_memory_plot(record, t, folder, f"bench_layer-{device}-memory"))
    return out


def _layer_plot(record: dict[str, Any], t: dict[str, Any], folder: Path, stem: str) -> Path:
    plt = _pyplot()
    dim, keys, batch = _column(t, "dim"), _column(t, "keys"), _column(t, "batch")
    bare, ours = _column(t, "bare torch ms"), _column(t, "KVAttention ms")
    lines: dict[str, list[tuple[float, float, float]]] = {}
    for row in t["rows"]:
        label = f"d={row[dim]}, {row[keys]} keys"
        lines.setdefault(label, []).append((_number(row[batch]), _number(row[bare]), _number(row[ours])))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    for i, (label, pts) in enumerate(lines.items()):
        pts.sort()
        colour = f"C{i}"
        xs = [p[0] for p in pts]
        left.plot(xs, [p[2] for p in pts], "o-", color=colour, linewidth=2, label=f"KVAttention, {label}")
        left.plot(xs, [p[1] for p in pts], "s--", color=colour, linewidth=1, label=f"bare torch, {label}")
        right.plot(xs, [p[2] / p[1] for p in pts], "o-", color=colour, label=label)
    _batch_axes(left, right)
    left.set_yscale("log")
    left.set_ylabel("forward + backward, ms (log)")
    left.set_title("KVAttention vs the same top-k attention in bare torch")
    left.legend(fontsize=7)
    right.axhline(1.1, color="grey", linestyle=":", linewidth=1, label="target <= 1.1x")
    right.axhline(1.0, color="black", linewidth=0.6)
    right.set_ylabel("KVAttention time / bare torch time")
    right.set_title("ratio (same process, interleaved medians)")
    right.legend(fontsize=7)
    fig.text(0.01, 0.005, _subtitle(record), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, folder, stem)


def _candidates_plot(record: dict[str, Any], t: dict[str, Any], folder: Path, stem: str) -> Path:
    plt = _pyplot()
    dim, keys, kind, batch = (_column(t, c) for c in ("dim", "keys", "kind", "batch"))
    bare, ours = _column(t, "bare torch ms"), _column(t, "candidates ms")
    lines: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for row in t["rows"]:
        lines.setdefault((f"d={row[dim]}, {row[keys]} keys", str(row[kind])), []).append(
            (_number(row[batch]), _number(row[bare]), _number(row[ours]))
        )
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    first_kind = str(t["rows"][0][kind]) if t["rows"] else ""
    colours: dict[str, str] = {}
    for (size, kind_), pts in lines.items():
        pts.sort()
        colour = colours.setdefault(size, f"C{len(colours)}")
        xs = [p[0] for p in pts]
        if kind_ == first_kind:
            left.plot(xs, [p[2] for p in pts], "o-", color=colour, linewidth=2, label=f"candidates, {size}")
            left.plot(xs, [p[1] for p in pts], "s--", color=colour, linewidth=1, label=f"bare torch, {size}")
        style = {"random": "-", "unit": "--", "clustered": ":", "norms100": "-."}.get(kind_, "-")
        right.plot(xs, [p[1] / p[2] for p in pts], style, color=colour, marker=".", label=f"{size}, {kind_}")
    _batch_axes(left, right)
    left.set_yscale("log")
    left.set_ylabel("ms per call (log)")
    left.set_title(f"candidates(q, k) vs bare torch.topk(q @ K.T, k), {first_kind} keys", fontsize=10)
    left.legend(fontsize=7)
    right.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="target >= 1x")
    right.set_ylabel("bare torch time / candidates time")
    right.set_title("speed-up over bare torch, every kind of keys", fontsize=10)
    right.legend(fontsize=5.5, ncol=2, loc="best")
    fig.text(0.01, 0.005, _subtitle(record), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _save(fig, folder, stem)


def _memory_plot(record: dict[str, Any], t: dict[str, Any], folder: Path, stem: str) -> Path:
    plt = _pyplot()
    cap = _column(t, "capacity")
    start = next((i for i, h in enumerate(t["headers"]) if h.startswith("rows at start")), None)
    series = [(i, h.removesuffix(" ms / step")) for i, h in enumerate(t["headers"]) if h.endswith("ms / step")]
    groups = []
    for row in t["rows"]:
        rows = _number(row[start]) if start is not None else 0.0
        label = f"from {row[start]} rows" if rows and rows == rows else "from empty"
        groups.append(label + ("" if str(row[cap]) in ("-", "None") else f",\ncapacity {row[cap]}"))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    width = 0.8 / len(series)
    for j, (col, label) in enumerate(series):
        xs = [g + (j - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [_number(row[col]) for row in t["rows"]]
        bars = ax.bar(xs, [0.0 if y != y else y for y in ys], width, label=label)
        ax.bar_label(bars, labels=["not run" if y != y else f"{y:.3g}" for y in ys], fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("ms per training step (add rows, attend, backward)")
    steps = t["rows"][0][_column(t, "steps")] if t["rows"] else "?"
    ax.set_title(f"kNN memory in a training loop ({steps} timed steps a row)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.005, _subtitle(record), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return _save(fig, folder, stem)


# --------------------------------------------------------------------------------------------- bench_memory


def memory_layer(record: dict[str, Any], folder: Path) -> list[Path]:
    """Memorisation accuracy against steps, memory layer beside dense FFNs; forward + backward beside lucidrains."""
    curves = record.get("points", {}).get("curves", {})
    t = _find_table(record, "lucidrains PKM ms")
    if not curves and t is None:
        return []
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8))
    for name, curve in curves.items():
        ours = name.startswith("ProductKeyMemory")
        left.plot([p[0] for p in curve], [p[1] for p in curve], "o-" if ours else "s--", linewidth=2 if ours else 1,
                  label=name)  # fmt: skip
    left.set_xlabel("training steps")
    left.set_ylabel("facts answered right (all facts)")
    left.set_ylim(0, 1.02)
    left.set_title("Memorisation: memory layer vs dense FFN, equal FLOPs / fact", fontsize=10)
    left.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    if t is not None:
        cols = {c: _column(t, c) for c in ("device", "threads", "clock", "n", "lucidrains PKM ms", "kvsearch ms")}
        rows = [r for r in t["rows"] if not math.isnan(_number(r[cols["kvsearch ms"]]))]
        labels = [f"{r[cols['device']]}, n={r[cols['n']]}\n{r[cols['threads']]} thr., {r[cols['clock']]}" for r in rows]
        xs = range(len(rows))
        for j, (col, label) in enumerate((("lucidrains PKM ms", "lucidrains PKM"), ("kvsearch ms", "kvsearch"))):
            ys = [_number(r[cols[col]]) for r in rows]
            bars = right.bar([x + (j - 0.5) * 0.4 for x in xs], ys, 0.4, label=label)
            right.bar_label(bars, labels=[f"{y:.0f}" for y in ys], fontsize=7)
        right.set_xticks(list(xs), labels, fontsize=7)
        right.set_ylabel("forward + backward, ms (median)")
        right.set_title("ProductKeyMemory vs lucidrains' PKM (same weights)", fontsize=10)
        right.grid(True, axis="y", alpha=0.3)
        right.legend(fontsize=8)
    fig.text(0.01, 0.005, _subtitle(record), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return [_save(fig, folder, "bench_memory-memorisation")]


# --------------------------------------------------------------------------------------------- entry points

DRAW: dict[str, Callable[[dict[str, Any], Path], list[Path]]] = {
    "bench_serving": serving,
    "bench_layer-cpu": layer,
    "bench_layer-cuda": layer,
    "bench_memory": memory_layer,
}


def _batch_axes(*axes: Any) -> None:
    """The batch-size x axis the layer plots share: log 2, labelled, gridded."""
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (queries per call)")
        ax.grid(True, which="both", alpha=0.3)


def _save(fig: Any, folder: Path, stem: str) -> Path:
    out = folder / "plots"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.png"
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def draw(name: str, folder: Path = ROOT) -> list[Path]:
    """Draw the plots of section ``name`` from ``folder/results/NAME.json`` into ``folder/plots/``.

    Args:
        name: a section of RESULTS.md (``bench_serving``, ``bench_layer-cpu``, ...).
        folder: the folder holding ``results/`` (the benchmarks folder, or ``$KVSEARCH_BENCH_OUT``).

    Returns:
        The PNGs written (none for a section without plots).
    """
    if name not in DRAW:
        return []
    record = json.loads((folder / "results" / f"{name}.json").read_text())
    paths = DRAW[name](record, folder)
    for path in paths:
        print(f"plot: {path}", file=sys.stderr)
    return paths


def tables_from_markdown(text: str) -> list[dict[str, Any]]:
    """The tables of a RESULTS.md section as ``{"heading", "headers", "rows"}`` (cells as text)."""
    tables: list[dict[str, Any]] = []
    heading, lines = "", text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("### "):
            heading = lines[i][4:]
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|(-+\|)+\s*$", lines[i + 1]):
            headers = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            tables.append({"heading": heading, "headers": headers, "rows": rows})
            continue
        i += 1
    return tables


def record_from_results_md(name: str, results: Path) -> dict[str, Any]:
    """A run's JSON made from its section of RESULTS.md (for a section written before the JSON existed)."""
    text = results.read_text()
    m = re.search(rf"<!-- section: {re.escape(name)} -->\n(.*?)<!-- end: {re.escape(name)} -->", text, re.S)
    if m is None:
        raise SystemExit(f"no section {name} in {results}")
    body = m.group(1)
    command = re.search(r"^`(python [^`]*)`", body, re.M)
    date = re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", body)
    cpu = re.search(r"(\d+) cores \((.*?)\), ([\d.]+) GiB", body)
    loads = re.findall(r"\(([\d.]+), [\d.]+, [\d.]+\)", body)
    info = {"date": date.group(0) if date else "?", "load_average": [loads[0]] if loads else ["?"]}
    if cpu:
        info.update(nproc=int(cpu.group(1)), cpu=cpu.group(2), memory_gib=float(cpu.group(3)))
    return {
        "name": name,
        "title": name,
        "command": command.group(1) if command else "",
        "machine": info,
        "load_end": [loads[-1]] if loads else ["?"],
        "tables": tables_from_markdown(body),
        "points": {},
        "from": "RESULTS.md (tables as printed: 3 significant digits)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="sections to draw (default: every results/*.json)")
    parser.add_argument("--from-results-md", action="store_true", help="make each JSON from RESULTS.md first")
    parser.add_argument("--folder", default=str(ROOT), help="holds results/ and plots/ (default: this folder)")
    args = parser.parse_args()
    folder = Path(args.folder)
    names = args.names or sorted(p.stem for p in (folder / "results").glob("*.json"))
    for name in names:
        if args.from_results_md:
            (folder / "results").mkdir(parents=True, exist_ok=True)
            record = record_from_results_md(name, folder / "RESULTS.md")
            (folder / "results" / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        draw(name, folder)


if __name__ == "__main__":
    main()
