"""The output of ``generate``: a contract-1 corpus folder written in parts, each committed exactly once.

Layout of ``OUTPUT/``::

    generate.json            the plan: settings, engine, target identity, prompt source digest, part ranges (first)
    parts/part-000042.json   one part's record: prompt range, rows, tokens, drops, finish reasons, seconds
    part-000042.arrow        one part's rows (Arrow IPC, the corpus schema), renamed into place last
    heldout_prompts.jsonl    prompts held out of the corpus for ``evaluate --prompts`` (never trained on)
    corpus.json              the corpus metadata (``dflash.corpus/1`` + ``generation``), written when all parts are

A part counts only once its ``.arrow`` file exists: it is written to a hidden temporary name, synced, its record
written, then renamed (atomic on POSIX), so a killed run leaves at most a temporary file, which the rerun removes
and redoes. One task writes one part, so there are never two writers on one part. Until ``corpus.json`` exists the
folder is refused as a corpus (``dflash.corpus.format.open_corpus``: "unfinished generate output").

A part's rows keep the prompt order; each row's ``sample_id`` is its prompt's id and its ``document_id`` the
prompt's source document (``PromptRecord.document_id``). Prompts dropped (too long for ``max_length``) and turns cut short are counted
in its record, never silently.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dflash.corpus.format import SCHEMA
from dflash.errors import CorpusError
from dflash.faults import fault_point
from dflash.generation.engine import GenerationEngine, GenerationRequest, SamplingSettings
from dflash.generation.prompts import ConversationBuilder, DropCounts, PromptRecord, prompt_ids_of
from dflash.io.files import MAX_RECORD_BYTES, atomic_write_text, load_json

__all__ = ["PLAN_FILE", "HELDOUT_PROMPTS_FILE", "PartSpec", "part_path", "part_record_path", "committed_parts", "generate_part",
           "clear_uncommitted", "row_occupancy"]

PLAN_FILE = "generate.json"
HELDOUT_PROMPTS_FILE = "heldout_prompts.jsonl"
_PARTS_DIR = "parts"


@dataclass(kw_only=True, slots=True)
class PartSpec:
    """One part: its id, the prompts it answers (``first_prompt`` is their index in the whole prompt list)."""

    part_id: int
    first_prompt: int
    records: list[dict[str, Any]]
    output: str
    settings: dict[str, Any]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_length: int = 2048


def part_path(output: str | Path, part_id: int) -> Path:
    return Path(output) / f"part-{part_id:06d}.arrow"


def part_record_path(output: str | Path, part_id: int) -> Path:
    return Path(output) / _PARTS_DIR / f"part-{part_id:06d}.json"


def committed_parts(output: str | Path) -> dict[int, dict[str, Any]]:
    """Records of the committed parts (``.arrow`` in place and its record readable), by part id."""
    output = Path(output)
    found: dict[int, dict[str, Any]] = {}
    for path in output.glob("part-*.arrow"):
        try:
            part_id = int(path.stem.removeprefix("part-"))
            found[part_id] = load_json(part_record_path(output, part_id), error=CorpusError, fix="",
                                       limit=MAX_RECORD_BYTES)
        except (ValueError, OSError):
            continue  # not ours, or a record lost with the disk: redone
    return found


def clear_uncommitted(output: str | Path) -> int:
    """Remove temporaries of killed writers (``.part-*.tmp-*``); returns how many."""
    leftovers = list(Path(output).glob(".part-*.tmp-*"))
    for path in leftovers:
        path.unlink(missing_ok=True)
    return len(leftovers)


def _write_part(output: Path, part_id: int, rows: list[tuple[list[int], list[int], str, str]], record: dict[str, Any]) -> None:
    """Commit one part: ``rows`` of ``(input_ids, loss_mask, sample_id, document_id)`` as an Arrow IPC file of the
    corpus schema (temporary name, fsync, record, rename)."""
    final = part_path(output, part_id)
    temporary = output / f".part-{part_id:06d}.tmp-{os.getpid()}"
    try:
        fault_point("generate.part-write", temporary)
        lengths = [len(ids) for ids, _, _, _ in rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        flat_ids = np.concatenate([np.asarray(ids, np.int32) for ids, _, _, _ in rows]) if rows else np.zeros(0, np.int32)
        flat_mask = np.concatenate([np.asarray(m, np.uint8) for _, m, _, _ in rows]) if rows else np.zeros(0, np.uint8)
        batch = pa.record_batch(
            [pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_ids, pa.int32())),
             pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_mask, pa.uint8())),
             pa.array([name for _, _, name, _ in rows], pa.string()),
             pa.array([document for _, _, _, document in rows], pa.string())],
            schema=SCHEMA,
        )
        with pa.OSFile(str(temporary), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
            writer.write_batch(batch)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        record_path = part_record_path(output, part_id)
        record_path.parent.mkdir(exist_ok=True)
        atomic_write_text(record_path, json.dumps(record, indent=1))
        os.replace(temporary, final)  # the commit
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def generate_part(engine: GenerationEngine, tokenizer: Any, spec: PartSpec,
                  progress: Callable[[int, int, int, int], None] | None = None) -> dict[str, Any]:
    """Answer every prompt of ``spec`` turn by turn with ``engine`` and commit the part (module docstring).

    Turn ``t`` of every conversation of the part goes to the engine in one call (the engine batches by length);
    a turn whose prompt leaves no room under ``max_length`` ends its conversation (``turns_cut``), a first turn
    drops the prompt (``too_long``). Returns the part's record (small: counts, not tokens).

    ``progress(turn, replies, generated tokens, decoding)`` is called where the engine reports progress (a
    ``progress`` attribute, as :class:`~dflash.generation.transformers_engine.TransformersEngine` has), so a long
    part shows progress before it commits: after each batch with its replies and their tokens (final), and while a
    batch decodes with none and ``decoding``, the tokens its replies have chosen so far (an estimate each call
    replaces; 0 once the batch's figures are final).
    """
    started = time.perf_counter()
    settings = SamplingSettings(**spec.settings)
    records = [PromptRecord.from_dict(r) for r in spec.records]
    builders = [ConversationBuilder(record, tokenizer, spec.template_kwargs) for record in records]
    drops = DropCounts()
    finish = Counter()
    token_sources = Counter()
    engine_seconds = 0.0
    rows_at_a_time: list[int] = []  # per engine call, the rows it decoded at once (engines that report it)
    row_steps = step_tokens = 0  # the decode steps' rows, and the tokens they chose (engines that report row steps)
    caches_made = 0  # KV caches the static decoder allocated for this part (each captured again on CUDA)
    turn = 0
    while True:
        requests: list[GenerationRequest] = []
        prompts: dict[int, list[int]] = {}
        for index, (builder, prompt) in enumerate(zip(builders, prompt_ids_of(builders), strict=True)):
            if prompt is None:
                continue
            room = spec.max_length - len(prompt)
            if room < 1:
                drops.add("too_long" if builder.num_turns_done == 0 else "turns_cut", builder.record.prompt_id)
                builder.stop()
                continue
            prompts[index] = prompt
            # No prompt_text: an engine that needs text decodes the ids itself, only when it must.
            requests.append(GenerationRequest(request_id=spec.first_prompt + index, prompt_ids=prompt,
                                              max_new_tokens=min(settings.max_new_tokens, room),
                                              source=f"{builder.record.prompt_id}, turn {builder.num_turns_done + 1}"))
        if not requests:
            break
        engine_started = time.perf_counter()
        reports = progress is not None and hasattr(engine, "progress")
        if reports:
            engine.progress = functools.partial(progress, turn)
        try:
            results = engine.generate(requests, settings)
        finally:
            if reports:
                engine.progress = None
        engine_seconds += time.perf_counter() - engine_started
        stats = getattr(engine, "last_stats", {})
        if "rows" in stats:
            rows_at_a_time.append(int(stats["rows"]))
        if "row_steps" in stats:  # each reply's first token comes from its prompt's forward, the others from steps
            row_steps += int(stats["row_steps"])
            step_tokens += sum(max(0, len(result.token_ids) - 1) for result in results)
            caches_made += int(stats.get("caches_made", 0))
        for request, result in zip(requests, results, strict=True):
            index = request.request_id - spec.first_prompt
            builders[index].add_reply(prompts[index], result.token_ids, finished=result.finish_reason == "stop")
            finish[result.finish_reason] += 1
            token_sources[result.token_source] += 1
        turn += 1
    rows = [(b.input_ids, b.loss_mask, b.record.prompt_id, b.record.document_id)
            for b in builders if b.num_turns_done and any(b.loss_mask)]
    record = {
        "part_id": spec.part_id,
        "first_prompt": spec.first_prompt,
        "num_prompts": len(records),
        "num_rows": len(rows),
        "num_tokens": int(sum(len(ids) for ids, _, _, _ in rows)),
        "generated_tokens": int(sum(sum(mask) for _, mask, _, _ in rows)),
        "turns": turn,
        "finish_reasons": dict(finish),
        "token_sources": dict(token_sources),
        "dropped": drops.to_dict(),
        "engine_seconds": round(engine_seconds, 3),
        "rows_at_a_time": min(rows_at_a_time, default=None),
        "row_steps": row_steps if rows_at_a_time else None,
        "step_tokens": step_tokens if rows_at_a_time else None,
        "caches_made": caches_made if rows_at_a_time else None,
        "seconds": round(time.perf_counter() - started, 3),
    }
    _write_part(Path(spec.output), spec.part_id, rows, record)
    return record


def plan_parts(num_prompts: int, part_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` prompt ranges of ``part_size`` prompts (the last one shorter)."""
    return [(start, min(num_prompts, start + part_size)) for start in range(0, num_prompts, part_size)]


def summarize_parts(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals over part records (for the corpus metadata and the report). ``engine_seconds``: time inside the
    engine's ``generate`` calls; ``part_seconds``: whole parts up to their commit (templates, tokenization, the
    engine; not the commit: the record is written inside the part), both summed over parts (parts on different
    workers overlap, so the sums can exceed the wall time). ``rows_at_a_time``: the fewest rows an engine call
    decoded at once (the transformers engine's static decoder: its batch size, or fewer where the GPU's memory held
    fewer); None where no part reports it. ``row_occupancy``: of the rows the static decoder's decode steps ran
    (``row_steps``: steps x cache rows, summed), the share that chose a token of a reply (``step_tokens``); the rest
    ran finished, free or filler rows, e.g. while a batch or the last requests of a part drain. None where no part
    reports it."""
    drops = DropCounts()
    finish: Counter = Counter()
    sources: Counter = Counter()
    for part in parts:
        drops.merge(part["dropped"])
        finish.update(part["finish_reasons"])
        sources.update(part["token_sources"])
    return {
        "num_prompts": sum(p["num_prompts"] for p in parts),
        "num_rows": sum(p["num_rows"] for p in parts),
        "num_tokens": sum(p["num_tokens"] for p in parts),
        "generated_tokens": sum(p["generated_tokens"] for p in parts),
        "finish_reasons": dict(finish),
        "token_sources": dict(sources),
        "dropped": drops.to_dict(),
        "engine_seconds": round(sum(p["engine_seconds"] for p in parts), 3),
        "part_seconds": round(sum(p["seconds"] for p in parts), 3),
        "rows_at_a_time": min((p["rows_at_a_time"] for p in parts if p.get("rows_at_a_time")), default=None),
        "row_occupancy": row_occupancy(parts),
    }


def row_occupancy(parts: Sequence[dict[str, Any]]) -> float | None:
    """Tokens the static decoder's decode steps chose / the rows those steps ran, over ``parts`` (records without
    these counts are left out); None where no part has them (:func:`summarize_parts`)."""
    counted = [p for p in parts if p.get("row_steps")]
    if not counted:
        return None
    return round(sum(p["step_tokens"] for p in counted) / sum(p["row_steps"] for p in counted), 4)
