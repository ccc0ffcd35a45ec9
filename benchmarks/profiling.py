"""The benchmarks' shared device instrumentation: torch.profiler summaries and the CUDA caching allocator's counters.

* :func:`profiled` runs a callable under ``torch.profiler`` (CPU activity, and CUDA where the device is CUDA; the
  calling thread's operators only, so :func:`start_profiler_here` first in the main thread where it runs in others);
  :func:`summarize` reads the profile: on CUDA the kernels and their device time, on CPU the ``aten::`` operators
  and their own CPU time (there are no kernels), the most expensive first, and the CUDA runtime calls counted by
  name (:data:`RUNTIME_CALLS`: allocations, copies, synchronizations).
* :func:`allocator_counters` and :func:`allocator_window`: the deltas of ``torch.cuda.memory_stats()`` counters
  between two moments (:data:`ALLOCATOR_COUNTERS`: ``cudaMalloc`` and ``cudaFree`` calls of the caching allocator,
  its retries after a failed ``cudaMalloc`` (which free cached blocks and synchronize), its waits for every stream)
  and the peak allocated and reserved bytes since :func:`reset_allocator_peaks`. CUDA only: off CUDA they return
  ``None`` and :func:`allocator_line` says so.

* :func:`operator_counts` counts a profile's ``aten::`` operator calls by name, inside and outside the ranges
  marked with a ``record_function`` label (:func:`marked`: e.g. every ``TargetRunner.forward``), top-level calls
  (those the Python code makes, not the ones they make in turn) and all, with the calls that make a CUDA host
  wait for the device (:data:`SYNC_OPERATORS`); on CPU the same Python code calls the same operators, so the
  counts of what a GPU host issues are read on CPU. It also counts the top-level calls that launch work on a CUDA
  device (every one but those of :data:`NO_KERNEL_OPERATORS`: views, allocations, no-op conversions) and, within
  :func:`host_transfers`, the ``.tolist()`` reads and ``torch.tensor(..., device=...)`` creations, which a CUDA
  host pays as copies (and a wait, for a read) but CPU runs as no operator at all.

Used by ``benchmarks/speculative_loop.py --profile`` and ``benchmarks/online.py`` (``--profile`` and its allocator
lines).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: CUDA runtime calls counted by :func:`summarize` (the profiler's runtime events, version suffixes dropped;
#: ``kernel launches``: every ``cudaLaunchKernel*`` and ``cuLaunchKernel*`` call, runtime or driver).
RUNTIME_CALLS = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaHostRegister", "cudaMemcpyAsync",
                 "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "kernel launches")

#: ``torch.cuda.memory_stats()`` counters whose deltas :func:`allocator_window` reports.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")

#: ``aten::`` operators that make the host wait for a CUDA device wherever they run on it: a tensor's value read
#: on the host (``.item()``, ``bool()``, ``int()``: ``_local_scalar_dense``) and outputs whose size depends on the
#: data (``nonzero``, and boolean indexing through it). Device-to-host copies and ``.tolist()`` of a device tensor
#: are CUDA's only (on CPU they are no copy at all): :data:`RUNTIME_CALLS` counts those.
SYNC_OPERATORS = ("aten::_local_scalar_dense", "aten::nonzero")

#: ``aten::`` operators that launch no kernel on a CUDA device: views and reshapes, metadata, allocations, and the
#: conversions that return their input (``aten::to`` to the same dtype and device calls nothing underneath, one
#: that converts calls ``_to_copy``, counted by its callee).
NO_KERNEL_OPERATORS = frozenset(f"aten::{name}" for name in (
    "alias", "as_strided", "detach", "detach_", "empty", "empty_like", "empty_strided", "expand", "lift_fresh",
    "narrow", "permute", "reshape", "_reshape_alias", "resolve_conj", "resolve_neg", "select", "slice", "split",
    "squeeze", "t", "to", "transpose", "unbind", "unflatten", "unsqueeze", "view", "_unsafe_view", "contiguous",
    "item", "_local_scalar_dense", "result_type"))

#: ``record_function`` labels of the host transfers :func:`host_transfers` marks: a device tensor read on the host
#: (``.tolist()``: a device-to-host copy and a wait for the device on CUDA) and a tensor made from host values on a
#: device (``torch.tensor(..., device=...)``: a host-to-device copy on CUDA).
HOST_READ = "host read: Tensor.tolist"
HOST_WRITE = "host write: torch.tensor(device=...)"

_SUFFIX = re.compile(r"(_v\d+|_ptsz|_ptds)+$")  # cudaMemcpyAsync_v3020, cudaMemcpyAsync_ptsz: the same call
_LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel)")


def profiled(fn: Callable[[], Any], device: torch.device) -> tuple[Any, Any]:
    """``(fn(), the torch.profiler profile of that call)``: CPU activity, and CUDA's where ``device`` is CUDA (the
    device is synchronized before the profile ends, so every kernel ``fn`` queued is in it). Only the calling
    thread's operators are recorded: call this in the thread that does the work."""
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        result = fn()
        if on_device:
            torch.cuda.synchronize(device)
    return result, prof


def start_profiler_here(device: torch.device) -> None:
    """An empty profile in the calling thread (call it in the main thread before :func:`profiled` runs in
    others): the profiler's backend (kineto) initializes its client on the first profile and, where that happens
    in another thread than the one that registered it, prints an error and skips it."""
    profiled(lambda: None, device)


def summarize(prof: Any, on_device: bool, top: int = 6) -> dict[str, Any]:
    """What a profile holds: ``busy_ms`` (on CUDA the device time of its kernels and copies, on CPU the ``aten::``
    operators' own time), ``calls`` (kernels and copies on the device / operator calls), ``top`` (the ``top`` most expensive as ``(name, count,
    ms)``), ``runtime_calls`` (per name of :data:`RUNTIME_CALLS`, the calls made; on CPU none) and ``on_device``."""
    averages = prof.key_averages()
    if on_device:  # the kernels and their device time
        events, own = [e for e in averages if e.device_type.name == "CUDA"], (lambda e: e.self_device_time_total)
    else:  # on CPU: the operators' own time (no kernels to count)
        events, own = [e for e in averages if e.key.startswith("aten::")], (lambda e: e.self_cpu_time_total)
    runtime = dict.fromkeys(RUNTIME_CALLS, 0)
    for event in averages:
        name = "kernel launches" if _LAUNCH.match(event.key) else _SUFFIX.sub("", event.key)
        if name in runtime:  # no kernel is named like a runtime call
            runtime[name] += event.count
    return {"busy_ms": sum(own(e) for e in events) / 1000, "calls": sum(e.count for e in events),
            "top": [(e.key, e.count, own(e) / 1000) for e in sorted(events, key=own, reverse=True)[:top]],
            "runtime_calls": runtime, "on_device": on_device}  # fmt: skip


def marked(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """``fn`` with every call inside a ``torch.profiler.record_function(label)`` range (for
    :func:`operator_counts`; free outside a profile)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return call


@contextmanager
def host_transfers() -> Iterator[None]:
    """Within: every ``Tensor.tolist()`` call inside a ``record_function`` range named :data:`HOST_READ`, every
    ``torch.tensor(..., device=...)`` call inside one named :data:`HOST_WRITE` (for :func:`operator_counts`; they
    are the methods of ``torch``, so every module's calls are seen)."""
    tolist, tensor = torch.Tensor.tolist, torch.tensor

    def read(self: torch.Tensor) -> Any:
        with torch.profiler.record_function(HOST_READ):
            return tolist(self)

    def write(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            return tensor(*args, **kwargs)
        with torch.profiler.record_function(HOST_WRITE):
            return tensor(*args, **kwargs)

    torch.Tensor.tolist, torch.tensor = read, write
    try:
        yield
    finally:
        torch.Tensor.tolist, torch.tensor = tolist, tensor


def operator_counts(prof: Any, label: str) -> dict[str, Any]:
    """The ``aten::`` operator calls of a profile, by name, inside the ``record_function`` ranges named ``label``
    (:func:`marked`) and outside them: ``inside`` and ``outside`` (top-level calls per name: the ones Python code
    makes, whose own calls are not counted again), ``inside_all`` and ``outside_all`` (every call, nested ones
    included), ``launches_inside`` and ``launches_outside`` (top-level calls that launch work on a CUDA device:
    those with a call outside :data:`NO_KERNEL_OPERATORS` in them, themselves included), ``syncs_inside`` and
    ``syncs_outside`` (calls of :data:`SYNC_OPERATORS`, nested ones included), ``reads_inside`` / ``reads_outside``
    and ``writes_inside`` / ``writes_outside`` (the :data:`HOST_READ` and :data:`HOST_WRITE` ranges of
    :func:`host_transfers`) and ``ranges`` (how many ``label`` ranges). The profile's own thread only
    (:func:`profiled`)."""
    inside: dict[str, int] = {}
    outside: dict[str, int] = {}
    totals = dict.fromkeys(("inside_all", "outside_all", "launches_inside", "launches_outside", "syncs_inside",
                            "syncs_outside", "reads_inside", "reads_outside", "writes_inside", "writes_outside",
                            "ranges"), 0)  # fmt: skip
    launching: set[int] = set()  # ids of the top-level calls with a kernel-launching call in them
    for event in prof.events():
        if event.name == label:
            totals["ranges"] += 1
        transfer = {HOST_READ: "reads", HOST_WRITE: "writes"}.get(event.name)
        if not event.name.startswith("aten::") and transfer is None:
            continue
        in_range, top, parent = False, event, event.cpu_parent
        while parent is not None:
            in_range = in_range or parent.name == label
            top = parent if parent.name.startswith("aten::") else top
            parent = parent.cpu_parent
        where = "inside" if in_range else "outside"
        if transfer is not None:
            totals[f"{transfer}_{where}"] += 1
            continue
        totals[f"{where}_all"] += 1
        totals[f"syncs_{where}"] += event.name in SYNC_OPERATORS
        if event.name not in NO_KERNEL_OPERATORS and id(top) not in launching:
            launching.add(id(top))
            totals[f"launches_{where}"] += 1
        if top is event:
            counts = inside if in_range else outside
            counts[event.name] = counts.get(event.name, 0) + 1
    return {"inside": inside, "outside": outside, **totals}


def allocator_counters(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's :data:`ALLOCATOR_COUNTERS` now (cumulative since the process started); ``None``
    off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTERS}


def reset_allocator_peaks(device: torch.device) -> None:
    """Start the peaks :func:`allocator_window` reports from now (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocator_window(before: dict[str, int] | None, after: dict[str, int] | None,
                     device: torch.device) -> dict[str, int] | None:  # fmt: skip
    """The counters' increase from ``before`` to ``after`` (two :func:`allocator_counters`), with the peak
    allocated and reserved bytes since the last :func:`reset_allocator_peaks` (``peak_allocated_bytes``,
    ``peak_reserved_bytes``); ``None`` off CUDA."""
    if before is None or after is None:
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: after[name] - before[name] for name in ALLOCATOR_COUNTERS} | {
        "peak_allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
        "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0))}


def allocator_line(window: dict[str, int] | None) -> str:
    """``cudaMalloc +3, cudaFree +0, ...`` for :func:`allocator_window`'s figures; off CUDA, that they are CUDA's."""
    if window is None:
        return "CUDA only (torch.cuda.memory_stats)"
    return (f"cudaMalloc +{window['num_device_alloc']}, cudaFree +{window['num_device_free']}, alloc retries "
            f"+{window['num_alloc_retries']}, syncs of all streams +{window['num_sync_all_streams']}, peak allocated "
            f"{window['peak_allocated_bytes'] / 2**30:.2f} GiB, peak reserved {window['peak_reserved_bytes'] / 2**30:.2f} GiB")
