"""A ProductKeyMemory's slots as records (``memory.slots``): reads by id, edits, freezing under real optimizers,
metadata and the filter language, usage, which slots a batch reaches.

Each promise is checked against a reference computed here: keys from the sub-keys, outputs by brute force over every
slot in float64, hits as a count of the forwards' ids, filters against the metadata's own tensors, usage from the
reads observed, and frozen rows compared bitwise after optimizer steps.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from kvsearch import (
    DimensionMismatchError,
    InvalidArgumentError,
    KeyNotFoundError,
    NonFiniteError,
    ProductKeyMemory,
    UnknownOptionError,
)


def make(seed: int = 0, dtype: torch.dtype = torch.float64, **options) -> ProductKeyMemory:
    torch.manual_seed(seed)
    config = {"num_keys": 6, "heads": 2, "k": 3, "key_dim": 6, "value_dim": 5} | options
    return ProductKeyMemory(10, **config).to(dtype)


def inputs(seed: int, rows: int = 16, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(rows, 10, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------------------------- reads


def test_a_slot_is_read_by_id_and_its_keys_score_as_the_layer_scores():
    memory = make(0, query_norm=None)
    n = memory.num_keys
    ids = torch.tensor([0, 7, 35, 13])
    got = memory.slots.read(ids)
    sub = memory.subkeys.detach()
    for row, i in enumerate(ids.tolist()):
        for h in range(memory.heads):
            assert torch.equal(got.keys[row, h], torch.cat([sub[h, 0, i // n], sub[h, 1, i % n]]))
        assert torch.equal(got.values[row], memory.values[i])
    assert got.frozen.tolist() == [False] * 4 and got.hits.tolist() == [0] * 4 and got.written.tolist() == [-1] * 4
    x = inputs(1, 4)
    slot_ids, weights = memory.select(x)  # (4, heads, k)
    q = memory.query_map(x).view(4, memory.heads, memory.key_dim).detach()  # no norm: the queries as scored
    keys = memory.slots.keys(slot_ids)  # (4 * heads * k, heads, key_dim)
    per_head = keys.view(4, memory.heads, memory.k, memory.heads, memory.key_dim).diagonal(dim1=1, dim2=3)
    scores = torch.einsum("mhd,mkdh->mhk", q, per_head)  # each slot's score for the head that reached it
    torch.testing.assert_close(scores.softmax(-1), weights.detach(), rtol=1e-12, atol=1e-12)
    assert len(memory.slots) == 36 and "36 slots" in repr(memory.slots)
    assert memory.slots.read(5).ids.tolist() == [5] and memory.slots.read([]).values.shape == (0, 5)


@pytest.mark.parametrize(
    "ids,error",
    [
        (36, KeyNotFoundError),
        ([-1], KeyNotFoundError),
        (torch.tensor([[3, 40]]), KeyNotFoundError),
        (torch.tensor([1.0]), InvalidArgumentError),
        (torch.tensor([True]), InvalidArgumentError),
        (True, InvalidArgumentError),
        ("3", InvalidArgumentError),
        ([1, 2.0], InvalidArgumentError),
    ],
)
def test_bad_slot_ids_are_refused_with_a_typed_error(ids, error):
    memory = make(0)
    for call in (memory.slots.read, memory.slots.freeze, memory.slots.metadata):
        with pytest.raises(error):
            call(ids)
    assert memory.frozen_count == 0


def test_reached_gives_each_slot_once_with_its_summed_weight_and_counts_nothing():
    memory = make(2)
    x = inputs(3, 6)
    reached = memory.slots.reached(x)
    ids, weights = memory.select(x)
    expected: dict[int, list[float]] = {}
    for i, w in zip(ids.reshape(-1).tolist(), weights.reshape(-1).tolist()):
        expected.setdefault(i, []).append(w)
    assert reached.ids.tolist() == sorted(expected)
    assert reached.reads.tolist() == [len(expected[i]) for i in sorted(expected)]
    torch.testing.assert_close(
        reached.weights, torch.tensor([sum(expected[i]) for i in sorted(expected)], dtype=torch.float64)
    )
    assert float(reached.weights.sum()) == pytest.approx(6 * memory.heads)  # each input's heads: weights sum to 1
    assert int(memory.step) == 0 and int(memory.hits.sum()) == 0


# ---------------------------------------------------------------------------------------------- edits


def test_update_values_changes_what_the_edited_slots_give_and_nothing_else():
    memory = make(4, query_norm="layernorm").eval()  # no running statistics: the training forward changes no query
    x = inputs(5, 12)
    before = memory(x)
    target = memory.last_ids[0].reshape(-1).unique()  # the slots input 0 reaches
    new = torch.randn(len(target), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    memory.train()
    memory(inputs(7))  # a training forward: step 1
    memory.eval()
    memory.slots.update_values(target, new)
    after = memory(x)
    ids, weights = memory.last_ids, memory.last_weights  # (12, heads, k): the selection does not read the values
    ref = (weights.unsqueeze(-1) * memory.values.detach()[ids]).sum(dim=(1, 2))  # brute blend of the new values
    torch.testing.assert_close(after, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(memory.slots.read(target).values, new)
    untouched = ~torch.isin(ids.reshape(12, -1), target).any(dim=1)  # inputs that reach none of the edited slots
    assert untouched.sum() > 0 and torch.equal(after[untouched], before[untouched])
    assert not torch.equal(after[0], before[0])
    assert memory.slots.read(target).written.tolist() == [1] * len(target)


def test_bad_edits_are_refused_before_anything_is_written():
    memory = make(0)
    saved = memory.values.detach().clone()
    cases = [
        (([1, 1], torch.zeros(2, 5)), InvalidArgumentError, "distinct"),
        (([1, 2], torch.zeros(3, 5)), DimensionMismatchError, r"\(2, 5\)"),
        (([1, 2], torch.zeros(2, 4)), DimensionMismatchError, r"\(2, 5\)"),
        (([1, 2], torch.zeros(2, 5, dtype=torch.long)), InvalidArgumentError, "float"),
        (([1, 2], [[0.0] * 5] * 2), InvalidArgumentError, "float"),
        (([1, 2], torch.full((2, 5), float("inf"))), NonFiniteError, "values"),
        (([1, 99], torch.zeros(2, 5)), KeyNotFoundError, "99"),
    ]
    for (ids, values), error, says in cases:
        with pytest.raises(error, match=says):
            memory.slots.update_values(ids, values)
    assert torch.equal(memory.values, saved) and int((memory.written >= 0).sum()) == 0
    memory.slots.update_values(3, torch.ones(5))  # one id may take one row
    assert torch.equal(memory.values[3], torch.ones(5, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------- freezing


@pytest.mark.parametrize("sparse", [False, True])
def test_frozen_slots_get_no_gradient_and_the_others_theirs(sparse):
    free = make(8, num_keys=8, k=4)
    memory = ProductKeyMemory(**(free.config | {"sparse": sparse})).double()
    memory.load_state_dict(free.state_dict())
    x = inputs(9)
    grads = []
    for module in (free, memory):
        module(x).pow(2).sum().backward()
        grad = module.values.grad
        grads.append(grad.to_dense() if grad.is_sparse else grad)
    reached = free.last_ids.reshape(-1).unique()
    frozen = reached[::2]
    memory.zero_grad()
    memory.slots.freeze(frozen)
    assert memory.slots.frozen.tolist() == frozen.tolist() and memory.frozen_count == len(frozen)
    memory(x).pow(2).sum().backward()
    grad = memory.values.grad
    if sparse:
        assert not torch.isin(grad._indices()[0], frozen).any()  # dropped, not zeros: SparseAdam never sees them
        grad = grad.to_dense()
    assert grad[frozen].abs().sum() == 0 and grads[0][frozen].abs().sum() > 0
    rest = torch.ones(len(grad), dtype=torch.bool)
    rest[frozen] = False
    torch.testing.assert_close(grad[rest], grads[0][rest], rtol=1e-12, atol=1e-12)
    memory.slots.unfreeze(frozen)
    memory.zero_grad()
    memory(x).pow(2).sum().backward()
    grad = memory.values.grad
    torch.testing.assert_close(grad.to_dense() if sparse else grad, grads[0], rtol=1e-12, atol=1e-12)
    assert memory.frozen_count == 0


def train(memory: ProductKeyMemory, optimizers: list[torch.optim.Optimizer], seed: int, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        memory(torch.randn(32, 10, generator=gen)).pow(2).mean().backward()
        for opt in optimizers:
            opt.step()


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd-momentum-decay": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_frozen_values_stay_bitwise_equal_under_protect_whatever_the_optimizer(name):
    memory = make(10, dtype=torch.float32, num_keys=8, k=4)
    opt = OPTIMIZERS[name](memory.parameters())
    train(memory, [opt], seed=11)  # momentum and moments built up for many rows before the freeze
    frozen = memory.hits.nonzero().reshape(-1)[::3]  # trained slots
    memory.slots.freeze(frozen)
    handle = memory.slots.protect(opt)
    before, others = memory.values.detach().clone(), memory.values.detach().clone()
    train(memory, [opt], seed=12)
    assert torch.equal(memory.values[frozen], before[frozen])
    assert not torch.equal(memory.values, others)  # the others trained
    handle.remove()
    train(memory, [opt], seed=13, steps=1)
    moved = not torch.equal(memory.values[frozen], before[frozen])
    assert moved == (name != "sgd")  # without protect: momentum and weight decay move them, plain SGD does not
    memory.slots.unfreeze(frozen)
    handle = memory.slots.protect(opt)  # protecting nothing frozen now
    again = memory.values.detach().clone()
    train(memory, [opt], seed=14, steps=1)
    assert not torch.equal(memory.values[frozen], again[frozen])  # unfrozen: they train again
    handle.remove()


def test_a_sparse_memory_under_sparse_adam_leaves_frozen_rows_alone_without_protect():
    memory = make(15, dtype=torch.float32, num_keys=8, k=4, sparse=True)
    others = [p for name, p in memory.named_parameters() if name != "values"]
    optimizers = [torch.optim.SparseAdam([memory.values], lr=0.01), torch.optim.Adam(others, lr=0.01)]
    train(memory, optimizers, seed=16)
    frozen = memory.hits.nonzero().reshape(-1)[::2]
    memory.slots.freeze(frozen)
    before = memory.values.detach().clone()
    train(memory, optimizers, seed=17)
    assert torch.equal(memory.values[frozen], before[frozen])
    assert not torch.equal(memory.values, before)


def test_protect_refuses_an_optimizer_without_the_values():
    memory = make(0)
    with pytest.raises(InvalidArgumentError, match="values"):
        memory.slots.protect(torch.optim.SGD(memory.query_map.parameters(), lr=0.1))


# ---------------------------------------------------------------------------------------------- metadata


def test_hits_written_and_step_count_the_training_forwards_only():
    memory = make(20, num_keys=8, k=4)
    counts = torch.zeros(64, dtype=torch.long)
    last = torch.full((64,), -1, dtype=torch.long)
    frozen = torch.tensor([1, 2, 3, 40, 41])
    memory.slots.freeze(frozen)
    for step in range(1, 5):
        memory(inputs(20 + step))
        ids = memory.last_ids.reshape(-1)
        counts += torch.bincount(ids, minlength=64)
        last[ids.unique()] = step
    memory.eval()
    memory(inputs(30))  # eval: counts nothing
    memory.train()
    with torch.no_grad():
        memory(inputs(31))  # no grad: counts nothing
    last[frozen] = -1  # a frozen slot's value was not written by training
    assert int(memory.step) == 4 and torch.equal(memory.hits, counts) and torch.equal(memory.written, last)
    meta = memory.slots.metadata([1, int(counts.argmax())])
    assert meta[0] == {"hits": int(counts[1]), "written": None, "frozen": True}
    assert meta[1] == {"hits": int(counts.max()), "written": int(last[counts.argmax()]), "frozen": False}


@pytest.mark.parametrize(
    "where,rule",
    [
        ({"hits": {"$gte": 3}}, lambda h, w, f, i: h >= 3),
        ({"hits": 0}, lambda h, w, f, i: h == 0),
        ({"written": None}, lambda h, w, f, i: w < 0),
        ({"written": {"$gte": 3}}, lambda h, w, f, i: w >= 3),
        ({"frozen": True}, lambda h, w, f, i: f),
        ({"frozen": False, "hits": {"$in": [1, 2]}}, lambda h, w, f, i: ~f & ((h == 1) | (h == 2))),
        ({"$or": [{"$id": {"$lt": 10}}, {"written": {"$gt": 3}}]}, lambda h, w, f, i: (i < 10) | (w > 3)),
        ({"$not": {"$id": {"$in": [0, 5, 63]}}}, lambda h, w, f, i: ~torch.isin(i, torch.tensor([0, 5, 63]))),
        ({"$key": None, "missing": {"$exists": False}}, lambda h, w, f, i: torch.ones_like(f)),
        ({"missing": 1}, lambda h, w, f, i: torch.zeros_like(f)),
    ],
)
def test_where_selects_the_slots_whose_metadata_satisfies_the_filter(where, rule):
    memory = make(21, num_keys=8, k=4)
    memory.slots.freeze([0, 1, 2, 3, 50])
    for step in range(4):
        memory(inputs(40 + step))
    got = memory.slots.where(where)
    expected = rule(memory.hits, memory.written, memory.frozen, torch.arange(64)).nonzero().reshape(-1)
    assert got.tolist() == expected.tolist()
    assert 0 < len(memory.slots.where({"hits": {"$gt": 0}})) < 64  # the data is not trivial


def test_a_bad_filter_is_refused_with_the_filter_languages_errors():
    memory = make(0)
    with pytest.raises(UnknownOptionError):
        memory.slots.where({"hits": {"$bigger": 3}})
    with pytest.raises(InvalidArgumentError):
        memory.slots.where(["hits"])


# ---------------------------------------------------------------------------------------------- usage


def test_usage_over_a_stream_of_batches_is_the_fraction_used_and_the_kl_from_uniform():
    memory = make(22, num_keys=8, k=4).eval()
    assert memory.slots.usage().kl is None and memory.slots.usage().reads == 0
    with pytest.raises(InvalidArgumentError, match="no forward"):
        memory.slots.observe()
    summed = torch.zeros(64, dtype=torch.float64)
    for seed in range(3):
        memory(inputs(50 + seed, 5))
        memory.slots.observe()
        summed.index_add_(0, memory.last_ids.reshape(-1), memory.last_weights.reshape(-1))
    usage = memory.slots.usage()
    p = summed / summed.sum()
    expected_kl = sum(float(v) * math.log(float(v) * 64) for v in p if v > 0)
    assert usage.reads == 3 * 5 * 2 * 4 and usage.fraction == float((summed > 0).sum()) / 64
    assert usage.kl == pytest.approx(expected_kl, rel=1e-9) and 0 < usage.kl < math.log(64)
    memory.slots.reset_usage()
    assert memory.slots.usage().reads == 0 and memory.slots.usage().fraction == 0.0
    memory.slots.observe(torch.arange(64), torch.ones(64, dtype=torch.float64))  # every slot alike: uniform
    assert memory.slots.usage().fraction == 1.0 and memory.slots.usage().kl == pytest.approx(0.0, abs=1e-12)
    memory.slots.reset_usage()
    memory.slots.observe(torch.tensor([7, 7]), torch.tensor([0.5, 0.5]))  # one slot: the largest divergence
    assert memory.slots.usage().kl == pytest.approx(math.log(64)) and memory.slots.usage().fraction == 1 / 64
    with pytest.raises(DimensionMismatchError):
        memory.slots.observe(torch.tensor([1, 2]), torch.tensor([0.5]))
    with pytest.raises(InvalidArgumentError, match="both"):
        memory.slots.observe(torch.tensor([1, 2]))


def test_the_slots_state_travels_in_the_state_dict_and_usage_does_not():
    memory = make(23)
    memory(inputs(60))
    memory.slots.observe()
    memory.slots.freeze([4])
    other = make(24)
    other.load_state_dict(memory.state_dict())
    assert other.slots.frozen.tolist() == [4] and torch.equal(other.hits, memory.hits)
    assert "usage_weights" not in memory.state_dict() and other.slots.usage().reads == 0  # a measurement, not state
    assert isinstance(memory.slots.memory, nn.Module)
