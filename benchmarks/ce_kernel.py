"""Benchmark the per-chunk cross-entropy of the DFlash loss: softmax CE, argmax hits and ``d loss / d logits``.

One chunk of the chunked LM head (dflash/drafter/loss.py): ``[C, V]`` bf16 logits, int64 targets, float32 row
weights -> (weighted CE sum, ``[C]`` hits, ``[C, V]`` bf16 gradient). Implementations timed:

* ``eager``      ``loss._ce_chunk_inplace`` (float32 buffer, ~10 passes)
* ``inductor``   ``torch.compile(loss._ce_chunk_fusable)`` (what ran on CUDA before the Triton kernel)
* ``triton``     ``ce_triton.ce_chunk_triton`` into a new gradient tensor
* ``triton-inplace``  the same, gradient written over the logits (what loss.py runs: ``DFLASH_CE_KERNEL=auto``)

Effective bandwidth = ``3 * C * V * itemsize / time``: the bytes of the minimal two-pass scheme (read the logits twice,
write the gradient once), the same for every implementation, so GB/s compares them on one scale (H200 HBM3e peak:
4.8 TB/s). Accuracy: max |grad - grad_fp32| over the chunk against the eager chunk run on float32 logits, relative
error of the total, and the number of rows whose hit flag differs.

Each timed call starts from a fresh copy of the logits (the in-place variants destroy them); the copy is outside the
timed region (CUDA events around the call only).

    python benchmarks/ce_kernel.py                       # GPU: C=10240, V=151936 and 49152, bf16 (~30-60 s)
    python benchmarks/ce_kernel.py --sweep               # also each Triton pass per (BLOCK_V, num_warps) config
    python benchmarks/ce_kernel.py --json ce.json        # also write the figures
    python benchmarks/ce_kernel.py --smoke               # CPU: eager only, tiny sizes, checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
from rich.console import Console
from rich.table import Table

from dflash.drafter import ce_triton, loss

console = Console(width=150)
BANDWIDTH_FORMULA = "GB/s = 3 * C * V * itemsize / t  (read logits twice + write grad once: the two-pass minimum)"


def make_chunk(num_rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Logits ~ N(0, 2^2); targets uniform; row weights exp(-(k-1)/7) over block positions, ~10% zero."""
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=generator, device=device) * 2.0).to(dtype)
    target = torch.randint(0, vocab, (num_rows,), generator=generator, device=device)
    positions = torch.arange(num_rows, device=device) % 15
    rows_w = torch.exp(-positions.float() / 7.0)
    rows_w = rows_w * (torch.rand(num_rows, generator=generator, device=device) > 0.1)
    return logits, target, rows_w


def implementations(device: str, smoke: bool):
    impls = {"eager": lambda x, t, w: loss._ce_chunk_inplace(x, t, w, True)}
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device == "cuda" and not smoke:
        impls["inductor"] = lambda x, t, w: loss._fused_chunk_fn()(x, t, w)
    if ce_triton.triton_available() and (device == "cuda" or interpret):
        impls["triton"] = lambda x, t, w: ce_triton.ce_chunk_triton(x, t, w)
        impls["triton-inplace"] = lambda x, t, w: ce_triton.ce_chunk_triton(x, t, w, inplace=True)
    return impls


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, source: torch.Tensor, target, rows_w, *, warmup: int, iters: int, device: str) -> float:
    """Median milliseconds of ``fn(fresh copy of source, target, rows_w)``, the copy not timed."""
    work = torch.empty_like(source)
    times = []
    for step in range(warmup + iters):
        work.copy_(source)
        _sync(device)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(work, target, rows_w)
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            begin = time.perf_counter()
            out = fn(work, target, rows_w)
            elapsed = (time.perf_counter() - begin) * 1e3
        del out
        if step >= warmup:
            times.append(elapsed)
    return sorted(times)[len(times) // 2]


def accuracy(fn, source, target, rows_w, reference) -> dict:
    want_total, want_correct, want_grad = reference
    total, correct, grad = fn(source.clone(), target, rows_w)
    grad_error = 0.0
    for start in range(0, grad.shape[0], 1024):  # row blocks: no [C, V] float32 temporaries
        block = (grad[start:start + 1024].float() - want_grad[start:start + 1024]).abs().max()
        grad_error = max(grad_error, float(block))
    return {
        "max_abs_grad_diff": grad_error,
        "total_rel_diff": abs(float(total) - float(want_total)) / max(abs(float(want_total)), 1e-30),
        "correct_mismatches": int((correct != want_correct).sum()),
    }


def sweep_triton(source, target, rows_w, *, warmup: int, iters: int) -> list[dict]:
    """Each pass alone per config: pass 1 (stats) from STATS_CONFIGS, pass 2 (grad into a new tensor)."""
    rows = []
    bytes_one_pass = source.numel() * source.element_size()
    for block, warps in ce_triton.STATS_CONFIGS:
        ms = time_calls(lambda x, t, w, c=(block, warps): ce_triton.ce_chunk_triton(
            x, t, w, need_grad=False, stats_config=c), source, target, rows_w, warmup=warmup, iters=iters,
            device="cuda")
        rows.append({"pass": "stats", "block_v": block, "num_warps": warps, "ms": ms,
                     "gb_per_s": bytes_one_pass / ms / 1e6})
    stats_ms = min(row["ms"] for row in rows)
    for block, warps in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8)):
        ms = time_calls(lambda x, t, w, c=(block, warps): ce_triton.ce_chunk_triton(
            x, t, w, grad_config=c), source, target, rows_w, warmup=warmup, iters=iters, device="cuda")
        rows.append({"pass": "grad", "block_v": block, "num_warps": warps, "ms": ms - stats_ms,
                     "gb_per_s": 2 * bytes_one_pass / max(ms - stats_ms, 1e-6) / 1e6})
    return rows


def run_shape(num_rows: int, vocab: int, dtype: torch.dtype, device: str, args) -> list[dict]:
    if device == "cuda":  # a static compile per V, as in training (V fixed), not a dynamic-shape recompile
        torch._dynamo.reset()
        loss._fused_chunk_fn.cache_clear()
    source, target, rows_w = make_chunk(num_rows, vocab, dtype, device)
    reference = loss._ce_chunk_inplace(source.float(), target, rows_w, True)  # float32 grad
    moved = 3 * num_rows * vocab * source.element_size()
    results = []
    for name, fn in implementations(device, args.smoke).items():
        if args.impls and name not in args.impls:
            continue
        compile_start = time.perf_counter()
        fn(source.clone(), target, rows_w)  # compile / autotune outside the timing
        _sync(device)
        first_call_s = time.perf_counter() - compile_start
        ms = time_calls(fn, source, target, rows_w, warmup=args.warmup, iters=args.iters, device=device)
        row = {"impl": name, "rows": num_rows, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
               "ms": ms, "gb_per_s": moved / ms / 1e6, "first_call_s": first_call_s}
        row.update(accuracy(fn, source, target, rows_w, reference))
        results.append(row)
    if device == "cuda" and getattr(ce_triton, "_ce_stats_kernel_tuned", None) is not None:
        best = getattr(ce_triton._ce_stats_kernel_tuned, "best_config", None)
        if best is not None:
            console.print(f"V={vocab}: autotuned stats config {best}")
    if args.sweep and device == "cuda" and ce_triton.triton_available():
        for row in sweep_triton(source, target, rows_w, warmup=args.warmup, iters=args.iters):
            row.update({"impl": f"sweep-{row['pass']}", "rows": num_rows, "vocab": vocab})
            results.append(row)
    del source, reference
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def print_table(results: list[dict]) -> None:
    table = Table(title="cross-entropy chunk (median per call)")
    for column in ("impl", "C x V", "ms", "GB/s", "first call s", "max |dgrad|", "total rel", "hit diffs"):
        table.add_column(column, justify="left" if column == "impl" else "right")
    for row in results:
        if row["impl"].startswith("sweep-"):
            label = f"{row['impl']} {row['block_v']}/{row['num_warps']}w"
            table.add_row(label, f"{row['rows']} x {row['vocab']}", f"{row['ms']:.3f}", f"{row['gb_per_s']:.0f}",
                          "", "", "", "")
            continue
        table.add_row(row["impl"], f"{row['rows']} x {row['vocab']}", f"{row['ms']:.3f}", f"{row['gb_per_s']:.0f}",
                      f"{row['first_call_s']:.1f}", f"{row['max_abs_grad_diff']:.2e}", f"{row['total_rel_diff']:.1e}",
                      str(row["correct_mismatches"]))
    console.print(table)
    console.print(BANDWIDTH_FORMULA)
    if any(row["impl"].startswith("sweep-") for row in results):
        console.print("sweep rows: GB/s of that pass alone (stats: C*V*itemsize read; grad: read + write; grad ms = "
                      "stats+grad call minus the best stats time)")


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        json.dump(payload, handle, indent=2)
    os.replace(handle.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, eager only (+Triton under TRITON_INTERPRET=1), "
                                                             "tiny sizes: checks the script, not the speed")
    parser.add_argument("--rows", type=int, default=10240, help="C, rows per chunk")
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 49152], help="V values")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--impls", nargs="+", default=None,
                        choices=["eager", "inductor", "triton", "triton-inplace"], help="subset to time (default all)")
    parser.add_argument("--sweep", action="store_true", help="also time each Triton pass per config")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.smoke:
        device, args.rows, args.vocab, args.warmup, args.iters = "cpu", 24, [1000], 1, 2
    elif not torch.cuda.is_available():
        parser.error("needs CUDA (use --smoke on CPU)")
    else:
        device = "cuda"
    results = []
    for vocab in args.vocab:
        results += run_shape(args.rows, vocab, torch.bfloat16, device, args)
    print_table(results)
    if args.json is not None:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "triton": getattr(ce_triton.triton, "__version__", None)}
        write_json(args.json, {"formula": BANDWIDTH_FORMULA, "environment": env, "results": results})
        console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
