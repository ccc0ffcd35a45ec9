"""Elementwise parts of a drafter layer (RMSNorm, q/k norm + RoPE, residual add + norm, SwiGLU) as pure functions,
run as ``torch.compile``'d fused kernels in eager mode on CUDA.

Why: on the block-token path (Q = A*B = 8192 rows per packed sequence at the 8B shape) each eager RMSNorm is ~6
passes over a ``[Q, H]`` float32 tensor forward and more backward, the q_norm/RoPE ~10 more; per layer that is
~18 GB of memory traffic (fwd+bwd), ~25 ms per 3072-token sequence over 5 layers on an H200. Fused (one kernel per
function forward, one or two backward, as Liger-Kernel / inductor do), the same math moves ~5x less. The GEMMs and
attention are untouched: "eager" still means eager layers with dynamic shapes.

The plain functions are the reference math and what runs on CPU, inside compiled layers (inductor fuses them there
anyway) and when fusion is off. The compiled versions treat the row dimension as dynamic from the first compile,
so batch shapes never recompile them (one graph per function and call-site dtype variant). If compiling fails the plain path is used with
a warning (as the fused cross-entropy chunk in ``loss.py`` does), except inside a CUDA graph capture: an error
there is the capture's (its caller runs the same work eagerly), and the plain path could not run inside the broken
capture either.

Legend: N rows, H hidden, D head_dim.
"""

from __future__ import annotations

import warnings

import torch
import torch._dynamo
import torch.nn.functional as F

__all__ = ["rms_norm", "add_rms_norm", "norm_rope", "swiglu", "set_fused_elementwise", "fused_elementwise_enabled"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None) -> torch.Tensor:
    """RMSNorm in float32, output in the input dtype (then ``out_dtype``): ``(w * (x*rsqrt(mean x^2 + eps)).to(dt))``."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * h.to(dtype)).to(dtype)
    return out if out_dtype is None else out.to(out_dtype)


def _add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                  out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + delta`` and ``rms_norm(h)`` (the post-attention norm of a pre-norm layer)."""
    h = residual + delta
    return h, _rms_norm(h, weight, eps, out_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """Per-head RMSNorm (Qwen3 q_norm / k_norm) then RoPE; x ``[N, heads, D]``, cos/sin ``[N, D]``."""
    x = _rms_norm(x, weight, eps, None)
    x = x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
    return x.to(out_dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_PLAIN = {"rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "norm_rope": _norm_rope, "swiglu": _swiglu}
_compiled: dict[str, object] = {}
_state = {"enabled": True, "backend": "inductor", "devices": ("cuda",), "failed": False}


def set_fused_elementwise(enabled: bool, *, backend: str = "inductor", devices: tuple[str, ...] = ("cuda",)) -> None:
    """Turn the compiled elementwise kernels on/off (default on, CUDA only). ``backend`` goes to ``torch.compile``;
    ``devices`` lists the device types that use them (tests add ``"cpu"`` with a cheap backend)."""
    _state.update(enabled=bool(enabled), backend=backend, devices=tuple(devices), failed=False)
    _compiled.clear()


def fused_elementwise_enabled(device: torch.device) -> bool:
    """True when the compiled kernels would be used for tensors on ``device`` (not while dynamo is tracing)."""
    return (_state["enabled"] and not _state["failed"] and device.type in _state["devices"]
            and not torch.compiler.is_compiling())


def _capturing() -> bool:
    """Whether a CUDA graph capture is under way on the current stream (no CUDA: False)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _call(name: str, *args):
    if fused_elementwise_enabled(args[0].device):
        fn = _compiled.get(name)
        if fn is None:
            # A few static variants per function (dtype / out_dtype / grad mode per call site) before the row
            # dimension goes dynamic; keep them above the default limit (8) so none silently falls back.
            for limit in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, limit):
                    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
            # One compiled wrapper per function: each has its own code object, hence its own graph cache.
            fn = _compiled[name] = torch.compile(_PLAIN[name], backend=_state["backend"])
        for arg in args:  # rows dynamic from the first compile: no recompile when the batch shape changes
            if isinstance(arg, torch.Tensor) and arg.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001  compiler missing/broken: same math, plain ops
            if _capturing():  # the capture's failure, not the compiler's: its caller falls back (dflash.decoding.static_target)
                raise
            _state["failed"] = True
            warnings.warn(f"fused elementwise kernel {name!r} failed to compile ({error!r}); using plain ops",
                          RuntimeWarning, stacklevel=3)
    return _PLAIN[name](*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm of ``[..., H]`` (see :func:`_rms_norm`); ``out_dtype`` folds the cast to the compute dtype in."""
    return _call("rms_norm", x, weight, eps, out_dtype)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + delta, rms_norm(residual + delta))``."""
    return _call("add_rms_norm", residual, delta, weight, eps, out_dtype)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """q_norm/k_norm + RoPE of ``[N, heads, D]`` with cos/sin ``[N, D]``, result in ``out_dtype``."""
    return _call("norm_rope", x, weight, eps, cos, sin, out_dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return _call("swiglu", gate, up)
