"""The kept-context drafter (dflash/decoding/drafter_cache.py): its drafts over the context keys and values it keeps
equal the drafter's own over the exact context, along generations driven as the loop drives them; its fused
kernels compile at the first draft only. Inside the loop: every evaluate test (CPU), and tests/test_static_target.py's
GPU tests (captured graphs against the eager loop)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_static_target import _llama, _tiny_drafter

from dflash.decoding.drafter_cache import GraphedDrafter


def test_graphed_drafter_drafts_what_the_drafter_drafts():
    """Over its kept context keys and values (rows past the context masked, stale rows of a longer earlier context
    left in the buffers) the wrapper's draft equals the drafter's own on the exact context; built and first used
    under inference mode (as the loop drafts), it drafts outside it too (its tensors are plain ones)."""
    drafter = _tiny_drafter(_llama())
    width = drafter.config.num_taps * drafter.config.hidden_size
    with torch.inference_mode():
        graphed = GraphedDrafter(drafter, capacity=96)
    generator = torch.Generator().manual_seed(0)
    block = torch.tensor([5, 0, 0, 0, 0, 0])
    for rows in (60, 7, 33):  # each a new context: the 7-row one leaves 53 stale rows of the first in the buffers
        context = torch.randn(rows, width, generator=generator)
        expected = drafter.draft_block(context, torch.arange(rows), block, rows)
        with torch.inference_mode(rows == 60):
            drafted = graphed.draft_block(context, torch.arange(rows), block, rows)
        torch.testing.assert_close(drafted, expected, atol=1e-4, rtol=1e-4)
        assert not torch.equal(expected, drafter.draft_block(context[:-1], torch.arange(rows - 1), block, rows))
    assert graphed.eager_drafts == 3 and graphed.replays == 0
    with pytest.raises(ValueError, match="holds 96 positions"):
        graphed.draft_block(torch.zeros(92, width), torch.arange(92), block, 92)


def test_graphed_drafter_keeps_each_rows_keys_across_the_cycles_of_a_generation():
    """As the loop drives it, under inference mode (where each cycle's prefix is a new view that records no
    ``_base``): prefixes of one buffer growing by 1 .. B rows per cycle (a prompt shorter than a block first), then a
    new generation in another buffer with a longer prompt than the first's whole context, then that buffer rewritten
    and passed again from a shorter prefix: every draft equals the drafter's own over the exact context, though the
    wrapper computes a row's keys and values only in the cycles whose window holds it (a prompt window after window,
    then one window per cycle)."""
    drafter = _tiny_drafter(_llama())
    reference = copy.deepcopy(drafter)
    width = drafter.config.num_taps * drafter.config.hidden_size
    graphed = GraphedDrafter(drafter, capacity=96)
    windows, compute = [], drafter.context_keys_values
    drafter.context_keys_values = lambda hidden, positions: windows.append(hidden.shape[0]) or compute(hidden, positions)
    generator = torch.Generator().manual_seed(1)
    block = torch.tensor([9, 0, 0, 0, 0, 0])
    with torch.inference_mode():
        first, second = torch.randn(96, width, generator=generator), torch.randn(96, width, generator=generator)
        for buffer, prefixes in ((first, (3, 4, 10, 16, 17, 23)), (second, (40, 46, 47, 52)), (second, (20, 26))):
            if prefixes[0] == 20:
                buffer.copy_(torch.randn(96, width, generator=generator))
            for rows in prefixes:
                expected = reference.draft_block(buffer[:rows], torch.arange(rows), block, rows)
                torch.testing.assert_close(graphed.draft_block(buffer[:rows], torch.arange(rows), block, rows),
                                           expected, atol=1e-4, rtol=1e-4)
    assert graphed.eager_drafts == 12
    # The buffers' probe; 1 window per cycle of the first buffer; ceil(40 / 6) for the second's prompt, then 1 per
    # cycle; ceil(20 / 6) from the shorter prefix, then 1.
    assert set(windows) == {6} and len(windows) == 1 + 6 + (7 + 3) + (4 + 1)


def test_graphed_drafter_compiles_its_fused_kernels_at_the_first_draft_only():
    """The drafter's elementwise kernels are torch.compile'd on CUDA (dflash/drafter/fused.py; forced on here with a
    CPU backend): every draft over the fixed-size buffer has the same shapes, so all compiles happen in the first
    call (on CUDA the first warm-up, outside the capture) and no later draft, whatever its context length, compiles
    again (a compile inside a capture would break it)."""
    from torch._dynamo.utils import counters

    from dflash.drafter import fused

    torch._dynamo.reset()
    fused.set_fused_elementwise(True, backend="eager", devices=("cpu",))
    try:
        drafter = _tiny_drafter(_llama(), layers=1)
        width = drafter.config.num_taps * drafter.config.hidden_size
        graphed = GraphedDrafter(drafter, capacity=96)
        compiled = []
        with torch.inference_mode():  # as the loop drafts
            for rows in (60, 7, 90):
                before = counters["stats"]["unique_graphs"]
                graphed.draft_block(torch.randn(rows, width), torch.arange(rows), torch.tensor([5, 0, 0, 0, 0, 0]), rows)
                compiled.append(counters["stats"]["unique_graphs"] - before)
        assert compiled[0] > 0 and compiled[1:] == [0, 0]
        assert fused.fused_elementwise_enabled(torch.device("cpu"))
    finally:
        fused.set_fused_elementwise(True)
        torch._dynamo.reset()
