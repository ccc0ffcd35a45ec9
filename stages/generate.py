"""``dflash-stages generate``: prompts -> the target's own responses -> a contract-1 corpus (``loss_mask`` = 1 on
generated tokens only), resumable and exactly once.

Run::

    dflash-stages generate --output data/gen                                  # embedded default prompts (stdlib)
    dflash-stages generate chats.jsonl --turns all --output data/gen --target-gpus 0,1,2,3
    dflash-stages generate prompts.jsonl --output data/gen --target-processes 2       # CPU worker processes
    dflash-stages generate prompts.txt --engine openai --endpoint http://127.0.0.1:8000/v1 --output data/gen

Order of work: load the tokenizer and the target's identity (no weights), read the prompts (bad lines counted with
their reasons), check the chat template has a generation prompt, plan parts (``--part-size`` prompts each), open or
create the output (a rerun of the same command resumes: committed parts are skipped; other settings are refused),
then answer each pending part as one task: with ``--engine transformers`` (default) one target replica per GPU,
scheduled by Dask exactly as ``extract`` is (same worker lifecycle, ``--target-gpus``, ``--target-processes``,
``--scheduler-address``); with ``--engine openai`` the user's servers, from this process. When every part is
committed, ``corpus.json`` records the generation settings (engine, target identity, temperature, top-p, max tokens,
seed, template kwargs) and the counts; the folder is then a corpus ``extract`` reads.

With the default prompt set, the held-out prompts (documents training never sees) are written to
``OUTPUT/heldout_prompts.jsonl`` for ``evaluate --prompts``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dflash.errors import ConfigError, DFlashError
from dflash.generation.default_prompts import (
    DefaultPromptConfig,
    default_prompt_sets,
    describe_default_prompts,
    write_prompts_jsonl,
)
from dflash.generation.engine import SamplingSettings
from dflash.generation.parts import (
    HELDOUT_PROMPTS_FILE,
    PLAN_FILE,
    PartSpec,
    clear_uncommitted,
    committed_parts,
    generate_part,
    plan_parts,
    row_occupancy,
    summarize_parts,
)
from dflash.generation.prompts import (
    DropCounts,
    TurnMode,
    check_generation_prompt,
    check_prompt_file,
    read_prompt_file,
)
from dflash.io.files import DEFAULT_MAX_LINE_BYTES, atomic_write_text, load_json
from dflash.io.locks import output_lock
from dflash.progress import DEFAULT_PROGRESS_INTERVAL, LogProgress, check_progress_interval
from dflash.target.load import load_tokenizer, resolve_target_path, target_identity
from dflash.values import check_seed
from stages.config.check import nested_config
from stages.config.options import CommandSettings, config_options, setting
from stages.config.resolve import print_and_exit, resolve_stage_config
from stages.replicas.cluster import close_cluster, start_cluster, validate_placement
from stages.replicas.tasks import returns_user_errors, task_result

__all__ = ["GenerateConfig", "run_generate", "register", "HELDOUT_PROMPTS_FILE"]

log = logging.getLogger(__name__)

_PLUGIN_NAME = "dflash-generate-target"
EngineName = Literal["transformers", "openai"]


def _json_object(text: str) -> Any:
    """``--template-kwargs``'s JSON text as its value.

    Raises:
        ConfigError: text that is not JSON.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--template-kwargs is not valid JSON ({error.msg}): {text!r}") from None


@dataclass(kw_only=True, slots=True)
class GenerateConfig:
    """Everything ``generate`` needs; saved in ``generate.json`` and the corpus metadata. Each field's help is its one
    description (``--help``, docs/config-reference.md)."""

    prompts: str = setting("default", argument='PROMPTS', help='`default` (stdlib prompt set), or a chat/prompts file: .jsonl/.json/.parquet (messages, prompt or text per row) or .txt (a prompt per line).')
    output: str = setting(short='-o', help='Corpus folder to write (a rerun resumes). Required (here or in --config/--preset/--set).')
    target: str = setting("default", help='Target: `default`, a transformers folder or a .gguf file.')
    engine: EngineName = setting("transformers", help='transformers (the target on this node) or openai (--endpoint servers).')
    turns: TurnMode = setting("all", help='Chat inputs: all = regenerate every assistant turn in order; last = only the last.')
    chat_template: bool = setting(True, help='Send `prompt` fields through the chat template (else raw completion).')
    template_kwargs: dict[str, Any] = setting(default_factory=dict, parse=_json_object, help='Extra chat-template variables as JSON, e.g. \'{"enable_thinking": false}\'.')
    temperature: float = setting(0.0, help='0 = greedy.')
    top_p: float = setting(1.0, help='Nucleus mass when sampling.')
    max_new_tokens: int = setting(512, help='Most tokens per reply.')
    seed: int = setting(0, help='Sampling seed.')
    max_length: int = setting(2048, help='Most tokens per row (prompt + replies); longer prompts are dropped and counted.')
    max_prompts: int | None = setting(None, help='Only the first N prompts.')
    part_size: int = setting(1024, help='Prompts per committed part.')
    batch_size: int = setting(256, help='transformers engine: rows per generate() call.')
    prefill_tokens: int = setting(262_144, help='transformers engine: padded prompt tokens per call.')
    kv_cache: Literal["auto", "static", "dynamic"] = setting("auto", help='transformers engine: static (own decode loop over a static KV cache, CUDA graphs on CUDA), dynamic (transformers generate()), auto (static on CUDA, dynamic elsewhere).')
    continuous_batching: bool = setting(True, help="Static KV cache with the fused attention (CUDA with Triton; Llama, Mistral, Qwen2, Qwen3 targets): a row takes the next prompt as soon as its reply ends (continuous batching) instead of every batch running to its longest reply; each committed part's prompts stream through the batch's rows. False: batch after batch.")
    deterministic: bool = setting(False, help="Static KV cache: decode attention by grouped matmuls over the padded cache (bitwise repeatable, slower) instead of the default (CUDA with Triton: the ranged kernel, repeatable too; else SDPA's, whose bits may vary).")
    target_gpus: list[int] | None = setting(None, help='GPUs for target replicas, e.g. 0,1,2 (one Dask worker each).')
    target_processes: int | None = setting(None, help='CPU processes for target replicas (no GPU), one Dask worker each.')
    scheduler_address: str | None = setting(None, help='An existing Dask scheduler (tcp://host:8786).')
    dashboard_address: str = setting("127.0.0.1:0", runtime=True, help='Dask dashboard of a local cluster (localhost by default).')
    tls_ca_file: str | None = setting(None, help='TLS for --scheduler-address: the CA file (with --tls-cert, --tls-key).')
    tls_cert: str | None = setting(None, help='TLS client certificate for --scheduler-address.')
    tls_key: str | None = setting(None, help='TLS client key for --scheduler-address.')
    #: Settings of the embedded default prompt set (``prompts = "default"``): ``generate.default_prompts.FIELD``.
    default_prompts: DefaultPromptConfig = field(default_factory=DefaultPromptConfig)
    endpoints: list[str] = setting(default_factory=list, option='--endpoint', repeat=True, help='openai engine: base URL of a server, e.g. http://127.0.0.1:8000/v1 (repeatable).')
    served_model: str | None = setting(None, help='openai engine: model name on the servers (default: the only one served).')
    api_key_env: str | None = setting(None, help='openai engine: environment variable holding the API key.')
    concurrency: int = setting(8, help='openai engine: requests in flight per endpoint.')
    request_timeout_s: float = setting(120.0, help='openai engine: seconds one request may take, its whole reply included (then retried; a hung endpoint stalls the run about (max retries + 1) x this).')
    max_retries: int = setting(3, help='openai engine: retries after a connection error, timeout, HTTP 5xx/408/429 (0 = try once).')
    max_prompt_bytes: int = setting(DEFAULT_MAX_LINE_BYTES, help="Most bytes of one prompts-file line (or .parquet row's text); a longer one is an error.")
    overwrite: bool = setting(False, help='Replace an output generated with other settings.')
    break_lock: bool = setting(False, runtime=True, option='--break-lock', help="Take over OUTPUT's lock left by a run on another host known dead.")
    progress_interval: float = field(default=DEFAULT_PROGRESS_INTERVAL, metadata={"runtime": True,
        "help": "Seconds between two progress lines (prompts, tokens, rates, ETA) when output is not a terminal; 0: none."})

    def __post_init__(self) -> None:
        check_seed("seed", self.seed)
        check_progress_interval(self.progress_interval)
        self.default_prompts = nested_config(DefaultPromptConfig(), self.default_prompts, "default_prompts")
        check_seed("default_prompts.seed", self.default_prompts.seed)
        if self.prompts != "default":
            check_prompt_file(self.prompts)  # a wrong path fails here, before any work
        if self.engine not in ("transformers", "openai"):
            raise ConfigError(f"engine must be transformers or openai, got {self.engine!r}")
        if self.turns not in ("all", "last"):
            raise ConfigError(f"turns must be all or last, got {self.turns!r}")
        if self.max_length < 2:
            raise ConfigError(f"max_length must be >= 2, got {self.max_length}")
        if self.part_size < 1:
            raise ConfigError(f"part_size must be >= 1, got {self.part_size}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.prefill_tokens < 1:
            raise ConfigError(f"prefill_tokens must be >= 1, got {self.prefill_tokens}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ConfigError(f"max_prompts must be >= 1, got {self.max_prompts}")
        if self.max_prompt_bytes < 1:
            raise ConfigError(f"max_prompt_bytes must be >= 1, got {self.max_prompt_bytes}")

        validate_placement(self)
        if self.engine == "openai" and not self.endpoints:
            raise ConfigError("engine openai needs at least one --endpoint URL (e.g. http://127.0.0.1:8000/v1)")
        if self.engine == "openai":
            self.openai_config()  # validates endpoints, concurrency, request_timeout_s, max_retries
        if not isinstance(self.template_kwargs, dict):
            raise ConfigError(f"template_kwargs must be a JSON object, got {self.template_kwargs!r}")
        self.sampling()  # validates temperature, top_p, max_new_tokens

    def sampling(self) -> Any:
        return SamplingSettings(temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens,
                                seed=self.seed)

    def openai_config(self) -> Any:
        """The ``openai`` engine's settings (:class:`dflash.generation.openai_engine.OpenAIEngineConfig`)."""
        from dflash.generation.openai_engine import OpenAIEngineConfig

        return OpenAIEngineConfig(endpoints=list(self.endpoints), model=self.served_model,
                                  api_key_env=self.api_key_env, concurrency=self.concurrency,
                                  request_timeout_s=self.request_timeout_s, max_retries=self.max_retries)

    def to_dict(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.__slots__}
        data["default_prompts"] = self.default_prompts.to_dict()
        return data

    def plan_settings(self) -> dict[str, Any]:
        """What decides the output's content: a resume must match these (placement and batching excluded)."""
        data = self.to_dict()
        for key in ("output", "target_gpus", "target_processes", "scheduler_address", "dashboard_address", "tls_ca_file",
                    "tls_cert", "tls_key", "break_lock", "overwrite",
                    "batch_size", "prefill_tokens", "kv_cache", "continuous_batching", "deterministic", "concurrency", "endpoints", "api_key_env",
                    "request_timeout_s", "max_retries", "max_prompt_bytes", "progress_interval"):
            data.pop(key)
        return data


# ---------------------------------------------------------------------------------------------------- prompts
def _load_prompts(config: GenerateConfig,
                  processes: int | None = 1) -> tuple[list[Any], Any, dict[str, Any], list[Any] | None]:  # fmt: skip

    if config.prompts == "default":
        sets = default_prompt_sets(config.default_prompts, processes=processes)
        records, heldout = sets["train"], sets["heldout"]
        source = {**describe_default_prompts(config.default_prompts, sets), "heldout_prompts": len(sets["heldout"]),
                  "heldout_file": HELDOUT_PROMPTS_FILE}
        drops = DropCounts()
    else:
        records, drops = read_prompt_file(config.prompts, chat_template=config.chat_template, turns=config.turns,
                                          max_prompt_bytes=config.max_prompt_bytes)
        source = {"path": str(Path(config.prompts).resolve()), "sha256": _sha256(Path(config.prompts))}
        heldout = None
    if config.max_prompts is not None:
        records = records[: config.max_prompts]
    return records, drops, source, heldout


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()


def _records_digest(records: list[Any]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps(record.to_dict(), sort_keys=True).encode())
    return "sha256:" + digest.hexdigest()


# ---------------------------------------------------------------------------------------------------- output
def _existing_plan(output: Path) -> dict[str, Any] | None:
    """The plan of an existing generate output, None where there is none; refuses a folder of other files."""
    plan_file = output / PLAN_FILE
    if plan_file.is_file():
        existing = load_json(plan_file, error=ConfigError, fix=f"the plan of {output} is damaged: generate into a "
                             "new --output, or pass --overwrite to start this one again")
        if not isinstance(existing.get("settings"), dict):
            raise ConfigError(f"{plan_file}: no settings object; generate into a new --output, or pass --overwrite")
        return existing
    if output.is_dir() and any(p.name != HELDOUT_PROMPTS_FILE for p in output.iterdir()):
        raise ConfigError(f"--output {output} exists and is not a generate output; pass a new or empty folder")
    return None


def _refuse_other_settings(output: Path, existing: dict[str, Any], settings: dict[str, Any]) -> None:
    changed = sorted(k for k in set(existing["settings"]) | set(settings) if existing["settings"].get(k) != settings.get(k))
    raise ConfigError(
        f"{output} holds a generate run with other settings or prompts (differs in: "
        f"{', '.join(changed) or 'the prompts'}); rerun with the same settings to resume, or pass "
        "--overwrite to start over, or another --output"
    )


def _check_output_settings(config: GenerateConfig) -> None:
    """What can be told of the output before any work: a folder of other files, or (without --overwrite) a
    generate output of other settings. Its prompts and target are compared once they are read (:func:`_open_output`)."""
    output = Path(config.output)
    existing = _existing_plan(output)
    settings = json.loads(json.dumps(config.plan_settings()))  # as the plan file holds them
    if existing is not None and not config.overwrite and existing["settings"] != settings:
        _refuse_other_settings(output, existing, settings)


def _open_output(config: GenerateConfig, plan: dict[str, Any]) -> None:
    """Create the output folder with its plan, or check an existing one holds the same plan."""
    output = Path(config.output)  # run_generate refused an output that is a file before taking the lock
    plan_file = output / PLAN_FILE
    existing = _existing_plan(output)
    if existing is not None and existing.get("plan_digest") != plan["plan_digest"]:
        if not config.overwrite:
            _refuse_other_settings(output, existing, plan["settings"])
        _clear_output(output)
    output.mkdir(parents=True, exist_ok=True)
    removed = clear_uncommitted(output)
    if removed:
        log.info("removed %d unfinished part file(s) of a killed run", removed)
    if not plan_file.is_file():
        atomic_write_text(plan_file, json.dumps(plan, indent=2))


def _clear_output(output: Path) -> None:
    from dflash.corpus.format import METADATA_FILE

    for path in [*output.glob("part-*.arrow"), *output.glob(".part-*"), output / PLAN_FILE, output / METADATA_FILE]:
        path.unlink(missing_ok=True)
    shutil.rmtree(output / "parts", ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- workers
def _plugin_class() -> type:
    import torch

    from stages.replicas.replica import TargetReplicaPlugin

    class GenerateWorkerPlugin(TargetReplicaPlugin):
        """Generate's target replica: the shared lifecycle with a :class:`TransformersEngine` on top."""

        name = _PLUGIN_NAME

        def __init__(self, *, engine_kwargs: dict[str, Any], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.engine_kwargs = engine_kwargs
            self.engine = None
            self.tokenizer = None

        def build(self, loaded: Any, device: torch.device) -> None:
            from dflash.generation.transformers_engine import TransformersEngine

            self.tokenizer = loaded.tokenizer
            self.engine = TransformersEngine(loaded.model, loaded.tokenizer, **self.engine_kwargs,
                                             description={"target": loaded.identity.to_dict()})

        def release(self) -> torch.device | None:
            if self.engine is None:
                return None
            device = self.engine.device
            self.engine.close()
            self.engine = None
            return device

    return GenerateWorkerPlugin


#: The Dask event topic a worker's in-part progress goes to (``Worker.log_event`` -> ``Client.subscribe_topic``).
_PROGRESS_TOPIC = "dflash-generate-progress"
#: Least seconds between two in-part events of a worker that carry only the tokens of replies still decoding (the
#: engine reports those every decode step); events with final replies go at once.
_DECODING_EVENT_INTERVAL_S = 1.0


class _PromptProgress:
    """The bar's prompts and tokens: committed parts, plus the first-turn replies of parts still running (a prompt
    counts once its first reply is back; its part's commit makes the count exact), so a part taking minutes shows
    progress and an ETA before it commits; and the tokens of the replies still decoding in each running part (an
    estimate the engine reports while a batch decodes, replaced by the batch's exact figure when it ends)."""

    def __init__(self, progress: Any, task: Any, *, prompts: int, tokens: int) -> None:
        self.progress, self.task = progress, task
        self.committed, self.tokens = prompts, tokens
        self.running: dict[int, list[int]] = {}  # part -> [first-turn replies, tokens reported, tokens decoding]
        self.finished: set[int] = set()  # parts committed: a late event of theirs changes nothing
        self.lock = threading.Lock()

    def start(self) -> None:
        """The parts start now: rates and ETA count from here, not from before the target loaded."""
        self.progress.update(self.task, status="")
        self.progress.reset_clock(self.task)

    def _show(self) -> None:
        in_flight = sum(replies for replies, _, _ in self.running.values())
        decoding = sum(tokens for _, _, tokens in self.running.values())
        self.progress.update(self.task, completed=self.committed + in_flight, tokens=self.tokens + decoding)

    def batch(self, part_id: int, part_size: int, turn: int, replies: int, tokens: int, decoding: int = 0) -> None:
        """A part's progress (:func:`dflash.generation.parts.generate_part`): final replies and their tokens, and
        the tokens of its replies still decoding (replacing the last such figure)."""
        with self.lock:
            if part_id in self.finished:
                return
            counts = self.running.setdefault(part_id, [0, 0, 0])
            if turn == 0:
                counts[0] = min(part_size, counts[0] + replies)
            counts[1] += tokens
            counts[2] = decoding
            self.tokens += tokens
            self._show()

    def part_done(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.finished.add(int(record["part_id"]))
            _, reported, _ = self.running.pop(int(record["part_id"]), [0, 0, 0])
            self.committed += int(record["num_prompts"])
            self.tokens += max(0, int(record["generated_tokens"]) - reported)
            self._show()


@returns_user_errors
def generate_part_task(spec: Any) -> dict[str, Any]:
    """Dask task: answer one part on this worker's target replica and commit it; returns the part's record (an
    error the user must fix comes back as the task's value, :mod:`stages.replicas.tasks`, and
    :func:`_run_on_dask` raises it)."""
    from distributed import get_worker

    worker = get_worker()
    done = committed_parts(spec.output).get(spec.part_id)
    if done is not None:  # a task rerun after its worker died past the commit: the part stays as committed
        return {**done, "worker": str(worker.name)}
    plugin = worker.plugins.get(_PLUGIN_NAME)
    if plugin is None or plugin.engine is None:
        raise RuntimeError(f"worker {worker.address} has no target loaded (plugin {_PLUGIN_NAME} missing)")
    last_event = -_DECODING_EVENT_INTERVAL_S

    def progress(turn: int, replies: int, tokens: int, decoding: int) -> None:
        nonlocal last_event
        now = time.monotonic()
        if not replies and now - last_event < _DECODING_EVENT_INTERVAL_S:
            return  # only the tokens still decoding, reported again within the second: skipped
        last_event = now
        worker.log_event(_PROGRESS_TOPIC, {"part": spec.part_id, "size": len(spec.records), "turn": turn,
                                           "replies": replies, "tokens": tokens, "decoding": decoding})

    record = generate_part(plugin.engine, plugin.tokenizer, spec, progress=progress)
    record["worker"] = str(worker.name)
    return record


def _run_on_dask(config: GenerateConfig, specs: list[Any], progress: _PromptProgress,
                 timings: dict[str, float]) -> list[dict[str, Any]]:
    from distributed import as_completed

    started = time.perf_counter()
    client, cluster, placement = start_cluster(config)  # extract's cluster: one worker per target GPU, or CPU processes
    timings["cluster_start"] = time.perf_counter() - started
    records = []
    try:
        plugin = _plugin_class()(
            target_spec=config.target, gpu_by_worker=placement.get("gpu_by_worker"),
            device=placement.get("device", "auto"), torch_threads=placement.get("torch_threads"),
            die_with_parent=placement.get("die_with_parent", False),
            engine_kwargs={"batch_size": config.batch_size, "token_budget": config.prefill_tokens,
                           "cache": config.kv_cache, "deterministic": config.deterministic,
                           "continuous": config.continuous_batching},
        )
        started = time.perf_counter()
        client.register_plugin(plugin)  # runs setup (target load) on every worker
        timings["target_load"] = time.perf_counter() - started
        resources = placement.get("resources")
        started = time.perf_counter()

        def on_batch(event: tuple[float, dict[str, Any]]) -> None:
            message = event[1]
            progress.batch(message["part"], message["size"], message["turn"], message["replies"], message["tokens"],
                           message["decoding"])

        client.subscribe_topic(_PROGRESS_TOPIC, on_batch)
        progress.start()
        futures = [client.submit(generate_part_task, spec, key=f"generate-part-{spec.part_id}", pure=False,
                                 resources=resources) for spec in specs]
        for future in as_completed(futures):
            record = task_result(future)  # raises a part's error the user must fix; committed parts stay
            records.append(record)
            progress.part_done(record)
        timings["parts"] = time.perf_counter() - started
    finally:
        close_cluster(client, cluster)
    return records


def _run_in_process(config: GenerateConfig, specs: list[Any], tokenizer: Any, progress: _PromptProgress,
                    timings: dict[str, float]) -> list[dict[str, Any]]:
    engine = _openai_engine(config, tokenizer)
    progress.start()
    records = []
    started = time.perf_counter()
    try:
        for spec in specs:
            record = generate_part(engine, tokenizer, spec, progress=functools.partial(
                progress.batch, spec.part_id, len(spec.records)))
            records.append(record)
            progress.part_done(record)
        timings["parts"] = time.perf_counter() - started
    finally:
        engine.close()
    return records


def _openai_engine(config: GenerateConfig, tokenizer: Any) -> Any:
    from dflash.generation.openai_engine import OpenAIEngine

    return OpenAIEngine(config.openai_config(), tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------------- stage
def run_generate(config: GenerateConfig, console: Console | None = None, *,
                 prompt_processes: int | None = 1) -> dict[str, Any]:
    """Run the stage (module docstring); returns the summary also written into ``corpus.json``.

    ``prompt_processes``: processes that build the embedded default prompt set
    (:func:`dflash.generation.default_prompts.default_prompt_sets`; ``None``: one per core, at most 16). Spawned
    processes re-import the caller's main module, so the default is 1 (in this process); the CLI passes ``None``.

    The output's lock (``dflash.io.locks``) is held for the whole run: a second ``generate`` into the same folder is
    refused at once, naming the holder.

    Raises:
        ConfigError: bad prompts, settings, template or output (one line naming it); TargetError: no target;
        LockError: another process writes into ``config.output``.
    """
    output = Path(config.output)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file; pass a folder")
    if config.engine == "transformers":
        from stages.replicas.cluster import require_local_gpus

        require_local_gpus(config)  # before the lock and any file
    with output_lock(output, what="corpus", break_lock=config.break_lock):
        _check_output_settings(config)  # before the tokenizer, the prompts and the target load
        return _run_generate(config, console, prompt_processes)


def _run_generate(config: GenerateConfig, console: Console | None, prompt_processes: int | None) -> dict[str, Any]:
    from dflash.corpus.format import METADATA_FILE, open_corpus

    console = console or Console(stderr=True)
    started = time.perf_counter()
    identity = target_identity(resolve_target_path(config.target)).to_dict()
    tokenizer = load_tokenizer(config.target)
    timings = {"tokenizer": time.perf_counter() - started}  # with the target's identity
    records, read_drops, source, heldout = _load_prompts(config, prompt_processes)
    timings["prompts"] = time.perf_counter() - started - timings["tokenizer"]  # read, or built (the default set)
    if any(record.messages is not None for record in records):
        check_generation_prompt(tokenizer, config.template_kwargs, where=f"target {config.target}")
    ranges = plan_parts(len(records), config.part_size)
    settings = config.plan_settings()
    plan_digest = hashlib.sha256(json.dumps([settings, _records_digest(records), identity], sort_keys=True,
                                            default=str).encode()).hexdigest()
    plan = {"format": "dflash.generate/1", "plan_digest": plan_digest, "settings": settings, "target": identity,
            "prompt_source": source, "num_prompts": len(records), "parts": ranges,
            "read_dropped": read_drops.to_dict()}
    _open_output(config, plan)
    output = Path(config.output)
    if heldout is not None:  # the default set's held-out prompts, for evaluate --prompts
        write_prompts_jsonl(heldout, output / HELDOUT_PROMPTS_FILE)
    done = committed_parts(output)
    sampling = config.sampling().to_dict()
    specs = [PartSpec(part_id=part_id, first_prompt=start, records=[r.to_dict() for r in records[start:stop]],
                      output=str(output), settings=sampling, template_kwargs=dict(config.template_kwargs),
                      max_length=config.max_length)
             for part_id, (start, stop) in enumerate(ranges) if part_id not in done]
    console.print(f"generate: {len(records):,} prompts in {len(ranges)} parts ({len(done)} committed before), "
                  f"engine {config.engine}, target {identity.get('name')}; left out while reading: "
                  f"{read_drops.describe()}")
    # On a terminal a bar; in a log a line every progress_interval seconds (dflash.progress).
    with LogProgress(TextColumn("[bold]generate"), BarColumn(), MofNCompleteColumn(), TextColumn("prompts"),
                     TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn(), TimeRemainingColumn(),
                     console=console, transient=False, unit="prompts", interval=config.progress_interval,
                     speed_estimate_period=300) as progress:
        committed = sum(r["num_prompts"] for r in done.values())
        tokens = sum(int(r["generated_tokens"]) for r in done.values())
        task = progress.add_task("generate", total=len(records), completed=committed, tokens=tokens,
                                 status="starting the target" if specs else "")
        counts = _PromptProgress(progress, task, prompts=committed, tokens=tokens)
        this_run: list[dict[str, Any]] = []
        if specs:
            if config.engine == "openai":
                this_run = _run_in_process(config, specs, tokenizer, counts, timings)
            else:
                this_run = _run_on_dask(config, specs, counts, timings)
    done = committed_parts(output)
    missing = [part_id for part_id in range(len(ranges)) if part_id not in done]
    if missing:
        raise DFlashError(f"{len(missing)} of {len(ranges)} parts are not committed (e.g. part {missing[0]}); "
                          "rerun the same command to finish them")
    totals = summarize_parts([done[i] for i in range(len(ranges))])
    engine_description = {"engine": config.engine}
    if config.engine == "openai":
        engine_description.update(endpoints=list(config.endpoints), served_model=config.served_model)
    generation = {
        "engine": engine_description,
        "target": identity,
        "target_spec": config.target,
        **config.sampling().to_dict(),
        "template_kwargs": dict(config.template_kwargs),
        "chat_template": config.chat_template,
        "turns": config.turns,
        "max_length": config.max_length,
        "prompt_source": source,
        "read_dropped": read_drops.to_dict(),
        **totals,
    }
    from dflash.corpus.format import FORMAT_VERSION

    corpus = open_corpus(output, allow_unfinished=True)
    metadata = {"format_version": FORMAT_VERSION, "source": "generate", "target_spec": config.target,
                "target": identity, "generation": generation, "num_rows": len(corpus),
                "num_tokens": corpus.num_tokens, "fingerprint": corpus.fingerprint}
    atomic_write_text(output / METADATA_FILE, json.dumps(metadata, indent=2, default=str) + "\n")
    seconds = time.perf_counter() - started
    timings["other"] = seconds - sum(timings.values())  # output checks, the part plan, the corpus metadata
    summary = {**totals, "output": str(output), "seconds": round(seconds, 1), "parts": len(ranges),
               "rows": len(corpus), "timings": {name: round(value, 1) for name, value in timings.items()}}
    counts = totals["dropped"]["counts"]
    left_out = {reason: n for reason, n in counts.items() if reason != "turns_cut"}  # a cut chat keeps its row
    console.print(
        f"generate: {totals['num_rows']:,} rows, {totals['generated_tokens']:,} generated tokens "
        f"({totals['num_tokens']:,} in all), finish {totals['finish_reasons']}, left out while generating "
        f"{sum(left_out.values())} ({', '.join(f'{k} {v}' for k, v in left_out.items()) or 'none'})"
        + (f", chats cut short {counts['turns_cut']} (turns_cut: the row keeps its earlier turns)"
           if counts.get("turns_cut") else "")
        + (f", left out while reading {sum(read_drops.counts.values())} lines ({read_drops.describe()})"
           if read_drops.counts else "")
        + f" -> {output}", soft_wrap=True,
    )
    fewer = totals["rows_at_a_time"]
    if config.engine == "transformers" and fewer is not None and fewer < config.batch_size:
        console.print(f"generate: the GPU's memory held {fewer:,} of the {config.batch_size:,} rows of "
                      "generate.batch_size at a time; a lower max_length, max_new_tokens or prefill_tokens fits more",
                      highlight=False, markup=False)
    console.print(_timings_line(summary["timings"], this_run), highlight=False, markup=False, soft_wrap=True)
    return summary


def _timings_line(timings: dict[str, float], parts: list[dict[str, Any]]) -> str:
    """Where this run's wall time went; ``parts``: the records of the parts this run answered (none on a rerun
    that found every part committed)."""
    spent = ", ".join(f"{key.replace('_', ' ')} {value:.1f} s" for key, value in timings.items())
    if not parts:
        return f"generate time: {spent}; every part was committed before (no engine run)"
    engine, whole = sum(p["engine_seconds"] for p in parts), sum(p["seconds"] for p in parts)
    busy = row_occupancy(parts)
    caches = sum(p.get("caches_made") or 0 for p in parts)
    rows = ("" if busy is None else f"; the decode steps' rows chose a token {busy:.1%} of the time, "
            f"{caches} KV cache(s) allocated")
    return (f"generate time: {spent}; inside the parts answered now ({len(parts)}): engine {engine:.1f} s of "
            f"{whole:.1f} s (summed over parts){rows}")


def register(app: typer.Typer) -> None:
    """Add the ``generate`` command to ``app``."""
    @app.command("generate")
    @config_options(GenerateConfig, "generate")
    def generate_command(settings: CommandSettings) -> None:
        """Generate the target's own responses to prompts as a training corpus (the DFlash paper's recipe)."""
        config = resolve_stage_config(
            GenerateConfig, "generate", given=settings.given, config_file=settings.config_file,
            preset=settings.preset, overrides=settings.sets, required=("output",), option_names=settings.spellings)
        if settings.print_config:
            print_and_exit("generate", config)
        run_generate(config, prompt_processes=None)  # the CLI's entry points run under a __main__ guard

