"""flash-attn-4 (FlexAttention ``BACKEND="FLASH"``) against inductor's Triton kernels at tiny, ragged shapes (token
counts that are not multiples of the 128-token tiles), on the drafter's own BlockMask. GPU with flash-attn-4 only.

For three packed batches (the test fixtures' documents ``[700, 300, 213]`` + 11 padding tokens with 100 and 96
anchors of block 16, and ``[1024, 512, 512]`` with 96), random bf16 q ``[1, 4, Q, 64]``, k/v ``[1, 2, T+Q, 64]``: one
forward + backward per backend; prints the relative L2 difference of the output and of dq / dk / dv (context keys
``[0, T)`` and block keys ``[T, T+Q)`` apart) and the number of key rows whose dk differs by more than 5% of the
largest row norm. Output of one H200 run: docs/results/flex_attention_flash_tiny.txt.

    python benchmarks/flex_attention_ragged.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from drafter_fixtures import packed_batch, random_anchors  # noqa: E402

from dflash.drafter import attention_layout, flash_attention_available, flex_block_mask  # noqa: E402

CASES = [([700, 300, 213], 100, 11), ([700, 300, 213], 96, 11), ([1024, 512, 512], 96, 0)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


def main() -> None:
    if not torch.cuda.is_available() or not flash_attention_available():
        raise SystemExit("flex_attention_ragged: needs a CUDA GPU with flash-attn-4 (pip install 'dflash-stages[fa4]')")
    from torch.nn.attention.flex_attention import flex_attention

    attend = torch.compile(flex_attention, dynamic=False)
    for lengths, count, padding in CASES:
        batch = packed_batch(lengths, width=8, vocab=97, dtype=torch.float32, padding=padding)
        anchors = random_anchors(batch, 16, count=count)
        layout = attention_layout(anchors.cuda(), batch.position_ids.cuda(), 16)
        mask = flex_block_mask(layout)
        num_context, num_queries = batch.position_ids.shape[0], layout.num_queries
        generator = torch.Generator(device="cuda").manual_seed(0)

        def rand(heads: int, length: int, generator: torch.Generator = generator) -> torch.Tensor:
            return torch.randn(1, heads, length, 64, device="cuda", dtype=torch.bfloat16, generator=generator)

        q = rand(4, num_queries).requires_grad_()
        k, v = (rand(2, num_context + num_queries).requires_grad_() for _ in range(2))
        grad_out = rand(4, num_queries)
        results = []
        for options in (None, {"BACKEND": "FLASH"}):
            for tensor in (q, k, v):
                tensor.grad = None
            out = attend(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)
            out.backward(grad_out)
            results.append((out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()))
        (o1, q1, k1, v1), (o2, q2, k2, v2) = results
        t = num_context
        print(f"T={t} Q={num_queries} out {relative(o1, o2):.2e} dq {relative(q1, q2):.2e} "
              f"dk_ctx {relative(k1[:, :, :t], k2[:, :, :t]):.2e} dk_blk {relative(k1[:, :, t:], k2[:, :, t:]):.2e} "
              f"dv_ctx {relative(v1[:, :, :t], v2[:, :, :t]):.2e} dv_blk {relative(v1[:, :, t:], v2[:, :, t:]):.2e}",
              flush=True)
        row_error = (k1 - k2).norm(dim=-1).amax(1)[0]
        bad = (row_error > 0.05 * k1.norm(dim=-1).amax(1)[0].clamp_min(1e-6)).nonzero().flatten()
        print(f"  bad dk rows: {bad.numel()} {bad[:10].tolist()}", flush=True)


if __name__ == "__main__":
    main()
