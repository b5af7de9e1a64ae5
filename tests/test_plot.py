"""Plots: heatmaps of attention weights, one answer's candidates, training curves.

matplotlib is imported directly (not skipped when missing): the dev extra, which the tests need, installs it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import numpy as np
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, MissingDependencyError  # noqa: E402
from kvsearch.plot import heatmap, plot_answer, plot_history  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"
QUERIES = ["Li", "Lipto", "Smola", "Zhan"]
POOLINGS = [("exact", 1.0), ("softmax", 0.1), ("nonnegative", 1.0), ("average", 1.0)]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def images(fig) -> list[np.ndarray]:
    return [np.asarray(im.get_array()) for ax in fig.axes for im in ax.get_images()]


def test_one_matrix_labels_and_colour_bar(rng):
    weights = torch.softmax(torch.randn(3, 5), dim=-1)  # (queries, keys)
    fig = heatmap(weights, queries=["a", "b", "c"], keys=list("vwxyz"))
    (image,) = images(fig)
    np.testing.assert_allclose(image, weights.numpy(), rtol=1e-6)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list("vwxyz")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    assert ax.get_xlabel() == "keys" and ax.get_ylabel() == "queries"
    assert fig.axes[-1].get_ylabel() == "attention weight"  # the colour bar
    assert len(ax.texts) == 15  # small matrices are annotated


@pytest.mark.parametrize("shape", [(4, 6), (3, 4, 6), (2, 3, 4, 6)])
def test_grid_layout_shares_axes_and_one_scale(shape):
    weights = np.random.default_rng(0).random(shape)
    fig = heatmap(weights, annotate=False)
    grid = weights.reshape((-1,) + shape[-2:])  # (panels, queries, keys)
    got = images(fig)
    assert len(got) == len(grid)
    for image, expected in zip(got, grid):
        np.testing.assert_allclose(image, expected)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert {ax.get_images()[0].get_clim() for ax in panels} == {(0.0, float(weights.max()))}
    assert len(fig.axes) == len(panels) + 1  # one colour bar for the grid
    rows = shape[0] if len(shape) == 4 else 1
    assert sum(bool(ax.get_ylabel()) for ax in panels) == rows  # y label only on the left column


@pytest.mark.parametrize(
    ("weights", "kwargs", "error"),
    [
        (np.zeros(3), {}, DimensionMismatchError),
        (np.zeros((1, 1, 1, 2, 2)), {}, DimensionMismatchError),
        (np.zeros((2, 0)), {}, InvalidArgumentError),
        (np.full((2, 2), np.nan), {}, InvalidArgumentError),
        (np.zeros((2, 3)), {"queries": ["a"]}, DimensionMismatchError),
        (np.zeros((2, 3)), {"keys": "abc"}, InvalidArgumentError),
        (np.zeros((2, 2, 3)), {"titles": ["only one"]}, DimensionMismatchError),
        ("not numbers", {}, InvalidArgumentError),
    ],
)
def test_bad_input_is_refused(weights, kwargs, error):
    with pytest.raises(error):
        heatmap(weights, **kwargs)


def test_the_four_special_cases_render_to_png(tmp_path, names_db):
    """The picture of the closing note: the engine's weights for four poolings, as one grid.

    The PNG is written to ``tmp_path`` and checked there (its size in pixels, and that it is a picture, not a
    blank canvas). The committed ``docs/heatmap.png`` is regenerated from it only when the environment variable
    ``KVSEARCH_WRITE_DOCS=1`` is set, so an ordinary test run never changes the git tree:

        KVSEARCH_WRITE_DOCS=1 python -m pytest -q tests/test_plot.py -k four_special_cases
    """
    answers = [names_db.query(QUERIES, k="all", pooling=p, temperature=t) for p, t in POOLINGS]
    weights = torch.stack([a.weights for a in answers]).reshape(2, 2, len(QUERIES), len(names_db))
    keys = answers[0].keys[0]
    # references by hand: one-hot on the equal key; softmax, relu and mean over cosine scores
    onehot = torch.tensor([[float(q == k) for k in keys] for q in QUERIES])  # (4, 6)
    q = names_db.encoder.encode(QUERIES)  # (4, dim)
    unit_keys = torch.nn.functional.normalize(names_db.store.table.keys, dim=-1)  # (6, dim)
    cosine = torch.nn.functional.normalize(q, dim=-1) @ unit_keys.T
    torch.testing.assert_close(weights[0, 0], onehot)
    torch.testing.assert_close(weights[0, 1], torch.softmax(cosine / 0.1, dim=-1))
    torch.testing.assert_close(weights[1, 0], cosine.relu())
    torch.testing.assert_close(weights[1, 1], torch.full_like(cosine, 1 / len(keys)))
    titles = [
        ["one-hot: exact lookup (Lipto, Zhan not found)", "softmax, T=0.1: a convex combination"],
        ["non-negative, not normalised", "uniform: average pooling"],
    ]
    fig = heatmap(weights, queries=QUERIES, keys=keys, titles=titles, suptitle="attention weights: queries x keys")
    out = tmp_path / "heatmap.png"
    fig.savefig(out, dpi=90, metadata={"Software": None})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert images(fig)[3].std() == 0  # average pooling: every weight the same
    # The file read back: the figure's size at 90 dpi, and drawn on (the colour map's many colours, not a
    # white canvas).
    pixels = plt.imread(out)  # (height, width, RGBA) floats in [0, 1]
    width, height = fig.get_size_inches() * 90
    assert pixels.shape == (round(height), round(width), 4)
    rgb = pixels[..., :3].reshape(-1, 3)
    assert (rgb < 0.9).any(axis=1).mean() > 0.2  # over a fifth of the pixels are not (near) white
    assert len(np.unique((rgb * 255).round().astype(np.uint8), axis=0)) > 100
    if os.environ.get("KVSEARCH_WRITE_DOCS") == "1":
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(out, DOCS / "heatmap.png")  # the picture in the README and the closing note


def test_plot_answer_draws_the_sorted_weights(names_db):
    answer = names_db.query("Lipto", k=4, temperature=0.1)
    fig = answer.plot()
    ax = fig.axes[0]
    widths = [bar.get_width() for bar in ax.patches]
    np.testing.assert_allclose(widths, sorted(answer.weights.tolist(), reverse=True), rtol=1e-6)
    assert ax.get_yticklabels()[0].get_text().startswith("Lipton")
    assert ax.get_title() == "answer: 'Zachary'"


def test_plot_answer_batched_and_not_found(names_db):
    fig = plot_answer(names_db.query(["Li", "Nobody"], k=3, pooling="exact"), top=2)
    assert len(fig.axes) == 2
    assert fig.axes[0].get_title() == "answer: 'Mu'" and fig.axes[1].get_title() == "not found"
    assert all(len(ax.patches) == 2 for ax in fig.axes)
    with pytest.raises(InvalidArgumentError):
        plot_answer(SimpleNamespace(weights=torch.zeros(2)))


def test_plot_history_draws_losses_and_metrics():
    history = SimpleNamespace(
        losses=[1.0, 0.7, 0.5, 0.4],
        metrics=[
            {"epoch": 0, "step": 0, "recall@1": 0.2, "recall@k": 0.5, "mrr": 0.3},
            {"epoch": 1, "step": 4, "recall@1": 0.6, "recall@k": 0.9, "mrr": 0.7},
        ],
    )
    fig = plot_history(history)
    loss_ax, metric_ax = fig.axes
    np.testing.assert_allclose(loss_ax.lines[0].get_ydata(), history.losses)
    assert [line.get_label() for line in metric_ax.lines] == ["recall@1", "recall@k", "mrr"]
    np.testing.assert_allclose(metric_ax.lines[0].get_xdata(), [0, 1])
    np.testing.assert_allclose(metric_ax.lines[2].get_ydata(), [0.3, 0.7])
    with pytest.raises(InvalidArgumentError):
        plot_history(SimpleNamespace(losses=[1.0]))


def test_a_missing_matplotlib_names_the_extra(monkeypatch, names_db):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # `import matplotlib.pyplot` now fails
    with pytest.raises(MissingDependencyError, match=r"pip install \"kvsearch\[plot\]\""):
        heatmap(np.eye(2))
    with pytest.raises(ImportError):  # also an ImportError, for code that catches that
        names_db.query("Li", k=2).plot()
