"""Numerics of scores and pooling: the gaussian score far from the origin, non-finite scores, overflow.

Every float32 result is compared with a float64 reference computed in the test from the same float32 inputs
(direct differences, no expanded form), so what is measured is kvsearch's rounding, not the inputs'.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import kvsearch
from kvsearch.errors import NonFiniteError
from kvsearch.nn.attend import attend
from kvsearch.nn.kv_attention import KVAttention
from kvsearch.nn.pooling import pool
from kvsearch.nn.scores import compute_scores
from kvsearch.nn.streaming import streaming_attend, streaming_attention

OFFSETS = (0.0, 2e3, 1e4)


def curve(offset: float, *, m: int = 50, n: int = 40, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """A 1-D regression curve shifted by ``offset``: queries (n, 1), keys (m, 1), values sin(x) (m, 1), float32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.sort(torch.rand(m, generator=gen) * 5).values  # (m,)
    keys = (x + offset).unsqueeze(1).float()  # (m, 1)
    queries = (torch.linspace(0, 5, n) + offset).unsqueeze(1).float()  # (n, 1)
    return queries, keys, torch.sin(x).unsqueeze(1).float()


def reference_scores(queries: Tensor, keys: Tensor) -> Tensor:
    """-|q - k|^2 / 2 in float64 from direct differences: queries (..., n, dim), keys (..., m, dim) -> (..., n, m)."""
    diff = queries.double().unsqueeze(-2) - keys.double().unsqueeze(-3)  # (..., n, m, dim)
    return -0.5 * diff.pow(2).sum(-1)  # (..., n, m)


def reference_nw(queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Nadaraya-Watson in float64: softmax(-|q - k|^2 / 2) @ values."""
    return torch.softmax(reference_scores(queries, keys), dim=-1) @ values.double()  # (..., n, value_dim)


# ----------------------------------------------------------------------------- the gaussian score


@pytest.mark.parametrize("offset", OFFSETS)
def test_gaussian_scores_are_accurate_at_any_offset(offset):
    queries, keys, _ = curve(offset)
    expected = reference_scores(queries, keys)  # (n, m)
    got = compute_scores(queries, keys, "gaussian").double()  # (n, m)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-6 * scale  # relative to the scores' size, at any offset


@pytest.mark.parametrize("offset", OFFSETS)
def test_gaussian_scores_in_8_dims_and_batched(offset):
    gen = torch.Generator().manual_seed(1)
    keys = (torch.randn(3, 30, 8, generator=gen) + offset).float()  # (b, m, dim)
    queries = (torch.randn(3, 5, 8, generator=gen) + offset).float()  # (b, n, dim)
    expected = reference_scores(queries, keys)  # (b, n, m)
    got = compute_scores(queries, keys, "gaussian").double()
    assert (got - expected).abs().max() <= 1e-6 * expected.abs().max()


@pytest.mark.parametrize("offset", OFFSETS)
def test_nadaraya_watson_is_accurate_at_any_offset_in_every_layout(offset):
    queries, keys, values = curve(offset)
    expected = reference_nw(queries, keys, values)  # (n, 1)
    output, weights = attend(queries, keys, values, score="gaussian", pooling="softmax")  # shared keys
    assert (output.double() - expected).abs().max() < 1e-5
    torch.testing.assert_close(weights.sum(-1), torch.ones(len(queries)))
    n = len(queries)  # gathered candidates: every query with its own copy of the keys
    output, _ = attend(queries, keys.expand(n, -1, -1), values.expand(n, -1, -1), score="gaussian")
    assert (output.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("offset", OFFSETS)
def test_nadaraya_watson_gradient_is_accurate_at_any_offset(offset):
    queries, keys, values = curve(offset, m=20, n=10)
    q32, k32 = queries.clone().requires_grad_(), keys.clone().requires_grad_()
    attend(q32, k32, values, score="gaussian")[0].sum().backward()
    q64, k64 = queries.double().requires_grad_(), keys.double().requires_grad_()
    reference_nw(q64, k64, values).sum().backward()
    for got, expected in ((q32.grad, q64.grad), (k32.grad, k64.grad)):
        assert (got.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize("offset", OFFSETS)
def test_streaming_gaussian_is_accurate_at_any_offset(offset):
    queries, keys, values = curve(offset)
    expected = reference_nw(queries, keys, values)  # (n, 1)
    output = streaming_attention(queries, keys, values, score="gaussian", chunk=7)
    assert (output.double() - expected).abs().max() < 1e-5
    output, weights = streaming_attend(queries, keys, values, score="gaussian", temperature=1.0)
    expected_weights = torch.softmax(reference_scores(queries, keys), dim=-1)  # (n, m)
    assert (weights.double() - expected_weights).abs().max() < 1e-5  # the weights an answer shows sum to 1


@pytest.mark.parametrize("offset", OFFSETS)
def test_database_gaussian_query_is_accurate_at_any_offset(offset):
    queries, keys, values = curve(offset)
    db = kvsearch.Database(None, dim=1, value_dim=1, score="gaussian", device="cpu")
    db.add(keys=keys, values=values)
    expected = reference_nw(queries, keys, values)  # (n, 1) over every record
    assert (db.query(queries, k="all").output.double() - expected).abs().max() < 1e-5
    answer = db.query(queries, k=10)  # FAISS picks the candidates (its L2 is its own); torch scores them
    cand_keys, cand_values, _ = db.embeddings(answer.ids)  # (n, 10, 1) each
    expected = reference_nw(queries.unsqueeze(1), cand_keys, cand_values).squeeze(1)  # (n, 1)
    assert (answer.output.double() - expected).abs().max() < 1e-5
    layer = KVAttention(db, k=10, score="gaussian")
    output = layer(queries)
    cand_keys, cand_values, _ = db.embeddings(layer.last_ids)  # (n, 10, 1) each
    expected = reference_nw(queries.unsqueeze(1), cand_keys, cand_values).squeeze(1)  # (n, 1)
    assert (output.double() - expected).abs().max() < 1e-5


# ----------------------------------------------------------------------------- non-finite scores, overflow


def scores_with_minus_inf(queries: Tensor, keys: Tensor) -> Tensor:
    """Dot scores, -inf everywhere in the first query's row and on the second query's first two keys."""
    scores = queries @ keys.mT  # (n, m)
    scores = scores.clone()
    scores[0] = -math.inf
    scores[1, :2] = -math.inf
    return scores


@pytest.mark.parametrize("pooling", ["softmax", "normalize", "nonnegative", "hard", "average"])
def test_minus_inf_scores_drop_candidates_and_a_row_of_them_gives_zeros(pooling):
    gen = torch.Generator().manual_seed(2)
    queries = torch.randn(3, 4, generator=gen, requires_grad=True)
    keys, values = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen).requires_grad_()
    output, weights = attend(queries, keys, values, score=scores_with_minus_inf, pooling=pooling)
    assert torch.isfinite(output).all() and torch.isfinite(weights).all()
    assert torch.equal(weights[0], torch.zeros(5)) and torch.equal(output[0], torch.zeros(2))  # a masked row
    assert torch.equal(weights[1, :2], torch.zeros(2))  # dropped like masked candidates
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[0], keep[1, :2] = False, False
    _, expected = attend(queries, keys, values, score="dot", pooling=pooling, mask=keep)  # the same, as a mask
    torch.testing.assert_close(weights, expected)
    output.sum().backward()
    torch.testing.assert_close(values.grad, weights.detach().sum(0).unsqueeze(1).expand(5, 2))  # finite, and right
    assert queries.grad is None or torch.isfinite(queries.grad).all()  # average and exact weights are constant


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_plus_inf_scores_raise(bad):
    def score(queries: Tensor, keys: Tensor) -> Tensor:
        scores = (queries @ keys.mT).clone()  # (n, m)
        scores[1, 2] = bad
        return scores

    gen = torch.Generator().manual_seed(3)
    queries, keys, values = torch.randn(2, 4, generator=gen), torch.randn(5, 4, generator=gen), torch.randn(5, 2)
    with pytest.raises(NonFiniteError, match="scores"):
        attend(queries, keys, values, score=score)
    with pytest.raises(NonFiniteError, match="scores"):
        pool(score(queries, keys))


def test_a_database_query_whose_scores_are_all_minus_inf_is_not_found():
    def no_candidate_for_negative_queries(queries: Tensor, keys: Tensor) -> Tensor:
        scores = queries @ keys.mT  # (..., n, m)
        return scores.masked_fill(queries[..., :1] < 0, -math.inf)  # (..., n, m) rows of a query with x < 0

    db = kvsearch.Database(None, dim=4, value_dim=2, device="cpu")
    gen = torch.Generator().manual_seed(4)
    db.add(keys=torch.randn(6, 4, generator=gen), values=torch.randn(6, 2, generator=gen))
    queries = torch.tensor([[-1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    answer = db.query(queries, k=3, score=no_candidate_for_negative_queries)
    assert answer.found == [False, True] and answer.value[0] is None
    assert torch.equal(answer.output[0], torch.zeros(2)) and torch.isfinite(answer.output).all()


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "cosine"])
def test_inputs_near_1e20_never_give_nan(score):
    gen = torch.Generator().manual_seed(5)
    queries, keys = torch.randn(2, 4, generator=gen) * 1e20, torch.randn(6, 4, generator=gen) * 1e20
    values = torch.randn(6, 3, generator=gen)
    if score == "cosine":  # scale-free: an exact answer
        output, weights = attend(queries, keys, values, score=score)
        _, expected = attend(queries.double() / 1e20, keys.double() / 1e20, values.double(), score=score)
        torch.testing.assert_close(weights.double(), expected, atol=1e-5, rtol=1e-5)
        return
    with pytest.raises(NonFiniteError, match=f"the {score} scores overflowed"):  # q.k ~ 1e40 > float32's max
        attend(queries, keys, values, score=score)


def test_gaussian_near_1e20_is_finite_and_right():
    gen = torch.Generator().manual_seed(6)
    keys = 1e20 + torch.arange(6.0).unsqueeze(1) * 1e13  # (6, 1) float32 keys 1e13 apart, far from 0
    values = torch.randn(6, 2, generator=gen)
    queries = keys[[1, 4]]  # (2, 1) each equal to one key
    output, weights = attend(queries, keys, values, score="gaussian")
    assert torch.equal(weights, torch.eye(6)[[1, 4]]) and torch.equal(output, values[[1, 4]])


def test_tiny_temperature_gives_one_hot_not_nan():
    scores = torch.tensor([[1.0, 2.0, 3.0], [-5.0, -5.0, -4.0]])
    for pooling in ("softmax", "hard"):
        weights = pool(scores, pooling=pooling, temperature=1e-40)  # scores / temperature overflow float32
        assert torch.equal(weights, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))


def test_an_output_that_overflows_raises():
    keys = torch.ones(2, 1) * 1e15
    values = torch.full((2, 1), 1e30)
    with pytest.raises(NonFiniteError, match="output"):  # weights 1e15 (not normalised) x values 1e30
        attend(torch.ones(1, 1), keys, values, score="dot", pooling="nonnegative")
