"""What the ``kvsearch`` command prints: answer tables, ``info`` lines, fine-tuning tables, sizes.

Pure formatting of plain values (dicts, a :class:`~kvsearch.training.History`); it knows nothing of opening
databases or of argparse (that is :mod:`kvsearch.cli`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvsearch.training_config import History

__all__ = ["answer_table", "info_text", "encoder_text", "last_run_text", "human_size", "history_table"]


def info_text(info: dict[str, Any]) -> str:
    """The text form of ``kvsearch info``: one ``name  value`` line each, the encoders as kind and dim; the rows
    a database does not have (shards of a plain one, generations of a sharded one) are left out."""
    previous = info.get("previous_generation")
    generation = info.get("generation")
    rows = [
        ("path", info["path"]),
        ("shards", info.get("shards")),
        ("records", info["records"]),
        ("records_per_shard", ", ".join(str(n) for n in info.get("records_per_shard") or []) or None),
        ("dim", info["dim"]),
        ("value_dim", info["value_dim"]),
        ("encoder", encoder_text(info["encoder"], info["dim"])),
        ("query_encoder", encoder_text(info["query_encoder"], info["dim"], absent="none (the key encoder)")),
        ("value_encoder", encoder_text(info["value_encoder"], info["value_dim"])),
        ("index", info["index"]),
        ("indexed", info["indexed"]),
        ("score", info["score"]),
        ("store_version", info.get("store_version")),
        (
            "generation",
            None
            if generation is None
            else f"{generation} (no previous generation to roll back to)"
            if previous is None
            else f"{generation} (previous {previous}: kvsearch rollback returns to it)",
        ),
        ("last_run", None if "last_run" not in info else _last_run_or_none(info["last_run"])),
        ("size on disk", human_size(info["size_bytes"])),
    ]
    rows = [(name, value) for name, value in rows if value is not None]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _last_run_or_none(run: dict[str, Any] | None) -> str:
    return "none" if not run else last_run_text(run)


def answer_table(results: list[dict[str, Any]], pooling: str) -> str:
    blocks = []
    for r in results:
        head = f"query {r['query']!r} ({pooling}): " + (f"answer {r['value']!r}" if r["found"] else "not found")
        rows = [("key", "value", "weight")]
        rows += [
            (str(c["key"]), "<embedding>" if c["value"] is None else str(c["value"]), f"{c['weight']:.4f}")
            for c in r["candidates"]
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows]
        lines.insert(1, "  " + "  ".join("-" * w for w in widths))
        blocks.append("\n".join([head, *lines]) if r["candidates"] else head)
    return "\n\n".join(blocks)


def encoder_text(config: dict[str, Any] | str | None, dim: int | None, *, absent: str = "none") -> str:
    """An encoder as ``kind=ngram, dim=256`` (and its model, if named); ``absent`` for None; a string as is."""
    if config is None:
        return absent
    if isinstance(config, str):
        return config
    parts = {"kind": config.get("kind"), "dim": config.get("dim", dim)}
    if config.get("model") is not None:
        parts["model"] = config["model"]
    return ", ".join(f"{name}={value}" for name, value in parts.items() if value is not None)


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
        parts.append(f"{run['epochs']} epochs")
    if run.get("steps") is not None:
        parts.append(f"{run['steps']} steps")
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
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit} ({n} bytes)"
        size /= 1024
    return f"{n} B"  # pragma: no cover


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
