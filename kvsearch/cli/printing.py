"""What the ``kvsearch`` command prints: answer tables, ``info`` lines, fine-tuning tables, sizes.

Pure formatting of plain values (dicts, a :class:`~kvsearch.training.loop.History`); it knows nothing of opening
databases or of argparse (that is :mod:`kvsearch.cli.parser`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvsearch.metadata.codec import to_json

if TYPE_CHECKING:
    from kvsearch.training.config import History

__all__ = [
    "answer_table",
    "info_text",
    "encoder_text",
    "metadata_text",
    "cell",
    "last_run_text",
    "human_size",
    "counted",
    "history_table",
]


#: The widest a key, value or metadata cell of an answer table gets; longer texts end in "…".
MAX_CELL = 40


_KINDS = {  # what `kvsearch info` says of each kind of database folder, and what opens it
    "plain": "a database (kvsearch.Database)",
    "sharded": "a sharded database (kvsearch.distributed.ShardedDatabase)",
}


def info_text(info: dict[str, Any]) -> str:
    """The text form of ``kvsearch info``: one ``name  value`` line each, names aligned; what a database does
    not have (shards of a plain one, generations of a sharded one) is left out, and so are the internals that
    ``info --json`` keeps (the store version, the bare dims, the exact byte count)."""
    previous = info.get("previous_generation")
    generation = info.get("generation")
    records = f"{info['records']:,}"
    if info.get("indexed") is not None and info["indexed"] != info["records"]:
        records += f" ({info['indexed']:,} in the index)"
    per_shard = info.get("records_per_shard")
    dim, value_dim = info["dim"], info["value_dim"]
    rows = [
        ("path", info["path"]),
        ("kind", _KINDS.get(info.get("kind"), info.get("kind"))),
        ("records", records),
        ("shards", None if per_shard is None else f"{info['shards']} (records: {', '.join(map(str, per_shard))})"),
        ("encoder", encoder_text(info["encoder"], dim, absent=f"none: keys are embeddings (dim {dim})")),
        ("query encoder", encoder_text(info["query_encoder"], dim, absent="the key encoder")),
        (
            "value encoder",
            encoder_text(info["value_encoder"], value_dim, absent=f"none: values are embeddings (dim {value_dim})"),
        ),
        ("index", f"{info['index']}, score {info['score']}"),
        (
            "generation",
            None
            if generation is None
            else f"{generation} (no previous generation to roll back to)"
            if previous is None
            else f"{generation} (previous {previous}: kvsearch rollback returns to it)",
        ),
        ("last run", None if "last_run" not in info else _last_run_or_none(info["last_run"])),
        ("size on disk", human_size(info["size_bytes"])),
    ]
    rows = [(name, value) for name, value in rows if value is not None]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _last_run_or_none(run: dict[str, Any] | None) -> str:
    return "none" if not run else last_run_text(run)


def answer_table(results: list[dict[str, Any]], pooling: str) -> str:
    """The text form of ``kvsearch query``: per query a title line (its answer, or "not found"), then its
    candidates best first, one aligned row each — key, value, weight, and the metadata when a candidate has
    some. Long texts are cut at :data:`MAX_CELL` characters; ``--json`` has them whole."""
    blocks = []
    for r in results:
        head = f"query {r['query']!r} ({pooling}): " + (f"answer {r['value']!r}" if r["found"] else "not found")
        if not r["candidates"]:
            blocks.append(head)
            continue
        with_metadata = any(c.get("metadata") for c in r["candidates"])
        rows = [["key", "value", "weight", *(["metadata"] if with_metadata else [])]]
        for c in r["candidates"]:
            value = "<embedding>" if c["value"] is None else c["value"]
            row = [cell(str(c["key"])), cell(str(value)), f"{c['weight']:.4f}"]
            rows.append(row + ([cell(metadata_text(c.get("metadata") or {}))] if with_metadata else []))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        rows.insert(1, ["-" * w for w in widths])
        lines = []
        for row in rows:
            cells = [f"{row[0]:<{widths[0]}}", f"{row[1]:<{widths[1]}}", f"{row[2]:>{widths[2]}}", *row[3:]]
            lines.append("  " + "  ".join(cells))
        blocks.append("\n".join([head, *lines]))
    return "\n\n".join(blocks)


def cell(text: str, width: int = MAX_CELL) -> str:
    """A table cell: control characters (line breaks, tabs) as spaces, cut to ``width`` with a trailing "…"."""
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def metadata_text(metadata: dict[str, Any]) -> str:
    """Metadata as ``year=2001 lang=en`` (texts bare, other values as JSON: ``ok=true``, ``note=null``; datetimes
    as ISO text)."""
    metadata = to_json(metadata)
    return " ".join(
        f"{name}={value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
        for name, value in metadata.items()
    )


def records_table(rows: list[dict[str, Any]]) -> str:
    """``kvsearch list``: one line per record, ``id  key -> value  metadata``; "no records" for none."""
    if not rows:
        return "no records"
    width = max(len(str(r["id"])) for r in rows)
    lines = []
    for r in rows:
        key = "<embedding>" if r["key"] is None else cell(r["key"])
        value = "<embedding>" if r["value"] is None else cell(r["value"])
        meta = metadata_text(r["metadata"])
        lines.append(f"{r['id']:>{width}}  {key} -> {value}" + (f"  {meta}" if meta else ""))
    return "\n".join(lines)


def encoder_text(config: dict[str, Any] | str | None, dim: int | None, *, absent: str = "none") -> str:
    """An encoder as ``ngram, dim 256`` (a sentence encoder with its model: ``sentence all-MiniLM-L6-v2, dim
    384``); ``absent`` for None; a string (such as "the key encoder") as is."""
    if config is None:
        return absent
    if isinstance(config, str):
        return config
    kind = str(config.get("kind") or "encoder")
    if kind == "sentence":
        kind += f" {config.get('model') or 'all-MiniLM-L6-v2'}"
    elif config.get("model") is not None:
        kind += f" {config['model']}"
    dim = config.get("dim", dim)
    return kind if dim is None else f"{kind}, dim {dim}"


def last_run_text(run: dict[str, Any]) -> str:
    """One line for a fine-tuning run recorded by ``finetune`` (``encoders_info()["last_run"]``).

    Shows what the record holds, in this order: the metric before -> after, the kept epoch, epochs, steps,
    seconds, what was trained and with which loss, the date. Records written by older versions may lack some.
    """
    parts = []
    metric = run.get("metric", "metric")
    before, after = run.get("before"), run.get("after")
    if before is not None or after is not None:
        parts.append(f"{metric} {number(before)} -> {number(after)}")
    if run.get("kept_epoch") is not None:
        kept = int(run["kept_epoch"])
        of = f" of {run['epochs']}" if run.get("epochs") is not None else ""
        parts.append(f"kept epoch {kept}{of}" + (" (the start: nothing was committed)" if kept == 0 else ""))
    elif run.get("epochs") is not None:
        parts.append(counted(int(run["epochs"]), "epoch"))
    if run.get("steps") is not None:
        parts.append(counted(int(run["steps"]), "step"))
    if run.get("seconds") is not None:
        parts.append(f"{float(run['seconds']):.1f} s")
    if run.get("train") is not None:
        parts.append(f"train={run['train']}")
    if run.get("loss") is not None:
        parts.append(f"loss={run['loss']}")
    if run.get("date") is not None:
        parts.append(str(run["date"]))
    return ", ".join(parts) or json.dumps(run)


def number(value: Any) -> str:
    return "?" if value is None else f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """A count and its noun, singular for exactly one: ``counted(1, "epoch")`` is "1 epoch", ``counted(2, "query",
    "queries")`` "2 queries" (``plural`` defaults to ``noun + "s"``), ``counted(0, "record")`` "0 records"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def history_table(history: History) -> str:
    """The eval metrics of a fine-tuning run, one row per evaluation (epoch 0 is before training), as a table.

    Columns: the epoch, the step, the mean training loss of that epoch, then every metric (recall@1, recall@k
    shown with its k, MRR, or the eval loss on tensor pairs). The row of the kept epoch is marked.
    """
    names = [name for name in history.metrics[0] if name not in ("epoch", "step")]
    headers = {"recall@k": f"recall@{history.k}", "mrr": "MRR", "loss": "eval loss"}
    header = ["epoch", "step", "train loss", *(headers.get(name, name) for name in names)]
    rows = []
    for m in history.metrics:
        epoch = int(m["epoch"])
        train_loss = history.epoch_losses[epoch - 1] if 1 <= epoch <= len(history.epoch_losses) else None
        row = [str(epoch), str(int(m["step"])), "-" if train_loss is None else f"{train_loss:.4f}"]
        row += [f"{m[name]:.4f}" if name in m else "-" for name in names]
        if epoch == history.kept_epoch:
            row.append("<- kept" + (" (the start)" if epoch == 0 else ""))
        elif epoch == 0:
            row.append("(before)")
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(f"{cell:>{w}}" for cell, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = "  ".join(f"{cell:>{w}}" for cell, w in zip(row, widths))
        lines.append(f"{cells}  {row[len(widths)]}" if len(row) > len(widths) else cells)
    return "\n".join(lines)
