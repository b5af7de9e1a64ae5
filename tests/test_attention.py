"""Tests of kvsearch.nn (scores, pooling, attend, KVAttention) against brute-force references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.autograd import gradcheck
from torch.func import functional_call

from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, NonFiniteError, UnknownOptionError
from kvsearch.nn.attend import Candidates, attend
from kvsearch.nn.kv_attention import KVAttention
from kvsearch.nn.pooling import POOLINGS, pool
from kvsearch.nn.scores import SCORES, AdditiveScore, compute_scores

BUILTIN_SCORES = ("dot", "scaled_dot", "cosine", "gaussian")
LAYOUTS = ("2d", "gathered", "3d")


# ----------------------------------------------------------------------------- helpers


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Seeded standard normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def rand_mask(*shape: int, seed: int, p: float = 0.7) -> Tensor:
    """Seeded bool mask, True with probability p."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


def ref_scores(queries: Tensor, keys: Tensor, score: str) -> Tensor:
    """Hand-written scores: queries (..., n, dim), keys (..., m, dim) -> (..., n, m)."""
    dim = queries.shape[-1]
    if score == "dot":
        return torch.einsum("...nd,...md->...nm", queries, keys)
    if score == "scaled_dot":
        return torch.einsum("...nd,...md->...nm", queries, keys) / math.sqrt(dim)
    if score == "cosine":
        qn = queries / queries.norm(dim=-1, keepdim=True)
        kn = keys / keys.norm(dim=-1, keepdim=True)
        return torch.einsum("...nd,...md->...nm", qn, kn)
    assert score == "gaussian"
    return -0.5 * torch.cdist(queries, keys) ** 2


def ref_pool_row(scores: list[float], keep: list[bool], mode: str, temperature: float, match: list[bool]) -> list:
    """Pool one row with plain Python loops."""
    m = len(scores)
    out = [0.0] * m
    kept = [i for i in range(m) if keep[i]]
    if not kept:
        return out
    if mode == "softmax":
        top = max(scores[i] / temperature for i in kept)
        exps = {i: math.exp(scores[i] / temperature - top) for i in kept}
        total = sum(exps.values())
        for i in kept:
            out[i] = exps[i] / total
    elif mode in ("normalize", "nonnegative"):
        pos = {i: max(scores[i], 0.0) for i in kept}
        total = sum(pos.values()) if mode == "normalize" else 1.0
        for i in kept:
            out[i] = pos[i] / total if total > 0 else 0.0
    elif mode == "hard":
        best = max(kept, key=lambda i: (scores[i], -i))  # first index on ties
        out[best] = 1.0
    elif mode == "exact":
        for i in kept:
            if match[i]:
                out[i] = 1.0
                break
    else:
        for i in kept:
            out[i] = 1.0 / len(kept)
    return out


def ref_pool(scores: Tensor, keep: Tensor, mode: str, temperature: float = 1.0, match: Tensor | None = None):
    """Dense reference pooling over the last dim, row by row."""
    flat = scores.reshape(-1, scores.shape[-1]).tolist()
    flat_keep = keep.expand(scores.shape).reshape(-1, scores.shape[-1]).tolist()
    if match is None:
        match = torch.zeros(scores.shape, dtype=torch.bool)
    flat_match = match.expand(scores.shape).reshape(-1, scores.shape[-1]).tolist()
    rows = [ref_pool_row(s, k, mode, temperature, mt) for s, k, mt in zip(flat, flat_keep, flat_match, strict=True)]
    return torch.tensor(rows, dtype=scores.dtype).reshape(scores.shape)


def make_inputs(layout: str, seed: int, b: int = 3, n: int = 2, m: int = 5, dim: int = 4, vdim: int = 3):
    """Queries, keys and values in one of the three layouts, and the weights' shape."""
    if layout == "2d":
        shapes = (n, dim), (m, dim), (m, vdim), (n, m)
    elif layout == "gathered":
        shapes = (b, dim), (b, m, dim), (b, m, vdim), (b, m)
    else:
        shapes = (b, n, dim), (b, m, dim), (b, m, vdim), (b, n, m)
    q, k, v, w = shapes
    return randn(*q, seed=seed), randn(*k, seed=seed + 1), randn(*v, seed=seed + 2), w


def ref_attend(queries, keys, values, layout, score, mode="softmax", keep=None, match=None):
    """Reference attend: everything spelled out per layout."""
    if layout == "gathered":
        queries = queries.unsqueeze(1)
    scores = ref_scores(queries, keys, score)
    if keep is None:
        keep = torch.ones(scores.shape, dtype=torch.bool)
    elif layout == "gathered":
        keep = keep.unsqueeze(1)
    if match is not None and layout == "gathered":
        match = match.unsqueeze(1)
    weights = ref_pool(scores, keep, mode, match=match)
    output = torch.einsum("...nm,...mv->...nv", weights, values)
    if layout == "gathered":
        output, weights = output.squeeze(1), weights.squeeze(1)
    return output, weights


# ----------------------------------------------------------------------------- scores


@pytest.mark.parametrize("score", BUILTIN_SCORES)
@pytest.mark.parametrize("shapes", [((3, 4), (5, 4)), ((2, 3, 4), (2, 5, 4)), ((2, 3, 4), (5, 4))])
def test_compute_scores_matches_reference(score, shapes):
    q_shape, k_shape = shapes
    queries, keys = randn(*q_shape, seed=1), randn(*k_shape, seed=2)
    got = compute_scores(queries, keys, score)
    expected = ref_scores(queries, keys.expand(*q_shape[:-2], *k_shape) if len(k_shape) < len(q_shape) else keys, score)
    assert got.shape == (*q_shape[:-1], k_shape[-2])
    torch.testing.assert_close(got, expected)


def test_compute_scores_float32_gaussian_close_to_cdist():
    queries, keys = randn(6, 8, seed=3, dtype=torch.float32), randn(7, 8, seed=4, dtype=torch.float32)
    expected = -0.5 * torch.cdist(queries.double(), keys.double()) ** 2
    torch.testing.assert_close(compute_scores(queries, keys, "gaussian").double(), expected, atol=1e-5, rtol=1e-5)


def test_gaussian_of_a_key_with_itself_is_zero_with_finite_gradient():
    keys = randn(4, 3, seed=5).requires_grad_()
    scores = compute_scores(keys, keys, "gaussian")
    assert torch.all(scores <= 0)
    torch.testing.assert_close(scores.diagonal(), torch.zeros(4, dtype=torch.float64), atol=1e-12, rtol=0)
    scores.sum().backward()
    assert torch.isfinite(keys.grad).all()


def test_cosine_of_a_zero_vector_is_zero_not_nan():
    queries = torch.zeros(1, 3, requires_grad=True)
    scores = compute_scores(queries, randn(2, 3, seed=6, dtype=torch.float32), "cosine")
    assert torch.equal(scores, torch.zeros(1, 2))
    scores.sum().backward()
    assert torch.isfinite(queries.grad).all()


def test_compute_scores_calls_a_callable_as_is():
    def neg_dot(q: Tensor, k: Tensor) -> Tensor:
        return -(q @ k.mT)

    queries, keys = randn(2, 3, seed=7), randn(4, 3, seed=8)
    torch.testing.assert_close(compute_scores(queries, keys, neg_dot), -(queries @ keys.T))


@pytest.mark.parametrize("score", BUILTIN_SCORES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attend_every_score_every_layout_matches_reference(score, layout):
    queries, keys, values, wshape = make_inputs(layout, seed=10)
    output, weights = attend(queries, keys, values, score=score)
    expected_output, expected_weights = ref_attend(queries, keys, values, layout, score)
    assert weights.shape == wshape
    assert output.shape == (*wshape[:-1], values.shape[-1])
    torch.testing.assert_close(weights, expected_weights)
    torch.testing.assert_close(output, expected_output)


def test_attend_gathered_equals_one_2d_call_per_query():
    queries, keys, values, _ = make_inputs("gathered", seed=11)
    output, weights = attend(queries, keys, values, score="cosine")
    for i in range(queries.shape[0]):
        row_out, row_w = attend(queries[i : i + 1], keys[i], values[i], score="cosine")
        torch.testing.assert_close(output[i], row_out[0])
        torch.testing.assert_close(weights[i], row_w[0])


def test_attend_promotes_dtype_and_keeps_queries_device():
    queries = randn(2, 4, seed=12, dtype=torch.float32)
    output, weights = attend(queries, randn(3, 4, seed=13), randn(3, 2, seed=14))
    assert output.dtype == weights.dtype == torch.float64
    assert output.device == queries.device


# ----------------------------------------------------------------------------- pooling


@pytest.mark.parametrize("mode", POOLINGS)
@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_pool_matches_dense_reference(mode, temperature):
    scores = randn(4, 3, 6, seed=20)
    keep = rand_mask(4, 3, 6, seed=21)
    keep[1, 2] = False  # one fully masked row
    keep[2, 0] = True  # one row with nothing masked
    match = rand_mask(4, 3, 6, seed=22, p=0.3)
    got = pool(scores, keep, mode, temperature=temperature, match=match)
    expected = ref_pool(scores, keep, mode, temperature, match)
    torch.testing.assert_close(got, expected)
    assert torch.all(got[~keep] == 0)
    assert torch.all(got[1, 2] == 0)


def test_pool_without_mask_keeps_everything():
    scores = randn(2, 5, seed=23)
    torch.testing.assert_close(pool(scores), torch.softmax(scores, -1))
    torch.testing.assert_close(pool(scores, pooling="average"), torch.full((2, 5), 0.2, dtype=torch.float64))


def test_pool_mask_broadcasts():
    scores = randn(3, 4, seed=24)
    keep = torch.tensor([True, False, True, True])
    torch.testing.assert_close(pool(scores, keep), ref_pool(scores, keep.expand(3, 4), "softmax"))


def test_softmax_matches_torch_softmax_on_masked_copy():
    scores = randn(5, 7, seed=25)
    keep = rand_mask(5, 7, seed=26)
    keep[:, 0] = True
    expected = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
    torch.testing.assert_close(pool(scores, keep), expected)


def test_normalize_row_of_nonpositive_scores_is_zero_with_zero_gradient():
    scores = torch.tensor([[-1.0, -2.0, 0.0], [1.0, 3.0, -1.0]], requires_grad=True)
    weights = pool(scores, pooling="normalize")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 0.0], [0.25, 0.75, 0.0]]))
    weights.sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert torch.all(scores.grad[0] == 0)


def test_nonnegative_is_not_normalised():
    scores = torch.tensor([[2.0, 3.0, -1.0]])
    torch.testing.assert_close(pool(scores, pooling="nonnegative"), torch.tensor([[2.0, 3.0, 0.0]]))


@pytest.mark.parametrize("mode", POOLINGS)
def test_fully_masked_rows_are_zero_without_nan_forward_and_backward(mode):
    queries, keys, values, _ = make_inputs("3d", seed=30)
    queries, keys, values = (t.requires_grad_() for t in (queries, keys, values))
    keep = rand_mask(3, 2, 5, seed=31)
    keep[0] = False  # a batch element with no candidate at all
    keep[1, 1] = False  # one query with no candidate
    match = rand_mask(3, 2, 5, seed=32, p=0.5)
    output, weights = attend(queries, keys, values, pooling=mode, mask=keep, match=match)
    assert torch.all(weights[0] == 0) and torch.all(weights[1, 1] == 0)
    assert torch.all(output[0] == 0) and torch.all(output[1, 1] == 0)
    assert torch.all(weights[~keep] == 0)
    (output * randn(*output.shape, seed=33)).sum().backward()
    assert values.grad is not None
    constant = mode in ("exact", "average")  # weights do not depend on the scores
    for t in (queries, keys, values):
        assert (t.grad is None) == (constant and t is not values)
        assert t.grad is None or torch.isfinite(t.grad).all()


def test_no_kept_entries_at_all_and_empty_candidates():
    scores = randn(2, 4, seed=34).requires_grad_()
    for mode in POOLINGS:
        weights = pool(scores, torch.zeros(2, 4, dtype=torch.bool), mode, match=torch.ones(2, 4, dtype=torch.bool))
        assert torch.equal(weights, torch.zeros(2, 4, dtype=torch.float64))
    output, weights = attend(randn(2, 3, seed=35), randn(0, 3, seed=36), randn(0, 2, seed=37))
    assert weights.shape == (2, 0) and torch.equal(output, torch.zeros(2, 2, dtype=torch.float64))


# ----------------------------------------------------------------------------- valid_lens and masks


def lens_mask(lens: Tensor, m: int) -> Tensor:
    """Explicit keep-mask from lengths: (..., ) -> (..., m)."""
    return torch.stack([torch.tensor([j < int(x) for j in range(m)]) for x in lens.reshape(-1)]).reshape(*lens.shape, m)


@pytest.mark.parametrize("mode", POOLINGS)
def test_valid_lens_equal_explicit_mask(mode):
    queries, keys, values, _ = make_inputs("3d", seed=40)
    per_batch = torch.tensor([0, 3, 9])  # 9 > m: nothing masked
    got = attend(queries, keys, values, pooling=mode, valid_lens=per_batch)
    expected = attend(queries, keys, values, pooling=mode, mask=lens_mask(per_batch, 5).unsqueeze(1))
    torch.testing.assert_close(got, expected)

    per_query = torch.tensor([[1, 2], [5, 0], [4, 4]])
    got = attend(queries, keys, values, pooling=mode, valid_lens=per_query)
    expected = attend(queries, keys, values, pooling=mode, mask=lens_mask(per_query, 5))
    torch.testing.assert_close(got, expected)


def test_valid_lens_in_2d_and_gathered_layouts():
    queries, keys, values, _ = make_inputs("2d", seed=41)
    lens = torch.tensor([2, 4], dtype=torch.int32)
    torch.testing.assert_close(
        attend(queries, keys, values, valid_lens=lens), attend(queries, keys, values, mask=lens_mask(lens, 5))
    )
    queries, keys, values, _ = make_inputs("gathered", seed=42)
    lens = torch.tensor([1, 5, 3])
    torch.testing.assert_close(
        attend(queries, keys, values, valid_lens=lens), attend(queries, keys, values, mask=lens_mask(lens, 5))
    )


def test_valid_lens_and_mask_combine_with_and():
    queries, keys, values, _ = make_inputs("3d", seed=43)
    lens = torch.tensor([2, 5, 4])
    mask = rand_mask(3, 2, 5, seed=44)
    got = attend(queries, keys, values, valid_lens=lens, mask=mask)
    expected = attend(queries, keys, values, mask=mask & lens_mask(lens, 5).unsqueeze(1))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("mode", ["softmax", "normalize", "nonnegative", "hard", "average"])
def test_k_larger_than_present_keys_equals_attending_over_present_keys(mode):
    # two real candidates per query, padded to k = 4 with zero keys / values and a False mask
    queries, keys, values, _ = make_inputs("gathered", seed=45, m=2)
    pad_keys = F.pad(keys, (0, 0, 0, 2))  # (b, 4, dim)
    pad_values = F.pad(values, (0, 0, 0, 2))  # (b, 4, vdim)
    mask = torch.tensor([True, True, False, False]).expand(3, 4)
    output, weights = attend(queries, pad_keys, pad_values, pooling=mode, mask=mask)
    expected_output, expected_weights = attend(queries, keys, values, pooling=mode)
    torch.testing.assert_close(output, expected_output)
    torch.testing.assert_close(weights[:, :2], expected_weights)
    assert torch.all(weights[:, 2:] == 0)


# ----------------------------------------------------------------------------- hard and exact


def test_hard_forward_is_exactly_one_hot_first_on_ties():
    scores = torch.tensor([[0.1, 0.7, 0.3, 0.7], [2.0, 5.0, 1.0, 0.0], [-3.0, -1.0, -2.0, -1.5]])
    keep = torch.tensor([[True, True, True, True], [True, False, True, True], [True, True, True, True]])
    weights = pool(scores.requires_grad_(), keep, "hard", temperature=0.5)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert torch.equal(weights.detach(), expected)


def test_hard_gradient_is_the_softmax_gradient():
    scores = randn(3, 5, seed=50)
    keep = rand_mask(3, 5, seed=51)
    upstream = randn(3, 5, seed=52)
    grads = {}
    for mode in ("hard", "softmax"):
        s = scores.clone().requires_grad_()
        (pool(s, keep, mode, temperature=0.7) * upstream).sum().backward()
        grads[mode] = s.grad
    torch.testing.assert_close(grads["hard"], grads["softmax"])

    queries, keys, values, _ = make_inputs("gathered", seed=53)
    qgrads = {}
    for mode in ("hard", "softmax"):
        q = queries.clone().requires_grad_()
        attend(q, keys, values, pooling=mode)[0].sum().backward()
        qgrads[mode] = q.grad
    torch.testing.assert_close(qgrads["hard"], qgrads["softmax"])


def test_hard_output_is_the_best_value():
    queries, keys, values, _ = make_inputs("2d", seed=54)
    output, weights = attend(queries, keys, values, score="gaussian", pooling="hard")
    best = torch.cdist(queries, keys).argmin(-1)
    assert torch.equal(output, values[best])


def test_exact_first_match_wins_and_no_match_gives_zeros():
    scores = randn(3, 4, seed=60)
    match = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]]).bool()
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]]).bool()
    weights = pool(scores, keep, "exact", match=match)
    expected = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.float64)
    assert torch.equal(weights, expected)


def test_exact_match_computed_from_embedding_equality():
    keys = randn(5, 3, seed=61)
    keys[3] = keys[1]  # a duplicate key: the first copy wins
    values = randn(5, 2, seed=62)
    queries = torch.stack([keys[1], keys[4], keys[0] + 1e-9, keys[2]])
    output, weights = attend(queries, keys, values, pooling="exact")
    expected = torch.zeros(4, 5, dtype=torch.float64)
    expected[0, 1] = expected[1, 4] = expected[3, 2] = 1.0
    assert torch.equal(weights, expected)
    assert torch.equal(output[0], values[1]) and torch.equal(output[1], values[4])
    assert torch.equal(output[2], torch.zeros(2, dtype=torch.float64))  # near is not exact


def test_exact_match_computed_in_gathered_layout_and_given_match_wins():
    keys = randn(2, 3, 4, seed=63)
    values = randn(2, 3, 2, seed=64)
    queries = torch.stack([keys[0, 2], randn(4, seed=65)])
    output, weights = attend(queries, keys, values, pooling="exact")
    assert torch.equal(weights, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    assert torch.equal(output[0], values[0, 2])
    given_match = torch.tensor([[True, False, False], [False, True, True]])
    output, weights = attend(queries, keys, values, pooling="exact", match=given_match)
    assert torch.equal(weights, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64))


def test_exact_values_still_get_gradient():
    keys = randn(3, 2, seed=66)
    values = randn(3, 2, seed=67).requires_grad_()
    output, _ = attend(keys[1:2], keys, values, pooling="exact")
    output.sum().backward()
    assert torch.equal(values.grad, torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64))


# ----------------------------------------------------------------------------- gradients


def additive_double(seed: int, dim: int = 3, hidden: int = 4) -> AdditiveScore:
    torch.manual_seed(seed)
    return AdditiveScore(dim, dim, hidden).double()


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("mode", ["softmax", "normalize", "nonnegative", "average"])
def test_gradcheck_queries_keys_values(score, mode):
    if score == "gaussian" and mode in ("normalize", "nonnegative"):
        pytest.skip("refused: gaussian scores are never positive, every weight would be 0 (test_bad_input.py)")
    queries, keys, values, _ = make_inputs("3d", seed=70, b=2, n=2, m=4, dim=3, vdim=2)
    keep = torch.tensor([[[1, 1, 0, 1], [0, 0, 0, 0]], [[1, 1, 1, 1], [1, 0, 1, 0]]]).bool()
    score_fn = additive_double(71) if score == "additive" else score
    with torch.no_grad():  # relu modes: keep the inputs away from the kink at 0
        scores = compute_scores(queries, keys, score_fn)
    assert scores.abs().min() > 1e-3

    def fn(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return attend(q, k, v, score=score_fn, pooling=mode, mask=keep, temperature=0.8)

    inputs = tuple(t.clone().requires_grad_() for t in (queries, keys, values))
    assert gradcheck(fn, inputs)


@pytest.mark.parametrize("score", BUILTIN_SCORES)
def test_gradcheck_gathered_layout(score):
    queries, keys, values, _ = make_inputs("gathered", seed=72, b=2, m=3, dim=3, vdim=2)
    lens = torch.tensor([2, 3])

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q, k, v, score=score, valid_lens=lens)[0]

    assert gradcheck(fn, tuple(t.clone().requires_grad_() for t in (queries, keys, values)))


def test_gradcheck_additive_parameters():
    module = additive_double(73)
    queries, keys, values, _ = make_inputs("2d", seed=74, n=2, m=3, dim=3, vdim=2)
    names = [name for name, _ in module.named_parameters()]
    assert names == ["w_q.weight", "w_k.weight", "w_v.weight"]

    def fn(*params: Tensor) -> Tensor:
        def score(q: Tensor, k: Tensor) -> Tensor:
            return functional_call(module, dict(zip(names, params, strict=True)), (q, k))

        return attend(queries, keys, values, score=score)[0]

    params = tuple(p.detach().clone().requires_grad_() for p in module.parameters())
    assert gradcheck(fn, params)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_exact_pooling_with_respect_to_values(layout):
    """Exact pooling: one-hot weights where the key equals the query, zeros where none does (and where the
    match is masked out); the output is linear in the values and its gradient is that one-hot row."""
    queries, keys, values, _ = make_inputs(layout, seed=75, b=2, n=3, m=4, dim=3, vdim=2)
    if layout == "2d":  # queries (3, dim) over keys (4, dim)
        queries[0], queries[1] = keys[2], keys[0]  # two matches; the third query matches nothing
        mask = torch.tensor([True, True, True, False])
        expected = torch.tensor([[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    elif layout == "gathered":  # queries (2, dim) over their own candidates (2, 4, dim)
        queries[0], queries[1] = keys[0, 3], keys[1, 1]
        mask = torch.tensor([[True, True, True, True], [True, False, True, True]])  # the second match masked out
        expected = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.float64)
    else:  # queries (2, 3, dim) over keys (2, 4, dim)
        queries[0, 0], queries[0, 2], queries[1, 1] = keys[0, 1], keys[0, 3], keys[1, 0]
        mask = None
        expected = torch.zeros(2, 3, 4, dtype=torch.float64)
        expected[0, 0, 1] = expected[0, 2, 3] = expected[1, 1, 0] = 1.0

    def fn(v: Tensor) -> Tensor:
        return attend(queries, keys, v, pooling="exact", mask=mask)[0]

    _, weights = attend(queries, keys, values, pooling="exact", mask=mask)
    assert torch.equal(weights, expected) and expected.sum() > 0  # matches exist: the gradient is not all zero
    assert gradcheck(fn, (values.clone().requires_grad_(),))


def _top_k_margin(queries: Tensor, keys: Tensor, metric: str, k: int) -> tuple[Tensor, float]:
    """Brute-force top-k rows by a database's search metric, and the smallest gap at the k-th candidate."""
    if metric == "cosine":
        scores = F.normalize(queries, dim=-1) @ F.normalize(keys, dim=-1).T  # (batch, n)
    elif metric == "gaussian":
        scores = -(torch.cdist(queries, keys) ** 2)  # (batch, n): the L2 index's order
    else:
        scores = queries @ keys.T  # (batch, n)
    top = scores.topk(k + 1, dim=-1).values  # (batch, k + 1)
    return scores.topk(k, dim=-1).indices, float((top[:, k - 1] - top[:, k]).min())


@pytest.mark.parametrize(("db_score", "score"), [("dot", "scaled_dot"), ("cosine", "cosine"), ("gaussian", "gaussian")])
def test_gradcheck_kvattention_over_a_database(db_score, score):
    """The layer's whole path: a FAISS index picks k = 4 of 12 records, the store gathers them by id, attend
    pools them; gradcheck with respect to the queries.

    The store keeps float32 embeddings, which float64 represents exactly; with float64 queries the layer
    computes in float64 (keys and values are promoted), so gradcheck runs at its default float64 tolerances.
    Which candidates the index picks is piecewise constant in the queries: each query is checked to sit well
    inside its top-k (a margin far above gradcheck's perturbation of 1e-6).
    """
    import kvsearch

    keys, values = randn(12, 4, seed=140, dtype=torch.float32), randn(12, 3, seed=141, dtype=torch.float32)
    queries = randn(5, 4, seed=142)
    with kvsearch.Database(None, dim=4, value_dim=3, score=db_score) as db:
        ids = torch.tensor(db.add(keys=keys, values=values))
        rows, margin = _top_k_margin(queries, keys.double(), db_score, k=4)
        assert margin > 1e-3
        layer = KVAttention(db, k=4, score=score, temperature=0.7)
        output = layer(queries)
        assert output.dtype == torch.float64 and output.shape == (5, 3)
        for got, want in zip(layer.last_ids.tolist(), ids[rows].tolist()):
            assert sorted(got) == sorted(want)  # the index's candidates are the brute-force top-k
        (jacobian,) = torch.autograd.functional.jacobian(layer, (queries,))  # (5, 3, 5, 4)
        assert jacobian.abs().sum() > 0  # a gradient to check
        assert gradcheck(layer, (queries.clone().requires_grad_(),))


# ----------------------------------------------------------------------------- property test


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    layout=st.sampled_from(LAYOUTS),
    b=st.integers(1, 3),
    n=st.integers(1, 3),
    m=st.integers(1, 6),
    dim=st.integers(1, 5),
    vdim=st.integers(1, 3),
    score=st.sampled_from(BUILTIN_SCORES),
    seed=st.integers(0, 2**16),
)
def test_property_softmax_attend_equals_dense_masked_reference(layout, b, n, m, dim, vdim, score, seed):
    queries, keys, values, wshape = make_inputs(layout, seed, b=b, n=n, m=m, dim=dim, vdim=vdim)
    keep = rand_mask(*wshape, seed=seed + 3, p=0.6)
    output, weights = attend(queries, keys, values, score=score, mask=keep)
    # dense reference: torch.softmax on a -inf-filled copy, then fully masked rows set to 0
    q = queries.unsqueeze(1) if layout == "gathered" else queries
    k_ = keep.unsqueeze(1) if layout == "gathered" else keep
    scores = ref_scores(q, keys, score).masked_fill(~k_, -math.inf)
    ref_w = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    ref_out = ref_w @ values
    if layout == "gathered":
        ref_w, ref_out = ref_w.squeeze(1), ref_out.squeeze(1)
    torch.testing.assert_close(weights, ref_w)
    torch.testing.assert_close(output, ref_out)
    assert torch.all(weights[~keep] == 0)


# ----------------------------------------------------------------------------- errors


def test_unknown_score_name():
    q, k = randn(2, 3, seed=80), randn(4, 3, seed=81)
    with pytest.raises(UnknownOptionError, match=r"expected one of dot, scaled_dot.*got 'euclid'"):
        compute_scores(q, k, "euclid")
    with pytest.raises(UnknownOptionError, match="got 'euclid'"):
        attend(q, k, k, score="euclid")
    with pytest.raises(InvalidArgumentError, match="got int"):
        attend(q, k, k, score=3)


def test_additive_as_a_string_asks_for_the_module():
    q, k = randn(2, 3, seed=82), randn(4, 3, seed=83)
    hint = r"AdditiveScore\(query_dim, key_dim, hidden\).*got 'additive'"
    with pytest.raises(InvalidArgumentError, match=hint):
        compute_scores(q, k, "additive")
    with pytest.raises(InvalidArgumentError, match="AdditiveScore"):
        attend(q, k, k, score="additive")


def test_unknown_pooling_name():
    with pytest.raises(UnknownOptionError, match=r"expected one of softmax, .*average, got 'max'"):
        pool(randn(2, 3, seed=84), pooling="max")
    q = randn(2, 3, seed=85)
    with pytest.raises(UnknownOptionError, match="got 'max'"):
        attend(q, q, q, pooling="max")


@pytest.mark.parametrize("temperature", [0, -1.0, math.inf, math.nan, True, "1"])
def test_bad_temperature(temperature):
    with pytest.raises(InvalidArgumentError, match="temperature must be a finite number > 0, got"):
        pool(randn(2, 3, seed=86), temperature=temperature)
    q = randn(2, 3, seed=87)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        attend(q, q, q, temperature=temperature)


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 2, True])
def test_bad_dropout(dropout):
    q = randn(2, 3, seed=88)
    with pytest.raises(InvalidArgumentError, match=r"dropout must be a number in \[0, 1\), got"):
        attend(q, q, q, dropout=dropout)


def test_dim_mismatch_names_expected_and_got():
    q = randn(2, 4, seed=89)
    with pytest.raises(DimensionMismatchError, match="expected 4, got 3"):
        compute_scores(q, randn(5, 3, seed=90), "dot")
    with pytest.raises(DimensionMismatchError, match="expected 4, got 3"):
        attend(q, randn(5, 3, seed=90), randn(5, 2, seed=91))
    with pytest.raises(DimensionMismatchError, match=r"values .*expected shape \(5, 'value_dim'\), got \(4, 2"):
        attend(q, randn(5, 4, seed=92), randn(4, 2, seed=93))
    with pytest.raises(DimensionMismatchError, match="batch size: expected 2, got 3"):
        attend(q, randn(3, 5, 4, seed=94), randn(3, 5, 2, seed=95))
    with pytest.raises(DimensionMismatchError, match=r"got queries \(4,\) and keys \(5, 4\)"):
        attend(randn(4, seed=96), randn(5, 4, seed=97), randn(5, 2, seed=98))


def test_nonfinite_queries():
    keys, values = randn(5, 3, seed=99), randn(5, 2, seed=100)
    for bad in (math.nan, math.inf):
        q = randn(2, 3, seed=101)
        q[1, 2] = bad
        with pytest.raises(NonFiniteError, match=r"got 1 non-finite entries in queries of shape \(2, 3\)"):
            attend(q, keys, values)


def test_bad_masks_and_lengths():
    q, k, v, _ = make_inputs("3d", seed=102)
    with pytest.raises(InvalidArgumentError, match="mask must be a bool tensor, got a torch.int64"):
        attend(q, k, v, mask=torch.ones(3, 2, 5, dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match=r"expected \(3, 2, 5\), got \(4, 5\)"):
        attend(q, k, v, mask=torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(InvalidArgumentError, match="valid_lens must be an integer tensor, got a torch.float"):
        attend(q, k, v, valid_lens=torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(InvalidArgumentError, match=r"valid_lens must have shape \(3,\) or \(3, 2\), got \(2"):
        attend(q, k, v, valid_lens=torch.tensor([1, 2]))
    with pytest.raises(InvalidArgumentError, match="valid_lens must be >= 0, got -1"):
        attend(q, k, v, valid_lens=torch.tensor([1, -1, 2]))
    with pytest.raises(InvalidArgumentError, match="match must be a bool tensor"):
        attend(q, k, v, pooling="exact", match=torch.zeros(3, 2, 5))
    with pytest.raises(InvalidArgumentError, match="exact pooling needs match"):
        pool(randn(2, 3, seed=103), pooling="exact")
    with pytest.raises(InvalidArgumentError, match="queries must be a floating-point tensor"):
        attend(torch.ones(2, 4, dtype=torch.long), k[0], v[0])


def test_score_function_returning_a_wrong_shape():
    q, k, v, _ = make_inputs("2d", seed=104)
    with pytest.raises(DimensionMismatchError, match=r"must return shape \(2, 5\), got \(5, 2\)"):
        attend(q, k, v, score=lambda q_, k_: k_ @ q_.T)


def test_errors_are_value_errors_too():
    with pytest.raises(ValueError):
        pool(randn(2, 3, seed=105), pooling="max")


# ----------------------------------------------------------------------------- AdditiveScore


def test_additive_score_matches_the_formula_and_takes_different_dims():
    torch.manual_seed(110)
    module = AdditiveScore(query_dim=3, key_dim=5, hidden=7).double()
    queries, keys = randn(2, 4, 3, seed=111), randn(2, 6, 5, seed=112)
    scores = module(queries, keys)
    assert scores.shape == (2, 4, 6)
    wq, wk, wv = module.w_q.weight, module.w_k.weight, module.w_v.weight
    expected = torch.empty(2, 4, 6, dtype=torch.float64)
    for b in range(2):
        for i in range(4):
            for j in range(6):
                expected[b, i, j] = wv[0] @ torch.tanh(wq @ queries[b, i] + wk @ keys[b, j])
    torch.testing.assert_close(scores, expected)
    output, weights = attend(queries, keys, randn(2, 6, 2, seed=113), score=module)
    torch.testing.assert_close(weights, torch.softmax(expected, -1))
    assert all(layer.bias is None for layer in (module.w_q, module.w_k, module.w_v))


def test_additive_score_errors():
    module = AdditiveScore(3, 5)
    with pytest.raises(DimensionMismatchError, match=r"expected keys of shape \(..., m, 5\), got \(4, 3\)"):
        module(torch.randn(2, 3), torch.randn(4, 3))
    with pytest.raises(InvalidArgumentError, match="hidden must be a positive integer, got 0"):
        AdditiveScore(3, 3, hidden=0)


# ----------------------------------------------------------------------------- KVAttention


class FakeDB:
    """A brute-force database: top-k by dot product over fixed tensors, ids 100, 101, ..."""

    def __init__(self, keys: Tensor, values: Tensor) -> None:
        self.keys, self.values = keys, values
        self.ids = torch.arange(100, 100 + keys.shape[0])
        self.dim, self.value_dim = keys.shape[1], values.shape[1]
        self.calls = 0

    def candidates(self, queries: Tensor, k: int | str) -> Candidates:
        self.calls += 1
        if k == "all":
            return Candidates(ids=self.ids, keys=self.keys, values=self.values, mask=None)
        top = min(k, self.keys.shape[0])
        rows = (queries.detach() @ self.keys.T).topk(top, dim=-1).indices  # (batch, top)
        rows = F.pad(rows, (0, k - top), value=-1)  # (batch, k)
        mask = rows != -1
        safe = rows.clamp(min=0)
        return Candidates(
            ids=torch.where(mask, self.ids[safe], -1),
            keys=self.keys[safe] * mask.unsqueeze(-1),
            values=self.values[safe] * mask.unsqueeze(-1),
            mask=mask,
        )


@pytest.fixture
def db() -> FakeDB:
    return FakeDB(randn(6, 4, seed=120), randn(6, 3, seed=121))


def test_kvattention_forward_equals_attend_and_keeps_last_weights(db):
    layer = KVAttention(db, k=3, score="cosine", temperature=0.5)
    queries = randn(5, 4, seed=122)
    output = layer(queries)
    cand = db.candidates(queries, 3)
    expected, weights = attend(
        queries, cand.keys, cand.values, score="cosine", mask=cand.mask, temperature=0.5
    )  # the layer's own call, spelled out
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(layer.last_weights, weights)
    assert torch.equal(layer.last_ids, cand.ids) and layer.last_ids.min() >= 100
    assert not layer.last_weights.requires_grad


def test_kvattention_gradient_reaches_the_query(db):
    queries = randn(2, 4, seed=123).requires_grad_()
    KVAttention(db, k=4)(queries).sum().backward()
    assert queries.grad is not None and torch.isfinite(queries.grad).all() and queries.grad.abs().sum() > 0


def test_kvattention_additive_parameters_train(db):
    db = FakeDB(db.keys.float(), db.values.float())
    layer = KVAttention(db, k=4, score="additive")
    assert isinstance(layer.score_fn, AdditiveScore) and layer.score_fn.hidden == 64
    params = list(layer.parameters())
    assert len(params) == 3
    layer(randn(3, 4, seed=124, dtype=torch.float32)).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_kvattention_k_all_and_k_beyond_the_database(db):
    queries = randn(3, 4, seed=125)
    layer_all = KVAttention(db, k="all")
    output = layer_all(queries)
    expected, weights = attend(queries, db.keys, db.values)
    torch.testing.assert_close(output, expected)
    assert layer_all.last_weights.shape == layer_all.last_ids.shape == (3, 6)
    layer_big = KVAttention(db, k=10)
    torch.testing.assert_close(layer_big(queries), expected)
    assert torch.all(layer_big.last_ids[:, 6:] == -1) and torch.all(layer_big.last_weights[:, 6:] == 0)


def test_kvattention_exact(db):
    queries = torch.stack([db.keys[2], db.keys[0], randn(4, seed=126)])
    layer = KVAttention(db, k=6, pooling="exact")
    output = layer(queries)
    assert torch.equal(output[:2], db.values[[2, 0]])
    assert torch.equal(output[2], torch.zeros(3, dtype=torch.float64))


def test_kvattention_dropout_only_in_training(db):
    queries = randn(64, 4, seed=127)
    layer = KVAttention(db, k=6, dropout=0.5)
    layer.eval()
    reference = KVAttention(db, k=6)(queries)
    torch.testing.assert_close(layer(queries), reference)
    eval_weights = layer.last_weights
    layer.train()
    torch.manual_seed(128)
    output = layer(queries)
    dropped = layer.last_weights == 0
    assert dropped.any() and not dropped.all()
    torch.testing.assert_close(layer.last_weights[~dropped], 2 * eval_weights[~dropped])
    assert not torch.allclose(output, reference)


def test_kvattention_checks_options_up_front(db):
    with pytest.raises(UnknownOptionError, match="got 'euclid'"):
        KVAttention(db, score="euclid")
    with pytest.raises(UnknownOptionError, match="got 'max'"):
        KVAttention(db, pooling="max")
    for k in (0, -1, "some", True, 2.0):
        with pytest.raises(InvalidArgumentError, match="k must be a positive integer or 'all', got"):
            KVAttention(db, k=k)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        KVAttention(db, temperature=0)
    with pytest.raises(InvalidArgumentError, match="candidates"):
        KVAttention(object())


def test_kvattention_checks_queries_before_the_database(db):
    layer = KVAttention(db)
    with pytest.raises(DimensionMismatchError, match=r"expected queries of shape \(batch, 4\), got \(2, 3\)"):
        layer(randn(2, 3, seed=129))
    bad = randn(2, 4, seed=130)
    bad[0, 0] = math.nan
    with pytest.raises(NonFiniteError):
        layer(bad)
    assert db.calls == 0
