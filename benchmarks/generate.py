"""Generated tokens/s of ``generate``'s transformers engine on one device.

Run::

    python benchmarks/generate.py                                   # SmolLM2 (the embedded default), default prompts
    python benchmarks/generate.py --target qwen3-8b-random --batch-size 128
    python benchmarks/generate.py --kv-cache static dynamic         # A/B in one process
    python benchmarks/generate.py --decode-attention fast deterministic --batch-size 512 1024
    python benchmarks/generate.py --decode-attention ranged ranged-unfused --compile parts parts-decode   # fused vs not
    python benchmarks/generate.py --prompts 4096 --batch-size 1024 --batching continuous batches   # refill rows or not
    python benchmarks/generate.py --target qwen3-8b-random --batch-size 128 --varied-limits --batching continuous batches
    python benchmarks/generate.py --smoke                           # tiny, on CPU (a check that it runs)
    python benchmarks/generate.py --target smollm2-random --batch-size 1024 --profile 25   # where a step's time goes

Prompts: the first ``--prompts`` training prompts of the embedded default prompt set (code completions and
instructions about stdlib functions, through the chat template), so lengths are what the preset generates from;
for the random-weight targets (``qwen3-8b-random``, ``smollm2-random``: real shapes, no weights file), seeded random
prompts of 64-512 tokens (their replies are noise, their speed is real; they run to ``--max-new-tokens``, or with
``--varied-limits`` to a limit drawn per prompt from [max/8, max], as replies that stop early do). Each setting
runs the same requests once cold (graph capture, allocator) and ``--repeats`` times warm; the median warm pass is the
figure. Printed: generated tokens/s (reply tokens, stop token included; the padding rows of a batch excluded), rows
per second, the share of replies that stopped before ``--max-new-tokens``, how the decode step ran (CUDA graph or
eager), the share of replies identical to the first setting's (greedy: only floating-point ties can differ) and
to this setting's own cold pass (1.0 when its kernels repeat bit for bit: ``--decode-attention deterministic``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract import RANDOM_TARGETS, build_target  # noqa: E402  (the benchmarks' shared random-target builder)

from dflash.generation.default_prompts import DefaultPromptConfig, default_prompt_sets  # noqa: E402
from dflash.generation.engine import GenerationRequest, SamplingSettings  # noqa: E402
from dflash.generation.prompts import ConversationBuilder  # noqa: E402
from dflash.generation.transformers_engine import TransformersEngine  # noqa: E402
from dflash.target.load import load_tokenizer  # noqa: E402


def requests_of(num_prompts: int, max_new_tokens: int, tokenizer) -> list[GenerationRequest]:
    records = default_prompt_sets(DefaultPromptConfig(max_prompts=num_prompts))["train"]
    requests = []
    for index, record in enumerate(records):
        prompt = ConversationBuilder(record, tokenizer, {}).prompt_ids()
        requests.append(GenerationRequest(request_id=index, prompt_ids=prompt, max_new_tokens=max_new_tokens))
    return requests


class _PadOnly:
    """What the engine reads of a tokenizer, for random-weight targets without one."""

    pad_token_id = 0
    eos_token_id = 0


def hbm_bandwidth(device: torch.device, gigabytes: float = 4.0) -> float:
    """Bytes per second of a device-to-device copy (read + written), median of 5 after a warm-up."""
    source = torch.empty(int(gigabytes * 2**30), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for attempt in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        torch.cuda.synchronize(device)
        if attempt:
            times.append(start.elapsed_time(end) / 1e3)
    del source, target
    torch.cuda.empty_cache()
    return 2 * gigabytes * 2**30 / statistics.median(times)


def bound_seconds(model, engine, requests, results, bandwidth: float) -> tuple[float, float, int]:
    """The least time a pass could take at ``bandwidth`` bytes/s: every forward reads the weights once, and each
    decode step reads the keys and values of the positions its still-running rows attend (prompt + tokens so far);
    the prefill writes its rows' keys and values. Compute, launches and the host are taken as free. The decode steps
    are the ones the engine ran (``last_stats["decode_steps"]``: with continuous batching fewer than batch after
    batch), else those of its batches run to their longest reply. Returns the whole pass's bound, its decode steps'
    part and their number."""
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    kv_per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_bytes
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    batches = engine._batches(requests)
    steps = int(engine.last_stats.get("decode_steps", 0)) or sum(
        max(len(results[i].token_ids) for i in batch) - 1 for batch in batches)
    prefill = len(batches) * weights + sum(len(r.prompt_ids) for r in requests) * kv_per_token
    decode = steps * weights
    for request, result in zip(requests, results, strict=True):  # the step feeding token k reads prompt + k + 1 keys
        prompt, reply = len(request.prompt_ids), len(result.token_ids)
        decode += ((reply - 1) * (prompt + 1) + (reply - 1) * (reply - 2) // 2) * kv_per_token
    return (prefill + decode) / bandwidth, decode / bandwidth, steps


def engine_for(model, tokenizer, setting, stop, batch_size: int) -> TransformersEngine:
    """The engine of one ``(kv cache, decode attention, compile, batching)`` setting of the command line."""
    kv_cache, attention, compiled, batching = setting
    return TransformersEngine(model, tokenizer, batch_size=batch_size, token_budget=batch_size * 4096, cache=kv_cache,
                              continuous=batching == "continuous",
                              stop_token_ids=stop, deterministic=attention.startswith("deterministic"),
                              ranged=attention.startswith("ranged") if kv_cache == "static" else None,
                              fused=not attention.startswith("ranged-unfused"),
                              compile_parts=compiled.startswith("parts"), compile_prefill=compiled == "parts")


def agreement(model, tokenizer, requests, settings, setting, stop, batched, batch_size) -> dict:
    """Decode ``requests`` one at a time with ``setting`` and compare with their batched replies ``batched``."""
    kv_cache, attention, compiled, _ = setting
    model.forward = torch.compile(model.forward, dynamic=False) if compiled == "on" else model.forward
    engine = engine_for(model, tokenizer, setting, stop, 1)
    alone = [r.token_ids for r in engine.generate(requests, settings)]
    engine.close()
    identical = sum(a == b for a, b in zip(alone, batched, strict=False))
    compared = agreeing = 0
    first_divergence = []
    for a, b in zip(alone, batched, strict=False):
        common = min(len(a), len(b))
        compared += common
        same = [x == y for x, y in zip(a[:common], b[:common], strict=True)]
        agreeing += sum(same)
        if a != b:
            first_divergence.append(same.index(False) if False in same else common)
    row = {"agreement_prompts": len(requests), "batch_size": batch_size, "setting": "/".join(setting),
           "replies_identical": round(identical / len(requests), 4),
           "tokens_agreeing": round(agreeing / max(1, compared), 4),
           "median_first_divergence": statistics.median(first_divergence) if first_divergence else None}
    print(f"  one prompt at a time vs batch {batch_size} ({'/'.join(setting)}), {len(requests)} prompts: "
          f"{row['replies_identical']:.1%} of replies identical, {row['tokens_agreeing']:.1%} of tokens agree position "
          f"by position; where a reply departs, at token {row['median_first_divergence']} (median)", flush=True)
    return row


#: Kinds of device kernels by name (first match), for :func:`profile_batch`'s per-step split.
KERNEL_KINDS = (
    ("attention", ("ranged", "attn", "attention", "fmha", "flash", "sdpa")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "matmul", "splitk")),
    ("fused (compiled)", ("triton_",)),
    ("copy / fill", ("copy", "memcpy", "memset", "fill", "cat")),
    ("reduction / argmax", ("reduce", "argmax", "max_", "softmax", "sum")),
)


def profile_batch(model, tokenizer, requests, settings, setting, stop, batch_size, top, device) -> dict:
    """One warm batch of ``setting`` under ``torch.profiler``: the ``top`` kernels by device time, and device time per
    decode step by kind of kernel against the wall time per step (the gap is the host: launches, Python, waits)."""
    from torch.profiler import ProfilerActivity, profile

    kv_cache, attention, compiled, _ = setting
    engine = engine_for(model, tokenizer, setting, stop, batch_size)
    batch = requests[:batch_size]
    engine.generate(batch, settings)  # warm: capture, compilation, allocator
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        results = engine.generate(batch, settings)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
    engine.close()
    steps = max(len(r.token_ids) for r in results)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for event in kernels:
        name = event.name
        seconds = event.time_range.elapsed_us() / 1e6
        kind = next((k for k, keys in KERNEL_KINDS if any(key in name.lower() for key in keys)), "other elementwise")
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
        by_name.setdefault(name, []).append(seconds)
    device_total = sum(by_kind.values())
    print(f"  profile of one batch of {len(batch)} rows x {steps} steps ({'/'.join(setting)}): wall {wall:.2f} s = "
          f"{wall / steps * 1e3:.2f} ms per step; device kernels {device_total:.2f} s = {device_total / steps * 1e3:.2f} ms "
          f"per step, {len(kernels) / steps:.0f} kernels per step", flush=True)
    for kind, seconds in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"    {kind:20s} {seconds / steps * 1e3:7.3f} ms per step ({seconds / max(device_total, 1e-12):.0%})")
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    for name, times in ranked:
        print(f"    {sum(times) / steps * 1e3:7.3f} ms/step {len(times) / steps:6.1f} calls/step  {name[:110]}")
    if not kernels:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return {"profile": "/".join(setting), "rows": len(batch), "steps": steps, "wall_seconds": round(wall, 3),
            "device_seconds": round(device_total, 3), "kernels_per_step": round(len(kernels) / steps, 1),
            "device_ms_per_step_by_kind": {k: round(v / steps * 1e3, 3) for k, v in by_kind.items()},
            "top_kernels": [{"name": n, "ms_per_step": round(sum(t) / steps * 1e3, 3), "calls_per_step": round(len(t) / steps, 1)}
                            for n, t in ranked]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="default",
                        help="default (SmolLM2), qwen3-8b-random, smollm2-random (random weights) or a local path")
    parser.add_argument("--prompts", type=int, default=2048)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[512])
    parser.add_argument("--kv-cache", nargs="+", default=["static"], choices=["static", "dynamic"])
    parser.add_argument("--decode-attention", nargs="+", default=["ranged"],
                        choices=["ranged", "ranged-unfused", "fast", "deterministic"],
                        help="static cache: the ranged kernel (each row's own key range) with the rotary embedding and "
                             "cache write fused into one kernel (the default on CUDA), the ranged kernel through the "
                             "attention modules' own forward (ranged-unfused), SDPA's grouped-query kernel over the "
                             "padded cache (fast), the bitwise-repeatable matmuls")
    parser.add_argument("--compile", nargs="+", default=["parts"], choices=["off", "on", "parts", "parts-decode"],
                        help="static cache: the model through torch.compile (inductor): parts = its MLP and RMSNorm "
                             "modules in the decode step and the prefill (the engine's default on CUDA), parts-decode = "
                             "in the decode step only, on = the whole forward (recompiles for every new prompt width "
                             "and cache length), off = none")
    parser.add_argument("--batching", nargs="+", default=["continuous"], choices=["continuous", "batches"],
                        help="static cache with the fused attention: continuous = each row takes the next prompt as "
                             "soon as its reply ends (the engine's default), batches = batch after batch, each run to "
                             "its longest reply")
    parser.add_argument("--agreement", type=int, default=0, metavar="N",
                        help="also decode the first N prompts one at a time (batch 1, the first setting) and report how "
                             "often the batched replies of the first setting depart from them")
    parser.add_argument("--repeats", type=int, default=3, help="warm passes per setting (median reported)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the first setting's passes, profile one more batch of its first batch size and "
                             "print the N kernels that take the most device time, with time per decode step by kind")
    parser.add_argument("--varied-limits", action="store_true",
                        help="random-weight targets: each prompt's max_new_tokens drawn from [max/8, max] (seeded) "
                             "instead of all running to --max-new-tokens")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.max_new_tokens, args.batch_size, args.kv_cache = 8, 8, [4], ["dynamic"]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    model, identity = build_target(args.target, device, args.smoke, 0)
    if args.target in RANDOM_TARGETS:  # no tokenizer needed: seeded random prompts of 64-512 tokens
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(64, 513, (args.prompts,), generator=generator).tolist()
        limits = (torch.randint(max(1, args.max_new_tokens // 8), args.max_new_tokens + 1, (args.prompts,),
                                generator=generator).tolist() if args.varied_limits
                  else [args.max_new_tokens] * args.prompts)
        requests = [GenerationRequest(request_id=i, prompt_ids=torch.randint(1, 1000, (n,), generator=generator).tolist(),
                                      max_new_tokens=limit) for i, (n, limit) in enumerate(zip(lengths, limits, strict=True))]
        tokenizer, stop = _PadOnly(), [0]  # a random model almost never emits token 0: replies run to the limit
    else:
        tokenizer = load_tokenizer(args.target)
        requests = requests_of(args.prompts, args.max_new_tokens, tokenizer)
        stop = None
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, target {identity.name}, {len(requests)} prompts (mean {sum(len(r.prompt_ids) for r in requests) / len(requests):.0f} tokens), "
          f"max_new_tokens {args.max_new_tokens}, torch {torch.__version__}")
    bandwidth = hbm_bandwidth(device) if device.type == "cuda" else None
    if bandwidth:
        print(f"measured HBM bandwidth (device-to-device copy, bytes read + written): {bandwidth / 1e12:.2f} TB/s")
    figures = []
    reference: dict[int, list[list[int]]] = {}
    settings_list = [(kv, attention, compiled, batching) for kv in args.kv_cache
                     for attention in (args.decode_attention if kv == "static" else ["-"])
                     for compiled in (args.compile if kv == "static" else ["off"])
                     for batching in (args.batching if kv == "static" else ["batches"])]
    eager_forward = model.forward
    for kv_cache, attention, compiled, batching in settings_list:
        if compiled == "on":  # the whole forward recompiles for every prompt width and cache length
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        model.forward = torch.compile(eager_forward, dynamic=False) if compiled == "on" else eager_forward
        label = attention if compiled == "off" else f"{attention}+compile-{compiled}"
        for batch_size in args.batch_size:
            engine = engine_for(model, tokenizer, (kv_cache, attention, compiled, batching), stop, batch_size)
            name = label + ("+continuous" if engine.streams else "")
            warm = []
            own_cold: list[list[int]] | None = None
            for attempt in ["cold"] + [f"warm{k}" for k in range(1, args.repeats + 1)]:
                started = time.perf_counter()
                results = engine.generate(requests, settings)
                seconds = time.perf_counter() - started
                tokens = sum(len(r.token_ids) for r in results)
                stopped = sum(r.finish_reason == "stop" for r in results) / len(results)
                mode = engine.decode_step
                same = reference.setdefault(batch_size, [r.token_ids for r in results])
                agree = sum(a == r.token_ids for a, r in zip(same, results, strict=True)) / len(results)
                own_cold = own_cold or [r.token_ids for r in results]
                repeat = sum(a == r.token_ids for a, r in zip(own_cold, results, strict=True)) / len(results)
                bound, decode_bound, steps = (bound_seconds(model, engine, requests, results, bandwidth)
                                              if bandwidth else (None, None, 0))
                row = {"bound_seconds": bound and round(bound, 3),
                       "decode_step_bound_ms": bound and round(decode_bound / max(steps, 1) * 1e3, 3), "decode_steps": steps, "kv_cache": kv_cache, "decode_attention": name, "continuous_batching": engine.streams, "batch_size": batch_size, "pass": attempt, "seconds": round(seconds, 2),
                       "generated_tokens": tokens, "tokens_per_s": round(tokens / seconds, 1),
                       "rows_per_s": round(len(results) / seconds, 2), "stopped_early": round(stopped, 3),
                       "decode_step": mode, "identical_to_first_kind": round(agree, 4),
                       "identical_to_own_cold_pass": round(repeat, 4),
                       "device": name, "target": identity.name}
                figures.append(row)
                if attempt != "cold":
                    warm.append(tokens / seconds)
                bound_text = (f" [memory bound {tokens / bound:,.0f} tok/s, {bound / seconds:.0%} of it reached; "
                              f"per decode step {decode_bound / max(steps, 1) * 1e3:.2f} ms bound, {seconds / max(steps, 1) * 1e3:.2f} "
                              "ms measured (prefills included)]" if bound else "")
                print(f"  kv {kv_cache:7s} attention {name:13s} batch {batch_size:4d} {attempt}: {tokens:,} tokens "
                      f"in {seconds:.1f} s = {tokens / seconds:,.0f} generated tok/s{bound_text} ({stopped:.0%} stopped early; "
                      f"decode step {mode}; {agree:.1%} identical to the first setting, {repeat:.1%} to this "
                      "setting's cold pass)", flush=True)
            if warm:
                print(f"  kv {kv_cache:7s} attention {name:13s} batch {batch_size:4d} median of {len(warm)} warm passes: "
                      f"{statistics.median(warm):,.0f} generated tok/s", flush=True)
            engine.close()
    if args.profile:
        figures.append(profile_batch(model, tokenizer, requests, settings, settings_list[0], stop, args.batch_size[0],
                                     args.profile, device))
    if args.agreement:
        figures.append(agreement(model, tokenizer, requests[: args.agreement], settings, settings_list[0], stop,
                                 reference[args.batch_size[0]], args.batch_size[0]))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
