"""Stage ``evaluate``: speculative decoding with the target and a trained drafter; tau, acceptance, speedup.

Run::

    dflash-stages evaluate --drafter RUN [--prompts held-out --corpus CORPUS [--cache CACHE]] [--json OUT]
    dflash-stages evaluate --drafter EXPORT --prompts prompts.jsonl --temperature 0.7
    dflash-stages evaluate --drafter RUN --prompts heldout_prompts.jsonl --extra-prompts numpy-questions

Several prompt sets (``prompts``, then each of ``extra_prompts``) are evaluated one after the other in one run,
each with its own tau, per-position acceptance, speedups and lossless checks (references measured per set); the
report's top-level figures are the first set's, ``prompt_sets`` lists every set with its fingerprint, the tables
show them side by side and the last line names each (``tau = 2.614 (heldout_prompts) / 2.101 (numpy-questions)``).

Every prompt is decoded by the speculative loop (:func:`dflash.decoding.speculative.speculative_generate`) with the
drafter's block size. The first ``reference_prompts`` prompts of each set (default: every prompt) also get the two
references: the same loop with block size 1 (plain target decoding) and the target's own transformers ``generate()``
(greedy or sampled as the loop, KV cache on, the same stop tokens and ``max_new_tokens``:
:func:`dflash.decoding.speculative.target_generate`), plain decoding as users run it. Two speedups: the speculative
loop's throughput (new tokens per second, prefill included) over every prompt of the set divided by that of block
size 1 (``speedup``) and of ``generate()`` (``speedup_vs_generate``) over the prompts that have them (at batch 1 a
reference's time per token hardly depends on the prompt, while tau does, so the speculative side takes every
prompt; ``speedup_basis`` says it in words), measured in the same process, on the same model (same device and
dtype), the runs of a prompt one after the other, warm-up calls of each excluded, the device synchronized around
every timing on CUDA.
Greedy runs are checked for losslessness, not assumed. ``lossless`` checks every prompt without a reference decode:
one teacher-forced forward of the target over the prompt and its speculative output, on the same device and dtype,
where every emitted token must be the target's argmax after its prefix and the output must end where greedy
decoding ends it (``max_new_tokens`` or a stop token). On the prompts with references the output must also equal
the references' token for token: the block-size-1 loop's (``lossless_vs_block_size_1``) and ``generate()``'s
(``lossless_vs_generate``). A token that is not the target's choice is reported with the target's logit gap between
the two tokens there, from a full forward: a gap within ``near_tie_tolerance`` is a floating-point near-tie (kernels
for a 1-token and an N-token forward round differently, mostly in bf16), anything larger is a bug and fails the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from dflash.corpus.split import heldout_corpus
from dflash.decoding.eval_prompts import (
    EMBEDDED_PROMPT_SETS,
    EvalPrompt,
    PromptSet,
    check_prompt_source,
    embedded_prompts,
    held_out_rows,
    prompts_from_corpus,
    prompts_from_file,
)
from dflash.errors import ConfigError
from dflash.io.files import atomic_write_text
from dflash.progress import DEFAULT_PROGRESS_INTERVAL, LogProgress, check_progress_interval
from dflash.serving.export import drafter_source, load_drafter
from dflash.target.load import load_target, load_tokenizer
from dflash.training.checks import check_target_identity, recorded_identity
from dflash.values import check_seed
from stages.config.check import dtype_spelling
from stages.config.options import CommandSettings, config_options, setting
from stages.config.resolve import print_and_exit, resolve_stage_config

if TYPE_CHECKING:
    import torch

    from dflash.decoding.speculative import GenerationResult, SpeculativeConfig, TappedTarget

# torch and dflash.decoding.speculative are imported where they are used: every command's module is imported when the CLI
# starts, and importing torch (seconds on a small host) before a config check would delay every `error:` line.

__all__ = ["EvaluateConfig", "Baselines", "Evaluator", "attach_checked", "load_prompt_set", "evaluate_drafter",
           "run_evaluate", "print_report", "tau_line", "write_json_atomic", "register"]

log = logging.getLogger(__name__)
REPORT_FORMAT = "dflash-stages.evaluate/1"
#: The greedy lossless checks of a report, each a dict with ``checked`` (and ``passed`` when checked); reports written
#: before ``lossless_vs_block_size_1`` existed lack it, and their ``lossless`` compares with the block-size-1 loop.
LOSSLESS_KEYS = ("lossless", "lossless_vs_block_size_1", "lossless_vs_generate")


@dataclass(kw_only=True, slots=True)
class EvaluateConfig:
    """Settings of ``dflash-stages evaluate``. Each field's help is its one description (``--help``,
    docs/config-reference.md)."""

    drafter: Path = setting(help='Run folder (latest checkpoint), checkpoint folder or exported folder. Required (here or in --config/--preset/--set).')
    target: str | None = setting(None, help='Target spec; default: the one recorded with the drafter.')
    prompts: str = setting("held-out", help='held-out | numpy-questions | FILE.jsonl (messages/prompt/text) | FILE.txt (one per line).')
    extra_prompts: list[str] = setting(default_factory=list, repeat=True, help=(
        "More prompt sets evaluated beside prompts, each reported on its own: .jsonl/.txt files or embedded sets "
        "(numpy-questions: questions about documented NumPy functions). Repeatable."))
    corpus: Path | None = setting(None, help='Corpus for held-out prompts.')
    cache: Path | None = setting(None, help='Cache the drafter trained on: its rows are excluded from held-out prompts.')
    num_prompts: int = setting(16, help='Prompts to evaluate.')
    prompt_tokens: int = setting(128, help='Prompt window taken from a plain corpus row.')
    max_new_tokens: int = setting(128, help='Tokens generated per prompt.')
    temperature: float = setting(0.0, help='0 = greedy (checked lossless); > 0 = speculative sampling.')
    block_size: int | None = setting(None, help="Drafting block size; default: the drafter's.")
    ignore_eos: bool = setting(False, help='Keep generating after the end-of-sequence token.')
    compare_untrained: bool = setting(False, help='Also measure a randomly initialized drafter.')
    references: bool = setting(True, help="Also decode with block size 1 and the target's generate() (the speedups and the token-for-token lossless checks); --no-references: tau, acceptance and the teacher-forced lossless check (greedy) only, much faster (docs/benchmarks.md, Evaluate without the references).")
    reference_prompts: int | None = setting(None, help=(
        "Decode only the first N prompts of each set with the two references (the speedups divide the speculative "
        "tokens/s over every prompt by the references' over those N; the token-for-token checks against them cover "
        "those N; the teacher-forced lossless check covers every prompt). Default, or N at least a set's size: "
        "every prompt. Unused with --no-references (no reference runs)."))
    seed: int = setting(0, help='Prompt selection, sampling, untrained init.')
    device: str = setting("auto", help='auto | cpu | cuda | cuda:N.')
    dtype: str = setting("auto", help='auto (bf16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16 (bf16, fp32, fp16 also accepted).')
    cpu_threads: int = setting(1, help='Torch threads while decoding on CPU (more threads lose on shared cores).')
    kv_cache: Literal["auto", "static", "dynamic"] = setting("auto", help="The target's KV cache in the speculative and block-size-1 loops: static (one static cache; on CUDA the target's verify-block and one-token forwards are each captured once as a CUDA graph and replayed), dynamic (transformers' DynamicCache, eager forwards), auto (static on CUDA where the target allows it: sdpa or eager attention and only plain full-attention layers, no sliding windows or linear attention; dynamic elsewhere). Either way the drafter keeps its context's keys and values (computed for the last block-size rows each cycle, not the whole context; its steps captured as CUDA graphs on CUDA), and the generate() reference runs transformers' own generate(). Same tokens either way (float32); docs/benchmarks.md, \"Evaluate's loops on a static KV cache with CUDA graphs\".")
    #: Largest target logit gap that counts as a floating-point near-tie in the lossless check; None: 1e-3 in float32, 0.125 in 16-bit dtypes.
    near_tie_tolerance: float | None = None
    json_path: Path | None = setting(None, option='--json-file', help='Also write the full report as JSON to this file (default for a run folder: RUN/eval/final.json, which report, diff and inspect read; an earlier one there is kept as final.replaced-TIME.json).')
    progress_interval: float = field(default=DEFAULT_PROGRESS_INTERVAL, metadata={"runtime": True,
        "help": "Seconds between two progress lines (prompts, tokens, rates, ETA, tau so far) when output is not a "
                "terminal; 0: none."})

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)
        check_progress_interval(self.progress_interval)
        for name in ("drafter", "corpus", "cache", "json_path"):  # strings from a config file or --set
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)))
        for name in ("num_prompts", "prompt_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.reference_prompts is not None and self.reference_prompts < 1:
            raise ConfigError(f"reference_prompts must be >= 1 (or null: every prompt), got {self.reference_prompts}")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.kv_cache not in ("auto", "static", "dynamic"):
            raise ConfigError(f"kv_cache must be auto, static or dynamic, got {self.kv_cache!r}")
        if self.block_size is not None and self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 to draft anything, got {self.block_size}")

        self.dtype = dtype_spelling(self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.prompts == "held-out" and self.corpus is None:
            raise ConfigError("prompts: held-out prompts need --corpus (and --cache to exclude the training rows)")

        check_prompt_source(self.prompts)  # a wrong path fails here, before the target is loaded
        if isinstance(self.extra_prompts, str):
            self.extra_prompts = [self.extra_prompts]
        self.extra_prompts = [str(spec) for spec in self.extra_prompts]
        for spec in self.extra_prompts:
            check_prompt_source(spec, what="extra_prompts", held_out=False)
        specs = [self.prompts, *self.extra_prompts]
        if len(set(specs)) != len(specs):
            raise ConfigError(f"extra_prompts: a prompt set is named twice ({specs}); drop the repeat")
        kind, _, index = str(self.device).partition(":")
        if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N (N a GPU index >= 0), got {self.device!r}")

    def resolved_device(self) -> torch.device:
        """The device to run on.

        Raises:
            ConfigError: ``cuda`` or ``cuda:N`` on a host without CUDA, or N beyond its GPUs.
        """
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"device {self.device}: CUDA is not available on this host; use --device cpu")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ConfigError(f"device {self.device}: this host has {torch.cuda.device_count()} GPU(s)")
        return device

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def attach_checked(drafter: Any, target: Any, target_info: dict[str, Any], where: Path) -> None:
    """Attach the target's embedding/LM head to ``drafter`` after comparing them with the hashes recorded at
    training time (``dflash.training.checkpoint.check_target_weights``: bf16-rounded hashes when the dtypes differ).

    Raises:
        MismatchError: the target differs from the one the drafter was trained with.
    """
    from dflash.training.checkpoint import check_target_weights

    model = target.model
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    check_target_weights(target_info, embed, lm_head, where=str(where))
    drafter.attach_target(embed, lm_head)


def load_prompt_set(spec: str, config: EvaluateConfig, tokenizer: Any, *, name: str | None = None) -> PromptSet:
    """The prompt set ``spec`` names (``held-out``, an embedded set or a prompts file), ``config.num_prompts`` of
    it; named ``name``, else ``held-out``, the embedded set's name or the file's stem."""
    if spec == "held-out":
        from dflash.corpus.format import open_corpus

        corpus = open_corpus(config.corpus)
        corpus.check_fingerprint()
        heldout = heldout_corpus(corpus)  # a training corpus of a split (prepare): its held-out rows
        rows = held_out_rows(corpus, config.cache, heldout=heldout)
        if heldout is not None:
            source = f"held-out rows of {config.corpus} (its split's {heldout.path})"
            corpus = heldout
        else:
            source = f"held-out rows of {config.corpus}" + (f" not in {config.cache}" if config.cache else "")
        prompts = prompts_from_corpus(
            corpus, rows, num_prompts=config.num_prompts, prompt_tokens=config.prompt_tokens,
            continuation_tokens=config.max_new_tokens, seed=config.seed,
        )
        return PromptSet(name=name or "held-out", spec=spec, source=source, prompts=prompts,
                         details={"corpus_fingerprint": corpus.fingerprint})
    if spec in EMBEDDED_PROMPT_SETS:
        embedded = embedded_prompts(spec, tokenizer, num_prompts=config.num_prompts, seed=config.seed)
        return dataclasses.replace(embedded, name=name or embedded.name)
    prompts = prompts_from_file(spec, tokenizer, num_prompts=config.num_prompts)
    return PromptSet(name=name or Path(spec).stem, spec=spec, source=spec, prompts=prompts)


def _stop_tokens(tokenizer: Any, ignore_eos: bool) -> tuple[int, ...]:
    if ignore_eos or tokenizer.eos_token_id is None:
        return ()
    eos = tokenizer.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


@dataclass(kw_only=True, slots=True)
class Baselines:
    """The two references of a prompt set's first prompts (all of them, or ``reference_prompts``), measured once and
    reused for every drafter evaluated on them.

    Fields:
        block_size_1: the speculative loop at block size 1 (plain decoding through the same code), per prompt.
        target_generate: the target's own ``generate()`` (:func:`dflash.decoding.speculative.target_generate`), per prompt.
    """

    block_size_1: list[GenerationResult]
    target_generate: list[GenerationResult]


def _throughput(results: list[GenerationResult], *, split: bool = True) -> dict[str, Any]:
    """New tokens, seconds (prefill included) and tokens/s over ``results``; ``decode_seconds`` only when the
    runs timed their decode apart (``split``; ``generate()`` does not)."""
    tokens = sum(len(r.output_ids) for r in results)
    seconds = sum(r.seconds for r in results)
    decode = sum(r.decode_seconds for r in results) if split else None
    return {"new_tokens": tokens, "seconds": seconds, "decode_seconds": decode,
            "tokens_per_second": tokens / seconds if seconds > 0 else float("nan")}


def _logit_gap(model: Any, prompt: list[int], prefix: list[int], token_a: int, token_b: int) -> float:
    """Target logit of ``token_b`` minus that of ``token_a`` after ``prompt + prefix`` (one full forward)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + prefix], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1].float()
    return float(logits[token_b] - logits[token_a])


def _lossless_report(model: Any, prompts: list[EvalPrompt], spec: list[GenerationResult],
                     base: list[GenerationResult], tolerance: float) -> dict[str, Any]:
    """Token-for-token comparison of the speculative outputs with a reference's (``base``), prompt by prompt; a
    divergence is reported with the target's logit gap between the two tokens there (:func:`_logit_gap`)."""
    from dflash.decoding.speculative import first_divergence

    mismatches = []
    for index, (prompt, s, b) in enumerate(zip(prompts, spec, base, strict=True)):
        at = first_divergence(s.output_ids, b.output_ids)
        if at is None:
            continue
        entry: dict[str, Any] = {"prompt": index, "source": prompt.source, "index": at}
        if at < min(len(s.output_ids), len(b.output_ids)):
            gap = _logit_gap(model, prompt.input_ids, b.output_ids[:at], s.output_ids[at], b.output_ids[at])
            entry.update(speculative_token=s.output_ids[at], target_token=b.output_ids[at], target_logit_gap=gap,
                         near_tie=abs(gap) <= tolerance)
        else:
            entry.update(near_tie=False, reason="outputs differ in length")
        mismatches.append(entry)
    near_ties = sum(1 for m in mismatches if m["near_tie"])
    return {"checked": True, "prompts": len(prompts), "identical": len(prompts) - len(mismatches),
            "near_ties": near_ties, "near_tie_tolerance": tolerance,
            "passed": len(mismatches) == near_ties, "mismatches": mismatches}


def _teacher_forced_report(model: Any, prompts: list[EvalPrompt], spec: list[GenerationResult], tolerance: float,
                           *, max_new_tokens: int, stop_token_ids: tuple[int, ...]) -> dict[str, Any]:
    """The greedy lossless check of every prompt without a reference decode: one forward of the target per prompt
    over the prompt and its speculative output (teacher forcing, on the model's own device and dtype); every
    emitted token must be the target's argmax after its prefix, and the output must be cut where greedy decoding
    cuts it (at ``max_new_tokens``, or right after the first stop token).

    A token that is not the argmax is a near-tie when the argmax's logit exceeds its own by at most ``tolerance``
    (a 1-token and an N-token forward round differently), else a mismatch. Each prompt with a deviation has one
    entry in ``mismatches``: its first mismatch, or its first near-tie when it has no mismatch, with the count of
    tokens that are not the argmax (``deviations``). Later tokens are checked after their own prefix, so a
    near-tie does not hide a mismatch after it. ``tokens_checked`` counts the emitted tokens checked."""
    import torch

    stop = set(stop_token_ids)
    device = next(model.parameters()).device
    mismatches = []
    tokens_checked = 0
    for index, (prompt, result) in enumerate(zip(prompts, spec, strict=True)):
        output = list(result.output_ids)
        found: list[dict[str, Any]] = []
        deviations = 0
        if output:
            ids = torch.tensor([list(prompt.input_ids) + output[:-1]], device=device)
            with torch.inference_mode():  # logits after prompt + output[:i], for every i: the last len(output)
                logits = model(input_ids=ids, logits_to_keep=len(output)).logits[0].float()
            emitted = torch.tensor(output, device=device)
            best = logits.argmax(dim=-1)
            gaps = (logits.gather(1, best[:, None]) - logits.gather(1, emitted[:, None]))[:, 0]
            off = (best != emitted).nonzero().flatten().tolist()
            deviations = len(off)
            tokens_checked += len(output)
            for at in off:
                gap = float(gaps[at])
                found.append({"index": at, "speculative_token": output[at], "target_token": int(best[at]),
                              "target_logit_gap": gap, "near_tie": gap <= tolerance})
                if gap > tolerance:
                    break
        cut = next((at for at, token in enumerate(output[:-1]) if token in stop), None)
        if cut is not None:
            found.append({"index": cut + 1, "near_tie": False,
                          "reason": f"output continues after the stop token {output[cut]} at index {cut}"})
        elif len(output) > max_new_tokens or (len(output) < max_new_tokens and not (output and output[-1] in stop)):
            found.append({"index": min(len(output), max_new_tokens), "near_tie": False,
                          "reason": f"output has {len(output)} tokens: greedy decoding stops at max_new_tokens "
                                    f"({max_new_tokens}) or after a stop token"})
        if not found:
            continue
        first = min(found, key=lambda entry: (entry["near_tie"], entry["index"]))
        mismatches.append({"prompt": index, "source": prompt.source, **first, "deviations": deviations})
    near_ties = sum(1 for m in mismatches if m["near_tie"])
    return {"checked": True, "method": "teacher-forced", "prompts": len(prompts),
            "identical": len(prompts) - len(mismatches), "near_ties": near_ties, "near_tie_tolerance": tolerance,
            "tokens_checked": tokens_checked, "passed": len(mismatches) == near_ties, "mismatches": mismatches}


def _lossless_vs_generate(model: Any, prompts: list[EvalPrompt], spec: list[GenerationResult],
                          base: list[GenerationResult], generated: list[GenerationResult],
                          tolerance: float) -> dict[str, Any]:
    """The lossless report of the speculative outputs against ``generate()``'s, plus how many block-size-1 loop
    outputs equal ``generate()``'s (``block_size_1_identical``: tells a drafting bug from a loop that decodes
    otherwise than transformers)."""
    from dflash.decoding.speculative import first_divergence

    report = _lossless_report(model, prompts, spec, generated, tolerance)
    report["block_size_1_identical"] = sum(
        first_divergence(b.output_ids, g.output_ids) is None for b, g in zip(base, generated, strict=True))
    return report


def evaluate_drafter(
    target: Any,
    drafter: Any,
    prompts: list[EvalPrompt],
    *,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    stop_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    near_tie_tolerance: float | None = None,
    baseline: Baselines | None = None,
    references: bool = True,
    reference_prompts: int | None = None,
    console: Console | None = None,
    label: str = "drafter",
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL,
    kv_cache: str = "auto",
) -> tuple[dict[str, Any], Baselines | None]:
    """Speculative decoding of every prompt with ``drafter`` and (unless ``baseline`` is given) the two references,
    block size 1 in the same loop and the target's own ``generate()``, on the first ``reference_prompts`` prompts.

    Args:
        target: ``LoadedTarget``.
        drafter: a ``DFlashDrafter`` on the target's device with the target attached.
        baseline: both references' results on the first ``reference_prompts`` prompts and the same settings, to
            reuse (the pipeline evaluates several checkpoints against one baseline). Runs are interleaved per prompt
            when measured here.
        references: ``False`` (and no ``baseline``): decode with the drafter only; no speedup, no token-for-token
            check (greedy runs still get the teacher-forced ``lossless``).
        reference_prompts: how many prompts, the first ones, get the references; ``None``: every prompt.
        progress_interval: seconds between two progress lines where ``console`` is not a terminal (0: none).
        kv_cache: ``static``, ``dynamic`` or ``auto`` (:attr:`EvaluateConfig.kv_cache`): the target of both loops is
            :class:`dflash.decoding.static_target.StaticTappedTarget` or the dynamic-cache ``TappedTarget``; the
            drafter drafts through :class:`dflash.decoding.drafter_cache.GraphedDrafter` either way.

    Returns:
        ``(summary, baselines)``: summary with ``tau``, ``acceptance``, ``speedup`` (vs block size 1) and
        ``speedup_vs_generate`` (the speculative loop's tokens/s over every prompt divided by the reference's over
        its prompts, ``speedup_basis`` in words), ``reference_prompts``, ``throughput`` (``speculative``,
        ``baseline_block_size_1``, ``target_generate``, each with its ``prompts``), and in greedy mode the lossless
        checks: ``lossless`` (every prompt, teacher-forced: :func:`_teacher_forced_report`),
        ``lossless_vs_block_size_1`` and ``lossless_vs_generate`` (token for token, on the reference prompts);
        ``per_prompt`` (the reference's figures on the prompts that have them). Without references the speedups
        are ``None``, ``throughput`` holds ``speculative`` only and the token-for-token entries say
        ``checked: false`` (``lossless`` is checked all the same in greedy mode).
        ``baselines`` is ``None`` when no reference ran. ``decoding``: the KV cache the loops ran on and how many
        target forwards and drafts replayed a CUDA graph.
    """
    import torch

    from dflash.decoding.drafter_cache import GraphedDrafter
    from dflash.decoding.speculative import AcceptanceStats, SpeculativeConfig, TappedTarget
    from dflash.decoding.speculative import speculative_generate as _generate
    from dflash.decoding.static_target import StaticTappedTarget, static_cache_supported

    model = target.model
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    tolerance = near_tie_tolerance if near_tie_tolerance is not None else (1e-3 if dtype == torch.float32 else 0.125)
    spec_config = SpeculativeConfig(block_size=block_size, max_new_tokens=max_new_tokens, temperature=temperature,
                                    stop_token_ids=stop_token_ids, mask_token_id=mask_token_id)
    base_config = SpeculativeConfig(block_size=1, max_new_tokens=max_new_tokens, temperature=temperature,
                                    stop_token_ids=stop_token_ids)
    measure_baseline = baseline is None and references
    with_references = baseline is not None or references
    measured_prompts = len(prompts) if reference_prompts is None else min(reference_prompts, len(prompts))
    spec_results: list[GenerationResult] = []
    base_results: list[GenerationResult] = list(baseline.block_size_1) if baseline is not None else []
    generate_results: list[GenerationResult] = list(baseline.target_generate) if baseline is not None else []

    def generator(index: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)

    console = console or Console()
    # Transient bar over the prompts, shown from the warm-up on; on a non-terminal console (piped output, logs) a
    # line every progress_interval seconds instead, with the rate, ETA and tau so far (dflash.progress).
    progress = LogProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("prompts, {task.fields[tau]}"), TextColumn("[dim]{task.fields[phase]}"),
                           TimeElapsedColumn(), console=console, transient=True, unit="prompts",
                           interval=progress_interval)
    static = kv_cache == "static" or (kv_cache == "auto" and device.type == "cuda" and static_cache_supported(model))
    tapped = (StaticTappedTarget(model, target_layer_ids) if static  # ConfigError where the attention cannot
              else TappedTarget(model, target_layer_ids))
    capacity = max(len(p.input_ids) for p in prompts) + max_new_tokens + block_size
    if static:
        tapped.reserve(capacity)
    # Whatever the target's cache, the drafter keeps its context's keys and values (one shape per step: CUDA graphs
    # on CUDA), as the serving engines run it.
    drafter = GraphedDrafter(drafter, capacity)
    with tapped, progress:
        task = progress.add_task(f"evaluate {label}", total=len(prompts), tau="tau -", phase="warm-up", tokens=0)
        warm = SpeculativeConfig(block_size=block_size, max_new_tokens=min(8, max_new_tokens), temperature=temperature,
                                 mask_token_id=mask_token_id)
        _generate(tapped, drafter, prompts[0].input_ids, warm, generator=generator(0))  # kernels, allocator
        _generate(tapped, None, prompts[0].input_ids, SpeculativeConfig(block_size=1, max_new_tokens=4),
                  generator=generator(0))
        if measure_baseline:
            _plain_generate(tapped, prompts[0].input_ids, SpeculativeConfig(block_size=1, max_new_tokens=4), seed)
        for index, prompt in enumerate(prompts):
            if measure_baseline and index < measured_prompts:
                progress.update(task, phase="block size 1 baseline")
                base_results.append(_generate(tapped, None, prompt.input_ids, base_config,
                                              generator=generator(index)))
                progress.update(task, phase="target generate()")
                generate_results.append(_plain_generate(tapped, prompt.input_ids, base_config,
                                                        seed * 1_000_003 + index))
            progress.update(task, phase=f"block size {block_size}")
            spec_results.append(_generate(tapped, drafter, prompt.input_ids, spec_config,
                                          generator=generator(index)))
            lengths = [t for r in spec_results for t in r.acceptance_lengths]
            tau_so_far = sum(lengths) / max(len(lengths), 1)
            progress.update(task, advance=1, tau=f"tau {tau_so_far:.2f}",
                            tokens=sum(len(r.output_ids) for r in spec_results))

    decoding = {"kv_cache": "static" if static else "dynamic",
                "cuda_graphs": bool((static and tapped.replays) or drafter.replays),  # False: every capture failed
                "graph_replays": tapped.replays if static else 0,
                "drafter_graph_replays": drafter.replays}
    stats = AcceptanceStats.from_lengths([t for r in spec_results for t in r.acceptance_lengths], block_size)
    spec_speed = {**_throughput(spec_results), "prompts": len(spec_results)}
    per_prompt = [
        {"source": p.source, "prompt_tokens": len(p.input_ids), "new_tokens": len(s.output_ids),
         "cycles": s.num_cycles, "tau": (sum(s.acceptance_lengths) / s.num_cycles) if s.num_cycles else None,
         "finish_reason": s.finish_reason, "seconds": s.seconds}
        for p, s in zip(prompts, spec_results, strict=True)
    ]
    greedy = temperature == 0
    sampled = {"checked": False, "reason": "sampled mode: lossless in distribution, not token for token"}
    # The teacher-forced check needs no reference: every greedy evaluation gets it, with references or without.
    lossless = (_teacher_forced_report(model, prompts, spec_results, tolerance, max_new_tokens=max_new_tokens,
                                       stop_token_ids=stop_token_ids) if greedy else sampled)
    if not with_references:
        skipped = {"checked": False, "reason": "references not run (evaluate.references = false)"}
        return {"tau": stats.mean_tau, "acceptance": stats.to_dict(), "speedup": None, "speedup_vs_generate": None,
                "throughput": {"speculative": spec_speed}, "lossless": lossless, "lossless_vs_block_size_1": skipped,
                "lossless_vs_generate": skipped, "decoding": decoding, "per_prompt": per_prompt}, None
    measured = len(base_results)
    if measured != measured_prompts or len(generate_results) != measured:
        raise ValueError(f"the references hold {measured} block-size-1 and {len(generate_results)} generate() "
                         f"results for the first {measured_prompts} prompts")
    for entry, b, g in zip(per_prompt, base_results, generate_results, strict=False):
        entry.update(baseline_seconds=b.seconds, generate_new_tokens=len(g.output_ids), generate_seconds=g.seconds)
    base_speed = {**_throughput(base_results), "prompts": measured}
    generate_speed = {**_throughput(generate_results, split=False), "prompts": measured}
    reference_set, reference_spec = prompts[:measured], spec_results[:measured]
    summary: dict[str, Any] = {
        "tau": stats.mean_tau,
        "acceptance": stats.to_dict(),
        "speedup": spec_speed["tokens_per_second"] / base_speed["tokens_per_second"],
        "speedup_vs_generate": spec_speed["tokens_per_second"] / generate_speed["tokens_per_second"],
        "reference_prompts": measured,
        "speedup_basis": (f"speculative tokens/s over all {len(prompts)} prompts / the reference's tokens/s over "
                          + (f"the same {measured}" if measured == len(prompts) else f"the first {measured}")),
        "throughput": {"speculative": spec_speed, "baseline_block_size_1": base_speed,
                       "target_generate": {**generate_speed, "call": _generate_call(max_new_tokens, temperature,
                                                                                    stop_token_ids)}},
        "lossless": lossless,
        "lossless_vs_block_size_1": (
            _lossless_report(model, reference_set, reference_spec, base_results, tolerance) if greedy else sampled),
        "lossless_vs_generate": (
            _lossless_vs_generate(model, reference_set, reference_spec, base_results, generate_results, tolerance)
            if greedy else sampled),
        "decoding": decoding,
        "per_prompt": per_prompt,
    }
    return summary, Baselines(block_size_1=base_results, target_generate=generate_results)


def _plain_generate(tapped: TappedTarget, prompt_ids: list[int], config: SpeculativeConfig, seed: int) -> GenerationResult:
    """:func:`dflash.decoding.speculative.target_generate` on the tapped target with its taps off (the hooks stay, as they
    do for the block-size-1 loop, and keep nothing)."""
    from dflash.decoding.speculative import target_generate

    tapped.capture = False
    try:
        return target_generate(tapped.model, prompt_ids, config, seed=seed)
    finally:
        tapped.capture = True


def _generate_call(max_new_tokens: int, temperature: float, stop_token_ids: tuple[int, ...]) -> str:
    """The ``generate()`` call measured, as the report shows it."""
    sampling = "do_sample=False" if temperature == 0 else f"do_sample=True, temperature={temperature}, top_k=0, top_p=1.0"
    return (f"model.generate(input_ids, max_new_tokens={max_new_tokens}, {sampling}, use_cache=True, "
            f"eos_token_id={list(stop_token_ids)})")


def _untrained_like(drafter_config: Any, target: Any, seed: int) -> Any:
    import torch

    from dflash.drafter import DFlashDrafter

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        untrained = DFlashDrafter(drafter_config)
    model = target.model
    parameter = next(model.parameters())
    untrained.to(device=parameter.device, dtype=parameter.dtype)
    untrained.attach_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return untrained.eval()


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (:func:`dflash.io.files.atomic_write_text`), creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


class Evaluator:
    """The target, the prompt sets and their references, loaded/measured once; evaluates any number of drafters on
    them (the pipeline measures every epoch's checkpoint, and each set's references are measured once).

    Args:
        config: evaluation settings (``config.drafter`` is not read here).
        target_spec: the target to load.
        console: where progress goes.
        primary_name: the name of ``config.prompts``'s set in reports (default: :func:`load_prompt_set`'s).
    """

    def __init__(self, config: EvaluateConfig, target_spec: str, *, console: Console | None = None,
                 primary_name: str | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.target_spec = str(target_spec)
        self.device, self.dtype = config.resolved_device(), config.resolved_dtype()
        # The prompts first: a bad prompts file, a corpus without held-out rows... are refused before the model
        # loads (held-out prompts are corpus rows, already tokens; a file or an embedded set needs only the tokenizer).
        needs_tokenizer = config.prompts != "held-out" or bool(config.extra_prompts)
        tokenizer = load_tokenizer(self.target_spec) if needs_tokenizer else None
        self.prompt_sets = [load_prompt_set(config.prompts, config, tokenizer, name=primary_name),
                            *(load_prompt_set(spec, config, tokenizer) for spec in config.extra_prompts)]
        names = [prompt_set.name for prompt_set in self.prompt_sets]
        if len(set(names)) != len(names):
            raise ConfigError(f"extra_prompts: two prompt sets have one name ({names}); rename a prompts file")
        self.prompts = self.prompt_sets[0].prompts
        self.target = load_target(self.target_spec, dtype=self.dtype, device=self.device)
        self.baselines: dict[tuple[str, int], Baselines] = {}  # by (set name, prompts with references)

    @property
    def baseline(self) -> Baselines | None:
        """The first prompt set's references, once measured."""
        return self.baselines.get(self._baseline_key(self.prompt_sets[0]))

    def load_drafter(self, path: Path, loaded: tuple[Any, Any, dict[str, Any]] | None = None) -> tuple[Any, Any, dict[str, Any]]:
        """A drafter from ``path`` (or what :func:`dflash.serving.export.load_drafter` read from it, ``loaded``) on the target's device
        and dtype, target attached and checked."""
        drafter, drafter_config, target_info = loaded or load_drafter(Path(path))
        check_target_identity(
            target_info, self.target.identity,
            where=f"the drafter at {path} (trained on target {recorded_identity(target_info).get('name')!r})",
            fix=f"pass --target {target_info.get('target_spec')!r} (the recorded target)")
        drafter.to(device=self.device, dtype=self.dtype)
        attach_checked(drafter, self.target, target_info, Path(path))
        return drafter.eval(), drafter_config, target_info

    def _baseline_key(self, prompt_set: PromptSet) -> tuple[str, int]:
        return _baseline_key(prompt_set, self.config.reference_prompts)

    def untrained(self, drafter_config: Any) -> Any:
        """A randomly initialized drafter of ``drafter_config`` (seeded by ``config.seed``), target attached."""
        return _untrained_like(drafter_config, self.target, self.config.seed)

    def _summary(self, prompt_set: PromptSet, drafter: Any, drafter_config: Any, label: str, *,
                 references: bool = True) -> dict[str, Any]:
        config = self.config
        summary, baseline = evaluate_drafter(
            self.target, drafter, prompt_set.prompts,
            block_size=config.block_size or int(drafter_config.block_size),
            mask_token_id=int(drafter_config.mask_token_id), target_layer_ids=list(drafter_config.target_layer_ids),
            max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            stop_token_ids=_stop_tokens(self.target.tokenizer, config.ignore_eos), seed=config.seed,
            near_tie_tolerance=config.near_tie_tolerance,
            baseline=self.baselines.get(self._baseline_key(prompt_set)) if references else None,
            references=references, reference_prompts=config.reference_prompts, console=self.console,
            kv_cache=config.kv_cache,
            label=label if len(self.prompt_sets) == 1 else f"{label} on {prompt_set.name}",
            progress_interval=config.progress_interval,
        )
        if baseline is not None:
            self.baselines[self._baseline_key(prompt_set)] = baseline
        return summary

    def evaluate(self, drafter: Any, drafter_config: Any, *, label: str, compare_untrained: bool = False,
                 json_path: Path | None = None, references: bool | None = None,
                 all_sets: bool = True, num_prompts: int | None = None,
                 source: Path | None = None) -> dict[str, Any]:
        """Evaluate one drafter; returns the JSON report (also written atomically to ``json_path``).

        The report's top-level figures (``tau``, ``acceptance``, ``speedup``, ``lossless``, ...) are those of the
        first prompt set (``config.prompts``); ``prompt_sets`` holds every set evaluated, each with its own.

        ``references``: run (or reuse) the block-size-1 and ``generate()`` references; ``None`` = the config's
        ``references``. ``False``: tau, acceptance and the teacher-forced check only (the pipeline's per-epoch
        evaluations).
        ``all_sets``: ``False`` evaluates the first prompt set only (the pipeline's per-epoch evaluations).
        ``num_prompts``: evaluate only the first this many prompts of each set (the pipeline's per-epoch
        evaluations, ``evaluate.per_epoch_num_prompts``); ``None``: all of them.
        ``compare_untrained`` measures the untrained drafter on the first set."""
        import torch

        config = self.config
        references = config.references if references is None else references
        started = time.perf_counter()
        threads = torch.get_num_threads()
        cpu_threads = config.cpu_threads if self.device.type == "cpu" else None
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        evaluated = self.prompt_sets if all_sets else self.prompt_sets[:1]
        if num_prompts is not None:  # the first prompts of each set: a subset, another fingerprint, own references
            evaluated = [dataclasses.replace(prompt_set, prompts=prompt_set.prompts[:num_prompts])
                         for prompt_set in evaluated]
        try:
            summaries = [self._summary(prompt_set, drafter, drafter_config, label, references=references)
                         for prompt_set in evaluated]
            untrained = None
            if compare_untrained:
                floor = self._summary(self.prompt_sets[0], self.untrained(drafter_config), drafter_config,
                                      "untrained", references=references)
                untrained = {key: floor[key] for key in ("tau", "acceptance", "speedup", "speedup_vs_generate",
                                                         *LOSSLESS_KEYS)}
        finally:
            torch.set_num_threads(threads)
        sets = [{**_describe_set(prompt_set), **summary} for prompt_set, summary in zip(evaluated, summaries,
                                                                                        strict=True)]
        report = {
            "format": REPORT_FORMAT,
            "drafter": label,
            "drafter_source": None if source is None else str(source),
            "target": {"spec": self.target_spec, **self.target.identity.to_dict()},
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "prompts": _describe_set(evaluated[0]),
            "settings": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
                         "references": references, "compare_untrained": compare_untrained, "drafter": label,
                         "cpu_threads": cpu_threads,
                         "block_size": config.block_size or int(drafter_config.block_size),
                         "mode": "greedy" if config.temperature == 0 else "sampled"},
            **summaries[0],
            "prompt_sets": sets,
            "untrained": untrained,
            "seconds": time.perf_counter() - started,
        }
        if json_path is not None:
            write_json_atomic(Path(json_path), report)
        return report


def _baseline_key(prompt_set: PromptSet, reference_prompts: int | None) -> tuple[str, int]:
    """The references measured on a set: the set's name and how many of its first prompts have them (a set's
    subsets, ``num_prompts``, are its first prompts, so that number names the prompts measured)."""
    count = len(prompt_set.prompts)
    return prompt_set.name, count if reference_prompts is None else min(reference_prompts, count)


def _describe_set(prompt_set: PromptSet) -> dict[str, Any]:
    """A prompt set as reports name it: name, setting, what it is, size and fingerprint."""
    prompts = prompt_set.prompts
    return {"name": prompt_set.name, "spec": prompt_set.spec, "source": prompt_set.source, "count": len(prompts),
            "mean_prompt_tokens": sum(len(p.input_ids) for p in prompts) / len(prompts),
            "fingerprint": prompt_set.fingerprint, **prompt_set.details}


def run_evaluate(config: EvaluateConfig, *, console: Console | None = None) -> dict[str, Any]:
    """The whole stage: load the drafter, its target and the prompts, evaluate, write ``config.json_path``.

    Raises:
        ConfigError / CheckpointError / MismatchError: bad settings, unloadable drafter, wrong target.
    """
    drafter_path = Path(config.drafter)
    if config.json_path is not None and (Path(config.json_path).is_dir() or Path(config.json_path).parent.is_file()):
        raise ConfigError(f"--json-file {config.json_path}: a folder is there, or its parent is a file; pass a file "
                          "path in a folder")  # refused now, not after the evaluation
    source = drafter_source(drafter_path)  # resolved once: a run saving a new checkpoint meanwhile changes nothing
    loaded = load_drafter(source)
    evaluator = Evaluator(config, config.target or loaded[2].get("target_spec") or "default", console=console)
    drafter, drafter_config, _ = evaluator.load_drafter(drafter_path, loaded)
    path = report_path(config)
    report = evaluator.evaluate(drafter, drafter_config, label=str(drafter_path), source=source,
                                compare_untrained=config.compare_untrained)
    if path is not None:
        kept = write_report(path, report, keep_earlier=config.json_path is None)
        if kept is not None:
            (console or Console(stderr=True)).print(f"the earlier {path} is kept as {kept.name}")
    return report


def write_report(path: Path, report: dict[str, Any], *, keep_earlier: bool) -> Path | None:
    """Write ``report`` to ``path`` (atomically). With ``keep_earlier`` (a run folder's own ``eval/final.json``,
    written by default, which an evaluation on other prompts must not erase) an earlier file there is first renamed
    to ``final.replaced-<local time>.json`` beside it; returns that path, else None."""
    kept = None
    if keep_earlier and path.is_file():
        stamp = time.strftime("%Y%m%dT%H%M%S")
        kept = path.with_name(f"{path.stem}.replaced-{stamp}.json")
        serial = 1
        while kept.exists():  # two evaluations within a second
            serial += 1
            kept = path.with_name(f"{path.stem}.replaced-{stamp}-{serial}.json")
        path.replace(kept)
    write_json_atomic(path, report)
    return kept


def report_path(config: EvaluateConfig) -> Path | None:
    """Where the report is written: ``config.json_path``; without one, a run folder's ``RUN/eval/final.json``
    (where ``report``, ``diff`` and ``inspect`` find the evaluated tau); else nowhere."""
    if config.json_path is not None:
        return Path(config.json_path)
    drafter = Path(config.drafter)
    return drafter / "eval" / "final.json" if (drafter / "run.json").is_file() else None


def _lossless_text(lossless: dict[str, Any] | None, measured: bool) -> str | None:
    """A lossless entry as the tables show it; ``None`` when there is nothing to show."""
    if lossless is None:
        return None
    if lossless.get("checked"):
        verdict = "[green]passed[/]" if lossless["passed"] else "[red]FAILED[/]"
        ties = f", {lossless['near_ties']} diverge at float near-ties" if lossless["near_ties"] else ""
        tokens = (f" ({lossless['tokens_checked']} tokens: the target's argmax)"
                  if lossless.get("tokens_checked") is not None else "")
        return f"{verdict}: {lossless['identical']}/{lossless['prompts']} identical{tokens}{ties}"
    return "n/a (sampled)" if measured else None


def _prompt_sets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every prompt set of ``report`` (reports written before ``prompt_sets`` existed: the one set)."""
    return report.get("prompt_sets") or [{**report["prompts"], "name": report["prompts"].get("name", "prompts"),
                                          **{key: report.get(key) for key in ("tau", "acceptance", "speedup",
                                                                              "speedup_vs_generate", *LOSSLESS_KEYS)}}]


#: The lossless rows of the tables: label, report key.
_LOSSLESS_ROWS = (("greedy lossless check", "lossless"), ("lossless vs block size 1", "lossless_vs_block_size_1"),
                  ("lossless vs generate()", "lossless_vs_generate"))


def _references_text(count: int, measured: int | None) -> str:
    """Which of a set's ``count`` prompts its references were measured on: ``all 16``, ``first 4 of 16``
    (``measured`` is ``None`` in reports written before ``reference_prompts`` existed: every prompt)."""
    return f"all {count}" if measured in (None, count) else f"first {measured} of {count}"


def tau_line(report: dict[str, Any]) -> str:
    """``tau = 2.614`` for one prompt set; ``tau = 2.614 (held-out stdlib files) / 2.101 (numpy-questions)`` for
    several."""
    sets = _prompt_sets(report)
    if len(sets) == 1:
        return f"tau = {report['tau']:.3f}"
    return "tau = " + " / ".join(f"{entry['tau']:.3f} ({entry['name']})" for entry in sets)


def print_report(report: dict[str, Any], console: Console) -> None:
    """The report as rich tables: summary, the prompt sets side by side (when several), tau histogram,
    per-position acceptance."""
    acceptance = report["acceptance"]
    block_size = acceptance["block_size"]
    summary = Table(title=f"DFlash evaluation ({report['settings']['mode']}, block size {block_size})")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    if report.get("drafter_source"):
        summary.add_row("drafter", report["drafter_source"])
    summary.add_row("prompts", f"{report['prompts']['count']} ({report['prompts']['source']})")
    summary.add_row("draft-verify cycles", str(acceptance["num_cycles"]))
    summary.add_row("mean acceptance length tau", f"[bold]{report['tau']:.3f}[/]")
    if report.get("untrained"):
        summary.add_row("tau of an untrained drafter", f"{report['untrained']['tau']:.3f}")
    speed = report["throughput"]
    summary.add_row("speculative tokens/s", f"{speed['speculative']['tokens_per_second']:.1f}")
    decoding = report.get("decoding")  # reports written before the static cache existed lack it
    if decoding is not None:
        graphs = (f", CUDA graphs replayed {decoding['graph_replays']} times (target) and "
                  f"{decoding.get('drafter_graph_replays', 0)} (drafter)" if decoding["cuda_graphs"] else "")
        summary.add_row("target KV cache (speculative and block size 1 loops)", f"{decoding['kv_cache']}{graphs}")
    if report.get("speedup") is None:  # references not run: tau and the teacher-forced lossless check
        summary.add_row("speedups, token-for-token checks", "not measured (references off)")
    else:
        summary.add_row("prompts with references",
                        _references_text(report["prompts"]["count"], report.get("reference_prompts")))
        summary.add_row("block size 1 tokens/s", f"{speed['baseline_block_size_1']['tokens_per_second']:.1f}")
        summary.add_row("speedup vs block size 1", f"{report['speedup']:.2f}x")
    generate = speed.get("target_generate")
    if generate is not None:  # reports written before the generate() reference existed lack it
        summary.add_row("target generate() tokens/s (eager, no graphs)", f"{generate['tokens_per_second']:.1f}")
        summary.add_row("speedup vs generate()", f"{report['speedup_vs_generate']:.2f}x")
    if report.get("speedup_basis"):
        summary.add_row("speedups over", report["speedup_basis"])
    for name, key in _LOSSLESS_ROWS:
        text = _lossless_text(report.get(key), report.get("speedup") is not None or key == "lossless")
        if text is not None:
            summary.add_row(name, text)
    console.print(summary)
    sets = _prompt_sets(report)
    if len(sets) > 1:
        side = Table(title="prompt sets side by side")
        side.add_column("metric")
        for entry in sets:
            side.add_column(entry["name"], justify="right")
        side.add_row("what", *(entry["source"] for entry in sets))
        side.add_row("prompts", *(str(entry["count"]) for entry in sets))
        side.add_row("fingerprint", *(entry["fingerprint"].removeprefix("sha256:")[:12] for entry in sets))
        side.add_row("draft-verify cycles", *(str(entry["acceptance"]["num_cycles"]) for entry in sets))
        side.add_row("tau", *(f"[bold]{entry['tau']:.3f}[/]" for entry in sets))
        side.add_row("prompts with references", *(
            "-" if entry["speedup"] is None else _references_text(entry["count"], entry.get("reference_prompts"))
            for entry in sets))
        for name, key in (("speedup vs block size 1", "speedup"), ("speedup vs generate()", "speedup_vs_generate")):
            side.add_row(name, *("-" if entry[key] is None else f"{entry[key]:.2f}x" for entry in sets))
        for name, key in _LOSSLESS_ROWS:
            if any(entry.get(key) is not None for entry in sets):
                side.add_row(name, *(_lossless_text(entry.get(key), entry["speedup"] is not None) or "-"
                                     for entry in sets))
        console.print(side)
    positions = Table(title="per-position acceptance")
    positions.add_column("draft position k", justify="right")
    for entry in sets:
        suffix = "" if len(sets) == 1 else f" {entry['name']}"
        positions.add_column(f"P(accept k | reached k){suffix}", justify="right")
        positions.add_column(f"P(>= k accepted){suffix}", justify="right")
    for k in range(1, block_size):
        cells = []
        for entry in sets:
            rate = entry["acceptance"]["acceptance_per_position"][k - 1]
            cells += ["-" if rate is None else f"{rate:.3f}", f"{entry['acceptance']['reach_per_position'][k - 1]:.3f}"]
        positions.add_row(str(k), *cells)
    console.print(positions)
    histogram = Table(title="tau histogram" + ("" if len(sets) == 1 else f" ({sets[0]['name']})"))
    histogram.add_column("tau", justify="right")
    histogram.add_column("cycles", justify="right")
    histogram.add_column("share", justify="right")
    total = max(acceptance["num_cycles"], 1)
    for tau, count in acceptance["histogram"].items():
        histogram.add_row(tau, str(count), f"{count / total:.1%} " + "#" * round(40 * count / total))
    console.print(histogram)


def register(app: typer.Typer) -> None:
    """Add ``dflash-stages evaluate``."""

    @app.command("evaluate")
    @config_options(EvaluateConfig, "evaluate")
    def evaluate_command(
        settings: CommandSettings,
        as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON on stdout instead of the table (progress and messages go to stderr), as `cache info --json` and `inspect --json` do."),
    ) -> None:
        """Speculative decoding with the target and a drafter: tau, per-position acceptance, the speedup against
        block size 1 in the same loop and against the target's own generate() (KV cache, same stop tokens and new
        tokens; on the first --reference-prompts prompts of each set, default all), and the greedy lossless checks:
        every output token the target's argmax (one teacher-forced forward per prompt), and token for token against
        both references. Exit code 1 when a greedy output differs beyond a float near-tie."""
        console = Console()

        config = resolve_stage_config(EvaluateConfig, "evaluate", given=settings.given,
                                      config_file=settings.config_file, preset=settings.preset,
                                      overrides=settings.sets, required=("drafter",),
                                      option_names=settings.spellings)  # fmt: skip
        if settings.print_config:
            print_and_exit("evaluate", config)
        json_out = report_path(config)
        if as_json:  # stdout holds the JSON only
            console = Console(stderr=True)
        report = run_evaluate(config, console=console)
        if as_json:
            print(json.dumps(report, indent=2, default=str))
        else:
            print_report(report, console)
        if json_out is not None:
            console.print(f"report written to {json_out}")
        console.print(tau_line(report), soft_wrap=True)  # one line in a log too (grep)
        failed = [key for key in LOSSLESS_KEYS for entry in report["prompt_sets"]
                  if (entry.get(key) or {}).get("checked") and not entry[key]["passed"]]
        if "lossless" in failed:
            console.print("[red]greedy speculative output has tokens that are not the target's own greedy choice[/]")
        if "lossless_vs_block_size_1" in failed:
            console.print("[red]greedy speculative output differs from the block-size-1 loop's output[/]")
        if "lossless_vs_generate" in failed:
            console.print("[red]greedy speculative output differs from the target's generate() output[/]")
        if failed:
            raise typer.Exit(code=1)

