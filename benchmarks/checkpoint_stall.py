"""How long a checkpoint stalls the training loop vs how long writing it takes (issue 5 item 6).

Builds a drafter of the 8B shape (5 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 12288,
5 taps; ~1.05B fp32 parameters plus AdamW moments, ~12.6 GB of state), gives it optimizer state with one step,
then saves ``--saves`` checkpoints through :class:`dflash.training.checkpoint.Checkpointer` while "training" (an in-place
update of every parameter, as a step would) goes on. Prints, per save, the stall the loop saw (host copy into
reused pinned buffers) and the background write time. The first save also allocates the pinned buffers.

Run::

    python benchmarks/checkpoint_stall.py --output /local/disk/ckpt-bench        # on the GPU host
    python benchmarks/checkpoint_stall.py --smoke --output /tmp/ckpt-bench        # tiny sizes, any machine
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from dflash.drafter import DFlashConfig, DFlashDrafter
from dflash.training.checkpoint import Checkpointer, capture_rng_state


def drafter_config(smoke: bool) -> DFlashConfig:
    if smoke:
        shape = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     vocab_size=1024, target_layer_ids=[1, 3, 5], num_target_layers=8)
    else:
        shape = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36)
    return DFlashConfig(num_hidden_layers=5, block_size=16, mask_token_id=0, **shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="Run folder to write checkpoints into.")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--steps-between", type=int, default=5, help="In-place 'training' updates between saves.")
    parser.add_argument("--smoke", action="store_true", help="Tiny sizes (CPU is fine).")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    config = drafter_config(args.smoke)
    drafter = DFlashDrafter(config).to(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    for parameter in drafter.parameters():
        parameter.grad = torch.full_like(parameter, 1e-3)
    optimizer.step()
    num_parameters = sum(p.numel() for p in drafter.parameters())
    state_bytes = 3 * 4 * num_parameters
    print(f"device {device}; drafter {num_parameters / 1e6:.1f}M parameters; checkpoint state {state_bytes / 2**30:.2f} GiB")

    shutil.rmtree(args.output, ignore_errors=True)
    checkpointer = Checkpointer(args.output, keep_last=2)
    for save in range(1, args.saves + 1):
        for _ in range(args.steps_between):
            with torch.no_grad():
                for parameter in drafter.parameters():
                    parameter.mul_(0.999)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        snapshot = checkpointer.snapshot(
            step=save, model=drafter, optimizer=optimizer, trainer_state={"bench": True}, rng_state=capture_rng_state(),
            drafter_config=config.to_dict(), target_info={},
        )
        future = checkpointer.save(snapshot)
        stall = time.perf_counter() - started
        # Keep "training" while the write runs, as the loop would.
        busy = 0
        while not future.done():
            with torch.no_grad():
                for parameter in drafter.parameters():
                    parameter.mul_(0.999)
            busy += 1
        checkpointer.wait()
        print(f"save {save}: loop stall {stall:.3f} s; background write {checkpointer.last_write_seconds:.2f} s "
              f"({state_bytes / 2**30 / checkpointer.last_write_seconds:.2f} GiB/s); {busy} updates ran meanwhile")
    checkpointer.close()


if __name__ == "__main__":
    main()
