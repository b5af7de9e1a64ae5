"""Quiet model files: no progress bar from transformers or huggingface_hub while a model is read or written.

    with quiet_model_io():                    # transformers' and huggingface_hub's bars off, for the block only
        model = SentenceTransformer(folder)   # no "Loading weights" bar on stderr
    with quiet_model_io(errors_only=True):    # ... and transformers' warnings and info too (the command line)
        ...

Loading a sentence-transformers model draws transformers' "Loading weights" bar on stderr, and saving one its
"Writing model shards" bar; huggingface_hub draws its own. :class:`~kvsearch.encoders.sentence.SentenceEncoder`
reads and writes its model inside :func:`quiet_model_io`, so the Python API prints nothing there (kvsearch's own
bars, ``verbose=`` / ``show_progress=``, are kvsearch's tqdm and stay as asked). The switches are process-wide:
they are set for the block and set back to what they were afterwards, however the block ends, so the user's
other code keeps its bars and its verbosity; another thread that loads a model during the block is quiet too.

This module knows nothing of kvsearch's encoders, files or search: it flips transformers' and huggingface_hub's
switches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["quiet_model_io"]


@contextlib.contextmanager
def quiet_model_io(*, errors_only: bool = False) -> Iterator[None]:
    """Turn transformers' and huggingface_hub's progress bars off for the block, then back to what they were.

    It imports transformers' logging module (about half a second the first time): use it where a model is read or
    written anyway (the command line asks first whether its command will load one).

    Args:
        errors_only: also set transformers' logging to errors for the block (its warnings and info messages, e.g.
            the load report of a model folder, hidden): what the command line wants; the Python API keeps them.

    Returns:
        A context manager; nothing is yielded.
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
    if errors_only:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if errors_only:
            hf_logging.set_verbosity(hf_level)
        if hf_bars:
            hf_logging.enable_progress_bar()  # (and huggingface_hub's)
        if hub_bars:
            hub.enable_progress_bars()
        else:
            hub.disable_progress_bars()
