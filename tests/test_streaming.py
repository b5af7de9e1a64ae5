"""streaming.py: equal to dense softmax attention in value and gradient; gradcheck in float64."""

from __future__ import annotations

import pytest
import torch

from kvsearch import Database
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, UnknownOptionError
from kvsearch.nn.attend import attend
from kvsearch.nn.streaming import STREAMING_SCORES, streaming_attention


def inputs(batch, m, dim, value_dim, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()  # noqa: E731
    return make(batch, dim), make(m, dim), make(m, value_dim)


@pytest.mark.parametrize("score", STREAMING_SCORES)
def test_gradcheck_float64(score):
    q, k, v = inputs(2, 7, 3, 2)
    fn = lambda a, b, c: streaming_attention(a, b, c, score=score, temperature=0.7, chunk=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("score", STREAMING_SCORES)
@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_equals_dense_in_value_and_gradient(score, chunk, dtype, tol):
    q, k, v = inputs(6, 60, 16, 8, dtype=dtype, seed=1)
    out = streaming_attention(q, k, v, score=score, temperature=0.5, chunk=chunk)
    ref, _ = attend(q, k, v, score=score, pooling="softmax", temperature=0.5)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    dense = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for a, b in zip(ours, dense):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_large_scores_do_not_overflow_and_stats_are_right():
    q, k, v = inputs(4, 300, 8, 3, dtype=torch.float32, seed=2)
    q = (q * 40).detach()  # scores in the thousands: a naive exp overflows
    out, lse, best = streaming_attention(q, k, v, score="dot", chunk=32, return_stats=True)
    scores = q @ k.T  # (4, 300)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    assert torch.equal(best, scores.argmax(-1)) and torch.isfinite(out).all()


def test_only_requested_gradients_are_computed():
    q, k, v = inputs(2, 20, 4, 2)
    k.requires_grad_(False)
    v.requires_grad_(False)
    streaming_attention(q, k, v, chunk=3).sum().backward()
    assert q.grad is not None and k.grad is None and v.grad is None


def test_database_all_softmax_uses_streaming_and_equals_dense(tmp_path):
    q, k, v = inputs(5, 120, 8, 3, dtype=torch.float32, seed=3)
    db = Database(tmp_path / "db", dim=8, value_dim=3, score="scaled_dot")
    db.add(k.detach(), v.detach())
    queries = q.detach().clone().requires_grad_()
    ans = db.query(queries, k="all", pooling="softmax", temperature=0.3)
    ref, weights = attend(queries, k.detach(), v.detach(), score="scaled_dot", pooling="softmax", temperature=0.3)
    torch.testing.assert_close(ans.output, ref)
    torch.testing.assert_close(ans.weights, weights.detach())
    assert torch.equal(ans.ids[0], db.store.table.ids)
    (g_ours,) = torch.autograd.grad(ans.output.sum(), queries)
    (g_dense,) = torch.autograd.grad(ref.sum(), queries)
    torch.testing.assert_close(g_ours, g_dense)
    db.close()


def test_arguments_are_checked():
    q, k, v = inputs(2, 5, 4, 3)
    with pytest.raises(UnknownOptionError):
        streaming_attention(q, k, v, score="additive")
    with pytest.raises(InvalidArgumentError):
        streaming_attention(q, k, v, temperature=0)
    with pytest.raises(InvalidArgumentError):
        streaming_attention(q, k, v, chunk=0)
    with pytest.raises(InvalidArgumentError):
        streaming_attention(q, k[:0], v[:0])
    with pytest.raises(DimensionMismatchError):
        streaming_attention(q, k[:, :3], v)
    with pytest.raises(DimensionMismatchError):
        streaming_attention(q, k, v[:4])
