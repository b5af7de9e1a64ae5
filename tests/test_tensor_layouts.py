"""Every tensor layout and device at every tensor argument: it works, or a typed error says what came.

The hostile sweep (``tests/test_hostile.py``) gives every argument hostile *values*; this file gives every tensor
argument the same numbers in every *layout* (a table built programmatically: :data:`LAYOUTS` x :data:`ARGUMENTS`):

- non-contiguous tensors (transposed, strided slices, expanded with stride 0) and numpy arrays of any strides
  (Fortran order, slices, reversed, broadcast) simply work, and answer exactly as their contiguous copy does;
- sparse (COO, CSR, CSC, BSR, BSC), nested (strided and jagged), quantized, complex and ``meta`` tensors, and
  complex or bool numpy arrays, are refused with :class:`~kvsearch.InvalidArgumentError` naming what came,
  before anything is written (the database is left exactly as it was);
- other dtypes (bool, int8, uint8, float16, bfloat16, float64) work or raise a :class:`~kvsearch.KVSearchError`.

The arguments: ``Database`` (add, upsert, search, query, lookup, ``in``, exact_targets, candidates, delete, the reads
by id, ``where(ids=)``, commit_generation), ``ShardedDatabase`` (one process, no process group), ``KVAttention``,
``attend`` (queries, keys, values, mask, valid_lens, match; shared and gathered candidates), ``finetune`` (tensor
pairs), the pure attention functions and the indexes. The case count is in the closing note of issue 25.
"""

from __future__ import annotations

import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
from torch import Tensor

import kvsearch
from kvsearch import InvalidArgumentError, KVAttention, KVSearchError
from kvsearch.distributed import ShardedDatabase

DIM = 8
VALUE_DIM = 4
KEYS = ["Zhang", "Lipton", "Li", "Smola", "Hu", "Werness"]
VALUES = ["Aston", "Zachary", "Mu", "Alex", "Rachel", "Brent"]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse CSR is beta, quantize deprecated

Expect = Literal["same", "refused", "either"]
Kind = Literal["float", "int", "bool"]


# ----------------------------------------------------------------------------- layouts


def doubled(x: Tensor) -> Tensor:
    """The same numbers in a buffer twice as large in every dimension: every stride doubled (a strided slice)."""
    buffer = torch.zeros(*(2 * n for n in x.shape), dtype=x.dtype)
    view = buffer[tuple(slice(None, None, 2) for _ in x.shape)]
    view.copy_(x)
    return view


def transposed(x: Tensor) -> Tensor:
    """The same numbers stored transposed (the last two dimensions swapped in memory; 2-D and more)."""
    return x.mT.contiguous().mT


def expanded(x: Tensor) -> Tensor:
    """The first row repeated with stride 0 (other numbers than ``x``: compared with its own contiguous copy)."""
    return x[:1].expand_as(x)


def nested(x: Tensor, layout: torch.layout) -> Tensor:
    """``x``'s rows as a nested tensor (one row for a 1-D ``x``)."""
    return torch.nested.nested_tensor(list(x) if x.dim() >= 2 else [x], layout=layout)


def quantized(x: Tensor) -> Tensor:
    """``x`` quantized to qint8 (float arguments only)."""
    return torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)


@dataclass(frozen=True)
class Layout:
    """One way of handing over an argument's numbers.

    Attributes:
        name: the test id.
        make: the argument's dense value -> the value in this layout.
        expect: ``"same"`` (works, and answers as the contiguous copy), ``"refused"`` (InvalidArgumentError naming
            ``word``), ``"either"`` (returns, or raises a KVSearchError).
        kinds: the argument kinds it applies to.
        numpy: it makes a numpy array (only for the arguments that take numpy).
        word: a word the refusal's message must hold.
        min_ndim: the fewest dimensions a value needs to have a form in this layout (2 for transposed and the
            compressed sparse layouts).
    """

    name: str
    make: Callable[[Tensor], object]
    expect: Expect
    kinds: tuple[Kind, ...] = ("float", "int", "bool")
    numpy: bool = False
    word: str = ""
    min_ndim: int = 1


LAYOUTS: list[Layout] = [
    Layout("transposed", transposed, "same", min_ndim=2),
    Layout("strided slice", doubled, "same"),
    Layout("expanded (stride 0)", expanded, "same"),
    Layout("sparse_coo", lambda x: x.to_sparse(), "refused", word="sparse_coo"),
    Layout("sparse_csr", lambda x: x.to_sparse_csr(), "refused", word="sparse_csr", min_ndim=2),
    Layout("sparse_csc", lambda x: x.to_sparse_csc(), "refused", word="sparse_csc", min_ndim=2),
    Layout("sparse_bsr", lambda x: x.to_sparse_bsr((1, 1)), "refused", word="sparse_bsr", min_ndim=2),
    Layout("sparse_bsc", lambda x: x.to_sparse_bsc((1, 1)), "refused", word="sparse_bsc", min_ndim=2),
    Layout("meta", lambda x: x.to("meta"), "refused", word="meta"),
    Layout("nested", lambda x: nested(x, torch.strided), "refused", word="nested"),
    Layout("nested jagged", lambda x: nested(x, torch.jagged), "refused", word="nested"),
    Layout("quantized", quantized, "refused", ("float",), word="quantized"),
    Layout("complex", lambda x: x.to(torch.complex64), "refused", ("float", "int"), word="complex"),
    *(
        Layout(str(dtype).removeprefix("torch."), lambda x, d=dtype: x.to(d), "either")
        for dtype in (torch.bool, torch.int8, torch.uint8, torch.int32, torch.float16, torch.bfloat16, torch.float64)
    ),
    Layout("numpy fortran order", lambda x: np.asfortranarray(x.numpy()), "same", numpy=True),
    Layout("numpy strided slice", lambda x: doubled(x).numpy(), "same", numpy=True),
    Layout("numpy reversed (negative stride)", lambda x: x.numpy()[::-1], "same", numpy=True),
    Layout("numpy broadcast (stride 0)", lambda x: np.broadcast_to(x.numpy()[:1], x.shape), "same", numpy=True),
    Layout("numpy complex", lambda x: x.numpy().astype(np.complex64), "refused", numpy=True, word="complex"),
    Layout("numpy bool", lambda x: x.numpy() > 0, "refused", ("float",), numpy=True, word="bool"),
    Layout("numpy float16", lambda x: half_numpy(x), "either", numpy=True),
]


def half_numpy(x: torch.Tensor) -> np.ndarray:
    """``x`` as a float16 numpy array (ids past 65,504 become inf, as float16 has them: no warning about it)."""
    with np.errstate(over="ignore"):
        return x.numpy().astype(np.float16)


# ----------------------------------------------------------------------------- targets


def text_db(_: Path) -> kvsearch.Database:
    """Six authors in an n-gram database in memory (text keys and values, their embeddings from the encoder)."""
    db = kvsearch.Database(None, encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=64))
    db.add(KEYS, VALUES, [{"n": i} for i in range(len(KEYS))])
    return db


def tensor_db(_: Path) -> kvsearch.Database:
    """Six records given as embeddings (no text, no encoder), in memory."""
    gen = torch.Generator().manual_seed(5)
    db = kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM)
    db.add(torch.randn(6, DIM, generator=gen), torch.randn(6, VALUE_DIM, generator=gen))
    return db


_SHARDED_TEMPLATES: dict[str, Path] = {}


def sharded_db(folder: Path) -> ShardedDatabase:
    """Six records given as embeddings in two shards (one process, no process group): a copy of one template."""
    if "template" not in _SHARDED_TEMPLATES or not _SHARDED_TEMPLATES["template"].exists():
        template = folder.parent / "sharded-template"
        gen = torch.Generator().manual_seed(5)
        with ShardedDatabase(template, num_shards=2, dim=DIM, value_dim=VALUE_DIM, device="cpu") as sdb:
            sdb.add(torch.randn(6, DIM, generator=gen), torch.randn(6, VALUE_DIM, generator=gen))
        _SHARDED_TEMPLATES["template"] = template
    shutil.copytree(_SHARDED_TEMPLATES["template"], folder)
    return ShardedDatabase(folder, device="cpu")


def no_target(_: Path) -> None:
    return None


def small_index(cls: type) -> Callable[[Path], Any]:
    def make(_: Path) -> Any:
        index = cls(DIM) if cls is kvsearch.TorchIndex else cls(DIM, "Flat")
        index.add(torch.arange(5), randn(5, DIM, seed=3))
        return index

    return make


def randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def stored_ids(db: Any) -> Tensor:
    """Two stored ids of ``db`` (the second and the fifth record), a dense int64 (2,)."""
    hits = db.search(torch.ones(DIM), k=len(db))
    ids = sorted(hit.id for hit in hits)
    return torch.tensor([ids[1], ids[4]])


def plain(x: object) -> object:
    """``x`` as nested lists, tuples and numbers, to compare two answers (tensors as lists, results by field)."""
    if isinstance(x, Tensor):
        return plain(x.detach().cpu().float().tolist() if x.dtype in (torch.bfloat16, torch.float16) else x.tolist())
    if isinstance(x, np.ndarray):
        return plain(x.tolist())
    if is_dataclass(x) and not isinstance(x, type):
        return tuple(plain(getattr(x, f.name)) for f in fields(x) if f.name != "seconds")
    if isinstance(x, dict):
        return tuple(sorted((str(key), plain(v)) for key, v in x.items()))
    if isinstance(x, (list, tuple)) or type(x).__name__ in ("LazyKeys", "LazyMetadata"):
        return tuple(plain(v) for v in x)
    return x


def state(db: Any) -> object:
    """What a refused write must leave alone: len, generation, and every record (ids, texts, embeddings); an
    index's ids and every query's scores."""
    if isinstance(db, (kvsearch.Index, kvsearch.TorchIndex)):
        return plain(db.ids()), plain(db.search(torch.eye(DIM), db.ntotal or 1))
    if len(db) == 0:
        return 0, db.generation
    hits = db.search(torch.ones(DIM), k=len(db))  # every record
    ids = torch.tensor(sorted(hit.id for hit in hits))
    keys, values, _ = db.embeddings(ids)
    texts = sorted((hit.id, hit.key, plain(hit.value), plain(hit.metadata)) for hit in hits)
    return len(db), db.generation, texts, plain(keys), plain(values)


def assert_same(got: object, want: object, where: str = "") -> None:
    """Equal answers, floats up to rounding (a transposed operand may take another BLAS path)."""
    if isinstance(want, float) and isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6) or (math.isnan(got) and math.isnan(want)), where
    elif isinstance(want, tuple) and isinstance(got, tuple):
        assert len(got) == len(want), f"{where}: {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# ----------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class Argument:
    """One tensor argument of one public callable.

    Attributes:
        name: ``callable.argument``, the test id.
        make: builds the target (a database, an index, or None) in the given folder.
        call: ``(target, value) -> result``, the other arguments valid.
        value: the argument's valid dense value (given the target, for stored ids).
        kind: float, int or bool: which layouts apply.
        numpy: whether the argument takes numpy arrays too.
        writes: a refusal must leave the target as it was; a success is compared by the target's state.
        ndim: the value's number of dimensions (0: 1 for ints, else 2), to pick the layouts that have a form for it.
    """

    name: str
    make: Callable[[Path], Any]
    call: Callable[[Any, object], object]
    value: Callable[[Any], Tensor]
    kind: Kind = "float"
    numpy: bool = False
    writes: bool = False
    ndim: int = 0

    @property
    def rank(self) -> int:
        """The value's number of dimensions."""
        return self.ndim or (1 if self.kind == "int" else 2)


def queries(n: int = 2, dim: int = DIM, seed: int = 2) -> Callable[[Any], Tensor]:
    return lambda _: randn(n, dim, seed=seed)


def query_row(db: Any) -> Tensor:
    """A stored key embedding (dim,), so that lookups and ``in`` find something."""
    keys, _, _ = db.embeddings(stored_ids(db)[:1])
    return keys[0].clone()


def stored_queries(db: Any) -> Tensor:
    keys, _, _ = db.embeddings(stored_ids(db))
    return keys.clone()


def database_arguments(name: str, make: Callable[[Path], Any], sharded: bool) -> list[Argument]:
    """The tensor arguments of a Database (or a ShardedDatabase: the methods it has)."""
    two_keys = queries(2, DIM, 7)

    def two_values(db: Any) -> Tensor:
        return randn(2, db.value_dim, seed=8)

    out = [
        Argument(f"{name}.add.keys", make, lambda db, v: db.add(v, two_values(db)), two_keys, numpy=True, writes=True),
        Argument(
            f"{name}.add.values", make, lambda db, v: db.add(two_keys(db), v), two_values, numpy=True, writes=True
        ),
        Argument(f"{name}.upsert.keys", make, lambda db, v: db.upsert(v, two_values(db)), two_keys, writes=True),
        Argument(f"{name}.search.queries", make, lambda db, v: db.search(v, k=3), queries(), numpy=True),
        Argument(f"{name}.query.queries", make, lambda db, v: db.query(v, k=3), queries(), numpy=True),
        Argument(f"{name}.lookup.key", make, lambda db, v: db.lookup(v, default=None), query_row, numpy=True, ndim=1),
        Argument(f"{name}.__contains__.key", make, lambda db, v: v in db, query_row, numpy=True, ndim=1),
        Argument(f"{name}.exact_targets.queries", make, lambda db, v: db.exact_targets(v), stored_queries),
        Argument(f"{name}.candidates.queries", make, lambda db, v: db.candidates(v, 3), queries()),
        Argument(
            f"{name}.candidates.targets",
            make,
            lambda db, v: db.candidates(randn(2, DIM, seed=2), 3, targets=v),
            stored_ids,
            "int",
        ),
        Argument(f"{name}.embeddings.ids", make, lambda db, v: db.embeddings(v), stored_ids, "int", numpy=True),
        Argument(f"{name}.key_texts.ids", make, lambda db, v: db.key_texts(v), stored_ids, "int", numpy=True),
        Argument(f"{name}.delete.ids", make, lambda db, v: db.delete(v), stored_ids, "int", numpy=True, writes=True),
    ]
    if sharded:
        return out
    return out + [
        Argument(
            f"{name}.add.key_embeddings",
            make,
            lambda db, v: db.add(["n1", "n2"], ["v1", "v2"], key_embeddings=v),
            two_keys,
            numpy=True,
            writes=True,
        ),
        Argument(
            f"{name}.upsert.value_embeddings",
            make,
            lambda db, v: db.upsert(["Li", "n2"], ["v1", "v2"], value_embeddings=v),
            two_values,
            numpy=True,
            writes=True,
        ),
        Argument(f"{name}.metadata_of.ids", make, lambda db, v: db.metadata_of(v), stored_ids, "int", numpy=True),
        Argument(f"{name}.values_of.ids", make, lambda db, v: db.values_of(v), stored_ids, "int"),
        Argument(f"{name}.where.ids", make, lambda db, v: db.where(ids=v).records(), stored_ids, "int", numpy=True),
        Argument(
            f"{name}.commit_generation.values[ids]",
            make,
            lambda db, v: db.commit_generation(values=(v, randn(2, db.value_dim, seed=9))),
            stored_ids,
            "int",
            writes=True,
        ),
        Argument(
            f"{name}.commit_generation.values[embeddings]",
            make,
            lambda db, v: db.commit_generation(values=(stored_ids(db), v)),
            lambda db: randn(2, db.value_dim, seed=9),
            writes=True,
        ),
    ]


def attention_arguments() -> list[Argument]:
    """``KVAttention``, ``attend`` (shared keys and gathered candidates) and the pure attention functions."""
    q, keys, values = queries(2, DIM, 2), queries(5, DIM, 3), queries(5, 3, 4)
    shared = {"queries": q, "keys": keys, "values": values}
    out = [
        Argument(f"KVAttention[k={k}].forward.queries", text_db, lambda db, v, k=k: KVAttention(db, k=k)(v), queries())
        for k in (3, "all")
    ]
    out.append(
        Argument(
            "KVAttention[exact].forward.queries",
            text_db,
            lambda db, v: KVAttention(db, k=3, pooling="exact")(v),
            stored_queries,
        )
    )
    for arg in shared:
        out.append(
            Argument(
                f"attend.{arg}",
                no_target,
                lambda _, v, a=arg: kvsearch.attend(**{**{n: f(None) for n, f in shared.items()}, a: v}),
                shared[arg],
            )
        )
    gathered = {  # queries (b, dim), keys (b, k, dim), values (b, k, value_dim)
        "queries": queries(2, 4, 2),
        "keys": lambda _: randn(2, 5, 4, seed=4),
        "values": lambda _: randn(2, 5, 3, seed=5),
    }
    for arg in gathered:
        out.append(
            Argument(
                f"attend[gathered].{arg}",
                no_target,
                lambda _, v, a=arg: kvsearch.attend(**{**{n: f(None) for n, f in gathered.items()}, a: v}),
                gathered[arg],
                ndim=2 if arg == "queries" else 3,
            )
        )
    mask = lambda _: torch.tensor([[True, False, True, True, False], [True, True, True, False, True]])  # noqa: E731
    out += [
        Argument(
            "attend.mask",
            no_target,
            lambda _, v: kvsearch.attend(q(None), keys(None), values(None), mask=v),
            mask,
            "bool",
        ),
        Argument(
            "attend.match",
            no_target,
            lambda _, v: kvsearch.attend(q(None), keys(None), values(None), pooling="exact", match=v),
            mask,
            "bool",
        ),
        Argument(
            "attend.valid_lens",
            no_target,
            lambda _, v: kvsearch.attend(q(None), keys(None), values(None), valid_lens=v),
            lambda _: torch.tensor([3, 5]),
            "int",
        ),
        Argument("compute_scores.queries", no_target, lambda _, v: kvsearch.compute_scores(v, keys(None), "cosine"), q),
        Argument("pool.scores", no_target, lambda _, v: kvsearch.pool(v), queries(2, 5, 6)),
        Argument(
            "streaming_attention.keys",
            no_target,
            lambda _, v: kvsearch.streaming_attention(q(None), v, values(None), chunk=2),
            keys,
        ),
        Argument("AdditiveScore.forward.keys", no_target, lambda _, v: _additive()(q(None), v), keys),
        Argument("GaussianKernel.forward.queries", no_target, lambda _, v: kvsearch.GaussianKernel()(v, keys(None)), q),
    ]
    return out


def _additive() -> kvsearch.AdditiveScore:
    torch.manual_seed(0)
    return kvsearch.AdditiveScore(DIM, DIM)


def finetune_arguments() -> list[Argument]:
    """``finetune`` and ``evaluate`` on (queries, values) tensor pairs."""
    options = dict(epochs=1, k=3, batch_size=2, loss="answer", train_values=True, verbose=False, seed=0)
    q, v = queries(4, DIM, 11), queries(4, VALUE_DIM, 12)
    return [
        Argument(
            "finetune.train_pairs[queries]",
            tensor_db,
            lambda db, x: kvsearch.finetune(db, (x, v(None)), **options),
            q,
            writes=True,
        ),
        Argument(
            "finetune.train_pairs[values]",
            tensor_db,
            lambda db, x: kvsearch.finetune(db, (q(None), x), **options),
            v,
            writes=True,
        ),
        Argument(
            "finetune.eval_pairs[queries]",
            tensor_db,
            lambda db, x: kvsearch.finetune(db, (q(None), v(None)), eval_pairs=(x, v(None)), **options),
            q,
            writes=True,
        ),
    ]


def index_arguments() -> list[Argument]:
    """The indexes' tensor arguments."""
    out = []
    for cls in (kvsearch.Index, kvsearch.TorchIndex):
        name = cls.__name__
        out += [
            Argument(f"{name}.search.queries", small_index(cls), lambda index, v: index.search(v, 2), queries()),
            Argument(
                f"{name}.search.allowed",
                small_index(cls),
                lambda index, v: index.search(randn(2, DIM, seed=2), 2, allowed=v),
                lambda _: torch.tensor([1, 3]),
                "int",
            ),
            Argument(
                f"{name}.add.keys",
                small_index(cls),
                lambda index, v: index.add(torch.tensor([10, 11]), v),
                queries(2, DIM, 7),
                writes=True,
            ),
            Argument(
                f"{name}.remove.ids",
                small_index(cls),
                lambda index, v: index.remove(v),
                lambda _: torch.tensor([1, 3]),
                "int",
                writes=True,
            ),
        ]
    return out


ARGUMENTS: list[Argument] = (
    database_arguments("Database", text_db, sharded=False)
    + database_arguments("ShardedDatabase", sharded_db, sharded=True)
    + attention_arguments()
    + finetune_arguments()
    + index_arguments()
)


def applies(layout: Layout, argument: Argument) -> bool:
    """Whether the layout is given to this argument: its kind, numpy only where numpy is taken, and a form of the
    value in this layout (no transposed 1-D tensor, no 1-D CSR)."""
    return argument.kind in layout.kinds and (argument.numpy or not layout.numpy) and argument.rank >= layout.min_ndim


#: Every (argument, layout) case of the matrix.
CASES: list[tuple[Argument, Layout]] = [
    (argument, layout) for argument in ARGUMENTS for layout in LAYOUTS if applies(layout, argument)
]


# ----------------------------------------------------------------------------- the matrix


@pytest.fixture(scope="module")
def shared() -> dict[str, Any]:
    """The targets the cases that change nothing share, one per maker (see :class:`Fresh`)."""
    made: dict[str, Any] = {}
    yield made
    for target in made.values():
        close(target)


class Fresh:
    """Targets for one case: one per maker shared by the cases that change nothing (reads, and writes that must be
    refused: each checks that the state stayed), a new one per call for writes that may succeed."""

    def __init__(self, argument: Argument, shared: dict[str, Any], folder: Path) -> None:
        self.argument, self.shared, self.folder, self.made = argument, shared, folder, []

    def target(self, may_change: bool) -> Any:
        maker = self.argument.make
        if not (self.argument.writes and may_change):
            key = f"{maker.__name__}:{id(maker)}:{self.argument.writes}"
            if key not in self.shared:
                self.shared[key] = maker(self.folder / f"shared-{len(self.shared)}")
            return self.shared[key]
        target = maker(self.folder / f"target-{len(self.made)}")
        self.made.append(target)
        return target

    def forget(self) -> None:
        """Drop the shared targets of this argument's maker (a refused write changed one: the test fails)."""
        for key in [key for key in self.shared if key.startswith(f"{self.argument.make.__name__}:")]:
            close(self.shared.pop(key))

    def close(self) -> None:
        for target in self.made:
            close(target)


def close(target: Any) -> None:
    """Close a database (an index or None has nothing to close)."""
    if hasattr(target, "close"):
        target.close()


def outcome(argument: Argument, target: Any, value: object) -> tuple[str, object]:
    """``("ok", answer)`` or ``("error", its type)``: what the call gave (the state after it for a write)."""
    try:
        result = argument.call(target, value)
    except KVSearchError as exc:
        return "error", type(exc).__name__
    return "ok", state(target) if argument.writes else plain(result)


def contiguous_copy(value: object) -> object:
    """The same numbers, contiguous: what a non-contiguous value must answer like."""
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    return value.contiguous()


def check_case(argument: Argument, layout: Layout, fresh: Fresh) -> None:
    """One case: a non-contiguous value answers as its contiguous copy, a refused layout raises
    InvalidArgumentError naming it, any other raises only KVSearchError; a refused write changes nothing.

    Raises:
        AssertionError: the case fails.
    """
    target = fresh.target(may_change=layout.expect != "refused")
    value = layout.make(argument.value(target).detach())
    before = state(target) if argument.writes else None
    if layout.expect == "same":
        if isinstance(value, Tensor):
            assert not value.is_contiguous(), "the layout gave a contiguous tensor"
        got = outcome(argument, target, value)
        want = outcome(argument, fresh.target(may_change=True), contiguous_copy(value))
        assert_same(got, want, "answer")
        # the contiguous copy works, but for repeated keys (stride 0) and upserts of embeddings across shards
        expected_error = layout.name.startswith("expanded") or argument.name.startswith("ShardedDatabase.upsert")
        assert want[0] == "ok" or expected_error, f"the contiguous copy gave {want}"
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", np.exceptions.ComplexWarning)  # a dropped imaginary part is a bug
            argument.call(target, value)
    except KVSearchError as exc:
        assert str(exc), f"{type(exc).__name__} with an empty message"
        if layout.expect == "refused":  # says what was expected and what came
            assert ("expected" in str(exc) or "must" in str(exc)) and "got" in str(exc), str(exc)
            assert isinstance(exc, InvalidArgumentError), f"{type(exc).__name__}: {exc}"
            assert layout.word in str(exc), str(exc)
        if argument.writes and state(target) != before:
            fresh.forget()
            raise AssertionError(f"refused with {type(exc).__name__} but the target changed") from None
        return
    assert layout.expect == "either", "accepted"


@pytest.mark.parametrize("argument", ARGUMENTS, ids=lambda a: a.name)
def test_every_layout_works_or_is_refused_typed(argument, shared, tmp_path):
    """Every layout that has a form for this argument (:data:`CASES`): see :func:`check_case`."""
    problems = []
    for i, layout in enumerate(layout for a, layout in CASES if a is argument):
        fresh = Fresh(argument, shared, tmp_path / f"case-{i}")
        try:
            check_case(argument, layout, fresh)
        except Exception as exc:  # noqa: BLE001 - every case's failure is reported, with the layout's name
            problems.append(f"{layout.name}: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            fresh.close()
    assert not problems, f"{argument.name}:\n" + "\n".join(problems)


def test_the_matrix_covers_every_layout_and_argument():
    """Each layout reaches some argument, each argument gets the refused layouts, and the count stays large."""
    assert {layout.name for _, layout in CASES} == {layout.name for layout in LAYOUTS}
    for argument in ARGUMENTS:
        given = {layout.name for a, layout in CASES if a is argument}
        assert {"sparse_coo", "meta", "nested", "nested jagged"} <= given, argument.name
    assert len(CASES) >= 800


def test_mixed_float_dtypes_are_promoted_as_attend_promotes():
    """float32 queries with float64 keys score in float64, as the float64 pair does (``compute_scores``, the score
    modules), and ``attend`` gives the float64 answer."""
    q, keys, values = randn(3, DIM, seed=2), randn(5, DIM, seed=3).double(), randn(5, 2, seed=4)
    for score in ("dot", "scaled_dot", "cosine", "gaussian"):
        got = kvsearch.compute_scores(q, keys, score)  # (3, 5)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, kvsearch.compute_scores(q.double(), keys, score))
    additive = _additive()
    got = additive(q, keys)  # (3, 5) in float64, the float32 weights promoted
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, additive.double()(q.double(), keys))
    output, _ = kvsearch.attend(q, keys, values)  # (3, 2)
    torch.testing.assert_close(output, kvsearch.attend(q.double(), keys, values.double())[0])


# ----------------------------------------------------------------------------- devices


@pytest.mark.gpu
def test_cuda_tensors_into_a_cpu_database_and_back(tmp_path):
    """A CUDA query (contiguous or not) into a CPU database answers as the CPU query, on the query's device; a CPU
    query into a CUDA database too; CUDA keys and values added to a CPU database are stored as the CPU ones are."""
    cpu = tensor_db(tmp_path)
    gpu = kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM, device="cuda")
    keys, values, _ = cpu.embeddings(cpu.ids())
    gpu.add(keys.cuda(), values.cuda())
    q = randn(3, DIM, seed=2)
    want = cpu.query(q, k=3)
    want_ids = [[hit.id for hit in hits] for hits in cpu.search(q, k=3)]
    for db, given in [(cpu, q.cuda()), (cpu, q.cuda().T.contiguous().T), (gpu, q), (gpu, q.cuda())]:
        got = db.query(given, k=3)
        assert got.output.device == given.device
        torch.testing.assert_close(got.output.cpu(), want.output, rtol=1e-5, atol=1e-6)
        assert [[hit.id for hit in hits] for hits in db.search(given, k=3)] == want_ids
        output = KVAttention(db, k=3)(given)  # (3, value_dim) on the query's device
        assert output.device == given.device
        torch.testing.assert_close(output.cpu(), KVAttention(cpu, k=3)(q), rtol=1e-5, atol=1e-6)
    new_keys, new_values = randn(2, DIM, seed=7), randn(2, VALUE_DIM, seed=8)
    by_cuda, by_cpu = tensor_db(tmp_path), tensor_db(tmp_path)
    by_cuda.add(new_keys.cuda(), new_values.cuda())
    by_cpu.add(new_keys, new_values)
    assert state(by_cuda) == state(by_cpu)
    for db in (cpu, gpu, by_cuda, by_cpu):
        db.close()
