"""Which kernels run the drafter's training attention (FlexAttention with the step's BlockMask).

Two implementations of the same attention: flash-attn-4's CuTe DSL kernels (torch's FlexAttention
``kernel_options={"BACKEND": "FLASH"}``; Hopper and Blackwell GPUs, bf16/fp16; ``pip install 'dflash-stages[fa4]'``)
and inductor's Triton kernels (any CUDA GPU, any dtype). ``auto`` (the default) takes flash-attn-4's where they apply
and are installed, Triton's otherwise. Off CUDA the drafter uses the dense-mask SDPA path and none of this matters.

The choice is per process: ``DFLASH_ATTENTION_BACKEND`` (read at import; DDP workers inherit it), ``train
--attention-backend``, or :func:`set_attention_backend` (which also sets the variable, for processes started
later). Explicit FlexAttention ``kernel_options`` (:func:`set_flex_kernel_options`, for tuning) replace the choice.

Measured on one H200 (torch 2.11, flash-attn-4 4.0.0b36; docs/benchmarks.md): one 8B-shaped layer's attention at
batch 4 takes 2.08 ms forward and 7.42 ms backward on the flash kernels against Triton's 3.05 and 7.88, outputs and
gradients equal within bf16 rounding; the compiled batch-4 step of ``benchmarks/drafter_step.py`` goes from 485.3
to 476.8 ms (another H200, one process: 490.6 to 482.9 ms).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch

from dflash.errors import ConfigError

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionImplementation",
    "attention_backend",
    "attention_implementation",
    "attention_kernel_options",
    "flash_attention_applies",
    "flash_attention_available",
    "flex_kernel_options",
    "set_attention_backend",
    "set_flex_kernel_options",
]

AttentionBackend = Literal["auto", "flash", "triton"]
AttentionImplementation = Literal["flex-flash", "flex-triton", "dense-sdpa"]

#: The choices: ``flash`` = flash-attn-4's kernels, ``triton`` = inductor's, ``auto`` = flash where
#: :func:`flash_attention_applies` and :func:`flash_attention_available`, else triton.
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("auto", "flash", "triton")
ENV_VAR = "DFLASH_ATTENTION_BACKEND"
#: Head dims ``auto`` takes the flash kernels for (flash-attn-4 builds them for Hopper and Blackwell; the drafter
#: configs use them); ``flash`` forces them for others.
FLASH_HEAD_DIMS = (64, 128)
FLASH_DTYPES = (torch.bfloat16, torch.float16)

_state: dict = {
    "backend": os.environ.get(ENV_VAR, "auto").strip().lower() or "auto",  # validated at first use
    "kernel_options": None,  # explicit FlexAttention kernel_options (set_flex_kernel_options)
}


def _checked(name: str) -> AttentionBackend:
    name = str(name).strip().lower()
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {list(ATTENTION_BACKENDS)} "
                          f"(train --attention-backend or {ENV_VAR})")
    return name  # type: ignore[return-value]


def set_attention_backend(name: str) -> AttentionBackend:
    """Choose the attention kernels for this process and the processes it starts (sets ``DFLASH_ATTENTION_BACKEND``);
    case-insensitive. Returns the previous choice.

    Raises:
        ConfigError: a name not in :data:`ATTENTION_BACKENDS`.
    """
    name = _checked(name)
    previous = _state["backend"]
    _state["backend"] = name
    os.environ[ENV_VAR] = name
    return previous


def attention_backend() -> AttentionBackend:
    """The current choice (``auto``, ``flash`` or ``triton``).

    Raises:
        ConfigError: ``DFLASH_ATTENTION_BACKEND`` holds an unknown name.
    """
    return _checked(_state["backend"])


def set_flex_kernel_options(options: dict | None) -> None:
    """Set the FlexAttention ``kernel_options`` of every drafter attention call in this process (``None`` or
    ``{}``: back to the backend choice). For tuning and benchmarks; they replace the choice (add
    ``"BACKEND": "FLASH"`` to tune the flash path); a compiled layer recompiles once after a change."""
    _state["kernel_options"] = dict(options) if options else None


def flex_kernel_options() -> dict | None:
    """The ``kernel_options`` set with :func:`set_flex_kernel_options` (``None``: none set)."""
    options = _state["kernel_options"]
    return dict(options) if options else None


@functools.cache
def flash_attention_available() -> bool:
    """True when torch's FlexAttention has the FLASH backend and flash-attn-4's CuTe DSL (``flash_attn.cute``) really
    imports (a half-installed one, e.g. CUDA 13 wheels under a CUDA 12 torch, counts as absent). Imported once."""
    try:
        if importlib.util.find_spec("torch._inductor.kernel.flex.flex_flash_attention") is None:
            return False
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001  missing or broken install: the Triton kernels run instead
        return False
    return True


def flash_attention_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """True where ``auto`` takes flash-attn-4's kernels if installed: an NVIDIA (not ROCm) CUDA GPU of compute
    capability 9.0 or newer, q/k/v in bf16 or fp16, ``head_dim`` in :data:`FLASH_HEAD_DIMS`."""
    return (device.type == "cuda" and torch.version.hip is None and dtype in FLASH_DTYPES
            and head_dim in FLASH_HEAD_DIMS and torch.cuda.get_device_capability(device)[0] >= 9)


def attention_kernel_options(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict | None:
    """FlexAttention ``kernel_options`` for the drafter's attention on ``device`` with q/k/v in ``dtype``:
    options from :func:`set_flex_kernel_options` if set; else ``{"BACKEND": "FLASH"}`` for ``flash`` (and for
    ``auto`` where :func:`flash_attention_applies` and flash-attn-4 is installed), ``None`` (Triton) otherwise.

    Raises:
        ConfigError: ``flash`` chosen but flash-attn-4 is not installed, or for fp32 inputs (it has no fp32
            kernels); an unknown ``DFLASH_ATTENTION_BACKEND``.
    """
    explicit = flex_kernel_options()
    if explicit:
        return explicit
    name = attention_backend()
    if name == "auto":
        name = "flash" if flash_attention_applies(device, dtype, head_dim) and flash_attention_available() else "triton"
    if name == "triton":
        return None
    if not flash_attention_available():
        raise ConfigError(
            "attention backend 'flash' needs flash-attn-4's CuTe DSL (import flash_attn.cute failed): install it "
            "with pip install 'dflash-stages[fa4]', or choose --attention-backend triton"
        )
    if dtype not in FLASH_DTYPES:
        raise ConfigError(f"attention backend 'flash' runs bf16/fp16 only, this run computes in {dtype}; train with "
                          "--mixed-precision bf16 or choose --attention-backend triton")
    return {"BACKEND": "FLASH"}


def attention_implementation(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionImplementation:
    """What runs the drafter's training attention: ``"flex-flash"``, ``"flex-triton"`` or, off CUDA,
    ``"dense-sdpa"`` (the dense-mask path, whatever the choice). For run records and logs.

    Raises:
        ConfigError: as :func:`attention_kernel_options` (the choice is validated on every device).
    """
    if device.type != "cuda":
        attention_backend()  # a bad DFLASH_ATTENTION_BACKEND is an error here too
        return "dense-sdpa"
    options = attention_kernel_options(device, dtype, head_dim) or {}
    return "flex-flash" if options.get("BACKEND") == "FLASH" else "flex-triton"
