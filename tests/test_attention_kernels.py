"""The drafter's attention kernels (dflash.drafter.attention_backend): flash-attn-4's only where they apply (NVIDIA
CUDA, compute capability >= 9, bf16/fp16, head_dim 64/128, installed), explicit options win, bad names and impossible
forced choices are refused, forward_train hands the choice to every layer; on a GPU with flash-attn-4 the flash path
trains like the Triton path."""

from __future__ import annotations

import os

import pytest
import torch
from drafter_fixtures import packed_batch, random_anchors, tiny_drafter

from dflash.drafter import attention_kernels as backend
from dflash.drafter import attention_layout, flex_block_mask, model
from dflash.errors import ConfigError

CUDA = torch.device("cuda", 0)


@pytest.fixture
def restore_backend(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, backend.attention_backend())  # set_attention_backend writes the variable
    previous = backend.attention_backend()
    yield
    backend.set_attention_backend(previous)
    backend.set_flex_kernel_options(None)


@pytest.fixture
def hopper_with_flash(monkeypatch):
    """Pretend: an NVIDIA compute-capability-9.0 GPU and flash-attn-4 importable (the choice is logic on these)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(backend, "flash_attention_available", lambda: True)


@pytest.mark.parametrize("device, dtype, head_dim, capability, hip, expected", [
    (CUDA, torch.bfloat16, 128, (9, 0), None, {"BACKEND": "FLASH"}),
    (CUDA, torch.float16, 64, (10, 0), None, {"BACKEND": "FLASH"}),
    (CUDA, torch.float32, 128, (9, 0), None, None),  # flash-attn-4 has no fp32 kernels
    (CUDA, torch.bfloat16, 96, (9, 0), None, None),  # a head_dim auto does not take it for
    (CUDA, torch.bfloat16, 128, (8, 0), None, None),  # Ampere: Triton
    (CUDA, torch.bfloat16, 128, (9, 4), "6.4", None),  # ROCm (an MI300 reports 9.4): Triton
    (torch.device("cpu"), torch.bfloat16, 128, (9, 0), None, None),
])
def test_auto_takes_flash_only_where_it_applies(restore_backend, monkeypatch, device, dtype, head_dim, capability,
                                                hip, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(backend, "flash_attention_available", lambda: True)
    backend.set_attention_backend("auto")
    assert backend.attention_kernel_options(device, dtype, head_dim) == expected
    assert backend.attention_implementation(device, dtype, head_dim) == (
        "dense-sdpa" if device.type == "cpu" else "flex-flash" if expected else "flex-triton")


def test_auto_without_flash_attn_uses_triton(restore_backend, hopper_with_flash, monkeypatch):
    monkeypatch.setattr(backend, "flash_attention_available", lambda: False)
    backend.set_attention_backend("auto")
    assert backend.attention_kernel_options(CUDA, torch.bfloat16, 128) is None
    assert backend.attention_implementation(CUDA, torch.bfloat16, 128) == "flex-triton"


def test_explicit_choices_and_overrides(restore_backend, hopper_with_flash, monkeypatch):
    backend.set_attention_backend("auto")
    assert backend.set_attention_backend(" TRITON ") == "auto"  # case-insensitive; returns the previous choice
    assert backend.attention_backend() == "triton" and os.environ[backend.ENV_VAR] == "triton"  # workers inherit
    assert backend.attention_kernel_options(CUDA, torch.bfloat16, 128) is None
    backend.set_attention_backend("flash")  # forced: also where auto would not take it
    assert backend.attention_kernel_options(CUDA, torch.bfloat16, 96) == {"BACKEND": "FLASH"}
    with pytest.raises(ConfigError, match="bf16/fp16 only"):
        backend.attention_kernel_options(CUDA, torch.float32, 128)
    backend.set_flex_kernel_options({"ROWS_GUARANTEED_SAFE": True})  # explicit kernel options win (tuning)
    assert backend.attention_kernel_options(CUDA, torch.bfloat16, 128) == {"ROWS_GUARANTEED_SAFE": True}
    backend.set_flex_kernel_options(None)
    monkeypatch.setattr(backend, "flash_attention_available", lambda: False)
    with pytest.raises(ConfigError, match=r"dflash-stages\[fa4\]"):
        backend.attention_kernel_options(CUDA, torch.bfloat16, 128)
    assert backend.attention_implementation(torch.device("cpu"), torch.float32, 128) == "dense-sdpa"  # not used


def test_unknown_names_are_refused(restore_backend, monkeypatch):
    before = backend.attention_backend()
    with pytest.raises(ConfigError, match="unknown attention backend 'fa3'.*--attention-backend"):
        backend.set_attention_backend("fa3")
    assert backend.attention_backend() == before
    monkeypatch.setitem(backend._state, "backend", "fast")  # as a bad DFLASH_ATTENTION_BACKEND leaves it
    for call in (lambda: backend.attention_kernel_options(CUDA, torch.bfloat16, 128),
                 lambda: backend.attention_implementation(torch.device("cpu"), torch.float32, 128)):
        with pytest.raises(ConfigError, match="DFLASH_ATTENTION_BACKEND"):
            call()


ENV_VALUES = ("Triton", "", "fast")

# Each value in a fresh process that sets the variable, then imports dflash.drafter for the first time, so the value
# is read at import as in a fresh interpreter: forked from the session's CLI fork server (cli_helpers.forked_python),
# which imported torch and transformers (the slow part) once and never dflash.
_PRINT_BACKEND = """
import sys
assert "dflash.drafter" not in sys.modules
try:
    from dflash.drafter import attention_backend
    print(attention_backend(), flush=True)
except Exception as error:
    print(type(error).__name__, flush=True)
"""


@pytest.fixture(scope="module")
def backend_by_env_value():
    from cli_helpers import forked_python

    env = {key: value for key, value in os.environ.items() if key != backend.ENV_VAR}
    seen, stderr = {}, ""
    for value in ENV_VALUES:
        result = forked_python(_PRINT_BACKEND, env={**env, backend.ENV_VAR: value})
        assert result.returncode == 0 and len(result.stdout.split()) == 1, result.stdout + result.stderr
        seen[value], stderr = result.stdout.strip(), stderr + result.stderr
    return seen, stderr


@pytest.mark.parametrize("value, expected", [("Triton", "triton"), ("", "auto"), ("fast", "ConfigError")])
def test_environment_variable_sets_the_default(backend_by_env_value, value, expected):
    seen, stderr = backend_by_env_value
    assert seen[value] == expected, stderr


def test_forward_train_hands_the_choice_to_every_layer(restore_backend, monkeypatch):
    """The BlockMask path asks for options with the step's device, compute dtype and head_dim and gives them to every
    attention layer before the layers run (CPU: layers stopped right there)."""
    drafter = tiny_drafter(0, dtype=torch.float32, num_hidden_layers=3)
    batch = packed_batch([40, 30], width=drafter.fc.in_features, vocab=drafter.config.vocab_size, seed=0)
    anchors = random_anchors(batch, drafter.config.block_size, count=6, seed=0)
    mask = flex_block_mask(attention_layout(anchors, batch.position_ids, drafter.config.block_size))
    asked = []

    def options(device, dtype, head_dim):
        asked.append((device.type, dtype, head_dim))
        return {"BACKEND": "SENTINEL"}

    class LayersReached(Exception):
        pass

    def stop(*args, **kwargs):
        raise LayersReached

    monkeypatch.setattr(model, "attention_kernel_options", options)
    monkeypatch.setattr(drafter, "_run_layers", stop)
    with pytest.raises(LayersReached), torch.autocast("cpu", dtype=torch.bfloat16):
        drafter.forward_train(batch, anchors, mask=mask)
    assert asked == [("cpu", torch.bfloat16, drafter.config.head_dim)]
    assert [layer.self_attn.kernel_options for layer in drafter.layers] == [{"BACKEND": "SENTINEL"}] * 3


@pytest.mark.gpu
def test_flash_path_trains_like_the_triton_path(restore_backend):
    """Against a float32 reference (Triton kernels, no autocast), the bf16 flash path's output and every parameter
    gradient are as close as the bf16 Triton path's (within 2x its error): the FlashAttention test convention. A
    direct flash-vs-Triton comparison is not a fair test here: gradients such as fc's are sums that cancel to tiny
    values, so the bf16 rounding of either path alone moves them by their own size."""
    if not backend.flash_attention_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs flash-attn-4 (pip install 'dflash-stages[fa4]') and a Hopper or newer GPU")
    drafter = tiny_drafter(0, dtype=torch.float32, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, intermediate_size=512, block_size=16).cuda()
    batch = packed_batch([700, 300, 213], width=512, vocab=97, dtype=torch.float32, padding=11).to("cuda")
    anchors = random_anchors(batch.to("cpu"), 16, count=100).cuda()

    def run(choice: str, bf16: bool):
        backend.set_attention_backend(choice)
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = drafter.forward_train(batch, anchors)
        out.float().square().mean().backward()
        used = drafter.layers[0].self_attn.kernel_options
        return out.detach().float(), {n: p.grad.detach().clone() for n, p in drafter.named_parameters()}, used

    reference = run("triton", bf16=False)  # float32: auto and triton agree, flash has no fp32 kernels
    triton, flash = run("triton", bf16=True), run("flash", bf16=True)
    assert (reference[2], triton[2], flash[2]) == (None, None, {"BACKEND": "FLASH"})  # each ran what it says
    assert not torch.equal(flash[0], triton[0])  # really other kernels

    def error(result, name=None):
        got, want = (result[0], reference[0]) if name is None else (result[1][name], reference[1][name])
        return float((got - want).norm() / want.norm())

    assert error(flash) <= 2 * error(triton) + 1e-3
    for name in reference[1]:
        assert error(flash, name) <= 2 * error(triton, name) + 1e-3, (name, error(flash, name), error(triton, name))
