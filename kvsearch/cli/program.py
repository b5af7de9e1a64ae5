"""The ``kvsearch`` command line: build a database from a file, query it, inspect it, fine-tune it.

    kvsearch build indexes/authors --from authors.csv --key last --value first --metadata year lang
    kvsearch build indexes/authors --from authors.csv --key last --value first --metadata all --upsert
    kvsearch build indexes/people --from people.jsonl --shards 4      # a sharded database (ShardedDatabase)
    kvsearch query indexes/authors Li Lipto --k 3
    kvsearch query indexes/authors Li --where '{"year": {"$gte": 2000}, "lang": "en"}'
    kvsearch query indexes/authors Li --pooling exact --json
    kvsearch info indexes/authors
    kvsearch delete indexes/authors Li
    kvsearch finetune indexes/authors --pairs pairs.csv --eval held_out.csv --epochs 3
    kvsearch rollback indexes/authors
    kvsearch demo

``build --upsert`` makes the database hold what the file holds (new keys added, changed records replaced, equal
ones left alone) and prints the three counts: re-running it finishes a build that was killed midway.
``query`` prints only its results on stdout; the sentence model loads silently in every command.

``finetune`` prints one row per evaluation (epoch 0 is before training) with the kept epoch marked, and says
whether the database switched to a new generation of encoders or kept its old retriever; ``rollback``
returns once to the generation before the last switch.

A sharded database (``build --shards N``, see :mod:`kvsearch.distributed.sharded_database`) is served by this one process, which
opens every shard: ``build`` adds to it, ``query``, ``info`` and ``delete`` work on it with the same output and
exit statuses as on a plain folder; ``finetune`` and ``rollback`` are not supported across shards yet.

Every command has ``--help``. Errors are one line on stderr: exit status 2 for a usage error, 1 for
anything else (a bad file, a key that is not stored, "not found" in exact mode); ``--debug`` shows the
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from kvsearch.cli.printing import answer_table, history_table, info_text
from kvsearch.distributed import layout as sharding
from kvsearch.storage import folder as folders

if TYPE_CHECKING:
    from kvsearch.database import Database
    from kvsearch.distributed import ShardedDatabase
    from kvsearch.results import Answer

__all__ = ["main", "build_parser"]

PROG = "kvsearch"


class CommandError(Exception):
    """A failure to report on one line with exit status 1 (raised by the commands, caught in main)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _k(text: str) -> int | str:
    return "all" if text == "all" else _positive_int(text)


def _where(text: str) -> dict[str, Any]:
    """``--where``: a JSON object checked as a metadata filter (:func:`kvsearch.filters.check_where`)."""
    from kvsearch.errors import KVSearchError
    from kvsearch.filters import check_where

    try:
        where = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object such as \'{{"year": {{"$gte": 2000}}}}\', got {text!r} '
            f"({exc.msg} at column {exc.colno})"
        ) from None
    try:
        check_where(where)
    except KVSearchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return where


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvsearch`` command (build, query, info, delete, finetune, rollback, demo)."""
    parser = _Parser(
        prog=PROG,
        description="A differentiable key-value search engine: FAISS candidates, attention pooling in torch.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    scores = ("dot", "scaled_dot", "cosine", "gaussian")
    p = sub.add_parser(
        "build",
        help="create a database (or add to one) from a CSV, TSV or JSONL file",
        description="Create the database DB (or add to it) from FILE, validated first, then encoded and indexed "
        "in batches. Bad rows are reported with their line numbers and nothing is written.",
    )
    p.add_argument("db", metavar="DB", help="the database folder (created if missing)")
    p.add_argument("--from", dest="source", metavar="FILE", required=True, help="a .csv, .tsv or .jsonl file")
    p.add_argument("--key", default="key", metavar="COL", help="the column holding the keys (default: key)")
    p.add_argument("--value", default="value", metavar="COL", help="the column holding the values (default: value)")
    p.add_argument("--format", choices=("csv", "tsv", "jsonl"), help="the file format (default: from the suffix)")
    p.add_argument(
        "--metadata",
        nargs="+",
        metavar="COL",
        help='columns stored as metadata for query --where, or "all" (every column but the key and the value); '
        "a CSV field that reads as a number is stored as one, an empty one is left out, JSON keeps its types",
    )
    p.add_argument(
        "--upsert",
        action="store_true",
        help="add the new keys, replace the records whose value or metadata changed, leave equal ones alone "
        "(prints the counts); re-running it finishes a build that was interrupted",
    )
    p.add_argument(
        "--encoder",
        metavar="ngram|minilm|PATH",
        help="key and value encoder for a new database: ngram (character n-grams, the default), minilm "
        "(all-MiniLM-L6-v2, offline) or a sentence-transformers model folder",
    )
    p.add_argument("--index", metavar="SPEC", help='a FAISS index_factory string for a new database (default "Flat")')
    p.add_argument("--score", choices=scores, help="the default score of a new database (default cosine)")
    p.add_argument("--batch-size", type=_positive_int, default=1024, metavar="N", help="records per batch")
    p.add_argument(
        "--shards",
        type=_positive_int,
        metavar="N",
        help="create a sharded database of N shards (fixed for its life; torchrun ranks serve them, N a multiple "
        "of the world size); an existing sharded database is added to without it",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_cmd_build)

    p = sub.add_parser(
        "query",
        help="answer queries: the candidates and their attention weights",
        description="Query DB with each TEXT: the index picks K candidates, attention pooling weighs them. "
        "Prints a table (key, value, weight) per query, or JSON. In exact mode (--pooling exact) a key "
        "that is not stored is reported as not found, with exit status 1.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="one or more queries")
    p.add_argument("--k", type=_k, default=5, metavar="N", help='candidates per query, or "all" (default 5)')
    p.add_argument(
        "--pooling",
        choices=("softmax", "normalize", "nonnegative", "hard", "exact", "average"),
        default="softmax",
        help="how scores become weights (default softmax)",
    )
    p.add_argument("--temperature", type=_positive_float, default=1.0, metavar="T", help="softmax temperature")
    p.add_argument("--score", choices=scores, help="rescore the candidates with this score (default: the DB's)")
    p.add_argument(
        "--where",
        type=_where,
        metavar="JSON",
        help='a metadata filter: only matching records are candidates, e.g. \'{"year": {"$gte": 2000}, '
        '"lang": "en"}\' (operators $eq $ne $gt $gte $lt $lte $in $nin)',
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_cmd_query, quiet=True)

    p = sub.add_parser(
        "info",
        help="what a database holds: counts, dims, encoders, generation, last fine-tuning, index, size",
        description="Describe the database DB: record count, dimensions, encoders (key, query-side, value), "
        "the generation of the encoders (and the previous one, if a rollback can return to it), the last "
        "fine-tuning run, index type, score, size. For a sharded database: the shard count and the records "
        "of each shard instead of the generation and the last run.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(run=_cmd_info, quiet=True)

    p = sub.add_parser(
        "delete",
        help="delete records by key",
        description="Delete the records with these keys from DB: all of them, or none if one is not stored.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument("keys", nargs="+", metavar="KEY", help="the keys to delete")
    p.set_defaults(run=_cmd_delete, quiet=True)

    p = sub.add_parser(
        "finetune",
        help="fine-tune the query encoder on (query, target key) pairs",
        description="Fine-tune DB's encoder end to end on the pairs of FILE (a CSV, TSV or JSONL file with a "
        "query column and a target column naming a stored key), with kvsearch.finetune. Prints the eval "
        "metrics before training (epoch 0) and after each epoch, marks the epoch that was kept, and says "
        "whether the database switched to the fine-tuned encoders (a new generation, which 'kvsearch "
        "rollback' undoes) or kept its old retriever because the run did not improve the metric.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument("--pairs", metavar="FILE", required=True, help="a .csv, .tsv or .jsonl file of training pairs")
    p.add_argument("--eval", metavar="FILE", help="held-out pairs (same columns), measured before and after each epoch")
    p.add_argument("--query", default="query", metavar="COL", help="the query column (default: query)")
    p.add_argument("--target", default="target", metavar="COL", help="the target column (default: target)")
    p.add_argument(
        "--targets",
        choices=("key", "value"),
        help="the target column holds the right record's key, or the answer's value text "
        "(default: key for the retrieval loss, value for the answer losses)",
    )
    p.add_argument("--format", choices=("csv", "tsv", "jsonl"), help="the file format (default: from the suffix)")
    p.add_argument(
        "--loss", choices=("retrieval", "answer", "answer_mse"), default="retrieval", help="default retrieval"
    )
    p.add_argument(
        "--train",
        choices=("query", "query+keys"),
        default="query",
        help="train a query-side copy of the encoder (default), or the shared encoder with index refreshes",
    )
    p.add_argument("--epochs", type=_positive_int, default=3, metavar="N", help="passes over the pairs (default 3)")
    p.add_argument("--k", type=_positive_int, default=32, metavar="N", help="candidates per query (default 32)")
    p.add_argument("--lr", type=_positive_float, default=None, metavar="LR", help="learning rate")
    p.add_argument("--batch-size", type=_positive_int, default=None, metavar="N", help="pairs per step (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seeds the shuffling (default 0)")
    p.add_argument(
        "--keep",
        choices=("best", "last"),
        default="best",
        help="keep the epoch with the best eval metric, the start included (default), or the last epoch",
    )
    p.add_argument(
        "--metric",
        choices=("recall@1", "recall@k", "mrr"),
        default="recall@1",
        help="the eval metric that --keep best compares (default recall@1)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_cmd_finetune)

    p = sub.add_parser(
        "rollback",
        help="return to the encoders before the last fine-tuning (once)",
        description="Switch DB back to the previous generation of its encoders and embeddings (the one before "
        "the last fine-tuning run). Possible once: with nothing to roll back, it says so and exits with "
        "status 1.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.set_defaults(run=_cmd_rollback, quiet=True)

    p = sub.add_parser(
        "demo",
        help="the quickstart: build indexes/names and answer the example queries",
        description="Build the authors database in PATH (default indexes/names) and answer the example queries.",
    )
    p.add_argument("--path", default="indexes/names", help="database folder (default: indexes/names)")
    p.set_defaults(run=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvsearch`` command.

    Args:
        argv: the arguments after the program name; None -> ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 1 on an error or a "not found", 2 on a usage error (argparse exits
        itself for those and for ``--help``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_paths(args)
        # a model's loading bar and messages never show (our own bars: build and finetune without --quiet)
        quiet = args.command == "demo" or _loads_a_sentence_model(args)
        with _quiet_model_loading() if quiet else contextlib.nullcontext(), _one_line_warnings():
            return int(args.run(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse a folder or file argument that is no path before any is looked at (an empty one would be the working
    folder; a name past 255 bytes makes the OS raise ENAMETOOLONG).

    Raises:
        InvalidArgumentError: an empty path, one with NUL, a name longer than the file system takes.
    """
    from kvsearch.checks import check_path

    for name in ("db", "source", "pairs", "eval"):
        given = getattr(args, name, None)
        if given is not None:
            check_path(given)


def _loads_a_sentence_model(args: argparse.Namespace) -> bool:
    """Whether the command will load a sentence-transformers model: ``--encoder`` names one, or the encoder
    files of the database's current generation (``{prefix}.json`` for each of
    :data:`kvsearch.storage.folder.ENCODER_PREFIXES`, in :func:`kvsearch.storage.folder.current_generation_dir`) do."""
    from kvsearch.errors import KVSearchError

    encoder = getattr(args, "encoder", None)
    if encoder and encoder.strip().lower() != "ngram":
        return True
    folder = Path(getattr(args, "db", None) or ".")
    if sharding.is_sharded(folder):  # every shard has the same encoders: look at the first
        folder = sharding.shard_dir(folder, 0)
    if folders.is_database(folder):
        try:
            folder = folders.current_generation_dir(folder)
        except KVSearchError:  # an unreadable store: opening the database reports it
            pass
    for prefix in folders.ENCODER_PREFIXES:
        try:
            kind = json.loads((folder / f"{prefix}.json").read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            continue
        if kind not in (None, "ngram"):
            return True
    return False


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """kvsearch's own warnings (a database opened read-only, a missing file rewritten) as one line on stderr:
    ``kvsearch: warning: ...``; other libraries' warnings as Python shows them."""
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            text = str(message)
            if not text.startswith("kvsearch: "):
                shown(message, category, filename, lineno, file, line)
                return
            print(f"{PROG}: warning: {text.removeprefix('kvsearch: ')}", file=sys.stderr)

        warnings.showwarning = show
        yield


@contextlib.contextmanager
def _quiet_model_loading() -> Iterator[None]:
    """Silence what loading a sentence-transformers model prints on stderr for the duration: transformers'
    "Loading weights" bar and info messages, huggingface_hub's bars. Their switches are set back afterwards.

    It imports transformers' logging module (about half a second), so it is used only when a command will
    load such a model anyway (see :func:`_loads_a_sentence_model`).
    """
    try:
        from huggingface_hub import utils as hub
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - sentence-transformers (a dependency) brings both
        yield
        return
    hf_bars, hf_level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hub_bars = not hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # also huggingface_hub's
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(hf_level)
        if hf_bars:
            hf_logging.enable_progress_bar()  # (and huggingface_hub's)
        if hub_bars:
            hub.enable_progress_bars()
        else:
            hub.disable_progress_bars()


def _one_line(exc: BaseException) -> str:
    from kvsearch.errors import KVSearchError

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (KVSearchError, CommandError)):
        return text
    return f"{type(exc).__name__}: {text}"  # an unexpected error: say what kind


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvsearch")
    except Exception:  # not installed (run from a checkout)
        return "unknown"


# ---------------------------------------------------------------------- opening


def _open_existing(path_text: str, *, unsharded_for: str | None = None) -> Database | ShardedDatabase:
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


def _is_sharded_db(db: object) -> bool:
    """Whether an opened database is a :class:`~kvsearch.distributed.ShardedDatabase`."""
    from kvsearch.distributed import ShardedDatabase

    return isinstance(db, ShardedDatabase)


# ---------------------------------------------------------------------- commands


def _cmd_build(args: argparse.Namespace) -> int:
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
    db: Database | ShardedDatabase | None = None
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
            f"{done.unchanged} unchanged ({total} records in all)"
        )
    else:
        print(f"added {done} records from {args.source} to {args.db} ({total} records in all)")
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


def _cmd_query(args: argparse.Namespace) -> int:
    with _open_existing(args.db) as db:
        if _is_sharded_db(db) and len(db) == 0:  # as a plain Database says (a ShardedDatabase answers "not found")
            from kvsearch.errors import EmptyDatabaseError

            raise EmptyDatabaseError("expected a database with records to search, got an empty one")
        answer = db.query(
            list(args.texts),
            k=args.k,
            pooling=args.pooling,
            temperature=args.temperature,
            score=args.score,
            where=args.where,
        )
        results = _answer_rows(db, args.texts, answer, only_weighted=args.pooling == "exact")
    if args.json:
        print(json.dumps(results, ensure_ascii=False, indent=2))
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
    db: Database | ShardedDatabase, texts: Sequence[str], answer: Answer, *, only_weighted: bool = False
) -> list[dict[str, Any]]:
    """One dict per query: its answer and its candidates (best weight first), JSON-ready.

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


def _metadata_of(db: Database | ShardedDatabase, ids: list[int]) -> dict[int, dict[str, Any]]:
    """id -> the record's metadata ({} for none), read from the shard that holds it."""
    parts = [db.shards[s] for s in sorted(db.shards)] if _is_sharded_db(db) else [db]
    out: dict[int, dict[str, Any]] = {}
    for part in parts:
        out.update((i, record.metadata) for i, record in part.store.fetch(ids).items())
    return out


def _cmd_info(args: argparse.Namespace) -> int:
    path = Path(args.db)
    with _open_existing(args.db) as db:
        shards = [db.shards[s] for s in sorted(db.shards)] if _is_sharded_db(db) else [db]
        encoders = shards[0].encoders_info()  # every shard has the same encoders
        value_encoder = encoders.get("value_encoder")
        info: dict[str, Any] = {"path": str(path)}
        if _is_sharded_db(db):
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
        if not _is_sharded_db(db):
            info |= {
                "store_version": db.store.version,
                "generation": encoders["generation"],
                "previous_generation": encoders.get("previous"),
                "last_run": encoders.get("last_run"),
            }
    info["size_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(json.dumps(info, indent=2) if args.json else info_text(info))
    return 0


def _cmd_delete(args: argparse.Namespace) -> int:
    with _open_existing(args.db) as db:
        if _is_sharded_db(db):  # all or nothing: a ShardedDatabase checks each shard's keys only as it deletes
            from kvsearch.errors import KeyNotFoundError

            missing = next((key for key in args.keys if key not in db), None)
            if missing is not None:
                raise KeyNotFoundError(f"expected a stored key, got {missing!r}; nothing was deleted")
        ids = db.delete(list(args.keys))
        left = len(db)
    print(f"deleted {len(ids)} record{'s' if len(ids) != 1 else ''} from {args.db} ({left} left)")
    return 0


def _cmd_finetune(args: argparse.Namespace) -> int:
    try:
        from kvsearch.training.loop import finetune
    except ImportError:
        raise CommandError(
            "fine-tuning is not available: this kvsearch has no kvsearch.training.loop.finetune"
        ) from None

    pairs = _read_pairs(args.pairs, args)
    eval_pairs = None if args.eval is None else _read_pairs(args.eval, args)
    options: dict[str, Any] = {
        "epochs": args.epochs,
        "k": args.k,
        "loss": args.loss,
        "train": args.train,
        "seed": args.seed,
        "keep": args.keep,
        "metric": args.metric,
        "verbose": not args.quiet,
    }
    for name in ("targets", "lr", "batch_size"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    with _open_existing(args.db, unsharded_for="fine-tuning") as db:
        before = db.generation
        history = finetune(db, pairs, eval_pairs=eval_pairs, **options)
        after = db.generation
    evaluated = f", evaluated on {len(eval_pairs)} held-out pairs" if eval_pairs is not None else ""
    print(f"fine-tuned {args.db} on {len(pairs)} pairs for {args.epochs} epochs{evaluated} ({history.seconds:.1f} s)")
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


def _read_pairs(path: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """(query, target) pairs from a CSV, TSV or JSONL file; bad rows reported with their line numbers."""
    from kvsearch.cli.ingest import read_rows
    from kvsearch.errors import BadFileError

    pairs: list[tuple[str, str]] = []
    problems: list[tuple[int, str]] = []
    for row in read_rows(path, (args.query, args.target), format=args.format):
        if row.problem is not None:
            problems.append((row.line, row.problem))
        elif not row.fields[0].strip() or not row.fields[1].strip():
            problems.append((row.line, "empty query or target"))
        else:
            pairs.append((row.fields[0], row.fields[1]))
    if problems:
        shown = "; ".join(f"line {line}: {problem}" for line, problem in problems[:5])
        raise BadFileError(f"{path!r} has {len(problems)} bad rows, nothing was trained: {shown}", problems)
    if not pairs:
        raise CommandError(f"{path!r} holds no pairs")
    return pairs


def _cmd_rollback(args: argparse.Namespace) -> int:
    with _open_existing(args.db, unsharded_for="rolling back the encoders") as db:
        before = db.generation
        after = db.rollback_encoders()
    print(f"rolled back {args.db}: generation {before} -> {after}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvsearch.cli.demo import main as demo_main

    return demo_main(["--path", args.path])


if __name__ == "__main__":  # python -m kvsearch.cli.program
    raise SystemExit(main())
