"""The ``kvsearch`` command's argument parser: its commands, options, argument types and one-line usage errors.

:func:`build_parser` describes every command (build, query, info, delete, list, count, finetune, rollback, reshard,
demo) and its options; the argument types (a positive integer, ``--k`` as a number or ``all``, a positive float,
``--where`` as a checked JSON filter, its tagged datetimes and dates decoded: :mod:`kvsearch.cli.datetimes`) refuse
a bad value as a usage error (exit status 2). :class:`CommandError` is the failure a command reports on one line with
exit status 1.

It knows nothing of what the commands do (that is :mod:`kvsearch.cli.commands`) nor of how they are run
(:mod:`kvsearch.cli.program`).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NoReturn

__all__ = ["PROG", "CommandError", "OneLineParser", "build_parser"]

PROG = "kvsearch"

#: What every ``--where`` help says of datetimes (:mod:`kvsearch.cli.datetimes`).
WHERE_DATETIMES = (
    'a datetime is written {"$datetime": "2018-01-01T00:00:00+00:00"} (naive: UTC), a date {"$date": "2018-01-01"}, '
    "as --json prints them; a bare ISO string is a string, refused against a field that holds datetimes"
)


class CommandError(Exception):
    """A failure to report on one line with exit status 1 (raised by the commands, caught in main)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(text: str, low: int, expected: str) -> int:
    """An integer >= ``low``, or a usage error that says ``expected``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def _count(text: str) -> int:
    return _integer(text, 0, "an integer >= 0")


def _k(text: str) -> int | str:
    return "all" if text == "all" else _positive_int(text)


def _query_text(text: str) -> str:
    """A query TEXT: not empty nor blank (a usage error, as for any bad argument), kept as typed."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty query text, got {text!r}")
    return text


def _where(text: str) -> dict[str, Any]:
    """``--where``: a JSON object checked as a metadata filter (:func:`kvsearch.metadata.filters.check_where`), its
    tagged datetimes and dates decoded (:func:`kvsearch.cli.datetimes.decode`)."""
    from kvsearch.cli.datetimes import decode
    from kvsearch.errors import KVSearchError
    from kvsearch.metadata.filters import check_where

    try:
        where = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object such as \'{{"year": {{"$gte": 2000}}}}\', got {text!r} '
            f"({exc.msg} at column {exc.colno})"
        ) from None
    try:
        where = decode(where)  # {"$datetime": ISO} / {"$date": ISO} -> the datetime / date
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


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvsearch")
    except Exception:  # not installed (run from a checkout)
        return "unknown"


def _add_finetune(sub: Any) -> None:
    """The ``finetune`` command. Its defaults are :class:`~kvsearch.FinetuneConfig`'s: a training option not given is
    absent from the parsed namespace (``argparse.SUPPRESS``) and not passed on, so Python and the CLI train alike."""
    from kvsearch.training.config import FinetuneConfig

    d = FinetuneConfig()  # the one source of the defaults: the help says them, the parser passes none of them
    p = sub.add_parser(
        "finetune",
        help="fine-tune the retriever on (query, target key) pairs, or on misspellings of the stored keys",
        description="Fine-tune DB's encoder end to end with kvsearch.finetune, on the pairs of FILE (a CSV, TSV "
        "or JSONL file with a query column and a target column naming a stored key) and on (misspelt key, key) "
        "pairs generated from the stored keys (--noise, --generated); without --pairs on the generated pairs "
        "alone. Prints the eval metrics before training (epoch 0) and after each epoch (on --eval, or on "
        "queries of held-out keys; on the training pairs themselves, after the last epoch only), marks the epoch "
        "that was kept, and says whether the database switched to the fine-tuned encoders (a new generation, "
        "which 'kvsearch rollback' undoes) or kept its old retriever because the run did not improve the metric.",
        argument_default=argparse.SUPPRESS,  # the training options not given stay out of the namespace
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    _add_finetune_pairs(p, d)
    _add_finetune_training(p, d)
    p.add_argument("--quiet", action="store_true", default=False, help="no progress bars")


def _add_finetune_pairs(p: argparse.ArgumentParser, d: Any) -> None:
    """``finetune``'s options of what it trains on: the pairs file, its columns and the generated pairs.

    Args:
        p: the ``finetune`` parser.
        d: the default :class:`~kvsearch.FinetuneConfig`, whose values the help says.
    """
    from kvsearch.text.noise import NOISE_MODELS
    from kvsearch.training.config import FinetuneConfig
    from kvsearch.training.losses import ANSWER_LOSSES
    from kvsearch.training.metrics import TARGET_KINDS

    noise = ",".join(d.noise or ())
    answer_targets = FinetuneConfig(loss=ANSWER_LOSSES[0]).target_kind
    p.add_argument(
        "--pairs", default=None, metavar="FILE", help="a .csv, .tsv or .jsonl file of training pairs (optional)"
    )
    p.add_argument(
        "--eval",
        default=None,
        metavar="FILE",
        help="held-out pairs (same columns), measured before and after each epoch",
    )
    p.add_argument("--query", default="query", metavar="COL", help="the query column (default: query)")
    p.add_argument("--target", default="target", metavar="COL", help="the target column (default: target)")
    p.add_argument(
        "--targets",
        choices=TARGET_KINDS,
        help="the target column holds the right record's key, or the answer's value text "
        f"(default: {d.target_kind} for the {d.loss} loss, {answer_targets} for the answer losses)",
    )
    p.add_argument(
        "--format", default=None, choices=("csv", "tsv", "jsonl"), help="the file format (default: from the suffix)"
    )
    p.add_argument(
        "--noise",
        metavar="MODELS",
        type=_noise,
        help=f"comma-separated noise models of the generated pairs, among {', '.join(NOISE_MODELS)}, or none "
        f"(default {noise})",
    )
    p.add_argument(
        "--generated",
        type=_generated,
        metavar="N|auto",
        help=f"how many generated pairs to mix in (default {d.generated}: see kvsearch.training.pairs)",
    )


def _add_finetune_training(p: argparse.ArgumentParser, d: Any) -> None:
    """``finetune``'s options of how it trains: loss, mode, epochs, step sizes, what it keeps, precision.

    Args:
        p: the ``finetune`` parser.
        d: the default :class:`~kvsearch.FinetuneConfig`, whose values the help says.
    """
    from kvsearch.training.config import KEEPS, NEGATIVES, TRAIN_MODES
    from kvsearch.training.defaults import SENTENCE_BATCH, auto_batch_size
    from kvsearch.training.losses import LOSSES
    from kvsearch.training.metrics import TEXT_METRICS
    from kvsearch.training.precision import PRECISIONS

    p.add_argument("--loss", choices=LOSSES, help=f"default {d.loss}")
    p.add_argument(
        "--train",
        choices=TRAIN_MODES,
        help="train a query-side copy of the encoder, or the shared encoder with index refreshes (default: "
        "query+keys for an n-gram or a sentence encoder, else query)",
    )
    p.add_argument("--epochs", type=_positive_int, metavar="N", help=f"passes over the pairs (default {d.epochs})")
    p.add_argument("--k", type=_positive_int, metavar="N", help=f"candidates per query (default {d.k})")
    p.add_argument("--lr", type=_positive_float, metavar="LR", help="learning rate (default: per encoder kind)")
    p.add_argument("--temperature", type=_positive_float, metavar="T", help=f"default {d.temperature}")
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        metavar="N",
        help=f"pairs per step (default: {auto_batch_size(1)} with generated pairs, {SENTENCE_BATCH} for a sentence "
        f"encoder, else {auto_batch_size(0)})",
    )
    p.add_argument(
        "--warmup",
        type=_fraction,
        metavar="F",
        help="the fraction of the steps over which the learning rate rises from 0 (default: 0.1 for a sentence "
        "encoder, else 0)",
    )
    p.add_argument(
        "--negatives",
        choices=NEGATIVES,
        help="what a target competes with: the index's candidates, the batch's other targets, or both (default: "
        "in-batch for a sentence encoder, else candidates)",
    )
    p.add_argument(
        "--pairs-from",
        dest="pairs_from",
        metavar="value|metadata.FIELD",
        help="also train on (that text of each record, its key) pairs made from the records (default: none)",
    )
    p.add_argument("--seed", type=int, help=f"seeds the shuffling and the generated pairs (default {d.seed})")
    p.add_argument(
        "--keep",
        choices=KEEPS,
        help=f"keep the epoch with the best eval metric, the start included, or the last epoch (default {d.keep})",
    )
    p.add_argument(
        "--metric",
        choices=TEXT_METRICS,
        help=f"the eval metric that --keep best compares (default {TEXT_METRICS[0]})",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="train in float32 (fp32), or under autocast with bfloat16 (CPU or CUDA) or float16 (CUDA only); "
        f"the weights written stay float32 (default {d.precision})",
    )


def _noise(text: str) -> tuple[str, ...] | None:
    """``--noise``: comma-separated noise model names, or ``none`` (None: generate nothing)."""
    from kvsearch.text.noise import NOISE_MODELS

    if text.strip().lower() == "none":
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in NOISE_MODELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected noise models among {', '.join(NOISE_MODELS)} or none, got {text!r}")
    return names


def _fraction(text: str) -> float:
    """``--warmup``: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _generated(text: str) -> int | str:
    """``--generated``: a count >= 0 or ``auto``."""
    return text if text == "auto" else _integer(text, 0, "a count >= 0 or auto")


def _add_build(sub: Any) -> None:
    """The ``build`` command: create a database, or add to one, from a file."""
    from kvsearch.index.factory import describe_specs
    from kvsearch.nn.scores import DB_SCORES

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
    p.add_argument("--index", metavar="SPEC", help=f"the index of a new database: {describe_specs()}")
    p.add_argument("--score", choices=DB_SCORES, help="the default score of a new database (default cosine)")
    p.add_argument("--batch-size", type=_positive_int, default=1024, metavar="N", help="records per batch")
    p.add_argument(
        "--shards",
        type=_positive_int,
        metavar="N",
        help="create a sharded database of N shards (fixed for its life; torchrun ranks serve them, N a multiple "
        "of the world size); an existing sharded database is added to without it",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_query(sub: Any) -> None:
    """The ``query`` command: answer queries with their candidates and weights."""
    from kvsearch.nn.pooling import POOLINGS
    from kvsearch.nn.scores import DB_SCORES

    p = sub.add_parser(
        "query",
        help="answer queries: the candidates and their attention weights",
        description="Query DB with each TEXT: the index picks K candidates, attention pooling weighs them. "
        "Prints a table (key, value, weight) per query, or JSON. In exact mode (--pooling exact) a key "
        "that is not stored is reported as not found, with exit status 1.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument("texts", nargs="+", type=_query_text, metavar="TEXT", help="one or more queries (not blank)")
    p.add_argument("--k", type=_k, default=5, metavar="N", help='candidates per query, or "all" (default 5)')
    p.add_argument(
        "--pooling",
        choices=POOLINGS,
        default="softmax",
        help="how scores become weights (default softmax)",
    )
    p.add_argument("--temperature", type=_positive_float, default=1.0, metavar="T", help="softmax temperature")
    p.add_argument("--score", choices=DB_SCORES, help="rescore the candidates with this score (default: the DB's)")
    p.add_argument(
        "--where",
        type=_where,
        metavar="JSON",
        help='a metadata filter: only matching records are candidates, e.g. \'{"year": {"$gte": 2000}, '
        '"lang": "en"}\' (operators $eq $ne $gt $gte $lt $lte $in $nin); ' + WHERE_DATETIMES,
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(quiet=True)


def _add_info(sub: Any) -> None:
    """The ``info`` command: what a database holds."""
    p = sub.add_parser(
        "info",
        help="what a database holds: counts, dims, encoders, generation, last fine-tuning, index, size",
        description="Describe the database DB: its kind (a plain or a sharded database, and what opens it), "
        "record count, dimensions, encoders (key, query-side, value), "
        "the generation of the encoders (and the previous one, if a rollback can return to it), the last "
        "fine-tuning run, index type, score, size. For a sharded database: the shard count and the records "
        "of each shard instead of the generation and the last run.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(quiet=True)


def _add_delete(sub: Any) -> None:
    """The ``delete`` command: delete records by key."""
    p = sub.add_parser(
        "delete",
        help="delete records by key",
        description="Delete the records with these keys from DB: all of them, or none if one is not stored.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument("keys", nargs="+", metavar="KEY", help="the keys to delete")
    p.set_defaults(quiet=True)


def _add_list(sub: Any) -> None:
    """The ``list`` command: the records that match a filter."""
    p = sub.add_parser(
        "list",
        help="print the records that match a filter, in id order",
        description="Print the records of DB that match --where (every record without it) in id order: id, key, "
        "value and metadata, one line each (or JSON). Page with --limit and --offset.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument(
        "--where", type=_where, default=None, help='a JSON filter, e.g. \'{"lang": "en"}\'; ' + WHERE_DATETIMES
    )
    p.add_argument("--limit", type=_count, default=None, help="print at most N records (default: all)")
    p.add_argument("--offset", type=_count, default=0, help="skip the first N matching records (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.set_defaults(quiet=True)


def _add_count(sub: Any) -> None:
    """The ``count`` command: how many records match a filter."""
    p = sub.add_parser(
        "count",
        help="how many records match a filter",
        description="Print how many records of DB match --where (every record without it): the number alone, "
        'or with --json the object {"count": N}.',
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.add_argument(
        "--where",
        type=_where,
        default=None,
        help='a JSON filter, e.g. \'{"year": {"$gte": 2000}}\'; ' + WHERE_DATETIMES,
    )
    p.add_argument("--json", action="store_true", help='print {"count": N} instead of the number alone')
    p.set_defaults(quiet=True)


def _add_rollback(sub: Any) -> None:
    """The ``rollback`` command: the encoders before the last fine-tuning."""
    p = sub.add_parser(
        "rollback",
        help="return to the encoders before the last fine-tuning (once)",
        description="Switch DB back to the previous generation of its encoders and embeddings (the one before "
        "the last fine-tuning run). Possible once: with nothing to roll back, it says so and exits with "
        "status 1.",
    )
    p.add_argument("db", metavar="DB", help="the database folder")
    p.set_defaults(quiet=True)


def _add_reshard(sub: Any) -> None:
    """The ``reshard`` command: a copy with another shard count (or index)."""
    from kvsearch.index.factory import describe_specs

    p = sub.add_parser(
        "reshard",
        help="copy a database into a new folder with another shard count (ids, encoders, generation kept)",
        description="Copy the database SRC (plain or sharded) into the new folder DST with N shards: every record "
        "under its id, the embeddings as stored (never re-encoded), the encoders and generation, the options. "
        "--shards 1 makes one plain database; --index SPEC gives the copy another index. "
        "SRC is only read. DST must be absent or empty; it appears whole "
        "or not at all (built beside it, then renamed).",
    )
    p.add_argument("src", metavar="SRC", help="the database folder to copy (plain or sharded)")
    p.add_argument("dst", metavar="DST", help="the new folder (absent or empty)")
    p.add_argument(
        "--shards",
        type=_positive_int,
        required=True,
        metavar="N",
        help="the shard count of the copy; 1 makes a plain database (N a multiple of the torchrun world size)",
    )
    p.add_argument(
        "--index",
        metavar="SPEC",
        help="another index for the copy (an index is fixed when a database is created: this is how to change it; "
        f"its search parameters start empty): {describe_specs()}",
    )
    p.set_defaults(quiet=True)


def _add_demo(sub: Any) -> None:
    """The ``demo`` command: the quickstart."""
    p = sub.add_parser(
        "demo",
        help="the quickstart: build indexes/names and answer the example queries",
        description="Build the authors database in PATH (default indexes/names) and answer the example queries.",
    )
    p.add_argument("--path", default="indexes/names", help="database folder (default: indexes/names)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``kvsearch`` command (build, query, info, delete, list, count, finetune, rollback,
    reshard, demo)."""
    parser = OneLineParser(
        prog=PROG,
        description="A differentiable key-value search engine: FAISS candidates, attention pooling in torch.",
        epilog=f"Run '{PROG} COMMAND --help' for a command's options.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    _add_build(sub)
    _add_query(sub)
    _add_info(sub)
    _add_delete(sub)
    _add_list(sub)
    _add_count(sub)
    _add_finetune(sub)
    _add_rollback(sub)
    _add_reshard(sub)
    _add_demo(sub)
    return parser
