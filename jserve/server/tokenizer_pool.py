"""Tokenization and chat-template rendering off the event loop, in a worker process.

Why a process: the `tokenizers` library holds the GIL while it encodes, so a thread does not
help: a prompt of some megabytes takes seconds to encode, and from a worker thread it stalls the
event loop as long (docs/performance.md). Large inputs (over `INLINE_BYTES` of body) go to one
spawned process holding its own copy of the tokenizer; small ones, nearly all requests, run
inline (well under a millisecond). At most `max_jobs` large jobs are queued or running; past
that, 429. A dead worker is replaced and the request answered 503 with `Retry-After`.

Before any of that, `check_text_size` rejects text that cannot fit: every token covers at most
`max_token_bytes` bytes, so text longer than twice `max_input_tokens * max_token_bytes` bytes is
sure to be too long (twice: a normalizer may drop some of the text), without tokenizing it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import multiprocessing
import os
import pickle
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from jserve.server.errors import APIError, bad_request
from jserve.server.messages import messages_bytes

logger = logging.getLogger(__name__)

INLINE_BYTES = 16 * 1024

_WORKER_TOKENIZER: Any = None  # in the worker process


class ChatTemplateError(Exception):
    """The chat template refused the messages (its message is the client's to read)."""


def encode(tok: Any, text: str, add_special_tokens: bool) -> list[int]:
    return tok.encode(text, add_special_tokens=add_special_tokens)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """What a chat prompt is rendered from: the messages and the template's options and variables
    (`tools`, `chat_template_kwargs`, ...) as the request asked for them."""

    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict = dataclasses.field(default_factory=dict)  # extra template variables (e.g. tools)
    add_special_tokens: bool = False  # the tokenizer's own (BOS) on top of what the template writes

    def size(self) -> int:
        """UTF-8 bytes of what is rendered (the messages and the variables), to bound the work."""
        return messages_bytes(self.messages) + (len(json.dumps(self.variables).encode()) if self.variables else 0)


def render_chat(tok: Any, chat: ChatPrompt) -> tuple[str, list[int]]:
    """The rendered conversation and its ids; ChatTemplateError for a template's own error."""
    try:
        text = tok.apply_chat_template(chat.messages, add_generation_prompt=chat.add_generation_prompt,
                                       continue_final_message=chat.continue_final_message, **chat.variables)
    except ValueError as e:
        raise ChatTemplateError(f"chat template: {e}") from None
    except Exception as e:  # noqa: BLE001 - jinja2 errors raised by the template (raise_exception)
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from None
    return text, tok.encode(text, add_special_tokens=chat.add_special_tokens)


def decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids)


def _init_worker(payload: bytes) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = pickle.loads(payload)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int, interval: float = 0.5) -> None:
    """End the worker once its server is gone. A server that exits at once after a fatal engine
    fault (`os._exit`) leaves no time to send the pool's stop sentinel, and an orphaned worker
    kept its inherited stderr open: whoever read the server's log to its end waited forever."""
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(0)


def _in_worker(fn: Callable, *args: Any) -> Any:
    return fn(_WORKER_TOKENIZER, *args)


def max_token_bytes(tok: Any) -> int:
    """The most UTF-8 bytes one token's text can be (decoded alone, or as its vocabulary piece)."""
    most = 1
    for i in range(tok.vocab_size):
        piece = tok.id_to_piece(i) or ""
        most = max(most, len(tok.decode([i]).encode("utf-8", "replace")), len(piece.encode("utf-8", "replace")))
    return most


class TokenizerPool:
    """Runs the functions above on `tokenizer`: inline for small inputs, else in the worker.

    Args:
      tokenizer: a picklable tokenizer (jserve's `Tokenizer`).
      max_jobs: large jobs queued or running at once before 429.
      workers: worker processes (0: run everything inline, for tests and tiny deployments).
    """

    def __init__(self, tokenizer: Any, *, max_jobs: int = 32, workers: int = 1):
        self.tokenizer = tokenizer
        self.max_jobs = max_jobs
        self.workers = workers
        self.max_token_bytes = max_token_bytes(tokenizer)
        self.num_jobs = 0  # large jobs queued or running (event-loop only)
        self._payload = pickle.dumps(tokenizer) if workers else b""
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        if workers:
            self._start()

    def _start(self) -> None:
        self._executor = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
            initargs=(self._payload,))
        self._executor.submit(int)  # start the worker now, not on the first large request

    async def run(self, size: int, fn: Callable, *args: Any) -> Any:
        """`fn(tokenizer, *args)`; `size` (bytes of input) picks inline or the worker."""
        if size <= INLINE_BYTES or self._executor is None:
            return fn(self.tokenizer, *args)
        if self.num_jobs >= self.max_jobs:
            raise APIError(429, f"too many large requests being tokenized ({self.num_jobs}); retry later",
                           code="tokenizer_busy", headers={"Retry-After": "1"})
        loop = asyncio.get_running_loop()
        self.num_jobs += 1
        try:
            job = self._executor.submit(_in_worker, fn, *args)
        except BrokenProcessPool:
            self.num_jobs -= 1
            raise self._broken() from None
        # the slot is free when the worker is done with the job, even if its client left before
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._release))
        try:
            return await asyncio.wrap_future(job)
        except BrokenProcessPool:
            raise self._broken() from None

    def _release(self) -> None:
        self.num_jobs -= 1

    def _broken(self) -> APIError:
        logger.error("the tokenizer worker process died; starting a new one")
        old, self._executor = self._executor, None
        if old is not None:
            old.shutdown(wait=False, cancel_futures=True)
        self._start()
        return APIError(503, "the tokenizer worker restarted; retry", code="tokenizer_restarted",
                        headers={"Retry-After": "1"})

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def check_text_size(num_bytes: int, max_input_tokens: int, token_bytes: int, param: str) -> None:
    """400 if `num_bytes` of text must hold more than `max_input_tokens` tokens (see the module doc)."""
    if num_bytes > 2 * max_input_tokens * token_bytes:
        raise bad_request(f"the prompt is {num_bytes} bytes of text, at least {num_bytes // (2 * token_bytes)} "
                          f"tokens (one token covers at most {token_bytes} bytes), but at most {max_input_tokens} "
                          f"are allowed", param=param, code="context_length_exceeded")
