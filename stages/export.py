"""``dflash-stages export CKPT OUT``: write a trained drafter in the serving format vLLM and SGLang load.

CKPT is a checkpoint folder (``RUN/checkpoints/step_XXXXXXXX``) or a run folder (its ``latest`` checkpoint is used).
The export is written atomically, then read back with the strict loader (:func:`dflash.serving.export.read_exported`) and
compared tensor by tensor with the checkpoint; see ``dflash/export.py`` for the format.

    dflash-stages export runs/smol OUT/smol-dflash [--target PATH] [--overwrite]
    dflash-stages export --config export.toml [--set export.overwrite=true] [--print-config]

Settings resolve like every stage's (``stages.config.resolve``): defaults < ``--preset`` < ``--config`` (an
``[export]`` section or the fields at the top) < CKPT, OUT and the options given < ``--set``.

Exit status: 0 exported and verified; 2 the checkpoint, OUT or target is not usable (one ``error:`` line
says why and what to pass, or another export writes OUT); 130 interrupted (OUT is left as it was).
OUT is locked while it is written (``dflash.io.locks``): a second export into it is refused at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import typer

from dflash.errors import DFlashError
from dflash.io.locks import output_lock
from dflash.serving.export import export_checkpoint
from stages.config.exit_status import ExitCode, print_error
from stages.config.options import CommandSettings, config_options, setting
from stages.config.resolve import print_and_exit, resolve_stage_config

__all__ = ["ExportConfig", "register", "export_command"]


@dataclass(kw_only=True)
class ExportConfig:
    """What ``export`` needs; every field is also a ``--config`` key and a ``--set export.FIELD=VALUE``. Each field's
    help is its one description (``--help``, docs/config-reference.md)."""

    checkpoint: str | None = setting(None, argument='CKPT', help='Checkpoint folder, or a run folder (its `latest` checkpoint is used). Required (here or in --config/--preset/--set).')
    out: str | None = setting(None, argument='OUT', help='Export folder to create (config.json, model.safetensors, dflash_export.json). Required (here or in --config/--preset/--set).')
    target: str | None = setting(None, help="Target spec (folder, .gguf or 'default') whose config/tokenizer check RoPE and widths and name the mask token; default: the target_spec recorded in the checkpoint's target.json.")
    overwrite: bool = setting(False, option='--overwrite', help='Replace OUT if it exists (only after the new export is complete).')
    break_lock: bool = setting(False, option='--break-lock', help="Take over OUT's lock left by a run on another host known dead.")


@config_options(ExportConfig, "export")
def export_command(settings: CommandSettings) -> None:
    """Export a drafter checkpoint in the serving format (docs/dflash.md) and verify it with the strict loader."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    config = resolve_stage_config(ExportConfig, "export", given=settings.given, config_file=settings.config_file,
                                  preset=settings.preset, overrides=settings.sets, required=("checkpoint", "out"),
                                  option_names=settings.spellings)  # fmt: skip
    if settings.print_config:
        print_and_exit("export", config)
    checkpoint, out = Path(config.checkpoint), Path(config.out)
    target, overwrite, break_lock = config.target, config.overwrite, config.break_lock
    try:
        with warnings.catch_warnings(record=True) as caught, output_lock(out, what="export", break_lock=break_lock):
            warnings.simplefilter("always")
            destination, provenance = export_checkpoint(checkpoint, out, target=target, overwrite=overwrite)
        for warning in caught:
            console.print(f"[yellow]warning:[/] {escape(str(warning.message))}")
    except DFlashError as error:  # a wrong path, OUT exists, mismatched target...: the user's to fix (exit 2)
        print_error(error)
        raise typer.Exit(ExitCode.USAGE) from None

    config = provenance["drafter_config"]
    table = Table(title=f"Exported {destination}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    source = provenance.get("source") or {}
    target_info = provenance.get("target") or {}
    table.add_row("source checkpoint", f"{source.get('checkpoint')} (step {source.get('step')})")
    serve_target = _served_target(target if target is not None else target_info.get("target_spec"))
    identity = " ".join(str(part) for part in (target_info.get("name"), target_info.get("content_hash")) if part)
    table.add_row("target", escape(f"{serve_target} ({identity})" if identity else serve_target))
    table.add_row("draft layers", str(config["num_hidden_layers"]))
    table.add_row("block_size", str(config["block_size"]))
    table.add_row(
        "target_layer_ids", escape(f"{config['target_layer_ids']} (output of decoder layer l = hidden_states[l + 1])")
    )
    table.add_row("mask_token_id", str(config["mask_token_id"]))
    table.add_row("rope", escape(f"theta={config['rope_theta']} scaling={config.get('rope_scaling')}"))
    table.add_row("parameters", f"{provenance['num_parameters']:,} (bfloat16)")
    for name, record in provenance["files"].items():
        table.add_row(name, f"{record['bytes']:,} bytes {record['sha256']}")
    table.add_row("strict reload", "[green]ok[/]: names, shapes, dtype, RoPE keys, layer ids; tensors equal the checkpoint's")
    console.print(table)
    block_size = int(config["block_size"])
    console.print(
        escape("Serve it (the target must be the one it was trained on):\n"
        f"  vLLM:   vllm serve {serve_target} --speculative-config "
        f"'{{\"method\": \"dflash\", \"model\": \"{destination}\", \"num_speculative_tokens\": {block_size - 1}}}'\n"
        f"  SGLang: python -m sglang.launch_server --model-path {serve_target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {destination} --speculative-num-draft-tokens {block_size}"),
        soft_wrap=True,
    )


def _served_target(spec: str | None) -> str:
    """The local path of the target the drafter was trained with (``spec`` resolved, the embedded default named by
    its folder); the spec itself when it does not resolve on this machine, ``TARGET`` when none is recorded."""
    if not spec:
        return "TARGET"
    from dflash.target.load import resolve_target_path

    try:
        return str(resolve_target_path(spec))
    except DFlashError:
        return str(spec)


def register(app: typer.Typer) -> None:
    """Add the ``export`` command to the CLI."""
    app.command("export")(export_command)
