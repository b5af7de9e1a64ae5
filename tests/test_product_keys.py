"""ProductKeyMemory: exact top-k over the n^2 product keys, gradients, bad input, and the torch conventions.

The reference is brute force in float64 over every slot's concatenated key (``cat(subkeys[h, 0, a], subkeys[h, 1,
b])`` for slot ``a * n + b``), written here from the parameters alone; gradients are checked by
``torch.autograd.gradcheck`` in float64; the conventions (state_dict, deepcopy, torch.save, autocast, torch.compile,
DDP) against the same module run plainly. The slots as records are ``tests/test_product_slots.py``'s.
"""

from __future__ import annotations

import copy
import io
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from kvsearch import (
    DimensionMismatchError,
    InvalidArgumentError,
    MemoryLimitError,
    NonFiniteError,
    ProductKeyMemory,
    UnknownOptionError,
    memory_param_groups,
)
from kvsearch.nn.product_keys import product_topk

sys.path.insert(0, str(Path(__file__).parent))
import _pkm_ddp_ranks as ranks  # noqa: E402
from _distributed_ranks import join_ranks, start_ranks  # noqa: E402


def make(seed: int = 0, dtype: torch.dtype = torch.float64, **options) -> ProductKeyMemory:
    """A small memory drawn with ``seed`` (defaults: dim 10, n 6, heads 2, k 3, key_dim 6, value_dim 5)."""
    torch.manual_seed(seed)
    config = {"num_keys": 6, "heads": 2, "k": 3, "key_dim": 6, "value_dim": 5} | options
    return ProductKeyMemory(config.pop("dim", 10), **config).to(dtype)


def all_keys(memory: ProductKeyMemory) -> torch.Tensor:
    """Every slot's key per head, from the sub-keys alone: (heads, n^2, key_dim)."""
    n = memory.num_keys
    slot = torch.arange(n * n)
    sub = memory.subkeys.detach()  # (heads, 2, n, key_dim / 2)
    return torch.cat([sub[:, 0, slot // n], sub[:, 1, slot % n]], dim=-1)  # (heads, n^2, key_dim)


def brute(memory: ProductKeyMemory, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (m, heads, k), weights (m, heads, k) and output (m, value_dim) by scoring every slot."""
    with torch.no_grad():
        q = memory.query_map(x)  # (m, heads * key_dim)
        if isinstance(memory.norm, nn.LayerNorm):  # each half of each head's query
            q = memory.norm(q.view(len(x), memory.heads, 2, memory.key_dim // 2))
        else:
            q = memory.norm(q)
        q = q.reshape(len(x), memory.heads, memory.key_dim)  # (m, heads, key_dim)
        scores = torch.einsum("mhd,hsd->mhs", q, all_keys(memory))  # (m, heads, n^2)
        top, ids = scores.topk(memory.k, dim=-1)  # (m, heads, k)
        weights = top.softmax(-1)  # (m, heads, k)
        out = (weights.unsqueeze(-1) * memory.values.detach()[ids]).sum(dim=(1, 2))  # (m, value_dim)
    return ids, weights, out


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("n,k,heads", [(4, 1, 1), (5, 3, 2), (8, 8, 3), (16, 4, 4), (9, 5, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_product_topk_equals_brute_force_over_every_concatenated_key(n, k, heads, seed):
    gen = torch.Generator().manual_seed(seed)
    key_dim = 6
    queries = torch.randn(7, heads, key_dim, generator=gen, dtype=torch.float64)  # (m, heads, key_dim)
    subkeys = torch.randn(heads, 2, n, key_dim // 2, generator=gen, dtype=torch.float64)
    scores, ids = product_topk(queries, subkeys, k)  # (m, heads, k)
    slot = torch.arange(n * n)
    keys = torch.cat([subkeys[:, 0, slot // n], subkeys[:, 1, slot % n]], dim=-1)  # (heads, n^2, key_dim)
    ref_scores, ref_ids = torch.einsum("mhd,hsd->mhs", queries, keys).topk(k, dim=-1)  # (m, heads, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("query_norm", [None, "layernorm", "batchnorm"])
@pytest.mark.parametrize("n,k,heads", [(4, 2, 1), (6, 3, 2), (10, 10, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_layer_reads_the_brute_force_top_k_and_blend(query_norm, n, k, heads, seed):
    memory = make(seed, num_keys=n, k=k, heads=heads, query_norm=query_norm).eval()
    if query_norm == "batchnorm":  # running statistics that are not the identity
        memory.norm.running_mean.uniform_(-0.5, 0.5)
        memory.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(4, 3, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 10))
    out = memory(x)  # (4, 3, value_dim)
    ids, weights, ref = brute(memory, x.reshape(12, 10))
    assert out.shape == (4, 3, 5) and out.dtype == torch.float64
    assert torch.equal(memory.last_ids.reshape(12, heads, k), ids)
    torch.testing.assert_close(memory.last_weights.reshape(12, heads, k), weights, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.reshape(12, 5), ref, rtol=1e-10, atol=1e-12)
    assert not memory.last_ids.requires_grad and not memory.last_weights.requires_grad


def test_shapes_one_input_and_an_empty_batch():
    memory = make(0, query_norm="layernorm")
    assert memory(torch.randn(10, dtype=torch.float64)).shape == (5,)
    assert memory.last_ids.shape == (2, 3)
    empty = memory(torch.randn(0, 4, 10, dtype=torch.float64))
    assert empty.shape == (0, 4, 5) and memory.last_ids.shape == (0, 4, 2, 3)
    assert int(memory.step) == 2 and int(memory.hits.sum()) == 6  # training forwards; the empty one reached none


# ---------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("query_norm", [None, "layernorm", "batchnorm"])
def test_gradcheck_to_the_inputs_the_query_map_the_subkeys_and_the_values(query_norm):
    memory = make(3, dim=6, num_keys=4, heads=2, k=2, key_dim=4, value_dim=3, query_norm=query_norm)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    names = ("query_map.weight", "subkeys", "values")
    params = [dict(memory.named_parameters())[name].detach().clone().requires_grad_() for name in names]

    def read(x, *tensors):
        return functional_call(memory, dict(zip(names, tensors)), (x,))  # (3, value_dim)

    fast = query_norm is not None  # the norms are torch's own: a random projection of their Jacobian is enough
    assert torch.autograd.gradcheck(read, (x, *params), eps=1e-6, atol=1e-7, fast_mode=fast)


def test_sparse_gradients_equal_the_dense_ones():
    dense = make(5, num_keys=8, k=4)
    sparse = ProductKeyMemory(**(dense.config | {"sparse": True})).double()
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    grads = []
    for memory in (dense, sparse):
        xi = x.clone().requires_grad_()
        (memory(xi) * torch.linspace(-1, 1, 5, dtype=torch.float64)).sum().backward()
        grads.append((xi.grad, memory.subkeys.grad, memory.query_map.weight.grad, memory.values.grad))
    assert grads[1][3].is_sparse and not grads[0][3].is_sparse
    for a, b in zip(grads[0][:3], grads[1][:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1][3].to_dense(), grads[0][3], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "options,error,says",
    [
        ({"num_keys": 4, "k": 5}, InvalidArgumentError, "k <= num_keys"),
        ({"num_keys": 0}, InvalidArgumentError, "num_keys"),
        ({"num_keys": 4.0}, InvalidArgumentError, "num_keys"),
        ({"num_keys": 4, "k": 0}, InvalidArgumentError, "k as"),
        ({"num_keys": 4, "k": 2, "heads": 0}, InvalidArgumentError, "heads"),
        ({"num_keys": 4, "k": 2, "key_dim": 7}, InvalidArgumentError, "even key_dim"),
        ({"num_keys": 4, "k": 2, "value_dim": -1}, InvalidArgumentError, "value_dim"),
        ({"num_keys": 4, "k": 2, "query_norm": "rmsnorm"}, UnknownOptionError, "query_norm"),
        ({"num_keys": 4, "k": 2, "sparse": 1}, InvalidArgumentError, "sparse"),
        ({"num_keys": 3_000_000}, InvalidArgumentError, "num_keys"),
    ],
)
def test_bad_options_are_refused_with_a_typed_error(options, error, says):
    with pytest.raises(error, match=says):
        ProductKeyMemory(8, **options)


def test_a_memory_too_large_for_the_budget_is_refused_before_it_is_made(monkeypatch):
    monkeypatch.setenv("KVSEARCH_MEMORY_LIMIT", str(2**20))
    with pytest.raises(MemoryLimitError, match="ProductKeyMemory"):
        ProductKeyMemory(64, num_keys=256, k=4)


def test_bad_inputs_are_refused_with_a_typed_error():
    memory = make(0)
    cases = [
        (torch.randn(3, 9, dtype=torch.float64), DimensionMismatchError, r"\(\.\.\., 10\)"),
        (torch.tensor(1.0, dtype=torch.float64), DimensionMismatchError, "got ()"),
        (torch.ones(3, 10, dtype=torch.long), InvalidArgumentError, "floating-point"),
        ([[0.0] * 10], InvalidArgumentError, "floating-point"),
        (torch.randn(3, 10), InvalidArgumentError, "memory's dtype torch.float64"),
        (torch.randn(3, 10, dtype=torch.float64).to_sparse(), InvalidArgumentError, "to_dense"),
        (torch.full((3, 10), float("nan"), dtype=torch.float64), NonFiniteError, "inputs"),
    ]
    for x, error, says in cases:
        with pytest.raises(error, match=says):
            memory(x)
    with pytest.raises(InvalidArgumentError, match="more than one input"):
        make(0, query_norm="batchnorm")(torch.randn(1, 10, dtype=torch.float64))
    assert int(memory.step) == 0 and memory.last_ids is None  # nothing ran, nothing counted


def test_param_groups_put_the_values_apart():
    model = nn.Sequential(nn.Linear(4, 10), make(0, dtype=torch.float32), nn.Linear(5, 2))
    groups = memory_param_groups(model, lr=1e-3, value_lr=1e-2)
    assert [g["lr"] for g in groups] == [1e-3, 1e-2]
    assert groups[1]["params"] == [model[1].values] and groups[1]["weight_decay"] == 0.0
    assert len(groups[0]["params"]) == len(list(model.parameters())) - 1
    assert all(p is not model[1].values for p in groups[0]["params"])
    opt = torch.optim.AdamW(groups)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()  # the groups are what an optimizer takes
    assert model[1].param_groups(0.1, 0.2)[1]["lr"] == 0.2
    with pytest.raises(InvalidArgumentError, match="value_lr"):
        memory_param_groups(model, lr=1e-3, value_lr=float("nan"))


# ---------------------------------------------------------------------------------------------- conventions


def trained(seed: int = 0, **options) -> ProductKeyMemory:
    """A float32 memory after two SGD steps, with slots frozen and edited: every kind of state set."""
    memory = make(seed, dtype=torch.float32, num_keys=8, k=4, **options)
    opt = torch.optim.SGD(memory.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(2):
        opt.zero_grad()
        memory(torch.randn(16, 10, generator=gen)).pow(2).sum().backward()
        opt.step()
    memory.slots.freeze([3, 17, 40])
    memory.slots.update_values([5, 6], torch.ones(2, 5))
    return memory


def behaviour(memory: ProductKeyMemory) -> dict[str, torch.Tensor]:
    """What a memory does on fixed inputs: output in eval mode, then the gradient of one training step."""
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(99))
    memory.eval()
    out = memory(x).detach()
    memory.train()
    memory.zero_grad()
    memory(x).pow(2).sum().backward()
    return {"out": out, "grad": memory.values.grad.clone(), "ids": memory.last_ids}


def same_state(a: ProductKeyMemory, b: ProductKeyMemory) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert a.frozen_count == b.frozen_count == 3


def test_a_state_dict_round_trip_gives_a_memory_that_behaves_identically():
    memory = trained(0)
    state = memory.state_dict()
    assert {"frozen", "hits", "written", "step", "values", "subkeys"} <= set(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    other = ProductKeyMemory(**memory.config)  # drawn anew: different parameters, nothing frozen
    other.load_state_dict(torch.load(buffer, weights_only=True))
    same_state(memory, other)
    a, b = behaviour(memory), behaviour(other)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert b["grad"][[3, 17, 40]].abs().sum() == 0  # the loaded frozen set takes effect


def test_deepcopy_and_torch_save_of_the_module_behave_identically():
    memory = trained(1)
    buffer = io.BytesIO()
    torch.save(memory, buffer)
    buffer.seek(0)
    copies = [copy.deepcopy(memory), torch.load(buffer, weights_only=False)]
    for other in copies:
        same_state(memory, other)
    done = behaviour(memory)
    for other in copies:
        assert all(torch.equal(done[key], value) for key, value in behaviour(other).items())
        same_state(memory, other)  # the same bookkeeping after the same training forward
        other.slots.update_values([0], torch.zeros(1, 5))  # the copy is its own
        assert not torch.equal(other.values[0], memory.values[0])


def test_autocast_bf16_on_the_cpu_scores_in_float32_and_outputs_bf16():
    memory = make(2, dtype=torch.float32, num_keys=8, k=4, query_norm="layernorm").eval()
    x = torch.randn(12, 10, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = memory(x)
    assert out.dtype == torch.bfloat16 and memory.last_weights.dtype == torch.float32
    with torch.no_grad():  # the reference: the query map in bf16 (autocast's linear), everything after in float32
        q = F.linear(x.bfloat16(), memory.query_map.weight.bfloat16()).float()  # (12, heads * key_dim)
        q = memory.norm(q.view(12, 2, 2, 3)).view(12, 2, 6)  # each half normalised: (12, heads, key_dim)
        scores, ids = product_topk(q, memory.subkeys, 4)  # (12, heads, k)
        weights = scores.softmax(-1)
        ref = (weights.unsqueeze(-1) * memory.values[ids]).sum(dim=(1, 2))  # (12, value_dim)
    assert torch.equal(memory.last_ids, ids)
    torch.testing.assert_close(memory.last_weights, weights)
    torch.testing.assert_close(out, ref.bfloat16())
    low = x.bfloat16().requires_grad_()
    memory.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        memory(low).float().sum().backward()
    assert low.grad.dtype == torch.bfloat16 and memory.values.grad.dtype == torch.float32


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def forward_backward_both(x: torch.Tensor, *pairs: tuple) -> None:
    """For each (module, memory): zero the memory's grads, run x through the module and back (sum of squares);
    the outputs must agree."""
    outs = []
    for module, memory in pairs:
        memory.zero_grad()
        out = module(x)
        out.pow(2).sum().backward()
        outs.append(out.detach())
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize(
    "query_norm,backend",
    [
        ("layernorm", "aot_eager"),
        ("batchnorm", "aot_eager"),
        pytest.param("layernorm", "inductor", marks=pytest.mark.slow),  # compiles C++ (tens of seconds cold)
    ],
)
def test_torch_compile_fullgraph_matches_eager_with_frozen_slots(fresh_dynamo, query_norm, backend):
    eager = trained(3, query_norm=query_norm)
    compiled_memory = copy.deepcopy(eager)
    compiled = torch.compile(compiled_memory, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(4)
    for _ in range(2):  # training forwards: the buffers' bookkeeping compiles too
        x = torch.randn(16, 10, generator=gen)
        forward_backward_both(x, (eager, eager), (compiled, compiled_memory))
        torch.testing.assert_close(eager.values.grad, compiled_memory.values.grad)
        torch.testing.assert_close(eager.subkeys.grad, compiled_memory.subkeys.grad)
    assert compiled_memory.values.grad[[3, 17, 40]].abs().sum() == 0
    for name in ("hits", "written", "step"):
        assert torch.equal(getattr(eager, name), getattr(compiled_memory, name)), name
    assert torch.equal(eager.last_ids, compiled_memory.last_ids)
    explained = torch._dynamo.explain(compiled_memory)(torch.randn(4, 3, 10))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_torch_compile_of_a_sparse_memory_breaks_once_at_the_read_and_matches_eager(fresh_dynamo):
    eager = trained(5, sparse=True)
    compiled_memory = copy.deepcopy(eager)
    compiled = torch.compile(compiled_memory, backend="aot_eager")
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(6))
    forward_backward_both(x, (eager, eager), (compiled, compiled_memory))
    assert compiled_memory.values.grad.is_sparse
    torch.testing.assert_close(eager.values.grad.to_dense(), compiled_memory.values.grad.to_dense())
    torch.testing.assert_close(eager.subkeys.grad, compiled_memory.subkeys.grad)
    assert torch._dynamo.explain(compiled_memory)(x).graph_break_count == 1  # the read of the values


# ---------------------------------------------------------------------------------------------- DDP


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pkm-ddp")
    procs = start_ranks(ranks.WORLD, root, ranks.SCENARIO)
    try:
        ref = ranks.reference()  # while the ranks run
    finally:
        codes, results = join_ranks(procs, root, ranks.SCENARIO, ranks.DEADLINE_S)
    crashes = [f"rank {r}: {res.get('crash', '(no result)')}" for r, res in enumerate(results) if "seconds" not in res]
    assert codes == [0] * ranks.WORLD and not crashes, f"exit codes {codes}:\n" + "\n".join(crashes)
    return results, ref


def test_ddp_on_two_gloo_ranks_trains_as_one_process_averaging_the_ranks_losses(ddp_run):
    results, (start, ref_steps) = ddp_run
    own = [res["own"] for res in results]
    assert not torch.equal(own[0], own[1])  # each rank drew its own weights: DDP broadcast rank 0's
    assert all(torch.equal(w, start) for res in results for w in res["start"])
    before = start
    for step in range(ranks.STEPS):
        seen = [w for res in results for w in res["steps"][step]]
        assert all(torch.equal(w, seen[0]) for w in seen), f"step {step}: the ranks' weights differ"
        assert (seen[0] - before).abs().max() > 1e-4, f"step {step} changed nothing"
        torch.testing.assert_close(seen[0], ref_steps[step], atol=1e-5, rtol=1e-5)
        before = seen[0]
    for res in results:  # the frozen slots' values never moved, on either rank
        assert torch.equal(res["frozen_values"], res["frozen_values_before"])
    assert results[0]["losses"] != results[1]["losses"]
