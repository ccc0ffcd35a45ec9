"""Draw a learning-curve PNG of an H200 preset run from its metrics.jsonl and per-epoch evaluations.

Run from the repository root:

    python docs/results/h200_smollm2_learning_curve.py            # v2 -> h200_smollm2_learning_curve.png
    python docs/results/h200_smollm2_learning_curve.py --run v8   # v8 -> h200_smollm2_v8_learning_curve.png
    python docs/results/h200_smollm2_learning_curve.py --run v10  # v10 -> h200_smollm2_v10_learning_curve.png

Left: implied tau (teacher-forced, from per-position accuracies) on training batches and on the validation split,
and the real decoding loop's tau on the held-out prompts after each epoch, against tokens seen. Right: validation
accuracy per block position at a few steps.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = Path("docs/results")
RUNS = {  # run -> (file prefix, PNG, title)
    "v2": ("h200_smollm2_generated_v2", "h200_smollm2_learning_curve.png",
           "h200-smollm2 v2 (one NVIDIA H200): 5 layers, block 16, lr 6e-4, 3 epochs over 8,192 generated replies"),
    "v8": ("h200_smollm2_v8", "h200_smollm2_v8_learning_curve.png",
           "h200-smollm2 v8 (one NVIDIA H200): 5 layers, block 16, lr 6e-4, 3 epochs over 24,576 generated replies"),
    "v10": ("h200_smollm2_v10", "h200_smollm2_v10_learning_curve.png",
            "h200-smollm2 v10 (one NVIDIA H200): v8's data and drafter, WSD learning rate (peak 6e-4, last 20% decay)"),
}
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--run", choices=sorted(RUNS), default="v2")
prefix, png, title = RUNS[parser.parse_args().run]

rows = [json.loads(line) for line in (RESULTS / f"{prefix}_metrics.jsonl").open()]
train = [r for r in rows if r["kind"] == "train"]
val = [r for r in rows if r["kind"] == "val"]
steps = np.array([r["step"] for r in train])
seen = np.array([r["tokens_seen"] for r in train])


def tokens(step: int) -> float:
    """Millions of tokens seen at ``step`` (interpolated between train records)."""
    return float(np.interp(step, steps, seen)) / 1e6


epochs = []
for epoch in (1, 2, 3):
    path = RESULTS / f"{prefix}_eval_epoch_{epoch}.json"
    path = path if path.exists() else RESULTS / f"{prefix}_eval_final.json"  # the last epoch's report is final.json
    report = json.loads(path.read_text())
    epochs.append((int(report["drafter"].split("step_")[1].rstrip(")")), report["tau"]))
figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
left.plot(seen / 1e6, [r["expected_acceptance_length"] for r in train], label="train, implied tau (teacher-forced)")
left.plot([tokens(r["step"]) for r in val], [r["expected_acceptance_length"] for r in val], "o-", markersize=3,
          label="validation split, implied tau")
left.plot([tokens(step) for step, _ in epochs], [tau for _, tau in epochs], "s--",
          label="held-out prompts, tau (real decoding loop)")
left.set_xlabel("tokens seen (millions)")
left.set_ylabel("tau (block size 16)")
left.legend(fontsize=8)
left.grid(alpha=0.3)
for record in [v for v in val[2::max(1, len(val) // 5)] if v is not val[-1]] + [val[-1]]:
    right.plot(range(1, 16), record["accuracy_per_position"],
               label=f"step {record['step']} ({tokens(record['step']):.1f}M tokens)")
right.set_xlabel("block position k")
right.set_ylabel("validation accuracy at position k")
right.legend(fontsize=8)
right.grid(alpha=0.3)
figure.suptitle(title)
figure.tight_layout()
figure.savefig(RESULTS / png, dpi=90)
