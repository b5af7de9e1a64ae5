"""torch.compile: a model holding KVAttention compiles; compiled == eager in outputs and gradients; the only graph
breaks are the call into the database (an explicit ``torch.compiler.disable``, applied lazily), the attention math
compiles.

CI runs the ``aot_eager`` backend (dynamo's graphs and AOT autograd, no C++ compile: about a second a model); the
inductor variant, which compiles C++ (tens of seconds on 2 cores), is marked slow.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvsearch import Database, KVAttention, NonFiniteError


class Model(nn.Module):
    """Linear -> KVAttention -> Linear, with torch code on both sides of the layer (a user's model)."""

    def __init__(self, db: Database, **options: object) -> None:
        super().__init__()
        self.up = nn.Linear(32, db.dim)
        self.memory = KVAttention(db, **options)
        self.down = nn.Linear(db.value_dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.memory(self.up(x)).relu())  # (batch, 5)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def db() -> Database:
    gen = torch.Generator().manual_seed(0)
    db = Database(None, dim=64, value_dim=32, device="cpu")
    db.add(torch.randn(300, 64, generator=gen), torch.randn(300, 32, generator=gen))
    return db


def forward_backward(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    net.zero_grad()
    out = net(x)  # (batch, 5)
    out.pow(2).sum().backward()
    return out.detach(), [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize(
    "options",
    [
        {"k": 16, "score": "scaled_dot", "pooling": "softmax"},
        {"k": "all", "score": "additive", "pooling": "hard"},
        {"k": 16, "score": "cosine", "pooling": "normalize", "temperature": 0.5},
    ],
    ids=["scaled_dot-softmax-16", "additive-hard-all", "cosine-normalize-16"],
)
def test_compiled_equals_eager(db, options):
    torch.manual_seed(0)
    net = Model(db, **options)
    compiled = torch.compile(net, backend="aot_eager")
    for seed in (1, 2):  # the second call runs the cached graphs
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
        ref, ref_grads = forward_backward(net, x)
        ref_ids, ref_weights = net.memory.last_ids, net.memory.last_weights
        out, grads = forward_backward(compiled, x)
        torch.testing.assert_close(out, ref)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r)
        assert torch.equal(net.memory.last_ids, ref_ids)  # the compiled forward keeps them too
        torch.testing.assert_close(net.memory.last_weights, ref_weights)


@pytest.mark.parametrize(
    "score,pooling,k",
    [("dot", "softmax", 16), ("cosine", "hard", "all"), ("gaussian", "exact", 16), ("additive", "average", "all")],
)
def test_graph_breaks_only_at_the_database_call(db, score, pooling, k):
    net = Model(db, k=k, score=score, pooling=pooling, dropout=0.1)
    explained = torch._dynamo.explain(net)(torch.randn(8, 32))
    assert explained.break_reasons, "the database call must break the graph"
    for reason in explained.break_reasons:
        # torch.compiler.disable, applied lazily (torch._disable_dynamo: dynamo is imported at the first call)
        assert "marked as skipped" in reason.reason or "torch.compiler.disable" in reason.reason
        assert "self._candidates(" in reason.user_stack[-1].line  # KVAttention.forward's call into the database
    ops = {getattr(op, "__name__", str(op)) for graph in explained.ops_per_graph for op in graph}
    assert "matmul" in ops  # the scores and the blend were traced into a graph, not run eagerly
    assert explained.graph_count == 3  # up to the layer, its attention, after it


def test_compiled_model_still_checks_the_queries_it_searches_with(db):
    net = torch.compile(Model(db, k=8), backend="aot_eager")
    net(torch.randn(4, 32))
    x = torch.randn(4, 32)
    x[1, 0] = float("nan")
    with pytest.raises(NonFiniteError):
        net(x)  # the database call runs eagerly, with its checks


def test_compiled_under_autocast_equals_eager(db):
    torch.manual_seed(0)
    net = Model(db, k=16)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = net(x)
        out = torch.compile(net, backend="aot_eager")(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


@pytest.mark.slow
def test_inductor_compiled_equals_eager(db):
    torch.manual_seed(0)
    net = Model(db, k=16, score="scaled_dot", pooling="softmax")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = forward_backward(net, x)
    out, grads = forward_backward(torch.compile(net), x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
