"""Packed-attention kernels against each row run alone, on CUDA (issue 16 item 1, the varlen kernel added
2026-12-02): max |difference| / max |value| of each row's taps, for padded batches and for packed rows with each
packed kernel (flex_attention, sdpa, varlen), on the Qwen3-8B shape with random weights and on the real
SmolLM2-135M-Instruct; then a repeated call (bit-identical?) and the same rows packed in another order.

Run from the repository root: python docs/results/extract_packing_varlen_check_h200.py   (CUDA)
"""

import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from extract import build_target  # noqa: E402

from dflash.target import default_target_layer_ids  # noqa: E402
from dflash.target_runner import PACKED_ATTENTION, TargetRunner  # noqa: E402

rng = np.random.default_rng(0)
for spec in ("qwen3-8b-random", "default"):
    model, identity = build_target(spec, torch.device("cuda"), False, 0)
    ids = default_target_layer_ids(identity.num_hidden_layers, 5)
    rows = [rng.integers(0, 32000, size=n) for n in (700, 300, 1500, 90, 1, 2048, 513)]
    solo = TargetRunner(model, ids, "cuda", token_budget=1).run(rows)
    runners = {"padded": TargetRunner(model, ids, "cuda", token_budget=16384)}
    runners.update({name: TargetRunner(model, ids, "cuda", token_budget=4096, packing=True, packed_attention=name)
                    for name in PACKED_ATTENTION})
    for name, runner in runners.items():
        first, second = runner.run(rows), runner.run(rows)
        shuffled = runner.run(rows[::-1])[::-1]
        worst = [round(float((a.float() - b.float()).abs().max() / b.float().abs().max()), 5)
                 for a, b in zip(first, solo, strict=True)]
        print(f"{identity.name} {name}: vs alone {worst}; repeat bit-identical "
              f"{all(torch.equal(a, b) for a, b in zip(first, second, strict=True))}; reversed order vs alone "
              f"{max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(shuffled, solo, strict=True)):.5f}")
    del model, runners
    torch.cuda.empty_cache()
