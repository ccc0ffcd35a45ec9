"""The held-out split by document: whole documents of a corpus set aside for evaluation, never trained on.

A row's document is its ``document_id``, else its ``sample_id`` before any ``#<chunk>`` (the chunks of one split
file stay together). The documents are sorted and a seeded permutation (numpy ``default_rng(seed)``) picks the
held-out ones, so the same corpus and seed always hold out the same documents.

``prepare`` writes the training rows to its output and the held-out rows to the corpus ``heldout/`` inside it;
``run`` writes them to the sibling folders ``corpus/`` and ``heldout/`` of its work folder. Either way the training
corpus's ``corpus.json`` records the split under ``"split"`` (the held-out corpus's path relative to the training
corpus, its fingerprint, the seed and the held-out documents), and :func:`heldout_corpus` finds the held-out corpus
from the training one: ``evaluate --corpus TRAINING_CORPUS`` evaluates on the held-out rows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dflash.corpus.format import Corpus, CorpusWriter, open_corpus
from dflash.errors import ConfigError, CorpusError

__all__ = ["DEFAULT_HELDOUT_SHARE", "HELDOUT_DIR", "choose_heldout", "heldout_count", "heldout_corpus", "row_documents", "split_corpus"]

#: The folder inside a prepared corpus that holds its held-out rows.
HELDOUT_DIR = "heldout"
#: Share of the documents ``prepare`` holds out when no count is given (at least one).
DEFAULT_HELDOUT_SHARE = 0.05


def row_documents(corpus: Corpus) -> list[str]:
    """Each row's document: its ``document_id``, else its ``sample_id`` before ``#``."""
    return [corpus.document_id(i) or corpus.sample_id(i).split("#", 1)[0] for i in range(len(corpus))]


def heldout_count(num_documents: int, heldout_documents: int | None, *, where: str, setting: str) -> int:
    """How many of ``num_documents`` to hold out: ``heldout_documents``, or (``None``) :data:`DEFAULT_HELDOUT_SHARE`
    of them rounded up; 0 holds none out.

    Raises:
        ConfigError: a count > 0 that leaves no document to train on (1 document; a count >= the documents), naming
            ``where``, the counts and ``setting``.
    """
    count = math.ceil(DEFAULT_HELDOUT_SHARE * num_documents) if heldout_documents is None else heldout_documents
    if count == 0:
        return 0
    if num_documents <= count:
        have = f"only {num_documents} document" + ("" if num_documents == 1 else "s")
        raise ConfigError(
            f"{where} has {have} (a conversation, a file or a row's document_id is one document) and {count} must "
            f"be held out for evaluation, leaving none to train on; add data, lower {setting}, or set it to 0 and "
            "evaluate on a prompts file (evaluate --prompts FILE)"
        )
    return count


def choose_heldout(documents: list[str], count: int, seed: int) -> set[str]:
    """The ``count`` held-out documents among ``documents`` (one per row, repeats allowed): the first ``count`` of a
    ``default_rng(seed)`` permutation of the sorted distinct documents."""
    unique = sorted(set(documents))
    return {unique[i] for i in np.random.default_rng(seed).permutation(len(unique))[:count]}


def split_corpus(corpus: Corpus, train: CorpusWriter, heldout: CorpusWriter, *, heldout_documents: int, seed: int,
                 heldout_path: str, metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``corpus``'s rows to ``train`` and ``heldout`` by document and commit both (held-out first).

    ``heldout_documents`` (>= 1, fewer than the documents: :func:`heldout_count`) documents go to ``heldout``.
    ``heldout_path`` is the held-out corpus's path relative to the training corpus, recorded in the training
    corpus's ``corpus.json``. ``metadata`` (default: ``corpus``'s, less its counts and fingerprint) is written to
    both. Returns the counts of rows, tokens and documents on each side.
    """
    documents = row_documents(corpus)
    unique = sorted(set(documents))
    if not 1 <= heldout_documents < len(unique):
        raise ConfigError(f"heldout_documents={heldout_documents}: {corpus.path} has {len(unique)} documents; hold "
                          "out at least one and fewer than all")
    held = choose_heldout(documents, heldout_documents, seed)
    if metadata is None:
        metadata = {k: v for k, v in corpus.metadata.items() if k not in ("fingerprint", "num_rows", "num_tokens")}
    counts = {"train_rows": 0, "heldout_rows": 0, "train_tokens": 0, "heldout_tokens": 0}
    for index, document in enumerate(documents):
        row = corpus.row(index)
        side = "heldout" if document in held else "train"
        (heldout if side == "heldout" else train).add(row.input_ids, row.loss_mask, row.sample_id,
                                                       corpus.document_id(index))
        counts[f"{side}_rows"] += 1
        counts[f"{side}_tokens"] += len(row.input_ids)
    split_info = {"source": str(corpus.path), "source_fingerprint": corpus.fingerprint, "seed": seed,
                  "heldout_documents": sorted(held)}
    heldout.commit({**metadata, "split": {**split_info, "side": "heldout"}})
    held_fingerprint = open_corpus(heldout.path).metadata["fingerprint"]
    train.commit({**metadata, "split": {**split_info, "side": "train", "heldout": heldout_path,
                                        "heldout_fingerprint": held_fingerprint}})
    return {**counts, "heldout_documents": len(held), "train_documents": len(unique) - len(held)}


def heldout_corpus(corpus: Corpus) -> Corpus | None:
    """The held-out corpus recorded in the training corpus ``corpus``'s split, or ``None`` when it records none.

    Raises:
        CorpusError: the recorded held-out corpus is missing or is not the one the split wrote (fingerprints differ).
    """
    split = corpus.metadata.get("split")
    if not isinstance(split, dict) or split.get("side") != "train" or not isinstance(split.get("heldout"), str):
        return None
    base = corpus.path if corpus.path.is_dir() else corpus.path.parent
    path = (base / split["heldout"]).resolve()
    fix = f"rerun the command that wrote {base} (prepare writes both sides of the split)"
    if not path.is_dir():
        raise CorpusError(f"corpus {base} records its held-out rows in {path}, which does not exist; {fix}")
    held = open_corpus(path)
    if held.fingerprint != split.get("heldout_fingerprint"):
        raise CorpusError(f"held-out corpus {path} is {held.fingerprint}, but corpus {base} records "
                          f"{split.get('heldout_fingerprint')}; {fix}")
    return held

