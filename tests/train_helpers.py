"""Shared helpers of the train / checkpoint / DDP / sweep tests: a tiny REAL hidden-state cache and a tiny config.

The cache holds short snippets of the Python standard library, tokenized by the real SmolLM2 target, with the
target's own hidden states at two tapped layers (``dflash.target.runner.TargetRunner``, the extract stage's
runner), written through the real cache writer. A "prompt" prefix of each snippet is unsupervised (loss_mask 0), like chat data.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import torch

#: Tapped layers of the tiny cache: low layers, so building it runs 4 of the target's 30 layers (seconds on CPU).
TINY_LAYER_IDS = [1, 3]
STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "bisect", "heapq")


def stdlib_snippets(num_samples: int, *, min_lines: int = 4, max_lines: int = 9) -> list[str]:
    """Deterministic short source snippets cut from a few stdlib modules."""
    import importlib

    snippets: list[str] = []
    for name in STDLIB_MODULES:
        lines = [line for line in inspect.getsource(importlib.import_module(name)).splitlines() if line.strip()]
        start, width = 0, min_lines
        while start + width <= len(lines) and len(snippets) < num_samples:
            snippets.append("\n".join(lines[start : start + width]))
            start += width
            width = min_lines + (width + 3) % (max_lines - min_lines + 1)
        if len(snippets) >= num_samples:
            break
    return snippets[:num_samples]


def build_tiny_cache(
    path: Path,
    target: Any,
    *,
    num_samples: int = 24,
    num_shards: int = 2,
    layer_ids: list[int] | None = None,
    target_identity_override: dict[str, Any] | None = None,
    max_tokens: int = 96,
    chunk_tokens: int = 0,
    final_tap: bool = False,
    storage_dtype: str = "bfloat16",
) -> Path:
    """Write a real cache of ``num_samples`` stdlib snippets at ``path`` (see module docstring); ``chunk_tokens``
    (0: the format's default, one chunk per shard here) makes shards of several same-shaped chunks; ``final_tap``
    adds the target's final normed hidden state (the whole target then runs)."""
    from dflash.cache import CacheMetadata, HiddenSample, HiddenStateCache
    from dflash.target.runner import TargetRunner
    from dflash.target.taps import LAYER_ID_CONVENTION

    layer_ids = list(layer_ids or TINY_LAYER_IDS)
    tokenizer, model = target.tokenizer, target.model
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens] for text in stdlib_snippets(num_samples)]
    # The real extract path: tapped states, the forward stopping after the last tapped layer.
    hidden_states = TargetRunner(model, layer_ids, "cpu", final_tap=final_tap).run([torch.tensor(ids) for ids in encoded])
    samples = []
    for row, ids in enumerate(encoded):
        loss_mask = torch.ones(len(ids), dtype=torch.uint8)
        loss_mask[: max(1, len(ids) // 4)] = 0  # an unsupervised "prompt"
        samples.append(
            HiddenSample(
                corpus_row=row,
                input_ids=torch.tensor(ids, dtype=torch.int32),
                loss_mask=loss_mask,
                hidden=hidden_states[row],
            )
        )
    identity = target.identity.to_dict() | (target_identity_override or {})
    per_shard = -(-len(samples) // num_shards)
    shard_rows = [[s * per_shard, min(len(samples), (s + 1) * per_shard)] for s in range(num_shards)]
    metadata = CacheMetadata(
        target=identity,
        target_spec=str(target.path),
        target_layer_ids=layer_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        hidden_size=int(model.config.hidden_size),
        num_taps=len(layer_ids),
        corpus_fingerprint="sha256:" + "0" * 64,
        corpus_path="stdlib-snippets",
        num_shards=num_shards,
        shard_rows=shard_rows,
        chunk_tokens=chunk_tokens,
        final_tap=final_tap,
        storage_dtype=storage_dtype,
    )
    cache = HiddenStateCache.create(path, metadata)
    for shard, (start, stop) in enumerate(shard_rows):
        cache.write_shard(shard, samples[start:stop])
    return path


def tiny_config(cache: Path, output: Path, **overrides: Any):
    """A TrainConfig for a 1-layer, block-4 drafter on the tiny cache; a few seconds per run on CPU.

    A keyword names a field by its path's last part where only one field ends so (``lr`` sets ``optim.lr``), as
    ``sweep --grid`` keys do; a nested config's dict (``data={...}``) merges into that config."""
    from stages.config.check import deep_merge
    from stages.config.resolve import nested
    from stages.sweep import grid_path
    from stages.train.config import TrainConfig

    values: dict[str, Any] = dict(
        cache=str(cache),
        output=str(output),
        num_draft_layers=1,
        block_size=4,
        max_anchors_per_document=2,
        token_budget=192,
        num_buckets=2,
        validation_fraction=0.2,
        max_validation_batches=2,
        max_steps=6,
        lr=1e-3,
        warmup_ratio=0.2,
        save_every=3,
        log_every=1,
        progress=False,
        device="cpu",
        prefetch_batches=2,
        min_train_samples=1,  # the tiny caches test the mechanics, not a useful training set
    )
    values.update(overrides)
    tree: dict[str, Any] = {}
    for key, value in values.items():
        tree = deep_merge(tree, nested(key if isinstance(value, dict) else grid_path(key) or key, value))
    return TrainConfig.from_dict(tree)


def replace_config(config, **changes: Any):
    return dataclasses.replace(config, **changes)
