"""The numeric precision of a fine-tuning run: its autocast, its gradient scaler, its optimizer step.

    mixed = MixedPrecision("bf16", device)     # checked: "fp16" needs a CUDA device
    with mixed.autocast():
        q = query_encoder(texts)               # the forward in bfloat16 where autocast lowers an op
    loss = loss_fn(batch_in_float32)           # the loss outside autocast, in float32
    mixed.backward(loss)                       # scaled first under "fp16"
    mixed.step(opt, step, epoch)               # unscale (fp16: skip a step with Inf gradients), step, check weights

``"fp32"`` (the default) is no autocast and no scaler: the run is what it was before precisions existed.
``"bf16"`` runs the forward (encoders, attention) under ``torch.autocast`` with bfloat16 on the run's device (CPU,
or a CUDA device that supports it); bfloat16 has float32's range, so no scaler is needed. ``"fp16"`` runs it under
float16 on CUDA only, with a :class:`torch.amp.GradScaler` (float16 gradients underflow without one; a step whose
gradients overflow is skipped and the scale shrinks, see :data:`FP16_INIT_SCALE`); on the CPU it is refused
(float16 autocast there is slow and has no use a CPU run wants). Autocast never changes a parameter's dtype: the
weights stay float32, the optimizer updates them in float32, and a commit writes float32 weights.

This module knows nothing of the database, the draft, the losses or the metrics.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Literal, get_args

import torch
from torch import Tensor

from kvsearch.errors import NonFiniteError, NotSupportedError

__all__ = ["PrecisionName", "PRECISIONS", "FP16_INIT_SCALE", "MixedPrecision", "optimizer_step"]

PrecisionName = Literal["fp32", "bf16", "fp16"]
#: The precisions a run may train in: float32, or autocast with bfloat16 / float16 (CUDA only).
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

#: The fp16 gradient scaler's first scale. torch's default, 2**16, overflows the float16 gradients of a retrieval
#: loss (its gradients carry 1 / temperature: 20x at 0.05) and skips the first steps of a run while it backs off
#: (3 of 16 steps on the tests' task with float16 autocast on the CPU: its history lags float32's); 2**10 skips none
#: there and still lifts a gradient of 1e-10 above float16's smallest subnormal (6e-8). The scale grows from there
#: as torch's does.
FP16_INIT_SCALE = 2.0**10


class MixedPrecision:
    """One run's precision on one device: the autocast to run the forward under, and the scaler for ``"fp16"``."""

    def __init__(self, precision: str, device: torch.device) -> None:
        """Check that the device can train in ``precision``.

        Args:
            precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (already checked as a name by ``FinetuneConfig``).
            device: the device the run trains on (the database's).

        Raises:
            NotSupportedError: ``"fp16"`` on a device other than CUDA, or ``"bf16"`` on a CUDA device without
                bfloat16 support.
        """
        self.precision = precision
        self.device_type = device.type
        if precision == "fp16" and device.type != "cuda":
            raise NotSupportedError(
                f'expected precision="fp16" on a CUDA device (float16 autocast with a gradient scaler), got device '
                f'{device.type}: use precision="bf16" on the CPU'
            )
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise NotSupportedError(
                f'expected precision="bf16" on a device with bfloat16 support, got {torch.cuda.get_device_name(device)}'
                ': use precision="fp16"'
            )
        self.dtype = _DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=FP16_INIT_SCALE) if precision == "fp16" else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the block under autocast in the run's low precision (nothing for ``"fp32"``)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss`` (0-dim, float32); under ``"fp16"`` scaled by the scaler first."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, opt: torch.optim.Optimizer, step: int, epoch: int) -> None:
        """The optimizer step (through the scaler under ``"fp16"``), then the check of every trained weight.

        Raises:
            NonFiniteError: see :func:`optimizer_step`.
        """
        optimizer_step(opt, step, epoch, self.scaler)


def optimizer_step(
    opt: torch.optim.Optimizer, step: int, epoch: int, scaler: torch.amp.GradScaler | None = None
) -> None:
    """One optimizer step, then a check that every trained parameter is still usable.

    A huge learning rate (finite, say 1e38) overflows float32 in the optimizer's own arithmetic (Adam's
    ``lr / bias_correction``: torch raises a RuntimeError "value cannot be converted to type float without
    overflow"), or in the weights: NaN / Inf, or weights so large that their squares overflow (beyond
    ``sqrt(finfo.max)``, 1.8e19 in float32: a norm or a dot product with them is Inf, a normalised embedding
    0). Each ends as NonFiniteError. With a ``scaler`` (``"fp16"``) the gradients are unscaled first and a step
    whose gradients hold Inf or NaN is skipped, as :class:`torch.amp.GradScaler` does (its scale then shrinks).

    Raises:
        NonFiniteError: the step overflowed, or left a weight NaN, Inf or beyond the square-root range
            (naming the step and epoch).
    """
    try:
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    except RuntimeError as exc:
        if "overflow" not in str(exc):
            raise
        lrs = sorted({group.get("lr") for group in opt.param_groups}, key=str)
        raise NonFiniteError(
            f"the optimizer step {step} (epoch {epoch}) overflowed float32 with lr={lrs}: {exc}; nothing was written"
        ) from exc
    params = [(p, group.get("lr")) for group in opt.param_groups for p in group["params"] if p.numel()]
    oks = []
    for param, _ in params:
        low, high = torch.aminmax(param.detach())  # NaN propagates; the comparisons below are then False
        limit = math.sqrt(torch.finfo(param.dtype).max)
        oks.append((low > -limit) & (high < limit))
    if oks and not bool(torch.stack(oks).all()):  # one device sync per step
        param, lr = next(pl for pl, ok in zip(params, oks) if not bool(ok))
        raise NonFiniteError(
            f"a trained weight of shape {tuple(param.shape)} is NaN, Inf or beyond "
            f"{math.sqrt(torch.finfo(param.dtype).max):.2g} (its square overflows) after step {step} "
            f"(epoch {epoch}) with lr={lr!r}: the run diverged; nothing was written"
        )
