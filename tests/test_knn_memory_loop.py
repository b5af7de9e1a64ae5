"""Issue 34, part 5: ``Database(None)`` as a kNN memory at tensor speed keeps every guarantee of a database.

- A growing memory with ``capacity=`` in a training loop (add rows, attend, backward) against a reference made of
  plain torch tensors (the newest ``capacity`` rows): after every step the live ids, ``candidates`` and the
  ``KVAttention`` output and gradient equal ``torch.topk`` and the same attention over the reference rows.
- Ids are never reused: not after eviction, not after a delete of the newest record, not after a write refused.
- A write refused (wrong dims, non-finite, one value too few) raises its typed error before anything is written,
  also when it would have evicted: no record dropped, no id consumed.
- Records with texts in the same memory (the slower path): their key texts, the texts that came with their own
  embedding (given flags, written for a run of new ids by one statement) and ``lookup`` / ``get`` follow eviction.
- A growing index does not time the half-precision path afresh at every doubling of its keys
  (:class:`~kvsearch.index.exact_path.PathChooser`): a class of twice the keys starts on the decided path.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvsearch import (
    Database,
    DimensionMismatchError,
    KeyNotFoundError,
    KVAttention,
    NonFiniteError,
)
from kvsearch.index.exact_path import ENV_VAR, RETRY_EVERY, TRIALS, PathChooser

DIM, K = 8, 4


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k scaled-dot softmax attention in plain torch over the reference rows: (b, dim) -> (b, value_dim)."""
    with torch.no_grad():
        idx = torch.topk(q @ keys.T, min(k, len(keys))).indices  # (b, k)
    cand_k, cand_v = keys[idx], values[idx]  # (b, k, dim), (b, k, value_dim)
    scores = (cand_k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])  # (b, k)
    return (torch.softmax(scores, dim=-1).unsqueeze(1) @ cand_v).squeeze(1)  # (b, value_dim)


@pytest.mark.parametrize("capacity", [None, 50])
def test_a_growing_memory_answers_as_torch_topk_over_the_newest_rows(capacity):
    g = torch.Generator().manual_seed(34)
    db = Database(None, dim=DIM, value_dim=DIM, score="dot", **({} if capacity is None else {"capacity": capacity}))
    layer = KVAttention(db, k=K)
    ref_ids: list[int] = []
    ref_k, ref_v = torch.empty(0, DIM), torch.empty(0, DIM)
    last = 0
    for step, grow in enumerate([3, 17, 1, 40, 64, 9, 30, 2, 55, 12]):
        new_k, new_v = torch.randn(grow, DIM, generator=g), torch.randn(grow, DIM, generator=g)
        ids = db.add(new_k, new_v)
        assert ids == list(range(last + 1, last + 1 + grow))  # fresh ids, in order, never reused
        last = ids[-1]
        ref_ids, ref_k, ref_v = ref_ids + ids, torch.cat([ref_k, new_k]), torch.cat([ref_v, new_v])
        if capacity is not None:  # the reference keeps the newest rows
            ref_ids, ref_k, ref_v = ref_ids[-capacity:], ref_k[-capacity:], ref_v[-capacity:]
        assert db.ids().tolist() == ref_ids and len(db) == len(ref_ids)

        q = torch.randn(5, DIM, generator=g)
        found = db.candidates(q, K)
        want = torch.topk(q @ ref_k.T, min(K, len(ref_ids))).indices  # (5, k) rows of the reference
        assert found.ids[:, : want.shape[1]].tolist() == [[ref_ids[i] for i in row] for row in want.tolist()]

        q_ours, q_ref = q.clone().requires_grad_(), q.clone().requires_grad_()
        out = layer(q_ours)
        ref = reference_attention(q_ref, ref_k, ref_v, K)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(q_ours.grad, q_ref.grad, rtol=1e-5, atol=1e-6)
        if step % 3 == 0:  # a stored record reads back exactly; a dropped one is gone
            rec = db.get(ref_ids[-1])
            assert torch.equal(rec.key_embedding, ref_k[-1]) and torch.equal(rec.value_embedding, ref_v[-1])
    if capacity is not None:
        with pytest.raises(KeyNotFoundError):
            db.get(1)


def test_ids_are_never_reused_after_eviction_delete_or_a_refused_write():
    g = torch.Generator().manual_seed(35)
    db = Database(None, dim=DIM, value_dim=DIM, capacity=10)
    seen: list[int] = []
    for _ in range(4):
        seen += db.add(torch.randn(7, DIM, generator=g), torch.randn(7, DIM, generator=g))
    db.delete(seen[-1])  # the newest: its id is not handed out again
    with pytest.raises(DimensionMismatchError):
        db.add(torch.randn(3, DIM + 1), torch.randn(3, DIM))
    again = db.add(torch.randn(2, DIM, generator=g), torch.randn(2, DIM, generator=g))
    assert again == [seen[-1] + 1, seen[-1] + 2]
    assert len(set(seen + again)) == len(seen) + len(again) and db.ids().tolist() == seen[-9:-1] + again


@pytest.mark.parametrize(
    "bad",
    [
        lambda g: (torch.randn(12, DIM + 1, generator=g), torch.randn(12, DIM, generator=g)),
        lambda g: (torch.full((12, DIM), float("nan")), torch.randn(12, DIM, generator=g)),
        lambda g: (torch.randn(12, DIM, generator=g), torch.randn(11, DIM, generator=g)),
    ],
    ids=["dims", "nan", "one value too few"],
)
def test_a_refused_write_to_a_full_memory_raises_before_anything_is_written(bad):
    g = torch.Generator().manual_seed(36)
    db = Database(None, dim=DIM, value_dim=DIM, capacity=20)
    db.add(torch.randn(20, DIM, generator=g), torch.randn(20, DIM, generator=g))
    q = torch.randn(3, DIM, generator=g)
    before_ids, before = db.ids().tolist(), db.candidates(q, K)
    with pytest.raises((DimensionMismatchError, NonFiniteError)):
        db.add(*bad(g))  # would have evicted 12 records
    assert db.ids().tolist() == before_ids  # nothing dropped
    after = db.candidates(q, K)
    assert torch.equal(after.ids, before.ids) and torch.equal(after.keys, before.keys)
    assert db.add(torch.randn(1, DIM, generator=g), torch.randn(1, DIM, generator=g)) == [21]  # no id consumed


def test_records_with_texts_follow_eviction_beside_records_of_embeddings():
    g = torch.Generator().manual_seed(37)
    db = Database(None, dim=DIM, value_dim=DIM, capacity=6)
    texts = db.add(["alpha", "beta", "gamma"], ["A", "B", "C"], key_embeddings=torch.randn(3, DIM, generator=g),
                   value_embeddings=torch.randn(3, DIM, generator=g))  # fmt: skip
    assert db.key_texts(texts) == ["alpha", "beta", "gamma"]
    assert db.key_texts(texts, encoded_only=True) == [None, None, None]  # every text came with its embedding
    assert db.lookup("beta") == "B"
    plain = db.add(torch.randn(4, DIM, generator=g), torch.randn(4, DIM, generator=g))  # evicts "alpha"
    assert db.ids().tolist() == texts[1:] + plain
    assert db.lookup("alpha", None) is None and db.lookup("gamma") == "C"
    with pytest.raises(KeyNotFoundError):
        db.get(texts[0])
    assert db.get(texts[2]).key == "gamma" and db.get(plain[0]).key is None
    db.add(torch.randn(2, DIM, generator=g), torch.randn(2, DIM, generator=g))  # evicts "beta" and "gamma"
    assert db.ids_of_keys(["beta", "gamma"]).tolist() == [-1, -1]
    assert db.key_texts(plain) == [None] * 4


def test_a_growing_index_does_not_time_the_half_path_again_at_every_doubling(monkeypatch):
    """A class of twice the keys of a decided class takes its path over; only the retries time the other path."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    chooser, cuda = PathChooser(), torch.device("cuda")  # CUDA: float16 is fast there (nothing runs on it)
    half_paths = 0
    rows = 1000
    for _ in range(6):  # the keys double 6 times, 2 * TRIALS + 3 calls each: the half path 2.5x float32's time
        for _ in range(2 * TRIALS + 3):
            path = chooser.choose(256, rows, cuda, faiss_ok=False)
            half_paths += path != "float32"
            chooser.record(256, rows, path, 2.5 if path != "float32" else 1.0)
        rows *= 2
    assert half_paths == TRIALS  # timed in the first class only (no retry within RETRY_EVERY calls)
    assert 6 * (2 * TRIALS + 3) < RETRY_EVERY
    # where the half path wins, the grown class starts on it too
    fast = PathChooser()
    picks = []
    for rows in (1000, 2000):
        for _ in range(2 * TRIALS + 1):
            path = fast.choose(256, rows, cuda, faiss_ok=False)
            picks.append(path)
            fast.record(256, rows, path, 0.3 if path != "float32" else 1.0)
    assert picks[2 * TRIALS :] == ["float16"] * (2 * TRIALS + 2)
