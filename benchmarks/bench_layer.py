"""kvsearch as a layer inside a model, beside the same math in bare torch, in one run (interleaved medians).

    python benchmarks/bench_layer.py                    # every section, CPU; replaces its RESULTS.md section
    python benchmarks/bench_layer.py --quick --no-append
    python benchmarks/bench_layer.py --device cuda      # the GPU rows (float16 autocast there)

Sections (each ratio is measured against its peer in the same process, same tensors, calls interleaved):

1. ``Database(None).candidates(q, k)`` with the default index (``"Flat"``, path chosen per call) against bare
   ``torch.topk(q @ K.T, k)``, and against the same database forced to its float32 path, per batch size x dim x
   kind of keys (random unnormalised, unit-norm, clustered near-duplicates, norms spread 100x). The database uses
   ``score="dot"`` (what ``q @ K.T`` computes); ``candidates`` also gathers the keys and values, bare torch does
   not: the "bare + gather" column adds ``K[idx], V[idx]`` to it (the same work). Targets: speed-up over bare
   torch >= 1.0x, time over forced float32 <= 1.1x. The first calls of each class time both paths
   (``kvsearch.index.exact_path``): they are warm-up here, steady state is what is measured.
2. ``KVAttention`` forward + backward against a bare-torch top-k attention (the same top-k, gather, scaled-dot
   softmax and blend, written out). Target: <= 1.1x its time.
3. A kNN memory in a training loop (memorizing transformers): each step adds ``--grow`` rows to the memory, then
   ``--batch`` queries attend over their top-k and backward; against the same loop in bare torch over a
   preallocated buffer, and lucidrains' ``KNNMemory`` (``pip install --no-deps memorizing-transformers-pytorch
   einops-exts``: its own requirements pull faiss-gpu, whose files replace faiss-cpu's) with the same attention over
   the pairs it finds (HNSW: approximate). From empty, from empty with ``--capacity`` (the newest rows kept), and
   from ``--prefill`` rows (175,000, filled before the timed steps). Targets: <= 1.2x bare torch, and lucidrains'
   time >= 2x ours.
4. bf16 autocast (CUDA: float16) against float32 for the KVAttention forward + backward, and its error.
5. ``torch.compile`` against eager for a model holding KVAttention (forward + backward).
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, report, table  # noqa: E402

from kvsearch import Database, KVAttention  # noqa: E402
from kvsearch.index.exact_path import set_exact_path  # noqa: E402

KINDS = ("random", "unit", "clustered", "norms100")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each function, the calls of a round interleaved (the order rotating every round)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = time.perf_counter()
            fns[name]()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def make_keys(kind: str, n: int, dim: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Keys (n, dim) of one kind, and a generator of queries like them."""
    if kind == "clustered":  # near-duplicates: n / 100 centres, noise 1e-2 per coordinate
        centres = torch.randn(max(1, -(-n // 100)), dim, generator=g)  # ceil: every key has a centre
        keys = centres.repeat_interleave(100, 0)[:n] + 1e-2 * torch.randn(n, dim, generator=g)
        return keys, centres
    keys = torch.randn(n, dim, generator=g)
    if kind == "unit":
        keys = F.normalize(keys, dim=1)
    elif kind == "norms100":
        keys = keys * 10.0 ** (2 * torch.rand(n, 1, generator=g) - 1)
    return keys, keys


def make_queries(kind: str, like: Tensor, batch: int, g: torch.Generator) -> Tensor:
    """Queries (batch, dim): near a centre for clustered keys, Gaussian otherwise."""
    if kind == "clustered":
        pick = torch.randint(len(like), (batch,), generator=g)
        return like[pick] + 1e-2 * torch.randn(batch, like.shape[1], generator=g)
    return torch.randn(batch, like.shape[1], generator=g)


# ----------------------------------------------------------------------------------------------- 1. candidates


def bench_candidates(args: argparse.Namespace, device: torch.device) -> str:
    g = torch.Generator().manual_seed(0)
    rows = []
    k = args.k
    for dim in args.dims:
        n = max(2 * k, int(args.keys_mb * 2**20 / (4 * dim)))
        for kind in args.kinds:
            keys, like = make_keys(kind, n, dim, g)
            values = torch.randn(n, 8, generator=g)
            db = Database(None, dim=dim, value_dim=8, score="dot", device=device)
            db.add(keys, values)
            keys_dev, values_dev = keys.to(device), values.to(device)
            for batch in args.batches:
                q = make_queries(kind, like, batch, g).to(device)

                def forced32(q: Tensor = q, db: Database = db) -> object:
                    set_exact_path("float32")
                    try:
                        return db.candidates(q, k)
                    finally:
                        set_exact_path(None)

                def bare_gather(q: Tensor = q, keys: Tensor = keys_dev, values: Tensor = values_dev) -> object:
                    idx = torch.topk(q @ keys.T, k).indices  # (batch, k)
                    return keys[idx], values[idx]  # the same work as candidates: (batch, k, dim), (batch, k, 8)

                fns = {
                    "bare": lambda q=q, keys_dev=keys_dev: torch.topk(q @ keys_dev.T, k),
                    "bare+gather": bare_gather,
                    "auto": lambda q=q, db=db: db.candidates(q, k),
                    "float32": forced32,
                }
                for _ in range(5):  # warm-up: first touch; the path chooser times both paths of this class
                    fns["auto"]()
                fns["bare"]()
                fns["float32"]()
                t = interleaved(fns, args.rounds, device)
                same = torch.equal(db.candidates(q, k).ids.cpu(), forced32().ids.cpu())
                rows.append(
                    [
                        dim,
                        f"{n:,}",
                        kind,
                        batch,
                        t["bare"] * 1e3,
                        t["bare+gather"] * 1e3,
                        t["auto"] * 1e3,
                        t["float32"] * 1e3,
                        t["bare"] / t["auto"],
                        t["bare+gather"] / t["auto"],
                        t["auto"] / t["float32"],
                        "yes" if same else "NO",
                    ]
                )
                print(rows[-1], flush=True)
            db.close()
    headers = [
        "dim",
        "keys",
        "kind",
        "batch",
        "bare torch ms",
        "bare + gather ms",
        "candidates ms",
        "forced float32 ms",
        "speed-up vs bare (>= 1)",
        "vs bare + gather",
        "x forced float32 (<= 1.1)",
        "ids = float32's",
    ]
    return table(headers, rows)


# ----------------------------------------------------------------------------------------------- 2. layer


def bare_topk_attention(q: Tensor, keys: Tensor, values: Tensor, k: int) -> Tensor:
    """Top-k scaled-dot softmax attention in bare torch: (b, dim) -> (b, value_dim)."""
    with torch.no_grad():
        idx = torch.topk(q @ keys.T, k).indices  # (b, k)
    cand_k, cand_v = keys[idx], values[idx]  # (b, k, dim), (b, k, value_dim)
    scores = (cand_k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])  # (b, k)
    return (torch.softmax(scores, dim=-1).unsqueeze(1) @ cand_v).squeeze(1)  # (b, value_dim)


def bench_layer(args: argparse.Namespace, device: torch.device) -> str:
    g = torch.Generator().manual_seed(1)
    rows = []
    for dim, n in ((64, 51_200), (64, 100_000), (384, 100_000)):  # 100,000 x 64: issue 34's figure
        keys = torch.randn(n, dim, generator=g)
        values = torch.randn(n, 32, generator=g)
        db = Database(None, dim=dim, value_dim=32, score="dot", device=device)
        db.add(keys, values)
        layer = KVAttention(db, k=args.k)
        keys_dev, values_dev = keys.to(device), values.to(device)
        for batch in (16, 256):
            q = torch.randn(batch, dim, generator=g).to(device).requires_grad_()

            def ours(q: Tensor = q, layer: nn.Module = layer) -> None:
                layer(q).sum().backward()

            def bare(q: Tensor = q, keys: Tensor = keys_dev, values: Tensor = values_dev) -> None:
                bare_topk_attention(q, keys, values, args.k).sum().backward()

            q.grad = None
            ours()
            g_ours = q.grad.clone()
            q.grad = None
            bare()
            close = torch.allclose(g_ours, q.grad, rtol=1e-4, atol=1e-5)
            for _ in range(3):
                ours()
            t = interleaved({"bare": bare, "ours": ours}, args.layer_rounds, device)  # more rounds: ms-long calls
            rows.append([dim, f"{n:,}", batch, args.k, t["bare"] * 1e3, t["ours"] * 1e3, t["ours"] / t["bare"], close])
            print(rows[-1], flush=True)
    headers = ["dim", "keys", "batch", "k", "bare torch ms", "KVAttention ms", "x bare (<= 1.1)", "same gradient"]
    return table(headers, rows)


# ----------------------------------------------------------------------------------------------- 3. kNN memory


class BareMemory:
    """The bare-torch kNN memory: a preallocated buffer grown by doubling, the newest ``capacity`` rows kept."""

    def __init__(self, dim: int, value_dim: int, device: torch.device, capacity: int | None) -> None:
        self.keys = torch.empty(1024, dim, device=device)
        self.values = torch.empty(1024, value_dim, device=device)
        self.start, self.end, self.capacity = 0, 0, capacity

    def add(self, keys: Tensor, values: Tensor) -> None:
        r = len(keys)
        if self.end + r > len(self.keys):  # move the live rows to the front, or grow
            live = self.end - self.start
            size = max(len(self.keys), 2 * (live + r)) if self.capacity is None else 2 * self.capacity + r
            new_k = torch.empty(size, self.keys.shape[1], device=self.keys.device)
            new_v = torch.empty(size, self.values.shape[1], device=self.values.device)
            new_k[:live], new_v[:live] = self.keys[self.start : self.end], self.values[self.start : self.end]
            self.keys, self.values, self.start, self.end = new_k, new_v, 0, live
        self.keys[self.end : self.end + r], self.values[self.end : self.end + r] = keys, values
        self.end += r
        if self.capacity is not None:
            self.start = max(self.start, self.end - self.capacity)

    def attend(self, q: Tensor, k: int) -> Tensor:
        keys, values = self.keys[self.start : self.end], self.values[self.start : self.end]
        return bare_topk_attention(q, keys, values, min(k, len(keys)))


class LucidrainsMemory:
    """lucidrains' ``KNNMemory`` (memorizing-transformers-pytorch) in the same loop: its ``add`` of (1, rows, 2, dim)
    key / value pairs (a FAISS ``IndexHNSWFlat`` M=15, inner product, and a numpy memmap of the pairs) and its
    ``search`` (the top-k by HNSW, then the pairs read from the memmap), then the same scaled-dot softmax attention
    over the k found pairs as :func:`bare_topk_attention`, forward and backward (the gradient reaches the queries and
    ``proj``; the memory's keys and values are constants there, as in ours and bare torch's)."""

    def __init__(self, dim: int, capacity: int, folder: str) -> None:
        from memorizing_transformers_pytorch.knn_memory import KNNMemory  # the bench extra's peer

        # multiprocessing=False: one memory, joblib in this process (its default forks a pool per call on 2 cores)
        self.mem = KNNMemory(dim, max_memories=capacity, memmap_filename=f"{folder}/knn.memmap", multiprocessing=False)

    def add(self, keys: Tensor, values: Tensor) -> None:
        self.mem.add(torch.stack([keys, values], dim=1).unsqueeze(0))  # (1, rows, 2, dim)

    def attend(self, q: Tensor, k: int) -> Tensor:
        kv, mask = self.mem.search(q.unsqueeze(0), k)  # (1, b, k, 2, dim), (1, b, k)
        cand_k, cand_v, mask = kv[0, :, :, 0], kv[0, :, :, 1], mask[0]  # (b, k, dim) x2, (b, k)
        scores = (cand_k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])  # (b, k)
        scores = scores.masked_fill(~mask, -math.inf)  # (b, k) no pair found: weight 0
        return (torch.softmax(scores, dim=-1).unsqueeze(1) @ cand_v).squeeze(1)  # (b, dim)


def lucidrains_available() -> bool:
    try:
        import memorizing_transformers_pytorch.knn_memory  # noqa: F401
    except ImportError:
        return False
    return True


def memory_rounds(
    contenders: dict[str, Callable[[], Callable[[Tensor, Tensor, Tensor], None]]],
    stream: list[tuple[Tensor, Tensor, Tensor]],
    rounds: int,
    device: torch.device,
) -> dict[str, float]:
    """Median seconds of the steps of each contender: each round makes every contender's memory (pre-filled where
    asked: not timed), then times its ``len(stream)`` steps; the contenders' order rotates every round."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = contenders[name]()  # the memory made and pre-filled
            sync(device)
            start = time.perf_counter()
            for new_k, new_v, q in stream:
                step(new_k, new_v, q)
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_memory(args: argparse.Namespace, device: torch.device) -> str:
    """Section 3: the same loop -- add ``--grow`` rows, attend ``--batch`` queries over their top ``--k``, forward
    and backward -- for ``--steps`` steps, in three memories: kvsearch (``Database(None)`` + ``KVAttention``, exact
    top-k, ``score="dot"``: scaled-dot softmax), bare torch (:class:`BareMemory`: a doubling buffer,
    ``torch.topk(q @ K.T, k)``), and lucidrains' ``KNNMemory`` (:class:`LucidrainsMemory`: HNSW, approximate top-k;
    its memory holds ``capacity`` rows or the rows of the run, and resets its HNSW index when it would hold more).
    Rows: from empty; from empty with ``--capacity`` (the newest rows kept); and from ``--prefill`` rows (175,000:
    the memory filled before the timed steps, not timed). lucidrains' peer runs on the CPU only (FAISS-CPU)."""
    dim, value_dim, k = 64, 64, args.k
    peer = lucidrains_available() and device.type == "cpu"
    rows = []
    folder = tempfile.mkdtemp(prefix="knn-memory-")
    for capacity, prefill in ((None, 0), (args.capacity, 0), (None, args.prefill)):
        g = torch.Generator().manual_seed(2)
        stream = [
            (
                torch.randn(args.grow, dim, generator=g).to(device),
                torch.randn(args.grow, value_dim, generator=g).to(device),
                torch.randn(args.batch, dim, generator=g).to(device),
            )
            for _ in range(args.steps)
        ]
        first_k = torch.randn(prefill, dim, generator=g).to(device)  # (prefill, dim)
        first_v = torch.randn(prefill, value_dim, generator=g).to(device)  # (prefill, value_dim)
        proj = nn.Linear(dim, dim).to(device)

        def ours(capacity: int | None = capacity, first_k: Tensor = first_k, first_v: Tensor = first_v,
                 proj: nn.Module = proj) -> Callable[[Tensor, Tensor, Tensor], None]:  # fmt: skip
            kwargs = {} if capacity is None else {"capacity": capacity}
            db = Database(None, dim=dim, value_dim=value_dim, score="dot", device=device, **kwargs)
            if len(first_k):
                db.add(first_k, first_v)
            layer = KVAttention(db, k=k)

            def step(new_k: Tensor, new_v: Tensor, q: Tensor) -> None:
                db.add(new_k, new_v)
                layer(proj(q)).sum().backward()

            return step

        def bare(capacity: int | None = capacity, first_k: Tensor = first_k, first_v: Tensor = first_v,
                 proj: nn.Module = proj) -> Callable[[Tensor, Tensor, Tensor], None]:  # fmt: skip
            mem = BareMemory(dim, value_dim, device, capacity)
            if len(first_k):
                mem.add(first_k, first_v)

            def step(new_k: Tensor, new_v: Tensor, q: Tensor) -> None:
                mem.add(new_k, new_v)
                mem.attend(proj(q), k).sum().backward()

            return step

        def lucidrains(capacity: int | None = capacity, first_k: Tensor = first_k, first_v: Tensor = first_v,
                       proj: nn.Module = proj) -> Callable[[Tensor, Tensor, Tensor], None]:  # fmt: skip
            held = capacity or len(first_k) + args.steps * args.grow  # the run's rows: its index is never reset
            mem = LucidrainsMemory(dim, held, folder)
            for start in range(0, len(first_k), 8192):
                mem.add(first_k[start : start + 8192], first_v[start : start + 8192])

            def step(new_k: Tensor, new_v: Tensor, q: Tensor) -> None:
                mem.add(new_k, new_v)
                mem.attend(proj(q), k).sum().backward()

            return step

        contenders = {"bare": bare, "ours": ours} | ({"lucidrains": lucidrains} if peer else {})
        if not rows:  # the process's first calls (kernels made, modules imported): untimed
            memory_rounds(contenders, stream[:4], 1, device)
        t = memory_rounds(contenders, stream, args.memory_rounds, device)
        rows.append(
            [
                f"{prefill:,}",
                "-" if capacity is None else f"{capacity:,}",
                args.steps,
                args.grow,
                args.batch,
                k,
                t["bare"] * 1e3 / args.steps,
                t["ours"] * 1e3 / args.steps,
                t["lucidrains"] * 1e3 / args.steps if peer else "-",
                t["ours"] / t["bare"],
                t["lucidrains"] / t["ours"] if peer else "-",
            ]
        )
        print(rows[-1], flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    headers = ["rows at start", "capacity", "steps", "rows added / step", "queries / step", "k", "bare torch ms / step",
               "kvsearch ms / step", "lucidrains KNNMemory ms / step", "x bare (<= 1.2)",
               "lucidrains / kvsearch (>= 2)"]  # fmt: skip
    return table(headers, rows)


# ----------------------------------------------------------------------------------------------- 4-5. autocast, compile


def model_over(db: Database, dim: int, k: int) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(32, dim), KVAttention(db, k=k), nn.Linear(32, 5))


def bench_precision_and_compile(args: argparse.Namespace, device: torch.device) -> tuple[str, str]:
    g = torch.Generator().manual_seed(4)
    dim, n = 64, 51_200
    db = Database(None, dim=dim, value_dim=32, score="dot", device=device)
    db.add(torch.randn(n, dim, generator=g), torch.randn(n, 32, generator=g))
    model = model_over(db, dim, args.k).to(device)
    x = torch.randn(256, 32, generator=g).to(device)
    amp = torch.bfloat16 if device.type == "cpu" else torch.float16

    def step(m: nn.Module, autocast: bool) -> Tensor:
        m.zero_grad()
        with torch.autocast(device.type, dtype=amp, enabled=autocast):
            out = m(x)
        out.float().square().mean().backward()
        return out.detach().float()

    ref = step(model, False)
    low = step(model, True)
    err = float((low - ref).abs().max() / ref.abs().max())
    t = interleaved({"fp32": lambda: step(model, False), "amp": lambda: step(model, True)}, args.rounds, device)
    prec = table(
        ["autocast dtype", "float32 ms", "autocast ms", "x float32", "max rel. error of the output"],
        [[str(amp).removeprefix("torch."), t["fp32"] * 1e3, t["amp"] * 1e3, t["amp"] / t["fp32"], err]],
    )
    compiled = torch.compile(model)
    start = time.perf_counter()
    out_c = step(compiled, False)
    first = time.perf_counter() - start
    same = torch.allclose(out_c, ref, rtol=1e-4, atol=1e-5)
    t = interleaved({"eager": lambda: step(model, False), "compiled": lambda: step(compiled, False)}, args.rounds,
                    device)  # fmt: skip
    comp = table(
        ["eager ms", "compiled ms", "x eager", "first call (compile) s", "outputs equal"],
        [[t["eager"] * 1e3, t["compiled"] * 1e3, t["compiled"] / t["eager"], first, same]],
    )
    return prec, comp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds (a smoke run)")
    parser.add_argument("--sections", default="candidates,layer,memory,precision")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--keys-mb", type=float, default=25.0, help="size of the keys of section 1 (n = MB / dim)")
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layer-rounds", type=int, default=15, help="rounds of section 2 (--quick too)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--grow", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=20_000)
    parser.add_argument("--memory-rounds", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=175_000, help="rows in the memory before the third row's steps")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.dims, args.batches, args.rounds, args.steps, args.keys_mb = [64], [1, 64, 1024], 3, 40, 5.0
    device = torch.device(args.device)
    info = machine()
    sections = []
    wanted = set(args.sections.split(","))
    if "candidates" in wanted:
        sections.append(("Exact candidates vs bare torch.topk(q @ K.T, k)", bench_candidates(args, device)))
    if "layer" in wanted:
        sections.append(("KVAttention forward + backward vs bare-torch top-k attention", bench_layer(args, device)))
    if "memory" in wanted:
        sections.append(("kNN memory in a training loop vs bare torch", bench_memory(args, device)))
    if "precision" in wanted:
        prec, comp = bench_precision_and_compile(args, device)
        sections += [("Autocast vs float32 (KVAttention model, batch 256)", prec)]
        sections += [("torch.compile vs eager (same model)", comp)]
    name = f"bench_layer-{device.type}"  # its section of RESULTS.md, its JSON and plots
    report(f"Layer benchmark ({device.type})", command_line(), info, sections, append=not args.no_append, name=name)


if __name__ == "__main__":
    main()
