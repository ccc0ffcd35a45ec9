"""Draw docs/results/h200_smollm2_learning_curve.png from the H200 run's metrics.jsonl and per-epoch evaluations.

Run from the repository root: ``python docs/results/h200_smollm2_learning_curve.py``.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = Path("docs/results")
rows = [json.loads(line) for line in (RESULTS / "h200_smollm2_generated_v2_metrics.jsonl").open()]
train = [r for r in rows if r["kind"] == "train"]
val = [r for r in rows if r["kind"] == "val"]
steps = np.array([r["step"] for r in train])
seen = np.array([r["tokens_seen"] for r in train])


def tokens(step: int) -> float:
    """Millions of tokens seen at ``step`` (interpolated between train records)."""
    return float(np.interp(step, steps, seen)) / 1e6


epochs = [json.loads((RESULTS / f"h200_smollm2_generated_v2_eval_epoch_{e}.json").read_text()) for e in (1, 2, 3)]
figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
left.plot(seen / 1e6, [r["expected_acceptance_length"] for r in train], label="train, implied tau (teacher-forced)")
left.plot([tokens(r["step"]) for r in val], [r["expected_acceptance_length"] for r in val], "o-",
          label="validation split, implied tau")
left.plot([tokens(s) for s in (236, 472, 708)], [e["tau"] for e in epochs], "s--",
          label="held-out prompts, tau (real decoding loop)")
left.set_xlabel("tokens seen (millions)")
left.set_ylabel("tau (block size 16)")
left.legend(fontsize=8)
left.grid(alpha=0.3)
for record in [v for v in val[2::4] if v is not val[-1]] + [val[-1]]:
    right.plot(range(1, 16), record["accuracy_per_position"],
               label=f"step {record['step']} ({tokens(record['step']):.1f}M tokens)")
right.set_xlabel("block position k")
right.set_ylabel("validation accuracy at position k")
right.legend(fontsize=8)
right.grid(alpha=0.3)
figure.suptitle("h200-smollm2 (one NVIDIA H200): 5 layers, block 16, lr 6e-4, 3 epochs over 8,192 generated replies")
figure.tight_layout()
figure.savefig(RESULTS / "h200_smollm2_learning_curve.png", dpi=90)
