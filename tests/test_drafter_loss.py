"""Loss: chunked LM head + CE equals the plain computation (value and gradients); weights; masks; metrics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from drafter_fixtures import packed_batch, random_anchors, tiny_drafter

from dflash.drafter import (
    chunked_linear_cross_entropy,
    default_gamma,
    dflash_loss,
    expected_acceptance_length,
    position_weights,
    sample_anchors,
)
from dflash.errors import MismatchError


def test_default_gamma_and_position_weights():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    weights = position_weights(16, 7.0)
    assert weights.shape == (15,) and weights[0] == 1.0
    assert math.isclose(float(weights[14]), math.exp(-14 / 7), rel_tol=1e-6)


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000, None])
def test_chunked_linear_cross_entropy_matches_plain(chunk_rows, monkeypatch):
    import dflash.drafter.loss as loss_module

    sizes = []
    run_chunk = loss_module._run_chunk
    monkeypatch.setattr(loss_module, "_run_chunk", lambda logits, *a: sizes.append(len(logits)) or run_chunk(logits, *a))
    if chunk_rows is None:  # default sizing: budget of 16 rows of 300 logits -> 4 balanced chunks of 50 rows
        monkeypatch.setattr(loss_module, "DEFAULT_CHUNK_ELEMENTS", 16 * 300)
    torch.manual_seed(0)
    hidden = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(300, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 300, (50,))
    row_weights = torch.rand(50, dtype=torch.float64) * (torch.rand(50) > 0.3)
    total, correct = chunked_linear_cross_entropy(hidden, weight, targets, row_weights, chunk_rows=chunk_rows)
    (2.5 * total).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = hidden @ weight.T
    reference = (F.cross_entropy(logits, targets, reduction="none") * row_weights).sum()
    (2.5 * reference).backward()
    torch.testing.assert_close(total.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)
    assert torch.equal(correct, logits.argmax(-1) == targets)
    assert sizes == ([13, 13, 13, 11] if chunk_rows is None else
                     [min(chunk_rows, 50 - start) for start in range(0, 50, chunk_rows)])


def test_fusable_chunk_equals_inplace_chunk():
    from dflash.drafter.loss import _ce_chunk_fusable, _ce_chunk_inplace

    torch.manual_seed(3)
    logits = torch.randn(9, 40, dtype=torch.float64) * 4
    target = torch.randint(0, 40, (9,))
    rows_w = torch.rand(9, dtype=torch.float64)
    fused = _ce_chunk_fusable(logits, target, rows_w)
    eager = _ce_chunk_inplace(logits.clone(), target, rows_w, True)
    for a, b in zip(fused, eager, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_fused_chunk_on_cuda_matches_eager_chunk():
    torch.manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", requires_grad=True)
    weight = torch.randn(5000, 64, device="cuda")
    targets = torch.randint(0, 5000, (300,), device="cuda")
    row_weights = torch.rand(300, device="cuda")
    results = []
    for fused in (False, True):
        hidden.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, correct = chunked_linear_cross_entropy(hidden, weight, targets, row_weights, chunk_rows=128,
                                                          fused=fused)
        total.backward()
        results.append((total.detach(), correct, hidden.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-3)
    assert (results[0][1] == results[1][1]).float().mean() > 0.99
    torch.testing.assert_close(results[0][2], results[1][2], rtol=2e-2, atol=1e-3)


def _reference_loss(drafter, batch, anchors, gamma):
    """Straightforward version: full logits, per-block CE at positions 1..B-1 (position k predicts x_{a+k})."""
    block_size = drafter.config.block_size
    hidden = drafter.forward_train(batch, anchors)
    logits = hidden @ drafter.lm_head_weight.T
    total = weight_sum = 0.0
    for j, anchor in enumerate(anchors.tolist()):
        for k in range(1, block_size):
            w = math.exp(-(k - 1) / gamma) * float(batch.loss_mask[anchor + k])
            total = total + w * F.cross_entropy(logits[j, k][None], batch.input_ids[anchor + k][None])
            weight_sum += w
    return total, weight_sum


def test_dflash_loss_matches_reference_with_gradients():
    drafter = tiny_drafter(1).train()
    batch = packed_batch([30, 22], width=64, vocab=97, seed=1, supervised_fraction=0.7)
    anchors = random_anchors(batch, 4, count=9, seed=1)
    out = dflash_loss(drafter, batch, anchors, gamma=3.0, chunk_rows=5)
    out.loss().backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    total, weight_sum = _reference_loss(drafter, batch, anchors, 3.0)
    (total / weight_sum).backward()
    torch.testing.assert_close(out.weighted_ce_sum.double(), total.double(), rtol=1e-5, atol=1e-6)
    assert math.isclose(float(out.weight_sum), weight_sum, rel_tol=1e-6)
    for name, parameter in drafter.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, rtol=1e-5, atol=1e-7, msg=name)
    supervised = torch.stack([batch.loss_mask[anchors + k] for k in range(1, 4)], 1).sum(0)
    assert torch.equal(out.count_per_position, supervised)


def test_all_zero_loss_mask_gives_zero_loss_zero_grads_finite_params():
    drafter = tiny_drafter(2, dtype=torch.float32).train()
    batch = packed_batch([40, 30], width=64, vocab=97, seed=2, dtype=torch.float32)
    anchors = sample_anchors(batch, 4, 8, torch.Generator().manual_seed(0))
    batch.loss_mask.zero_()  # anchors sampled before: their targets are now all unsupervised
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3, weight_decay=0.0)
    for candidate in (anchors, sample_anchors(batch, 4, 8, torch.Generator(), num_anchors=16),
                      sample_anchors(batch, 4, 8, torch.Generator())):  # real / all padding / empty
        optimizer.zero_grad()
        out = dflash_loss(drafter, batch, candidate)
        loss = out.loss()
        loss.backward()
        assert float(loss.detach()) == 0.0 and float(out.weight_sum) == 0.0
        assert int(out.count_per_position.sum()) == 0
        for parameter in drafter.parameters():
            assert parameter.grad is None or not parameter.grad.any()
        optimizer.step()
        assert all(torch.isfinite(p).all() for p in drafter.parameters())


def test_expected_acceptance_length():
    assert expected_acceptance_length([1.0] * 15) == 16.0
    assert expected_acceptance_length([0.0, 1.0, 1.0]) == 1.0
    assert math.isclose(expected_acceptance_length(torch.tensor([0.5, 0.5])), 1.75)
    assert expected_acceptance_length([float("nan"), 1.0]) == 1.0


def test_bf16_autocast_matches_float32():
    """The mixed-precision recipe (float32 parameters, bf16 autocast) runs the same math as float32."""
    drafter = tiny_drafter(5, dtype=torch.float32).train()
    drafter.reset_parameters(std=0.05)
    batch = packed_batch([40, 30], width=64, vocab=97, seed=5, dtype=torch.float32)
    batch.hidden = batch.hidden.to(torch.bfloat16)  # as stored in the cache
    anchors = random_anchors(batch, 4, count=12, seed=5)
    reference = dflash_loss(drafter, batch, anchors)
    reference.loss().backward()
    reference_grad = drafter.fc.weight.grad.clone()
    drafter.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = dflash_loss(drafter, batch, anchors)
    mixed.loss().backward()
    assert mixed.weighted_ce_sum.dtype == torch.float32
    torch.testing.assert_close(mixed.loss().detach(), reference.loss().detach(), rtol=2e-2, atol=2e-2)
    cosine = F.cosine_similarity(drafter.fc.weight.grad.flatten(), reference_grad.flatten(), dim=0)
    assert cosine > 0.99


def _plain_distill(hidden, weight, teacher, row_weights, kind):
    """Full-logits reference: forward KL(p || q) or TV(p, q), ``p`` the teacher's softmax, ``q`` the drafter's."""
    log_q = torch.log_softmax(hidden @ weight.T, dim=-1)
    log_p = torch.log_softmax(teacher @ weight.T, dim=-1)
    if kind == "kl":
        per_row = (log_p.exp() * (log_p - log_q)).sum(-1)
    else:
        per_row = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    return (per_row * row_weights).sum()


@pytest.mark.parametrize("kind", ["kl", "tv"])
@pytest.mark.parametrize("chunk_rows", [1, 7, None])
def test_chunked_linear_distill_matches_plain(kind, chunk_rows):
    from dflash.drafter.loss import chunked_linear_distill

    torch.manual_seed(0)
    hidden = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(300, 16, dtype=torch.float64)
    teacher = torch.randn(40, 16, dtype=torch.float64)
    row_weights = torch.rand(40, dtype=torch.float64) * (torch.rand(40) > 0.3)
    total = chunked_linear_distill(hidden, weight, teacher, row_weights, kind=kind, chunk_rows=chunk_rows)
    (3.0 * total).backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    reference = _plain_distill(hidden, weight, teacher, row_weights, kind)
    (3.0 * reference).backward()
    torch.testing.assert_close(total.double(), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-5, atol=1e-8)
    assert float(reference.detach()) > 0.1
    # Against itself the term is 0, and so is its gradient.
    same = chunked_linear_distill(teacher.clone().requires_grad_(), weight, teacher, row_weights, kind=kind)
    assert float(same.detach()) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("kind", ["kl", "tv"])
def test_dflash_loss_with_a_distill_term_matches_reference(kind):
    """The batch carries the final tap after the taps; block position k of anchor a is compared with the target's
    distribution at a+k-1, weighted like the CE; objective = ce_weight * CE + distill_weight * term."""
    drafter = tiny_drafter(3).train()
    taps = packed_batch([30, 22], width=64, vocab=97, seed=3, supervised_fraction=0.7)
    final = torch.randn(taps.hidden.shape[0], 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    batch = dataclasses.replace(taps, hidden=torch.cat([taps.hidden, final], dim=1))
    anchors = random_anchors(taps, 4, count=9, seed=3)
    out = dflash_loss(drafter, batch, anchors, gamma=3.0, chunk_rows=5, distill=kind, distill_weight=0.7,
                      ce_weight=0.2)
    (out.objective_sum / out.weight_sum).backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()

    ce_total, weight_sum = _reference_loss(drafter, taps, anchors, 3.0)
    states = drafter.forward_train(taps, anchors)
    rows, teachers, row_weights = [], [], []
    for j, anchor in enumerate(anchors.tolist()):
        for k in range(1, 4):
            rows.append(states[j, k])
            teachers.append(final[anchor + k - 1])
            row_weights.append(math.exp(-(k - 1) / 3.0) * float(batch.loss_mask[anchor + k]))
    term = _plain_distill(torch.stack(rows), drafter.lm_head_weight, torch.stack(teachers),
                          torch.tensor(row_weights, dtype=torch.float64), kind)
    ((0.2 * ce_total + 0.7 * term) / weight_sum).backward()
    torch.testing.assert_close(out.weighted_ce_sum.double(), ce_total.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.distill_sum.double(), term.double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.objective_sum.double(), (0.2 * ce_total + 0.7 * term).double(), rtol=1e-5,
                               atol=1e-6)
    for name, parameter in drafter.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, rtol=1e-5, atol=1e-7, msg=name)

    plain = dflash_loss(drafter, taps, anchors, gamma=3.0, chunk_rows=5)
    assert float(plain.distill_sum) == 0.0 and plain.objective_sum is plain.weighted_ce_sum
    with pytest.raises(MismatchError, match="extract --final-tap"):
        dflash_loss(drafter, taps, anchors, gamma=3.0, distill=kind)
