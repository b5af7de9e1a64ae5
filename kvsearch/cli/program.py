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

A sharded database (``build --shards N``, see :mod:`kvsearch.distributed.sharded_database`) is served by this one
process, which opens every shard: ``build`` adds to it, ``query``, ``info`` and ``delete`` work on it with the same
output and exit statuses as on a plain folder; ``finetune`` and ``rollback`` are not supported across shards yet.

Every command has ``--help``. Errors are one line on stderr: exit status 2 for a usage error, 1 for
anything else (a bad file, a key that is not stored, "not found" in exact mode); ``--debug`` shows the
traceback.

A closed output (``kvsearch query ... | head -1``) ends the command quietly, as ``git`` and ``grep`` do, with
exit status 141 (:data:`CLOSED_OUTPUT_STATUS`: 128 + SIGPIPE, what a shell reports for a process that a closed
pipe killed): nothing on stderr, nothing half-written. Python ignores SIGPIPE, so a write to a closed pipe raises
:class:`BrokenPipeError`; :func:`main` catches it, points the closed stream at ``/dev/null`` so that the
interpreter's last flush does not raise again, and returns the status (Python's recipe, "Note on SIGPIPE" in the
``signal`` docs). It does not restore SIGPIPE's default action: that would kill the process in the middle of a
write to stderr (a progress bar), before ``build`` has rolled back its unfinished transaction. ``build`` prints
its report after its records are committed and the database closed, so a closed pipe there leaves the database
whole; one that closes earlier (stderr's progress bars) rolls the build back as any failure does. Nothing in the
library touches signals: only this function handles the pipe.

This module owns :func:`main`: parse (:mod:`kvsearch.cli.parser`), run the command (:mod:`kvsearch.cli.commands`),
report an error on one line with its exit status, keep a sentence model's loading quiet and show kvsearch's own
warnings on one line. It knows nothing of what a command does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvsearch.cli.commands import COMMANDS
from kvsearch.cli.parser import PROG, CommandError, build_parser
from kvsearch.distributed import layout as sharding
from kvsearch.encoders.quiet import quiet_model_io
from kvsearch.storage import folder as folders
from kvsearch.storage.encoder_files import current_generation_dir

__all__ = ["main", "CLOSED_OUTPUT_STATUS"]

#: The exit status of a command whose stdout (or stderr) was closed by its reader: 128 + SIGPIPE (13), what a shell
#: shows for ``git log | head -1``'s git, which the signal ends. An exit, not a death by the signal: the process
#: ends through Python's normal shutdown.
CLOSED_OUTPUT_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvsearch`` command.

    Args:
        argv: the arguments after the program name; None -> ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 1 on an error or a "not found", 2 on a usage error (argparse exits
        itself for those and for ``--help``), :data:`CLOSED_OUTPUT_STATUS` (141) when the reader of stdout or
        stderr closed it (``| head -1``), quietly.
    """
    try:
        try:
            return _run(argv)
        finally:  # what is still buffered goes out now, where a closed pipe is caught (argparse's exits too)
            sys.stdout.flush()
            sys.stderr.flush()
    except BrokenPipeError:
        _silence_closed_streams()
        return CLOSED_OUTPUT_STATUS


def _run(argv: Sequence[str] | None) -> int:
    """Parse and run the command; an error is reported on one line with its status (a closed pipe raises)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_paths(args)
        # a model's loading bar and messages never show (our own bars: build and finetune without --quiet)
        quiet = args.command == "demo" or _loads_a_sentence_model(args)
        with quiet_model_io(errors_only=True) if quiet else contextlib.nullcontext(), _one_line_warnings():
            return int(COMMANDS[args.command](args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output is gone: no error to report (main ends quietly)
        raise
    except Exception as exc:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1


def _silence_closed_streams() -> None:
    """Point stdout and stderr, where their reader is gone, at ``/dev/null``: what they still buffer is dropped
    there by the interpreter's last flush instead of raising :class:`BrokenPipeError` again ("Exception ignored
    ... BrokenPipeError" and status 120). A stream that still works is left alone."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            continue
        except BrokenPipeError:
            pass
        except (OSError, ValueError):  # closed or unusable for another reason: nothing to redirect
            continue
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no file descriptor (a StringIO)
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, stream.fileno())
            finally:
                os.close(devnull)


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
    :data:`kvsearch.storage.folder.ENCODER_PREFIXES`, in
    :func:`kvsearch.storage.encoder_files.current_generation_dir`) do."""
    from kvsearch.errors import KVSearchError

    encoder = getattr(args, "encoder", None)
    if encoder and encoder.strip().lower() != "ngram":
        return True
    folder = Path(getattr(args, "db", None) or ".")
    if sharding.is_sharded(folder):  # every shard has the same encoders: look at the first
        folder = sharding.shard_dir(folder, 0)
    if folders.is_database(folder):
        try:
            folder = current_generation_dir(folder)
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


def _one_line(exc: BaseException) -> str:
    from kvsearch.errors import KVSearchError

    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (KVSearchError, CommandError)):
        return text
    return f"{type(exc).__name__}: {text}"  # an unexpected error: say what kind
