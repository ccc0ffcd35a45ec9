"""Drafter configuration, derived from the target's transformers config.

The drafter copies the target's widths (hidden size, heads, KV heads, head_dim, intermediate size), RMSNorm epsilon
and RoPE settings (theta and scaling), so its exported Qwen3-style config is what vLLM (``qwen3_dflash.py``),
SGLang (``models/dflash.py``) and z-lab/dflash load (DFlash, arXiv 2602.06036, section 3).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from dflash.errors import ConfigError
from dflash.target.taps import tapped_layer_ids

__all__ = ["DFlashConfig", "DrafterTrainingConfig", "DEFAULT_NUM_DRAFT_LAYERS", "PAPER_GAMMA", "default_gamma", "select_mask_token_id",
           "rope_settings_from_target"]

#: Draft decoder layers when nothing sets them (the paper's 5); also the number of tapped target layers
#: (``dflash.target.taps``) when no command sets that.
DEFAULT_NUM_DRAFT_LAYERS = 5
#: The paper's loss decay gamma per block size.
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Loss decay gamma: the paper's 7 for B=16, 5 for B=10, 4 for B=8; other sizes interpolate ``1 + 3B/8``
    (the line through the B=8 and B=16 values)."""
    if block_size < 2:
        raise ConfigError(f"block_size must be >= 2, got {block_size}")
    return PAPER_GAMMA.get(block_size, 1.0 + 0.375 * block_size)


@dataclass(kw_only=True, slots=True)
class DFlashConfig:
    """Shape and conditioning of a DFlash drafter.

    Widths equal the target's; ``num_hidden_layers`` counts DRAFT layers; ``num_target_layers`` counts the
    target's decoder layers (the range the tapped ``target_layer_ids`` live in; tap ``l`` = output of decoder
    layer ``l`` = transformers ``hidden_states[l + 1]``).
    """

    hidden_size: int
    """Model width H, equal to the target's (the embedding and LM head are the target's)."""
    intermediate_size: int
    """SwiGLU inner width."""
    num_hidden_layers: int = 5
    """Number of draft decoder layers (paper: 5; also 3 and 8)."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention); divides ``num_attention_heads``."""
    head_dim: int
    """Per-head width."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency, from the target."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling dict of the target (``rope_type`` plus its parameters), ``None`` for plain RoPE."""
    max_position_embeddings: int = 32768
    """Longest position the RoPE tables are meant for (from the target)."""
    vocab_size: int
    """Rows of the target's embedding / LM head."""
    attention_bias: bool = False
    """Bias on the q/k/v/o projections (Qwen3: False)."""
    block_size: int = 16
    """Tokens per draft block B: the anchor token plus B - 1 masked positions."""
    mask_token_id: int
    """Embedding row used for the masked block positions; an existing, unused special token of the target."""
    target_layer_ids: list[int] = field(default_factory=list)
    """Tapped target layers (0-based decoder layers whose output is used), strictly increasing."""
    num_target_layers: int
    """Decoder layers of the target."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                     "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"DFlashConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"DFlashConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"DFlashConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.block_size, int) and self.block_size >= 2):
            raise ConfigError(f"DFlashConfig.block_size must be an integer >= 2, got {self.block_size!r}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"DFlashConfig.rms_norm_eps must be a positive finite float, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"DFlashConfig.rope_theta must be a positive finite float, got {self.rope_theta!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"DFlashConfig.rope_scaling must be a dict or None, got {self.rope_scaling!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"DFlashConfig.mask_token_id must be an existing embedding row in [0, {self.vocab_size}), "
                f"got {self.mask_token_id!r}; pick an unused special token of the target's tokenizer"
            )
        ids = [int(i) for i in self.target_layer_ids]
        if not ids:
            raise ConfigError("DFlashConfig.target_layer_ids must name at least one tapped target layer")
        if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise ConfigError(f"DFlashConfig.target_layer_ids must be strictly increasing, got {ids}")
        if ids[0] < 0 or ids[-1] >= self.num_target_layers - 1:
            raise ConfigError(
                f"DFlashConfig.target_layer_ids must lie in [0, {self.num_target_layers - 2}] (never the last "
                f"layer, whose transformers hidden state is after the final norm), got {ids}"
            )
        self.target_layer_ids = ids

    @property
    def num_taps(self) -> int:
        """n, the number of tapped target layers (the fc input is n * hidden_size wide)."""
        return len(self.target_layer_ids)

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers-5 style ``rope_parameters`` (``rope_type``, ``rope_theta`` and the scaling fields)."""
        params: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling:
            params.update(self.rope_scaling)
            params.setdefault("rope_type", params.pop("type", "default"))
        params["rope_theta"] = self.rope_theta
        return params

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (``from_dict`` inverts it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        """Build from ``to_dict()`` output.

        Raises:
            ConfigError: unknown or missing keys (named in the message).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"DFlashConfig.from_dict: unknown keys {unknown}; expected a subset of {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as error:
            raise ConfigError(f"DFlashConfig.from_dict: {error}") from error

    @classmethod
    def from_target_config(
        cls,
        target_config: Any,
        *,
        tokenizer: Any = None,
        num_draft_layers: int = DEFAULT_NUM_DRAFT_LAYERS,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
    ) -> DFlashConfig:
        """Derive the drafter config from the target's transformers config.

        Args:
            target_config: the target's ``PretrainedConfig`` (Llama, Qwen2/3, Mistral... any decoder config with
                the usual field names; multimodal configs are read through ``get_text_config()``).
            tokenizer: the target's tokenizer, used to pick ``mask_token_id`` when it is not given.
            num_draft_layers: draft decoder layers (paper default 5).
            block_size: tokens per draft block.
            mask_token_id: explicit mask token id; default from :func:`select_mask_token_id`.
            target_layer_ids: tapped layers; default one per draft layer (:func:`dflash.target.taps.tapped_layer_ids`).

        Raises:
            ConfigError: a field is invalid, or no mask token can be chosen (pass ``mask_token_id``).
        """
        text_config = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_target_layers = int(text_config.num_hidden_layers)
        heads = int(text_config.num_attention_heads)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        vocab_size = int(text_config.vocab_size)
        target_layer_ids = tapped_layer_ids(num_target_layers, num_draft_layers, target_layer_ids)
        if mask_token_id is None:
            if tokenizer is None:
                raise ConfigError(
                    "DFlashConfig.mask_token_id: no tokenizer given to choose one; pass mask_token_id= "
                    "(an unused special token id of the target) or tokenizer="
                )
            mask_token_id = select_mask_token_id(tokenizer, vocab_size=vocab_size)
        rope_theta, rope_scaling = rope_settings_from_target(text_config)
        return cls(
            hidden_size=int(text_config.hidden_size),
            intermediate_size=int(text_config.intermediate_size),
            num_hidden_layers=int(num_draft_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(getattr(text_config, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(getattr(text_config, "max_position_embeddings", 32768)),
            vocab_size=vocab_size,
            attention_bias=bool(getattr(text_config, "attention_bias", False)),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=list(target_layer_ids),
            num_target_layers=num_target_layers,
        )


#: ``DrafterTrainingConfig.distill`` choices (``dflash.drafter.loss.distill_loss``).
DISTILL_KINDS = ("none", "kl", "tv")


@dataclass(kw_only=True, slots=True)
class DrafterTrainingConfig:
    """The drafter and objective a training run chooses (``train.drafter``; ``[train.drafter]`` in a config file,
    ``--set train.drafter.block_size=8``). The rest of the drafter's shape (:class:`DFlashConfig`: widths, RoPE,
    vocabulary) is the target's; the trainer derives it from these settings and the target
    (:meth:`DFlashConfig.from_target_config`)."""

    num_draft_layers: int = field(default=DEFAULT_NUM_DRAFT_LAYERS, metadata={"help": "Draft decoder layers (the paper's recipe: 5)."})
    block_size: int = field(default=16, metadata={"help": "Draft block size B (the paper's recipe: 16)."})
    mask_token_id: int | None = field(default=None, metadata={"help": (
        "Mask token row of the target embedding (default: chosen from the tokenizer's unused special tokens).")})
    target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "Tapped target layer ids (default: the cache's); anything else is refused, as the cache holds only its taps.")})
    gamma: float | None = field(default=None, metadata={"help": (
        "Loss decay over block positions (dflash.drafter.loss); default by block size: 7 for 16, 5 for 10, 4 for 8.")})
    max_anchors_per_document: int = field(default=512, metadata={"help": (
        "Anchor budget per document per epoch (the paper's recipe: 512; on a CPU host, when nothing sets it: the "
        "cpu-small preset's).")})
    #: Initial draft layer weights: ``random`` (Normal(0, 0.02), norms at 1: transformers' Qwen3 init, as DFlash
    #: trains) or ``target`` (each draft layer a copy of a target decoder layer, the final norm the target's;
    #: ``dflash.drafter.target_init``). Only a fresh run reads it; a resumed run continues from its checkpoint.
    init: Literal["random", "target"] = "random"
    #: With ``init = "target"``: the 0-based target decoder layer copied into each draft layer (one per draft
    #: layer, repeats allowed); default the target's last ``num_draft_layers`` layers.
    init_target_layers: list[int] | None = None
    distill: Literal["none", "kl", "tv"] = field(default="none", metadata={"help": (
        "A loss term against the target's own next-token distribution, weighted like the CE by block position: "
        "none, kl (forward KL(p_target || q_drafter)) or tv (total variation); needs a cache extracted with "
        "final_tap.")})
    distill_weight: float = field(default=1.0, metadata={"help": (
        "Weight of the distill term in the loss (ignored with distill = none).")})
    ce_weight: float = field(default=1.0, metadata={"help": (
        "Weight of the cross-entropy on the target's tokens in the loss; 0 with a distill term trains on it alone.")})

    def __post_init__(self) -> None:
        if self.distill not in DISTILL_KINDS:
            raise ConfigError(f"distill must be one of {'|'.join(DISTILL_KINDS)}, got {self.distill!r}")
        for name in ("distill_weight", "ce_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.ce_weight == 0 and (self.distill == "none" or self.distill_weight == 0):
            raise ConfigError("ce_weight is 0 and there is no distill term: the loss would be 0; set ce_weight > 0, "
                              "or drafter.distill = kl|tv with distill_weight > 0")
        for name in ("num_draft_layers", "max_anchors_per_document"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.mask_token_id is not None and (not isinstance(self.mask_token_id, int) or self.mask_token_id < 0):
            raise ConfigError(f"mask_token_id must be a token id >= 0, or None to choose one of the tokenizer's unused "
                              f"special tokens, got {self.mask_token_id!r}")
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.init not in ("random", "target"):
            raise ConfigError(f"init must be one of random|target, got {self.init!r}")
        if self.init_target_layers is not None:
            if self.init != "target":
                raise ConfigError("init_target_layers is given but init is 'random'; set init = 'target' or drop it")
            self.init_target_layers = [int(i) for i in self.init_target_layers]
            if len(self.init_target_layers) != self.num_draft_layers:
                raise ConfigError(
                    f"init_target_layers has {len(self.init_target_layers)} layers, num_draft_layers is "
                    f"{self.num_draft_layers}: give one target layer per draft layer"
                )
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ConfigError(f"block_size must be an integer >= 2, got {self.block_size!r}")
        if self.gamma is not None and not (self.gamma > 0 and math.isfinite(self.gamma)):
            raise ConfigError(f"gamma must be a positive finite number, got {self.gamma!r}")

    def resolved_gamma(self) -> float:
        """``gamma``, or the default for ``block_size`` (:func:`default_gamma`)."""
        return float(self.gamma) if self.gamma is not None else default_gamma(self.block_size)


def rope_settings_from_target(text_config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a transformers config, reading ``rope_parameters`` (transformers 5) or the
    legacy ``rope_theta`` / ``rope_scaling`` fields. ``rope_scaling`` is ``None`` for plain RoPE."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type layout (Gemma-style configs)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(text_config, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(text_config, "rope_scaling", None) or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        return theta, None
    return theta, scaling


def select_mask_token_id(tokenizer: Any, *, vocab_size: int) -> int:
    """Pick the embedding row used for masked block positions.

    Order: the tokenizer's own mask token; else an unused special token, i.e. a special added token that is not
    bos/eos/pad/unk/sep/cls, does not appear in the chat template, and is an existing embedding row (below
    ``vocab_size``). Among those, a token whose text contains "mask", then "pad", then the highest id (for
    SmolLM2 that is ``<empty_output>`` = 16, one of the code-pretraining markers a chat never emits).

    Raises:
        ConfigError: none qualifies; the message asks for an explicit ``mask_token_id``.
    """
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and 0 <= int(mask_id) < vocab_size:
        return int(mask_id)
    used: set[int] = set()
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id"):
        value = getattr(tokenizer, attribute, None)
        if isinstance(value, int):
            used.add(value)
        elif isinstance(value, list):
            used.update(int(v) for v in value)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = "\n".join(str(t) for t in template.values())
    candidates: list[tuple[int, str]] = []
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        content = getattr(token, "content", str(token))
        if not getattr(token, "special", True) or token_id in used or not 0 <= token_id < vocab_size:
            continue
        if content and content in template:
            continue
        candidates.append((int(token_id), content))
    if not candidates:
        raise ConfigError(
            "DFlashConfig.mask_token_id: the tokenizer has no mask token and no unused special token; pass "
            "mask_token_id= explicitly (an existing embedding row the data never contains; never add a new row)"
        )
    for keyword in ("mask", "pad"):
        hits = [c for c in candidates if keyword in c[1].lower()]
        if hits:
            return max(hits)[0]
    return max(candidates)[0]
