"""The static decoder's decode attention on one GPU: time per layer and bitwise repeatability of each kernel, and
optionally where one eager decode step spends its GPU time (docs/generate.md).

Run::

    python benchmarks/decode_attention.py                  # SmolLM2's shape: 9 query heads, 3 KV heads, head_dim 64
    python benchmarks/decode_attention.py --profile        # also a torch.profiler table of one eager decode step

Kernels, one query token per row against a cache of ``--lengths`` with half of it masked (additive bf16 mask):
``grouped-matmul`` (``dflash.generation.static_decode.deterministic_decode_attention``), ``sdpa-gqa``
(``grouped_decode_attention``: SDPA with ``enable_gqa``, the backend SDPA picks), ``sdpa-gqa-cudnn`` and
``sdpa-gqa-math`` (that backend forced), and ``sdpa-expanded`` (transformers' path: the KV heads repeated to the query
heads, the copy made once outside the timing). Printed per kernel: microseconds per call (one layer; mean of 50
after 3 warm-up calls) and whether 20 calls on the same inputs gave identical bits. ``--profile`` builds the
random-weight SmolLM2-shaped model (bf16, sdpa) and profiles 3 eager decode steps of the static decoder at
``--rows`` rows and cache length 640, 330 positions attended, for each decode attention (deterministic, fast, ranged).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash.generation.ranged_attention import ranged_attention_available, ranged_decode_attention
from dflash.generation.static_decode import (
    StaticDecoder,
    deterministic_decode_attention,
    grouped_decode_attention,
)


def timed(fn, calls: int = 50) -> tuple[float, bool]:
    for _ in range(3):
        reference = fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    microseconds = (time.perf_counter() - started) / calls * 1e6
    return microseconds, all(torch.equal(reference, fn()) for _ in range(20))


def kernels(rows: int, length: int, query_heads: int, kv_heads: int, head_dim: int) -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    query = torch.randn(rows, query_heads, 1, head_dim, device=device, dtype=dtype)
    key = torch.randn(rows, kv_heads, length, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    mask = torch.zeros(rows, 1, 1, length, device=device, dtype=dtype)
    mask[..., length // 2 + 10:] = torch.finfo(dtype).min
    group = query_heads // kv_heads
    expanded_key, expanded_value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)

    def sdpa(backend=None):
        def call():
            if backend is None:
                return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        return call

    candidates = {
        "grouped-matmul": lambda: deterministic_decode_attention(None, query, key, value, mask)[0],
        "sdpa-gqa": lambda: grouped_decode_attention(None, query, key, value, mask)[0],
        "sdpa-gqa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-gqa-math": sdpa(SDPBackend.MATH),
        "sdpa-expanded": lambda: F.scaled_dot_product_attention(query, expanded_key, expanded_value, attn_mask=mask),
    }
    if ranged_attention_available(device):
        starts = torch.zeros(rows, dtype=torch.int32, device=device)
        ends = torch.full((rows,), length // 2 + 10, dtype=torch.int32, device=device)
        candidates["ranged"] = lambda: ranged_decode_attention(query, key, value, starts, ends)
        for block, warps, stages in ((128, 4, 2), (64, 8, 2), (128, 8, 3), (64, 4, 3), (32, 4, 2)):
            candidates[f"ranged-b{block}w{warps}s{stages}"] = (
                lambda b=block, w=warps, st=stages: ranged_decode_attention(query, key, value, starts, ends, block=b,
                                                                            num_warps=w, num_stages=st))
        difference = (candidates["ranged"]().float() - candidates["sdpa-gqa"]().float()).abs().max().item()
        print(f"rows {rows} length {length} ranged vs sdpa-gqa: max abs difference {difference:.3g}")
    for name, fn in candidates.items():
        try:
            microseconds, repeatable = timed(fn)
        except RuntimeError as error:  # a backend without a kernel for these inputs
            print(f"rows {rows} length {length} {name:15s} no kernel ({str(error).splitlines()[0][:80]})")
            continue
        print(f"rows {rows} length {length} {name:15s} {microseconds:8.1f} us/layer  repeatable over 20 calls: "
              f"{repeatable}", flush=True)


def profile(rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    for kind in ("deterministic", "fast", "ranged"):
        decoder = StaticDecoder(model, rows=rows, pad_token_id=0, stop_token_ids=[0],
                                deterministic=kind == "deterministic", ranged=kind == "ranged")
        slot = decoder._slot(rows, 640)
        slot.mask[..., :330] = 0  # about half of the cache attended, as the ranged kernel's rows below
        slot.ends.fill_(330)
        with torch.inference_mode():
            for _ in range(2):
                decoder._step(slot)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    decoder._step(slot)
                torch.cuda.synchronize()
        print(f"== one eager decode step x3, {rows} rows, cache 640 (330 attended), decode attention {kind}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
        decoder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--lengths", type=int, nargs="+", default=[384, 640, 1024])
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("QUERY", "KV", "HEAD_DIM"))
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_attention.py needs a CUDA GPU")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for rows in args.rows:
        for length in args.lengths:
            kernels(rows, length, *args.heads)
    if args.profile:
        profile(args.rows[0])


if __name__ == "__main__":
    main()
