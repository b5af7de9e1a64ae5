"""The ``kvsearch`` commands: build, query, info, delete, list, count, finetune, rollback, reshard and demo, each on
parsed arguments.

Each ``cmd_*`` function takes the :class:`argparse.Namespace` of :func:`kvsearch.cli.parser.build_parser`, opens
the database it names (a plain folder or a sharded one, never created by accident except by ``build``), does its
work through the facades' public methods, prints its result on stdout (as JSON with ``--json``: datetimes and dates
in the tagged form that ``--where`` reads, :mod:`kvsearch.cli.datetimes`) and returns the exit status; a ``--where``
that compares an ISO string with a field holding datetimes is refused once the database is open;
:data:`COMMANDS` maps each command's name to its function. A failure raises (a :class:`KVSearchError` or a
:class:`~kvsearch.cli.parser.CommandError`); ``build`` removes what a failed build created.

It knows nothing of argument parsing, of how errors are shown or of exit statuses on errors
(:mod:`kvsearch.cli.program`), nor of how the databases store or search.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsearch.cli.datetimes import refuse_bare_datetimes, tagged
from kvsearch.cli.parser import PROG, CommandError
from kvsearch.cli.printing import answer_table, counted, history_table, info_text, records_table
from kvsearch.contract import parts_of
from kvsearch.distributed import layout as sharding
from kvsearch.storage import folder as folders

if TYPE_CHECKING:
    from kvsearch.contract import DatabaseProtocol
    from kvsearch.errors import BadFileError, UnknownTargetError
    from kvsearch.results import Answer

__all__ = [
    "COMMANDS",
    "cmd_build",
    "cmd_query",
    "cmd_info",
    "cmd_delete",
    "cmd_list",
    "cmd_count",
    "cmd_finetune",
    "finetune_options",
    "cmd_rollback",
    "cmd_reshard",
    "cmd_demo",
]


# ---------------------------------------------------------------------- opening


def _open_existing(path_text: str, *, unsharded_for: str | None = None) -> DatabaseProtocol:
    """Open a database that must exist (never create one by accident): a plain folder, or a sharded one with every
    shard opened by this process.

    Args:
        path_text: the folder.
        unsharded_for: what the command does, when it cannot work on a sharded database (that raises).

    Raises:
        CommandError: no database at ``path_text``.
        NotSupportedError: a sharded database and ``unsharded_for`` is given.
    """
    path = Path(path_text)
    if sharding.is_sharded(path):
        from kvsearch.distributed import ShardedDatabase
        from kvsearch.errors import NotSupportedError

        if unsharded_for is not None:
            raise NotSupportedError(
                f"{path_text!r} is a sharded database: {unsharded_for} is not supported across shards yet"
            )
        return ShardedDatabase(path)
    if not folders.is_database(path):
        folders.check_store_present(path)  # MissingFileError: what is left of a database whose store is gone
        raise CommandError(f"no kvsearch database at {path_text!r} (expected a folder with {folders.STORE_FILE})")
    from kvsearch.database import Database

    return Database(path)


def _is_sharded(db: DatabaseProtocol) -> bool:
    """Whether an opened database is made of shards (it has ``shards``: what only a sharded database offers)."""
    return getattr(db, "shards", None) is not None


# ---------------------------------------------------------------------- commands


def cmd_build(args: argparse.Namespace) -> int:
    """Create a database (or add to one) from a CSV, TSV or JSONL file; a failed build leaves nothing new."""
    from kvsearch.cli.ingest import ingest_file, upsert_file
    from kvsearch.encoders.registry import encoder_from_name

    path = Path(args.db)
    source = Path(args.source)
    if not source.is_file():
        raise CommandError(f"no file at {args.source!r}")
    metadata = args.metadata
    if metadata is not None and "all" in metadata:
        if len(metadata) > 1:
            raise CommandError(f"expected --metadata all alone or column names, got {' '.join(metadata)}")
        metadata = "all"
    sharded = args.shards is not None or sharding.is_sharded(path)
    if sharded and folders.is_database(path):
        raise CommandError(
            f"{args.db!r} holds a database that is not sharded: --shards creates a new sharded database "
            "(choose another folder)"
        )
    created = not (sharding.is_sharded(path) if sharded else folders.is_database(path))
    folder_existed = path.exists()
    shards_before = _existing_shard_dirs(path, args.shards) if sharded and created else set()
    creation = folders.Creation(path) if created and not sharded else None  # what the build makes, and only that
    encoder = encoder_from_name(args.encoder) if args.encoder else None
    if created and encoder is None:
        encoder = encoder_from_name("ngram")
    db: DatabaseProtocol | None = None
    try:
        if sharded:  # this one process opens (or creates) every shard
            from kvsearch.distributed import ShardedDatabase

            db = ShardedDatabase(path, num_shards=args.shards, encoder=encoder, index=args.index, score=args.score)
        else:
            from kvsearch.database import Database

            db = Database(path, encoder=encoder, index=args.index, score=args.score)
        ingest = upsert_file if args.upsert else ingest_file
        done = ingest(
            db,
            source,
            key=args.key,
            value=args.value,
            format=args.format,
            batch_size=args.batch_size,
            progress=not args.quiet,
            metadata=metadata,
        )
        total = len(db)
    except BaseException:
        if db is not None:
            with contextlib.suppress(Exception):  # the first error is the one to report (a full disk fails here too)
                db.close()
        if created and sharded:  # nothing half-written stays behind: not even an empty new database
            _remove_new_sharded_database(path, folder_existed, args.shards, shards_before)
        elif creation is not None:
            creation.rollback()  # only what this build made: never a file that was there before
        raise
    db.close()  # saves the index: a failure here leaves every record committed (the next open rebuilds the index)
    if args.upsert:
        print(
            f"upserted {args.source} into {args.db}: {done.added} added, {done.replaced} replaced, "
            f"{done.unchanged} unchanged ({counted(total, 'record')} in all)"
        )
    else:
        print(f"added {counted(done, 'record')} from {args.source} to {args.db} ({counted(total, 'record')} in all)")
    return 0


def _existing_shard_dirs(path: Path, num_shards: int) -> set[int]:
    """The shard folders (``shard-0000`` ...) already in ``path`` before a sharded build creates its own."""
    return {s for s in range(num_shards) if sharding.shard_dir(path, s).exists()}


def _remove_new_sharded_database(path: Path, folder_existed: bool, num_shards: int, before: set[int]) -> None:
    """Undo a sharded build that created the database: the folder if it was new, else only what the build wrote
    (``shards.json``, its temporary file, and the shard folders that were not there before)."""
    if not folder_existed:
        shutil.rmtree(path, ignore_errors=True)
        return
    for s in range(num_shards):
        if s not in before:
            shutil.rmtree(sharding.shard_dir(path, s), ignore_errors=True)
    (path / sharding.SHARDS_FILE).unlink(missing_ok=True)
    for leftover in path.glob(f".{sharding.SHARDS_FILE}.*.tmp"):
        leftover.unlink(missing_ok=True)


def cmd_query(args: argparse.Namespace) -> int:
    """Answer the queries: a table or JSON per query; exit status 1 when one finds nothing."""
    with _open_existing(args.db) as db:
        if _is_sharded(db) and len(db) == 0:  # as a plain Database says (a ShardedDatabase answers "not found")
            from kvsearch.errors import EmptyDatabaseError

            raise EmptyDatabaseError("expected a database with records to search, got an empty one")
        answer = db.query(
            list(args.texts),
            k=args.k,
            pooling=args.pooling,
            temperature=args.temperature,
            score=args.score,
            where=_where_checked(db, args.where),
        )
        results = _answer_rows(db, args.texts, answer, only_weighted=args.pooling == "exact")
    if args.json:
        print(json.dumps(tagged(results), ensure_ascii=False, indent=2))
    else:
        print(answer_table(results, args.pooling))
    missing = [r["query"] for r in results if not r["found"]]
    if missing:
        why = "no record has the key" if args.pooling == "exact" else "no candidate for"
        among = " among the records that match --where" if args.where is not None else ""
        print(f"{PROG} query: not found: {why} " + ", ".join(repr(m) for m in missing) + among, file=sys.stderr)
        return 1
    return 0


def _answer_rows(
    db: DatabaseProtocol, texts: Sequence[str], answer: Answer, *, only_weighted: bool = False
) -> list[dict[str, Any]]:
    """One dict per query: its answer and its candidates (best weight first), JSON-ready once :func:`tagged`
    (the metadata holds datetimes and dates as they are).

    With ``only_weighted`` (exact mode) the candidates of weight 0 are left out: they are not answers.
    """
    ids = answer.ids.tolist()  # (batch, k)
    weights = answer.weights.detach().cpu().tolist()  # (batch, k)
    wanted = sorted({i for row in ids for i in row if i >= 0})
    value_texts = db.value_texts(wanted)
    metadata = _metadata_of(db, wanted)
    results = []
    for b, text in enumerate(texts):
        rows = [
            {
                "id": i,
                "key": answer.keys[b][j],
                "value": value_texts.get(i),  # None for a value stored as an embedding
                "weight": round(float(weights[b][j]), 6),
                "metadata": metadata.get(i, {}),
            }
            for j, i in enumerate(ids[b])
            if i >= 0 and (weights[b][j] > 0 or not only_weighted)
        ]
        rows.sort(key=lambda r: -r["weight"])
        value = answer.value[b]
        results.append(
            {
                "query": text,
                "found": bool(answer.found[b]),
                "value": value if isinstance(value, str) or value is None else "<embedding>",
                "candidates": rows,
            }
        )
    return results


def _metadata_of(db: DatabaseProtocol, ids: list[int]) -> dict[int, dict[str, Any]]:
    """id -> the record's metadata ({} for none), read from the shard that holds it."""
    out: dict[int, dict[str, Any]] = {}
    for part in parts_of(db):
        out.update((i, record.metadata) for i, record in part.store.fetch(ids).items())
    return out


def cmd_info(args: argparse.Namespace) -> int:
    """Describe a database: counts, dims, encoders, generation, last run, index, score, size."""
    path = Path(args.db)
    with _open_existing(args.db) as db:
        shards, sharded = parts_of(db), _is_sharded(db)
        encoders = shards[0].encoders_info()  # every shard has the same encoders
        value_encoder = encoders.get("value_encoder")
        info: dict[str, Any] = {"path": str(path), "kind": "sharded" if sharded else "plain"}
        if sharded:
            info["shards"] = db.num_shards
            info["records_per_shard"] = [len(shard) for shard in shards]
        info |= {
            "records": sum(len(shard) for shard in shards),
            "dim": db.dim,
            "value_dim": db.value_dim,
            "encoder": encoders.get("encoder"),
            "query_encoder": encoders.get("query_encoder"),
            "value_encoder": "the key encoder" if value_encoder == "key" else value_encoder,
            "index": db.index_spec,
            "indexed": sum(shard.index.ntotal for shard in shards),
            "score": db.score,
        }
        if not sharded:
            info |= {
                "store_version": db.store.version,
                "generation": encoders["generation"],
                "previous_generation": encoders.get("previous"),
                "last_run": encoders.get("last_run"),
            }
    info["size_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(json.dumps(info, indent=2) if args.json else info_text(info))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Delete the records with these keys: all of them, or none if one is not stored."""
    with _open_existing(args.db) as db:
        if _is_sharded(db):  # all or nothing, the first missing key named as a plain Database names it
            from kvsearch.errors import KeyNotFoundError

            missing = next((key for key in args.keys if key not in db), None)
            if missing is not None:
                raise KeyNotFoundError(f"expected a stored key, got {missing!r}; nothing was deleted")
        ids = db.delete(list(args.keys))
        left = len(db)
    print(f"deleted {counted(len(ids), 'record')} from {args.db} ({left} left)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print the records that match ``--where`` in id order, ``--offset`` skipped, at most ``--limit``."""
    with _open_existing(args.db) as db:
        where = _where_checked(db, args.where) or {}
        page = db.where(where).records(limit=args.limit, offset=args.offset)  # id order, over every shard
    rows = [{"id": r.id, "key": r.key, "value": r.value, "metadata": r.metadata} for r in page]
    if args.json:  # datetimes tagged, as --where reads them
        print(json.dumps(tagged(rows), ensure_ascii=False, indent=2))
    else:
        print(records_table(rows))
    return 0


def cmd_count(args: argparse.Namespace) -> int:
    """Print how many records match ``--where`` (all records without it): the number, or ``{"count": N}``."""
    with _open_existing(args.db) as db:
        count = db.where(_where_checked(db, args.where) or {}).count()
    print(json.dumps({"count": count}) if args.json else count)
    return 0


def _where_checked(db: DatabaseProtocol, where: dict[str, Any] | None) -> dict[str, Any] | None:
    """``--where`` as given, once :func:`~kvsearch.cli.datetimes.refuse_bare_datetimes` has found no ISO string
    compared with a field of ``db`` that holds datetimes.

    Raises:
        InvalidArgumentError: such a string, with how to write the datetime.
    """
    refuse_bare_datetimes(db, where)
    return where


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune the database's encoder on (query, target) pairs and say what was committed."""
    try:
        from kvsearch.training.loop import finetune
    except ImportError:
        raise CommandError(
            "fine-tuning is not available: this kvsearch has no kvsearch.training.loop.finetune"
        ) from None

    from kvsearch.errors import UnknownTargetError

    pairs, lines = (None, []) if args.pairs is None else _read_pairs(args.pairs, args)
    eval_pairs, eval_lines = (None, []) if args.eval is None else _read_pairs(args.eval, args)
    files = {"train_pairs": (args.pairs, pairs, lines), "eval_pairs": (args.eval, eval_pairs, eval_lines)}
    options = finetune_options(args)
    with _open_existing(args.db, unsharded_for="fine-tuning") as db:
        before = db.generation
        try:
            history = finetune(db, pairs, eval_pairs=eval_pairs, **options)
        except UnknownTargetError as exc:
            path, read, at = files.get(exc.pairs or "", (None, None, []))
            if path is None or not exc.positions:
                raise
            raise _unknown_targets(exc, path, read, at) from None
        after = db.generation
    print(f"fine-tuned {args.db} {_trained_on(history, pairs, eval_pairs)} ({history.seconds:.1f} s)")
    if history.metrics:
        print(history_table(history))
    print(history.summary())
    if history.committed:
        print(
            f"{args.db} now answers with the fine-tuned retriever: generation {before} -> {after} "
            f"('kvsearch rollback {args.db}' returns to generation {before})"
        )
    else:
        print(f"nothing was committed: {args.db} keeps its old retriever (generation {after} unchanged)")
    return 0


def finetune_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`kvsearch.finetune` options of a parsed ``kvsearch finetune``: only those given on the command line
    (the parser leaves the others out of the namespace), and ``verbose`` (not ``--quiet``), so that every other
    option takes :class:`~kvsearch.FinetuneConfig`'s default: ``FinetuneConfig(**finetune_options(args))`` of a
    command with no training option is ``FinetuneConfig()``.

    Args:
        args: the namespace of ``build_parser().parse_args(["finetune", ...])``.

    Returns:
        Option name -> value, for ``finetune(db, pairs, **options)``.
    """
    from kvsearch.training.config import FinetuneConfig

    given = {field.name: getattr(args, field.name) for field in fields(FinetuneConfig) if hasattr(args, field.name)}
    return {**given, "verbose": not args.quiet}


def _trained_on(history: Any, pairs: list | None, eval_pairs: list | None) -> str:
    """What a run trained and was measured on, in words: "on 6 pairs for 3 epochs, evaluated on ..."."""
    parts = [] if pairs is None else [counted(len(pairs), "pair")]
    if history.generated:
        parts.append(f"{counted(history.generated, 'pair')} generated from the stored keys per epoch")
    text = f"on {' and '.join(parts)} for {counted(len(history.epoch_losses), 'epoch')}"
    if eval_pairs is not None:
        text += f", evaluated on {counted(len(eval_pairs), 'held-out pair')}"
    elif history.monitor:
        text += f", evaluated on {counted(history.monitor, 'query', 'queries')} of held-out keys"
    return text


def _read_pairs(path: str, args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[int]]:
    """(query, target) pairs from a CSV, TSV or JSONL file and the line of each; bad rows reported with their line
    numbers (BadFileError)."""
    from kvsearch.cli.ingest import read_rows

    pairs: list[tuple[str, str]] = []
    lines: list[int] = []
    problems: list[tuple[int, str]] = []
    for row in read_rows(path, (args.query, args.target), format=args.format):
        if row.problem is not None:
            problems.append((row.line, row.problem))
        elif not row.fields[0].strip() or not row.fields[1].strip():
            problems.append((row.line, "empty query or target"))
        else:
            pairs.append((row.fields[0], row.fields[1]))
            lines.append(row.line)
    if problems:
        raise _bad_pairs(path, problems, len(problems))
    if not pairs:
        raise CommandError(f"{path!r} holds no pairs")
    return pairs, lines


def _bad_pairs(path: str, problems: list[tuple[int, str]], count: int, hint: str = "") -> BadFileError:
    """The error of a pair file with ``count`` bad rows: the file, then the first few ``(line, problem)``."""
    from kvsearch.errors import BadFileError

    shown = "; ".join(f"line {line}: {problem}" for line, problem in problems[:5])
    more = f"; and {count - 5} more" if count > 5 else ""
    return BadFileError(f"{path!r} has {counted(count, 'bad row')}, nothing was trained: {shown}{more}{hint}", problems)


def _unknown_targets(
    exc: UnknownTargetError, path: str, pairs: list[tuple[str, str]], lines: list[int]
) -> BadFileError:
    """An unknown target of a pair file's pairs as a bad row of that file: its line, and the options to pass when
    the targets are of the other kind."""
    what = "stored key" if exc.targets == "key" else "stored value text"
    problems = [(lines[i], f"target {pairs[i][1]!r} is no {what}") for i in exc.positions]
    hint = ""
    if exc.other_kind:
        other, option = (
            ("value texts", "--targets value --loss answer") if exc.targets == "key" else ("keys", "--targets key")
        )
        hint = f" (all or most of these targets are stored {other}: pass {option})"
    return _bad_pairs(path, problems, len(problems), hint)


def cmd_rollback(args: argparse.Namespace) -> int:
    """Return once to the generation of encoders before the last switch."""
    with _open_existing(args.db, unsharded_for="rolling back the encoders") as db:
        before = db.generation
        after = db.rollback_encoders()
    print(f"rolled back {args.db}: generation {before} -> {after}")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    """Copy a database into a new folder with another shard count (:func:`kvsearch.reshard`)."""
    from kvsearch.distributed.reshard import reshard

    report = reshard(args.src, args.dst, num_shards=args.shards, index=args.index)
    before = f"{report.source_shards} shards" if report.source_shards else "plain"
    after = f"{report.num_shards} shards" if report.num_shards > 1 else "plain"
    after += f", index {args.index}" if args.index else ""
    print(
        f"resharded {args.src} ({before}) -> {args.dst} ({after}): {counted(report.records, 'record')}, ids kept, "
        f"generation {report.generation}, {report.seconds:.2f} s"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The quickstart (:mod:`kvsearch.cli.demo`)."""
    from kvsearch.cli.demo import main as demo_main

    return demo_main(["--path", args.path])


#: Each command's function, by the command's name (``args.command``).
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "build": cmd_build,
    "query": cmd_query,
    "info": cmd_info,
    "delete": cmd_delete,
    "list": cmd_list,
    "count": cmd_count,
    "finetune": cmd_finetune,
    "rollback": cmd_rollback,
    "reshard": cmd_reshard,
    "demo": cmd_demo,
}
