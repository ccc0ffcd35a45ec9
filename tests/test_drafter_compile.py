"""The fixed-shape path under torch.compile equals eager, and recompiles only when the shape (bucket) changes."""

from __future__ import annotations

import torch
import torch._dynamo
from drafter_fixtures import packed_batch, tiny_drafter

from dflash.drafter import dflash_loss, sample_anchors


def test_compiled_fixed_shape_path_equals_eager_and_recompiles_per_bucket_only():
    torch._dynamo.reset()
    compiles = []

    def counting_backend(graph_module, example_inputs):
        compiles.append(len(example_inputs))
        return graph_module.forward  # run the captured graph as is (fast on 2 CPU cores)

    eager = tiny_drafter(4, dtype=torch.float32).train()
    compiled = tiny_drafter(4, dtype=torch.float32).train()
    compiled.compile_layers(backend=counting_backend, fullgraph=True)
    buckets = {64: 24, 96: 32}  # padded length -> anchor slots (fixed shapes per bucket)
    for step, lengths in enumerate([[30, 20], [64], [40, 41], [33, 33, 20]]):
        bucket = min(b for b in buckets if b >= sum(lengths))
        batch = packed_batch(lengths, width=64, vocab=97, seed=step, padding=bucket - sum(lengths),
                             dtype=torch.float32)
        anchors = sample_anchors(batch, 4, 8, torch.Generator().manual_seed(step), num_anchors=buckets[bucket])
        outputs = []
        for model in (eager, compiled):
            model.zero_grad()
            out = dflash_loss(model, batch, anchors)
            out.loss().backward()
            outputs.append((out.weighted_ce_sum.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(outputs[0][0], outputs[1][0], rtol=1e-5, atol=1e-5)
        for a, b in zip(outputs[0][1], outputs[1][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # One graph per bucket, shared by every layer, whatever the documents inside.
    assert len(compiles) == len(buckets), compiles
