"""ProductKeyMemory beside lucidrains' ``product-key-memory``, and what its slots do inside a model, in one run.

    python benchmarks/bench_memory.py                  # ~12 min here; replaces its section of RESULTS.md
    python benchmarks/bench_memory.py --quick --no-append

Sections (the peer and ours in the same process, on the same tensors; timed calls interleaved, medians):

1. Speed: a training step's forward + backward (``zero_grad(set_to_none=True)``, ``out.sum().backward()``) of
   ``kvsearch.ProductKeyMemory`` and lucidrains' ``PKM`` at the same sizes: n = 128 and 512 sub-keys (16,384 and
   262,144 slots), 4 heads, k = 32, a batch of 1,024 inputs of dim 512, key dim 256 (lucidrains' ``dim_head`` 128:
   each half of a head's query), values of dim 512, LayerNorm over each half of each head's query (lucidrains'
   default ``use_layernorm=True``; ours ``query_norm="layernorm"``). lucidrains' weights are copied into ours, so the
   outputs and the input gradients are compared as well as the times. Rows at torch's default thread count (wall
   time) and at one thread (the process's CPU time: what the calls cost, less perturbed by the other processes of a
   shared machine); CUDA rows (wall time, synchronised) where a GPU is present, skipped elsewhere.
   ``kvsearch sparse=True`` (sparse gradients for the values: no dense n^2 x 512 gradient) is shown beside, for
   information: the peer has no such option. Target: <= 1.0x lucidrains' time.
2. Memorisation: a small model must store random facts, ``(subject, relation) -> object`` (``--facts``, 50,000 by
   default: ``--relations`` relations per subject, objects drawn uniformly from ``--objects``): the input is the sum
   of the subject's and the relation's embeddings, one residual layer, then a linear map to the objects. The layer is
   a ProductKeyMemory or a dense FFN (Linear, GELU, Linear) whose hidden width gives it the memory's FLOPs per token
   (counted in :func:`memory_flops` / :func:`ffn_flops`). Same steps, batches and seed; Adam over
   :func:`kvsearch.memory_param_groups` (the memory's values at ``--value-lr``, as the papers train them; the FFN at
   each of ``--ffn-lrs``, its best shown). Accuracy: the facts answered right (argmax) out of all of them.
3. Slot edits on the trained memory model: for ``--edits`` facts it answers right, the slots that fact's input
   reaches (``memory.slots.reached``) get new values (``slots.update_values``: gradient steps on those rows only)
   until the model gives another object; every other fact's answer is compared with its answer before the edit
   (target: >= 99 % unchanged), then the old values are put back.
4. Frozen slots: the slots ``--freeze-facts`` facts reach are frozen (``slots.freeze``) and copies of the model
   train ``--freeze-steps`` more steps on every fact, each from the same start: with the run's Adam (its moments
   from the training before), and with AdamW (the same moments, weight decay ``--freeze-decay`` on every group),
   each with and without ``slots.protect(optimizer)``. With ``protect`` the frozen rows must be bitwise unchanged;
   without it, what momentum and decay do to a row whose gradient is zero shows.

Sections 2-4 run at ``--train-threads`` (1) torch threads: on a loaded 2-core machine every parallel op waits for
a core, and these are accuracy figures, not timings.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, report, table  # noqa: E402

from kvsearch import ProductKeyMemory, memory_param_groups  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(
    fns: dict[str, Callable[[], object]], rounds: int, device: torch.device, clock: Callable[[], float]
) -> dict[str, float]:
    """Median seconds of each function by ``clock``, the calls of a round interleaved (the order rotating)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(device)
            start = clock()
            fns[name]()
            sync(device)
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peer_version() -> str | None:
    """lucidrains' ``product-key-memory`` version, or None where it is not installed."""
    try:
        import product_key_memory  # noqa: F401
    except ImportError:
        return None
    return importlib.metadata.version("product-key-memory")


# ----------------------------------------------------------------------------------------------- 1. speed


def copy_from_peer(theirs: nn.Module, ours: ProductKeyMemory) -> None:
    """Give ours lucidrains' weights: its query map's output is laid out (half, head, d), ours (head, half, d); its
    keys are (heads, n, 2, d), ours (heads, 2, n, d); the values and the LayerNorm are the same tensors."""
    heads, half = ours.heads, ours.key_dim // 2
    with torch.no_grad():
        weight = theirs.to_queries.weight.view(2, heads, half, ours.dim)  # (2, heads, half, dim)
        ours.query_map.weight.copy_(weight.transpose(0, 1).reshape(heads * 2 * half, ours.dim))
        ours.subkeys.copy_(theirs.keys.permute(0, 2, 1, 3))  # (heads, 2, n, half)
        ours.values.copy_(theirs.values.weight)  # (n^2, value_dim)
        ours.norm.load_state_dict(theirs.norm.state_dict())


def speed_rows(args: argparse.Namespace, device: torch.device, threads: int | None) -> list[list[Any]]:
    """Section 1's rows for one device and thread count (None: torch's default)."""
    from product_key_memory import PKM

    default_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    try:
        for n in args.sizes:
            torch.manual_seed(0)
            theirs = PKM(args.dim, heads=args.heads, num_keys=n, topk=args.k, dim_head=args.key_dim // 2).to(device)
            ours = ProductKeyMemory(args.dim, num_keys=n, heads=args.heads, k=args.k, key_dim=args.key_dim).to(device)
            copy_from_peer(theirs, ours)
            sparse = ProductKeyMemory(**{**ours.config, "sparse": True}).to(device)
            sparse.load_state_dict(ours.state_dict())
            x = torch.randn(1, args.batch, args.dim, device=device, requires_grad=True)  # (1, batch, dim): PKM's

            def step(module: nn.Module, x: Tensor = x) -> Callable[[], Tensor]:
                def run() -> Tensor:
                    module.zero_grad(set_to_none=True)
                    x.grad = None
                    module(x).sum().backward()
                    return x.grad

                return run

            fns = {"lucidrains": step(theirs), "kvsearch": step(ours), "sparse": step(sparse)}
            grads = {name: fn().clone() for name, fn in fns.items()}  # the first calls: warm-up too
            with torch.no_grad():
                diff = float((ours(x) - theirs(x)).abs().max())
            same_grad = all(torch.allclose(g, grads["lucidrains"], rtol=1e-4, atol=1e-6) for g in grads.values())
            for fn in fns.values():
                fn()
            # one thread: the process's CPU time (what the calls cost, whatever else the machine runs); else wall
            clock = time.process_time if threads == 1 and device.type == "cpu" else time.perf_counter
            t = interleaved(fns, args.rounds, device, clock)
            label = "-" if device.type == "cuda" else str(threads or default_threads)
            what = "CPU time" if clock is time.process_time else "wall"
            rows.append([device.type, label, what, n, f"{n * n:,}", t["lucidrains"] * 1e3, t["kvsearch"] * 1e3,
                         t["kvsearch"] / t["lucidrains"], t["sparse"] * 1e3, t["sparse"] / t["lucidrains"], diff,
                         "yes" if same_grad else "NO"])  # fmt: skip
            print(rows[-1], flush=True)
            del theirs, ours, sparse
    finally:
        torch.set_num_threads(default_threads)
    return rows


def bench_speed(args: argparse.Namespace) -> Any:
    headers = ["device", "threads", "clock", "n", "slots", "lucidrains PKM ms", "kvsearch ms",
               "kvsearch / lucidrains (<= 1.0)", "kvsearch sparse=True ms", "sparse / lucidrains",
               "max abs output diff", "same input gradient"]  # fmt: skip
    if peer_version() is None:
        return table(headers, [["cpu", "-", "-", "-", "-", "not installed: pip install product-key-memory"]
                               + ["-"] * (len(headers) - 6)])  # fmt: skip
    rows = []
    for threads in (None, 1):
        rows += speed_rows(args, torch.device("cpu"), threads)
    if torch.cuda.is_available():
        rows += speed_rows(args, torch.device("cuda"), None)
    else:
        print("no CUDA device: the CUDA rows are skipped", file=sys.stderr)
    return table(headers, rows)


# ----------------------------------------------------------------------------------------------- 2. memorisation


def memory_flops(dim: int, n: int, heads: int, k: int, key_dim: int, value_dim: int) -> int:
    """Multiply-adds x 2 (and adds) of one input through a ProductKeyMemory: the query map, each half scored against
    its n sub-keys, the k^2 sums per head, the softmax over k (~3k) and the weighted sum of heads * k values. The
    top-k selections (comparisons) and the LayerNorm (~5 per query number) are left out, as the papers do."""
    query, scores, sums = 2 * dim * heads * key_dim, 2 * heads * n * key_dim, heads * k * k
    return query + scores + sums + 3 * heads * k + 2 * heads * k * value_dim


def ffn_flops(dim: int, hidden: int) -> int:
    """Multiply-adds x 2 of one input through Linear(dim, hidden), GELU, Linear(hidden, dim) (GELU as ~1 per unit)."""
    return 4 * dim * hidden + hidden + 2 * dim


class FactModel(nn.Module):
    """``(subject, relation) -> object`` logits: embeddings summed, one residual layer, a linear read-out."""

    def __init__(self, subjects: int, relations: int, objects: int, dim: int, layer: nn.Module) -> None:
        super().__init__()
        self.subject, self.relation = nn.Embedding(subjects, dim), nn.Embedding(relations, dim)
        self.norm, self.layer, self.out_norm = nn.LayerNorm(dim), layer, nn.LayerNorm(dim)
        self.out = nn.Linear(dim, objects)

    def layer_inputs(self, subjects: Tensor, relations: Tensor) -> Tensor:
        """What the layer reads: (b,) ids -> (b, dim)."""
        return self.norm(self.subject(subjects) + self.relation(relations))

    def forward(self, subjects: Tensor, relations: Tensor) -> Tensor:
        h = self.subject(subjects) + self.relation(relations)  # (b, dim)
        h = h + self.layer(self.norm(h))  # (b, dim)
        return self.out(self.out_norm(h))  # (b, objects)


def make_facts(args: argparse.Namespace) -> tuple[Tensor, Tensor, Tensor]:
    """Every (subject, relation) pair once, each with a random object: (facts,) ids each."""
    subjects = args.facts // args.relations
    g = torch.Generator().manual_seed(0)
    subject = torch.arange(subjects).repeat_interleave(args.relations)  # (facts,)
    relation = torch.arange(args.relations).repeat(subjects)  # (facts,)
    return subject, relation, torch.randint(0, args.objects, (len(subject),), generator=g)


@torch.no_grad()
def predictions(model: FactModel, facts: tuple[Tensor, Tensor, Tensor], keep_ids: bool = False) -> Any:
    """The model's answer to every fact (facts,), and with ``keep_ids`` the memory's slots of each (facts, heads, k)."""
    was = model.training
    model.eval()
    answers, ids = [], []
    for start in range(0, len(facts[0]), 4096):
        answers.append(model(facts[0][start : start + 4096], facts[1][start : start + 4096]).argmax(-1))
        if keep_ids:
            ids.append(model.layer.last_ids)
    model.train(was)
    return (torch.cat(answers), torch.cat(ids)) if keep_ids else torch.cat(answers)


def accuracy(model: FactModel, facts: tuple[Tensor, Tensor, Tensor]) -> float:
    return float((predictions(model, facts) == facts[2]).double().mean())


def train(model: FactModel, optimizer: torch.optim.Optimizer, facts: tuple[Tensor, Tensor, Tensor], steps: int,
          batch: int, seed: int, evals: int = 0) -> tuple[list[tuple[int, float]], float]:  # fmt: skip
    """``steps`` Adam steps on random batches of facts; the accuracy every ``steps / evals`` steps; the seconds."""
    g = torch.Generator().manual_seed(seed)
    curve, spent = [], 0.0
    every = max(1, steps // evals) if evals else steps + 1
    for step in range(1, steps + 1):
        start = time.perf_counter()
        pick = torch.randint(0, len(facts[0]), (batch,), generator=g)  # (batch,)
        loss = F.cross_entropy(model(facts[0][pick], facts[1][pick]), facts[2][pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        spent += time.perf_counter() - start
        if step % every == 0 or (evals and step == steps and curve[-1][0] != steps):
            curve.append((step, accuracy(model, facts)))
            print(f"  step {step}: loss {loss.item():.3f}, accuracy {curve[-1][1]:.4f} ({spent:.0f} s)", flush=True)
    return curve, spent


def make_memory(args: argparse.Namespace) -> ProductKeyMemory:
    return ProductKeyMemory(args.model_dim, num_keys=args.num_keys, heads=args.heads, k=args.model_k,
                            key_dim=args.model_key_dim)  # fmt: skip


def bench_memorisation(args: argparse.Namespace, facts: tuple[Tensor, Tensor, Tensor]) -> tuple[Any, dict, Any]:
    """Section 2: the memory model and the FFN model (each FFN lr) trained alike. Returns the table, the curves and
    the trained memory model with its optimizer (for sections 3-4)."""
    dim, subjects = args.model_dim, args.facts // args.relations
    flops = memory_flops(dim, args.num_keys, args.heads, args.model_k, args.model_key_dim, dim)
    hidden = round((flops - 2 * dim) / (4 * dim + 1))  # the FFN width of equal FLOPs per token
    rows, curves = [], {}
    runs: list[tuple[str, Callable[[], nn.Module], float, float]] = [
        (
            f"FFN {dim}-{hidden}-{dim}",
            lambda: nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)),
            lr,
            lr,
        )
        for lr in args.ffn_lrs  # fmt: skip
    ]
    runs.append((f"ProductKeyMemory n={args.num_keys}", lambda: make_memory(args), args.lr, args.value_lr))
    kept: Any = None
    for name, layer_of, lr, value_lr in runs:
        torch.manual_seed(1)  # the same embeddings and read-out for every model
        model = FactModel(subjects, args.relations, args.objects, dim, layer_of())
        optimizer = torch.optim.Adam(memory_param_groups(model, lr=lr, value_lr=value_lr))
        print(f"{name}, lr {lr:g}, values' lr {value_lr:g}", flush=True)
        curve, seconds = train(model, optimizer, facts, args.steps, args.train_batch, seed=2, evals=args.evals)
        is_memory = isinstance(model.layer, ProductKeyMemory)
        layer_flops = flops if is_memory else ffn_flops(dim, hidden)
        params = sum(p.numel() for p in model.layer.parameters())
        rows.append([name, f"{params:,}", f"{layer_flops:,}", f"{lr:g}", f"{value_lr:g}" if is_memory else "-",
                     args.steps, args.train_batch, curve[-1][1], seconds / args.steps * 1e3])  # fmt: skip
        curves[f"{name}, lr {lr:g}" + (f" (values {value_lr:g})" if is_memory else "")] = curve
        if is_memory:
            kept = (model, optimizer)
    headers = ["layer", "layer parameters", "layer FLOPs / fact", "lr", "values' lr", "steps", "batch",
               "accuracy (all facts)", "ms / step"]  # fmt: skip
    return table(headers, rows), curves, kept


# ----------------------------------------------------------------------------------------------- 3. slot edits


def edit_fact(model: FactModel, fact: tuple[Tensor, Tensor], ids: Tensor, target: int, max_steps: int,
              step_size: float) -> int:  # fmt: skip
    """Change the model's answer to one fact by editing only the slots ``ids`` (those its input reaches): gradient
    steps of Frobenius norm ``step_size`` on those rows of the values, written with ``slots.update_values``, until
    the answer is ``target``. Returns the steps taken (``max_steps``: not reached)."""
    memory: ProductKeyMemory = model.layer  # type: ignore[assignment]
    goal = torch.tensor([target])
    for step in range(max_steps):
        logits = model(*fact)  # (1, objects)
        if int(logits.argmax(-1)) == target:
            return step
        (grad,) = torch.autograd.grad(F.cross_entropy(logits, goal), memory.values)  # (n^2, value_dim)
        rows = grad[ids]  # (r, value_dim): the rest of the gradient is zero
        memory.slots.update_values(ids, memory.slots.read(ids).values - step_size * rows / rows.norm().clamp_min(1e-12))
    return max_steps


def bench_edits(args: argparse.Namespace, model: FactModel, facts: tuple[Tensor, Tensor, Tensor]) -> Any:
    """Section 3: edit the slots of ``--edits`` facts, one at a time, and count the other facts whose answer moved."""
    model.eval()
    memory: ProductKeyMemory = model.layer  # type: ignore[assignment]
    before, slot_ids = predictions(model, facts, keep_ids=True)  # (facts,), (facts, heads, k)
    right = (before == facts[2]).nonzero().reshape(-1)
    g = torch.Generator().manual_seed(3)
    chosen = right[torch.randperm(len(right), generator=g)[: args.edits]]
    rows = []
    for i in chosen.tolist():
        target = int((facts[2][i] + 1 + torch.randint(0, args.objects - 1, (1,), generator=g)) % args.objects)
        fact = (facts[0][i : i + 1], facts[1][i : i + 1])
        with torch.no_grad():
            ids = memory.slots.reached(model.layer_inputs(*fact)).ids  # (r,): the slots this fact reads
        old = memory.slots.read(ids).values  # (r, value_dim)
        steps = edit_fact(model, fact, ids, target, args.edit_steps, args.edit_step_size)
        after = predictions(model, facts)  # (facts,)
        others = torch.ones(len(after), dtype=torch.bool)
        others[i] = False
        sharing = torch.isin(slot_ids.reshape(len(after), -1), ids).any(1) & others  # read an edited slot before
        changed = (after != before) & others
        moved = float((memory.slots.read(ids).values - old).norm() / old.norm())
        rows.append([i, int(facts[2][i]), target, int(after[i]), "yes" if int(after[i]) == target else "NO",
                     len(ids), steps, moved, int(sharing.sum()), int(changed.sum()),
                     f"{100 * (1 - float(changed.sum()) / float(others.sum())):.3f} %"])  # fmt: skip
        memory.slots.update_values(ids, old)  # put the old values back for the next edit
        print(rows[-1], flush=True)
    restored = bool(torch.equal(predictions(model, facts), before))
    model.train()
    unchanged = [float(r[-1].removesuffix(" %")) for r in rows]  # percent
    summary = table(
        ["edits", "answer changed to the target", "slots edited per fact (median)", "steps (median)",
         "other facts unchanged (>= 99 %): min", "median", "answers all back after restoring the old values"],
        [[len(rows), f"{sum(r[4] == 'yes' for r in rows)} / {len(rows)}", statistics.median(r[5] for r in rows),
          statistics.median(r[6] for r in rows), f"{min(unchanged):.3f} %", f"{statistics.median(unchanged):.3f} %",
          "yes" if restored else "NO"]],
    )  # fmt: skip
    detail = table(["fact", "object", "target", "answer after", "changed", "slots edited", "steps",
                    "relative change of their values", "other facts reading an edited slot",
                    "other facts whose answer moved", "other facts unchanged (>= 99 %)"], rows)  # fmt: skip
    return summary, detail


# ----------------------------------------------------------------------------------------------- 4. frozen slots


def bench_freeze(args: argparse.Namespace, model: FactModel, optimizer: torch.optim.Optimizer,
                 facts: tuple[Tensor, Tensor, Tensor]) -> Any:  # fmt: skip
    """Section 4: freeze the slots of ``--freeze-facts`` facts, train on from the same start four ways (Adam with the
    run's moments, and AdamW with ``--freeze-decay`` on every group; each with and without ``protect``), compare
    their values bitwise."""
    memory: ProductKeyMemory = model.layer  # type: ignore[assignment]
    g = torch.Generator().manual_seed(4)
    pick = torch.randperm(len(facts[0]), generator=g)[: args.freeze_facts]
    with torch.no_grad():
        ids = memory.slots.reached(model.layer_inputs(facts[0][pick], facts[1][pick])).ids  # (f,)
    memory.slots.freeze(ids)
    frozen_listed = torch.equal(memory.slots.where({"frozen": True}), ids)
    start_values = memory.values.detach().clone()  # (n^2, value_dim)
    start_step, start_written = int(memory.step), memory.written[ids].clone()
    state = copy.deepcopy(optimizer.state_dict())  # the run's Adam moments
    rows = []
    for kind, protect in (("Adam", True), ("Adam", False), ("AdamW", True), ("AdamW", False)):
        m = copy.deepcopy(model)  # the trained model, its slots frozen
        opt_class = torch.optim.Adam if kind == "Adam" else torch.optim.AdamW
        opt = opt_class(memory_param_groups(m, lr=args.lr, value_lr=args.value_lr))
        opt.load_state_dict(state)  # the moments of the run (and its groups' lr)
        decay = 0.0 if kind == "Adam" else args.freeze_decay
        for group in opt.param_groups:  # loaded from Adam's groups: AdamW's own decay, decoupled
            group["weight_decay"], group["decoupled_weight_decay"] = decay, kind == "AdamW"
        mem: ProductKeyMemory = m.layer  # type: ignore[assignment]
        handle = mem.slots.protect(opt) if protect else None
        name = f"{kind}{f' (decay {decay:g})' if decay else ''}, frozen" + (" + protect(optimizer)" if protect else "")
        print(name, flush=True)
        train(m, opt, facts, args.freeze_steps, args.train_batch, seed=5)
        values = mem.values.detach()
        frozen_moved = int((values[ids] != start_values[ids]).any(1).sum())
        others = torch.ones(len(values), dtype=torch.bool)
        others[ids] = False
        others_moved = int((values[others] != start_values[others]).any(1).sum())
        bitwise = bool(torch.equal(values[ids], start_values[ids]))
        kept_written = bool(torch.equal(mem.written[ids], start_written))
        rows.append([name, f"{len(ids):,}", args.freeze_facts, args.freeze_steps, int(mem.step) - start_step,
                     "yes" if bitwise else "NO", f"{frozen_moved:,}", f"{others_moved:,} of {int(others.sum()):,}",
                     "yes" if kept_written else "NO", "yes" if frozen_listed else "NO",
                     accuracy(m, (facts[0][pick], facts[1][pick], facts[2][pick]))])  # fmt: skip
        print(rows[-1], flush=True)
        if handle is not None:
            handle.remove()
    memory.slots.unfreeze(ids)
    headers = ["run", "frozen slots", "their facts", "steps", "training forwards counted", "frozen values bitwise "
               "unchanged", "frozen rows moved", "other rows moved", "frozen slots' written unchanged",
               "where({'frozen': True}) = the frozen ids", "accuracy on their facts after"]  # fmt: skip
    return table(headers, rows)


# ----------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds and facts (a smoke run)")
    parser.add_argument("--sections", default="speed,memorisation", help="speed, memorisation (with edits, freeze)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512], help="n: sub-keys per half (section 1)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--key-dim", type=int, default=256, help="ours' key_dim (lucidrains' dim_head: half of it)")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--facts", type=int, default=50_000)
    parser.add_argument("--relations", type=int, default=50, help="relations per subject (subjects = facts / this)")
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--model-dim", type=int, default=64)
    parser.add_argument("--num-keys", type=int, default=256, help="n of the model's memory (n^2 slots)")
    parser.add_argument("--model-k", type=int, default=16)
    parser.add_argument("--model-key-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--train-batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3, help="the memory model's lr (all but the values)")
    parser.add_argument("--value-lr", type=float, default=1e-2)
    parser.add_argument("--ffn-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--evals", type=int, default=10, help="accuracy evaluations during training")
    parser.add_argument("--edits", type=int, default=20)
    parser.add_argument("--edit-steps", type=int, default=200, help="the most gradient steps of one edit")
    parser.add_argument("--edit-step-size", type=float, default=0.25, help="the norm of each edit step's change")
    parser.add_argument("--freeze-facts", type=int, default=100)
    parser.add_argument("--freeze-steps", type=int, default=200)
    parser.add_argument("--freeze-decay", type=float, default=0.01, help="AdamW's weight decay in section 4")
    parser.add_argument("--train-threads", type=int, default=1)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.rounds, args.facts, args.steps, args.edits, args.freeze_steps = [128], 3, 25_000, 600, 5, 50
        args.ffn_lrs, args.evals = [1e-2], 5
    info = machine()
    version = peer_version()
    info["versions"]["product-key-memory"] = version or "-"
    sections: list[tuple[str, Any]] = []
    points: dict[str, Any] = {}
    wanted = set(args.sections.split(","))
    if "speed" in wanted:
        sections.append((f"Forward + backward vs lucidrains' product-key-memory {version} (batch {args.batch:,} x "
                         f"dim {args.dim}, {args.heads} heads, k {args.k}, key dim {args.key_dim}, LayerNorm queries; "
                         f"medians of {args.rounds} interleaved rounds)", bench_speed(args)))  # fmt: skip
    if "memorisation" in wanted:
        default_threads = torch.get_num_threads()
        torch.set_num_threads(args.train_threads)
        try:
            facts = make_facts(args)
            mem_table, curves, (model, optimizer) = bench_memorisation(args, facts)
            points["curves"] = curves
            sections.append((f"Memorisation: {len(facts[0]):,} random (subject, relation) -> object facts "
                             f"({args.facts // args.relations:,} subjects x {args.relations} relations, "
                             f"{args.objects:,} objects), {args.steps:,} steps of {args.train_batch}, "
                             f"{args.train_threads} thread", mem_table))  # fmt: skip
            summary, detail = bench_edits(args, model, facts)
            sections.append(("Slot edits: the slots one fact reaches, edited with slots.update_values", summary))
            sections.append(("Slot edits, each", detail))
            freeze_table = bench_freeze(args, model, optimizer, facts)
            sections.append((f"Frozen slots, {args.freeze_steps} more steps on every fact", freeze_table))
        finally:
            torch.set_num_threads(default_threads)
    report("Memory layer benchmark (ProductKeyMemory)", command_line(), info, sections, append=not args.no_append,
           name="bench_memory", points=points)  # fmt: skip


if __name__ == "__main__":
    main()
