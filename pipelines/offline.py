"""The pipeline: generate (or prepare -> split) -> extract -> train -> evaluate as ONE command, on a preset config;
with an ``online`` section, generate (or prepare -> split) -> online training -> evaluate, with no cache on disk.

Run::

    dflash-stages run                                   # preset cpu-small: the README main job, 2 CPU cores, < 10 min
    dflash-stages run --preset h200-smollm2 --workdir /data/dflash --docs /usr/share/doc/python3.12/html/_sources
    dflash-stages run --set train.optim.lr=3e-4 --set evaluate.num_prompts=32   # override any preset field
    dflash-stages run --preset h200-smollm2-online --workdir /data/dflash      # train without the 46 GB cache

Stages run in this process through their Python entry points (``run_prepare``, ``run_extract``,
``run_training``, ``run_online``, ``run_evaluate``), never as shell commands. Work folder layout::

    WORKDIR/pipeline.json        resolved config, per-stage status, timings, tau after each epoch
    WORKDIR/corpus/              with a generate section: the target's own responses (contract 1), and
                                 corpus/heldout_prompts.jsonl, the held-out prompts evaluation uses
    WORKDIR/corpus-all/          prepare's corpus (contract 1)
    WORKDIR/corpus/ heldout/     the split by document: training rows / held-out rows (training never sees them)
    WORKDIR/cache/               extract's hidden-state cache of corpus/ (contract 2); never made with ``online``
    WORKDIR/run/                 the drafter run (contract 3), from the cache or (``online``) from the producers
    WORKDIR/eval/epoch_K.json    evaluation reports (epoch 0 = untrained drafter) and eval/final.json

Resumable: a stage whose output is complete and whose config is unchanged is skipped; extract resumes from its
committed shards and train from its latest checkpoint. Changing a stage's config in an existing work folder is an
error naming the stage (use another ``--workdir``), since its outputs would no longer match the settings; the fields
its config declares ``runtime`` (progress lines, logging, checkpoint cadence, locks: docs/config-reference.md) may
change.

Online training (an ``online`` section: the producer fields of :class:`pipelines.online.OnlineConfig`): extract is
not run; :func:`pipelines.online.run_online` trains on ``corpus/`` with the ``train`` section's trainer while target
replicas compute the hidden states into a shared-memory ring (docs/online-queue.md). Its plan comes from the corpus
lengths and equals the one extract's cache would give (same schedule, epoch ends and batches), so everything below
(epoch segments, exact resume, evaluations) is the same; ``pipeline.json`` records the stage as ``online``, whose
settings are the ``online`` and ``train`` sections. A work folder trained one way is refused the other way.

The held-out split is by document (a stdlib file and its length chunks stay together), chosen by a seeded
permutation of the documents; held-out prompts come only from ``heldout/``. With ``evaluate.per_epoch`` the
training runs in epoch-long segments (exact resume: same trajectory as one straight run) and tau is measured on
the held-out prompts after each epoch, starting with the untrained drafter (epoch 0); those before the last measure
tau, acceptance and the teacher-forced lossless check only (``evaluate.per_epoch_references`` also runs the speedup
references and the token-for-token checks at each), on the first ``evaluate.per_epoch_num_prompts`` prompts when set, the last one and ``eval/final.json``
everything. The held-out prompts are the first prompt set; ``evaluate.extra_prompts`` (the presets:
``numpy-questions``, another kind of prompt from a package no preset trains on) are measured on the final drafter
only, each reported beside the first, and the last line names each set's tau.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from dflash.drafter.config import DEFAULT_NUM_DRAFT_LAYERS
from dflash.errors import ConfigError
from dflash.io.files import load_json
from dflash.io.locks import output_lock
from dflash.serving.export import drafter_source
from dflash.target.load import locate_target, target_num_layers
from pipelines.online import ONLINE_CACHE_PREFIX, OnlineConfig
from stages.config.check import (
    EXCLUSIVE_SETTINGS,
    deep_merge,
    field_default,
    layer_over,
    leaf_paths,
    read_config_file,
    runtime_paths,
)
from stages.config.presets import PIPELINE_SECTIONS, PRESETS, load_preset, strip_comments
from stages.config.resolve import default_paths, plain_value, resolve_stage_config
from stages.evaluate import EvaluateConfig
from stages.extract.command import ExtractConfig
from stages.generate import GenerateConfig
from stages.prepare import PrepareConfig
from stages.train.config import TrainConfig

if TYPE_CHECKING:
    from stages.evaluate import Evaluator

log = logging.getLogger(__name__)

__all__ = ["PipelineConfig", "PipelineEvaluateConfig", "SECTIONS", "SplitConfig", "register", "resolve_pipeline",
           "run_pipeline"]

#: The fix named when an evaluation report of the work folder cannot be read.
_EVAL_FIX = "the evaluation report is damaged: remove it and rerun the same command (that evaluation runs again)"

#: The work-folder entry (``paths`` of ``_run_stages``) each stage writes.
_STAGE_OUTPUT = {"generate": "corpus", "prepare": "corpus-all", "split": "corpus", "extract": "cache", "train": "run",
                 "online": "run", "evaluate": "eval"}
_STATE_FILE = "pipeline.json"
_UNSET = object()  # a setting one side of a comparison lacks

#: The preset ``run`` uses when none is given; ``run --config FILE`` is merged over it.
DEFAULT_PRESET = "cpu-small"


@dataclass(kw_only=True, slots=True)
class SplitConfig:
    """The ``split`` section: prepare's corpus split by document into training rows and held-out rows
    (``dflash.corpus.split``).

    Fields:
        heldout_documents: documents held out for evaluation (training never sees them); required, at least 1.
        seed: seed of the permutation of the documents that picks the held-out ones.
    """

    heldout_documents: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.heldout_documents is None or self.heldout_documents < 1:
            raise ConfigError(f"heldout_documents must be a positive integer, got {self.heldout_documents!r}")


@dataclass(kw_only=True, slots=True)
class PipelineEvaluateConfig(EvaluateConfig):
    """The ``evaluate`` section: :class:`stages.evaluate.EvaluateConfig`'s fields, plus when the pipeline evaluates
    (``stages.config.resolve.PIPELINE_ONLY`` names these for the evaluate command, which skips them in a preset).

    Fields:
        per_epoch: train in epoch-long segments and measure tau on the held-out prompts after each epoch.
        per_epoch_references: the evaluations before the last also run the speedup references and lossless checks.
        per_epoch_num_prompts: the evaluations before the last use the first N prompts of the first set (None:
            every prompt).
    """

    per_epoch: bool = False
    per_epoch_references: bool = False
    per_epoch_num_prompts: int | None = None

    def __post_init__(self) -> None:
        EvaluateConfig.__post_init__(self)
        if self.per_epoch_num_prompts is not None and self.per_epoch_num_prompts < 1:
            raise ConfigError(f"per_epoch_num_prompts must be >= 1 (or null: every prompt), got "
                              f"{self.per_epoch_num_prompts}")


#: Marks a path inside the work folder in :data:`SECTIONS`; a section is checked with a path there that no stage
#: writes.
IN_WORKDIR = "WORKDIR/"


@dataclass(frozen=True)
class Section:
    """How ``run`` checks one stage section: ``config`` is the stage's config dataclass; ``pipeline_sets`` the
    fields the pipeline gives the stage itself (paths inside the work folder, as :data:`IN_WORKDIR`), with the value
    the check builds the config with; no layer may set them, nor ``target`` (the pipeline's own). ``unset``: the
    value the check uses where no layer sets a field (the pipeline decides it when the stage runs)."""

    config: type
    pipeline_sets: Mapping[str, Any] = field(default_factory=dict)
    unset: Mapping[str, Any] = field(default_factory=dict)


#: Every stage section of a pipeline, one line each, checked in this order (train before extract: extract's default
#: taps follow train's draft layers); :data:`stages.config.presets.PIPELINE_SECTIONS` lists them in run order.
SECTIONS: dict[str, Section] = {
    "generate": Section(GenerateConfig, {"output": IN_WORKDIR}),
    "prepare": Section(PrepareConfig, {"output": IN_WORKDIR, "overwrite": True, "heldout_documents": 0}),
    "split": Section(SplitConfig),
    "train": Section(TrainConfig, {"cache": IN_WORKDIR, "output": IN_WORKDIR, "resume": False, "stop_at_step": None}),
    # The online branch trains the train section's trainer on WORKDIR/corpus and writes no cache (no cache_to).
    "online": Section(OnlineConfig, {"corpus": IN_WORKDIR, "train": None, "cache_to": None}),
    "extract": Section(ExtractConfig, {"corpus": IN_WORKDIR, "output": IN_WORKDIR}),
    "evaluate": Section(PipelineEvaluateConfig, {"drafter": IN_WORKDIR, "corpus": IN_WORKDIR, "cache": None,
                                                 "json_path": None}, unset={"prompts": "held-out"}),
}

#: Keys of the ``evaluate`` section that the pipeline reads itself (``_run_stages`` takes them out of what the
#: evaluator gets), with their defaults.
EVALUATE_EXTRAS = {f.name: field_default(f) for f in dataclasses.fields(PipelineEvaluateConfig)
                   if f.name == "compare_untrained" or f.name not in EvaluateConfig.__dataclass_fields__}


def stages_run(config: Mapping[str, Any]) -> list[str]:
    """The stage sections a pipeline config runs: with a ``generate`` section the corpus is the target's own
    responses and ``prepare`` and ``split`` are not run; without one, ``generate`` is not run. With an ``online``
    section the training reads hidden states computed live (``online`` and ``train``) and ``extract`` is not run."""
    first = ["generate"] if config.get("generate") else ["prepare", "split"]
    middle = ["online"] if config.get("online") else ["extract"]
    return [*first, *middle, "train", "evaluate"]


def derived_extract(extract: dict[str, Any], train: Mapping[str, Any]) -> None:
    """The extract settings that follow the train section where the extract section leaves them unset, in place:
    one tap per draft layer (``dflash.target.taps``: the cache holds the layers the trained drafter reads), and the
    target's final normed hidden state for a distilling drafter, which reads it."""
    drafter = train.get("drafter") if isinstance(train.get("drafter"), Mapping) else {}
    if extract.get("num_taps") is None and extract.get("target_layer_ids") is None:
        extract["num_taps"] = drafter.get("num_draft_layers", DEFAULT_NUM_DRAFT_LAYERS)
    if drafter.get("distill", "none") != "none" and extract.get("final_tap") is None:
        extract["final_tap"] = True


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """The resolved pipeline: one dict of stage settings per stage, as the layers set them (:func:`resolve_pipeline`
    checks each against its stage's config).

    Fields:
        workdir: where every stage writes (layout in the module docstring).
        target: target spec shared by every stage.
        generate / prepare / split / extract / online / train / evaluate: the stage sections of the preset. With a
            ``generate`` section the training corpus is the target's own responses to the prompt set
            (``stages.generate``; the default prompt set holds out whole stdlib files, and evaluation uses its
            held-out prompts): ``prepare`` and ``split`` are then not run. With an ``online`` section (the producer
            fields of ``pipelines.online.OnlineConfig``: ``target_gpus`` or ``target_processes``, ``ring_slots``,
            ...; the pipeline sets ``corpus``, ``target`` and the trainer from ``train``) target replicas compute
            the hidden states while the drafter trains: ``extract`` is not run and no cache is written.
    """

    workdir: Path
    target: str = "default"
    generate: dict[str, Any] = field(default_factory=dict)
    prepare: dict[str, Any] = field(default_factory=dict)
    split: dict[str, Any] = field(default_factory=dict)
    extract: dict[str, Any] = field(default_factory=dict)
    online: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).expanduser()
        extra = self.evaluate.get("extra_prompts")
        default_prompts = self.generate.get("default_prompts")
        packages = default_prompts.get("packages") if isinstance(default_prompts, dict) else None
        if isinstance(extra, list) and "numpy-questions" in extra and isinstance(packages, list) and "numpy" in packages:
            raise ConfigError("evaluate.extra_prompts: numpy-questions asks about numpy, which "
                              "generate.default_prompts.packages trains on, so it tests nothing held out; drop numpy "
                              "from the packages or numpy-questions from evaluate.extra_prompts")
        if not self.online:  # the online branch runs no extract: its producers tap the layers themselves
            derived_extract(self.extract, self.train)
        if self.generate and self.generate.get("prompts", "default") != "default" and "prompts" not in self.evaluate:
            raise ConfigError(
                f"evaluate.prompts: generate.prompts is {self.generate['prompts']!r}, which has no held-out split; "
                "give evaluate.prompts (a .jsonl/.txt file of prompts training never saw)"
            )

    def section(self, name: str) -> dict[str, Any]:
        return {"target": self.target, **getattr(self, name)}

    def to_dict(self) -> dict[str, Any]:
        return {"workdir": str(self.workdir), "target": self.target,
                **{name: getattr(self, name) for name in PIPELINE_SECTIONS}}


def pipeline_sections(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A preset's or config file's pipeline sections and ``target``, without ``_`` comments.

    Raises:
        ConfigError: a key that is neither a pipeline section nor ``target`` (with a did-you-mean), a section that
            is not a table, a target that is not a string; named with ``source``.
    """
    data = strip_comments(dict(data))
    for key, value in data.items():
        if key == "target":
            if not isinstance(value, str):
                raise ConfigError(f"target ({source}): expected str (a target spec), got {value!r}")
            continue
        if key not in PIPELINE_SECTIONS:
            close = difflib.get_close_matches(key, PIPELINE_SECTIONS, n=1)
            raise ConfigError(f"{key} ({source}): not a pipeline section; "
                              + (f"did you mean {close[0]}?" if close else f"sections: {', '.join(PIPELINE_SECTIONS)}"))
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} ({source}): expected a section (a table of {key} settings), got {value!r}")
    return data


def _sets_by_section(overrides: Sequence[str], run: Sequence[str], preset: str) -> dict[str, list[str]]:
    """``--set SECTION.KEY=VALUE`` items by section.

    Raises:
        ConfigError: an item without ``=`` or a ``SECTION.`` prefix, of an unknown section, or of a section the
            pipeline does not run (which would otherwise be silently dropped, or for ``generate`` silently replace
            prepare and split), naming the item.
    """
    sets: dict[str, list[str]] = {}
    for item in overrides:
        key, sep, _ = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set {item!r}: expected section.field=value, e.g. train.optim.lr=3e-4")
        if section not in PIPELINE_SECTIONS:
            raise ConfigError(f"--set {item!r}: unknown section {section!r}; expected one of {list(PIPELINE_SECTIONS)}")
        if section not in run:
            article = "an" if section[0] in "aeiou" else "a"
            raise ConfigError(f"--set {item!r}: preset {preset} runs no {section} stage (it runs {', '.join(run)}); "
                              f"drop it, or use a preset with {article} {section} section")
        sets.setdefault(section, []).append(item)
    return sets


def resolve_pipeline(*, workdir: Path, preset: str = DEFAULT_PRESET, config_file: str | Path | None = None,
                     overrides: Sequence[str] = (), target: str | None = None,
                     docs: Sequence[str | Path] = ()) -> PipelineConfig:  # fmt: skip
    """The pipeline ``run`` runs, every section it runs checked before any stage, as each stage command resolves
    its own (``stages.config.resolve.resolve_stage_config``): defaults < ``preset`` < ``config_file`` (sections
    merged field by field) < the options (``target``; ``docs`` adds text folders to prepare's inputs, after every
    layer) < ``overrides`` (``--set SECTION.KEY=VALUE``). A section the pipeline does not run (prepare and split
    beside generate) is kept as the layers give it.

    Raises:
        ConfigError: the first problem, named as the stage commands name it (``SECTION.KEY (SOURCE): ...``).
        TargetError: the target names no transformers folder or ``.gguf`` file.
    """
    layers = [(pipeline_sections(load_preset(preset), f"preset {preset}"), f"preset {preset}")]
    if config_file is not None:
        source = f"--config {config_file}"
        layers.append((pipeline_sections(read_config_file(config_file), source), source))
    given = {name: {} for name in PIPELINE_SECTIONS}  # as the layers set them: what decides which stages run
    for data, _ in layers:
        for name in PIPELINE_SECTIONS:
            layer_over(given[name], copy.deepcopy(data.get(name, {})))
    run = stages_run(given)
    sets = _sets_by_section(overrides, run, preset)
    if docs and "prepare" not in run:
        raise ConfigError(f"--docs adds text folders to prepare's inputs, but preset {preset} generates its corpus "
                          "(a generate section) and runs no prepare; drop --docs")
    target = target if target is not None else next(
        (data["target"] for data, _ in reversed(layers) if "target" in data), "default")
    target_path = locate_target(target)  # a wrong target path fails now, not when the first stage loads it
    sections = {name: values for name, values in given.items() if name not in run}
    for name in (name for name in SECTIONS if name in run):
        sections[name] = _resolve_section(name, layers, sets.get(name, ()), target=target, target_path=target_path,
                                          docs=docs, workdir=Path(workdir).expanduser(), resolved=sections)
    return PipelineConfig(workdir=workdir, target=target, **{name: sections[name] for name in PIPELINE_SECTIONS})


def _resolve_section(name: str, layers: Sequence[tuple[Mapping[str, Any], str]], sets: Sequence[str], *,
                     target: str, target_path: Path, docs: Sequence[str | Path], workdir: Path,
                     resolved: Mapping[str, dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """One section's settings as the layers set them, checked by building its stage's config as the stage will
    (``resolved``: the sections checked before it)."""
    spec = SECTIONS[name]
    values: dict[str, Any] = {}
    pipeline_sets = {key: str(workdir / "check") if value == IN_WORKDIR else value
                     for key, value in spec.pipeline_sets.items()}
    has_target = "target" in {f.name for f in dataclasses.fields(spec.config)}

    def add_docs(merged: dict[str, Any]) -> None:
        if name == "prepare" and docs:
            merged["inputs"] = [*merged.get("inputs", ["default"]), *(str(d) for d in docs)]

    def build(merged: dict[str, Any]) -> Any:
        values.update(copy.deepcopy(merged))
        settings = {**spec.unset, **copy.deepcopy(merged), **pipeline_sets}
        if name == "extract":
            derived_extract(settings, resolved["train"])
        if name == "online":  # its trainer is the train section's, reading the producers instead of a cache
            check = str(workdir / "check")
            settings["train"] = TrainConfig.from_dict({**copy.deepcopy(resolved["train"]), "target": target,
                                                       "cache": f"{ONLINE_CACHE_PREFIX}{check}", "output": check})
        config = spec.config(**settings, **({"target": target} if has_target else {}))
        if name == "train":
            _check_init_target_layers(config, target_path)
        return config

    resolve_stage_config(spec.config, name, layers=[(data.get(name, {}), source) for data, source in layers],
                         overrides=sets, reserved=("target", *spec.pipeline_sets), build=build, fill=add_docs)
    return values


def printable_pipeline(config: PipelineConfig) -> dict[str, Any]:
    """The resolved pipeline as ``--print-config`` prints it: the non-empty sections, plus every key that
    :data:`DEFAULT_PRESET` sets and this config leaves at its stage's default (written out with that default), so
    the output read back with ``--config`` (merged over the default preset) or with ``--preset FILE.json`` resolves
    to the same config. A pipeline without a ``generate`` section cannot mask the default preset's one this way:
    read such a printout back with ``--preset FILE.json``."""
    data = {k: copy.deepcopy(v) for k, v in config.to_dict().items() if k != "workdir" and (v or k == "target")}
    for section, base in load_preset(DEFAULT_PRESET).items():
        if section not in SECTIONS or not isinstance(base, dict) or section not in data:
            continue
        values = data[section]
        chosen = {key for group in EXCLUSIVE_SETTINGS for key in group if values.get(key) is not None}
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section].config)}
        for key, base_value in base.items():
            if any(key in group and chosen & set(group) for group in EXCLUSIVE_SETTINGS):
                continue  # the chosen member of its group replaces it when read back
            if key not in fields:
                continue
            default = field_default(fields[key])
            if key not in values:
                values[key] = plain_value(default)
            if isinstance(base_value, dict) and isinstance(values[key], dict):
                for sub in base_value:  # nested settings (generate.default_prompts) merge field by field too
                    values[key].setdefault(sub, (plain_value(default) or {}).get(sub))
    return data


def _check_init_target_layers(config: TrainConfig, target_path: Path) -> None:
    """``drafter.init_target_layers`` within the target's depth, checked before generate/extract run (train would
    refuse it only after them). Skipped when the depth cannot be read without loading the target."""
    layers = config.drafter.init_target_layers
    if not layers:
        return
    depth = target_num_layers(target_path)
    if depth is None:
        return
    bad = [i for i in layers if not 0 <= i < depth]
    if bad:
        raise ConfigError(f"drafter.init_target_layers: {bad} out of range: the target ({target_path.name}) has "
                          f"layers 0..{depth - 1}")


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _output_settings(stage: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that decide what ``stage`` writes, by dotted path: ``settings`` over its config's defaults (a
    setting given at its default value is the setting left out), without the fields declared ``runtime``
    (``stages.config.check.runtime_paths``: progress, logging, locks...), which a rerun in the same work folder may
    change."""
    config = SECTIONS[stage].config if stage in SECTIONS else None
    ignored = runtime_paths(config) if config is not None else frozenset()
    values = {**(default_paths(config) if config is not None else {}), **leaf_paths(settings)}
    return {path: value for path, value in values.items() if path not in ignored}


def _output_digest(stage: str, settings: Mapping[str, Any]) -> str:
    """The digest of :func:`_output_settings`."""
    return _digest(_output_settings(stage, settings))


def _settings_changes(stage: str, before: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """The output-deciding settings that differ, one ``stage.path: old -> new`` each (``(default)`` after a value
    the side did not set, ``(not set)`` where it has none)."""
    old, new = _output_settings(stage, before), _output_settings(stage, now)

    def shown(values: dict[str, Any], path: str, given: Mapping[str, Any]) -> str:
        if path not in values:
            return "(not set)"
        return json.dumps(values[path], default=str) + ("" if path in leaf_paths(given) else " (default)")

    return ", ".join(f"{stage}.{path}: {shown(old, path, before)} -> {shown(new, path, now)}"
                     for path in sorted(set(old) | set(new)) if old.get(path, _UNSET) != new.get(path, _UNSET))


class _State:
    """``WORKDIR/pipeline.json``: per-stage config digests, completion and timings (rewritten atomically)."""

    def __init__(self, workdir: Path, config: PipelineConfig) -> None:
        self.path = workdir / _STATE_FILE
        self.data: dict[str, Any] = load_json(self.path, error=ConfigError, fix=f"remove it to rerun every stage of "
                                              f"{workdir}") if os.path.lexists(self.path) else {}
        self.data["config"] = config.to_dict()
        self.data.setdefault("stages", {})

    def check(self, stage: str, settings: dict[str, Any], output: Path | None = None) -> bool:
        """True when ``stage`` completed with these settings; raises when it ran with other ones and left something
        in ``output`` (its folder). Settings declared ``runtime`` may differ (:func:`_output_digest`). A stage that
        failed before writing anything there (e.g. extract refused by its disk-space check) is forgotten, so the
        same command with a corrected setting runs it."""
        record = self.data["stages"].get(stage)
        if record is None:
            return False
        changed = _output_digest(stage, record["settings"]) != _output_digest(stage, settings)
        if (not record.get("done") and output is not None and changed
                and not (output.exists() and (not output.is_dir() or any(output.iterdir())))):
            del self.data["stages"][stage]
            return False
        if changed:
            raise ConfigError(
                f"{stage}: {self.path.parent} holds outputs of this stage made with other settings "
                f"({_settings_changes(stage, record['settings'], settings)}); use a new --workdir, or the "
                "settings it was made with"
            )
        return bool(record.get("done"))

    def start(self, stage: str, settings: dict[str, Any]) -> None:
        self.data["stages"].setdefault(stage, {"digest": _digest(settings), "settings": settings, "done": False})
        self.save()

    def finish(self, stage: str, seconds: float, result: dict[str, Any] | None = None) -> None:
        record = self.data["stages"][stage]
        record.update(done=True, seconds=record.get("seconds", 0.0) + seconds, result=result)
        self.save()

    def save(self) -> None:
        from stages.evaluate import write_json_atomic

        write_json_atomic(self.path, self.data)


def _split_corpus(source: Path, train_out: Path, heldout_out: Path, *, heldout_documents: int, seed: int) -> dict[str, Any]:
    """Write the training and held-out corpora of ``source`` by document (``dflash.corpus.split``)."""
    import os

    from dflash.corpus.format import CorpusWriter, open_corpus
    from dflash.corpus.split import heldout_count, row_documents, split_corpus

    corpus = open_corpus(source)
    corpus.check_fingerprint()  # its fingerprint is recorded as the split's source
    heldout_count(len(set(row_documents(corpus))), heldout_documents, where=f"the corpus {source}",
                  setting="split.heldout_documents")
    with CorpusWriter(train_out, overwrite=True) as train, CorpusWriter(heldout_out, overwrite=True) as heldout:
        return split_corpus(corpus, train, heldout, heldout_documents=heldout_documents, seed=seed,
                            heldout_path=os.path.relpath(heldout_out, train_out))


def _latest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    from dflash.training.checkpoint import read_trainer_state, resolve_checkpoint

    if not (run_dir / "latest").is_file():
        return None
    folder = resolve_checkpoint(run_dir)
    return folder, read_trainer_state(folder)


class _DropTrainerExclusionLog(logging.Filter):
    """Drops the trainer's "excluded N of M samples ..." log record: the trainer also prints the same counts to the
    console right after (with the length-bucket table), so the pipeline's output states the fact once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("excluded ")


@contextmanager
def _excluded_samples_reported_once() -> Iterator[None]:
    trainer_log = logging.getLogger("stages.train.loop")
    drop = _DropTrainerExclusionLog()
    trainer_log.addFilter(drop)
    try:
        yield
    finally:
        trainer_log.removeFilter(drop)


def run_pipeline(config: PipelineConfig, *, console: Console | None = None,
                 prompt_processes: int | None = 1) -> dict[str, Any]:  # fmt: skip
    """Run (or resume) the pipeline ``config`` (from :func:`resolve_pipeline`, which checked every section); returns
    the final evaluation report (``tau`` and the rest).

    ``prompt_processes``: as :func:`stages.generate.run_generate` (1 by default; the CLI passes ``None``).

    Raises:
        ConfigError: a stage's settings changed in an existing work folder; any stage's own errors.
        LockError: another pipeline runs in the same work folder (``dflash.io.locks``; each stage also locks its own
            output inside it).
    """
    with output_lock(config.workdir, what="pipeline work folder"), _excluded_samples_reported_once():
        return _run_stages(config, console=console, prompt_processes=prompt_processes)


def _run_stages(config: PipelineConfig, *, console: Console | None = None,
                prompt_processes: int | None = 1) -> dict[str, Any]:  # fmt: skip
    from pipelines.online import ONLINE_CACHE_PREFIX, OnlineConfig, planned_online_steps, run_online
    from stages.evaluate import EvaluateConfig, Evaluator, write_json_atomic
    from stages.extract.command import ExtractConfig, run_extract
    from stages.prepare import PrepareConfig, run_prepare
    from stages.train.config import TrainConfig
    from stages.train.data import planned_total_steps
    from stages.train.launch import run_training

    console = console or Console()
    workdir = config.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    state = _State(workdir, config)
    paths = {name: workdir / name for name in ("corpus-all", "corpus", "heldout", "cache", "run", "eval")}
    # The stage that trains: ``train`` on extract's cache, or ``online`` (producers feed the trainer live). Both
    # write WORKDIR/run, so a work folder trained one way is refused the other way.
    training = "online" if config.online else "train"
    if config.online and {"extract", "train"} & set(state.data["stages"]):
        raise ConfigError(f"online: {workdir} holds a drafter trained from extract's cache; the online section trains "
                          "without one into the same run folder: use a new --workdir")
    if not config.online and "online" in state.data["stages"]:
        raise ConfigError(f"online: {workdir} holds a drafter trained online (no cache); without the online section "
                          "the pipeline would extract and train into the same run folder: give the same online "
                          "section, or use a new --workdir")
    heldout_prompts: Path | None = None
    primary_name: str | None = None  # the first prompt set's name in reports (None: the evaluate stage's default)

    def stage(name: str, settings: dict[str, Any], work, **skip_info: Any) -> None:
        if state.check(name, settings, paths[_STAGE_OUTPUT[name]]):
            console.rule(f"[dim]{name}: complete, skipped")
            return
        console.rule(f"[bold]{name}")
        state.start(name, settings)
        started = time.perf_counter()
        result = work()
        state.finish(name, time.perf_counter() - started, result)
        console.print(f"{name} took {time.perf_counter() - started:.1f} s")

    if config.generate:
        from stages.generate import HELDOUT_PROMPTS_FILE, GenerateConfig, run_generate

        generate = config.section("generate")
        stage("generate", generate, lambda: _json_safe(run_generate(
            GenerateConfig(output=str(paths["corpus"]), **generate), console=console,
            prompt_processes=prompt_processes)))
        heldout_prompts = Path(config.evaluate.get("prompts") or paths["corpus"] / HELDOUT_PROMPTS_FILE)
        if not config.evaluate.get("prompts") and generate.get("prompts", "default") == "default":
            primary_name = "held-out stdlib files"
    else:
        prepare = config.section("prepare")

        def prepare_work() -> dict[str, Any]:
            # The split stage holds documents out (split.heldout_documents); prepare writes every row.
            output, report = run_prepare(PrepareConfig(output=paths["corpus-all"], overwrite=True, heldout_documents=0,
                                                       **prepare),
                                         console=console)
            console.print(report.table())
            return {"corpus": str(output), "samples": report.samples_kept, "tokens": report.tokens_kept}

        stage("prepare", prepare, prepare_work)
        split = {"seed": 0, **config.split}

        def split_work() -> dict[str, Any]:
            counts = _split_corpus(paths["corpus-all"], paths["corpus"], paths["heldout"], **split)
            console.print(f"held out {counts['heldout_documents']} documents ({counts['heldout_rows']} rows, "
                          f"{counts['heldout_tokens']:,} tokens) for evaluation; training split: "
                          f"{counts['train_documents']} documents ({counts['train_rows']} rows, "
                          f"{counts['train_tokens']:,} tokens)")
            return counts

        stage("split", split, split_work)
        if config.evaluate.get("prompts"):  # a prompts file given: evaluate on it, not on the held-out rows
            heldout_prompts = Path(config.evaluate["prompts"])
    if not config.online:
        extract = config.section("extract")
        stage("extract", extract, lambda: _json_safe(run_extract(
            ExtractConfig(corpus=str(paths["corpus"]), output=str(paths["cache"]), **extract), console=console)))

    train = deep_merge({"telemetry": {"progress": True}}, config.section("train"))
    evaluate = {"seed": 0, **config.evaluate}
    evaluate.pop("prompts", None)  # where the prompts come from is decided above
    per_epoch = bool(evaluate.pop("per_epoch", EVALUATE_EXTRAS["per_epoch"]))
    # Per-epoch evaluations before the last measure tau, acceptance and the teacher-forced lossless check only,
    # unless per_epoch_references: the two
    # references (block size 1, generate()) are ~2/3 of an evaluation and are re-run in every new process (each
    # call of a job-time-limited host), while the final drafter's report carries the speedups and lossless checks.
    per_epoch_references = bool(evaluate.pop("per_epoch_references", EVALUATE_EXTRAS["per_epoch_references"]))
    compare_untrained = bool(evaluate.pop("compare_untrained", EVALUATE_EXTRAS["compare_untrained"]))
    # The epochs before the last may measure tau on the first prompts of the first set only (each such evaluation
    # costs in proportion); the last epoch, the final drafter, is measured on every prompt of every set.
    per_epoch_num_prompts = evaluate.pop("per_epoch_num_prompts", EVALUATE_EXTRAS["per_epoch_num_prompts"])

    def train_config(**changes: Any) -> TrainConfig:
        return TrainConfig.from_dict(deep_merge({**train, "cache": str(paths["cache"]), "output": str(paths["run"])},
                                                changes))

    def online_config(**changes: Any) -> OnlineConfig:
        corpus = str(paths["corpus"].resolve())  # saved in run.json: absolute, as the online command saves it
        return OnlineConfig(corpus=corpus, target=config.target, **config.online,
                            train=train_config(cache=f"{ONLINE_CACHE_PREFIX}{corpus}", **changes))

    def train_segment(**changes: Any) -> dict[str, Any]:
        """Train (or resume) to the end of the schedule or to ``stop_at_step``: from the cache, or online."""
        if config.online:
            return run_online(online_config(**changes))
        return run_training(train_config(**changes))

    def planned_steps() -> int:
        """The schedule length a new run gets, from the sample lengths alone (the cache's, or the corpus's)."""
        return planned_online_steps(online_config()) if config.online else planned_total_steps(train_config())

    # What the training stage's record in pipeline.json is checked against: with online, the producers too.
    training_settings = {"online": config.online, "train": train} if config.online else train

    evaluator: Evaluator | None = None

    def get_evaluator() -> Evaluator:
        nonlocal evaluator
        if evaluator is None:
            if heldout_prompts is not None:  # the prompt set's held-out prompts (unseen documents), or evaluate.prompts
                settings = EvaluateConfig(drafter=paths["run"], target=config.target, prompts=str(heldout_prompts),
                                          **evaluate)
            else:
                settings = EvaluateConfig(drafter=paths["run"], target=config.target, prompts="held-out",
                                          corpus=paths["heldout"], **evaluate)
            evaluator = Evaluator(settings, config.target, console=console, primary_name=primary_name)
        return evaluator

    def evaluate_checkpoint(folder: Path, json_path: Path, label: str, *, untrained: bool = False,
                            compare_untrained: bool = False, references: bool | None = None,
                            all_sets: bool = True, num_prompts: int | None = None) -> dict[str, Any]:
        ev = get_evaluator()
        source = drafter_source(folder)  # the checkpoint read, resolved once
        drafter, drafter_config, _ = ev.load_drafter(source)
        if untrained:
            drafter = ev.untrained(drafter_config)
        return ev.evaluate(drafter, drafter_config, label=label, json_path=json_path, compare_untrained=compare_untrained,
                           references=references, all_sets=all_sets, num_prompts=num_prompts,
                           source=None if untrained else source)

    epoch_taus: list[dict[str, Any]] = list(state.data.get("epochs", []))

    def record_epoch(entry: dict[str, Any], report: dict[str, Any]) -> None:
        epoch_taus.append(entry)
        epoch_taus.sort(key=lambda e: e["epoch"])  # the untrained drafter (epoch 0) is measured after epoch 1 trains
        state.data["epochs"] = epoch_taus
        state.save()
        where = f"step {entry['step']}"
        if entry.get("data_epoch") is not None and "max_steps" in train:  # the points are not epoch ends
            where += f", {entry['steps_fraction']:.0%} of the steps, data cursor in epoch {entry['data_epoch']}"
        others = "".join(f"; {other['tau']:.3f} on {other['count']} {other['name']} prompts"
                         for other in report.get("prompt_sets", [])[1:])
        console.print(f"[bold]epoch {entry['epoch']}: tau = {entry['tau']:.3f}[/] on {report['prompts']['count']} "
                      f"held-out prompts{others} ({where})")

    done_epochs = {entry["epoch"] for entry in epoch_taus}
    if per_epoch and not state.check(training, training_settings, paths["run"]):
        console.rule(f"[bold]{training} (epoch by epoch, tau on held-out prompts after each epoch)")
        state.start(training, training_settings)
        started = time.perf_counter()
        # The schedule's length places the epoch ends: a run under way has it in its checkpoints; a new one plans it
        # from the sample lengths as the trainer will (checked against the trainer's after the first segment).
        latest = _latest_checkpoint(paths["run"])
        total_steps = int(latest[1]["total_steps"]) if latest is not None else planned_steps()
        epochs = float(train.get("epochs", 6.0))
        for epoch in range(1, math.ceil(epochs) + 1):
            # At least step 1: a schedule shorter than half the epochs still trains before its first evaluation.
            stop = total_steps if epoch >= epochs else min(total_steps, max(1, round(epoch * total_steps / epochs)))
            latest = _latest_checkpoint(paths["run"])
            if latest is None or int(latest[1]["step"]) < stop:
                _stop_if_interrupted(train_segment(resume=latest is not None,
                                                   stop_at_step=None if stop == total_steps else stop))
                scheduled = int(_latest_checkpoint(paths["run"])[1]["total_steps"])
                if scheduled != total_steps:  # not expected: the plan is the trainer's own computation
                    log.warning("the trainer scheduled %d steps where %d were planned; epoch ends follow the trainer's",
                                scheduled, total_steps)
                    total_steps = scheduled
            if compare_untrained and 0 not in done_epochs:  # needs a checkpoint for the drafter's config, not weights
                report = evaluate_checkpoint(_latest_checkpoint(paths["run"])[0], paths["eval"] / "epoch_0.json",
                                             "untrained drafter (epoch 0)", untrained=True,
                                             references=None if per_epoch_references else False, all_sets=False,
                                             num_prompts=per_epoch_num_prompts)
                record_epoch({"epoch": 0, "step": 0, "tau": report["tau"], "speedup": report["speedup"]}, report)
                done_epochs.add(0)
            if epoch in done_epochs:
                continue
            folder, trainer_state = _latest_checkpoint(paths["run"])
            # With train.max_steps the schedule is not whole epochs: the points are at equal fractions of the steps,
            # and the data cursor says which pass over the corpus each one fell in.
            cursor = trainer_state.get("data") or {}
            label = f"epoch {epoch}" if "max_steps" not in train else f"point {epoch} of {math.ceil(epochs)}"
            last = int(trainer_state["step"]) >= total_steps
            # The learning curve is the first prompt set's; the final drafter (last) is measured on every set.
            report = evaluate_checkpoint(folder, paths["eval"] / f"epoch_{epoch}.json", f"{label} ({folder.name})",
                                         references=None if per_epoch_references or last else False, all_sets=last,
                                         num_prompts=None if last else per_epoch_num_prompts)
            record_epoch({"epoch": epoch, "step": int(trainer_state["step"]), "tau": report["tau"],
                          "speedup": report["speedup"], "checkpoint": str(folder),
                          "data_epoch": cursor.get("epoch"), "steps_fraction": stop / total_steps}, report)
        state.finish(training, time.perf_counter() - started, {"total_steps": total_steps})
    else:
        def train_work() -> dict[str, Any]:
            resume = _latest_checkpoint(paths["run"]) is not None
            return _json_safe(_stop_if_interrupted(train_segment(resume=resume)))

        stage(training, training_settings, train_work)

    final_path = paths["eval"] / "final.json"
    final_untrained = compare_untrained and not per_epoch
    def final_work() -> dict[str, Any]:
        report = None
        if per_epoch and epoch_taus and epoch_taus[-1]["step"] == int(_latest_checkpoint(paths["run"])[1]["step"]):
            last = load_json(paths["eval"] / f"epoch_{epoch_taus[-1]['epoch']}.json", error=ConfigError, fix=_EVAL_FIX)
            # The last epoch's report measured the final drafter; reused when it ran the references the final
            # evaluation would run (reports written before the setting existed always ran them), on every set.
            extra = [entry.get("spec") for entry in last.get("prompt_sets", [{}])[1:]]
            if (last["settings"].get("references", True) == evaluate.get("references", True)
                    and extra == list(evaluate.get("extra_prompts", []))):
                report = last
                write_json_atomic(final_path, report)
        if report is None:
            report = evaluate_checkpoint(_latest_checkpoint(paths["run"])[0], final_path, "final drafter",
                                         compare_untrained=final_untrained)
        return {"tau": report["tau"], "prompt_sets": {entry["name"]: entry["tau"]
                                                      for entry in report.get("prompt_sets", [])}}

    stage("evaluate", {**evaluate, "compare_untrained": final_untrained}, final_work)
    report = load_json(final_path, error=ConfigError, fix=_EVAL_FIX)
    state.data["tau"] = report["tau"]
    state.save()
    return {**report, "epochs": epoch_taus, "stage_seconds": {
        name: record.get("seconds") for name, record in state.data["stages"].items()}}


def _stop_if_interrupted(summary: dict[str, Any]) -> dict[str, Any]:
    """End the pipeline with exit status 130 when training stopped on SIGTERM or a first Ctrl-C (its checkpoint is
    saved): no evaluation of a half-trained drafter, and to a scheduler the run is not finished. Rerunning the same
    ``dflash-stages run`` command continues from the checkpoint (finished stages are skipped)."""
    if summary.get("stopped_by_signal"):
        from stages.config.exit_status import ExitCode

        Console(stderr=True).print(f"[bold yellow]interrupted[/] during training at step {summary.get('step')}; the "
                                   "checkpoint is saved. Rerun the same command to continue.")
        raise typer.Exit(ExitCode.INTERRUPTED)
    return summary


def _json_safe(data: Any) -> Any:
    return json.loads(json.dumps(data, default=str))


def print_summary(report: dict[str, Any], console: Console) -> None:
    """Stage timings, tau per epoch, and the final evaluation tables."""
    from stages.evaluate import print_report

    timings = Table(title="pipeline stages")
    timings.add_column("stage")
    timings.add_column("seconds", justify="right")
    for name, seconds in report["stage_seconds"].items():
        timings.add_row(name, "-" if seconds is None else f"{seconds:.1f}")
    console.print(timings)
    if report["epochs"]:
        epochs = Table(title="tau on held-out prompts after each epoch")
        epochs.add_column("epoch", justify="right")
        epochs.add_column("step", justify="right")
        epochs.add_column("tau", justify="right")
        for entry in report["epochs"]:
            epochs.add_row(str(entry["epoch"]), str(entry["step"]), f"{entry['tau']:.3f}")
        console.print(epochs)
    print_report(report, console)


def register(app: typer.Typer) -> None:
    """Add ``dflash-stages run``."""

    @app.command("run")
    def run_command(
        preset: str = typer.Option(DEFAULT_PRESET, "--preset", help=f"One of {', '.join(PRESETS)}, or a preset .json file."),
        workdir: Path = typer.Option(Path("dflash-work"), "--workdir", help="Work folder of every stage (resumable)."),
        overrides: list[str] = typer.Option([], "--set", help="Override a preset field: section.field=value (repeatable; value parsed as JSON, else a string). Every setting is checked before the first stage runs; a section the preset does not run (prepare or split beside generate, generate beside prepare, extract beside online, online without an online section) is refused."),
        docs: list[Path] = typer.Option([], "--docs", help="Extra text folders for the corpus, e.g. the Python docs' reST sources."),
        target: str | None = typer.Option(None, "--target", help="Target spec (default: the preset's, 'default' = SmolLM2)."),
        config_file: str | None = typer.Option(None, "--config", help="Sections (generate, prepare, split, extract, online, train, evaluate; target) in a .toml, .yaml or .json file, merged field by field over the preset; --target, --docs and --set go over it."),
        print_config: bool = typer.Option(False, "--print-config", help="Check and print the resolved pipeline config (JSON; --preset FILE.json or --config reads it back) and exit; nothing runs."),
    ) -> None:
        """The main job: generate (or prepare + split) -> extract -> train -> evaluate on a preset; ends by printing tau.

        With an online section (presets cpu-online, h200-smollm2-online) training reads hidden states computed live
        instead of extract's cache: no cache on disk, the same batches.
        """
        console = Console()
        config = resolve_pipeline(workdir=workdir, preset=preset, config_file=config_file, overrides=overrides,
                                  target=target, docs=docs)
        if print_config:
            print(json.dumps(printable_pipeline(config), indent=2))
            raise typer.Exit(0)

        from stages.evaluate import tau_line

        console.print(f"preset {preset} -> {workdir}")
        started = time.perf_counter()
        report = run_pipeline(config, console=console, prompt_processes=None)  # under __main__
        print_summary(report, console)
        console.print(f"pipeline finished in {time.perf_counter() - started:.1f} s; results in {workdir}")
        counts = " + ".join(str(entry["count"]) for entry in report.get("prompt_sets") or [report["prompts"]])
        console.print(f"[bold]{tau_line(report)}[/] (mean acceptance length, block size "  # one line in a log too
                      f"{report['acceptance']['block_size']}, {counts} held-out prompts)", soft_wrap=True)
