"""Where the time of the pipeline's evaluations goes, phase by phase, on a finished ``dflash-stages run`` work folder.

Times, in one process and in this order: importing the evaluate stage (torch, transformers); loading the target;
building each prompt set; loading the drafter (with the check of the target's embedding and LM-head hashes); a
tau-only evaluation (what the epochs before the last run) of every prompt of the first set, then of its first
``--subset`` prompts (``evaluate.per_epoch_num_prompts``); a full evaluation of the first set (the two references,
block size 1 and ``generate()``, measured on it); the same again (references reused, as the pipeline's evaluator
does within a process); and the full evaluation of every set (the final drafter's report). Then the final report
as a new process measures it, the references of every set measured: with the references on every prompt, and on the
first ``--reference-prompts`` prompts of each set (``evaluate.reference_prompts``; the teacher-forced lossless
check still covers every prompt); the note gives the speedups and what they are computed over. The settings are
the work folder's ``evaluate`` section (``pipeline.json``).

Run::

    python benchmarks/evaluation_cost.py dflash-work --reference-prompts 1 > docs/results/evaluation_cost_cpu.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

started = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--subset", type=int, default=2, help="Prompts of the per-epoch subset.")
    parser.add_argument("--reference-prompts", type=int, default=1,
                        help="Prompts of each set that get the references in the last variant.")
    args = parser.parse_args()
    rows: list[tuple[str, float, str]] = []

    def timed(name: str, work, note=lambda result: ""):
        begin = time.perf_counter()
        result = work()
        rows.append((name, time.perf_counter() - begin, note(result)))
        return result

    def imports():
        import stages.evaluate

        return stages.evaluate

    evaluate_module = timed("import stages.evaluate (torch, transformers)", imports)
    state = json.loads((args.workdir / "pipeline.json").read_text())
    section = {k: v for k, v in state["config"]["evaluate"].items()
               if k not in ("per_epoch", "per_epoch_references", "per_epoch_num_prompts", "compare_untrained",
                            "reference_prompts")}
    prompts = args.workdir / "corpus" / "heldout_prompts.jsonl"
    config = evaluate_module.EvaluateConfig(drafter=args.workdir / "run", target=state["config"]["target"],
                                            prompts=str(prompts), **section)
    from dflash.target.load import load_target

    evaluator = evaluate_module.Evaluator.__new__(evaluate_module.Evaluator)
    evaluator.config, evaluator.target_spec = config, config.target
    evaluator.console = evaluate_module.Console(stderr=True)
    evaluator.device, evaluator.dtype = config.resolved_device(), config.resolved_dtype()
    evaluator.target = timed("load the target", lambda: load_target(config.target, dtype=evaluator.dtype,
                                                                     device=evaluator.device))
    evaluator.prompt_sets = [timed(f"build prompt set {spec}", lambda spec=spec: evaluate_module.load_prompt_set(
        spec, config, evaluator.target.tokenizer, name="held-out stdlib files" if spec == str(prompts) else None),
        lambda s: f"{len(s.prompts)} prompts") for spec in (config.prompts, *config.extra_prompts)]
    evaluator.prompts, evaluator.baselines = evaluator.prompt_sets[0].prompts, {}
    drafter, drafter_config, _ = timed("load the drafter, check the target's weights",
                                       lambda: evaluator.load_drafter(config.drafter))

    def run(label, **kwargs):
        return timed(label, lambda: evaluator.evaluate(drafter, drafter_config, label=label, **kwargs),
                     lambda r: "; ".join(f"{s['name']}: {s['count']} prompts, tau {s['tau']:.3f}, "
                                         f"{s['acceptance']['num_cycles']} cycles"
                                         + ("" if s["speedup"] is None else
                                            f", {s['speedup']:.2f}x vs block size 1 ({s['speedup_basis']})"
                                            + ("" if not s["lossless"]["checked"] else
                                               f", lossless {s['lossless']['identical']}/{s['lossless']['prompts']}"
                                               f" ({s['lossless']['tokens_checked']} tokens)"))
                                         for s in r["prompt_sets"]))

    run("tau only, first set (an epoch before the last)", references=False, all_sets=False)
    run(f"tau only, first {args.subset} prompts of the first set", references=False, all_sets=False,
        num_prompts=args.subset)
    run("first set with both references (measured)", references=True, all_sets=False)
    run("first set with both references (reused)", references=True, all_sets=False)
    run("every set with both references (final; first set's reused)", references=True)
    evaluator.baselines = {}
    run("every set, references on every prompt (final, all measured)", references=True)
    evaluator.config = dataclasses.replace(config, reference_prompts=args.reference_prompts)
    run(f"every set, references on the first {args.reference_prompts} (final, measured)", references=True)
    settings = {k: getattr(config, k) for k in ("num_prompts", "prompt_tokens", "max_new_tokens", "device",
                                                "dtype", "cpu_threads", "extra_prompts")}
    settings["reference_prompts (last row)"] = args.reference_prompts
    print(f"workdir {args.workdir}; settings {settings}")
    print(f"{'phase':<64} {'seconds':>8}  note")
    for name, seconds, note in rows:
        print(f"{name:<64} {seconds:>8.2f}  {note}")
    print(f"{'total (this process)':<64} {time.perf_counter() - started:>8.2f}")


if __name__ == "__main__":
    main()
