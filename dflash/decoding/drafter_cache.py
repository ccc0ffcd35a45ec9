"""The drafter's context keys and values kept from one draft-verify cycle to the next, each cycle's steps captured as
CUDA graphs (:class:`GraphedDrafter`).

In a decoding loop the drafter drafts every block over the tapped target states of every token accepted so far. A
context row's keys and values in each drafter layer depend on that row alone, so, as the serving engines keep the
drafter's context in a KV cache, :class:`GraphedDrafter` computes them once per accepted token into fixed-size
buffers instead of running the whole context through the drafter at every cycle; and since its two steps (write a
window of rows, draft one block) have one shape for every cycle, on CUDA each is captured once as a CUDA graph and
replayed, which at batch 1, where a small drafter's forward is a few hundred kernel launches, is most of the gain.
It drafts for either target of :func:`dflash.decoding.speculative.speculative_generate` (the dynamic-cache
``TappedTarget`` or :class:`dflash.decoding.static_target.StaticTappedTarget`): the drafter's context does not depend
on the target's cache.

Source followed: PyTorch's CUDA graph capture (warm-up on a side stream, then ``torch.cuda.graph``;
:func:`dflash.target.graphs.capture_graph`); the serving engines' DFlash drafters (vLLM ``qwen3_dflash.py``, SGLang
``models/dflash.py``), which keep the drafter's context keys and values in its own KV cache.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from dflash.target.graphs import capture_graph

__all__ = ["GraphedDrafter"]

log = logging.getLogger(__name__)


class GraphedDrafter(torch.nn.Module):
    """A DFlash drafter that keeps its context's keys and values across cycles, each cycle's work captured once as
    a CUDA graph.

    A context row's keys and values in every drafter layer depend on that row's tapped target states alone
    (:meth:`dflash.drafter.DFlashDrafter.context_keys_values`), so, as the serving engines keep the drafter's context
    in a KV cache, this wrapper computes them once per accepted token into fixed-size ``[capacity, kv_heads, D]``
    buffers instead of running the whole context through the drafter's projections at every cycle. A cycle writes a
    window of ``B`` rows (the block size: the most rows one cycle can accept) ending at the block's start, which
    holds every row accepted since the last cycle, then drafts over the buffers with the rows past the block's start
    masked out (``draft_block_cached(..., context_valid=...)``). Both steps have one shape for every cycle: on CUDA
    each is captured at its first use and replayed after. A prompt (more new rows than a window) is written window
    after window through the same step. Without CUDA the same steps run eagerly. Returns ``[B, V]`` float32 logits
    like the drafter's; those of a replay are overwritten by the next draft.

    The loop hands the drafter a prefix of one buffer per generation (``context_hidden[:position]``) whose rows it
    never rewrites once passed: the wrapper keeps the rows it has written for as long as the same buffer comes
    back, and starts over when another buffer (a new generation) or a shorter prefix comes.

    Args:
        drafter: a :class:`dflash.drafter.DFlashDrafter` (``context_keys_values`` and ``draft_block_cached``).
        capacity: context rows the buffers hold (prompt + new tokens + one block, as the target's cache).
        cuda_graphs: capture the steps (CUDA only).
    """

    def __init__(self, drafter: torch.nn.Module, capacity: int, *, cuda_graphs: bool = True) -> None:
        super().__init__()
        self.drafter = drafter
        self.config = drafter.config
        parameter = next(drafter.parameters())
        self.device, self.capacity = parameter.device, int(capacity)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._width = drafter.config.num_taps * drafter.config.hidden_size
        self._dtype = parameter.dtype
        # Plain tensors even when built under inference mode: the start positions are written in place at every
        # cycle, which an inference tensor refuses outside that mode (see _allocate).
        with torch.inference_mode(False):
            self._positions = torch.arange(self.capacity, device=self.device)
            # The end of the window being written, then the block's start: the write step's rows end there, the
            # draft step's block starts there (one fill per cycle serves both).
            self._start = torch.zeros((), dtype=torch.int64, device=self.device)
        self._window: torch.Tensor | None = None  # [B, n*H] taps of the rows being written
        self._block: torch.Tensor | None = None
        self._keys_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer, [capacity, kv, D]
        self._graphs: dict[str, tuple[torch.cuda.CUDAGraph, Any]] = {}  # step -> its graph and outputs
        self._failed = False
        self._source: weakref.ref | None = None  # the storage of the loop's buffer the written rows came from
        self._origin: tuple | None = None  # the prefix's storage offset and strides in it
        self._written = 0  # rows 0 .. _written - 1 of that buffer hold their keys and values
        #: Drafts replayed from the graph and run eagerly (benchmarks and the evaluation report read them).
        self.replays = 0
        self.eager_drafts = 0

    def draft_block(self, context_hidden: torch.Tensor, context_positions: torch.Tensor,
                    block_input_ids: torch.Tensor, block_start: int) -> torch.Tensor:
        """:meth:`dflash.drafter.DFlashDrafter.draft_block` for the loop's context prefix ``context_hidden``
        ``[block_start, n*H]`` at positions ``0 .. block_start - 1`` (what the loop passes).

        Raises:
            ValueError: the context or the block runs past ``capacity``.
        """
        rows, size = context_hidden.shape[0], block_input_ids.numel()
        if rows != block_start or block_start + size > self.capacity:
            raise ValueError(f"the graphed drafter holds {self.capacity} positions of a context that starts at 0; got "
                             f"{rows} context rows and a block at {block_start}")
        if self._block is None or self._block.shape != block_input_ids.shape:
            self._allocate(size)
        # The loop's buffer is recognised by its storage (and where the prefix starts in it), not by a tensor
        # object: each cycle's prefix is a new view, and under inference mode a view records no ``_base``.
        storage, origin = context_hidden.untyped_storage(), (context_hidden.storage_offset(), context_hidden.stride())
        if self._source is None or self._source() is not storage or self._origin != origin or rows < self._written:
            self._source, self._origin, self._written = weakref.ref(storage), origin, 0
        while rows - self._written > size:  # more new rows than one window: a prompt, window after window
            self._write_window(context_hidden, self._written, rows)
            self._written += size
        self._write_window(context_hidden, max(0, rows - size), rows)  # leaves _start at rows, the block's start
        self._written = rows
        self._block.copy_(block_input_ids)
        logits, replayed = self._run("draft", self._draft)
        self.replays += replayed
        self.eager_drafts += not replayed
        return logits

    def _allocate(self, size: int) -> None:
        """Buffers for blocks of ``size`` tokens (zeros: rows not yet written are weighted by zero, and 0 x NaN would
        still be NaN); a new block size starts the context over and captures again."""
        # Plain tensors even when the loop drafts under inference mode: they are written in place at every cycle,
        # which an inference tensor refuses outside that mode.
        with torch.inference_mode(False):
            self._window = torch.zeros((size, self._width), dtype=self._dtype, device=self.device)
            self._block = torch.zeros(size, dtype=torch.int64, device=self.device)
            probe = self.drafter.context_keys_values(self._window, self._positions[:size])  # their shapes, dtypes
            self._keys_values = [tuple(torch.zeros((self.capacity, *t.shape[1:]), dtype=t.dtype, device=self.device)
                                       for t in pair) for pair in probe]  # fmt: skip
        self._graphs.clear()
        self._failed, self._source, self._written = False, None, 0

    def _write_window(self, context_hidden: torch.Tensor, first: int, rows: int) -> None:
        """Write the keys and values of the window of rows ``first .. first + B - 1`` (those from ``rows`` on are
        zeros here, overwritten once accepted); ``_start`` is left at the window's last row to write + 1."""
        window = self._window
        count = min(rows, first + window.shape[0]) - first
        window[:count].copy_(context_hidden[first : first + count])
        if count < window.shape[0]:
            window[count:].zero_()
        self._start.fill_(first + count)
        self._run("write", self._write)

    def _write(self) -> None:
        # The window's first row: B rows before its end, or row 0 while fewer than B rows are written (a prompt
        # shorter than a block: ``first + count`` is then ``rows`` < B).
        size = self._window.shape[0]
        positions = (self._start - size).clamp_min(0) + self._positions[:size]
        new = self.drafter.context_keys_values(self._window, positions)
        for kept, computed in zip(self._keys_values, new, strict=True):
            for buffer, rows in zip(kept, computed, strict=True):
                buffer.index_copy_(0, positions, rows)

    def _draft(self) -> torch.Tensor:
        return self.drafter.draft_block_cached(self._keys_values, self._block, self._start,
                                               context_valid=self._positions < self._start)

    def _run(self, name: str, step) -> tuple[Any, bool]:
        """``step``'s outputs and whether its graph replayed them (captured at the step's first use), or the step run
        eagerly without CUDA graphs (or once a capture failed). A replay's outputs are the capture's tensors, which
        the next replay overwrites."""
        if name not in self._graphs and self.cuda_graphs and not self._failed:
            try:
                self._graphs[name] = capture_graph(self.device, step)
            except RuntimeError as exc:  # pragma: no cover - depends on the drafter's kernels and the CUDA build
                log.warning("CUDA graph capture of the drafter's %s step failed (%s); drafting eagerly", name, exc)
                self._failed = True
                self._graphs.clear()
                torch.cuda.synchronize(self.device)
        if name not in self._graphs:
            return step(), False
        graph, outputs = self._graphs[name]
        graph.replay()
        return outputs, True
