"""Engine ``transformers``: batched generation with the target's own transformers model, on one device.

Requests are sorted by prompt length and cut into batches of at most ``batch_size`` rows whose padded prompt tokens
stay within ``token_budget`` (length grouping keeps left padding small), each left-padded to a multiple of
``prompt_bucket`` tokens.

- ``cache="static"`` (the default on CUDA): :class:`dflash.generation.static_decode.StaticDecoder`, this project's
  decode loop over transformers' ``StaticCache``, the decode step replayed as a CUDA graph (one per cache length);
  every batch has ``batch_size`` rows (filler rows), so a few captured shapes serve a whole run. Sampling is seeded
  per request (``seed`` and the request id), independent of batching.
  With the fused attention (CUDA with Triton, Llama/Mistral/Qwen2/Qwen3 targets) and ``continuous`` on, one
  ``generate`` call's requests stream through the ``batch_size`` rows instead
  (:meth:`~dflash.generation.static_decode.StaticDecoder.decode_stream`): a row takes the next request as soon as its
  reply ends, so no row idles until the longest reply of its batch; ``token_budget`` then caps each refill's prefill.
- ``cache="dynamic"`` (the default elsewhere): ``model.generate`` with transformers' dynamic cache. Sampling is
  seeded per batch (``seed`` + the first request id of the batch): a rerun of the same shard samples the same tokens.

Greedy (temperature 0) output depends only on the prompt, up to floating-point ties between batch compositions.

Source followed: transformers' ``GenerationMixin.generate``, ``StaticCache``; PyTorch's CUDA graphs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from transformers.generation.streamers import BaseStreamer

from dflash.errors import ConfigError
from dflash.generation.engine import GenerationRequest, GenerationResult, SamplingSettings

__all__ = ["TransformersEngine", "CacheKind"]

log = logging.getLogger(__name__)

CacheKind = Literal["auto", "static", "dynamic"]


class TransformersEngine:
    """:class:`dflash.generation.engine.GenerationEngine` over a loaded transformers causal LM.

    Args:
        model: the target (``LoadedTarget.model``), in eval mode on its device.
        tokenizer: its tokenizer (pad and stop tokens).
        batch_size: most rows per ``generate`` call.
        token_budget: most padded prompt tokens per call (batch rows x prompt length).
        cache: ``"static"`` (StaticDecoder: fixed-shape KV cache, CUDA-graph decode step on CUDA),
            ``"dynamic"`` (``model.generate``, transformers' dynamic cache), ``"auto"``: static on CUDA, dynamic
            elsewhere.
        deterministic: static cache: bitwise-repeatable decode attention
            (:func:`dflash.generation.static_decode.deterministic_decode_attention`), slower; default SDPA's
            grouped-query kernel, whose bits may differ from run to run on CUDA (near-ties then break differently).
        ranged: static cache, not deterministic: decode attention that reads only the cache positions each row
            attends (:func:`dflash.generation.static_decode.ranged_attention`); None: where it can run (CUDA with
            Triton), False: SDPA's grouped-query kernel over the whole padded cache.
        compile_parts: static cache: the target's MLP and RMSNorm modules run through ``torch.compile`` while the
            engine is open (:class:`dflash.generation.static_decode.StaticDecoder`); None: on CUDA with Triton.
        compile_prefill: with ``compile_parts``, in the prefill too (shape-generic graphs); None: with
            ``compile_parts``.
        fused: with ranged attention, Llama/Mistral/Qwen2/Qwen3 attention decodes with its rotary embedding and cache
            write in one kernel (:mod:`dflash.generation.fused_decode`); None: wherever ranged attention runs.
        continuous: static cache: stream each call's requests through the rows (continuous batching) where the
            decoder can (every attention layer fused); False: batch after batch.
        prompt_bucket: prompts are left-padded to a multiple of this many tokens (fewer compiled shapes).
        stop_token_ids: tokens that end a reply (default: the tokenizer's EOS and, for chat models, the end of turn).
        description: extra facts for :meth:`describe` (the target identity).
    """

    name = "transformers"

    def __init__(self, model: Any, tokenizer: Any, *, batch_size: int = 256, token_budget: int = 262_144,
                 cache: CacheKind = "auto", deterministic: bool = False, ranged: bool | None = None,
                 compile_parts: bool | None = None, compile_prefill: bool | None = None, fused: bool | None = None,
                 continuous: bool = True, prompt_bucket: int = 64,
                 stop_token_ids: Sequence[int] | None = None,
                 description: dict[str, Any] | None = None) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if token_budget < 1:
            raise ConfigError(f"token_budget must be >= 1, got {token_budget}")
        if cache not in ("auto", "static", "dynamic"):
            raise ConfigError(f"cache must be auto, static or dynamic, got {cache!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.token_budget = token_budget
        self.device = next(model.parameters()).device
        self.cache = ("static" if self.device.type == "cuda" else "dynamic") if cache == "auto" else cache
        self.deterministic = bool(deterministic)
        self.continuous = bool(continuous)
        self.prompt_bucket = max(1, prompt_bucket)
        self.stop_token_ids = sorted(set(stop_token_ids if stop_token_ids is not None else default_stop_ids(tokenizer)))
        if not self.stop_token_ids:
            raise ConfigError("the target's tokenizer has no EOS token; pass stop_token_ids")
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.stop_token_ids[0])
        self.description = dict(description or {})
        #: When set (:func:`dflash.generation.parts.generate_part`), called with ``(replies, tokens, decoding)``:
        #: replies final since the last call and their generated tokens (exact), and the tokens chosen so far by the
        #: replies still decoding in this :meth:`generate` call (an estimate each call replaces; 0 once they are
        #: final). Called after each batch, and while one decodes: every step of ``generate()``, every host check of
        #: the static decoder.
        self.progress: Callable[[int, int, int], None] | None = None
        #: Seconds, generated tokens and (static cache) decode steps of the last :meth:`generate` call (for the
        #: stage's report and benchmarks).
        self.last_stats: dict[str, float] = {}
        self._decoder: Any = None
        if self.cache == "static":
            from dflash.generation.static_decode import StaticDecoder

            self._decoder = StaticDecoder(model, rows=batch_size, pad_token_id=self.pad_token_id,
                                          stop_token_ids=self.stop_token_ids, deterministic=deterministic,
                                          ranged=ranged, compile_parts=compile_parts,
                                          compile_prefill=compile_prefill, fused=fused)

    def describe(self) -> dict[str, Any]:
        import transformers

        return {"engine": self.name, "transformers": transformers.__version__, "torch": torch.__version__,
                "device": str(self.device), "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "kv_cache": self.cache, "deterministic": self.deterministic,
                "ranged_attention": bool(self._decoder is not None and self._decoder.ranged),
                "compiled_modules": len(self._decoder._compiled) if self._decoder is not None else 0,
                "fused_attention_modules": len(self._decoder._fused) if self._decoder is not None else 0,
                "continuous_batching": self.streams,
                "batch_size": self.batch_size, "stop_token_ids": self.stop_token_ids,
                **self.description}

    @property
    def streams(self) -> bool:
        """Whether :meth:`generate` streams its requests through the rows (continuous batching)."""
        return self.continuous and self._decoder is not None and self._decoder.streams

    @property
    def decode_step(self) -> str:
        """How the last batch's decode steps ran: ``"graph"`` (CUDA graph replay), ``"eager"`` or ``"generate()"``."""
        return self._decoder.last_mode if self._decoder is not None else "generate()"

    @staticmethod
    def _length_order(requests: Sequence[GenerationRequest]) -> list[int]:
        """Request indices by prompt length (then id): batches and refills of similar widths, little left padding."""
        return sorted(range(len(requests)), key=lambda i: (len(requests[i].prompt_ids), requests[i].request_id))

    @staticmethod
    def _row_keys(settings: SamplingSettings, requests: Sequence[GenerationRequest]) -> list[int]:
        """Per request, the static decoder's sampling key: its tokens depend on the seed and the request only."""
        return [settings.seed * 2**32 + r.request_id for r in requests]

    def _batches(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        for index in self._length_order(requests):
            width = self._bucketed(len(requests[index].prompt_ids))
            if current and (len(current) >= self.batch_size or (len(current) + 1) * width > self.token_budget):
                batches.append(current)
                current = []
            current.append(index)
        if current:
            batches.append(current)
        return batches

    def _bucketed(self, length: int) -> int:
        return -(-length // self.prompt_bucket) * self.prompt_bucket

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], settings: SamplingSettings) -> list[GenerationResult]:
        started = time.perf_counter()
        row_steps, caches = (self._decoder.row_steps, self._decoder.caches_made) if self._decoder is not None else (0, 0)
        results, steps, rows = (self._stream if self.streams else self._batched)(requests, settings)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_stats = {"seconds": time.perf_counter() - started,
                           "generated_tokens": float(sum(len(result.token_ids) for result in results))}
        if self._decoder is not None:
            self.last_stats["decode_steps"] = float(steps)
            self.last_stats["rows"] = float(rows)  # the fewest of any batch; fewer than batch_size where memory capped them
            self.last_stats["row_steps"] = float(self._decoder.row_steps - row_steps)
            self.last_stats["caches_made"] = float(self._decoder.caches_made - caches)
        return results

    def _stream(self, requests: Sequence[GenerationRequest],
                settings: SamplingSettings) -> tuple[list[GenerationResult], int, int]:
        """Every request through :meth:`StaticDecoder.decode_stream`; returns the results, the decode steps and the
        rows decoded at once."""
        order = self._length_order(requests)
        ordered = [requests[i] for i in order]

        def progress(indices: list[int], replies: list[list[int]], decoding: int) -> None:  # replies cut at stop/limit
            if self.progress is not None:
                self.progress(len(indices), sum(len(reply) for reply in replies), decoding)

        token_lists = self._decoder.decode_stream(
            [r.prompt_ids for r in ordered], [r.max_new_tokens for r in ordered], temperature=settings.temperature,
            top_p=settings.top_p, row_keys=self._row_keys(settings, ordered), prompt_bucket=self.prompt_bucket,
            prefill_tokens=self.token_budget, progress=progress)
        results: list[GenerationResult | None] = [None] * len(requests)
        for index, request, tokens in zip(order, ordered, token_lists, strict=True):
            results[index] = self._result(request, tokens)
        return results, self._decoder.last_steps, self._decoder.last_rows  # type: ignore[return-value]

    def _batched(self, requests: Sequence[GenerationRequest],
                 settings: SamplingSettings) -> tuple[list[GenerationResult], int, int]:
        """Batch after batch (:meth:`_batches`); returns the results, the static decoder's decode steps and the
        fewest rows a batch decoded at once (``batch_size`` without the static decoder)."""
        results: list[GenerationResult | None] = [None] * len(requests)
        steps, fewest = 0, self.batch_size
        for batch in self._batches(requests):
            rows = [requests[i] for i in batch]
            outputs = self._generate_batch(rows, settings)
            if self._decoder is not None:
                steps += self._decoder.last_steps
                fewest = min(fewest, self._decoder.last_rows)
            for index, result in zip(batch, outputs, strict=True):
                results[index] = result
            if self.progress is not None:
                self.progress(len(outputs), sum(len(result.token_ids) for result in outputs), 0)
        assert all(result is not None for result in results)
        return results, steps, fewest  # type: ignore[return-value]

    def _generate_batch(self, rows: list[GenerationRequest], settings: SamplingSettings) -> list[GenerationResult]:
        width = self._bucketed(max(len(r.prompt_ids) for r in rows))
        decoding = None if self.progress is None else functools.partial(self.progress, 0, 0)
        if self._decoder is not None:
            token_lists = self._decoder.decode([r.prompt_ids for r in rows], [r.max_new_tokens for r in rows],
                                               temperature=settings.temperature, top_p=settings.top_p,
                                               row_keys=self._row_keys(settings, rows), width=width,
                                               progress=decoding)
            return [self._result(request, tokens) for request, tokens in zip(rows, token_lists, strict=True)]
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, request in enumerate(rows):
            ids = torch.as_tensor(list(request.prompt_ids), dtype=torch.long)
            input_ids[i, width - len(ids):] = ids
            attention_mask[i, width - len(ids):] = 1
        max_new = max(r.max_new_tokens for r in rows)
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new, "eos_token_id": self.stop_token_ids, "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }
        if settings.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=0)
            torch.manual_seed(settings.seed + min(r.request_id for r in rows))
        if decoding is not None:
            kwargs["streamer"] = _TokenCounter([r.max_new_tokens for r in rows], self.stop_token_ids, decoding)
        output = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                     **kwargs)
        new_tokens = output[:, width:].cpu().tolist()
        return [self._result(request, tokens) for request, tokens in zip(rows, new_tokens, strict=True)]

    def _result(self, request: GenerationRequest, tokens: list[int]) -> GenerationResult:
        tokens = tokens[: request.max_new_tokens]
        end = next((k for k, token in enumerate(tokens) if token in self.stop_token_ids), None)
        if end is not None:
            return GenerationResult(request_id=request.request_id, token_ids=tokens[: end + 1], finish_reason="stop")
        return GenerationResult(request_id=request.request_id, token_ids=tokens, finish_reason="length")

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
        self.model = None  # the worker plugin owns the target and frees the device


class _TokenCounter(BaseStreamer):
    """A ``generate()`` streamer (transformers' hook for tokens as they come) that counts the tokens the rows of a
    batch have chosen so far and passes the count to ``report`` at every step.

    ``generate()`` calls :meth:`put` once with the prompt ids, then once per decode step with that step's token of
    every row, on the host; a row that has ended (a stop token) gets the pad token from then on, and a row past its
    own ``max_new_tokens`` (the batch decodes to its largest) will be cut: neither is counted, so after the last step
    the count is the batch's generated tokens as the engine's replies hold them.
    """

    def __init__(self, limits: Sequence[int], stop_token_ids: Sequence[int],
                 report: Callable[[int], None]) -> None:
        self.limits = torch.tensor(list(limits), dtype=torch.long)
        self.stops = torch.tensor(list(stop_token_ids), dtype=torch.long)
        self.open = torch.ones(len(self.limits), dtype=torch.bool)  # rows that have not chosen a stop token
        self.report = report
        self.steps = -1  # the first put is the prompt
        self.tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.steps += 1
        if self.steps == 0:
            return
        counted = self.open & (self.limits >= self.steps)  # the rows choosing their token number `steps` now
        self.tokens += int(counted.sum())
        self.open = counted & ~torch.isin(value.reshape(-1), self.stops)
        self.report(self.tokens)

    def end(self) -> None:
        pass


def default_stop_ids(tokenizer: Any) -> list[int]:
    """The tokens that end a reply: the tokenizer's EOS id(s), plus ``<|im_end|>``/``<|eot_id|>``/``<end_of_turn>``
    where the vocabulary has them (chat models end turns with these)."""
    ids: set[int] = set()
    eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(int(t) for t in eos)
    vocab = tokenizer.get_vocab()
    for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
        if name in vocab and name in (tokenizer.all_special_tokens or []):
            ids.add(int(vocab[name]))
    return sorted(ids)
