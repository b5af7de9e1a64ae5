"""No host-device synchronisation in ``KVAttention`` forward + backward (and ``add``) where the tensors are on a GPU.

On a machine without a GPU (CI) the paths a GPU takes are run on the CPU inside :func:`kvsearch.nn.precision.sync_free`
(``host_reads`` is then False, as on a GPU), and every operation that would make the host wait for a CUDA device is
recorded (``tests/_host_syncs.py``: ``item`` / ``bool`` / ``int``, ``tolist``, ``numpy``, ``cpu``, ``nonzero``,
boolean indexing, ``unique``, copies across devices): none may run. With CUDA, the ``gpu`` tests run the same calls
on the device under ``torch.cuda.set_sync_debug_mode("error")``, which raises at the first synchronisation.
"""

from __future__ import annotations

import pytest
import torch
from _host_syncs import HostSyncs

from kvsearch import Database, KVAttention
from kvsearch.nn.precision import host_reads, sync_free

# (database score, layer score, pooling): the index metrics (ip, cosine over raw keys, l2) and the poolings
CONFIGS = [
    ("dot", "scaled_dot", "softmax"),
    ("cosine", "cosine", "softmax"),
    ("gaussian", "gaussian", "softmax"),
    ("dot", "dot", "hard"),
    ("dot", "scaled_dot", "normalize"),
    ("dot", "additive", "softmax"),
]


def _memory(score: str, device: torch.device, n: int = 600, capacity: int | None = None) -> Database:
    gen = torch.Generator().manual_seed(7)
    db = Database(None, dim=16, value_dim=8, score=score, device=device, capacity=capacity)
    db.add(torch.randn(n, 16, generator=gen).to(device), torch.randn(n, 8, generator=gen).to(device))
    return db


def test_the_recorder_sees_every_kind_of_read():
    """The recorder itself: each way of reading a tensor back is seen (a planted ``item()`` would be)."""
    x = torch.arange(6.0)
    reads = [
        lambda: x.sum().item(),
        lambda: bool(x.any()),
        lambda: int(x.argmax()),
        lambda: x.tolist(),
        lambda: x.numpy(),
        lambda: x.nonzero(),
        lambda: x[x > 2],
        lambda: torch.unique(x),
        lambda: x.cpu(),
        lambda: torch.equal(x, x),
    ]
    for read in reads:
        with HostSyncs() as syncs:
            read()
        assert syncs.found, read
    with HostSyncs() as syncs:
        (x * 2 + 1).topk(3).indices.sort()
    assert syncs.found == []


def test_sync_free_turns_host_reads_off():
    cpu = torch.device("cpu")
    assert host_reads(cpu)
    with sync_free():
        assert not host_reads(cpu)
    assert host_reads(cpu) and not host_reads(torch.device("meta"))


@pytest.mark.parametrize("batch", [4, 100])  # one product and one top-k (<= 64 queries); the scan (more)
@pytest.mark.parametrize(("db_score", "score", "pooling"), CONFIGS)
def test_kvattention_forward_backward_reads_nothing_back(db_score, score, pooling, batch):
    db = _memory(db_score, torch.device("cpu"))
    layer = KVAttention(db, k=12, score=score, pooling=pooling, dropout=0.1)
    queries = torch.randn(batch, 16, generator=torch.Generator().manual_seed(8)).requires_grad_()
    with sync_free():
        layer(queries).sum().backward()  # the first call derives the index's data: not a step
        with HostSyncs() as syncs:
            for _ in range(2):
                layer(queries).pow(2).sum().backward()
    assert syncs.found == []
    assert queries.grad is not None and torch.isfinite(queries.grad).all()


@pytest.mark.parametrize("batch", [4, 100])
@pytest.mark.parametrize("db_score", ["dot", "cosine", "gaussian"])
def test_the_sync_free_path_finds_what_the_cpu_path_finds(db_score, batch):
    """The GPU's form of the exact search (ties ordered by id among the best k + 8) and of the layer gives the CPU
    form's candidates, output and gradient."""
    db = _memory(db_score, torch.device("cpu"), n=3000)
    layer = KVAttention(db, k=16)
    queries = torch.randn(batch, 16, generator=torch.Generator().manual_seed(9)).requires_grad_()
    out = layer(queries)
    (grad,) = torch.autograd.grad(out.sum(), queries)
    ids = db.candidates(queries, 16).ids
    with sync_free():
        out_free = layer(queries)
        (grad_free,) = torch.autograd.grad(out_free.sum(), queries)
        ids_free = db.candidates(queries, 16).ids
    assert torch.equal(ids_free, ids)
    torch.testing.assert_close(out_free, out)
    torch.testing.assert_close(grad_free, grad)


@pytest.mark.xfail(
    strict=True,
    reason="add reads its keys and values back: check_finite (checks.py all_finite's item()) and the store's "
    "numpy copies (storage/store.py); the storage / writes side owns them (issue 34 item 6)",
)
@pytest.mark.parametrize("capacity", [None, 1000])
def test_add_and_the_layer_in_a_growing_memory_read_nothing_back(capacity):
    """A kNN memory's step (add rows, attend, backward) reads no embedding back to the host (integer ids kept on the
    host by design are not device reads)."""
    db = _memory("dot", torch.device("cpu"), capacity=capacity)
    layer = KVAttention(db, k=12)
    gen = torch.Generator().manual_seed(10)
    with sync_free():
        layer(torch.randn(8, 16, generator=gen).requires_grad_()).sum().backward()
        with HostSyncs() as syncs:
            for _ in range(3):
                db.add(torch.randn(300, 16, generator=gen), torch.randn(300, 8, generator=gen))
                layer(torch.randn(8, 16, generator=gen).requires_grad_()).sum().backward()
    assert syncs.on_floats == []


# ----------------------------------------------------------------------------- on a GPU


def _no_sync(step, calls: int = 3) -> None:
    """Run ``step`` once (warm-up: derived data, caches) and then ``calls`` times under the "error" sync mode."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(calls):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [4, 100])
@pytest.mark.parametrize(("db_score", "score", "pooling"), CONFIGS)
def test_kvattention_on_cuda_makes_no_host_sync(db_score, score, pooling, batch):
    device = torch.device("cuda")
    db = _memory(db_score, device, n=5000)
    layer = KVAttention(db, k=12, score=score, pooling=pooling).to(device)
    queries = torch.randn(batch, 16, device=device, requires_grad=True)
    _no_sync(lambda: layer(queries).sum().backward())
    found = db.candidates(queries, 12)
    assert found.ids.is_cuda and found.keys.is_cuda and found.values.is_cuda and found.mask.is_cuda
    assert queries.grad.is_cuda and torch.isfinite(queries.grad).all()


@pytest.mark.gpu
def test_kvattention_on_cuda_under_autocast_makes_no_host_sync():
    device = torch.device("cuda")
    db = _memory("dot", device, n=5000)
    layer = KVAttention(db, k=12)
    queries = torch.randn(64, 16, device=device, requires_grad=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            out = layer(queries)
        out.float().sum().backward()

    _no_sync(step)


@pytest.mark.gpu
@pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="add reads its keys and values back (check_finite, the store's numpy copies): the storage / writes side",
)
@pytest.mark.parametrize("capacity", [None, 2000])
def test_add_in_a_growing_memory_on_cuda_makes_no_host_sync(capacity):
    device = torch.device("cuda")
    db = _memory("dot", device, capacity=capacity)
    layer = KVAttention(db, k=12)

    def step() -> None:
        db.add(torch.randn(256, 16, device=device), torch.randn(256, 8, device=device))
        layer(torch.randn(32, 16, device=device, requires_grad=True)).sum().backward()

    _no_sync(step)
