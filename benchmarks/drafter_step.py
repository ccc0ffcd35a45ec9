"""Benchmark one DFlash drafter training step (anchors + mask + forward + backward + AdamW) on one GPU.

Default: the 8B-shaped drafter of issue 3 (5 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate
12288, vocab 151936, taps [1, 9, 17, 25, 33] of a 36-layer target), 512 anchors per sequence x block 16, gamma 7,
sequence 3072, batch 1 and 4 (sequences packed into one row), bf16 autocast over float32 parameters, eager and
compiled. Prints step time, sequence tokens/s and MFU (formula printed), then counts dynamo compiles over 12
distinct batch shapes (padded to length buckets on the compiled fixed-shape path).

GPU:   python benchmarks/drafter_step.py [--profile OUT_DIR]
CPU:   python benchmarks/drafter_step.py --smoke      (tiny config, seconds; checks the script, not the speed)

``--profile OUT_DIR``: after timing each mode/batch, torch.profiler over 3 steps; writes
``OUT_DIR/profile_<mode>_b<batch>.txt`` (top 30 CUDA kernels by self time with counts and % of the timed step, time
by kernel category and by step phase). On CPU (``--smoke``) the table lists CPU operators instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch._dynamo
from rich.console import Console
from rich.table import Table

from dflash.batches.packed import PackedBatch
from dflash.drafter import DFlashConfig, DFlashDrafter, attention_layout, dflash_loss, fused, sample_anchors
from dflash.drafter.attention_kernels import (
    attention_backend,
    attention_implementation,
    set_attention_backend,
    set_flex_kernel_options,
)
from dflash.drafter.model import set_train_shortcuts

console = Console(width=150)

MFU_FORMULA = (
    "MFU = F_step / (t_step * peak).  F_step = 3*(2*Q*L*P_layer + 2*T*L*2*H*Hkv) + 3.5*(L*4*Hq*S_vis) "
    "+ 2*(2*T*n*H*H) + 2*(2*A*(B-1)*H*V);  Q = A*B block tokens, T packed tokens, L draft layers, "
    "P_layer = H*Hq + 2*H*Hkv + Hq*H + 3*H*I (q,k,v,o,MLP weights), Hq/Hkv = heads*head_dim, S_vis = visible "
    "(query,key) pairs of the sparse mask, n taps, V vocab. Factors: 3 = fwd+bwd (input and weight grads), "
    "3.5 = attention fwd + 2.5x bwd, 2 = fc (no input grad: data) and LM head (frozen: no weight grad). "
    "F_step is the plain step's work; the training shortcuts (dflash.drafter.model.set_train_shortcuts) skip part "
    "of it, and MFU stays on F_step so that settings compare by time. With --distill kl|tv F_step adds "
    "3*(2*A*(B-1)*H*V): the target's logits, the drafter's again, and the gradient of the distillation term."
)


#: Switches of dflash.drafter.model.set_train_shortcuts (it returns the current settings).
SHORTCUT_NAMES = list(set_train_shortcuts())

#: Public reference trainer's DFlash step at these settings on one H200, torch 2.11 (issue 3): sequence tokens/s.
REFERENCE_TOKENS_PER_SECOND = {"eager": 16_700.0, "compiled": 20_300.0}
#: Targets: 1.25x the reference in both modes.
TARGET_SPEEDUP = 1.25


def eight_b_config(block_size: int) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960, vocab_size=151936,
        block_size=block_size, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36,
    )


def smoke_config(block_size: int) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=1000, block_size=block_size, mask_token_id=999, target_layer_ids=[0, 2],
        num_target_layers=4, max_position_embeddings=4096,
    )


def make_batch(lengths: list[int], config: DFlashConfig, device: torch.device, *, pad_to: int | None = None,
               seed: int = 0, final_tap: bool = False) -> PackedBatch:
    """Documents of ``lengths`` (first 10% of each unsupervised, like a prompt), padded to ``pad_to``; with
    ``final_tap`` the hidden states carry one more random slot (the target's final state, for ``--distill``)."""
    generator = torch.Generator().manual_seed(seed)
    real = sum(lengths)
    total = pad_to or real
    loss_mask = torch.zeros(total, dtype=torch.uint8)
    start = 0
    for length in lengths:
        loss_mask[start + max(1, length // 10): start + length] = 1
        start += length
    width = (config.num_taps + int(final_tap)) * config.hidden_size
    batch = PackedBatch(
        input_ids=torch.randint(0, config.vocab_size, (total,), generator=generator),
        loss_mask=loss_mask,
        hidden=(torch.randn(total, width, generator=generator) * 2).to(torch.bfloat16),
        position_ids=torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(total - real, dtype=torch.int64)]),
        document_ids=torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]
                               + [torch.full((total - real,), -1)]).to(torch.int64),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        num_real_tokens=real,
        corpus_rows=list(range(len(lengths))),
    )
    return batch.to(device, non_blocking=False)


def step_flops(config: DFlashConfig, batch: PackedBatch, anchors: torch.Tensor, distill: str = "none") -> float:
    """F_step of MFU_FORMULA for the real (non-padding) anchors of this step."""
    real = anchors[anchors >= 0]
    layout = attention_layout(real, batch.position_ids, config.block_size)
    visible = float((layout.context_hi - layout.context_lo).sum()) + layout.num_queries * config.block_size
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    hq = config.num_attention_heads * config.head_dim
    hkv = config.num_key_value_heads * config.head_dim
    layers, num_tokens, num_anchors = config.num_hidden_layers, batch.num_real_tokens, real.numel()
    queries = num_anchors * config.block_size
    p_layer = hidden * hq + 2 * hidden * hkv + hq * hidden + 3 * hidden * inter
    linear = 2 * queries * layers * p_layer + 2 * num_tokens * layers * 2 * hidden * hkv
    attention = layers * 4 * hq * visible
    fc = 2 * num_tokens * config.num_taps * hidden * hidden
    lm_head = 2 * num_anchors * (config.block_size - 1) * hidden * vocab
    return 3 * linear + 3.5 * attention + 2 * fc + (2 if distill == "none" else 5) * lm_head


def build_drafter(config: DFlashConfig, device: torch.device, compiled: bool, backend: str) -> DFlashDrafter:
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).to(device)
    embed = (torch.randn(config.vocab_size, config.hidden_size, device=device) * 0.02).to(torch.bfloat16)
    lm_head = (torch.randn(config.vocab_size, config.hidden_size, device=device) * 0.02).to(torch.bfloat16)
    drafter.attach_target(embed, lm_head)
    if compiled:
        drafter.compile_layers(backend=backend)
    return drafter.train()


class Stepper:
    """One training step; ``fixed`` selects the fixed-shape anchor path (no host sync)."""

    def __init__(self, drafter: DFlashDrafter, device: torch.device, budget: int, gamma: float) -> None:
        self.drafter = drafter
        self.device = device
        self.budget = budget
        self.gamma = gamma
        self.ce_chunk_rows: int | None = None  # None: the loss's default
        self.distill = "none"  # --distill: the loss's distillation term (the batch then carries a final tap)
        self.generator = torch.Generator(device=device).manual_seed(0)
        self.optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-5, fused=device.type == "cuda")
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def anchors(self, batch: PackedBatch, num_anchors: int | None) -> torch.Tensor:
        return sample_anchors(batch, self.drafter.config.block_size, self.budget, self.generator,
                              num_anchors=num_anchors)

    def __call__(self, batch: PackedBatch, num_anchors: int | None) -> torch.Tensor:
        # record_function ranges name the step phases in --profile output (negligible cost otherwise).
        with torch.profiler.record_function("phase:anchors"):
            anchors = self.anchors(batch, num_anchors)
        with torch.profiler.record_function("phase:forward+loss"), self.autocast:
            out = dflash_loss(self.drafter, batch, anchors, gamma=self.gamma, chunk_rows=self.ce_chunk_rows,
                              distill=self.distill)
            loss = out.loss()
        with torch.profiler.record_function("phase:backward"):
            loss.backward()
        with torch.profiler.record_function("phase:optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(stepper: Stepper, batch: PackedBatch, num_anchors: int | None, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        stepper(batch, num_anchors)
    synchronize(stepper.device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = stepper(batch, num_anchors)
    synchronize(stepper.device)
    elapsed = (time.perf_counter() - start) / steps
    if not math.isfinite(float(loss)):
        raise RuntimeError(f"non-finite loss {float(loss)}")
    return elapsed


PROFILE_STEPS = 3
PROFILE_TOP = 30
#: Kernel categories, first match wins (searched in the lower-cased kernel / operator name).
CATEGORIES = [
    # Inductor kernels are named after the ops they fuse ("triton_tem_fused__to_copy_add_flex_attention..." is the
    # flex-attention forward): only real copies count here.
    ("memcpy/memset", r"memcpy|memset|copy_device|dtoh|htod|dtod|aten::copy_|aten::to\b|aten::_to_copy|direct_copy"),
    ("optimizer", r"adam|multi_tensor|foreach|fused_adam|optimizer"),
    ("flash/flex attention", r"flex_attention|flash|fmha|attention|sdpa|_efficient_attention"),
    ("GEMM", r"gemm|nvjet|cutlass|xmma|cublas|matmul|aten::mm\b|aten::addmm|aten::bmm|aten::linear|splitk|"
             r"sm90_|sm80_|ampere_|hopper|triton_tem_fused.*mm"),
    ("flash/flex attention", r"triton_tem_fused"),  # other inductor templates here: flex attention
    ("CE/softmax", r"softmax|logsumexp|cross_entropy|nll_loss|_ce_chunk|argmax|amax"),
    ("elementwise/norm/rope", r"elementwise|vectorized|unrolled|reduce|triton_poi|triton_per|triton_red|rsqrt|"
                              r"norm|mul|add|pow|mean|silu|cat|neg|exp|where|index|gather|scatter|embedding|fill|zero|sqrt|lerp|sub|div|"
                              r"cos|sin|clamp|sum|sort|topk|rand|arange|ge\b|lt\b|bitwise"),
]
_PHASE_PREFIX = "phase:"
_CE_RANGE = "dflash:lm_head_ce"


def _category(name: str, in_ce: bool) -> str:
    lowered = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, lowered):
            # Non-GEMM kernels launched inside the chunked LM head + CE (compiled chunk: triton_*) are CE work.
            if in_ce and category in ("elementwise/norm/rope", "memcpy/memset"):
                return "CE/softmax"
            return category
    return "CE/softmax" if in_ce else "other"


def _short(name: str, width: int = 110) -> str:
    name = " ".join(name.split())
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_steps(stepper: Stepper, batch: PackedBatch, num_anchors: int | None, step_seconds: float,
                  path: Path, title: str) -> None:
    """Profile PROFILE_STEPS steps and write the compact kernel table to ``path`` (atomic)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    on_cuda = stepper.device.type == "cuda"
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    stepper(batch, num_anchors)  # one unprofiled step: any lazy setup stays out of the window
    synchronize(stepper.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            stepper(batch, num_anchors)
        synchronize(stepper.device)
    profiled_wall = (time.perf_counter() - start) / PROFILE_STEPS
    write_profile_table(list(prof.events()), on_cuda, step_seconds, profiled_wall, path, title)
    console.print(f"profile written: {path}")


def write_profile_table(events: list, on_cuda: bool, step_seconds: float, profiled_wall: float, path: Path,
                        title: str) -> None:
    """The compact text table of ``profile_steps`` from profiler ``FunctionEvent``s (atomic write)."""
    from torch.autograd import DeviceType

    if on_cuda:
        # Device-side events: kernels, memcpy/memset; user annotations (record_function ranges projected on the GPU
        # timeline) give the phase / CE windows.
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        annotation = [bool(getattr(e, "is_user_annotation", False)) or e.name.startswith((_PHASE_PREFIX, _CE_RANGE))
                      for e in device]
        kernels = [e for e, note in zip(device, annotation, strict=True) if not note]
        windows = [(e.name, e.time_range.start, e.time_range.end)
                   for e, note in zip(device, annotation, strict=True) if note]
        unit = "CUDA kernels (self device time)"
    else:
        # CPU fallback (--smoke): CPU operators by self CPU time.
        kernels = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async
                   and not e.name.startswith((_PHASE_PREFIX, _CE_RANGE)) and e.self_cpu_time_total > 0]
        windows = [(e.name, e.time_range.start, e.time_range.end) for e in events
                   if e.name.startswith((_PHASE_PREFIX, _CE_RANGE))]
        unit = "CPU operators (self CPU time; no CUDA here)"
    phase_windows = sorted((s, e, n[len(_PHASE_PREFIX):]) for n, s, e in windows if n.startswith(_PHASE_PREFIX))
    ce_windows = sorted((s, e) for n, s, e in windows if n == _CE_RANGE)

    def inside(t: float, spans) -> str | None:
        for span in spans:
            if span[0] <= t < span[1]:
                return span[2] if len(span) > 2 else "yes"
        return None

    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_category: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_phase: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in kernels:
        us = event.time_range.elapsed_us() if on_cuda else event.self_cpu_time_total
        t = event.time_range.start
        for table, key in ((by_name, event.name),
                           (by_category, _category(event.name, inside(t, ce_windows) is not None)),
                           (by_phase, inside(t, phase_windows) or "backward/unannotated")):
            table[key][0] += 1
            table[key][1] += us
    busy_us = sum(v[1] for v in by_name.values())
    step_us = step_seconds * 1e6

    def pct(us_total: float) -> str:
        return f"{us_total / PROFILE_STEPS / step_us:6.1%}"

    lines = [
        f"drafter_step profile: {title}",
        f"torch {torch.__version__}; {PROFILE_STEPS} profiled steps; timed step {step_seconds * 1e3:.2f} ms; "
        f"profiled wall {profiled_wall * 1e3:.2f} ms/step; summed {unit}: {busy_us / PROFILE_STEPS / 1e3:.2f} ms/step "
        f"({pct(busy_us).strip()} of the timed step)",
        "% = time per step / timed step time. Counts are per step.",
        "",
        f"== top {PROFILE_TOP} by self time ==",
        f"{'ms/step':>9} {'% step':>7} {'count':>7} {'avg us':>9}  name",
    ]
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:PROFILE_TOP]:
        lines.append(f"{us / PROFILE_STEPS / 1e3:9.3f} {pct(us)} {count / PROFILE_STEPS:7.1f} {us / count:9.1f}  "
                     f"{_short(name)}")
    rest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[PROFILE_TOP:]
    if rest:
        us = sum(v[1] for _, v in rest)
        lines.append(f"{us / PROFILE_STEPS / 1e3:9.3f} {pct(us)} {sum(v[0] for _, v in rest) / PROFILE_STEPS:7.1f} "
                     f"{'':>9}  ({len(rest)} other names)")
    for heading, table in (("by category (name patterns; non-GEMM kernels inside the LM head + CE range count "
                            "as CE/softmax)", by_category),
                           ("by step phase (record_function ranges on the device timeline; backward runs on the "
                            "autograd thread and may be unannotated)", by_phase)):
        lines += ["", f"== {heading} ==", f"{'ms/step':>9} {'% step':>7} {'count':>7}  group"]
        for key, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"{us / PROFILE_STEPS / 1e3:9.3f} {pct(us)} {count / PROFILE_STEPS:7.1f}  {key}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def count_compiles(stepper: Stepper, config: DFlashConfig, args, device: torch.device, fixed: bool) -> tuple[int, int]:
    """Run one step on each of ``args.shapes`` distinct batch shapes; return (distinct shapes, graphs compiled).

    Real lengths are all different; the fixed-shape path pads them to ``args.buckets`` length buckets."""
    seq_len = args.seq_len
    buckets = [seq_len * (i + 1) // args.buckets for i in range(args.buckets)]
    lengths = [int(seq_len * (0.25 + 0.75 * (i + 1) / args.shapes)) - 3 * i for i in range(args.shapes)]
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    shapes = set()
    for i, length in enumerate(lengths):
        pad_to = min(b for b in buckets if b >= length) if fixed else None
        batch = make_batch([length], config, device, pad_to=pad_to, seed=100 + i, final_tap=stepper.distill != "none")
        num_anchors = args.anchors if fixed else None
        anchors_shape = num_anchors if fixed else int(stepper.anchors(batch, None).numel())
        shapes.add((length, anchors_shape))
        stepper(batch, num_anchors)
    synchronize(device)
    return len(shapes), torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny config on CPU, seconds")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4], help="sequences packed per step")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512, help="anchor budget per sequence (document)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gamma", type=float, default=7.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shapes", type=int, default=12, help="distinct batch shapes for the compile count (0: skip the sweep)")
    parser.add_argument("--buckets", type=int, default=3, help="length buckets of the fixed-shape path")
    parser.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak (H200 SXM: 989.4)")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--no-fused-elementwise", action="store_true",
                        help="eager mode: plain PyTorch norm/RoPE/SwiGLU ops instead of the compiled fused kernels "
                             "(dflash.drafter.fused), to measure what they save")
    parser.add_argument("--flex-options", default=None, metavar="JSON",
                        help="FlexAttention kernel_options for every attention call, e.g. '{\"ROWS_GUARANTEED_SAFE\": true}' "
                             "(default or '{}': inductor's defaults)")
    parser.add_argument("--ce-chunk-rows", type=int, default=None, help="LM-head + CE chunk rows (default: the loss's)")
    parser.add_argument("--distill", default="none", choices=["none", "kl", "tv"],
                        help="add the loss's distillation term (train.drafter.distill) against a random final tap")
    parser.add_argument("--inductor", default=None, metavar="JSON",
                        help="torch._inductor.config overrides, e.g. '{\"coordinate_descent_tuning\": true}'")
    parser.add_argument("--shortcuts", nargs="+", default=["all"], metavar="SET",
                        help="training shortcuts, each SET one table block: all (default), none, or names joined by "
                             f"'+' ({', '.join(SHORTCUT_NAMES)}); e.g. --shortcuts none all for an A/B in one run")
    parser.add_argument("--residual-dtype", nargs="+", default=["compute"], choices=["compute", "float32"],
                        help="residual stream of the block tokens, each one table block: compute (bf16, the default) "
                             "or float32 (the parameter dtype); e.g. --residual-dtype float32 compute for an A/B")
    parser.add_argument("--attention-backend", nargs="+", default=None, choices=["auto", "flash", "triton"],
                        help="attention kernels (dflash.drafter.attention_kernels), each one table block: auto "
                             "(flash-attn-4's where installed and usable, else Triton), flash, triton; default: "
                             "DFLASH_ATTENTION_BACKEND or auto; e.g. --attention-backend triton flash for an A/B")
    parser.add_argument("--profile", type=Path, default=None, metavar="OUT_DIR",
                        help="after timing, profile 3 steps per mode/batch; write OUT_DIR/profile_<mode>_b<batch>.txt")
    args = parser.parse_args()
    args.attention_backend = args.attention_backend or [attention_backend()]
    if args.smoke:
        args.seq_len, args.anchors, args.block_size, args.gamma = 96, 8, 4, 4.0
        args.warmup, args.steps, args.buckets = 1, 2, 2
        args.compile_backend = "eager"  # dynamo tracing and guards only: the recompile count is what is checked
        config = smoke_config(args.block_size)
        device = torch.device("cpu")
    else:
        config = eight_b_config(args.block_size)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_float32_matmul_precision("high")
    if args.no_fused_elementwise:
        fused.set_fused_elementwise(False)
    if args.inductor is not None:
        import torch._inductor.config as inductor_config

        for key, value in json.loads(args.inductor).items():
            setattr(inductor_config, key, value)
    if args.flex_options is not None:
        set_flex_kernel_options(json.loads(args.flex_options))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    console.print(f"[bold]drafter step benchmark[/] on {name}, torch {torch.__version__}; config: "
                  f"{config.num_hidden_layers} layers, H={config.hidden_size}, V={config.vocab_size}, "
                  f"B={config.block_size}, {args.anchors} anchors/seq, seq {args.seq_len}")
    console.print(MFU_FORMULA)
    table = Table("mode", "shortcuts, attention", "batch", "anchor path", "step ms", "ms/seq", "seq tok/s", "x reference",
                  "TFLOP/step", "MFU", "peak mem GiB")
    compile_rows = []
    runs = [(mode, shortcuts, residual, backend) for backend in args.attention_backend
            for residual in args.residual_dtype for shortcuts in args.shortcuts for mode in args.modes]
    for mode, shortcuts, residual, backend in runs:
        set_attention_backend(backend)
        attention = attention_implementation(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                                             config.head_dim)
        names = SHORTCUT_NAMES if shortcuts == "all" else [] if shortcuts == "none" else shortcuts.split("+")
        set_train_shortcuts(**{**dict.fromkeys(SHORTCUT_NAMES, False), **dict.fromkeys(names, True)})
        compiled = mode == "compiled"
        torch._dynamo.reset()
        graphs_at_start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        drafter = build_drafter(config, device, compiled, args.compile_backend)
        drafter.residual_in_compute_dtype = residual == "compute"
        stepper = Stepper(drafter, device, args.anchors, args.gamma)
        stepper.ce_chunk_rows = args.ce_chunk_rows
        stepper.distill = args.distill
        fixed = compiled  # eager: dynamic anchors (nonzero); compiled: fixed shape, no host sync
        for batch_size in args.batch_sizes:
            batch = make_batch([args.seq_len] * batch_size, config, device, final_tap=args.distill != "none")
            num_anchors = args.anchors * batch_size if fixed else None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds = time_steps(stepper, batch, num_anchors, args.warmup, args.steps)
            flops = step_flops(config, batch, stepper.anchors(batch, num_anchors), args.distill)
            tokens = batch_size * args.seq_len
            mfu = flops / seconds / (args.peak_tflops * 1e12)
            memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            label = (shortcuts if residual == "compute" else f"{shortcuts}, {residual} residual") + f", {attention}"
            table.add_row(mode, label, str(batch_size), "fixed" if fixed else "dynamic", f"{seconds * 1e3:.1f}",
                          f"{seconds * 1e3 / batch_size:.1f}", f"{tokens / seconds:,.0f}",
                          "-" if args.smoke else f"{tokens / seconds / REFERENCE_TOKENS_PER_SECOND[mode]:.2f}",
                          f"{flops / 1e12:.2f}",
                          f"{mfu:.1%}", f"{memory:.1f}")
            if args.profile is not None:
                suffix = ("" if shortcuts == "all" else f"_{shortcuts.replace('+', '-')}") + (
                    "" if residual == "compute" else f"_{residual}_residual") + (
                    "" if len(args.attention_backend) == 1 else f"_{backend}")
                profile_steps(stepper, batch, num_anchors, seconds,
                              args.profile / f"profile_{mode}_b{batch_size}{suffix}.txt",
                              f"{mode}, batch {batch_size}, {'fixed' if fixed else 'dynamic'} anchors, {attention}, "
                              f"{seconds * 1e3:.1f} ms/step, {tokens / seconds:,.0f} seq tok/s, MFU {mfu:.1%}")
        shapes, graphs = count_compiles(stepper, config, args, device, fixed) if args.shapes else (0, 0)
        total_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_at_start
        compile_rows.append((mode, f"{shortcuts}, {attention}", shapes, graphs, total_graphs))
        del drafter, stepper
        if device.type == "cuda":
            torch.cuda.empty_cache()
    console.print(table)
    if not args.smoke:
        console.print(f"x reference: seq tok/s over the public reference trainer's ({REFERENCE_TOKENS_PER_SECOND}, "
                      f"one H200, torch 2.11); target >= {TARGET_SPEEDUP}x in each mode.")
    counts = Table("mode", "shortcuts, attention", "distinct batch shapes", "length buckets", "graphs compiled in sweep",
                   "graphs compiled in total")
    for mode, shortcuts, shapes, graphs, total in compile_rows:
        counts.add_row(mode, shortcuts, str(shapes), str(args.buckets) if mode == "compiled" else "-", str(graphs),
                       str(total))
    console.print(counts)
    console.print("Graphs counted during the shape sweep only (the full-length bucket was already compiled while "
                  "timing). compiled: per new bucket 3 layer graphs with the shortcuts (first layer, middle layers, last layer; "
                  "1 without) plus the fused CE chunk "
                  "(static, then one dynamic graph for last-chunk sizes); eager: the compiled flex_attention kernel "
                  "and the fused CE chunk, each going dynamic after one recompile. Both modes: the fused elementwise "
                  "kernels (norm, add+norm, q/k norm+RoPE, SwiGLU) have dynamic rows from the start (one graph per "
                  "dtype variant, none in the sweep).")


if __name__ == "__main__":
    main()
