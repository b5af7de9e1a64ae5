"""``torch.func.vmap`` over ``attend`` and ``KVAttention``: the same as a Python loop over the examples.

Under vmap no tensor value can be read back to the host (``.item()`` raises torch's RuntimeError), so the checks that
read values (NaN / Inf, overflow) are skipped there as under ``torch.compile``; the layer's database search runs
outside vmap on every example's queries at once and is checked there. Outside vmap every check still fires.
``streaming_attention`` (a custom backward without a functorch rule) refuses typed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.func import functional_call, grad, vmap

import kvsearch
from kvsearch.errors import DimensionMismatchError, NonFiniteError, NotSupportedError
from kvsearch.nn.attend import attend
from kvsearch.nn.kv_attention import KVAttention
from kvsearch.nn.streaming import streaming_attention

SCORES = ("dot", "scaled_dot", "cosine", "gaussian")
POOLINGS = ("softmax", "normalize", "nonnegative", "hard", "exact", "average")
EXAMPLES = 3


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Seeded standard normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def inputs(layout: str, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """EXAMPLES examples of queries, keys and values in one of attend's layouts (the vmapped dim first)."""
    shapes = {
        "2d": ((2, 4), (5, 4), (5, 3)),
        "gathered": ((2, 4), (2, 5, 4), (2, 5, 3)),
        "3d": ((2, 2, 4), (2, 5, 4), (2, 5, 3)),
    }[layout]
    q, k, v = (randn(EXAMPLES, *shape, seed=seed + i) for i, shape in enumerate(shapes))
    q[1].view(-1, 4)[0] = k[1].view(-1, 4)[0]  # one query equal to a key: exact pooling finds something
    return q, k, v


def loop(fn, *batches: Tensor) -> Tensor:
    """``fn`` applied to each example, stacked: what vmap must give."""
    return torch.stack([fn(*(b[i] for b in batches)) for i in range(EXAMPLES)])


# ----------------------------------------------------------------------------- attend


@pytest.mark.parametrize("layout", ["2d", "gathered", "3d"])
@pytest.mark.parametrize("score", SCORES)
def test_vmap_attend_equals_a_loop(score, layout):
    queries, keys, values = inputs(layout, seed=10)
    for pooling in POOLINGS:
        if score == "gaussian" and pooling in ("normalize", "nonnegative"):
            continue  # refused: every weight would be 0

        def one(q: Tensor, k: Tensor, v: Tensor, pooling: str = pooling) -> Tensor:
            output, weights = attend(q, k, v, score=score, pooling=pooling)
            return torch.cat([output.flatten(), weights.flatten()])  # both compared

        torch.testing.assert_close(vmap(one)(queries, keys, values), loop(one, queries, keys, values))


def test_vmap_attend_with_masks_lengths_a_learned_score_and_shared_keys():
    queries, keys, values = inputs("3d", seed=20)
    mask = torch.rand(EXAMPLES, 2, 2, 5, generator=torch.Generator().manual_seed(21)) < 0.6
    lens = torch.tensor([[1, 5], [0, 3], [2, 2]])
    masked = lambda q, k, v, m: attend(q, k, v, mask=m)[0]  # noqa: E731
    torch.testing.assert_close(vmap(masked)(queries, keys, values, mask), loop(masked, queries, keys, values, mask))
    lengths = lambda q, k, v, n: attend(q, k, v, valid_lens=n, pooling="average")[0]  # noqa: E731
    torch.testing.assert_close(vmap(lengths)(queries, keys, values, lens), loop(lengths, queries, keys, values, lens))
    additive = kvsearch.AdditiveScore(4, 4, hidden=8).double()
    learned = lambda q, k, v: attend(q, k, v, score=additive, temperature=0.5)[0]  # noqa: E731
    torch.testing.assert_close(vmap(learned)(queries, keys, values), loop(learned, queries, keys, values))
    shared = lambda q: attend(q, keys[0], values[0])[0]  # noqa: E731  (only the queries vmapped)
    torch.testing.assert_close(vmap(shared)(queries), loop(shared, queries))


def test_vmap_of_grad_gives_per_example_gradients_of_attend():
    queries, keys, values = inputs("3d", seed=30)

    def loss(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q, k, v, score="cosine")[0].pow(2).sum()

    got = vmap(grad(loss, argnums=(0, 1, 2)))(queries, keys, values)
    for i in range(EXAMPLES):
        example = [t[i].clone().requires_grad_() for t in (queries, keys, values)]
        want = torch.autograd.grad(loss(*example), example)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[i], w)


def test_the_finiteness_checks_still_fire_outside_vmap():
    queries, keys, values = inputs("3d", seed=40)
    queries[2, 1, 1, 3] = math.nan
    with pytest.raises(NonFiniteError, match=r"got 1 non-finite entries in queries of shape \(2, 2, 4\)"):
        attend(queries[2], keys[2], values[2])
    keys[0, 0, 0] = math.inf
    with pytest.raises(NonFiniteError, match="keys must be finite"):
        attend(queries[0], keys[0], values[0])
    # under vmap nothing can be read back: no check and no error (as under torch.compile); the other examples'
    # outputs are what a loop gives them
    output = vmap(lambda q, k, v: attend(q, k, v)[0])(queries, keys, values)
    torch.testing.assert_close(output[1], attend(queries[1], keys[1], values[1])[0])


def test_streaming_attention_refuses_vmap_typed():
    queries, keys, values = randn(EXAMPLES, 2, 4, seed=50), randn(6, 4, seed=51), randn(6, 3, seed=52)
    with pytest.raises(NotSupportedError, match="inside torch.func transforms"):
        vmap(lambda q: streaming_attention(q, keys, values))(queries)
    torch.testing.assert_close(streaming_attention(queries[0], keys, values), attend(queries[0], keys, values)[0])


# ----------------------------------------------------------------------------- KVAttention


KEYS = np.random.default_rng(60).standard_normal((40, 4)).astype(np.float32)


@pytest.fixture
def db():
    values = np.random.default_rng(61).standard_normal((40, 3)).astype(np.float32)
    with kvsearch.Database(None, dim=4, value_dim=3) as database:
        database.add(KEYS, values)
        yield database


@pytest.mark.parametrize(
    "options",
    [{"k": 5}, {"k": "all"}, {"k": 50}, {"k": 5, "pooling": "exact"}, {"k": 5, "score": "cosine", "pooling": "hard"}],
)
def test_vmap_kvattention_equals_a_loop(db, options):
    layer = KVAttention(db, **options)
    queries = randn(EXAMPLES, 2, 4, seed=62, dtype=torch.float32)
    queries[1, 0] = torch.from_numpy(KEYS[7])  # a stored key: exact pooling finds it
    got = vmap(layer)(queries)  # (EXAMPLES, 2, 3)
    assert layer.last_weights is None and layer.last_ids is None  # batched tensors do not outlive vmap
    torch.testing.assert_close(got, loop(layer, queries))
    if options.get("pooling") == "exact":
        assert got[1, 0].abs().sum() > 0  # the stored key was found under vmap too
    torch.testing.assert_close(vmap(vmap(layer))(queries.unsqueeze(0).expand(2, -1, -1, -1)), got.expand(2, -1, -1, -1))
    torch.testing.assert_close(vmap(layer, in_dims=1)(queries.transpose(0, 1)), got)


def test_vmap_of_grad_gives_per_example_gradients_of_kvattention(db):
    layer = KVAttention(db, k=6, score="additive").double()
    queries = randn(EXAMPLES, 2, 4, seed=63)
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def loss(p: dict, q: Tensor) -> Tensor:
        return functional_call(layer, p, (q,)).pow(2).sum()

    per_query, per_param = vmap(grad(loss, argnums=(1, 0)), in_dims=(None, 0))(params, queries)
    for i in range(EXAMPLES):
        q = queries[i].clone().requires_grad_()
        layer.zero_grad()
        layer(q).pow(2).sum().backward()
        torch.testing.assert_close(per_query[i], q.grad)
        for name, p in layer.named_parameters():
            torch.testing.assert_close(per_param[name][i], p.grad)


def test_kvattention_checks_fire_inside_and_outside_vmap(db):
    layer = KVAttention(db, k=5)
    queries = randn(EXAMPLES, 2, 4, seed=64, dtype=torch.float32)
    queries[2, 1, 0] = math.nan
    with pytest.raises(NonFiniteError, match=r"got 1 non-finite entries in queries of shape \(2, 4\)"):
        layer(queries[2])  # outside vmap, as before
    with pytest.raises(NonFiniteError, match=r"got 1 non-finite entries in queries of shape \(6, 4\)"):
        vmap(layer)(queries)  # the search runs outside vmap on every example's queries: checked there
    with pytest.raises(DimensionMismatchError, match=r"expected queries of shape \(batch, 4\), got \(4,\)"):
        vmap(layer)(queries[0])  # each example one query (4,): not the layer's (batch, dim)
