"""Export a trained drafter in the serving format that vLLM, SGLang and z-lab's loader read, and load it back strictly.

An export folder holds three files (DFLASH.md "Serving format"):

- ``config.json``: a Qwen3 config (``model_type: "qwen3"``) with ``architectures: ["DFlashDraftModel"]``, top-level
  ``block_size`` and ``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids, ...}``,
  ``layer_types`` (all ``"full_attention"``), ``sliding_window: null``, ``use_sliding_window: false``,
  ``tie_word_embeddings: false``, ``dtype: "bfloat16"``, and both the legacy ``rope_theta`` / ``rope_scaling`` and
  transformers 5's ``rope_parameters``. Never ``eagle_aux_hidden_state_layer_ids`` (vLLM prefers it over
  ``dflash_config.target_layer_ids`` and applies no +1 shift to it).
- ``model.safetensors`` in bfloat16, names without a ``model.`` prefix (``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``, ``layers.{i}....``), no ``embed_tokens`` and no ``lm_head`` (the target's are used).
- ``dflash_export.json``: provenance (source checkpoint, target identity and embedding/LM-head hashes, the tap
  convention, sha256 of the two files above). Serving engines ignore it; :func:`load_exported` checks it.

Additive keys beyond DFLASH.md, each for a reader seen in the engines' code (vLLM ``qwen3_dflash.py``, SGLang
``models/dflash.py`` + ``speculative/dflash_utils.py``, z-lab ``dflash/model.py``):
``dflash_config.block_size`` (z-lab and SGLang read ``dflash_config`` before the top level), ``dflash_config.mask_token``
(SGLang versions that resolve the mask token by its string, default ``"<|MASK|>"``, and otherwise ADD a new token
to the tokenizer), ``is_causal: false`` (vLLM and z-lab read it before ``layer_types``), ``torch_dtype`` (loaders on
transformers 4), ``attention_dropout``, ``max_window_layers``, ``use_cache``.

Legend: H = hidden size, n = number of tapped target layers, I = intermediate size, hd = head_dim,
Nq / Nkv = attention / key-value heads, L = draft layers, V = vocab size.
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

from dflash.errors import ExportError, MismatchError, TargetError
from dflash.target import LAYER_ID_CONVENTION, validate_target_layer_ids

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
    "rope_parameters_from_legacy",
    "legacy_rope_from_parameters",
    "serving_config",
    "drafter_config_dict_from_serving",
    "expected_weight_shapes",
    "check_state_dict",
    "export_drafter",
    "read_exported",
    "load_exported",
    "load_exported_drafter",
    "check_against_target",
    "export_checkpoint",
    "sha256_file",
]

EXPORT_FORMAT_VERSION = 1
SERVING_ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "dflash_export.json"
#: Files of a training checkpoint folder (docs/INTERFACES.md "Checkpoints").
CHECKPOINT_CONFIG_FILE = "drafter_config.json"
CHECKPOINT_TARGET_FILE = "target.json"

# Keys whose values are fixed by the serving format (DFLASH.md); load_exported rejects anything else.
_FIXED_KEYS: dict[str, Any] = {
    "architectures": [SERVING_ARCHITECTURE],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
_REQUIRED_INT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
    "block_size",
    "num_target_layers",
)
_FORBIDDEN_KEYS = ("eagle_aux_hidden_state_layer_ids",)
_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


# --------------------------------------------------------------------------------------------------------------
# RoPE: legacy (rope_theta, rope_scaling) <-> transformers 5 rope_parameters
# --------------------------------------------------------------------------------------------------------------


def rope_parameters_from_legacy(rope_theta: float, rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    """transformers 5 ``rope_parameters`` from the legacy pair: ``{"rope_type", "rope_theta", **scaling}``.

    A legacy ``"type"`` key (transformers < 4.45) is read as ``"rope_type"``; no scaling means ``"default"``.
    """
    parameters: dict[str, Any] = {}
    if rope_scaling:
        parameters.update({key: value for key, value in rope_scaling.items() if key != "type"})
        if "rope_type" not in parameters and "type" in rope_scaling:
            parameters["rope_type"] = rope_scaling["type"]
        parameters.pop("rope_theta", None)
    parameters.setdefault("rope_type", "default")
    parameters["rope_theta"] = float(rope_theta)
    return parameters


def legacy_rope_from_parameters(rope_parameters: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """The legacy pair ``(rope_theta, rope_scaling)`` of a ``rope_parameters`` dict; ``rope_scaling`` is ``None``
    for plain (``"default"``) RoPE, as transformers 4 wrote it.

    Raises:
        ExportError: ``rope_parameters`` has no ``rope_theta``.
    """
    if "rope_theta" not in rope_parameters:
        raise ExportError(f"rope_parameters {dict(rope_parameters)} has no rope_theta")
    scaling = {key: value for key, value in rope_parameters.items() if key != "rope_theta"}
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        return float(rope_parameters["rope_theta"]), None
    return float(rope_parameters["rope_theta"]), scaling


# --------------------------------------------------------------------------------------------------------------
# Config: DFlashConfig <-> serving config.json
# --------------------------------------------------------------------------------------------------------------


def _config_dict(config: DFlashConfig | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    return dict(config.to_dict())


def serving_config(config: DFlashConfig | Mapping[str, Any], *, mask_token: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of an export, from a drafter config (DFLASH.md "Serving format").

    Args:
        config: a ``DFlashConfig`` or its ``to_dict()``; fields used: hidden_size, intermediate_size,
            num_hidden_layers (draft layers), num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
            rope_theta, rope_scaling, max_position_embeddings, vocab_size, attention_bias, block_size,
            mask_token_id, target_layer_ids, num_target_layers.
        mask_token: the tokenizer's string for ``mask_token_id``; written as ``dflash_config.mask_token`` so SGLang
            versions that look the mask token up by string find the same row.

    Raises:
        ExportError: a required field is missing.
    """
    fields = _config_dict(config)
    missing = [
        name
        for name in (*_REQUIRED_INT_KEYS, "rms_norm_eps", "rope_theta", "mask_token_id", "target_layer_ids")
        if name not in fields
    ]
    if missing:
        raise ExportError(f"drafter config lacks {missing}; got fields {sorted(fields)}")
    num_layers = int(fields["num_hidden_layers"])
    rope_scaling = fields.get("rope_scaling")
    rope_parameters = rope_parameters_from_legacy(fields["rope_theta"], rope_scaling)
    rope_theta, legacy_scaling = legacy_rope_from_parameters(rope_parameters)
    dflash_config: dict[str, Any] = {
        "mask_token_id": int(fields["mask_token_id"]),
        "target_layer_ids": [int(i) for i in fields["target_layer_ids"]],
        "block_size": int(fields["block_size"]),
    }
    if mask_token is not None:
        dflash_config["mask_token"] = str(mask_token)
    return {
        "architectures": [SERVING_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": int(fields["hidden_size"]),
        "intermediate_size": int(fields["intermediate_size"]),
        "num_hidden_layers": num_layers,
        "num_attention_heads": int(fields["num_attention_heads"]),
        "num_key_value_heads": int(fields["num_key_value_heads"]),
        "head_dim": int(fields["head_dim"]),
        "rms_norm_eps": float(fields["rms_norm_eps"]),
        "attention_bias": bool(fields.get("attention_bias", False)),
        "attention_dropout": 0.0,
        "max_position_embeddings": int(fields["max_position_embeddings"]),
        "vocab_size": int(fields["vocab_size"]),
        "block_size": int(fields["block_size"]),
        "num_target_layers": int(fields["num_target_layers"]),
        "dflash_config": dflash_config,
        "layer_types": ["full_attention"] * num_layers,
        "is_causal": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": num_layers,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "rope_theta": rope_theta,
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope_parameters,
    }


def _fail(path: Path, message: str) -> ExportError:
    return ExportError(f"{path}: {message}")


def _validate_serving_config(config: Mapping[str, Any], path: Path) -> None:
    """Every rule of the serving format on a parsed ``config.json``; raises ExportError naming the key."""
    for key, expected in _FIXED_KEYS.items():
        if key not in config:
            raise _fail(path, f"missing key {key!r} (expected {expected!r}); re-export with `dflash-stages export`")
        if config[key] != expected:
            raise _fail(path, f"{key} is {config[key]!r}, expected {expected!r}")
    for key in _FORBIDDEN_KEYS:
        if key in config:
            raise _fail(
                path,
                f"{key} must not be written: vLLM prefers it over dflash_config.target_layer_ids and applies no +1 "
                "shift, so the drafter would read the wrong layers; remove the key",
            )
    for key in _REQUIRED_INT_KEYS:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise _fail(path, f"{key} must be a positive integer, got {value!r}")
    if config["block_size"] < 2:
        raise _fail(path, f"block_size must be >= 2 (one anchor and at least one drafted token), got {config['block_size']}")
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise _fail(path, f"rms_norm_eps must be a positive number, got {eps!r}")
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types != ["full_attention"] * num_layers:
        raise _fail(
            path,
            f"layer_types must be {num_layers} x 'full_attention' (the drafter attends its block bidirectionally, "
            f"no sliding window), got {layer_types!r}",
        )
    if config.get("is_causal", False) is not False:
        raise _fail(path, f"is_causal must be false (block attention is bidirectional), got {config['is_causal']!r}")

    dflash_config = config.get("dflash_config")
    if not isinstance(dflash_config, Mapping):
        raise _fail(path, f"dflash_config must be an object with mask_token_id and target_layer_ids, got {dflash_config!r}")
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in dflash_config:
            raise _fail(path, f"dflash_config lacks {key!r}")
    mask_token_id = dflash_config["mask_token_id"]
    vocab_size = config["vocab_size"]
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < vocab_size:
        raise _fail(
            path,
            f"dflash_config.mask_token_id {mask_token_id!r} is not a row of the target embedding [0, {vocab_size}); "
            "the mask token must be an existing (unused special) token of the target",
        )
    layer_ids = dflash_config["target_layer_ids"]
    if not isinstance(layer_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
        raise _fail(path, f"dflash_config.target_layer_ids must be a list of integers, got {layer_ids!r}")
    try:
        validate_target_layer_ids(layer_ids, config["num_target_layers"])
    except TargetError as error:
        raise _fail(path, f"dflash_config.target_layer_ids: {error}") from None
    if "block_size" in dflash_config and dflash_config["block_size"] != config["block_size"]:
        raise _fail(
            path,
            f"dflash_config.block_size {dflash_config['block_size']!r} disagrees with block_size {config['block_size']!r}; "
            "engines read one or the other",
        )

    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        if key not in config:
            raise _fail(
                path,
                f"missing {key!r}: write the legacy rope_theta/rope_scaling AND rope_parameters (loaders read either)",
            )
    rope_parameters = config["rope_parameters"]
    if not isinstance(rope_parameters, Mapping) or "rope_theta" not in rope_parameters:
        raise _fail(path, f"rope_parameters must be an object with rope_theta, got {rope_parameters!r}")
    if config["rope_scaling"] is not None and not isinstance(config["rope_scaling"], Mapping):
        raise _fail(path, f"rope_scaling must be null or an object, got {config['rope_scaling']!r}")
    from_legacy = rope_parameters_from_legacy(config["rope_theta"], config["rope_scaling"])
    normalized = rope_parameters_from_legacy(rope_parameters["rope_theta"], rope_parameters)
    if from_legacy != normalized:
        raise _fail(
            path,
            f"RoPE keys disagree: rope_theta={config['rope_theta']!r}, rope_scaling={config['rope_scaling']!r} imply "
            f"{from_legacy}, but rope_parameters={dict(rope_parameters)}; engines on transformers 4 and 5 would "
            "rotate differently. Re-export so both come from the target's RoPE",
        )


def drafter_config_dict_from_serving(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``DFlashConfig`` fields of a (validated) serving ``config.json``."""
    rope_theta, rope_scaling = legacy_rope_from_parameters(
        rope_parameters_from_legacy(config["rope_parameters"]["rope_theta"], config["rope_parameters"])
    )
    dflash_config = config["dflash_config"]
    return {
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "rms_norm_eps": float(config["rms_norm_eps"]),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": config["max_position_embeddings"],
        "vocab_size": config["vocab_size"],
        "attention_bias": bool(config.get("attention_bias", False)),
        "block_size": config["block_size"],
        "mask_token_id": dflash_config["mask_token_id"],
        "target_layer_ids": list(dflash_config["target_layer_ids"]),
        "num_target_layers": config["num_target_layers"],
    }


# --------------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------------


def expected_weight_shapes(config: DFlashConfig | Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight name of the serving format with its shape (DFLASH.md; transformers Qwen3 names).

    ``fc.weight [H, n*H]``, ``hidden_norm.weight [H]``, ``norm.weight [H]``, per layer ``i``: norms ``[H]``,
    ``q_proj [Nq*hd, H]``, ``k_proj``/``v_proj [Nkv*hd, H]``, ``o_proj [H, Nq*hd]``, ``q_norm``/``k_norm [hd]``,
    ``gate_proj``/``up_proj [I, H]``, ``down_proj [H, I]``; with ``attention_bias`` also the q/k/v/o biases.
    """
    fields = _config_dict(config)
    hidden = int(fields["hidden_size"])
    head_dim = int(fields["head_dim"])
    q_width = int(fields["num_attention_heads"]) * head_dim
    kv_width = int(fields["num_key_value_heads"]) * head_dim
    intermediate = int(fields["intermediate_size"])
    num_taps = len(fields["target_layer_ids"])
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, num_taps * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_width, hidden),
        "self_attn.k_proj.weight": (kv_width, hidden),
        "self_attn.v_proj.weight": (kv_width, hidden),
        "self_attn.o_proj.weight": (hidden, q_width),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
    }
    assert set(per_layer) == set(_LAYER_WEIGHTS)
    if fields.get("attention_bias", False):
        per_layer.update(
            {
                "self_attn.q_proj.bias": (q_width,),
                "self_attn.k_proj.bias": (kv_width,),
                "self_attn.v_proj.bias": (kv_width,),
                "self_attn.o_proj.bias": (hidden,),
            }
        )
    for layer_idx in range(int(fields["num_hidden_layers"])):
        for name, shape in per_layer.items():
            shapes[f"layers.{layer_idx}.{name}"] = shape
    return shapes


def check_state_dict(
    shapes: Mapping[str, tuple[int, ...]], config: DFlashConfig | Mapping[str, Any], *, where: str
) -> None:
    """Names and shapes of a drafter state dict against the serving format; no tensor data is read.

    Args:
        shapes: name -> shape of every tensor found.
        config: the drafter config the tensors should match.
        where: the file named in errors.

    Raises:
        ExportError: unknown names (``model.`` prefix, ``embed_tokens``, ``lm_head``...), missing names, or a wrong
            shape; every offender is listed.
    """
    expected = expected_weight_shapes(config)
    unknown = sorted(set(shapes) - set(expected))
    missing = sorted(set(expected) - set(shapes))
    problems: list[str] = []
    if unknown:
        hints = []
        if any(name.startswith("model.") for name in unknown):
            hints.append("names must not carry a 'model.' prefix")
        if any("embed_tokens" in name or "lm_head" in name for name in unknown):
            hints.append("embed_tokens/lm_head must not be stored (engines would use them instead of the target's)")
        problems.append(f"unknown tensor names {unknown}" + (f" ({'; '.join(hints)})" if hints else ""))
    if missing:
        problems.append(f"missing tensor names {missing}")
    wrong = [
        f"{name}: expected shape {list(expected[name])}, got {list(shapes[name])}"
        for name in sorted(set(shapes) & set(expected))
        if tuple(shapes[name]) != tuple(expected[name])
    ]
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong))
    if problems:
        raise ExportError(
            f"{where}: weights do not match the serving format of a {int(_config_dict(config)['num_hidden_layers'])}-layer "
            f"drafter: " + " | ".join(problems)
        )


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


def _replace_dir(staging: Path, destination: Path, *, overwrite: bool) -> None:
    """Move a finished staging folder to ``destination``; the old folder (if allowed) goes only after success."""
    if destination.exists():
        if not overwrite:
            raise ExportError(f"{destination} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
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
    """
    import torch
    from safetensors.torch import save_file

    import dflash

    destination = Path(out_dir).expanduser().absolute()
    if destination.exists() and not overwrite:
        raise ExportError(f"{destination} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    config_json = serving_config(config, mask_token=mask_token)
    _validate_serving_config(config_json, destination / CONFIG_FILE)
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
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
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
            "drafter_config": _config_dict(config),
            "num_parameters": int(sum(t.numel() for t in tensors.values())),
            "files": {
                name: {"sha256": sha256_file(staging / name), "bytes": (staging / name).stat().st_size}
                for name in (WEIGHTS_FILE, CONFIG_FILE)
            },
        }
        _write_json(staging / PROVENANCE_FILE, provenance)
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
        provenance = json.loads(provenance_path.read_text())
        if verify_hashes:
            for name, record in provenance.get("files", {}).items():
                actual = sha256_file(folder / name)
                if actual != record.get("sha256"):
                    raise ExportError(
                        f"{folder / name}: sha256 {actual} differs from {record.get('sha256')} recorded in "
                        f"{PROVENANCE_FILE}; the file was modified or truncated after export. Re-export it"
                    )

    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ExportError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ExportError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    _validate_serving_config(config, config_path)

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
    """Strict loader of a serving-format export: the proof an export is loadable (DFLASH.md: one engine skips
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
    from dflash.drafter import DFlashConfig

    config, provenance, state_dict = read_exported(path, verify_hashes=verify_hashes, check_finite=check_finite)
    if expected_target is not None and provenance.get("target"):
        recorded = provenance["target"].get("content_hash")
        if recorded is not None and recorded != expected_target.get("content_hash"):
            raise MismatchError(
                f"{path}: exported for target {provenance['target'].get('name')!r} ({recorded}), but the expected "
                f"target is {expected_target.get('name')!r} ({expected_target.get('content_hash')}); use the target "
                "the drafter was trained on"
            )
    try:
        drafter_config = DFlashConfig.from_dict(drafter_config_dict_from_serving(config))
    except (TypeError, ValueError) as error:
        raise ExportError(f"{Path(path) / CONFIG_FILE}: does not make a valid drafter config ({error})") from None
    return drafter_config, state_dict


def load_exported_drafter(
    path: str | os.PathLike[str], *, target: Any = None
) -> tuple[Any, DFlashConfig, dict[str, Any]]:
    """A ``DFlashDrafter`` built from an export through the strict loader (what ``dflash.checkpoint.load_drafter``
    returns for export folders).

    Args:
        path: the export folder.
        target: a ``LoadedTarget`` or transformers causal LM; its embedding and LM head are attached, its identity
            (for a ``LoadedTarget``) is checked against the export's provenance, and the embedding/LM-head hashes
            recorded at training time must match.

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
    target_info = (json.loads(provenance_path.read_text()).get("target") or {}) if provenance_path.is_file() else {}
    if target is not None:
        model = getattr(target, "model", target)
        drafter.attach_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        recorded = target_info.get("weight_hashes") or {}
        actual = drafter.target_weight_hashes()
        for key, value in recorded.items():
            if actual.get(key) != value:
                raise MismatchError(
                    f"{path}: the target's {key} hash {actual.get(key)} differs from {value} recorded at training; "
                    "attach the target the drafter was trained with"
                )
    return drafter, config, target_info


# --------------------------------------------------------------------------------------------------------------
# Checkpoints (docs/INTERFACES.md "Checkpoints") -> export
# --------------------------------------------------------------------------------------------------------------


def _rope_of_target_config(target_config: Any) -> dict[str, Any]:
    from dflash.drafter.config import rope_settings_from_target

    text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return rope_parameters_from_legacy(*rope_settings_from_target(text_config))


def check_against_target(config: DFlashConfig | Mapping[str, Any], target_config: Any, *, where: str) -> None:
    """The drafter config agrees with the target's transformers config: hidden size, vocabulary, layer count,
    RoPE (theta and scaling) and positions (DFLASH.md "Known ways to get it silently wrong").

    Raises:
        MismatchError: naming the field, both values and the fix.
    """
    fields = _config_dict(config)
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
        target: the target spec; default: ``target_spec`` recorded in the checkpoint's ``target.json``. Its config
            and tokenizer (no weights) are read to check RoPE/widths and to name the mask token. When no target
            can be found, these checks are skipped with a warning.
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``(export_dir, provenance)``.

    Raises:
        CheckpointError, ExportError, MismatchError: see ``dflash.checkpoint.load_checkpoint``,
            :func:`export_drafter`, :func:`check_against_target`.
    """
    import torch

    from dflash.checkpoint import load_checkpoint

    loaded = load_checkpoint(checkpoint, with_training_state=False)
    checkpoint_dir, config, state_dict = loaded.path, loaded.drafter_config, loaded.model_state
    target_info, trainer_state = loaded.target_info, loaded.trainer_state
    spec = target if target is not None else target_info.get("target_spec")
    mask_token: str | None = None
    if spec is not None:
        from transformers import AutoConfig, AutoTokenizer

        from dflash.target import resolve_target_path, target_identity

        target_path = resolve_target_path(spec)
        check_against_target(config, AutoConfig.from_pretrained(target_path), where=str(checkpoint_dir))
        if target is not None and target_info.get("content_hash"):
            identity = target_identity(target_path)
            if identity.content_hash != target_info["content_hash"]:
                raise MismatchError(
                    f"{checkpoint_dir}: trained on target {target_info.get('name')!r} ({target_info['content_hash']}), "
                    f"but --target {spec!s} is {identity.name!r} ({identity.content_hash}); pass the training target"
                )
        tokenizer = AutoTokenizer.from_pretrained(target_path)
        mask_token = tokenizer.convert_ids_to_tokens(int(config["mask_token_id"]))
    else:
        warnings.warn(
            f"{checkpoint_dir} records no target_spec and no --target was given: RoPE/width checks against the "
            "target and dflash_config.mask_token are skipped",
            stacklevel=2,
        )
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
