"""The ``openai`` generation engine: the target's responses from OpenAI-compatible servers the user runs.

One or more endpoints (vLLM, SGLang, llama.cpp or llama-cpp-python servers) serve the target; every request goes to
``POST {endpoint}/completions`` with the already-templated prompt (the caller applies the target's chat template, so
no ``/chat/completions``: the template is exactly the target's). Requests are spread over the endpoints, at most
``concurrency`` in flight on each (a free slot on any endpoint takes the next request, so a faster server serves
more); connection errors, timeouts, HTTP 5xx and 429 are retried with exponential backoff and jitter; an endpoint
still failing after its retries stops the run with one :class:`dflash.errors.GenerationError` line naming it.

Token ids. The prompt is sent as token ids (``prompt: [int, ...]``, which vLLM, SGLang and llama.cpp accept) where
the server accepts them, else as text. The response ids are taken from the server where it returns them: vLLM
(>= 0.10.2) and SGLang return ``choices[i].token_ids`` when the request sets ``return_token_ids: true``; llama.cpp's
``llama-server`` returns no ids field on ``/v1/completions`` (its native ``/completion`` has ``tokens``) but with
``logprobs: 1`` gives each generated token's ``id`` in ``choices[i].logprobs.content``, which the engine then reads.
Servers that return text only (llama-cpp-python) get the text re-tokenized with the target tokenizer, recorded per
result as ``token_source="retokenized"`` (it may differ from what the model generated at token boundaries). Both
capabilities are probed once per endpoint when the engine starts (a one-token request) and recorded by
:meth:`OpenAIEngine.describe`.

Replies are checked, not trusted. A reply is read up to a size bound (1 MiB plus 4 KiB per requested token) and
within ``request_timeout_s`` in all before it is parsed (:func:`dflash.io.files.decode_json`: deep nesting,
unconvertible numbers and lone surrogates are refused). Its token ids must lie in the target tokenizer's
vocabulary, number at most the request's ``max_tokens``, and decode with the target tokenizer to the text the server
returned, up to what detokenizers legitimately change (:meth:`OpenAIEngine._decodes_to`); re-tokenized text must
fit ``max_tokens`` too. A reply that fails is a :class:`dflash.errors.GenerationError` naming the endpoint, the
request and its prompt (``GenerationRequest.source``) and what was wrong; it is not retried.

Stop tokens. The corpus must supervise the stop: a response that ended on the end-of-sequence token ends with that
token in ``token_ids`` (see ``GenerationResult``). Servers drop it from the text, and some from the ids, so when the
finish reason is ``"stop"`` and the ids do not end with a stop token, the engine appends the one the server names
(vLLM ``stop_reason`` / SGLang ``matched_stop`` when an int) or else the tokenizer's ``eos_token_id``, and records
``info["appended_stop_token"] = True``; when the ids already fill ``max_tokens`` there is no room for it (nor for
the row under ``max_length``), so nothing is appended and the reply counts as cut (finish reason ``"length"``). No ``stop`` strings are sent, so "stop" means a stop token.

Sampling. Greedy is ``temperature: 0``; ``top_p``, ``max_tokens`` and ``seed`` (``settings.seed + request_id``)
are sent with every request, and so are neutral values for the sampling extras that servers default differently
(``min_p: 0``, ``repetition_penalty: 1`` / ``repeat_penalty: 1``, and when sampling ``top_k`` "off"):
llama-cpp-python defaults to top-k 40, min-p 0.05 and a repeat penalty of 1.1, vLLM to the model's
generation_config; the server then samples (or takes the argmax of) the model's own distribution. A quantized server
(a Q4 GGUF, an FP8 vLLM) produces data for its quantized model, not the full-precision target: its greedy
continuations may legitimately differ.

Sources followed: the OpenAI completions API (``POST /v1/completions``: ``model``, ``prompt``, ``max_tokens``,
``temperature``, ``top_p``, ``seed``; ``choices[i].text`` / ``finish_reason``; ``GET /v1/models``); vLLM's
``CompletionRequest.return_token_ids`` and ``CompletionResponseChoice.token_ids`` / ``stop_reason``
(``vllm/entrypoints/openai/protocol.py``); SGLang's ``return_token_ids`` / ``token_ids`` / ``matched_stop``
(``sglang/srt/entrypoints/openai/protocol.py``); llama.cpp ``tools/server`` (``/v1/completions`` returns no ids,
``/props`` ``build_info``). HTTP through ``httpx2`` (the httpx API; already required by huggingface_hub).
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx2 as httpx

from dflash.errors import ConfigError, GenerationError
from dflash.generation.engine import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    TokenSource,
)
from dflash.io.files import JSONInputError, decode_json

__all__ = ["OpenAIEngineConfig", "OpenAIEngine"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: What a reply's text and its decoded ids may differ in (see OpenAIEngine._decodes_to).
_NOT_COMPARED = re.compile(r"[\s\ufffd]+")
#: Status codes retried with backoff: rate limiting and server-side failures (a restarting or overloaded server).
_RETRY_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
#: Status codes that mean "this server does not take token-id prompts" in the capability probe: any error, since
#: llama-cpp-python answers its validation error with HTTP 500 (a real failure shows again in the text probe).
_REJECTED_STATUS = frozenset(range(400, 600))
_BODY_SNIPPET_CHARS = 200
#: Bound on a reply's size before it is parsed: this much for any reply, plus ``_REPLY_BYTES_PER_TOKEN`` per token
#: a completion may hold (its text as JSON escapes, its id, and with ``logprobs`` the per-token entry).
_REPLY_BASE_BYTES = 2**20
_REPLY_BYTES_PER_TOKEN = 4096


@dataclass(kw_only=True, slots=True)
class OpenAIEngineConfig:
    """Where the OpenAI-compatible servers are and how hard to push them.

    Attributes:
        endpoints: base URLs of the servers, as an OpenAI client's ``base_url`` (``http://host:port/v1``); the engine
            calls ``{endpoint}/completions`` and ``{endpoint}/models``. At least one; no duplicates.
        model: served model name sent as ``model``; None = ask ``{endpoint}/models`` and take the only model served
            (an error if there are several). Every endpoint must serve it.
        api_key_env: name of an environment variable holding the API key sent as ``Authorization: Bearer``; None =
            no key. Only the variable's name is stored and recorded, never the key.
        concurrency: most requests in flight on each endpoint (the server batches them), >= 1.
        request_timeout_s: seconds one HTTP request may take, its whole reply included (a long generation too), > 0;
            a request past it is a timeout, retried.
        max_retries: retries of a request after a connection error, timeout, HTTP 5xx, 408 or 429 (0 = try once),
            >= 0.
        backoff_base_s: delay before the first retry; doubles on each retry, with jitter (x0.5 to x1), > 0.
        backoff_max_s: cap on one retry's delay (and on a server's ``Retry-After``), >= ``backoff_base_s``.
        use_token_ids: send prompts as token ids where the server accepts them (no server-side re-tokenization of
            the prompt); False = always send the prompt text.
    """

    endpoints: list[str]
    model: str | None = None
    api_key_env: str | None = None
    concurrency: int = 16
    request_timeout_s: float = 120.0
    max_retries: int = 3
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    use_token_ids: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            self.endpoints = [self.endpoints]
        if not self.endpoints:
            raise ConfigError("endpoints must name at least one server base URL, e.g. http://127.0.0.1:8000/v1")
        normalized: list[str] = []
        for index, endpoint in enumerate(self.endpoints):
            parts = urlsplit(str(endpoint).strip())
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"endpoints[{index}]={endpoint!r} is not an http(s) URL; expected a base URL "
                                  "such as http://127.0.0.1:8000/v1")
            if parts.path.rstrip("/") == "":
                raise ConfigError(f"endpoints[{index}]={endpoint!r} has no path; OpenAI-compatible base URLs end in "
                                  f"/v1: use {endpoint.rstrip('/')}/v1")
            if parts.query or parts.fragment:
                raise ConfigError(f"endpoints[{index}]={endpoint!r} has a query or fragment; give the base URL only")
            url = str(endpoint).strip().rstrip("/")
            if url in normalized:
                raise ConfigError(f"endpoints[{index}]={endpoint!r} is listed twice; raise concurrency instead")
            normalized.append(url)
        self.endpoints = normalized
        if self.model is not None and not self.model.strip():
            raise ConfigError("model must be a served model name or None (ask the server), got an empty string")
        if self.api_key_env is not None and not _ENV_NAME.fullmatch(self.api_key_env):
            # The value is not echoed: a user who put the key itself here would see it in logs.
            raise ConfigError("api_key_env must be the NAME of an environment variable (e.g. VLLM_API_KEY), got a "
                              f"{len(self.api_key_env)}-character value that is not one (not shown, it may be the "
                              "key); export the key in a variable and give its name")
        if self.concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1 (requests in flight per endpoint), got {self.concurrency}")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")
        if self.max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0 (0 = try once), got {self.max_retries}")
        if not self.backoff_base_s > 0:
            raise ConfigError(f"backoff_base_s must be > 0 seconds, got {self.backoff_base_s}")
        if not self.backoff_max_s >= self.backoff_base_s:
            raise ConfigError(f"backoff_max_s must be >= backoff_base_s ({self.backoff_base_s}), "
                              f"got {self.backoff_max_s}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Server:
    """What the engine learned about one endpoint when it started."""

    endpoint: str
    owned_by: str | None = None
    version: str | None = None
    accepts_prompt_ids: bool = False
    #: where the server puts the generated ids: ``"token_ids"`` (vLLM, SGLang: ``choices[i].token_ids``),
    #: ``"logprobs"`` (llama.cpp: ``choices[i].logprobs.content[j].id``, asked with ``logprobs: 1``) or None (text).
    token_ids_from: str | None = None
    models: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "owned_by": self.owned_by, "version": self.version,
                "accepts_prompt_ids": self.accepts_prompt_ids, "returns_token_ids": self.token_ids_from is not None,
                "token_ids_from": self.token_ids_from}


class _Aborted(Exception):
    """Another request failed; this one stops retrying (never leaves ``generate``)."""


class _TooLarge(Exception):
    """A reply over its byte bound (never leaves ``_call``)."""


class OpenAIEngine:
    """Generation through OpenAI-compatible ``/v1/completions`` endpoints (see the module docstring).

    Args:
        config: the endpoints and limits.
        tokenizer: the target's transformers tokenizer: re-tokenizes text-only responses, decodes prompts for
            servers that take text only (when a request has no ``prompt_text``), and gives ``eos_token_id``.

    Raises:
        ConfigError: ``api_key_env`` names an unset variable; the tokenizer has no ``eos_token_id``.
        GenerationError: an endpoint is unreachable after its retries, does not serve ``model``, serves several
            models while ``model`` is None, or the endpoints serve different models.
    """

    name = "openai"

    def __init__(self, config: OpenAIEngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ConfigError("the target tokenizer has no eos_token_id; the openai engine needs it to end responses "
                              "that stopped on the end-of-sequence token")
        headers = {"Content-Type": "application/json"}
        if config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ConfigError(f"api_key_env={config.api_key_env!r}: the environment variable is not set; "
                                  f"export {config.api_key_env}=<key>, or leave api_key_env unset for a server "
                                  "without a key")
            headers["Authorization"] = f"Bearer {key}"
        slots = config.concurrency * len(config.endpoints)
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(config.request_timeout_s, connect=min(10.0, config.request_timeout_s)),
            limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots),
        )
        self._random = random.Random()
        # Fast tokenizers are not safe to call from several threads at once ("Already borrowed").
        self._tokenizer_lock = threading.Lock()
        self._warned_prompt_mismatch = False
        self._vocab_size = len(tokenizer)  # added tokens included
        self._abort = threading.Event()
        try:
            self._servers = [self._probe_models(endpoint) for endpoint in config.endpoints]
            self.model = self._resolve_model()
            for server in self._servers:
                self._probe_token_ids(server)
                server.version = self._server_version(server.endpoint)
        except BaseException:
            self._client.close()
            raise

    # ---------------------------------------------------------------- public interface

    def describe(self) -> dict[str, Any]:
        """Engine name, endpoints, model, per-server version and token-id support, and the config (no key)."""
        return {
            "engine": self.name,
            "endpoints": list(self.config.endpoints),
            "model": self.model,
            "servers": [server.to_dict() for server in self._servers],
            "token_ids_from_engine": all(server.token_ids_from is not None for server in self._servers),
            "config": self.config.to_dict(),
        }

    def generate(self, requests: Sequence[GenerationRequest], settings: SamplingSettings) -> list[GenerationResult]:
        """Continue every request on the endpoints; results in the order of ``requests``.

        Raises:
            GenerationError: an endpoint failed after its retries (the run stops; requests not yet sent are
                cancelled), rejected a request, or answered with an unexpected finish reason.
        """
        if not requests:
            return []
        self._abort.clear()
        # One token per free request slot: a worker takes an endpoint's token, sends, and gives it back, so at most
        # `concurrency` requests are in flight on each endpoint and idle endpoints take the next request.
        slots: queue.SimpleQueue[_Server] = queue.SimpleQueue()
        for _ in range(self.config.concurrency):
            for server in self._servers:
                slots.put(server)

        def run(request: GenerationRequest) -> GenerationResult:
            server = slots.get()
            try:
                return self._complete(server, request, settings)
            finally:
                slots.put(server)

        num_workers = min(len(requests), self.config.concurrency * len(self._servers))
        pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="dflash-openai")
        try:
            futures = [pool.submit(run, request) for request in requests]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f in done and f.exception() is not None
                      and not isinstance(f.exception(), _Aborted)]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            return [future.result() for future in futures]
        except BaseException:
            # The first failure (or Ctrl-C) stops the rest: queued requests are cancelled, and requests in flight
            # give up at their next retry instead of retrying on.
            self._abort.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        self._abort.set()
        self._client.close()

    def __enter__(self) -> OpenAIEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- one request

    def _request_body(self, server: _Server, request: GenerationRequest, settings: SamplingSettings, *,
                      probe: bool = False) -> dict[str, Any]:
        if server.accepts_prompt_ids and self.config.use_token_ids:
            prompt: list[int] | str = [int(token) for token in request.prompt_ids]
        elif request.prompt_text is not None:
            prompt = request.prompt_text
        else:
            with self._tokenizer_lock:
                prompt = self.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": int(request.max_new_tokens),
            "temperature": float(settings.temperature),
            "top_p": 1.0 if settings.greedy else float(settings.top_p),
            "seed": int(settings.seed + request.request_id),
            "n": 1,
            "stream": False,
            "return_token_ids": True,
            # Neutral values for the extras servers default differently (see the module docstring).
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "repeat_penalty": 1.0,
            # vLLM adds BOS to a text prompt by default; the templated prompt already has what the template wants.
            "add_special_tokens": False,
        }
        if probe or server.token_ids_from == "logprobs":
            body["logprobs"] = 1
        if not settings.greedy:
            # "No top-k" is spelled -1 by vLLM and SGLang (SGLang refuses 0) and 0 by llama.cpp and llama-cpp-python
            # (which refuses -1); greedy decoding does not depend on it, so it is only sent when sampling.
            body["top_k"] = -1 if server.owned_by in ("vllm", "sglang") else 0
        return body

    def _complete(self, server: _Server, request: GenerationRequest, settings: SamplingSettings) -> GenerationResult:
        body = self._request_body(server, request, settings)
        what = f"completion of request {request.request_id}" + (f" ({request.source})" if request.source else "")
        payload = self._call(server.endpoint, "POST", "/completions", what, body=body,
                             max_bytes=_REPLY_BASE_BYTES + _REPLY_BYTES_PER_TOKEN * int(request.max_new_tokens))
        choice = _first_choice(payload, server.endpoint, what)
        raw_finish = choice.get("finish_reason")
        if raw_finish not in ("stop", "length"):
            raise GenerationError(f"endpoint {server.endpoint}: {what} finished with finish_reason={raw_finish!r} "
                                  "(expected 'stop' or 'length'); fix: check the server log (an aborted request or a "
                                  "content filter), then rerun")
        finish: FinishReason = raw_finish
        token_ids, token_source = self._reply_ids(server, request, choice, what)
        appended = False
        if finish == "stop":
            named = choice.get("stop_reason", choice.get("matched_stop"))
            stop_id = named if isinstance(named, int) and not isinstance(named, bool) else self.tokenizer.eos_token_id
            if not 0 <= stop_id < self._vocab_size:
                self._refuse(server, what, f"it names stop token {stop_id}, outside the target tokenizer's "
                                           f"vocabulary [0, {self._vocab_size})")
            if not token_ids or token_ids[-1] not in {stop_id, self.tokenizer.eos_token_id}:
                if len(token_ids) < request.max_new_tokens:
                    token_ids.append(int(stop_id))
                    appended = True
                else:  # the stop token does not fit under max_tokens (nor the row under max_length): a cut reply
                    finish = "length"
        info: dict[str, Any] = {"endpoint": server.endpoint,
                                "prompt_as": "token_ids" if isinstance(body["prompt"], list) else "text",
                                "appended_stop_token": appended}
        usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
        for key in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(key), int):
                info[key] = usage[key]
        if info.get("prompt_tokens", len(request.prompt_ids)) != len(request.prompt_ids) \
                and not self._warned_prompt_mismatch:
            self._warned_prompt_mismatch = True
            warnings.warn(f"endpoint {server.endpoint} counted {info['prompt_tokens']} prompt tokens for request "
                          f"{request.request_id}, the target tokenizer {len(request.prompt_ids)}: the server continued "
                          "a differently tokenized prompt (a BOS it added, or special tokens in the text); responses "
                          "may differ from the target's own (shown once)", stacklevel=2)
        return GenerationResult(request_id=request.request_id, token_ids=token_ids, finish_reason=finish,
                                token_source=token_source, info=info)

    def _reply_ids(self, server: _Server, request: GenerationRequest, choice: dict[str, Any],
                   what: str) -> tuple[list[int], TokenSource]:
        """The reply's token ids, checked (never trusted): from the server where it returns them (every id in the
        target tokenizer's vocabulary, at most ``max_tokens`` of them, decoding to the text it returned), else its
        text re-tokenized (at most ``max_tokens`` tokens).

        Raises:
            GenerationError: naming the endpoint, the request (its prompt) and what the reply got wrong.
        """
        text = choice.get("text")
        if not isinstance(text, str):
            self._refuse(server, what, "its choice has no text")
        limit = int(request.max_new_tokens)
        if server.token_ids_from is not None:
            ids = _engine_ids(choice, server.token_ids_from)
            if ids is None:
                where = "token_ids" if server.token_ids_from == "token_ids" else "logprobs.content[].id"
                self._refuse(server, what, f"it returned no list of integer token ids in {where}, as it did when "
                                           "probed")
            source: TokenSource = "engine"
        else:
            with self._tokenizer_lock:
                ids = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
            source = "retokenized"
        if len(ids) > limit:
            self._refuse(server, what, f"it returned {len(ids):,} tokens"
                         + (" (its text re-tokenized)" if source == "retokenized" else "")
                         + f" for max_tokens={limit}")
        bad = next((i for i, token in enumerate(ids) if not 0 <= token < self._vocab_size), None)
        if bad is not None:
            self._refuse(server, what, f"token id {ids[bad]} at position {bad} is outside the target tokenizer's "
                                       f"vocabulary [0, {self._vocab_size})")
        if source == "engine" and not self._decodes_to(ids, text):
            with self._tokenizer_lock:
                decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
            self._refuse(server, what, f"its token ids decode to {_snippet(decoded)[:80]!r} but its text is "
                                       f"{_snippet(text)[:80]!r}")
        return ids, source

    def _decodes_to(self, ids: list[int], text: str) -> bool:
        """Whether ``ids`` decode with the target tokenizer to the server's ``text``, up to what detokenizers
        legitimately change: special tokens shown or left out, whitespace (a SentencePiece word start at the reply's
        start, spaces around added tokens, spaces before punctuation cleaned up) and an incomplete UTF-8 character
        (held back, or written as U+FFFD). One or two decodes of at most ``max_tokens`` ids."""
        wanted = None
        for skip_special in (True, False):
            with self._tokenizer_lock:
                decoded = self.tokenizer.decode(ids, skip_special_tokens=skip_special,
                                                clean_up_tokenization_spaces=False)
            if decoded == text:
                return True
            wanted = _comparable(text) if wanted is None else wanted
            if _comparable(decoded) == wanted:
                return True
        return False

    def _refuse(self, server: _Server, what: str, problem: str) -> NoReturn:
        raise GenerationError(f"endpoint {server.endpoint}: {what}: the reply cannot be what the target generated: "
                              f"{problem}; fix: serve the target (with its own tokenizer) on that endpoint, or "
                              "remove it from endpoints; the parts committed so far are kept, rerun the same command "
                              "to continue")

    # ---------------------------------------------------------------- HTTP with retries

    def _call(self, endpoint: str, method: str, path: str, what: str, *, body: dict[str, Any] | None = None,
              retry: bool = True, accept: frozenset[int] = frozenset(),
              max_bytes: int = _REPLY_BASE_BYTES) -> dict[str, Any]:
        """One JSON request with retries. Returns the decoded JSON object, or ``{"_status": code}`` for a status in
        ``accept``. A reply is read up to ``max_bytes`` (a longer one is refused before it is parsed) and within
        ``request_timeout_s`` from the request's start (a server trickling bytes is a timeout). Raises
        GenerationError (one line: endpoint, what failed, the fix)."""
        url = endpoint + path
        attempts = self.config.max_retries + 1 if retry else 1
        failure = ""
        for attempt in range(attempts):
            if self._abort.is_set():
                raise _Aborted()
            retry_after: float | None = None
            try:
                status, headers, data = self._send(method, url, body, max_bytes)
            except httpx.TransportError as error:
                failure = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            except _TooLarge as error:
                raise GenerationError(f"endpoint {endpoint}: {what} returned a reply of more than {max_bytes:,} bytes "
                                      f"({error}); fix: point endpoints at an OpenAI-compatible server serving the "
                                      "target (its replies are far smaller)") from None
            else:
                text = data.decode("utf-8", "replace")
                if 200 <= status < 300:
                    try:
                        payload = decode_json(data)
                    except JSONInputError as error:
                        payload = error
                    if not isinstance(payload, dict):
                        reason = str(payload) if isinstance(payload, JSONInputError) else "not a JSON object"
                        raise GenerationError(f"endpoint {endpoint}: {what} returned a body that is not usable: "
                                              f"{reason} ({_snippet(text)!r}); fix: point endpoints at an "
                                              "OpenAI-compatible server's /v1 base URL")
                    return payload
                if status in accept:
                    return {"_status": status, "_text": _snippet(text)}
                if status not in _RETRY_STATUS:
                    hint = ("check api_key_env" if status in (401, 403) else
                            "check the endpoint's /v1 path and the model name" if status == 404 else
                            "check the request against the server's limits (context length, max_tokens)")
                    raise GenerationError(f"endpoint {endpoint}: {what} was rejected with HTTP {status} "
                                          f"({_snippet(text)!r}); fix: {hint}")
                failure = f"HTTP {status} ({_snippet(text)!r})"
                retry_after = _retry_after_s(headers.get("Retry-After"))
            if attempt + 1 < attempts:
                delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** attempt)
                delay *= 0.5 + 0.5 * self._random.random()
                if retry_after is not None:
                    delay = max(delay, min(retry_after, self.config.backoff_max_s))
                if self._abort.wait(delay):
                    raise _Aborted()
        raise GenerationError(f"endpoint {endpoint}: {what} failed after {attempts} attempt(s), last: {failure}; "
                              f"fix: check that the server is running and reachable (curl {endpoint}/models), raise "
                              "max_retries or request_timeout_s if it is overloaded, or remove it from endpoints")

    def _send(self, method: str, url: str, body: dict[str, Any] | None, max_bytes: int,
              timeout_s: float | None = None) -> tuple[int, httpx.Headers, bytes]:
        """One HTTP exchange: status, headers and at most ``max_bytes`` of the body, within ``timeout_s`` (default
        ``request_timeout_s``).

        Raises:
            httpx.TransportError: connection failures and timeouts, the whole exchange past ``request_timeout_s``
                included (``httpx.ReadTimeout``).
            _TooLarge: a declared or received body over ``max_bytes``.
        """
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        content = None if body is None else json.dumps(body)
        timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        with self._client.stream(method, url, content=content, timeout=timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise _TooLarge(f"Content-Length {int(declared):,}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise _TooLarge(f"{size:,} bytes received and more coming")
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"the reply took more than {timeout_s:g} s (request_timeout_s)")
            return response.status_code, response.headers, b"".join(chunks)

    # ---------------------------------------------------------------- start-up probes

    def _probe_models(self, endpoint: str) -> _Server:
        payload = self._call(endpoint, "GET", "/models", "listing models (GET /models)")
        data = payload.get("data")
        models = [str(entry["id"]) for entry in data if isinstance(entry, dict) and "id" in entry] \
            if isinstance(data, list) else []
        owned_by = next((str(entry["owned_by"]) for entry in data if isinstance(entry, dict)
                         and entry.get("owned_by")), None) if isinstance(data, list) else None
        return _Server(endpoint=endpoint, owned_by=owned_by, models=models)

    def _resolve_model(self) -> str:
        wanted = self.config.model
        if wanted is not None:
            for server in self._servers:
                if wanted not in server.models:
                    raise GenerationError(f"endpoint {server.endpoint} does not serve model {wanted!r} (it serves "
                                          f"{server.models}); fix: set model to one of those, or start the server "
                                          "with the target")
            return wanted
        for server in self._servers:
            if len(server.models) != 1:
                raise GenerationError(f"endpoint {server.endpoint} serves {len(server.models)} models "
                                      f"({server.models}); fix: set model to the target's served name")
        names = {server.models[0] for server in self._servers}
        if len(names) > 1:
            raise GenerationError(f"endpoints serve different models ({sorted(names)}); fix: point every endpoint "
                                  "at the same target, or set model")
        return names.pop()

    def _probe_token_ids(self, server: _Server) -> None:
        """A one-token greedy request: does the server take a token-id prompt, and where does it return ids?"""
        with self._tokenizer_lock:
            probe_ids = list(self.tokenizer.encode("Hello", add_special_tokens=False))[:1] or [0]
            probe_text = self.tokenizer.decode(probe_ids, skip_special_tokens=False)
        settings = SamplingSettings(temperature=0.0, max_new_tokens=1)
        what = "probing token-id support (POST /completions, 1 token)"
        request = GenerationRequest(request_id=0, prompt_ids=probe_ids, max_new_tokens=1, prompt_text=probe_text)
        payload: dict[str, Any] = {"_status": None}
        if self.config.use_token_ids:
            server.accepts_prompt_ids = True
            body = self._request_body(server, request, settings, probe=True)
            payload = self._call(server.endpoint, "POST", "/completions", what, body=body, retry=False,
                                 accept=_REJECTED_STATUS)
            server.accepts_prompt_ids = "_status" not in payload
        if "_status" in payload:
            body = self._request_body(server, request, settings, probe=True)
            payload = self._call(server.endpoint, "POST", "/completions", what, body=body)
        choice = _first_choice(payload, server.endpoint, what)
        server.token_ids_from = "token_ids" if isinstance(choice.get("token_ids"), list) else \
            "logprobs" if _engine_ids(choice) is not None else None

    def _server_version(self, endpoint: str) -> str | None:
        """The server's version where one cheap GET tells it: vLLM's ``/version``, llama.cpp's ``/props``
        ``build_info``, or a FastAPI server's ``/openapi.json`` ``info`` (llama-cpp-python). None if none answers."""
        root = endpoint[: -len("/v1")] if endpoint.endswith("/v1") else endpoint
        for path in ("/version", "/props", "/openapi.json"):
            try:
                status, _, data = self._send("GET", root + path, None, _REPLY_BASE_BYTES,
                                             timeout_s=min(5.0, self.config.request_timeout_s))
                payload = decode_json(data) if status == 200 else None
            except (httpx.HTTPError, _TooLarge, JSONInputError):
                payload = None
            if not isinstance(payload, dict):
                continue
            if path == "/version" and isinstance(payload.get("version"), str):
                return f"version {payload['version']}"
            if path == "/props" and isinstance(payload.get("build_info"), str):
                return f"llama.cpp {payload['build_info']}"
            info = payload.get("info")
            if path == "/openapi.json" and isinstance(info, dict) and isinstance(info.get("version"), str):
                return f"{info.get('title', 'openapi')} {info['version']}"
        return None


def _engine_ids(choice: dict[str, Any], where: str | None = None) -> list[int] | None:
    """The generated ids in a choice: vLLM/SGLang ``token_ids``, else llama.cpp's ``logprobs.content[j].id``
    (``where``: only that place, as probed); None when there is no list of integers there."""
    ids = choice.get("token_ids") if where in (None, "token_ids") else None
    if not isinstance(ids, list) and where in (None, "logprobs"):
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        ids = [entry.get("id") for entry in content if isinstance(entry, dict)] if isinstance(content, list) else None
        if ids is not None and len(ids) != len(content):
            return None
    if not isinstance(ids, list) or not all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
        return None
    return [int(token) for token in ids]


def _comparable(text: str) -> str:
    """``text`` without whitespace and U+FFFD, for :meth:`OpenAIEngine._decodes_to`."""
    return _NOT_COMPARED.sub("", text)


def _first_choice(payload: dict[str, Any], endpoint: str, what: str) -> dict[str, Any]:
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise GenerationError(f"endpoint {endpoint}: {what} returned no choices ({_snippet(json.dumps(payload))!r}); "
                              "fix: point endpoints at an OpenAI-compatible /v1 completions server")
    return choices[0]


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _BODY_SNIPPET_CHARS else text[:_BODY_SNIPPET_CHARS] + "..."


def _retry_after_s(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: fall back to the computed backoff
        return None
