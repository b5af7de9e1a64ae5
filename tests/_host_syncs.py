"""Record the operations that would make the host wait for a CUDA device, on any device (the CPU included).

    with HostSyncs() as syncs:
        layer(queries).sum().backward()
    assert syncs.found == []

Two layers of torch's dispatch are watched, so that a CPU run sees what a CUDA run would wait on:

- the aten operators (a :class:`~torch.utils._python_dispatch.TorchDispatchMode`): ``_local_scalar_dense`` (what
  ``item()``, ``bool(t)``, ``int(t)``, ``float(t)`` and a Python condition on a tensor run), ``nonzero``,
  ``masked_select``, the ``unique`` family, ``equal``, ``is_nonzero``, ``repeat_interleave`` without
  ``output_size``, indexing or ``index_put_`` with a boolean mask (a hidden ``nonzero``), and any copy whose
  result is on another device than its input;
- the tensor methods that read a tensor into Python without an aten operator (a
  :class:`~torch.overrides.TorchFunctionMode`): ``tolist``, ``numpy``, ``item``, ``cpu`` (on a CUDA tensor a
  copy to the host), ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__``.

Each finding is a line ``op: where`` naming the innermost kvsearch frame that asked for it; :attr:`HostSyncs.on_floats`
keeps those on floating-point tensors (the embeddings a CUDA run keeps on the device, where the CPU run cannot tell
them from the integer ids a database keeps on the host by design).
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: aten operators that read a device value back to the host (or wait for the device to know an output's size).
SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,
    aten.is_nonzero.default,
}

#: Indexing operators: with a boolean mask they run a hidden ``nonzero``.
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}

#: Tensor methods that hand a tensor's values to Python (no aten operator runs for some of them).
SYNC_METHODS = {
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


def _where() -> str:
    """The innermost frame of the package (or of the test) that led here."""
    for frame in reversed(traceback.extract_stack()):
        if "/kvsearch/" in frame.filename and "_host_syncs" not in frame.filename:
            return f"{frame.filename.split('/kvsearch/')[-1]}:{frame.lineno} {frame.line}"
    return "outside kvsearch"


class _Ops(TorchDispatchMode):
    def __init__(self, found: list[tuple[str, torch.dtype]]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name, first = None, next((a for a in args if isinstance(a, torch.Tensor)), None)
        if func in SYNC_OPS:
            name = str(func)
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            name = str(func)
        elif func in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                name = f"{func} with a boolean mask"
        elif func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            target = args[0] if func is aten.copy_.default else out
            if source.device != target.device:
                name = f"{func} {source.device} -> {target.device}"
        if name is not None:
            self.found.append((f"{name}: {_where()}", None if first is None else first.dtype))
        return out


class _Methods(TorchFunctionMode):
    def __init__(self, found: list[tuple[str, torch.dtype]]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in SYNC_METHODS:
            self.found.append((f"Tensor.{func.__name__}: {_where()}", args[0].dtype))
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """A context that records every operation that would make the host wait for a CUDA device (see above)."""

    def __init__(self) -> None:
        self._found: list[tuple[str, torch.dtype]] = []
        self._modes = (_Methods(self._found), _Ops(self._found))

    @property
    def found(self) -> list[str]:
        """Every operation recorded, in order: ``op: where``."""
        return [text for text, _ in self._found]

    @property
    def on_floats(self) -> list[str]:
        """Those on floating-point tensors."""
        return [text for text, dtype in self._found if dtype is not None and dtype.is_floating_point]

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
