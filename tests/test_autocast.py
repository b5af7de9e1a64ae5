"""Mixed precision: KVAttention, attend, Database.query / candidates and streaming attention under torch.autocast.

The rule (as fused SDPA): scores, pooling and the blend run in float32 inside; the output comes out in the autocast
dtype, the weights in float32; gradients reach low-precision queries in their dtype. Checked against the same math
in float32 (the reference), on CPU bfloat16 here and on CUDA float16 / bfloat16 where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvsearch import Database, KVAttention, attend
from kvsearch.nn.streaming import streaming_attention

BF16 = torch.bfloat16
POOLINGS = ["softmax", "normalize", "nonnegative", "hard", "exact", "average"]
SCORES = ["dot", "scaled_dot", "cosine", "gaussian", "additive"]


def memory(n: int = 200, dim: int = 64, value_dim: int = 32, device: str = "cpu", seed: int = 0) -> Database:
    """An in-memory database of random keys and values; keys rounded to bfloat16 so that bf16 queries can equal them."""
    gen = torch.Generator().manual_seed(seed)
    db = Database(None, dim=dim, value_dim=value_dim, device=device)
    keys = torch.randn(n, dim, generator=gen).to(BF16).float()  # (n, dim)
    db.add(keys, torch.randn(n, value_dim, generator=gen))
    return db


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against ``b`` in norm."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def model(db: Database, k: int | str, score: str, pooling: str, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), KVAttention(db, k=k, score=score, pooling=pooling), nn.Linear(32, 5))


def run(net: nn.Module, x: torch.Tensor, amp: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward under autocast (or not), backward outside it; the output and the parameters' gradients (zeros where
    none flows: exact pooling's weights are constant)."""
    net.zero_grad()
    with torch.autocast("cpu", dtype=BF16, enabled=amp):
        out = net(x)  # (batch, 5)
    out.float().pow(2).sum().backward()
    return out, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in net.parameters()]


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("k", [16, "all"])
@pytest.mark.parametrize("score", SCORES)
def test_model_under_bf16_autocast_matches_float32(score, k):
    db = memory()
    net = model(db, k, score, "softmax")
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = run(net, x, amp=False)
    out, grads = run(net, x, amp=True)
    assert ref.dtype == torch.float32 and out.dtype == BF16  # the last Linear under autocast gives bf16
    assert net[1].last_weights.dtype == torch.float32
    assert rel(out, ref) < 3e-2
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()  # parameters stay float32
        assert rel(g, r) < 5e-2


@pytest.mark.parametrize("pooling", POOLINGS)
def test_model_under_autocast_runs_with_every_pooling(pooling):
    db = memory()
    score = "dot" if pooling in ("normalize", "nonnegative") else "gaussian"
    for k in (16, "all"):
        net = model(db, k, score, pooling)
        out, grads = run(net, torch.randn(8, 32), amp=True)
        assert out.dtype == BF16 and torch.isfinite(out).all()
        assert all(torch.isfinite(g).all() for g in grads)


# ----------------------------------------------------------------------------- the layer: the rule, exactly


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("score", SCORES)
def test_layer_computes_in_float32_and_returns_autocast_dtype(score, pooling):
    if score == "gaussian" and pooling in ("normalize", "nonnegative"):
        pytest.skip("refused pairing (all weights 0)")
    db = memory(n=100)
    stored = db.candidates(torch.zeros(1, 64), "all").keys[:3]  # (3, dim) stored keys, exact in bf16
    gen = torch.Generator().manual_seed(2)
    q = torch.cat([stored, torch.randn(3, 64, generator=gen)]).to(BF16)  # (6, dim): 3 found by exact pooling
    for k in (8, "all"):
        torch.manual_seed(0)
        layer = KVAttention(db, k=k, score=score, pooling=pooling)
        q32 = q.float().requires_grad_()  # the very values, in float32: the reference
        ref = layer(q32)  # (6, value_dim) float32
        ref_weights = layer.last_weights
        qb = q.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16):
            out = layer(qb)  # (6, value_dim)
        assert out.dtype == BF16 and layer.last_weights.dtype == torch.float32
        torch.testing.assert_close(out, ref.to(BF16))  # float32 inside: only the output is rounded
        torch.testing.assert_close(layer.last_weights, ref_weights)
        if pooling in ("exact", "average"):  # constant weights: no gradient reaches the queries
            assert not out.requires_grad
            continue
        grad = torch.randn(ref.shape, generator=gen)
        (ref_grad,) = torch.autograd.grad(ref, q32, grad)
        (grad_q,) = torch.autograd.grad(out, qb, grad.to(BF16))
        assert grad_q.dtype == BF16  # autograd casts the gradient back to the queries' dtype
        assert rel(grad_q, ref_grad) < 2e-2


# ----------------------------------------------------------------------------- the database


def test_candidates_under_autocast_search_exactly():
    db = memory(n=3000)
    q = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    plain = db.candidates(q, 16)
    with torch.autocast("cpu", dtype=BF16):
        amp = db.candidates(q, 16)
    assert torch.equal(amp.ids, plain.ids)  # the index scores in float32, not autocast's bf16
    assert torch.equal(amp.keys, plain.keys)


@pytest.mark.parametrize("k", [16, "all"])
@pytest.mark.parametrize("pooling", ["softmax", "hard"])
def test_query_with_tensor_queries_under_autocast(k, pooling):
    db = memory()
    q = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).to(BF16)
    ref = db.query(q.float(), k=k, pooling=pooling)
    with torch.autocast("cpu", dtype=BF16):
        ans = db.query(q, k=k, pooling=pooling)
    assert ans.output.dtype == BF16 and ans.weights.dtype == torch.float32
    assert torch.equal(ans.ids, ref.ids)
    torch.testing.assert_close(ans.output, ref.output.to(BF16))
    torch.testing.assert_close(ans.weights, ref.weights)


# ----------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "cosine", "gaussian"])
@pytest.mark.parametrize("backward_under_autocast", [False, True])
def test_streaming_under_autocast_matches_float32(score, backward_under_autocast):
    gen = torch.Generator().manual_seed(6)
    q, keys, values = torch.randn(6, 16, generator=gen), torch.randn(300, 16, generator=gen), torch.randn(300, 8)
    leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
    ref = streaming_attention(*leaves, score=score, chunk=64)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, grad)
    with torch.autocast("cpu", dtype=BF16):
        out = streaming_attention(*leaves, score=score, chunk=64)
        if backward_under_autocast:  # the backward's matmuls must not turn bf16 either
            grads = torch.autograd.grad(out, leaves, grad.to(BF16))
    if not backward_under_autocast:
        grads = torch.autograd.grad(out, leaves, grad.to(BF16))
    assert out.dtype == BF16
    torch.testing.assert_close(out, ref.to(BF16))
    for g, r in zip(grads, ref_grads):
        assert g.dtype == torch.float32
        assert rel(g, r) < 2e-2


def test_streaming_from_bf16_inputs_under_autocast():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(4, 16, generator=gen).to(BF16).requires_grad_()
    keys, values = torch.randn(100, 16, generator=gen).to(BF16), torch.randn(100, 8, generator=gen).to(BF16)
    ref = streaming_attention(q.float(), keys.float(), values.float(), chunk=32)
    with torch.autocast("cpu", dtype=BF16):
        out = streaming_attention(q, keys, values, chunk=32)
    out.float().sum().backward()
    assert out.dtype == BF16 and q.grad.dtype == BF16
    torch.testing.assert_close(out, ref.to(BF16))


# ----------------------------------------------------------------------------- CUDA


def cuda_inputs(seed: int = 8) -> tuple[Database, torch.Tensor]:
    db = memory(n=500, device="cuda", seed=seed)
    q = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed)).cuda()  # (16, dim)
    return db, q


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("score", ["dot", "scaled_dot", "cosine", "gaussian", "additive"])
def test_cuda_autocast_layer(dtype, score):
    db, q = cuda_inputs()
    torch.manual_seed(0)
    layer = KVAttention(db, k=16, score=score).cuda()
    q16 = q.to(dtype)  # the queries a low-precision model hands over
    q32 = q16.float().requires_grad_()
    ref = layer(q32)  # (16, value_dim) float32
    ref_weights = layer.last_weights
    grad = torch.randn_like(ref)
    ref.backward(grad)
    qa = q16.clone().requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        out = layer(qa)
    out.backward(grad.to(dtype))
    assert out.device.type == "cuda" and out.dtype == dtype and layer.last_weights.dtype == torch.float32
    torch.testing.assert_close(out, ref.to(dtype))
    torch.testing.assert_close(layer.last_weights, ref_weights, rtol=1e-4, atol=1e-5)
    assert qa.grad.dtype == dtype and torch.isfinite(qa.grad).all()
    assert rel(qa.grad, q32.grad) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_autocast_query_and_streaming(dtype):
    db, q = cuda_inputs()
    q16 = q.to(dtype)
    with torch.autocast("cuda", dtype=dtype):
        plain_ids = db.candidates(q, 16).ids
        ans = db.query(q16, k="all")  # streaming softmax over every record
        top = db.query(q16, k=16)
    assert torch.equal(plain_ids, db.candidates(q, 16).ids)  # the index searches outside autocast
    ref = db.query(q16.float(), k="all")
    assert ans.output.dtype == dtype and ans.weights.dtype == torch.float32
    torch.testing.assert_close(ans.output, ref.output.to(dtype))
    torch.testing.assert_close(ans.weights, ref.weights, rtol=1e-4, atol=1e-6)
    assert top.output.dtype == dtype and torch.equal(top.ids, db.query(q16.float(), k=16).ids)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["softmax", "normalize", "hard", "average"])
@pytest.mark.parametrize("k", [16, "all"])
def test_cuda_layer_forward_backward_against_cpu_float64(pooling, k):
    db, q = cuda_inputs(seed=9)
    layer = KVAttention(db, k=k, score="dot", pooling=pooling)
    qc = q.clone().requires_grad_()
    out = layer(qc)  # (16, value_dim) on CUDA, float32
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(10)).cuda()
    out.backward(grad)
    cand = db.candidates(q, k)  # the same candidates, moved to the CPU in float64 for the reference
    q64 = q.detach().cpu().double().requires_grad_()
    mask = None if cand.mask is None else cand.mask.cpu()
    ref, ref_weights = attend(
        q64, cand.keys.cpu().double(), cand.values.cpu().double(), score="dot", pooling=pooling, mask=mask
    )
    ref.backward(grad.cpu().double())
    assert out.device.type == "cuda" and qc.grad.device.type == "cuda"
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.last_weights.cpu().double(), ref_weights, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(qc.grad.cpu().double(), q64.grad, rtol=1e-3, atol=1e-4)
