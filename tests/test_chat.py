"""Assistant loss masks from the real SmolLM2 chat template (dflash/chat.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from dflash.corpus.chat import check_assistant_mask, has_generation_markers, normalize_messages, tokenize_chat
from dflash.errors import CorpusError

CONVERSATION = [
    {"role": "system", "content": "Tu es un assistant précis. Réponds brièvement."},
    {"role": "user", "content": "Qu'est-ce qu'un générateur en Python ? 🐍"},
    {"role": "assistant", "content": "Une fonction qui contient `yield` : elle produit ses valeurs à la demande."},
    {"role": "user", "content": "Et en japonais, comment dit-on « merci » ?"},
    {"role": "assistant", "content": "On dit ありがとう (arigatō).\n"},
    {"role": "user", "content": "Merci !"},
    {"role": "assistant", "content": "Avec plaisir — bonne journée ☀️"},
]
REPLIES = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
END_OF_TURN = "<|im_end|>"

# SmolLM2's own template with {% generation %} markers around each reply and its end-of-turn token.
MARKED_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous [start, stop) runs of ones."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def test_smollm2_template_has_no_generation_markers_and_template_mode_names_the_fix(tokenizer):
    assert not has_generation_markers(tokenizer)
    with pytest.raises(CorpusError, match="--assistant-mask prefix-diff"):
        check_assistant_mask(tokenizer, "template")
    with pytest.raises(CorpusError, match="generation"):
        tokenize_chat(tokenizer, CONVERSATION, mode="template")


def test_prefix_diff_mask_covers_exactly_each_reply_and_its_end_of_turn(tokenizer):
    input_ids, loss_mask = tokenize_chat(tokenizer, CONVERSATION, mode="prefix-diff")
    assert input_ids.dtype == np.int32 and loss_mask.dtype == np.uint8 and len(input_ids) == len(loss_mask)
    # Same tokens as transformers' own chat-template tokenization.
    reference = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert input_ids.tolist() == list(reference)
    runs = _runs(loss_mask)
    assert len(runs) == len(REPLIES)
    for (start, stop), reply in zip(runs, REPLIES, strict=True):
        assert tokenizer.decode(input_ids[start:stop]) == reply + END_OF_TURN
        # The role header right before the reply is not supervised.
        assert tokenizer.decode(input_ids[:start]).endswith("<|im_start|>assistant\n")
    # Everything unsupervised decodes to system/user turns and headers only: no reply text leaks out of the mask.
    unsupervised = tokenizer.decode(input_ids[loss_mask == 0])
    assert "yield" not in unsupervised and "ありがとう" not in unsupervised
    assert "Qu'est-ce qu'un générateur en Python ? 🐍" in unsupervised


def test_last_turn_only_supervises_the_final_reply(tokenizer):
    input_ids, loss_mask = tokenize_chat(tokenizer, CONVERSATION, mode="prefix-diff", last_turn_only=True)
    runs = _runs(loss_mask)
    assert len(runs) == 1
    start, stop = runs[0]
    assert tokenizer.decode(input_ids[start:stop]) == REPLIES[-1] + END_OF_TURN


def test_template_markers_and_prefix_diff_agree(tokenizer):
    marked = copy.deepcopy(tokenizer)
    marked.chat_template = MARKED_TEMPLATE
    assert has_generation_markers(marked)
    ids_template, mask_template = tokenize_chat(marked, CONVERSATION, mode="template")
    ids_diff, mask_diff = tokenize_chat(tokenizer, CONVERSATION, mode="prefix-diff")
    assert ids_template.tolist() == ids_diff.tolist()
    assert mask_template.tolist() == mask_diff.tolist()
    _, last_only = tokenize_chat(marked, CONVERSATION, mode="template", last_turn_only=True)
    assert len(_runs(last_only)) == 1 and _runs(last_only)[0] == _runs(mask_diff)[-1]


def test_conversation_without_reply_has_empty_mask(tokenizer):
    ids, mask = tokenize_chat(tokenizer, CONVERSATION[:2], mode="prefix-diff")
    assert len(ids) > 0 and not mask.any()


def test_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    rewriting = copy.deepcopy(tokenizer)
    # Earlier replies are shortened once a later turn exists (as reasoning templates drop old thoughts).
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:3] }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(CorpusError, match="message 2: the chat template renders"):
        tokenize_chat(rewriting, CONVERSATION, mode="prefix-diff", where="chat.jsonl line 7")
    # Only the last reply is located with --last-turn-only, which such templates render in full.
    ids, mask = tokenize_chat(rewriting, CONVERSATION, mode="prefix-diff", last_turn_only=True)
    assert tokenizer.decode(ids[mask == 1]) == REPLIES[-1] + END_OF_TURN


def test_normalize_messages_checks_roles_and_content_and_reads_sharegpt():
    assert normalize_messages({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                              where="x") == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(CorpusError, match="data.jsonl line 3 message 1: role 'bot'"):
        normalize_messages({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
                           where="data.jsonl line 3")
    with pytest.raises(CorpusError, match="content is list"):
        normalize_messages({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, where="f row 0")
    with pytest.raises(CorpusError, match="no 'messages' field"):
        normalize_messages({"prompt": "x"}, where="f row 0")
    # an empty conversation is refused here, not by the chat template's own ValueError later
    with pytest.raises(CorpusError, match="^f row 2: 'messages' is an empty list"):
        normalize_messages({"messages": []}, where="f row 2")
    with pytest.raises(CorpusError, match="^f row 2: 'conversations' is an empty list"):
        normalize_messages({"conversations": []}, where="f row 2")
