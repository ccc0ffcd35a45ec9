"""The fused (torch.compile'd) elementwise kernels of an eager drafter layer run the same math as the plain ops.

On CUDA they are on by default; here they are forced on for CPU with the ``aot_eager`` backend, which exercises the
same dynamo capture and AOTAutograd forward/backward split without a C++ build (inductor codegen is torch's)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from drafter_fixtures import packed_batch, random_anchors, tiny_drafter

from dflash.drafter import dflash_loss, fused


@pytest.fixture
def fused_on_cpu():
    torch._dynamo.reset()
    fused.set_fused_elementwise(True, backend="aot_eager", devices=("cpu", "cuda"))
    yield
    fused.set_fused_elementwise(True)
    torch._dynamo.reset()


def _loss_and_grads(drafter, batch, anchors, autocast: bool):
    drafter.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = dflash_loss(drafter, batch, anchors)
        loss = out.loss()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in drafter.parameters()]


def test_fused_elementwise_equals_plain_ops_forward_and_backward(fused_on_cpu):
    drafter = tiny_drafter(3, dtype=torch.float32).train()
    # Two shapes (the second call goes dynamic), float32 then the bf16 autocast recipe.
    for step, (lengths, autocast) in enumerate([([40, 23], False), ([57], True)]):
        batch = packed_batch(lengths, width=64, vocab=97, seed=step, dtype=torch.float32)
        anchors = random_anchors(batch, 4, 12, seed=step)
        fused.set_fused_elementwise(True, backend="aot_eager", devices=("cpu",))
        assert fused.fused_elementwise_enabled(torch.device("cpu"))
        got_loss, got_grads = _loss_and_grads(drafter, batch, anchors, autocast)
        fused.set_fused_elementwise(False)
        assert not fused.fused_elementwise_enabled(torch.device("cpu"))
        want_loss, want_grads = _loss_and_grads(drafter, batch, anchors, autocast)
        tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_loss, want_loss, **tol)
        for got, want in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(got, want, **tol)


def test_fused_functions_match_reference_math(fused_on_cpu):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 8, generator=generator, dtype=torch.float32, requires_grad=True)
    weight = torch.rand(8, generator=generator) + 0.5
    angles = torch.rand(37, 4, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    got = fused.norm_rope(x, weight, 1e-6, cos, sin, torch.float32)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    rotated = torch.cat([-normed[..., 4:], normed[..., :4]], -1)
    want = normed * cos[:, None] + rotated * sin[:, None]
    torch.testing.assert_close(got, want)
    # RoPE is a rotation: it keeps each half-pair's norm (the norm's output scale survives).
    torch.testing.assert_close(got.pow(2).sum(-1), normed.pow(2).sum(-1))
    (grad,) = torch.autograd.grad(got.sum(), x)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(grad, want_grad)
    gate, up = torch.randn(2, 5, 16, generator=generator)
    torch.testing.assert_close(fused.swiglu(gate, up), gate * torch.sigmoid(gate) * up)
    residual, delta = torch.randn(2, 6, 8, generator=generator)
    h, out = fused.add_rms_norm(residual, delta, weight, 1e-6, torch.bfloat16)
    torch.testing.assert_close(h, residual + delta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fused.rms_norm(h, weight, 1e-6).to(torch.bfloat16))


@pytest.mark.gpu
def test_inductor_fused_elementwise_equals_plain_ops_on_cuda():
    torch._dynamo.reset()
    drafter = tiny_drafter(0, dtype=torch.float32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, intermediate_size=256, block_size=16).cuda().train()
    results = []
    try:
        for enabled in (True, False):
            fused.set_fused_elementwise(enabled)
            for step, lengths in enumerate([[700, 300], [513]]):
                batch = packed_batch(lengths, width=256, vocab=97, seed=step, dtype=torch.float32).to("cuda")
                anchors = random_anchors(batch.to("cpu"), 16, count=60, seed=step).cuda()
                drafter.zero_grad()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = dflash_loss(drafter, batch, anchors)
                out.loss().backward()
                results.append((out.loss().detach(), drafter.fc.weight.grad.clone()))
    finally:
        fused.set_fused_elementwise(True)
    for (got_loss, got_grad), (want_loss, want_grad) in zip(results[:2], results[2:], strict=True):
        torch.testing.assert_close(got_loss, want_loss, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got_grad, want_grad, rtol=5e-2, atol=5e-3)


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("no compiler here")


def test_a_compile_failure_falls_back_to_plain_ops_except_inside_a_cuda_graph_capture(monkeypatch):
    """Outside a capture a kernel that fails to compile warns and runs the plain ops from then on; inside a CUDA graph
    capture the error is the capture's: it reaches the capturing caller (which runs the same work eagerly) and the
    fused kernels stay on for the rest of the process."""
    x, weight = torch.randn(5, 8), torch.rand(8)
    torch._dynamo.reset()
    fused.set_fused_elementwise(True, backend=_failing_backend, devices=("cpu",))
    try:
        monkeypatch.setattr(fused, "_capturing", lambda: True)  # a CPU build has no capture to be inside of
        with pytest.raises(RuntimeError, match="no compiler here"):
            fused.rms_norm(x, weight, 1e-6)
        assert fused.fused_elementwise_enabled(x.device)
        monkeypatch.undo()
        assert not fused._capturing()
        with pytest.warns(RuntimeWarning, match="'rms_norm' failed to compile"):
            torch.testing.assert_close(fused.rms_norm(x, weight, 1e-6), fused._rms_norm(x, weight, 1e-6, None))
        assert not fused.fused_elementwise_enabled(x.device)
    finally:
        fused.set_fused_elementwise(True)
        torch._dynamo.reset()
