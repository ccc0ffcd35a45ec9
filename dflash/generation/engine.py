"""The generation engine interface: token ids of a prompt in, token ids of the target's response out.

Every engine (transformers on the target's GPUs, OpenAI-compatible servers) implements :class:`GenerationEngine`.
The caller (``stages/generate.py``) renders chat templates, tokenizes prompts, regenerates multi-turn
conversations turn by turn on the model's own history, and builds the contract-1 corpus; an engine only continues
prompts. Token ids are those of the target's tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from dflash.errors import ConfigError

__all__ = ["SamplingSettings", "GenerationRequest", "GenerationResult", "GenerationEngine", "FinishReason", "TokenSource"]

#: ``"stop"``: the model produced an end-of-sequence / stop token (included in ``token_ids``); ``"length"``: the
#: ``max_new_tokens`` limit (or the context length) was reached.
FinishReason = Literal["stop", "length"]
#: ``"engine"``: ids as the engine generated them; ``"retokenized"``: the engine returned text only, and the ids are
#: the target tokenizer's encoding of that text (may differ from what the model generated at token boundaries).
TokenSource = Literal["engine", "retokenized"]


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingSettings:
    """How responses are sampled; recorded in the corpus metadata.

    Attributes:
        temperature: 0 = greedy (argmax), the default: the drafter then learns the target's greedy choices, which
            is what greedy speculative decoding verifies against.
        top_p: nucleus sampling mass in (0, 1]; ignored when greedy.
        max_new_tokens: most tokens generated per response (the stop token included), >= 1.
        seed: seed of the sampling generator (per request: ``seed + request_id``, so results do not depend on
            batching or on which replica ran the request).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_new_tokens,
                "seed": self.seed}


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerationRequest:
    """One prompt to continue.

    Attributes:
        request_id: caller's id, unique within one ``generate`` call (also seeds sampling, see SamplingSettings).
        prompt_ids: the prompt as target token ids (chat template and generation prompt already applied), int.
        max_new_tokens: this request's limit (<= the settings' ``max_new_tokens``; the caller lowers it so that
            prompt + response fits the target's context).
        prompt_text: the same prompt as text, for engines that cannot take token ids (None if unknown).
        source: where the prompt comes from, for messages (``"chats.jsonl line 7, turn 2"``; None if unknown).
    """

    request_id: int
    prompt_ids: Sequence[int]
    max_new_tokens: int
    prompt_text: str | None = None
    source: str | None = None


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """The target's response to one :class:`GenerationRequest`.

    Attributes:
        request_id: the request's id.
        token_ids: generated token ids, the prompt excluded; a final stop token is included when
            ``finish_reason == "stop"`` (it is a token the drafter should learn to predict).
        finish_reason: see :data:`FinishReason`.
        token_source: see :data:`TokenSource`.
        info: engine-specific extras (e.g. the endpoint that served it), JSON-serializable.
    """

    request_id: int
    token_ids: list[int]
    finish_reason: FinishReason
    token_source: TokenSource = "engine"
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class GenerationEngine(Protocol):
    """What every engine implements. ``generate`` returns one result per request, in request order.

    Engines raise :class:`dflash.errors.GenerationError` for failures the user must fix (an endpoint down after its
    retries, a model that is not the target), naming the endpoint or model and the fix.
    """

    #: Short engine name recorded in the corpus metadata (``"transformers"``, ``"openai"``).
    name: str

    def describe(self) -> dict[str, Any]:
        """JSON-serializable description recorded in the corpus metadata (engine name, endpoints, versions...)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest], settings: SamplingSettings) -> list[GenerationResult]:
        """Continue every request; results in the order of ``requests``."""
        ...

    def close(self) -> None:
        """Release the engine's resources (models, sessions, connections)."""
        ...
