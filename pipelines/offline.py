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
error naming the stage (use another ``--workdir``), since its outputs would no longer match the settings.

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
tau and acceptance only (``evaluate.per_epoch_references`` also runs the speedup references and lossless checks at
each), on the first ``evaluate.per_epoch_num_prompts`` prompts when set, the last one and ``eval/final.json``
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
from collections.abc import Callable, Iterator
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
from dflash.target.load import locate_target, target_num_layers
from stages.config.check import (
    EXCLUSIVE_SETTINGS,
    check_fields,
    deep_merge,
    field_default,
    layer_over,
)
from stages.config.presets import PIPELINE_SECTIONS, PRESETS, load_preset, strip_comments
from stages.config.resolve import layer_sets, parse_sets, plain_value

if TYPE_CHECKING:
    from stages.evaluate import Evaluator

log = logging.getLogger(__name__)

__all__ = ["apply_overrides", "PipelineConfig", "run_pipeline", "register",
           "validate_sections"]

#: The fix named when an evaluation report of the work folder cannot be read.
_EVAL_FIX = "the evaluation report is damaged: remove it and rerun the same command (that evaluation runs again)"

#: The work-folder entry (``paths`` of ``_run_stages``) each stage writes.
_STAGE_OUTPUT = {"generate": "corpus", "prepare": "corpus-all", "split": "corpus", "extract": "cache", "train": "run",
                 "online": "run", "evaluate": "eval"}
_STATE_FILE = "pipeline.json"


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides (value parsed as JSON, else kept as a string).

    Raises:
        ConfigError: an override without ``=`` or without a ``section.`` prefix, or an unknown section.
    """
    result = copy.deepcopy(config)
    for override in overrides:
        key, sep, _ = override.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(f"--set {override!r}: expected section.field=value, e.g. train.optim.lr=3e-4")
        if section not in PIPELINE_SECTIONS:
            raise ConfigError(f"--set {override!r}: unknown section {section!r}; expected one of {list(PIPELINE_SECTIONS)}")
        layer_sets(result.setdefault(section, {}), parse_sets([override], section))  # as every stage applies it
    return result


def stages_run(config: dict[str, Any]) -> list[str]:
    """The stage sections a pipeline config runs: with a ``generate`` section the corpus is the target's own
    responses and ``prepare`` and ``split`` are not run; without one, ``generate`` is not run. With an ``online``
    section the training reads hidden states computed live (``online`` and ``train``) and ``extract`` is not run."""
    first = ["generate"] if config.get("generate") else ["prepare", "split"]
    middle = ["online"] if config.get("online") else ["extract"]
    return [*first, *middle, "train", "evaluate"]


def _refuse_sections_not_run(config: dict[str, Any], overrides: list[str], preset: str) -> None:
    """Refuse a ``--set`` for a section the preset does not run, which would otherwise be silently dropped (or,
    for ``generate``, would silently replace the preset's prepare and split).

    Raises:
        ConfigError: naming the override, its section and the stages the preset runs.
    """
    run = stages_run(config)
    for override in overrides:
        section = override.partition("=")[0].strip().partition(".")[0]
        if section in PIPELINE_SECTIONS and section not in run:
            article = "an" if section[0] in "aeiou" else "a"
            raise ConfigError(f"--set {override!r}: preset {preset} runs no {section} stage (it runs "
                              f"{', '.join(run)}); drop it, or use a preset with {article} {section} section")


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """The resolved pipeline: one dict of stage settings per stage (the stage configs validate the fields).

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
        # With an online section extract does not run: its producers tap one layer per draft layer themselves
        # (pipelines.online.online_metadata) unless online.target_layer_ids names the layers.
        if not self.online and self.extract.get("num_taps") is None and self.extract.get("target_layer_ids") is None:
            # One tap per draft layer (dflash.target.taps): the cache holds the layers the trained drafter reads.
            drafter = self.train.get("drafter") if isinstance(self.train.get("drafter"), dict) else {}
            self.extract["num_taps"] = drafter.get("num_draft_layers", DEFAULT_NUM_DRAFT_LAYERS)
        drafter = self.train.get("drafter") if isinstance(self.train.get("drafter"), dict) else {}
        if not self.online and drafter.get("distill", "none") != "none" and self.extract.get("final_tap") is None:
            # A distilling drafter reads the target's final normed hidden state, so the cache stores it.
            self.extract["final_tap"] = True
        held = self.split.get("heldout_documents", 0)
        if not self.generate and (not isinstance(held, int) or held < 1):
            raise ConfigError(f"split.heldout_documents must be a positive integer, got {held!r}")
        if self.generate and self.generate.get("prompts", "default") != "default" and "prompts" not in self.evaluate:
            raise ConfigError(
                f"evaluate.prompts: generate.prompts is {self.generate['prompts']!r}, which has no held-out split; "
                "give evaluate.prompts (a .jsonl/.txt file of prompts training never saw)"
            )

    @classmethod
    def from_preset(cls, preset: dict[str, Any], *, workdir: Path) -> PipelineConfig:
        return cls(workdir=workdir, **preset)

    def section(self, name: str) -> dict[str, Any]:
        return {"target": self.target, **getattr(self, name)}

    def to_dict(self) -> dict[str, Any]:
        return {"workdir": str(self.workdir), "target": self.target,
                **{name: getattr(self, name) for name in PIPELINE_SECTIONS}}



def validate_sections(config: PipelineConfig, source: Callable[[str, str], str]) -> None:
    """Check every stage section before any stage runs: unknown keys (did-you-mean), wrong types, then each stage
    config's own checks (ranges, choices), as that stage will build it.

    Args:
        config: the resolved pipeline.
        source: ``(section, key)`` -> where the value came from, for the message (``"--set train.lr=abc"``).

    Raises:
        ConfigError: the first problem, naming ``section.key`` and its source.
        TargetError: ``config.target`` names no transformers folder or ``.gguf`` file.
    """
    from stages.evaluate import EvaluateConfig
    from stages.extract.command import ExtractConfig
    from stages.prepare import PrepareConfig
    from stages.train.config import TrainConfig

    placeholder = str(config.workdir / "validate")
    checks: list[tuple[str, type, set[str], dict[str, Any], dict[str, Any]]] = [
        ("extract", ExtractConfig, {"corpus", "output"}, {}, {"corpus": placeholder, "output": placeholder}),
        ("train", TrainConfig, {"cache", "output", "resume", "stop_at_step"}, {},
         {"cache": placeholder, "output": placeholder}),
    ]
    if config.online:  # no extract: the online section is checked below, with the trainer it feeds
        checks = [check for check in checks if check[0] != "extract"]
    if config.generate:
        from stages.generate import GenerateConfig

        checks.insert(0, ("generate", GenerateConfig, {"output"}, {}, {"output": placeholder}))
    else:
        checks.insert(0, ("prepare", PrepareConfig, {"output", "overwrite", "heldout_documents"}, {},
                          {"output": placeholder, "overwrite": True, "heldout_documents": 0}))
        for key, value in config.split.items():
            if key not in ("heldout_documents", "seed"):
                raise ConfigError(f"split.{key} ({source('split', key)}): unknown key; known: heldout_documents, seed")
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"split.{key} ({source('split', key)}): expected int, got {value!r}")

    target_path = locate_target(config.target)  # a wrong target path fails now, not when the first stage loads it
    _check_init_target_layers(config, target_path, source)
    evaluate_extra = {key: _EVALUATE_EXTRA_TYPES.get(key, type(value)) for key, value in EVALUATE_EXTRAS.items()}
    for section, cls, reserved, extra, paths in checks:
        values = getattr(config, section)
        check_fields(cls, values, section=section, source=lambda key, s=section: source(s, key),
                     reserved=reserved | {"target"}, extra=extra)
        _build_for_check(section, cls, {"target": config.target, **values, **paths}, source)
    if config.online:
        _check_online(config, placeholder, source)
    evaluate = {k: v for k, v in config.evaluate.items() if k not in evaluate_extra}
    check_fields(EvaluateConfig, config.evaluate, section="evaluate", source=lambda key: source("evaluate", key),
                 reserved={"drafter", "target", "corpus", "cache", "json"}, extra=evaluate_extra)
    _build_for_check("evaluate", EvaluateConfig, {"prompts": "held-out", **evaluate, "drafter": placeholder,
                                                  "target": config.target, "corpus": placeholder}, source)
    subset = config.evaluate.get("per_epoch_num_prompts")
    if subset is not None and subset < 1:
        raise ConfigError(f"evaluate.per_epoch_num_prompts ({source('evaluate', 'per_epoch_num_prompts')}): must be "
                          f">= 1 (or null: every prompt), got {subset}")


#: The preset ``run`` uses when none is given; ``run --config FILE`` is merged over it.
DEFAULT_PRESET = "cpu-small"

#: Keys of the ``evaluate`` section that the pipeline reads itself (not EvaluateConfig fields), with their defaults.
EVALUATE_EXTRAS = {"per_epoch": False, "per_epoch_references": False, "compare_untrained": False,
                   "per_epoch_num_prompts": None}

#: The annotations of :data:`EVALUATE_EXTRAS` whose default does not tell their type.
_EVALUATE_EXTRA_TYPES = {"per_epoch_num_prompts": int | None}


def printable_pipeline(config: PipelineConfig) -> dict[str, Any]:
    """The resolved pipeline as ``--print-config`` prints it: the non-empty sections, plus every key that
    :data:`DEFAULT_PRESET` sets and this config leaves at its stage's default (written out with that default), so
    the output read back with ``--config`` (merged over the default preset) or with ``--preset FILE.json`` resolves
    to the same config. A pipeline without a ``generate`` section cannot mask the default preset's one this way:
    read such a printout back with ``--preset FILE.json``."""
    from stages.evaluate import EvaluateConfig
    from stages.extract.command import ExtractConfig
    from stages.generate import GenerateConfig
    from stages.train.config import TrainConfig

    data = {k: copy.deepcopy(v) for k, v in config.to_dict().items() if k != "workdir" and (v or k == "target")}
    classes = {"generate": GenerateConfig, "extract": ExtractConfig, "train": TrainConfig, "evaluate": EvaluateConfig}

    for section, base in load_preset(DEFAULT_PRESET).items():
        if section not in classes or not isinstance(base, dict) or section not in data:
            continue
        values = data[section]
        chosen = {key for group in EXCLUSIVE_SETTINGS for key in group if values.get(key) is not None}
        fields = {f.name: f for f in dataclasses.fields(classes[section])}
        extras = EVALUATE_EXTRAS if section == "evaluate" else {}
        for key, base_value in base.items():
            if any(key in group and chosen & set(group) for group in EXCLUSIVE_SETTINGS):
                continue  # the chosen member of its group replaces it when read back
            if key in extras:
                default = extras[key]
            elif key in fields:
                default = field_default(fields[key])
            else:
                continue
            if key not in values:
                values[key] = plain_value(default)
            if isinstance(base_value, dict) and isinstance(values[key], dict):
                for sub in base_value:  # nested settings (generate.default_prompts) merge field by field too
                    values[key].setdefault(sub, (plain_value(default) or {}).get(sub))
    return data


def _check_init_target_layers(config: PipelineConfig, target_path: Path, source: Callable[[str, str], str]) -> None:
    """``train.drafter.init_target_layers`` within the target's depth, checked before generate/extract run (train
    would refuse it only after them). Skipped when the depth cannot be read without loading the target."""
    drafter = (config.train or {}).get("drafter") or {}
    layers = drafter.get("init_target_layers") if isinstance(drafter, dict) else None
    if not isinstance(layers, list) or not layers:
        return

    depth = target_num_layers(target_path)
    if depth is None:
        return
    bad = [i for i in layers if isinstance(i, int) and not 0 <= i < depth]
    if bad:
        raise ConfigError(f"train.drafter.init_target_layers ({source('train', 'drafter.init_target_layers')}): "
                          f"{bad} out of range: the target ({target_path.name}) has layers 0..{depth - 1}")


#: Fields of ``OnlineConfig`` that ``run`` sets itself: the corpus (``WORKDIR/corpus``), the target and the
#: trainer (the ``train`` section).
_ONLINE_SET_BY_PIPELINE = ("corpus", "target", "train")

#: Fields of ``OnlineConfig`` about writing a cache, which the online branch of ``run`` exists to avoid.
_ONLINE_CACHE_FIELDS = ("cache_to", "cache_shard_size")


def _check_online(config: PipelineConfig, placeholder: str, source: Callable[[str, str], str]) -> None:
    """The ``online`` section as ``OnlineConfig`` will be built from it (keys, types, then its own checks against
    the trainer of the ``train`` section)."""
    from pipelines.online import ONLINE_CACHE_PREFIX, OnlineConfig
    from stages.train.config import TrainConfig

    for key in _ONLINE_CACHE_FIELDS:
        if key in config.online:
            raise ConfigError(f"online.{key} ({source('online', key)}): run's online branch writes no hidden-state "
                              "cache; remove it (for a cache, drop the online section: extract then writes one)")
    check_fields(OnlineConfig, config.online, section="online", source=lambda key: source("online", key),
                 reserved=set(_ONLINE_SET_BY_PIPELINE))
    trainer = TrainConfig.from_dict({"target": config.target, **config.train,
                                     "cache": f"{ONLINE_CACHE_PREFIX}{placeholder}", "output": placeholder})
    _build_for_check("online", lambda **values: OnlineConfig(train=trainer, **values),
                     {"target": config.target, **config.online, "corpus": placeholder}, source)


def _build_for_check(section: str, cls: Callable[..., Any], values: dict[str, Any],
                     source: Callable[[str, str], str]) -> None:
    try:
        cls(**values)
    except (ConfigError, ValueError, TypeError) as error:
        message = str(error)
        from stages.config.check import leaf_paths
        from stages.config.resolve import without_key

        candidates = sorted({*values, *leaf_paths(values)}, key=len, reverse=True)  # optim.lr: a nested field
        key = next((k for k in candidates if message.startswith((k + " ", k + ":"))), None)

        where = f"{section}.{key} ({source(section, key)})" if key else f"{section} ({source(section, '')})"
        raise ConfigError(f"{where}: {without_key(message, key) if key else message}") from None


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
        in ``output`` (its folder). A stage that failed before writing anything there (e.g. extract refused by its
        disk-space check) is forgotten, so the same command with a corrected setting runs it."""
        record = self.data["stages"].get(stage)
        if record is None:
            return False
        if (not record.get("done") and output is not None and record["digest"] != _digest(settings)
                and not (output.exists() and (not output.is_dir() or any(output.iterdir())))):
            del self.data["stages"][stage]
            return False
        if record["digest"] != _digest(settings):
            raise ConfigError(
                f"{stage}: {self.path.parent} holds outputs of this stage made with other settings "
                f"({record['settings']} vs now {settings}); use a new --workdir"
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
                 source: Callable[[str, str], str] | None = None,
                 prompt_processes: int | None = 1) -> dict[str, Any]:  # fmt: skip
    """Run (or resume) the pipeline; returns the final evaluation report (``tau`` and the rest).

    ``prompt_processes``: as :func:`stages.generate.run_generate` (1 by default; the CLI passes ``None``).

    Raises:
        ConfigError: a setting fails :func:`validate_sections` (before any work); a stage's settings changed in an
            existing work folder; any stage's own errors.
        LockError: another pipeline runs in the same work folder (``dflash.io.locks``; each stage also locks its own
            output inside it).
    """
    # Before anything is written; ``source`` names where a setting came from (the CLI passes --set/preset).
    validate_sections(config, source or (lambda section, key: "pipeline config"))
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
    # Per-epoch evaluations before the last measure tau and acceptance only, unless per_epoch_references: the two
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
        drafter, drafter_config, _ = ev.load_drafter(folder)
        if untrained:
            drafter = ev.untrained(drafter_config)
        return ev.evaluate(drafter, drafter_config, label=label, json_path=json_path, compare_untrained=compare_untrained,
                           references=references, all_sets=all_sets, num_prompts=num_prompts)

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
        preset: str = typer.Option("cpu-small", "--preset", help=f"One of {', '.join(PRESETS)}, or a preset .json file."),
        workdir: Path = typer.Option(Path("dflash-work"), "--workdir", help="Work folder of every stage (resumable)."),
        overrides: list[str] = typer.Option([], "--set", help="Override a preset field: section.field=value (repeatable; value parsed as JSON, else a string). Every setting is checked before the first stage runs; a section the preset does not run (prepare or split beside generate, generate beside prepare, extract beside online, online without an online section) is refused."),
        docs: list[Path] = typer.Option([], "--docs", help="Extra text folders for the corpus, e.g. the Python docs' reST sources."),
        target: str | None = typer.Option(None, "--target", help="Target spec (default: the preset's, 'default' = SmolLM2)."),
        config_file: str | None = typer.Option(None, "--config", help="Sections (generate, prepare, split, extract, online, train, evaluate; target) in a .toml, .yaml or .json file, merged field by field over the preset, under --set."),
        print_config: bool = typer.Option(False, "--print-config", help="Check and print the resolved pipeline config (JSON; --preset FILE.json or --config reads it back) and exit; nothing runs."),
    ) -> None:
        """The main job: generate (or prepare + split) -> extract -> train -> evaluate on a preset; ends by printing tau.

        With an online section (presets cpu-online, h200-smollm2-online) training reads hidden states computed live
        instead of extract's cache: no cache on disk, the same batches.
        """
        console = Console()
        preset_config = load_preset(preset)
        from_file: set[tuple[str, str]] = set()
        if config_file is not None:
            from stages.config.check import read_config_file

            for section, values in strip_comments(read_config_file(config_file)).items():
                if section == "target":
                    preset_config["target"] = values
                    continue
                if section not in PIPELINE_SECTIONS or not isinstance(values, dict):
                    close = difflib.get_close_matches(section, PIPELINE_SECTIONS, n=1)
                    raise ConfigError(f"{section} (--config {config_file}): not a pipeline section; "
                                      + (f"did you mean {close[0]}?" if close else f"sections: {', '.join(PIPELINE_SECTIONS)}"))
                from stages.config.check import leaf_paths

                layer_over(preset_config.setdefault(section, {}), values)
                from_file.update((section, key) for key in {*values, *leaf_paths(values)})
        _refuse_sections_not_run(preset_config, overrides, preset)
        preset_config = apply_overrides(preset_config, overrides)
        if docs and preset_config.get("generate"):
            raise ConfigError(f"--docs adds text folders to prepare's inputs, but preset {preset} generates its corpus "
                              "(a generate section) and runs no prepare; drop --docs")
        if docs:
            preset_config.setdefault("prepare", {})
            preset_config["prepare"]["inputs"] = [*preset_config["prepare"].get("inputs", ["default"]),
                                                  *(str(d) for d in docs)]
        if target is not None:
            preset_config["target"] = target
        config = PipelineConfig.from_preset(preset_config, workdir=workdir)
        given = {}
        for override in overrides:
            key, _, _ = override.partition("=")
            section, _, name = key.strip().partition(".")
            given[(section, name)] = f"--set {override}"

        def source(section: str, key: str) -> str:
            if (section, key) in given:
                return given[(section, key)]
            if section == "prepare" and key == "inputs" and docs:
                return "--docs"
            if (section, key) in from_file or (section, key.split(".")[0]) in from_file:
                return f"--config {config_file}"
            return f"preset {preset}"

        if print_config:
            validate_sections(config, source)
            print(json.dumps(printable_pipeline(config), indent=2))
            raise typer.Exit(0)

        from stages.evaluate import tau_line

        console.print(f"preset {preset} -> {workdir}")
        started = time.perf_counter()
        report = run_pipeline(config, console=console, source=source, prompt_processes=None)  # under __main__
        print_summary(report, console)
        console.print(f"pipeline finished in {time.perf_counter() - started:.1f} s; results in {workdir}")
        counts = " + ".join(str(entry["count"]) for entry in report.get("prompt_sets") or [report["prompts"]])
        console.print(f"[bold]{tau_line(report)}[/] (mean acceptance length, block size "
                      f"{report['acceptance']['block_size']}, {counts} held-out prompts)")
