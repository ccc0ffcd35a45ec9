"""Tokenize chat conversations with the target's own chat template and mark the assistant replies.

``loss_mask`` is 1 exactly on the tokens of assistant replies, the end-of-turn token included, role headers and
the separator after the end-of-turn token excluded (DFlash trains on response tokens only: arXiv 2602.06036
section 4.2). Two ways to find the replies:

- ``"template"``: the template's ``{% generation %}`` markers, through transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``. Templates without the markers (SmolLM2's,
  many others) cannot mark anything: :func:`check_assistant_mask` raises and names the fix.
- ``"prefix-diff"`` (explicit fallback): render the conversation prefix by prefix with the same template; reply
  ``i`` spans from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
  ``render(messages[:i + 1])`` minus anything after the end-of-turn token. Both renders must be prefixes of the
  full render (checked; a template that rewrites earlier turns raises). Character spans are mapped to tokens with
  the fast tokenizer's offsets; a token is supervised when it starts inside a reply span.

Never falls back to an all-ones mask.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from dflash.errors import CorpusError

__all__ = [
    "AssistantMaskMode",
    "ASSISTANT_MASK_MODES",
    "has_generation_markers",
    "check_assistant_mask",
    "normalize_messages",
    "tokenize_chat",
]

AssistantMaskMode = Literal["template", "prefix-diff"]
ASSISTANT_MASK_MODES = ("template", "prefix-diff")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_ROLES = ("system", "user", "assistant", "tool", "developer")
# ShareGPT-style ``conversations: [{from, value}]`` role names.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool", "function": "tool"}
# End-of-turn strings of common templates, tried after the tokenizer's own eos token.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def has_generation_markers(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template holds ``{% generation %}`` markers."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default", "")
    return bool(template) and bool(_GENERATION_MARKER.search(template))


def check_assistant_mask(tokenizer: Any, mode: AssistantMaskMode, *, where: str = "the target") -> None:
    """Fail early when ``mode`` cannot mark assistant replies with this tokenizer.

    Raises:
        CorpusError: no chat template; ``"template"`` without ``{% generation %}`` markers (names the fixes);
            ``"prefix-diff"`` with a slow tokenizer (no character offsets).
        ValueError: unknown ``mode``.
    """
    if mode not in ASSISTANT_MASK_MODES:
        raise ValueError(f"assistant mask mode must be one of {ASSISTANT_MASK_MODES}, got {mode!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise CorpusError(f"the tokenizer of {where} has no chat template; chat data cannot be rendered for it")
    if mode == "template" and not has_generation_markers(tokenizer):
        raise CorpusError(
            f"the chat template of {where} has no {{% generation %}} markers, so transformers cannot mark the "
            "assistant tokens (return_assistant_tokens_mask); pass --assistant-mask prefix-diff to derive the "
            "reply spans by rendering each conversation prefix with the same template, or use a target whose "
            "template marks generations"
        )
    if mode == "prefix-diff" and not getattr(tokenizer, "is_fast", False):
        raise CorpusError(f"--assistant-mask prefix-diff needs a fast tokenizer (character offsets); {where} has a slow one")


def normalize_messages(record: dict[str, Any], *, where: str) -> list[dict[str, str]]:
    """The ``messages`` of one input record as ``[{role, content}]``; ShareGPT ``conversations`` accepted.

    Raises:
        CorpusError: no ``messages``/``conversations`` field, a message without a string role/content, or an
            unknown role; ``where`` names the file and row.
    """
    if "messages" in record and record["messages"] is not None:
        raw, role_key, content_key, roles = record["messages"], "role", "content", {r: r for r in _ROLES}
    elif "conversations" in record and record["conversations"] is not None:
        raw, role_key, content_key, roles = record["conversations"], "from", "value", _SHAREGPT_ROLES
    else:
        raise CorpusError(f"{where}: no 'messages' field (keys: {sorted(record)}); give messages: [{{role, content}}, ...]")
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise CorpusError(f"{where}: 'messages' is {type(raw).__name__}, expected a list of {{role, content}} objects")
    if not raw:
        field = "messages" if role_key == "role" else "conversations"
        raise CorpusError(f"{where}: '{field}' is an empty list; give at least one message, or leave the row out")
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise CorpusError(f"{where} message {index}: expected an object with role and content, got {message!r:.80}")
        role, content = message.get(role_key), message.get(content_key)
        if role not in roles:
            raise CorpusError(f"{where} message {index}: role {role!r} is not one of {sorted(roles)}")
        if not isinstance(content, str):
            raise CorpusError(
                f"{where} message {index}: content is {type(content).__name__}, expected a string (flatten "
                "multi-part content into text first)"
            )
        messages.append({"role": roles[role], "content": content})
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _end_of_turn_strings(tokenizer: Any) -> list[str]:
    own = [t for t in (getattr(tokenizer, "eos_token", None),) if t]
    return own + [t for t in _END_OF_TURN if t not in own]


def _reply_end(chunk: str, content: str, end_markers: list[str]) -> int:
    """Length of the supervised part of an assistant turn's rendered text ``chunk`` (reply + end-of-turn)."""
    content_at = chunk.find(content) if content else 0
    search_from = content_at + len(content) if content_at >= 0 else 0
    for marker in end_markers:
        found = chunk.find(marker, search_from)
        if found >= 0:
            return found + len(marker)
    return len(chunk.rstrip())


def _prefix_diff_spans(
    tokenizer: Any, messages: list[dict[str, str]], turns: list[int], full: str, where: str
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` in ``full`` of the assistant messages at indices ``turns``."""
    spans = []
    markers = _end_of_turn_strings(tokenizer)
    for index in turns:
        message = messages[index]
        before = _render(tokenizer, messages[:index], add_generation_prompt=True) if index else ""
        through = _render(tokenizer, messages[: index + 1], add_generation_prompt=False)
        if not (full.startswith(before) and full.startswith(through) and through.startswith(before)):
            raise CorpusError(
                f"{where} message {index}: the chat template renders this conversation's prefix differently from "
                "the whole (it rewrites earlier turns), so --assistant-mask prefix-diff cannot locate the reply; "
                "use a template with {% generation %} markers (--assistant-mask template) or --last-turn-only"
            )
        start = len(before)
        spans.append((start, start + _reply_end(through[start:], message["content"], markers)))
    return spans


def tokenize_chat(
    tokenizer: Any,
    messages: list[dict[str, str]],
    *,
    mode: AssistantMaskMode,
    last_turn_only: bool = False,
    where: str = "conversation",
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize one conversation with the target's chat template and mark its assistant replies.

    Args:
        tokenizer: the target's (fast) tokenizer, with its chat template.
        messages: ``[{role, content}]`` (see :func:`normalize_messages`).
        mode: ``"template"`` (``{% generation %}`` markers) or ``"prefix-diff"`` (module docstring).
        last_turn_only: supervise only the last assistant reply (earlier replies become context).
        where: file and row, for error messages.

    Returns:
        ``(input_ids [L] int32, loss_mask [L] uint8)``; the mask is all 0 when there is no assistant reply
        (the caller drops and counts such rows).

    Raises:
        CorpusError: the template cannot mark replies (see :func:`check_assistant_mask`) or rewrites earlier turns.
    """
    if mode == "template":
        check_assistant_mask(tokenizer, mode)
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        input_ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        loss_mask = np.asarray(encoded["assistant_masks"], dtype=np.uint8)
        if last_turn_only and loss_mask.any():
            starts = np.flatnonzero(np.diff(np.concatenate([[0], loss_mask.astype(np.int8)])) == 1)
            loss_mask[: starts[-1]] = 0
        return input_ids, loss_mask
    full = _render(tokenizer, messages, add_generation_prompt=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    spans = _prefix_diff_spans(tokenizer, messages, turns[-1:] if last_turn_only else turns, full, where)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    token_starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    loss_mask = np.zeros(len(input_ids), dtype=np.uint8)
    for start, end in spans:
        loss_mask[(token_starts >= start) & (token_starts < end)] = 1
    return input_ids, loss_mask
