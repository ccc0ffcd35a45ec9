"""Cost of evaluate's decoding loops per target KV cache: milliseconds per step, side by side in one process.

Run::

    python benchmarks/speculative_loop.py --target smollm2-random --dtype float32      # one GPU: static vs dynamic
    python benchmarks/speculative_loop.py                                             # the real SmolLM2
    python benchmarks/speculative_loop.py --smoke                                      # tiny, on CPU (a check that it runs)

For each ``--kv-cache`` (``dynamic``: transformers' DynamicCache, eager forwards; ``static``:
``dflash.decoding.static_target.StaticTappedTarget`` and the drafter in a ``dflash.decoding.drafter_cache.GraphedDrafter``, CUDA graphs on CUDA) and each of ``--prompts`` seeded random
prompts of ``--prompt-tokens`` tokens, the loop of ``dflash.decoding.speculative`` runs three ways: block size 1 (plain
decoding: ms per token), block ``--block-size`` with a replay drafter that proposes the target's own greedy tokens
and is wrong from a seeded random position on (every cycle accepts 0 .. B-1 drafts: ms per cycle of the target's
verify forward and the loop, with no drafter cost), and the same block with a random-weight ``DFlashDrafter`` of
``--draft-layers`` layers (ms per cycle with a drafter's forward; it accepts almost nothing, so the cycles are many).
On the static cache the drafter keeps its context's keys and values (``--drafter-context kept``, as evaluate runs
it); ``whole`` computes every context row's again at each draft, captured the same way, so ``--drafter-context
kept whole`` at a long ``--prompt-tokens`` shows what keeping them saves per cycle.
Each setting runs once cold (graph capture, allocator) and ``--repeats`` times; the median is printed, with the
ratio of each cache to the first and whether its tokens equal the first's (greedy, same dtype: they should).

``--profile`` then profiles one prompt of each loop (wall against device-busy time per step, the costliest
kernels) and counts the host's work per cycle (per token at block size 1) OUTSIDE what CUDA graphs capture (the
static target's forward body, the kept-context drafter's write and draft steps; on the dynamic cache the model's
forward, and a drafter that is not graphed drafts as a whole): operator calls by name, those that launch work on a
CUDA device, host-device synchronizations (``.item()``, ``.tolist()``) and host-to-device tensors, and the wall
time outside those parts (without the profiler). The same Python runs the same operators on CPU, where the captured
parts run eagerly, so the counts are read on CPU as well (the wall time there includes CPU arithmetic a GPU would do).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract import RANDOM_TARGETS, build_target  # noqa: E402  (the benchmarks' shared random-target builder)
from profiling import host_transfers, marked, operator_counts, profiled, summarize  # noqa: E402  (shared profiling)

from dflash.decoding.drafter_cache import GraphedDrafter  # noqa: E402
from dflash.decoding.speculative import SpeculativeConfig, TappedTarget, speculative_generate  # noqa: E402
from dflash.decoding.static_target import StaticTappedTarget  # noqa: E402


class ReplayDrafter(torch.nn.Module):
    """Proposes ``reference`` (the target's greedy continuation), wrong from a seeded random block position on."""

    def __init__(self, reference: list[int], vocab: int, seed: int) -> None:
        super().__init__()
        self.anchor_param = torch.nn.Parameter(torch.zeros(1))
        self.reference, self.vocab = reference, vocab
        self.generator = torch.Generator().manual_seed(seed)

    def draft_block(self, context_hidden, context_positions, block_input_ids, block_start):
        size = block_input_ids.numel()
        wrong = int(torch.randint(1, size + 1, (1,), generator=self.generator))
        tokens = [self.reference[i] if i < len(self.reference) else 0 for i in range(block_start, block_start + size)]
        tokens = [t if k < wrong else (t + 1) % self.vocab for k, t in enumerate(tokens)]
        logits = torch.full((size, self.vocab), -1e4, device=context_hidden.device)
        logits[torch.arange(size), torch.tensor(tokens)] = 0.0
        return logits


class WholeContextDrafter(GraphedDrafter):
    """:class:`GraphedDrafter` that computes the keys and values of every context row again at each draft (the
    accepted taps copied into a buffer of ``capacity`` rows, the rows past them masked), captured the same way: the
    cost that keeping them saves, side by side (``--drafter-context whole``)."""

    def __init__(self, drafter, capacity: int) -> None:
        super().__init__(drafter, capacity)
        parameter = next(drafter.parameters())
        width = drafter.config.num_taps * drafter.config.hidden_size
        self._taps = torch.zeros((self.capacity, width), dtype=parameter.dtype, device=parameter.device)

    def draft_block(self, context_hidden, context_positions, block_input_ids, block_start):
        self._taps[: context_hidden.shape[0]].copy_(context_hidden)
        return super().draft_block(context_hidden, context_positions, block_input_ids, block_start)

    def _write_window(self, context_hidden, first, rows):  # nothing kept: every draft computes the whole context
        self._start.fill_(rows)  # the block's start, which the draft step reads

    def _draft(self):
        return self.drafter.draft_block_cached(self.drafter.context_keys_values(self._taps, self._positions),
                                               self._block, self._start, context_valid=self._positions < self._start)


def _random_drafter(model, layers: int, block: int, taps: list[int]):
    from dflash.drafter import DFlashConfig, DFlashDrafter

    config = DFlashConfig.from_target_config(model.config, num_draft_layers=layers, block_size=block, mask_token_id=0,
                                             target_layer_ids=taps)
    torch.manual_seed(0)
    parameter = next(model.parameters())
    drafter = DFlashDrafter(config).to(device=parameter.device, dtype=parameter.dtype).eval()
    drafter.attach_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return drafter


def _timed(tapped, drafter_for, prompts, config) -> tuple[float, int, list[list[int]]]:
    """Seconds of the decode loops (prefills excluded), steps (cycles) and the outputs, over ``prompts``;
    ``drafter_for(index)`` gives prompt ``index``'s drafter (None for block size 1)."""
    seconds, steps, outputs = 0.0, 0, []
    for index, prompt in enumerate(prompts):
        result = speculative_generate(tapped, drafter_for(index), prompt, config)
        seconds += result.decode_seconds
        steps += result.num_cycles
        outputs.append(result.output_ids)
    return seconds, steps, outputs


def _profile(tapped, drafter_for, prompts, config, device: torch.device) -> dict:
    """One pass over ``prompts`` under torch.profiler: where a step's time goes (on CUDA, the kernels' busy time
    against the wall time; the rest is the host: launches, synchronizations, Python)."""
    (seconds, steps, _), prof = profiled(lambda: _timed(tapped, drafter_for, prompts, config), device)
    summary = summarize(prof, on_device=device.type == "cuda")
    on_device, per = summary["on_device"], max(steps, 1)
    top_rows = [(name[:60], count // per, ms / per) for name, count, ms in summary["top"]]
    wall = 1000 * seconds / per
    busy = summary["busy_ms"] / per  # prefill included: one prompt's prefill over its many steps
    line = (f"profiled: {wall:.2f} ms/step wall (under the profiler), {'device busy' if on_device else 'operators'} "
            f"{busy:.2f} ms/step ({busy / wall:.0%}), {summary['calls'] / per:.0f} "
            f"{'kernels' if on_device else 'operator calls'}/step; most time: "
            + "; ".join(f"{name} x{count} {ms:.3f} ms" for name, count, ms in top_rows))
    return {"wall_ms_per_step": wall, "busy_ms_per_step": busy, "per_step": summary["calls"] / per,
            "top": top_rows, "summary": line}


#: The ``record_function`` label around what CUDA graphs capture (``--profile`` counts what runs outside it).
CAPTURED = "captured step"


def _captured_parts(tapped, drafter) -> list[tuple[object, str]]:
    """``(object, method name)`` of what a CUDA graph captures on CUDA: the static target's forward body and the
    kept-context drafter's write and draft steps; on the dynamic cache the model's forward (eager: nothing is
    captured, the forward is what the loop calls), and a drafter's ``draft_block`` where it is not graphed."""
    parts = [(tapped, "_body") if isinstance(tapped, StaticTappedTarget) else (tapped.model, "forward")]
    if isinstance(drafter, GraphedDrafter):
        parts += [(drafter, "_write"), (drafter, "_draft")]
    elif drafter is not None:
        parts.append((drafter, "draft_block"))
    return parts


@contextmanager
def _wrapped(parts: list[tuple[object, str]], wrap):
    """Each part's method replaced on its instance by ``wrap(method, index)`` (index 0: the target's), restored
    after."""
    for index, (owner, name) in enumerate(parts):
        setattr(owner, name, wrap(getattr(owner, name), index))
    try:
        yield
    finally:
        for owner, name in parts:
            delattr(owner, name)  # the class's method again


def _outside_graphs(tapped, drafter_for, prompt, config, device: torch.device, repeats: int) -> dict:
    """The host's work per cycle outside what CUDA graphs capture (:func:`_captured_parts`), from two generations of
    ``prompt``, half of ``max_new_tokens`` and all of it (within the capacity the caches were sized for): their
    difference over their cycles' difference is exactly a cycle's work (the prefill, the prompt's drafter windows
    and the set-up cancel). Counts come from one profile of each (:func:`profiling.operator_counts`: top-level
    calls by name, those launching CUDA work, syncs, ``.tolist()`` reads, ``torch.tensor(device=...)`` writes);
    the wall time outside the parts from ``repeats`` unprofiled runs of each (the least, the host's noise being
    all upward): the decode loop's seconds less the parts' own (the prefill's excluded). On CPU torch runs one
    thread meanwhile: the host's work outside is one thread's anyway, and on shared cores a forward's threads
    waiting for each other made the figure noise."""
    configs = (dataclasses.replace(config, max_new_tokens=max(config.max_new_tokens // 2, 1)), config)
    cycles, counts, outside_s = [], [], []
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        for chosen in configs:
            _outside_pass(tapped, drafter_for, prompt, chosen, device, repeats, cycles, counts, outside_s)
    finally:
        torch.set_num_threads(threads)
    per = max(cycles[1] - cycles[0], 1)
    names = sorted(set(counts[0]["outside"]) | set(counts[1]["outside"]))
    by_name = {name: (counts[1]["outside"].get(name, 0) - counts[0]["outside"].get(name, 0)) / per for name in names}
    figures = {key: (counts[1][key] - counts[0][key]) / per
               for key in ("outside_all", "launches_outside", "syncs_outside", "reads_outside", "writes_outside",
                           "launches_inside")}
    figures |= {"operators_outside": sum(by_name.values()), "by_name": {k: v for k, v in by_name.items() if v},
                "outside_ms": 1000 * (outside_s[1] - outside_s[0]) / per, "cycles": cycles}
    top = sorted(figures["by_name"].items(), key=lambda item: (-item[1], item[0]))
    figures["summary"] = (
        f"outside the captured steps, per step: {figures['operators_outside']:.1f} operator calls "
        f"({figures['launches_outside']:.1f} launching CUDA work), {figures['syncs_outside'] + figures['reads_outside']:.1f} "
        f"host-device syncs ({figures['syncs_outside']:.1f} .item() or data-dependent, {figures['reads_outside']:.1f} .tolist()), "
        f"{figures['writes_outside']:.1f} host-to-device tensors; {figures['outside_ms']:.3f} ms wall "
        f"({'CUDA' if device.type == 'cuda' else 'CPU, eager arithmetic included'}); "
        # Replayed graphs record no operator: inside counts only where the captured parts ran eagerly (CPU).
        + (f"inside the captured steps {figures['launches_inside']:.0f} calls launching CUDA work (run eagerly "
           f"here; about what the graphs hold); " if figures["launches_inside"] else "")
        + "outside by name: " + ", ".join(f"{name.removeprefix('aten::')} x{count:g}" for name, count in top))
    return figures


def _outside_pass(tapped, drafter_for, prompt, config, device, repeats, cycles, counts, outside_s) -> None:
    """One generation of :func:`_outside_graphs`: its cycles, operator counts and least wall seconds outside the
    captured parts, appended to the lists."""
    drafter = drafter_for(0)
    with _wrapped(_captured_parts(tapped, drafter), lambda fn, _: marked(fn, CAPTURED)), host_transfers():
        result, prof = profiled(lambda: speculative_generate(tapped, drafter, prompt, config), device)
    cycles.append(result.num_cycles)
    counts.append(operator_counts(prof, CAPTURED))
    runs = []
    for _ in range(repeats):
        drafter, spent = drafter_for(0), ([], [])  # the target's calls, the drafter's

        def timer(fn, index, spent=spent):
            def call(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[min(index, 1)].append(time.perf_counter() - started)

            return call

        with _wrapped(_captured_parts(tapped, drafter), timer):
            result = speculative_generate(tapped, drafter, prompt, config)
        runs.append(result.decode_seconds - sum(spent[0][1:]) - sum(spent[1]))  # spent[0][0]: the prefill
    outside_s.append(min(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default", help="default (SmolLM2), smollm2-random, qwen3-8b-random or a local path")
    parser.add_argument("--kv-cache", nargs="+", default=["static", "dynamic"], choices=["dynamic", "static"],
                        help="caches in the order they run (the first is the ratios' basis)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU-sized lengths")
    parser.add_argument("--profile", action="store_true",
                        help="after the timings, profile one prompt of each loop: wall vs device-busy ms per step, "
                             "kernels per step and the kernels that take the most time")
    parser.add_argument("--drafter-context", nargs="+", default=["kept"], choices=["kept", "whole"],
                        help="static cache: the drafter keeps its context's keys and values (kept, as evaluate runs "
                             "it) or computes every context row's again at each draft (whole); both: side by side")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.prompt_tokens, args.max_new_tokens, args.block_size, args.draft_layers = 2, 16, 12, 4, 1
        args.repeats = min(args.repeats, 2)
        args.target = "smollm2-random" if args.target == "default" else args.target
    device = torch.device(args.device)
    model, identity = build_target(args.target, device, args.smoke, seed=0)
    model.to(getattr(torch, args.dtype))
    layers = model.config.num_hidden_layers
    taps = sorted({1, layers // 2, layers - 3})
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    low = 1 if args.target in RANDOM_TARGETS else 0
    prompts = [torch.randint(low, vocab, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    plain = SpeculativeConfig(block_size=1, max_new_tokens=args.max_new_tokens)
    block = SpeculativeConfig(block_size=args.block_size, max_new_tokens=args.max_new_tokens, mask_token_id=0)
    drafter = _random_drafter(model, args.draft_layers, args.block_size, taps)
    print(f"target {identity.name} ({args.dtype}, {device}{', ' + torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}), "
          f"{args.prompts} prompts x {args.prompt_tokens} tokens, {args.max_new_tokens} new, block {args.block_size}, "
          f"torch {torch.__version__}", flush=True)
    rows, first = [], {}
    for kind in args.kv_cache:
        tapped = (StaticTappedTarget if kind == "static" else TappedTarget)(model, taps)
        capacity = args.prompt_tokens + args.max_new_tokens + args.block_size
        if kind == "static":
            tapped.reserve(capacity)
        drafters = ({context: (GraphedDrafter if context == "kept" else WholeContextDrafter)(drafter, capacity)
                     for context in args.drafter_context} if kind == "static" else {"whole": drafter})
        with tapped:
            references = _timed(tapped, lambda i: None, prompts, plain)[2]
            loops = {"block size 1 (ms/token)": (lambda i: None, plain),
                     f"block {args.block_size}, replay drafter (ms/cycle)":
                         (lambda i, refs=references: ReplayDrafter(prompts[i] + refs[i], vocab, i), block)}
            for context, drafting in drafters.items():
                loops[f"block {args.block_size}, {args.draft_layers}-layer drafter, {context} context (ms/cycle)"] = (
                    lambda i, model=drafting: model, block)
            for name, (chosen, config) in loops.items():
                _timed(tapped, chosen, prompts, config)  # cold: capture, allocator
                runs = [_timed(tapped, chosen, prompts, config) for _ in range(args.repeats)]
                per_step = statistics.median(1000 * s / max(n, 1) for s, n, _ in runs)
                # Drafter rows compare with the first drafter row, whatever its context.
                same = first.setdefault(name.split("-layer drafter")[0], (per_step, runs[0][2]))
                row = {"kv_cache": kind, "loop": name, "ms_per_step": per_step, "steps": runs[0][1],
                       "ratio_to_first": same[0] / per_step, "same_tokens_as_first": runs[0][2] == same[1],
                       "graph_replays": getattr(tapped, "replays", 0),
                       "draft_replays": sum(getattr(d, "replays", 0) for d in drafters.values())}
                rows.append(row)
                print(f"{kind:8s} {name:58s} {per_step:8.2f} ms  steps {row['steps']:5d}  "
                      f"{row['ratio_to_first']:.2f}x the {args.kv_cache[0]} cache  same tokens: {row['same_tokens_as_first']}",
                      flush=True)
                if args.profile:
                    row["profile"] = _profile(tapped, chosen, prompts[:1], config, device)
                    print(f"{'':8s} {'':58s} {row['profile']['summary']}", flush=True)
                    row["outside_graphs"] = _outside_graphs(tapped, chosen, prompts[0], config, device, max(args.repeats, 5))
                    print(f"{'':8s} {'':58s} {row['outside_graphs']['summary']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
