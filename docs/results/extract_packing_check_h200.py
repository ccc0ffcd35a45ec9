"""The packed-attention check quoted in extract_packing_qwen3_h200.txt, as it ran on the H200 (device call after the
benchmark, 2026-12-01): max |difference| / max |value| of each row's taps against the row run alone, for padded and
packed batches, and for the same rows packed WITHOUT restarting positions (attention leaking across rows: the control).

Run from the repository root: python docs/results/extract_packing_check_h200.py   (CUDA; Qwen3-8B shape, random weights)
"""

import sys

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from extract import build_target  # noqa: E402

from dflash.target_runner import TargetRunner  # noqa: E402

m, ident = build_target("qwen3-8b-random", torch.device("cuda"), False, 0)
rng = np.random.default_rng(0)
rows = [rng.integers(0, 32000, size=n) for n in (700, 300, 1500, 90)]
ids = [1, 9, 17, 25, 33]
solo = TargetRunner(m, ids, "cuda", token_budget=1).run(rows)
pad = TargetRunner(m, ids, "cuda", token_budget=16384).run(rows)
pk = TargetRunner(m, ids, "cuda", token_budget=16384, packing=True).run(rows)
for name, other in (("padded", pad), ("packed", pk)):
    print(name, [round(float((a.float() - b.float()).abs().max() / b.float().abs().max()), 5) for a, b in zip(other, solo, strict=True)])
r = TargetRunner(m, ids, "cuda", token_budget=16384, packing=True)
t = torch.cat([torch.as_tensor(x) for x in rows])[None].cuda()
h = r.forward(t, position_ids=torch.arange(t.shape[1], device="cuda")[None])
off = 700
print("leaky", round(float((h[0, off:off + 300].float().cpu() - solo[1].float()).abs().max() / solo[1].float().abs().max()), 5))
