"""CUDA graph capture of a target's forward on the target's own GPU: one home for the warm-up, stream and device rule
that the static decoder (generate) and the static tapped target (evaluate) both capture with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["capture_graph"]


def capture_graph(device: torch.device, body: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``body`` on ``device`` as a CUDA graph; returns the graph and what the captured call returned (the
    tensors each replay refills).

    ``body`` runs twice on a side stream first (allocator, lazily loaded kernels, the first call's compiles of
    torch.compile'd functions: none of them may happen inside a capture), then once under capture. Everything runs
    with ``device`` current and is captured on a stream of ``device``: the model may sit on another GPU than the
    current one (``--device cuda:1``; a Dask task thread, which never set its device, has GPU 0 current), and a
    capture stream on the current GPU would record none of its kernels, leaving a graph whose replays do nothing.

    Raises:
        RuntimeError: the capture failed (an operation a graph cannot record: a host sync, a CPU copy, ...); the
            caller's stream is current again.

    Source followed: PyTorch's CUDA semantics notes, "CUDA Graphs" (whole-network capture: warm up on a side stream
    before capturing, replay with inputs copied into the captured tensors).
    """
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    body()
            current.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outputs = body()
        finally:  # a capture that fails raises again when it ends, before torch.cuda.graph restores the stream
            torch.cuda.set_stream(current)
    return graph, outputs
