"""Export a trained drafter in the serving format that vLLM, SGLang and z-lab's loader read, and load it back strictly.

An export folder holds ``config.json`` and ``model.safetensors`` (bfloat16) as :mod:`dflash.serving.format` defines
them (docs/dflash.md, "Serving format"), plus ``dflash_export.json``: provenance (source checkpoint, target identity and
embedding/LM-head hashes, the tap convention, sha256 of the two files). Serving engines ignore it;
:func:`load_exported` checks it.

One engine skips weight names it does not know without a word, so an export is proven only by :func:`load_exported`,
which fails on unknown, missing or misnamed tensors, wrong shapes or dtype, non-increasing or out-of-range layer
ids and RoPE keys that disagree, and by drafting the training logits from the reloaded weights
(``tests/test_export.py``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dflash
from dflash.drafter import DFlashConfig
from dflash.drafter.config import rope_settings_from_target
from dflash.errors import CheckpointError, ExportError, MismatchError, TargetError
from dflash.io.files import load_json
from dflash.serving.format import (
    CONFIG_FILE,
    EXPORT_FORMAT_VERSION,
    PROVENANCE_FILE,
    SERVING_ARCHITECTURE,
    WEIGHTS_FILE,
    check_state_dict,
    config_dict,
    drafter_config_dict_from_serving,
    expected_weight_shapes,
    rope_parameters_from_legacy,
    serving_config,
    validate_serving_config,
)
from dflash.target.load import resolve_target_path, target_identity
from dflash.target.taps import LAYER_ID_CONVENTION
from dflash.training.checks import check_target_identity

if TYPE_CHECKING:
    import torch

    from dflash.drafter import DFlashConfig

__all__ = [
    "EXPORT_FORMAT_VERSION",
    "SERVING_ARCHITECTURE",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "PROVENANCE_FILE",
    "CHECKPOINT_CONFIG_FILE",
    "CHECKPOINT_TARGET_FILE",
    "serving_config",
    "drafter_config_dict_from_serving",
    "expected_weight_shapes",
    "check_state_dict",
    "export_drafter",
    "read_exported",
    "load_drafter",
    "drafter_source",
    "load_exported",
    "load_exported_drafter",
    "check_against_target",
    "export_checkpoint",
    "sha256_file",
]

#: The fix named when an export's own JSON files cannot be read.
_REEXPORT = "the export is damaged or was edited: export the drafter again (dflash-stages export RUN OUT)"

#: Files of a training checkpoint folder (docs/training.md "Run folder").
CHECKPOINT_CONFIG_FILE = "drafter_config.json"
CHECKPOINT_TARGET_FILE = "target.json"


# --------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------


def sha256_file(path: Path, chunk_bytes: int = 16 << 20) -> str:
    """``sha256:<hex>`` of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")


def _check_replaceable(destination: Path, *, overwrite: bool) -> None:
    """Refuse an existing ``destination`` unless ``overwrite`` and it is an earlier export or an empty folder (a typo
    in the output path must never delete a user's folder or file).

    Raises:
        ExportError: naming the path and the fix.
    """
    if not destination.exists() and not destination.is_symlink():
        return
    if not overwrite:
        raise ExportError(f"{destination} already exists; pass --overwrite to replace an earlier export there, or "
                          "another output folder")
    is_export = destination.is_dir() and ((destination / PROVENANCE_FILE).is_file() or _is_serving_dir(destination))
    if not is_export and not (destination.is_dir() and not any(destination.iterdir())):
        kind = "a folder" if destination.is_dir() else "a file"
        raise ExportError(
            f"{destination} exists and is {kind} that is not an export of dflash-stages (no {PROVENANCE_FILE}); "
            "--overwrite replaces only an earlier export or an empty folder: pass another output folder"
        )


def _is_serving_dir(folder: Path) -> bool:
    try:
        architectures = load_json(folder / CONFIG_FILE, error=ExportError, fix="").get("architectures", [])
        return isinstance(architectures, list) and "DFlashDraftModel" in architectures
    except (OSError, ValueError):
        return False


def _replace_dir(staging: Path, destination: Path, *, overwrite: bool) -> None:
    """Move a finished staging folder to ``destination``; the old folder (if allowed) goes only after success."""
    if destination.exists():
        _check_replaceable(destination, overwrite=overwrite)
        trash = destination.with_name(f".{destination.name}.old-{os.getpid()}")
        destination.rename(trash)
        try:
            staging.rename(destination)
        except BaseException:
            trash.rename(destination)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(destination)


def export_drafter(
    state_dict: Mapping[str, torch.Tensor],
    config: DFlashConfig | Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    target_info: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    mask_token: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``state_dict`` + ``config`` as a serving-format folder (atomic: staging folder, then rename).

    Args:
        state_dict: the drafter's trainable tensors under the serving names (``DFlashDrafter.state_dict()``), any
            float dtype; stored as bfloat16.
        config: the drafter's ``DFlashConfig`` (or its dict).
        out_dir: the export folder to create.
        target_info: the checkpoint's ``target.json`` (TargetIdentity fields, ``target_spec``, embedding/LM-head
            hashes); recorded in ``dflash_export.json``.
        source: where the weights came from (checkpoint path, step...); recorded in ``dflash_export.json``.
        mask_token: the tokenizer's string for ``mask_token_id`` (see :func:`serving_config`).
        overwrite: replace an existing ``out_dir``.

    Returns:
        The export folder.

    Raises:
        ExportError: names/shapes do not match the config, a tensor is not floating point or not finite, or
            ``out_dir`` exists without ``overwrite``.
        OSError: a write was refused (a full disk, no permission...), naming the file; nothing is left behind.
    """
    import torch

    from dflash.io.weights import save_safetensors  # loads torch

    destination = Path(out_dir).expanduser().absolute()
    _check_replaceable(destination, overwrite=overwrite)
    config_json = serving_config(config, mask_token=mask_token)
    validate_serving_config(config_json, destination / CONFIG_FILE)
    check_state_dict({name: tuple(t.shape) for name, t in state_dict.items()}, config, where="state_dict")
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(state_dict):
        tensor = state_dict[name].detach()
        if not tensor.is_floating_point():
            raise ExportError(f"state_dict[{name!r}] has dtype {tensor.dtype}; drafter weights are floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise ExportError(
                f"state_dict[{name!r}] holds NaN/Inf values; export a checkpoint from before the divergence "
                "(`dflash-stages inspect RUN --scan` names every bad tensor)"
            )
        tensors[name] = tensor.to(device="cpu", dtype=torch.bfloat16).contiguous()

    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        save_safetensors(tensors, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        _write_json(staging / CONFIG_FILE, config_json)
        provenance = {
            "format": "dflash-serving",
            "format_version": EXPORT_FORMAT_VERSION,
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "dflash_stages_version": dflash.__version__,
            "torch_version": torch.__version__,
            "layer_id_convention": LAYER_ID_CONVENTION,
            "layer_id_note": "target_layer_ids are 0-based decoder layers whose OUTPUT is tapped "
            "(transformers hidden_states[id + 1]); engines add the +1 themselves",
            "target": dict(target_info) if target_info is not None else None,
            "source": dict(source) if source is not None else None,
            "drafter_config": config_dict(config),
            "num_parameters": int(sum(t.numel() for t in tensors.values())),
            "files": {
                name: {"sha256": sha256_file(staging / name), "bytes": (staging / name).stat().st_size}
                for name in (WEIGHTS_FILE, CONFIG_FILE)
            },
        }
        _write_json(staging / PROVENANCE_FILE, provenance)
        for name in (WEIGHTS_FILE, CONFIG_FILE, PROVENANCE_FILE):  # safetensors writes 0600; a serving engine often
            (staging / name).chmod(0o644)                          # runs as another user
        staging.chmod(0o755)
        _replace_dir(staging, destination, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


# --------------------------------------------------------------------------------------------------------------
# Strict loading
# --------------------------------------------------------------------------------------------------------------


def read_exported(
    path: str | os.PathLike[str], *, verify_hashes: bool = True, check_finite: bool = True
) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """Read and validate an export folder without building a ``DFlashConfig``.

    Returns:
        ``(serving_config, provenance, state_dict)``; ``provenance`` is ``{}`` for exports without
        ``dflash_export.json``; tensors are bfloat16 on CPU.

    Raises:
        ExportError: any rule of the serving format is broken (see :func:`load_exported`).
    """
    import torch
    from safetensors import safe_open

    folder = Path(path).expanduser()
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for required in (config_path, weights_path):
        if not required.is_file():
            raise ExportError(f"{required} is missing; an export folder holds {CONFIG_FILE} and {WEIGHTS_FILE}")
    extra_weights = sorted(p.name for p in folder.glob("*.safetensors") if p.name != WEIGHTS_FILE)
    extra_weights += sorted(p.name for p in folder.glob("*.bin"))
    if extra_weights:
        raise ExportError(f"{folder}: unexpected weight files {extra_weights}; engines may load them too")
    provenance: dict[str, Any] = {}
    provenance_path = folder / PROVENANCE_FILE
    if provenance_path.is_file():
        provenance = load_json(provenance_path, error=ExportError, fix=_REEXPORT)
        if verify_hashes:
            for name, record in provenance.get("files", {}).items():
                actual = sha256_file(folder / name)
                if actual != record.get("sha256"):
                    raise ExportError(
                        f"{folder / name}: sha256 {actual} differs from {record.get('sha256')} recorded in "
                        f"{PROVENANCE_FILE}; the file was modified or truncated after export. Re-export it"
                    )

    try:
        config = load_json(config_path, error=ExportError, fix=_REEXPORT)
    except FileNotFoundError:
        raise ExportError(f"{config_path}: missing; {_REEXPORT}") from None
    validate_serving_config(config, config_path)

    try:
        handle = safe_open(str(weights_path), framework="pt", device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ExportError(f"{weights_path}: not a readable safetensors file ({error})") from None
    with handle:
        names = list(handle.keys())
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
        check_state_dict(shapes, drafter_config_dict_from_serving(config), where=str(weights_path))
        state_dict: dict[str, torch.Tensor] = {}
        for name in names:
            tensor = handle.get_tensor(name)
            if tensor.dtype != torch.bfloat16:
                raise ExportError(f"{weights_path}: tensor {name!r} is {tensor.dtype}, the serving format stores bfloat16")
            if check_finite and not bool(torch.isfinite(tensor).all()):
                raise ExportError(f"{weights_path}: tensor {name!r} holds NaN/Inf values")
            state_dict[name] = tensor
    return config, provenance, state_dict


def load_exported(
    path: str | os.PathLike[str],
    *,
    expected_target: Mapping[str, Any] | None = None,
    verify_hashes: bool = True,
    check_finite: bool = True,
) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """Strict loader of a serving-format export: the proof an export is loadable (docs/dflash.md: one engine skips
    names it does not know without a word, so this loader fails on them).

    Checks: every fixed key of the format (architectures, model_type, dtype, tie_word_embeddings, layer_types,
    sliding window off, no ``eagle_aux_hidden_state_layer_ids``); ``target_layer_ids`` strictly increasing in
    ``[0, num_target_layers - 2]``; ``mask_token_id`` a row of the target vocabulary; ``rope_theta``/``rope_scaling``
    agree with ``rope_parameters``; tensor names exactly the expected set (no unknown, missing or misnamed tensor),
    shapes, bfloat16, finite values; file hashes recorded in ``dflash_export.json``.

    Args:
        path: the export folder.
        expected_target: a ``TargetIdentity`` dict; when the export records its target, ``content_hash`` must match.
        verify_hashes: check the sha256 of ``model.safetensors``/``config.json`` against ``dflash_export.json``.
        check_finite: reject tensors holding NaN/Inf.

    Returns:
        ``(DFlashConfig, state_dict)`` with bfloat16 CPU tensors under the serving names, ready for
        ``DFlashDrafter(config).load_state_dict(state_dict)``.

    Raises:
        ExportError: the folder breaks a rule; the message names the file, the key or tensor, expected vs got.
        MismatchError: the export was made for another target than ``expected_target``.
    """
    config, provenance, state_dict = read_exported(path, verify_hashes=verify_hashes, check_finite=check_finite)
    if expected_target is not None and provenance.get("target"):
        check_target_identity(provenance["target"], expected_target,
                              where=f"{path} (exported for target {provenance['target'].get('name')!r})",
                              fix=f"use the target the drafter was trained on, not {expected_target.get('name')!r}")
    try:
        drafter_config = DFlashConfig.from_dict(drafter_config_dict_from_serving(config))
    except (TypeError, ValueError) as error:
        raise ExportError(f"{Path(path) / CONFIG_FILE}: does not make a valid drafter config ({error})") from None
    return drafter_config, state_dict


def load_exported_drafter(
    path: str | os.PathLike[str], *, target: Any = None
) -> tuple[Any, DFlashConfig, dict[str, Any]]:
    """A ``DFlashDrafter`` built from an export through the strict loader (what :func:`load_drafter`
    returns for export folders).

    Args:
        path: the export folder.
        target: a ``LoadedTarget`` or transformers causal LM; its embedding and LM head are attached, its identity
            (for a ``LoadedTarget``) is checked against the export's provenance, and the embedding/LM-head hashes
            recorded at training time must match (bf16-rounded when ``target`` is loaded in another dtype).

    Returns:
        ``(drafter, config, target_info)``: the drafter in eval mode on CPU with float32 parameters (the bf16
        export values, upcast exactly), its config, and the provenance's target record (``{}`` if none).

    Raises:
        ExportError: see :func:`load_exported`. MismatchError: ``target`` is not the export's target.
    """
    from dflash.drafter import DFlashDrafter

    identity = getattr(target, "identity", None)
    config, state_dict = load_exported(path, expected_target=identity.to_dict() if identity is not None else None)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state_dict, strict=True)
    drafter.eval()
    provenance_path = Path(path) / PROVENANCE_FILE
    target_info = ((load_json(provenance_path, error=ExportError, fix=_REEXPORT).get("target") or {})
                   if provenance_path.is_file() else {})
    if target is not None:
        from dflash.training.checkpoint import check_target_weights

        model = getattr(target, "model", target)
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        # Compares the bf16-rounded hashes when the target is loaded in another dtype than at training (fp32 on
        # CPU vs bf16 on GPU); the as-is hashes otherwise.
        check_target_weights(target_info, embed, head, where=str(path))
        drafter.attach_target(embed, head)
    return drafter, config, target_info


def drafter_source(path: str | Path) -> Path:
    """The folder a drafter at ``path`` is read from: an exported serving folder itself, else the checkpoint folder
    a run folder's ``latest`` names (or ``path``, a checkpoint folder).

    Raises:
        CheckpointError: nothing loadable at ``path`` (as :func:`load_drafter`).
    """
    from dflash.training.checkpoint import resolve_checkpoint

    path = Path(path)
    return path if _is_export_folder(path) else resolve_checkpoint(path)


def _is_export_folder(path: Path) -> bool:
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        architectures = load_json(config, error=CheckpointError, fix="").get("architectures", [])
        return isinstance(architectures, list) and "DFlashDraftModel" in architectures
    except (OSError, CheckpointError):
        return False


def _target_weights(target: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding weight [V, H], LM head weight [V, H]) of a ``LoadedTarget`` or a transformers causal LM."""
    model = getattr(target, "model", target)
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def load_drafter(path: str | Path, *, target: Any = None) -> tuple[Any, Any, dict[str, Any]]:
    """Load a drafter from a run folder (its ``latest``), a checkpoint folder or an exported serving folder.

    Args:
        path: see above.
        target: a ``LoadedTarget`` or transformers causal LM whose embedding and LM head are attached to the
            drafter (checked against the hashes recorded at training time); ``None`` leaves them unattached.

    Returns:
        ``(drafter, config, target_info)``: a ``DFlashDrafter`` in eval mode on CPU (fp32 for checkpoints), its
        ``DFlashConfig``, and the recorded target information (identity, ``target_spec``, hashes).

    Raises:
        CheckpointError: nothing loadable at ``path``; MismatchError: ``target`` is not the training target.
    """
    from dflash.drafter import DFlashConfig, DFlashDrafter
    from dflash.training.checkpoint import check_target_weights, load_checkpoint

    path = Path(path)
    if _is_export_folder(path):
        return load_exported_drafter(path, target=target)

    checkpoint = load_checkpoint(path, with_training_state=False)
    config = DFlashConfig.from_dict(checkpoint.drafter_config)
    drafter = DFlashDrafter(config)
    missing, unexpected = drafter.load_state_dict(checkpoint.model_state, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{checkpoint.path / 'model.safetensors'} does not match the drafter built from drafter_config.json: "
            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}; the checkpoint is from another version"
        )
    if target is not None:
        embed_weight, lm_head_weight = _target_weights(target)
        tied = lm_head_weight is None or lm_head_weight.data_ptr() == embed_weight.data_ptr()
        drafter.attach_target(embed_weight, None if tied else lm_head_weight)
        check_target_weights(checkpoint.target_info, embed_weight, None if tied else lm_head_weight, where=str(checkpoint.path))
    drafter.eval()
    return drafter, config, checkpoint.target_info


# --------------------------------------------------------------------------------------------------------------
# Checkpoints (docs/training.md "Run folder") -> export
# --------------------------------------------------------------------------------------------------------------


def _rope_of_target_config(target_config: Any) -> dict[str, Any]:
    text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return rope_parameters_from_legacy(*rope_settings_from_target(text_config))


def check_against_target(config: DFlashConfig | Mapping[str, Any], target_config: Any, *, where: str) -> None:
    """The drafter config agrees with the target's transformers config: hidden size, vocabulary, layer count,
    RoPE (theta and scaling) and positions (docs/dflash.md, "Ways to get it silently wrong").

    Raises:
        MismatchError: naming the field, both values and the fix.
    """
    fields = config_dict(config)
    pairs = {
        "hidden_size": (fields["hidden_size"], int(target_config.hidden_size)),
        "vocab_size": (fields["vocab_size"], int(target_config.vocab_size)),
        "num_target_layers": (fields["num_target_layers"], int(target_config.num_hidden_layers)),
        "rope_parameters": (
            rope_parameters_from_legacy(fields["rope_theta"], fields.get("rope_scaling")),
            _rope_of_target_config(target_config),
        ),
    }
    for name, (drafter_value, target_value) in pairs.items():
        if drafter_value != target_value:
            raise MismatchError(
                f"{where}: drafter {name} is {drafter_value!r} but the target's is {target_value!r}; export with "
                "--target pointing at the target the drafter was trained on"
            )


def _check_target(
    config: Mapping[str, Any], target_info: Mapping[str, Any], target: str | os.PathLike[str] | None, *, where: str
) -> str | None:
    """Check the drafter config against its target (config and identity; no weights loaded) and return the
    tokenizer's string for ``mask_token_id``. The target is ``target`` or the ``target_spec`` recorded at training;
    a recorded spec that does not resolve on this machine only warns (an explicit ``target`` must resolve)."""
    from transformers import AutoConfig, AutoTokenizer

    spec = target if target is not None else target_info.get("target_spec")
    skipped = "RoPE/width/identity checks against the target and dflash_config.mask_token are skipped"
    if spec is None:
        warnings.warn(f"{where} records no target_spec and no --target was given: {skipped}", stacklevel=3)
        return None
    try:
        target_path = resolve_target_path(spec)
    except TargetError as error:
        if target is not None:
            raise
        warnings.warn(f"{where}: the recorded target {spec!r} is not available here ({error}); pass --target: {skipped}", stacklevel=3)
        return None
    check_against_target(config, AutoConfig.from_pretrained(target_path), where=where)
    if target_info.get("content_hash"):
        check_target_identity(target_info, target_identity(target_path),
                              where=f"{where}: trained on target {target_info.get('name')!r}",
                              fix=f"{spec!s} is another target; pass --target with the training target")
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    return tokenizer.convert_ids_to_tokens(int(config["mask_token_id"]))


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    target: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """Export a checkpoint (or a run's ``latest``) to the serving format, then prove it with the strict loader.

    Args:
        checkpoint: a checkpoint folder or a run folder.
        out_dir: the export folder.
        target: the target spec; default: ``target_spec`` recorded in the checkpoint's ``target.json``. Its config,
            identity and tokenizer (no weights) are read to check RoPE/widths/content hash and to name the mask
            token. When the recorded target cannot be found here, these checks are skipped with a warning.
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``(export_dir, provenance)``.

    Raises:
        CheckpointError, ExportError, MismatchError: see ``dflash.training.checkpoint.load_checkpoint``,
            :func:`export_drafter`, :func:`check_against_target`.
    """
    import torch

    from dflash.training.checkpoint import load_checkpoint

    loaded = load_checkpoint(checkpoint, with_training_state=False)
    checkpoint_dir, config, state_dict = loaded.path, loaded.drafter_config, loaded.model_state
    target_info, trainer_state = loaded.target_info, loaded.trainer_state
    mask_token = _check_target(config, target_info, target, where=str(checkpoint_dir))
    source = {
        "checkpoint": str(checkpoint_dir.absolute()),
        "step": trainer_state.get("step"),
        "epoch": trainer_state.get("epoch"),
        "checkpoint_weights_sha256": sha256_file(checkpoint_dir / WEIGHTS_FILE),
    }
    destination = export_drafter(
        state_dict,
        config,
        out_dir,
        target_info=target_info or None,
        source=source,
        mask_token=mask_token,
        overwrite=overwrite,
    )
    # Proof: the strict loader reads it back, and every tensor equals the bf16 cast of the checkpoint's.
    serving, provenance, reloaded = read_exported(destination)
    for name, tensor in state_dict.items():
        if not torch.equal(reloaded[name], tensor.to(torch.bfloat16)):
            raise ExportError(f"{destination / WEIGHTS_FILE}: tensor {name!r} differs from the checkpoint after reload")
    return destination, provenance
