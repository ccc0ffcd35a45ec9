"""The fixed-shape path under torch.compile equals eager, and recompiles only when the shape (bucket) changes."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from drafter_fixtures import packed_batch, tiny_drafter

from dflash.drafter import dflash_loss, sample_anchors


def test_compiled_fixed_shape_path_equals_eager_and_recompiles_per_bucket_only():
    """Compiled layers give eager's loss and gradients; graphs are bounded by the buckets."""
    torch._dynamo.reset()
    compiles = []

    def counting_backend(graph_module, example_inputs):
        compiles.append(len(example_inputs))
        return graph_module.forward  # run the captured graph as is (fast on 2 CPU cores)

    eager = tiny_drafter(4, dtype=torch.float32, num_hidden_layers=4).train()
    compiled = tiny_drafter(4, dtype=torch.float32, num_hidden_layers=4).train()
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
    # Per bucket, whatever the documents inside: one graph for the first layer (its A + 1 distinct input rows), one
    # shared by the middle layers, one for the last (anchor rows dropped): 3 per bucket, not one per layer or step.
    assert len(compiles) == 3 * len(buckets), compiles
    assert compiled.compiled_graphs == len(compiles)  # the trainer's logged count agrees with dynamo's compiles
    assert eager.compiled_graphs == 0


@pytest.mark.gpu
def test_fixed_shape_anchors_and_block_mask_do_not_sync_the_host():
    from dflash.drafter import attention_layout, flex_block_mask

    batch = packed_batch([700, 300, 200], width=64, vocab=97, padding=24, dtype=torch.float32).to("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        anchors = sample_anchors(batch, 16, 64, generator, num_anchors=192)
        flex_block_mask(attention_layout(anchors, batch.position_ids, 16))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_compiled_layers_with_block_mask_equal_eager_on_cuda():
    drafter = tiny_drafter(0, dtype=torch.float32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=256, block_size=16).cuda().train()
    batch = packed_batch([700, 300], width=256, vocab=97, padding=24, dtype=torch.float32).to("cuda")
    anchors = sample_anchors(batch, 16, 64, torch.Generator(device="cuda").manual_seed(0), num_anchors=128)
    results = []
    for compiled in (False, True):
        if compiled:
            drafter.compile_layers()
        drafter.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = dflash_loss(drafter, batch, anchors)
        out.loss().backward()
        results.append((out.loss().detach(), drafter.fc.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=5e-2, atol=5e-3)
