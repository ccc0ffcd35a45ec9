"""Helper of h200_smollm2_ablation.sh (issue 13, experiment A: raw stdlib text vs the target's own replies).

Subcommands (each prints what it did; run from the repository root with the project importable):

  raw-folder DEST [--max-files N] [--packages NAME ...] [--max-tokens T]
      DEST/stdlib/<relative path>: the default corpus's stdlib *.py files (test suites excluded, as prepare's
      `default` input) MINUS every file the embedded prompt set holds out (dflash.generation.default_prompts.
      is_heldout_document, 50 permille by path hash), and DEST/placeholder/zz_placeholder.txt, one tiny document
      that the pipeline's split stage is made to hold out (see `plan`), so that the training split is exactly the
      training-side stdlib files. DEST/manifest.json lists the held-out files.
      With --packages (v8 and later: the preset's generate.default_prompts.packages): then DEST/packages/<name>/
      <relative path>, the package files the prompt set draws its package prompts from, in the prompt set's own
      order (default_prompts._package_prompts: non-held-out files with prompts, seeded permutation), until the
      raw text reaches --max-tokens target tokens in all (the regenerated corpus's size, so both arms hold the
      same number of corpus tokens, counted with the target's tokenizer; the cap stops before the prompt set's
      last package files, so the raw arm holds fewer distinct files than the regenerated one).
  heldout-prompts OUT
      The prompt set's held-out prompts, written exactly as `generate` writes OUTPUT/heldout_prompts.jsonl
      (default_prompt_sets(DefaultPromptConfig()) -> write_prompts_jsonl).
  plan CORPUS --preset P --out PRESET --target-tokens T --scratch DIR [--set section.key=value ...]
      On the prepared raw corpus: the split seed that holds out the placeholder document alone, then the epoch
      plans of the training split (dflash.corpus.CorpusLengths: the same batches the streaming loader plans from
      a cache of that corpus) -> the max_steps whose cumulative real tokens come closest to T (the tokens_seen of
      the run to match). Writes the pipeline preset PRESET: P without `generate`, with prepare (CORPUS, re-read
      as tokenized data), split (1 document, that seed) and train.max_steps.
  run-pipeline --prompts FILE -- RUN-ARGS...
      `dflash-stages run RUN-ARGS` with evaluation on FILE: pipelines/offline.py drops evaluate.prompts when the
      corpus comes from prepare + split (it evaluates on the held-out corpus rows instead), so
      stages.evaluate.EvaluateConfig is wrapped to turn prompts="held-out" into FILE (nothing else changes).
  summary WORKDIR OUT.json
      tau per epoch, speedups, per-position acceptance, lossless checks and the final tokens_seen of a workdir.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

PLACEHOLDER_TEXT = "split placeholder: the one document the pipeline's split stage holds out (never trained on).\n" * 4


def raw_folder(dest: Path, max_files: int | None, packages: list[str], max_tokens: int | None) -> None:
    from dflash.default_corpus import default_corpus_files, stdlib_root
    from dflash.generation.default_prompts import DefaultPromptConfig, is_heldout_document

    permille = DefaultPromptConfig().heldout_permille
    root = stdlib_root()
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "stdlib").mkdir(parents=True)
    kept, held = [], []
    for file in default_corpus_files():
        relative = file.path.relative_to(root).as_posix()
        if is_heldout_document(relative, permille):
            held.append(relative)
            continue
        if max_files is not None and len(kept) >= max_files:
            continue
        target = dest / "stdlib" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file.path, target)
        kept.append(relative)
    (dest / "placeholder").mkdir()
    (dest / "placeholder" / "zz_placeholder.txt").write_text(PLACEHOLDER_TEXT)
    manifest = {"python": sys.version.split()[0], "stdlib": str(root), "heldout_permille": permille,
                "kept_files": len(kept), "heldout_files": held, "max_files": max_files}
    print(f"raw-folder: {len(kept)} training-side stdlib files -> {dest / 'stdlib'}; {len(held)} held-out files "
          f"left out (Python {manifest['python']}, {root})")
    if packages:
        manifest["packages"] = _package_files(dest / "packages", [dest / "stdlib" / k for k in kept], packages,
                                              max_tokens)
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _package_files(dest: Path, stdlib_files: list[Path], packages: list[str], max_tokens: int | None) -> dict:
    """Copy the prompt set's package files (its order) under ``dest`` until stdlib + package tokens reach
    ``max_tokens``; returns what was taken."""
    import numpy as np

    from dflash.generation.default_prompts import DefaultPromptConfig, _file_prompts, package_files
    from dflash.target import load_tokenizer

    tokenizer = load_tokenizer(None)

    def count(path: Path) -> int:
        text = path.read_text(encoding="utf-8", errors="replace")
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    stdlib_tokens = sum(count(p) for p in stdlib_files)
    config = DefaultPromptConfig(packages=tuple(packages))
    files = package_files(config)  # in the prompt set's order below (its first draw of the seed)
    rng = np.random.default_rng(config.seed)
    total, taken = stdlib_tokens, []
    for index in rng.permutation(len(files)):
        file, relative = files[index]
        if max_tokens is not None and total >= max_tokens:
            break
        if not _file_prompts(file.path, relative, file.sample_id, config):
            continue  # the prompt set skips it too (not UTF-8, or under 100 characters)
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file.path, target)
        total += count(target)
        taken.append(relative)
    print(f"raw-folder: {stdlib_tokens:,} stdlib tokens + {len(taken)} package files ({', '.join(packages)}) "
          f"-> {total:,} tokens (cap {max_tokens if max_tokens is not None else 'none'}) -> {dest}")
    return {"names": list(packages), "files": len(taken), "stdlib_tokens": stdlib_tokens, "tokens": total,
            "max_tokens": max_tokens, "first_files": taken[:20]}


def heldout_prompts(out: Path) -> None:
    from dflash.generation.default_prompts import DefaultPromptConfig, default_prompt_sets, write_prompts_jsonl

    sets = default_prompt_sets(DefaultPromptConfig())
    count = write_prompts_jsonl(sets["heldout"], out)
    print(f"heldout-prompts: {count} held-out prompts -> {out}")


def _apply_sets(config: dict, overrides: list[str]) -> dict:
    from pipelines.offline import apply_overrides

    return apply_overrides(config, overrides)


def plan(corpus_path: Path, preset: str, out: Path, target_tokens: int, scratch: Path, overrides: list[str]) -> None:
    import numpy as np
    import torch

    from dflash.batch_source import PlannedCursor
    from dflash.corpus import CorpusLengths, open_corpus
    from pipelines.offline import _split_corpus, load_preset
    from stages.train import TrainConfig
    from stages.trainer import stream_config

    corpus = open_corpus(corpus_path)
    documents = [corpus.sample_id(i).split("#", 1)[0] for i in range(len(corpus))]
    unique = sorted(set(documents))
    placeholder = [d for d in unique if d.startswith("placeholder:")]
    if len(placeholder) != 1:
        raise SystemExit(f"plan: expected one placeholder document in {corpus_path}, found {placeholder}")
    index = unique.index(placeholder[0])
    # _split_corpus holds out unique[permutation(len(unique))[:1]] (numpy default_rng(seed)).
    seed = next(s for s in range(1_000_000) if int(np.random.default_rng(s).permutation(len(unique))[0]) == index)
    if scratch.exists():
        shutil.rmtree(scratch)
    counts = _split_corpus(corpus_path, scratch / "corpus", scratch / "heldout", heldout_documents=1, seed=seed)
    if counts["heldout_rows"] != documents.count(placeholder[0]):
        raise SystemExit(f"plan: split seed {seed} did not hold out the placeholder alone: {counts}")
    print(f"plan: split seed {seed} holds out {placeholder[0]} alone; training split {counts['train_documents']} "
          f"documents, {counts['train_rows']} rows, {counts['train_tokens']:,} tokens")

    config = _apply_sets(load_preset(preset), overrides)
    train = {k: v for k, v in config["train"].items() if not k.startswith("_")}
    train.pop("max_steps", None)
    train_config = TrainConfig(cache=str(scratch / "cache"), output=str(scratch / "run"), **train)
    cursor = PlannedCursor(CorpusLengths(open_corpus(scratch / "corpus")),
                           stream_config(train_config, "train", torch.device("cpu")))
    cumulative, per_epoch = [0], []
    epoch = 0
    while cumulative[-1] < target_tokens and epoch < 10_000:
        tokens = [batch.num_tokens for batch in cursor.plan(epoch).batches]
        per_epoch.append({"epoch": epoch, "steps": len(tokens), "tokens": int(sum(tokens))})
        for value in tokens:
            cumulative.append(cumulative[-1] + value)
        epoch += 1
    steps = int(np.argmin([abs(c - target_tokens) for c in cumulative[1:]])) + 1
    predicted = cumulative[steps]
    print(f"plan: {per_epoch[0]['steps']} steps / {per_epoch[0]['tokens']:,} real tokens per epoch (epoch 0); "
          f"max_steps {steps} -> predicted tokens_seen {predicted:,} vs target {target_tokens:,} "
          f"({(predicted - target_tokens) / target_tokens:+.3%}); {steps / per_epoch[0]['steps']:.3f} epochs")

    result = {k: v for k, v in config.items() if k != "generate"}
    result["_why"] = (f"Issue 13 ablation A: {preset} on RAW stdlib text (training-side files of the prompt set, "
                      f"its held-out files removed), same train settings, max_steps {steps} for {target_tokens:,} "
                      "training tokens; evaluated on the prompt set's held-out prompts (h200_smollm2_ablation.py).")
    result["prepare"] = {"inputs": [str(corpus_path)], "max_length": int(corpus.metadata.get("max_length") or 2048),
                         "length_policy": "error"}
    result["split"] = {"heldout_documents": 1, "seed": seed}
    result["train"] = {**config["train"], "max_steps": steps}
    out.write_text(json.dumps(result, indent=2))
    (out.with_suffix(".plan.json")).write_text(json.dumps(
        {"split_seed": seed, "placeholder": placeholder[0], "split_counts": counts, "target_tokens": target_tokens,
         "max_steps": steps, "predicted_tokens_seen": predicted, "epochs": per_epoch,
         "predicted_tokens_at": {str(s): cumulative[s] for s in sorted({round(k * steps / 3) for k in (1, 2, 3)})}},
        indent=1))
    print(f"plan: preset -> {out}")


def run_pipeline(prompts: Path, args: list[str]) -> None:
    import stages.evaluate as evaluate_module

    original = evaluate_module.EvaluateConfig
    prompts = prompts.resolve()
    if not prompts.is_file():
        raise SystemExit(f"run-pipeline: no prompts file {prompts}")

    class HeldOutPromptsFile(original):  # still the dataclass (its fields are checked by name)
        __slots__ = ()

        def __init__(self, **values):
            if values.get("prompts", "held-out") == "held-out":
                values["prompts"] = str(prompts)
                values.pop("corpus", None)
            super().__init__(**values)

    evaluate_module.EvaluateConfig = HeldOutPromptsFile
    from stages import cli

    sys.argv = ["dflash-stages", "run", *args]
    cli.main()


def summary(workdir: Path, out: Path) -> None:
    state = json.loads((workdir / "pipeline.json").read_text())
    result = {"workdir": str(workdir), "epochs": state.get("epochs", []), "tau": state.get("tau"),
              "stage_seconds": {k: v.get("seconds") for k, v in state.get("stages", {}).items()}}
    for entry in result["epochs"]:
        path = workdir / "eval" / f"epoch_{entry['epoch']}.json"
        if path.is_file():
            report = json.loads(path.read_text())
            entry["report_keys"] = sorted(report)
            for key in ("acceptance", "lossless", "lossless_vs_generate", "speedup", "speedup_vs_generate", "throughput",
                        "prompts", "seconds", "device", "dtype"):
                if key in report:
                    entry[key] = report[key]
    metrics = workdir / "run" / "metrics.jsonl"
    if metrics.is_file():
        last = None
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "train":
                last = row
        if last is not None:
            result["last_train_step"] = {k: last.get(k) for k in ("step", "epoch", "tokens_seen", "loss",
                                                                   "expected_acceptance_length")}
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"tau": result["tau"], "epochs": [(e["epoch"], e["step"], round(e["tau"], 4),
                                                       round(e.get("speedup") or 0, 3)) for e in result["epochs"]],
                      "last_train_step": result.get("last_train_step")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("raw-folder")
    p.add_argument("dest", type=Path)
    p.add_argument("--max-files", type=int)
    p.add_argument("--packages", nargs="*", default=[])
    p.add_argument("--max-tokens", type=int)
    p = sub.add_parser("heldout-prompts")
    p.add_argument("out", type=Path)
    p = sub.add_parser("plan")
    p.add_argument("corpus", type=Path)
    p.add_argument("--preset", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--target-tokens", type=int, required=True)
    p.add_argument("--scratch", type=Path, required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p = sub.add_parser("run-pipeline")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser("summary")
    p.add_argument("workdir", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "raw-folder":
        raw_folder(args.dest, args.max_files, args.packages, args.max_tokens)
    elif args.command == "heldout-prompts":
        heldout_prompts(args.out)
    elif args.command == "plan":
        plan(args.corpus, args.preset, args.out, args.target_tokens, args.scratch, args.overrides)
    elif args.command == "run-pipeline":
        run_pipeline(args.prompts, args.args[1:] if args.args[:1] == ["--"] else args.args)
    else:
        summary(args.workdir, args.out)


if __name__ == "__main__":
    main()
