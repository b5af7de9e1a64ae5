"""Pictures of attention: weight heatmaps, one answer's candidates, fine-tuning curves.

    from kvsearch.plot import heatmap, plot_answer, plot_history
    fig = heatmap(weights, queries=["Li", "Lipto"], keys=db_keys)   # (queries, keys) -> Figure
    fig = db.query("Lipto", k=4).plot()                               # one query's candidates and weights
    fig = plot_history(history)                                       # loss and retrieval metrics per epoch

matplotlib is an optional extra (``pip install kvsearch[plot]``); it is imported inside the functions,
so ``import kvsearch`` never needs it. Every function returns the ``matplotlib.figure.Figure`` (made with
pyplot, so ``plt.show()`` and notebooks display it); nothing is saved unless you call ``fig.savefig``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, MissingDependencyError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["heatmap", "plot_answer", "plot_history", "AnswerLike"]


class AnswerLike(Protocol):
    """What :func:`plot_answer` reads of an answer: a :class:`kvsearch.results.Answer`, or anything like it."""

    @property
    def weights(self) -> Any: ...  # (k,) or (batch, k)
    @property
    def ids(self) -> Any: ...  # (k,) or (batch, k), -1 where missing
    @property
    def keys(self) -> Any: ...  # the candidates' key texts (a list, or one per query)
    @property
    def value(self) -> Any: ...  # the answer's value (or one per query)
    @property
    def found(self) -> Any: ...  # bool (or one per query)


_INSTALL_HINT = 'plotting needs matplotlib: pip install "kvsearch[plot]" (or pip install matplotlib)'


def _pyplot() -> Any:
    """matplotlib.pyplot, imported on first use, with an install hint when it is missing."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - exercised with matplotlib hidden, see tests
        raise MissingDependencyError(f"{_INSTALL_HINT} ({exc})") from exc
    return plt


def _as_numpy(weights: object) -> np.ndarray:
    """Weights (tensor, array or nested lists) as a float64 numpy array, detached and on the CPU."""
    try:
        import torch

        if isinstance(weights, torch.Tensor):
            return weights.detach().to("cpu", torch.float64).numpy()
    except ImportError:  # pragma: no cover - torch is a dependency of kvsearch
        pass
    try:
        arr = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"expected weights as a tensor or array of numbers, got {type(weights).__name__}"
        ) from None
    return arr


def _labels(labels: Sequence[object] | None, n: int, what: str) -> list[str] | None:
    if labels is None:
        return None
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise InvalidArgumentError(f"expected {what} as a list of {n} labels, got {type(labels).__name__}")
    if len(labels) != n:
        raise DimensionMismatchError(f"expected {n} {what} labels (one per row/column), got {len(labels)}")
    return ["" if label is None else str(label) for label in labels]


def heatmap(
    weights: object,
    queries: Sequence[object] | None = None,
    keys: Sequence[object] | None = None,
    *,
    xlabel: str = "keys",
    ylabel: str = "queries",
    titles: Sequence[str] | Sequence[Sequence[str]] | None = None,
    figsize: tuple[float, float] | None = None,
    cmap: str = "Reds",
    vmin: float | None = 0.0,
    vmax: float | None = None,
    annotate: bool | None = None,
    suptitle: str | None = None,
) -> Figure:
    """Draw attention weights as heatmaps: one matrix, a row of them or a grid.

    The layout of d2l's ``show_heatmaps``: a grid of (queries x keys) matrices sharing their axes, tick
    labels on the outer panels only, and one colour bar for the whole grid (all panels use one scale).

    Args:
        weights: (queries, keys), (cols, queries, keys) or (rows, cols, queries, keys); a tensor (detached
            for you), an array or nested lists.
        queries: one label per query (row of each matrix), e.g. the query texts.
        keys: one label per key (column of each matrix), e.g. the candidate keys.
        xlabel: the x axis label of the bottom panels.
        ylabel: the y axis label of the left panels.
        titles: a title per column (a list of cols strings) or per panel (rows lists of cols strings).
        figsize: the figure size in inches; by default grown with the grid and the matrix size.
        cmap: a matplotlib colour map name.
        vmin: the low end of the colour scale (default 0: weights are non-negative); None -> data min.
        vmax: the high end; None -> the largest weight.
        annotate: write each weight in its cell; by default only when every matrix has at most 12 x 12 cells.
        suptitle: a title over the whole figure.

    Returns:
        The matplotlib Figure.

    Raises:
        DimensionMismatchError: weights are not 2-, 3- or 4-dimensional, or labels do not match their count.
        InvalidArgumentError: weights are empty or not numbers, or hold NaN.
        MissingDependencyError: matplotlib is not installed.
    """
    grid = _weight_grid(weights)  # (rows, cols, queries, keys)
    rows, cols, n_q, n_k = grid.shape
    q_labels = _labels(queries, n_q, "query")
    k_labels = _labels(keys, n_k, "key")
    panel_titles = _panel_titles(titles, rows, cols)
    if annotate is None:
        annotate = n_q <= 12 and n_k <= 12

    plt = _pyplot()
    if figsize is None:
        figsize = _default_figsize(grid.shape, annotate=annotate, key_labels=bool(k_labels), suptitle=bool(suptitle))
    fig, axes = plt.subplots(rows, cols, figsize=figsize, sharex=True, sharey=True, squeeze=False)
    lo = float(np.nanmin(grid)) if vmin is None else vmin
    hi = float(np.nanmax(grid)) if vmax is None else vmax
    if hi <= lo:
        hi = lo + 1.0  # a constant matrix (e.g. all zeros): still a valid colour scale
    image = None
    for r in range(rows):
        for c in range(cols):
            ax = axes[r, c]
            matrix = grid[r, c]  # (queries, keys)
            image = ax.imshow(matrix, cmap=cmap, vmin=lo, vmax=hi, aspect="auto", interpolation="nearest")
            if annotate:
                _write_cells(ax, matrix, lo, hi)
            if k_labels is not None:  # without labels, matplotlib's own integer ticks
                ax.set_xticks(range(n_k))
                ax.set_xticklabels(k_labels, rotation=45, ha="right")
            if q_labels is not None:
                ax.set_yticks(range(n_q))
                ax.set_yticklabels(q_labels)
            if r == rows - 1:
                ax.set_xlabel(xlabel)
            if c == 0:
                ax.set_ylabel(ylabel)
            if panel_titles is not None:
                ax.set_title(panel_titles[r][c], fontsize=10)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout(rect=(0, 0, 0.9 if cols > 1 else 0.88, 1))
    cax = fig.add_axes((0.91 if cols > 1 else 0.89, 0.15, 0.015 if cols > 1 else 0.025, 0.7))
    fig.colorbar(image, cax=cax, label="attention weight")
    return fig


def _weight_grid(weights: object) -> np.ndarray:
    """Weights of shape (queries, keys), (cols, queries, keys) or (rows, cols, queries, keys) as a 4-D float64 grid.

    Raises:
        DimensionMismatchError: weights are not 2-, 3- or 4-dimensional.
        InvalidArgumentError: weights are empty or not numbers, or hold NaN.
    """
    arr = _as_numpy(weights)
    if arr.ndim not in (2, 3, 4):
        raise DimensionMismatchError(
            f"expected weights of shape (queries, keys), (cols, queries, keys) or (rows, cols, queries, keys), "
            f"got shape {arr.shape}"
        )
    grid = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)  # (rows, cols, queries, keys)
    if grid.size == 0:
        raise InvalidArgumentError(f"expected at least one weight, got shape {arr.shape}")
    if np.isnan(grid).any():
        raise InvalidArgumentError("expected weights without NaN, got NaN")
    return grid


def _default_figsize(
    shape: tuple[int, ...], *, annotate: bool, key_labels: bool, suptitle: bool
) -> tuple[float, float]:
    """The figure size in inches of a (rows, cols, queries, keys) grid: grown with the grid and the matrix size."""
    rows, cols, n_q, n_k = shape
    cell = 0.55 if annotate else 0.35
    side = min(cell * max(n_q, n_k), 5.0) / max(n_q, n_k)  # inches per cell: a panel is at most 5 in
    width = max(2.5, side * n_k + (1.2 if key_labels else 0.6)) * cols + 1.2
    height = max(2.0, side * n_q + (1.0 if key_labels else 0.6)) * rows + (0.4 if suptitle else 0.0)
    return (width, height)


def _write_cells(ax: Any, matrix: np.ndarray, lo: float, hi: float) -> None:
    """Write each weight of a (queries, keys) matrix in its cell, white on the darker half of the scale."""
    mid = lo + (hi - lo) / 2
    n_q, n_k = matrix.shape
    for i in range(n_q):
        for j in range(n_k):
            value = matrix[i, j]
            ax.text(
                j,
                i,
                f"{value:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if value > mid else "black",
            )


def _panel_titles(titles: object, rows: int, cols: int) -> list[list[str]] | None:
    if titles is None:
        return None
    if isinstance(titles, str) or not isinstance(titles, Sequence):
        raise InvalidArgumentError(f"expected titles as a list, got {type(titles).__name__}")
    if all(isinstance(t, str) for t in titles):
        if len(titles) != cols:
            raise DimensionMismatchError(f"expected {cols} titles (one per column), got {len(titles)}")
        return [list(titles) for _ in range(rows)]
    if len(titles) != rows or any(isinstance(t, str) or len(t) != cols for t in titles):
        raise DimensionMismatchError(f"expected titles as {rows} lists of {cols} strings")
    return [[str(t) for t in row] for row in titles]


def plot_answer(answer: AnswerLike, *, top: int | None = None, figsize: tuple[float, float] | None = None) -> Figure:
    """One query's candidates and their attention weights, as horizontal bars (best on top).

    The highest-weight candidate is drawn in a darker colour and named in the title with the answer's
    value; missing candidates (id -1) are left out. A batched answer gets one panel per query.

    Args:
        answer: what :meth:`Database.query` returned (one query or a batch).
        top: show at most this many candidates per query (the highest weights); default all.
        figsize: the figure size in inches.

    Returns:
        The matplotlib Figure.

    Raises:
        InvalidArgumentError: ``answer`` is not an Answer-like object, or ``top < 1``.
        MissingDependencyError: matplotlib is not installed.
    """
    for name in ("weights", "ids", "keys", "value", "found"):
        if not hasattr(answer, name):
            raise InvalidArgumentError(f"expected a kvsearch Answer (with .{name}), got {type(answer).__name__}")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise InvalidArgumentError(f"expected top as a positive int or None, got {top!r}")
    weights = _as_numpy(answer.weights)
    ids = _as_numpy(answer.ids).astype(np.int64)
    batched = weights.ndim == 2
    weights = weights.reshape(-1, weights.shape[-1])  # (batch, k)
    ids = ids.reshape(weights.shape)  # (batch, k)
    keys = answer.keys if batched else [answer.keys]
    values = answer.value if batched else [answer.value]
    found = answer.found if batched else [answer.found]
    n = weights.shape[0]

    plt = _pyplot()
    shown = [int(min(top or weights.shape[1], (ids[b] >= 0).sum())) for b in range(n)]
    if figsize is None:
        figsize = (6.0, max(1.8, 0.32 * max(shown + [1]) + 1.1) * n)
    fig, axes = plt.subplots(n, 1, figsize=figsize, squeeze=False)
    for b in range(n):
        ax = axes[b, 0]
        keep = np.flatnonzero(ids[b] >= 0)
        order = keep[np.argsort(-weights[b, keep], kind="stable")][: shown[b]]
        labels = [_candidate_label(keys[b][i], int(ids[b, i])) for i in order]
        w = weights[b, order]
        best = int(order[0]) if len(order) and found[b] else -1
        colours = ["tab:red" if i == best else "tab:gray" for i in order]
        ax.barh(range(len(order)), w, color=colours)
        ax.set_yticks(range(len(order)))
        ax.set_yticklabels(labels)
        ax.invert_yaxis()
        for y, value in enumerate(w):
            ax.text(value, y, f" {value:.3f}", va="center", fontsize=8)
        hi = float(w.max()) if len(w) else 1.0
        ax.set_xlim(0, max(hi, 1e-9) * 1.25)
        ax.set_xlabel("attention weight")
        value = values[b]
        shown_value = value if isinstance(value, str) or value is None else f"tensor {tuple(value.shape)}"
        ax.set_title(f"answer: {shown_value!r}" if found[b] else "not found", fontsize=10)
    fig.tight_layout()
    return fig


def _candidate_label(key: str | None, id_: int) -> str:
    return f"{key} (id {id_})" if key is not None else f"id {id_}"


def plot_history(history: object, *, figsize: tuple[float, float] = (10.0, 3.5)) -> Figure:
    """Fine-tuning curves: the training loss per step, and the retrieval metrics per epoch.

    Works with any object that has ``.losses`` (a list of floats, one per step) and ``.metrics`` (a list
    of dicts, one per evaluation, with an ``"epoch"`` entry and numbers such as ``recall@1``,
    ``recall@k`` and ``mrr``), such as the ``History`` that :func:`kvsearch.finetune` returns. Every
    numeric entry of the metric dicts other than ``epoch``/``step`` gets its own curve.

    Args:
        history: the training history.
        figsize: the figure size in inches.

    Returns:
        The matplotlib Figure (two panels: loss, metrics).

    Raises:
        InvalidArgumentError: ``history`` lacks ``.losses`` or ``.metrics``, or they hold non-numbers.
        MissingDependencyError: matplotlib is not installed.
    """
    if not hasattr(history, "losses") or not hasattr(history, "metrics"):
        raise InvalidArgumentError(
            f"expected a training history with .losses and .metrics, got {type(history).__name__}"
        )
    losses = _as_numpy(list(history.losses)).reshape(-1)  # (steps,)
    metrics = list(history.metrics)
    names: list[str] = []
    for m in metrics:
        if not isinstance(m, dict):
            raise InvalidArgumentError(f"expected each metrics entry as a dict, got {type(m).__name__}")
        for name, value in m.items():
            if name not in ("epoch", "step") and _is_number(value) and name not in names:
                names.append(name)

    plt = _pyplot()
    fig, (ax_loss, ax_metrics) = plt.subplots(1, 2, figsize=figsize)
    if len(losses):
        ax_loss.plot(np.arange(1, len(losses) + 1), losses, color="tab:blue", lw=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("loss")
    ax_loss.grid(alpha=0.3)
    for name in names:
        points = [(m.get("epoch", i), float(m[name])) for i, m in enumerate(metrics) if _is_number(m.get(name))]
        xs, ys = zip(*points)
        ax_metrics.plot(xs, ys, marker="o", label=name)
    ax_metrics.set_xlabel("epoch")
    ax_metrics.set_ylabel("value")
    ax_metrics.set_title("retrieval metrics")
    values = [float(m[name]) for m in metrics for name in names if _is_number(m.get(name))]
    if values and 0.0 <= min(values) and max(values) <= 1.0:
        ax_metrics.set_ylim(-0.02, 1.02)  # recall and MRR live in [0, 1]: show the whole scale
    ax_metrics.grid(alpha=0.3)
    if names:
        ax_metrics.legend(loc="lower right")
    fig.tight_layout()
    return fig


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(value)
