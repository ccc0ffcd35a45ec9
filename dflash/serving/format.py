"""The serving format of a DFlash drafter: what vLLM, SGLang and z-lab's loader read (docs/dflash.md, "Serving format").

Pure rules, no I/O: the ``config.json`` derived from a ``DFlashConfig`` (:func:`serving_config`), its validation
(:func:`validate_serving_config`), the inverse mapping (:func:`drafter_config_dict_from_serving`), the expected
weight names and shapes (:func:`expected_weight_shapes`, :func:`check_state_dict`), and the RoPE key conversions.
Writing and strict loading live in :mod:`dflash.serving.export`.

``config.json``: a Qwen3 config (``model_type: "qwen3"``) with ``architectures: ["DFlashDraftModel"]``, top-level
``block_size`` and ``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids, ...}``, ``layer_types``
(all ``"full_attention"``), ``sliding_window: null``, ``use_sliding_window: false``, ``tie_word_embeddings: false``,
``dtype: "bfloat16"``, and both the legacy ``rope_theta`` / ``rope_scaling`` and transformers 5's
``rope_parameters``. Never ``eagle_aux_hidden_state_layer_ids`` (vLLM prefers it over
``dflash_config.target_layer_ids`` and applies no +1 shift to it). Weights: ``model.safetensors`` in bfloat16,
names without a ``model.`` prefix, no ``embed_tokens`` and no ``lm_head``.

Additive keys beyond docs/dflash.md, each for a reader seen in the engines' code (vLLM ``qwen3_dflash.py``, SGLang
``models/dflash.py`` + ``speculative/dflash_utils.py``, z-lab ``dflash/model.py``):
``dflash_config.block_size`` (z-lab and SGLang read ``dflash_config`` before the top level), ``dflash_config.mask_token``
(SGLang versions that resolve the mask token by its string, default ``"<|MASK|>"``, and otherwise ADD a new token
to the tokenizer), ``is_causal: false`` (vLLM and z-lab read it before ``layer_types``), ``torch_dtype`` (loaders on
transformers 4), ``attention_dropout``, ``max_window_layers``, ``use_cache``.

Legend: H = hidden size, n = number of tapped target layers, I = intermediate size, hd = head_dim,
Nq / Nkv = attention / key-value heads, L = draft layers, V = vocab size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.errors import ExportError, TargetError
from dflash.target.taps import validate_target_layer_ids

if TYPE_CHECKING:
    from dflash.drafter import DFlashConfig

__all__ = [
    "EXPORT_FORMAT_VERSION",
    "SERVING_ARCHITECTURE",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "PROVENANCE_FILE",
    "rope_parameters_from_legacy",
    "legacy_rope_from_parameters",
    "serving_config",
    "validate_serving_config",
    "drafter_config_dict_from_serving",
    "expected_weight_shapes",
    "check_state_dict",
]

EXPORT_FORMAT_VERSION = 1
SERVING_ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "dflash_export.json"

# Keys whose values are fixed by the serving format (docs/dflash.md); load_exported rejects anything else.
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


def config_dict(config: DFlashConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A ``DFlashConfig`` or its dict as a plain dict."""
    if isinstance(config, Mapping):
        return dict(config)
    return dict(config.to_dict())


def serving_config(config: DFlashConfig | Mapping[str, Any], *, mask_token: str | None = None) -> dict[str, Any]:
    """The ``config.json`` of an export, from a drafter config (docs/dflash.md, "Serving format").

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
    fields = config_dict(config)
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


def validate_serving_config(config: Mapping[str, Any], path: Path) -> None:
    """Every rule of the serving format on a parsed ``config.json`` read from ``path``.

    Raises:
        ExportError: naming ``path``, the key, expected vs got, and the fix.
    """
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
    """Every weight name of the serving format with its shape (docs/dflash.md; transformers Qwen3 names).

    ``fc.weight [H, n*H]``, ``hidden_norm.weight [H]``, ``norm.weight [H]``, per layer ``i``: norms ``[H]``,
    ``q_proj [Nq*hd, H]``, ``k_proj``/``v_proj [Nkv*hd, H]``, ``o_proj [H, Nq*hd]``, ``q_norm``/``k_norm [hd]``,
    ``gate_proj``/``up_proj [I, H]``, ``down_proj [H, I]``; with ``attention_bias`` also the q/k/v/o biases.
    """
    fields = config_dict(config)
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
            f"{where}: weights do not match the serving format of a {int(config_dict(config)['num_hidden_layers'])}-layer "
            f"drafter: " + " | ".join(problems)
        )

