"""Experiment (issue 3): what the optimizer step and gradient clipping cost in the compiled batch-4 drafter step,
and what overlapping AdamW with the next step's forward would save. GPU only; not used by the trainer.

Five variants of the step of ``benchmarks/drafter_step.py`` (8B shape, 4 x 3072 tokens, 2048 fixed anchors, compiled
layers, bf16 autocast, fused AdamW), timed interleaved in one process (``--rounds`` rounds of 10 steps each, after 3
warm-up steps per variant), so that GPU clock drift hits all of them alike:

* ``base``: forward, backward, AdamW (what drafter_step.py times).
* ``overlap``: AdamW split per module (fc + hidden_norm, each layer, final norm), run on a side CUDA stream with one
  event per module; the next step's forward waits only for the module it is about to use.
* ``clip-explicit``: ``clip_grad_norm_(1.0)`` before AdamW, as the trainer does.
* ``clip-fused``: the global norm only, with the clip coefficient and the non-finite skip folded into fused AdamW
  through its ``grad_scale`` / ``found_inf`` arguments (as ``torch.amp.GradScaler`` uses them; no host sync).
* ``overlap+clip-fused``: both.

The overlap hooks are attached by wrapping the drafter's ``fuse_context``, its compiled layers and a forward
pre-hook on the final norm (this script only). Each variant has its own AdamW state (peak memory counts all five).

    python benchmarks/optimizer_overlap.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_step import Stepper, build_drafter, eight_b_config, make_batch  # noqa: E402

from dflash.drafter import dflash_loss  # noqa: E402

VARIANTS = {"base": ("none", False), "overlap": ("none", True), "clip-explicit": ("explicit", False),
            "clip-fused": ("fused", False), "overlap+clip-fused": ("fused", True)}


class Variant:
    """One optimizer arrangement over the drafter's parameters (see the module docstring)."""

    def __init__(self, drafter, clip: str, overlap: bool) -> None:
        self.clip, self.overlap = clip, overlap
        groups = [list(drafter.fc.parameters()) + list(drafter.hidden_norm.parameters())]
        groups += [list(layer.parameters()) for layer in drafter.layers]
        groups += [list(drafter.norm.parameters())]
        assert sum(len(group) for group in groups) == len(list(drafter.parameters()))
        self.params = [p for group in groups for p in group]
        self.optimizers = ([torch.optim.AdamW(group, lr=1e-5, fused=True) for group in groups] if overlap
                           else [torch.optim.AdamW(self.params, lr=1e-5, fused=True)])
        self.events: list[torch.cuda.Event | None] = [None] * len(groups)
        self.side = torch.cuda.Stream()

    def wait(self, group: int) -> None:
        """Make the current stream wait for the update of module group ``group`` (overlap variants only)."""
        if self.overlap and self.events[group] is not None:
            torch.cuda.current_stream().wait_event(self.events[group])

    def step(self) -> None:
        if self.clip == "explicit":
            torch.nn.utils.clip_grad_norm_(self.params, 1.0, error_if_nonfinite=False)
        elif self.clip == "fused":
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params], error_if_nonfinite=False)
            inverse_coefficient = 1.0 / torch.clamp(1.0 / (norm + 1e-6), max=1.0)  # fused AdamW divides by it
            found_inf = (~torch.isfinite(norm)).float()
            for optimizer in self.optimizers:
                optimizer.grad_scale, optimizer.found_inf = inverse_coefficient, found_inf
        if self.overlap:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                for index, optimizer in enumerate(self.optimizers):
                    optimizer.step()
                    event = torch.cuda.Event()
                    event.record(self.side)
                    self.events[index] = event
            for p in self.params:  # freed on the main stream below while the side stream may still read them
                p.grad.record_stream(self.side)
            if self.clip == "fused":
                inverse_coefficient.record_stream(self.side)
                found_inf.record_stream(self.side)
        else:
            for optimizer in self.optimizers:
                optimizer.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of 10 steps per variant")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("optimizer_overlap: needs a CUDA GPU (side streams)")
    device = torch.device("cuda")
    torch.set_float32_matmul_precision("high")
    config = eight_b_config(16)
    drafter = build_drafter(config, device, True, "inductor")
    stepper = Stepper(drafter, device, 512, 7.0)  # its anchor generator and autocast; its own optimizer is unused
    variants = {name: Variant(drafter, clip, overlap) for name, (clip, overlap) in VARIANTS.items()}
    current: dict[str, Variant] = {}

    fuse_context = drafter.fuse_context

    def fuse_after_update(hidden):
        current["variant"].wait(0)
        return fuse_context(hidden)

    def layer_after_update(index, layer):
        def call(*layer_args):
            current["variant"].wait(index + 1)
            return layer(*layer_args)
        return call

    drafter.fuse_context = fuse_after_update
    drafter._compiled_layers = [layer_after_update(i, layer) for i, layer in enumerate(drafter._compiled_layers)]
    drafter.norm.register_forward_pre_hook(lambda module, inputs: current["variant"].wait(len(drafter.layers) + 1))
    batch = make_batch([3072] * 4, config, device)

    def run(name: str, steps: int) -> None:
        current["variant"] = variants[name]
        for _ in range(steps):
            anchors = stepper.anchors(batch, 2048)
            with stepper.autocast:
                loss = dflash_loss(drafter, batch, anchors, gamma=7.0).loss()
            loss.backward()
            variants[name].step()

    for name in variants:
        run(name, 3)
    results: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name in variants:
            torch.cuda.synchronize()
            started = time.perf_counter()
            run(name, 10)
            torch.cuda.synchronize()
            results[name].append((time.perf_counter() - started) / 10 * 1e3)
            print(f"round {round_index} {name:20s} {results[name][-1]:.1f} ms/step", flush=True)
    for name, times in results.items():
        print(f"{name:20s} " + " ".join(f"{t:.1f}" for t in times) + f"  min {min(times):.1f}")
    print(torch.cuda.get_device_name(), torch.__version__, f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
