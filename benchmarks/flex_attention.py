"""FlexAttention kernel options on the DFlash training mask: forward and forward+backward time per call.

Builds the exact attention problem of one drafter layer in ``benchmarks/drafter_step.py`` (8B shape: 32 query
heads, 8 KV heads, head_dim 128, bf16; packed sequences of 3072 tokens, 512 fixed-shape anchors x block 16 per
sequence; the drafter's own ``flex_block_mask``) and times ``flex_attention`` compiled with each candidate
``kernel_options`` dict (FlexAttention's documented options: ``fwd_``/``bwd_``-prefixed ``BLOCK_M``/``BLOCK_N``/
``BLOCK_M1``.. ``num_warps``/``num_stages``, ``USE_TMA``, ``ROWS_GUARANTEED_SAFE``), optionally also with inductor's
max-autotune search. Prints one line per candidate as soon as it is measured (so a time-limited run keeps what it
measured), then a table; ``--json OUT`` writes the figures. A winner is applied with
``dflash.drafter.attention_kernels.set_flex_kernel_options`` (on an H200 the drafter keeps inductor's default Triton tiles: the
fastest forward alone, 128x128 tiles, did not speed up the training step; docs/benchmarks.md). Where flash-attn-4
is installed the ``flash`` candidate (``BACKEND="FLASH"``, its CuTe DSL kernels: what the drafter then uses) is
timed too, and its output and gradients are compared with the Triton default's.

Attention FLOPs per call: ``4 * heads * head_dim * visible_pairs`` forward (QK^T and PV), 2.5x that backward.

    python benchmarks/flex_attention.py                   # batch 4, all candidates (GPU, ~3-5 min incl. compiles)
    python benchmarks/flex_attention.py --batch 1 --only default,rows_safe
    python benchmarks/flex_attention.py --autotune        # also inductor max-autotune (slow compile)
    python benchmarks/flex_attention.py --smoke           # tiny, CPU: checks that it runs
    python benchmarks/flex_attention.py --tiles           # the mask's tile counts at full size (CPU, seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_step import eight_b_config, make_batch, smoke_config  # noqa: E402

from dflash.drafter.anchors import sample_anchors  # noqa: E402
from dflash.drafter.attention_kernels import flash_attention_available  # noqa: E402
from dflash.drafter.masks import attention_layout, dense_attention_mask, flex_block_mask  # noqa: E402


def _forward(block_m: int, block_n: int, warps: int, stages: int) -> tuple[str, dict]:
    return f"fwd_{block_m}x{block_n}_w{warps}_s{stages}", {
        "fwd_BLOCK_M": block_m, "fwd_BLOCK_N": block_n, "fwd_num_warps": warps, "fwd_num_stages": stages}


def _backward(block_m: int, block_n: int, warps: int, stages: int) -> tuple[str, dict]:
    """dK/dV tiles ``block_m x block_n``, dQ tiles transposed (inductor's own backward configs pair them so)."""
    return f"bwd_{block_m}x{block_n}_w{warps}_s{stages}", {
        "bwd_BLOCK_M1": block_m, "bwd_BLOCK_N1": block_n, "bwd_BLOCK_M2": block_n, "bwd_BLOCK_N2": block_m,
        "bwd_num_warps": warps, "bwd_num_stages": stages}


#: Candidate kernel options (name -> options). "default" = inductor's own choice for the GPU.
CANDIDATES: dict[str, dict] = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"USE_TMA": True},
    "tma_rows_safe": {"USE_TMA": True, "ROWS_GUARANTEED_SAFE": True},
    **dict(_forward(*tiles) for tiles in [(128, 128, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3)]),
    **dict(_backward(*tiles) for tiles in [(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 4, 3),
                                            (64, 128, 8, 4), (128, 128, 8, 2), (64, 64, 8, 3)]),
}


def build_layout(batch_size: int, smoke: bool, device: torch.device):
    """The drafter config, the step's ``AttentionLayout`` and its visible (query, key) pair count."""
    config = smoke_config(16) if smoke else eight_b_config(16)
    seq, budget = (96, 8) if smoke else (3072, 512)
    batch = make_batch([seq] * batch_size, config, device)
    generator = torch.Generator(device=device).manual_seed(0)
    anchors = sample_anchors(batch, config.block_size, budget, generator, num_anchors=budget * batch_size)
    layout = attention_layout(anchors, batch.position_ids, config.block_size)
    real = anchors >= 0
    visible = float(((layout.context_hi - layout.context_lo).view(-1, config.block_size)[real].sum())
                    + int(real.sum()) * config.block_size * config.block_size)
    return config, layout, visible


def tile_counts(layout) -> tuple[int, int]:
    """(partial, full) 128x128 tiles of the step's ``BlockMask`` (what FlexAttention computes; any device)."""
    mask = flex_block_mask(layout)
    return int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())


def build_problem(batch_size: int, smoke: bool, device: torch.device):
    """q ``[1, Hq, Q, D]``, k/v ``[1, Hkv, T+Q, D]`` bf16 (requires grad), the mask and the visible pair count."""
    config, layout, visible = build_layout(batch_size, smoke, device)
    mask = flex_block_mask(layout) if device.type == "cuda" else dense_attention_mask(layout)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(1)

    def rand(heads: int, length: int) -> torch.Tensor:
        return torch.randn(1, heads, length, config.head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()

    q = rand(config.num_attention_heads, layout.num_queries)
    k = rand(config.num_key_value_heads, layout.num_keys)
    v = rand(config.num_key_value_heads, layout.num_keys)
    return config, q, k, v, mask, visible


def time_candidate(fn, q, k, v, mask, options: dict, warmup: int, iters: int, device: torch.device) -> tuple[float, float]:
    """(forward ms, forward+backward ms) per call, averaged over ``iters`` after ``warmup`` calls."""
    from torch.nn.attention.flex_attention import flex_attention

    def call():
        if isinstance(mask, torch.Tensor):  # CPU smoke: SDPA with the dense mask
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None)

    del flex_attention
    grad = torch.randn_like(q)
    for _ in range(warmup):
        call().backward(grad)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    # Forward as in training (grad enabled, output discarded): a no-grad call is another graph, and timing it gave
    # meaningless figures on the H200 (190 ms for a ~3 ms forward).
    started = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    forward = (time.perf_counter() - started) / iters
    started = time.perf_counter()
    for _ in range(iters):
        call().backward(grad)
    sync()
    both = (time.perf_counter() - started) / iters
    return forward * 1e3, both * 1e3


def relative_differences(fn, q, k, v, mask, options: dict) -> dict[str, float]:
    """``|a - b| / |a|`` (L2) of the output and of dq/dk/dv between ``options`` and the Triton default."""
    grad = torch.randn_like(q)
    results = []
    for opts in (None, options):
        for tensor in (q, k, v):
            tensor.grad = None
        out = fn(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)
        out.backward(grad)
        results.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for tensor in (q, k, v):
        tensor.grad = None
    return {name: float((a - b).norm() / a.norm()) for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[4])
    parser.add_argument("--only", default=None, help="comma-separated candidate names (default: all)")
    parser.add_argument("--options", default=None, help="an extra candidate as a JSON dict, named 'custom'")
    parser.add_argument("--autotune", action="store_true", help="also compile with mode='max-autotune-no-cudagraphs'")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (SDPA with the dense mask)")
    parser.add_argument("--tiles", action="store_true",
                        help="only count the full-size mask's tiles (partial, full, share of computed pairs visible) "
                             "and exit; runs on CPU")
    args = parser.parse_args()
    if args.tiles:
        for batch_size in args.batch:
            _, layout, visible = build_layout(batch_size, False, torch.device("cpu"))
            partial, full = tile_counts(layout)
            print(f"batch {batch_size}: {partial + full} tiles of 128x128 per layer ({partial} partial, {full} full); "
                  f"visible pairs {visible:.4g} = {visible / ((partial + full) * 128 * 128):.1%} of the computed ones")
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    candidates = dict(CANDIDATES)
    if flash_attention_available():
        candidates["flash"] = {"BACKEND": "FLASH"}
    if args.options:
        candidates["custom"] = json.loads(args.options)
    if args.only:
        candidates = {name: candidates[name] for name in args.only.split(",")}
    if device.type != "cuda":
        candidates = {"default": {}}
    from torch import _dynamo

    _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    runs = [(name, options, compiled) for name, options in candidates.items()]
    if args.autotune and device.type == "cuda":
        runs.append(("max-autotune", {}, torch.compile(flex_attention, dynamic=False, mode="max-autotune-no-cudagraphs")))
    rows = []
    for batch_size in args.batch:
        config, q, k, v, mask, visible = build_problem(batch_size, args.smoke, device)
        flops_fwd = 4 * config.num_attention_heads * config.head_dim * visible
        print(f"batch {batch_size}: Q={q.shape[2]} KV={k.shape[2]} visible pairs {visible:.4g} "
              f"({visible / (q.shape[2] * k.shape[2]):.1%} of dense); fwd {flops_fwd / 1e12:.3f} TFLOP", flush=True)
        for name, options, fn in runs:
            started = time.perf_counter()
            try:
                forward, both = time_candidate(fn, q, k, v, mask, options, args.warmup, args.iters, device)
            except Exception as error:  # noqa: BLE001  an invalid option set: report and go on
                print(f"  {name:22s} FAILED: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            backward = both - forward
            row = {"batch": batch_size, "name": name, "options": options, "fwd_ms": forward, "bwd_ms": backward,
                   "fwd_bwd_ms": both, "fwd_tflops": flops_fwd / forward / 1e9,
                   "bwd_tflops": 2.5 * flops_fwd / max(backward, 1e-9) / 1e9,
                   "compile_and_time_s": time.perf_counter() - started}
            if options.get("BACKEND") == "FLASH":
                row["rel_l2_vs_triton"] = relative_differences(fn, q, k, v, mask, options)
            rows.append(row)
            print(f"  {name:22s} fwd {forward:8.3f} ms ({row['fwd_tflops']:6.1f} TFLOP/s)  bwd {backward:8.3f} ms "
                  f"({row['bwd_tflops']:6.1f} TFLOP/s)  fwd+bwd {both:8.3f} ms  [{row['compile_and_time_s']:.0f} s]",
                  flush=True)
            if "rel_l2_vs_triton" in row:
                print("  " + " ".join(f"{key} {value:.2e}" for key, value in row["rel_l2_vs_triton"].items())
                      + "  (relative L2 difference from the Triton default)", flush=True)
        del q, k, v, mask
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                                               else "cpu", "torch": torch.__version__, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
