"""The Triton cross-entropy chunk (dflash/drafter/ce_triton.py) computes what the float32 eager chunk computes.

Reference: ``loss._ce_chunk_inplace`` (float32 softmax, torch.argmax). The kernel tests run on CUDA (``gpu``
marker). With Triton installed and ``TRITON_INTERPRET=1`` set before pytest starts, the same tests also run on CPU
through Triton's interpreter (slow; a correctness check of the kernel math without a GPU). The kernel-selection
tests (``DFLASH_CE_KERNEL``) run everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from dflash.drafter import ce_triton, loss
from dflash.drafter.ce_triton import ce_chunk_triton, triton_available
from dflash.errors import ConfigError

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and triton_available()

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs triton and TRITON_INTERPRET=1"),
                 id="interpret"),
]


def _case(num_rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Random logits (num_rows >= 9, vocab > 500) with the awkward rows: ties for the max, +-30 logits, target = argmax, targets 0 and V-1,
    zero and large weights."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator) * 3.0
    target = torch.randint(0, vocab, (num_rows,), generator=generator)
    rows_w = torch.rand(num_rows, generator=generator) * 2.0
    rows_w[::5] = 0.0  # unsupervised rows
    rows_w[1] = 37.5  # weights need not be <= 1
    target[2], target[3] = 0, vocab - 1
    logits[3, vocab - 1] = 25.0  # target at V-1 is the argmax
    logits[4, [11, 500, vocab - 1]] = 20.0  # three-way tie: argmax is 11
    target[4] = 11
    logits[6, [0, vocab - 1]] = 20.0  # tie, target is the later index: not a hit
    target[6] = vocab - 1
    logits[7] = torch.where(torch.rand(vocab, generator=generator) < 0.5, -30.0, 30.0)  # +-30 everywhere
    logits[8, target[8]] = 15.0  # plain hit
    return logits.to(dtype).to(device), target.to(device), rows_w.to(device)


def _reference(logits, target, rows_w):
    # Clone: for float32 logits the eager chunk's softmax buffer IS the logits tensor.
    return loss._ce_chunk_inplace(logits.clone(), target, rows_w, True)


def _assert_matches(got, want, dtype):
    total, correct, grad = got
    want_total, want_correct, want_grad = want
    assert total.dtype == torch.float32 and total.dim() == 0
    assert correct.dtype == torch.bool
    torch.testing.assert_close(total, want_total.float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(correct, want_correct)
    assert grad.dtype == dtype
    # bf16/fp16: at most about one unit in the last place apart (different rounding of the same float32 value).
    # atol 1e-6: grads near 1e-6 (exp of very negative logits) differ by the fast exp of the GPU kernel (H200, Triton 3.6:
    # at most 2.1e-7 apart on these cases), far below anything that moves training.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(grad.float(), want_grad.float(), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("shape", [(257, 49152), (64, 151936)], ids=["257x49152", "64x151936"])
def test_bf16_chunk_matches_float32_reference(device, inplace, shape):
    logits, target, rows_w = _case(*shape, torch.bfloat16, device)
    want = _reference(logits, target, rows_w)
    assert want[1][[3, 4, 8]].all() and not want[1][6]  # the case exercises hits, ties and misses
    keep = logits.clone()
    got = ce_chunk_triton(logits, target, rows_w, inplace=inplace)
    _assert_matches(got, want, torch.bfloat16)
    if inplace:
        assert got[2].data_ptr() == logits.data_ptr()
    else:
        assert torch.equal(logits, keep)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_other_dtypes_and_fixed_configs_match(device, dtype):
    logits, target, rows_w = _case(33, 5000, dtype, device, seed=1)
    want = _reference(logits, target, rows_w)
    # Tiles that do not divide V, several stats/grad tile sizes.
    for stats_config, grad_config in [((1024, 4), (1024, 4)), ((8192, 8), (4096, 8)), (None, None)]:
        got = ce_chunk_triton(logits, target, rows_w, stats_config=stats_config, grad_config=grad_config)
        _assert_matches(got, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_weight_rows_give_exact_zeros_and_special_values(device):
    vocab = 3000
    logits, target, rows_w = _case(12, vocab, torch.bfloat16, device, seed=2)
    logits[0, 5] = float("nan")  # weight 0 (rows_w[::5] = 0): nothing of it may leak
    logits[5, :] = float("inf")  # weight 0 too
    logits[9, 17] = float("nan")  # weighted NaN row: NaN loss, not a hit
    rows_w[9] = 1.0
    target[9] = 17
    logits[10, :] = float("-inf")  # -inf is fine where the target is finite
    logits[10, [3, 4]] = 2.0
    target[10], rows_w[10] = 4, 0.75
    logits[11, : vocab // 2] = float("-inf")  # leading -inf tiles must not poison the running sum
    target[11] = vocab - 2
    total, correct, grad = ce_chunk_triton(logits, target, rows_w, stats_config=(1024, 4))
    assert torch.isnan(total)
    assert torch.isnan(grad[9]).all() and not correct[9]
    assert (grad[[0, 5]] == 0).all() and not torch.signbit(grad[[0, 5]].float()).any()
    assert not correct[0] and not correct[5]  # NaN / +inf rows are never hits
    torch.testing.assert_close(grad[10, [3, 4]].float(), torch.tensor([0.375, -0.375], device=device))
    assert (grad[10, :3] == 0).all() and (grad[10, 5:] == 0).all()
    # Without the NaN row: the non-finite zero-weight rows 0 and 5 add exactly nothing to the total.
    keep = torch.tensor([i for i in range(12) if i != 9], device=device)
    clean = torch.tensor([i for i in range(12) if i not in (0, 5, 9)], device=device)
    want = _reference(logits[clean], target[clean], rows_w[clean])
    got_total, got_correct, got_grad = ce_chunk_triton(logits[keep], target[keep], rows_w[keep])
    in_keep = torch.tensor([i not in (0, 5) for i in keep.tolist()], device=device)
    _assert_matches((got_total, got_correct[in_keep], got_grad[in_keep]), want, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_strided_rows_and_empty_chunk(device):
    logits, target, rows_w = _case(40, 7000, torch.bfloat16, device, seed=3)
    want = _reference(logits, target, rows_w)
    total, correct, grad = ce_chunk_triton(logits, target, rows_w, need_grad=False)
    assert grad is None
    torch.testing.assert_close(total, want[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(correct, want[1])
    wide = torch.zeros(40, 7100, dtype=torch.bfloat16, device=device)
    wide[:, :7000] = logits
    strided = wide[:, :7000]  # row stride 7100: padded rows (an LM head padded to a multiple of 128, say)
    strided_target = torch.stack([target, target + 1], dim=1)[:, 0]  # stride 2
    _assert_matches(ce_chunk_triton(strided, strided_target, rows_w), want, torch.bfloat16)
    _assert_matches(ce_chunk_triton(strided, target, rows_w, inplace=True), want, torch.bfloat16)
    assert (wide[:, 7000:] == 0).all()  # the padding columns are never written
    empty_total, empty_correct, empty_grad = ce_chunk_triton(logits[:0], target[:0], rows_w[:0])
    assert float(empty_total) == 0.0 and empty_correct.shape == (0,) and empty_grad.shape == (0, 7000)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "eager"])
def test_chunked_linear_cross_entropy_same_with_triton_kernel(monkeypatch, kernel):
    generator = torch.Generator().manual_seed(4)
    hidden = (torch.randn(300, 64, generator=generator)).cuda().requires_grad_(True)
    weight = (torch.randn(49152, 64, generator=generator) * 0.3).cuda()
    targets = torch.randint(0, 49152, (300,), generator=generator).cuda()
    row_weights = (torch.rand(300, generator=generator) * (torch.rand(300, generator=generator) > 0.2)).cuda()

    def run(choice):
        monkeypatch.setenv(loss.CE_KERNEL_ENV, choice)
        hidden.grad = None
        total, correct = loss.chunked_linear_cross_entropy(hidden, weight, targets, row_weights, chunk_rows=128,
                                                           compute_dtype=torch.bfloat16, fused=True)
        total.backward()
        return total.detach(), correct, hidden.grad.clone()

    got, want = run(kernel), run("eager")
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=1e-4)
    monkeypatch.delenv(loss.CE_KERNEL_ENV)
    assert loss._chunk_kernel(torch.empty(2, 3, dtype=torch.bfloat16, device="cuda"), True) == "triton"


def test_kernel_choice_follows_environment(monkeypatch):
    cpu_logits = torch.zeros(2, 3)
    monkeypatch.delenv(loss.CE_KERNEL_ENV, raising=False)
    assert loss._chunk_kernel(cpu_logits, True) == "inductor"  # CPU: never Triton
    assert loss._chunk_kernel(cpu_logits, False) == "eager"
    monkeypatch.setenv(loss.CE_KERNEL_ENV, "eager")
    assert loss._chunk_kernel(cpu_logits, True) == "eager"
    monkeypatch.setenv(loss.CE_KERNEL_ENV, " Inductor ")
    assert loss._chunk_kernel(cpu_logits, True) == "inductor"
    monkeypatch.setenv(loss.CE_KERNEL_ENV, "cuda-magic")
    with pytest.raises(ConfigError, match="DFLASH_CE_KERNEL='cuda-magic' is not one of auto, triton"):
        loss._chunk_kernel(cpu_logits, True)
    monkeypatch.setenv(loss.CE_KERNEL_ENV, "triton")
    with pytest.raises(ConfigError, match="DFLASH_CE_KERNEL=triton needs Triton and bf16/fp16/fp32 CUDA logits"):
        loss._chunk_kernel(cpu_logits, True)


def test_eager_choice_runs_the_reference_chunk_on_cpu(monkeypatch):
    """fused=True with DFLASH_CE_KERNEL=eager: no compiler, the float32 eager chunk's exact results."""
    logits, target, rows_w = _case(9, 600, torch.float32, "cpu", seed=5)
    monkeypatch.setenv(loss.CE_KERNEL_ENV, "eager")
    want = _reference(logits, target, rows_w)
    got = loss._run_chunk(logits, target, rows_w, True, True)
    for got_part, want_part in zip(got, want, strict=True):
        assert torch.equal(got_part, want_part)


def test_cpu_tensors_are_refused_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits, target, rows_w = _case(9, 600, torch.bfloat16, "cpu")
    expected = "logits must be on a CUDA device" if triton_available() else "needs the 'triton' package"
    with pytest.raises(ConfigError, match=expected):
        ce_chunk_triton(logits, target, rows_w)
    assert isinstance(ce_triton.triton_available(), bool)
