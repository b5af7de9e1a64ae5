"""The Python API prints no progress bar of transformers or huggingface_hub (issue 35): ``SentenceEncoder()``,
``finetune(..., verbose=False)`` on a sentence-encoder database (whose commit writes the model) and reopening it
leave stderr empty, as the command line with ``--quiet`` does; the switches are set back afterwards, so the user's
other code keeps its bars."""

from __future__ import annotations

import pytest
from huggingface_hub import utils as hub
from transformers.utils import logging as hf_logging

from kvsearch import Database, SentenceEncoder, finetune
from kvsearch.encoders.quiet import quiet_model_io

AUTHORS = {"Li": "Mu", "Lipton": "Zachary", "Smola": "Alexander", "Zhang": "Aston", "Werness": "Brent", "Hu": "Rachel"}
PAIRS = [("Lipto", "Lipton"), ("Smolla", "Smola"), ("Zang", "Zhang"), ("Wernes", "Werness")]
#: What the model's bars print: their names and tqdm's bar characters.
BARS = ("Loading weights", "Writing model shards", "it/s", "█", "|")


def switches() -> tuple[bool, int, bool]:
    """transformers' bars, its verbosity, huggingface_hub's bars."""
    return hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity(), not hub.are_progress_bars_disabled()


@pytest.fixture
def user_switches():
    """The process's switches as they were before the test, set back after it."""
    before = switches()
    yield before
    hf_logging.set_verbosity(before[1])
    hf_logging.enable_progress_bar() if before[0] else hf_logging.disable_progress_bar()
    hub.enable_progress_bars() if before[2] else hub.disable_progress_bars()


def draw_a_bar(name: str) -> None:
    """What transformers does while it loads or saves a model: one of its tqdm bars."""
    for _ in hf_logging.tqdm(range(3), desc=name):
        pass


@pytest.mark.parametrize("bars", [True, False])
@pytest.mark.parametrize("errors_only", [False, True])
def test_quiet_model_io_silences_the_bars_for_the_block_only(capfd, user_switches, bars, errors_only):
    hf_logging.enable_progress_bar() if bars else hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_warning()
    before = switches()
    with quiet_model_io(errors_only=errors_only):
        draw_a_bar("Loading weights")
        assert not hf_logging.is_progress_bar_enabled() and hub.are_progress_bars_disabled()
        assert hf_logging.get_verbosity() == (hf_logging.ERROR if errors_only else hf_logging.WARNING)
    assert capfd.readouterr().err == ""
    assert switches() == before  # the user's own switches, as they were
    draw_a_bar("Writing model shards")
    assert ("Writing model shards" in capfd.readouterr().err) == bars


def test_quiet_model_io_sets_the_switches_back_when_the_block_raises(user_switches):
    hf_logging.enable_progress_bar()
    before = switches()
    with pytest.raises(KeyError), quiet_model_io(errors_only=True):
        raise KeyError("x")
    assert switches() == before


def test_a_sentence_encoder_loads_trains_saves_and_reopens_without_a_bar(capfd, tmp_path, user_switches):
    hf_logging.enable_progress_bar()  # the default of a fresh process: bars on
    before = switches()
    capfd.readouterr()
    encoder = SentenceEncoder(device="cpu")
    assert capfd.readouterr().err == ""  # no "Loading weights" bar
    db = Database(tmp_path / "db", encoder=encoder, device="cpu")
    db.add(keys=list(AUTHORS), values=list(AUTHORS.values()))
    capfd.readouterr()
    history = finetune(db, PAIRS, k=4, epochs=1, keep="last", train="query", verbose=False)  # the model is written
    assert history.committed and db.query_encoder is not None
    assert capfd.readouterr().err == ""  # no "Writing model shards" bar
    db.close()
    reopened = Database(tmp_path / "db", device="cpu")  # loads the fine-tuned model folder
    assert reopened.query_encoder is not None and len(reopened.search("Lipto", k=1)) == 1
    assert capfd.readouterr().err == ""
    shown = finetune(
        reopened, PAIRS, k=4, epochs=1, keep="last", train="query", verbose=True
    )  # the run's own bar may show
    err = capfd.readouterr().err
    assert shown.committed and "finetune" in err
    assert not any(name in err for name in BARS[:2])  # ... but never the model's
    reopened.close()
    assert switches() == before  # the user's switches as they were: bars on
