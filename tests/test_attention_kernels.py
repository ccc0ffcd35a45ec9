"""FlexAttention backend choice (dflash.drafter.model.attention_kernel_options): flash-attn-4's kernels only where
they apply (CUDA, compute capability >= 9, bf16/fp16, head_dim 64/128, installed), explicit options win, bad names
are refused; on a GPU with flash-attn-4 the flash path trains like the Triton path."""

from __future__ import annotations

import pytest
import torch
from drafter_fixtures import packed_batch, random_anchors, tiny_drafter

from dflash.drafter import model
from dflash.errors import ConfigError

CUDA = torch.device("cuda", 0)


@pytest.fixture
def restore_backend():
    previous = model.attention_backend()
    yield
    model.set_attention_backend(previous)
    model.set_flex_kernel_options(None)


@pytest.fixture
def hopper_with_flash(monkeypatch):
    """Pretend: a compute-capability-9.0 GPU and flash-attn-4 importable (the choice is pure logic on these)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(model, "flash_attention_available", lambda: True)


@pytest.mark.parametrize("device, dtype, head_dim, capability, expected", [
    (CUDA, torch.bfloat16, 128, (9, 0), {"BACKEND": "FLASH"}),
    (CUDA, torch.float16, 64, (10, 0), {"BACKEND": "FLASH"}),
    (CUDA, torch.float32, 128, (9, 0), None),  # flash-attn-4 has no fp32 kernels
    (CUDA, torch.bfloat16, 96, (9, 0), None),  # a head_dim auto does not pick it for
    (CUDA, torch.bfloat16, 128, (8, 0), None),  # Ampere: Triton
    (torch.device("cpu"), torch.bfloat16, 128, (9, 0), None),
])
def test_auto_picks_flash_only_where_it_applies(restore_backend, monkeypatch, device, dtype, head_dim, capability,
                                                expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(model, "flash_attention_available", lambda: True)
    model.set_attention_backend("auto")
    assert model.attention_kernel_options(device, dtype, head_dim) == expected
    implementation = model.attention_implementation(device, dtype, head_dim)
    assert implementation == ("dense-sdpa" if device.type == "cpu" else
                              "flex-flash" if expected else "flex-triton")


def test_auto_without_flash_attn_uses_triton(restore_backend, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(model, "flash_attention_available", lambda: False)
    model.set_attention_backend("auto")
    assert model.attention_kernel_options(CUDA, torch.bfloat16, 128) is None


def test_explicit_choices_and_overrides(restore_backend, hopper_with_flash, monkeypatch):
    model.set_attention_backend("auto")
    assert model.set_attention_backend("TRITON") == "auto"  # case-insensitive; returns the previous choice
    assert model.attention_backend() == "triton"
    assert model.attention_kernel_options(CUDA, torch.bfloat16, 128) is None
    model.set_attention_backend("flash")  # forced: also where auto would not pick it
    assert model.attention_kernel_options(CUDA, torch.bfloat16, 96) == {"BACKEND": "FLASH"}
    model.set_flex_kernel_options({"ROWS_GUARANTEED_SAFE": True})  # explicit kernel options win (tuning)
    assert model.attention_kernel_options(CUDA, torch.bfloat16, 128) == {"ROWS_GUARANTEED_SAFE": True}
    model.set_flex_kernel_options(None)
    monkeypatch.setattr(model, "flash_attention_available", lambda: False)
    with pytest.raises(ConfigError, match=r"dflash-stages\[fa4\]"):
        model.attention_kernel_options(CUDA, torch.bfloat16, 128)


def test_unknown_names_are_refused(restore_backend, monkeypatch):
    before = model.attention_backend()
    with pytest.raises(ConfigError, match="unknown attention backend 'fa3'"):
        model.set_attention_backend("fa3")
    assert model.attention_backend() == before
    # A bad DFLASH_ATTENTION_BACKEND is read at import and refused at first use, naming the variable.
    monkeypatch.setitem(model._attention_backend, "name", "fast")
    with pytest.raises(ConfigError, match="DFLASH_ATTENTION_BACKEND"):
        model.attention_kernel_options(CUDA, torch.bfloat16, 128)


@pytest.mark.gpu
def test_flash_path_trains_like_the_triton_path(restore_backend):
    """Against a float32 reference (Triton kernels, no autocast), the bf16 flash path's output and every parameter
    gradient are as close as the bf16 Triton path's (within 2x its error): the FlashAttention test convention. A
    direct flash-vs-Triton comparison is not a fair test here: gradients such as fc's are sums that cancel to tiny
    values, so the bf16 rounding of either path alone moves them by their own size."""
    if not model.flash_attention_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs flash-attn-4 (pip install 'dflash-stages[fa4]') and a Hopper or newer GPU")
    drafter = tiny_drafter(0, dtype=torch.float32, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, intermediate_size=512, block_size=16).cuda()
    batch = packed_batch([700, 300, 213], width=512, vocab=97, dtype=torch.float32, padding=11).to("cuda")
    anchors = random_anchors(batch.to("cpu"), 16, count=100).cuda()

    def run(backend: str, bf16: bool):
        model.set_attention_backend(backend)
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = drafter.forward_train(batch, anchors)
        out.float().square().mean().backward()
        return out.detach().float(), {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}

    reference = run("triton", bf16=False)  # float32: auto and triton agree, flash has no fp32 kernels
    triton, flash = run("triton", bf16=True), run("flash", bf16=True)

    def error(result, name=None):
        got, want = (result[0], reference[0]) if name is None else (result[1][name], reference[1][name])
        return float((got - want).norm() / want.norm())

    assert error(flash) <= 2 * error(triton) + 1e-3
    for name in reference[1]:
        assert error(flash, name) <= 2 * error(triton, name) + 1e-3, (name, error(flash, name), error(triton, name))
