"""``dflash-stages cache info CACHE`` and ``dflash-stages cache verify CACHE``: inspect and check a hidden-state cache.

``info`` prints the root metadata, counts over committed shards, quarantined samples, size on disk and the
compression ratio. ``verify`` decodes every chunk (crc32c), recomputes each shard's digest and checks offsets,
completeness against the shard plan and duplicates. Exit status (the CLI's one scheme, ``stages.cli.ExitCode``):
0 sound; 1 corrupt shards (each named) or planned shards not committed yet (unless ``--allow-incomplete``);
2 no readable cache at the path (an ``error:`` line says what is wrong).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from dflash.errors import CacheCorruptError, CacheError, DFlashError
from dflash.io.locks import output_lock
from stages.config.exit_status import ExitCode

__all__ = ["register", "cache_app", "cache_info"]

cache_app = typer.Typer(name="cache", help="Inspect (info) and check (verify) a hidden-state cache.", no_args_is_help=True)


def _human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def cache_info(path: str) -> dict[str, Any]:
    """Everything ``cache info`` shows, as a JSON-able dict: metadata, totals, size on disk, ratio, quarantine."""
    from dflash.cache import CacheReader

    reader = CacheReader(path)
    totals = {"num_samples": 0, "num_tokens": 0, "num_quarantined": 0, "num_skipped": 0, "raw_bytes": 0, "stored_bytes": 0}
    for shard in reader.shards:
        record = reader.commit_record(shard)
        for name in totals:
            totals[name] += int(record.get(name, 0))
    size_on_disk = reader.size_on_disk()
    quarantined = reader.quarantined()
    return {
        "path": reader.url,
        "metadata": reader.metadata.to_dict(),
        "committed_shards": len(reader.shards),
        "planned_shards": reader.metadata.num_shards,
        **totals,
        "size_on_disk": size_on_disk,
        "compression_ratio": totals["raw_bytes"] / totals["stored_bytes"] if totals["stored_bytes"] else None,
        # Stored (compressed) shard bytes per token: the figure extract's report prints, computed the same way.
        "bytes_per_token": totals["stored_bytes"] / totals["num_tokens"] if totals["num_tokens"] else None,
        "document_keys": reader.document_keys_info,
        "quarantined_by_layer": dict(sorted(Counter(layer for entry in quarantined for layer in entry.get("layers", [])).items())),
        "quarantined": quarantined,
    }


def _print_info(info: dict[str, Any], console: Console, max_quarantined: int) -> None:
    from rich.markup import escape

    meta = info["metadata"]
    table = Table(title=f"hidden-state cache {info['path']}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    target = meta["target"]
    rows = [
        ("format", f"{meta['format']} v{meta['format_version']}"),
        ("target", f"{target.get('name')} ({target.get('content_hash', '?')[:23]}...)"),
        ("target spec", meta["target_spec"]),
        ("target layers / hidden / vocab", f"{target.get('num_hidden_layers')} / {meta['hidden_size']} / {target.get('vocab_size')}"),
        ("target_layer_ids", f"{meta['target_layer_ids']} ({meta['layer_id_convention']})"),
        ("storage dtype", meta["storage_dtype"] + (" [bold red](lossy)[/]" if meta["lossy"] else " (bit-exact)")),
        ("codec", json.dumps(meta["codec"]) + " + crc32c"),
        *([("codec choice", escape(f"auto -> {choice['chosen']}: {choice.get('reason', '')}"))]
          if (choice := (meta.get("extra") or {}).get("codec_choice")) else []),
        ("chunk tokens", str(meta["chunk_tokens"])),
        ("corpus", f"{meta['corpus_path'] or '?'} {meta['corpus_fingerprint'][:23]}..."),
        ("shards committed / planned", f"{info['committed_shards']} / {info['planned_shards']}"),
        ("samples", f"{info['num_samples']:,}"),
        ("tokens", f"{info['num_tokens']:,}"),
        ("quarantined samples", f"{info['num_quarantined']:,}" + (f" by layer {info['quarantined_by_layer']}" if info["num_quarantined"] else "")),
        ("skipped rows", f"{info['num_skipped']:,}"),
        ("source documents", f"{info['document_keys']['num_documents']:,} over {info['document_keys']['num_rows']:,} corpus rows"
         if info["document_keys"] else "none recorded (train's validation split goes by row)"),
        ("size on disk", _human_bytes(info["size_on_disk"])),
        ("raw (uncompressed) size", _human_bytes(info["raw_bytes"])),
        ("compression ratio", f"{info['compression_ratio']:.3f}x" if info["compression_ratio"] else "-"),
        ("stored bytes per token", f"{info['bytes_per_token']:,.0f}" if info["bytes_per_token"] else "-"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if info["quarantined"]:
        quarantine = Table(title="quarantined samples (non-finite hidden states)", title_justify="left")
        for column in ("shard", "corpus row", "sample id", "layers", "reason"):
            quarantine.add_column(column)
        for entry in info["quarantined"][:max_quarantined]:
            quarantine.add_row(str(entry["shard"]), str(entry["corpus_row"]), str(entry.get("sample_id")), str(entry.get("layers")), str(entry.get("reason", "")))
        console.print(quarantine)
        if len(info["quarantined"]) > max_quarantined:
            console.print(f"... and {len(info['quarantined']) - max_quarantined} more (--max-quarantined)")


@cache_app.command("info")
def info_command(
    cache: str = typer.Argument(..., metavar="CACHE", help="Cache root: a local folder or an fsspec URL."),
    as_json: bool = typer.Option(False, "--json", help="Print the information as JSON instead of tables."),
    max_quarantined: int = typer.Option(20, help="Quarantined samples to list in the table."),
) -> None:
    """Show a cache's metadata, counts, quarantined samples, size on disk and compression ratio."""
    console = Console()
    try:
        info = cache_info(cache)
    except CacheError as error:  # no cache there, or unreadable metadata: the user's path or cache to fix
        _print_error(error)
        raise typer.Exit(ExitCode.USAGE) from None
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info, console, max_quarantined)


@cache_app.command("verify")
def verify_command(
    cache: str = typer.Argument(..., metavar="CACHE", help="Cache root: a local folder or an fsspec URL."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete", help="Exit 0 even when planned shards are not committed yet."),
    uncommit_corrupt: bool = typer.Option(
        False, "--uncommit-corrupt", help="Withdraw every corrupt shard (delete its commit record and data) so the next extract run redoes it."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Read every chunk of every committed shard (checksums, digests, offsets); check completeness and duplicates.

    Exit status: 0 sound; 1 corrupt shards (each named with its array) or uncommitted planned shards (unless
    --allow-incomplete); 2 no readable cache at CACHE.
    """
    from dflash.cache import CacheReader, HiddenStateCache, verify_cache

    console = Console(stderr=as_json)
    try:
        num_committed = len(CacheReader(cache).shards)
        with Progress(
            TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True,
            disable=not console.is_terminal,  # piped output: no bar, and no blank line where it was
        ) as progress:
            task = progress.add_task("shards", total=num_committed)
            report = verify_cache(cache, fail_fast=False, on_shard=lambda shard: progress.advance(task))
    except CacheCorruptError as error:  # the check's verdict: the cache is damaged
        _print_error(error, label="CORRUPT: ")
        raise typer.Exit(ExitCode.CHECK_FAILED) from None
    except CacheError as error:  # nothing to check: a wrong path, or not a cache
        _print_error(error)
        raise typer.Exit(ExitCode.USAGE) from None
    if as_json:
        print(json.dumps(report, indent=2))
    for _shard, message in sorted(report["corrupt_shards"].items()):
        console.print(Text("CORRUPT: ", style="bold red") + Text(str(message)), soft_wrap=True)
    if report["corrupt_shards"] and uncommit_corrupt:
        try:
            with output_lock(cache, what="cache"):  # a writer: not while an extract run writes this cache
                writer = HiddenStateCache.open(cache)
                for shard in sorted(report["corrupt_shards"]):
                    writer.uncommit(shard)
        except DFlashError as error:
            _print_error(error)
            raise typer.Exit(ExitCode.USAGE) from None
        console.print(f"withdrew {len(report['corrupt_shards'])} corrupt shard(s); rerun `dflash-stages extract` with the same arguments to redo them")
    sound = report["committed_shards"] - len(report["corrupt_shards"])
    if report["corrupt_shards"] and not uncommit_corrupt:
        console.print(
            f"to repair: `dflash-stages cache verify {cache} --uncommit-corrupt` withdraws the corrupt shard(s), then rerun "
            "`dflash-stages extract` with the same arguments to redo them", soft_wrap=True)
    console.print(
        f"{'[green]ok[/]' if report['ok'] else '[red]checked[/]'}: {sound} sound committed shard(s) (chunk checksums and shard "
        f"digests match), {report['num_samples']:,} samples, {report['num_tokens']:,} tokens, {report['num_quarantined']} quarantined"
        + (f"; {len(report['corrupt_shards'])} corrupt" if report["corrupt_shards"] else ""),
        soft_wrap=True,
    )
    if report["stray_shards"]:
        console.print(f"{len(report['stray_shards'])} uncommitted shard folder(s) with leftover data (ignored, redone by extract): {report['stray_shards'][:10]}")
    if report["partial_files"]:
        console.print(
            f"{len(report['partial_files'])} temporary file(s) of an interrupted write (ignored, removed by the next extract "
            f"run): {', '.join(report['partial_files'][:10])}", soft_wrap=True, markup=False)
    if not report["ok"]:
        raise typer.Exit(ExitCode.CHECK_FAILED)
    if not report["complete"]:
        console.print(
            f"[yellow]incomplete[/]: {len(report['uncommitted_shards'])} of {report['planned_shards']} planned shards are not committed "
            f"(first: {report['uncommitted_shards'][:10]}); rerun `dflash-stages extract` with the same arguments"
        )
        if not allow_incomplete:
            raise typer.Exit(ExitCode.CHECK_FAILED)


def _print_error(error: Exception, label: str = "error: ") -> None:
    from rich.text import Text

    # stderr, no markup parsing, one line (paths and shard ids stay copy-pasteable), like the CLI's central handler.
    Console(stderr=True).print(Text(label, style="bold red") + Text(str(error)), soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add the ``cache`` command group (``info``, ``verify``) to the CLI."""
    app.add_typer(cache_app, name="cache")
