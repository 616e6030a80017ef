"""Constraints compiled with llguidance: one matcher per sequence, one token bitmask per step.

`GrammarCompiler` (one per served tokenizer) turns a request's `StructuredOutputsParams` into an
llguidance grammar, checks and compiles it (cached by its canonical text; off the caller's thread
and within a time limit, so a schema too hard to compile is an error, not a stalled server), and
hands out a `GrammarMatcher` per sequence (a copy of the compiled one). Each step the runner asks
`fill_bitmasks` for the constrained rows' masks, int32 `[batch, ceil(vocab / 32)]`, bit `t % 32`
of word `t // 32` set where token t is allowed (llguidance's layout, which the sampler unpacks);
the engine feeds each sampled token back with `GrammarMatcher.consume`.

llguidance (not xgrammar, which needs torch): docs/performance.md, "Structured outputs".
See docs/architecture.md, "Structured outputs".
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import threading
import time
from typing import Any, Sequence

import numpy as np

from jserve.core.request import StructuredOutputsParams
from jserve.structured import reasoning
from jserve.structured.closing import CLOSE_HORIZON, Closer

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0  # a constraint not compiled within this is refused
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint the grammar library refuses; the message says what is wrong."""


class GrammarBusy(GrammarError):
    """Every compiler thread stayed busy with other constraints: not the request's fault (503)."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return (vocab_size + 31) // 32


def canonical(spec: StructuredOutputsParams) -> str:
    """The constraint as canonical text: the compile cache's key."""
    value = getattr(spec, spec.kind)
    try:
        if spec.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(f"structured_outputs.json is not valid JSON: {e}") from None
        if isinstance(value, tuple):
            value = list(value)
        key = [spec.kind, value, spec.disable_any_whitespace] + (["reasoning"] if spec.reasoning else [])
        return json.dumps(key, sort_keys=True, ensure_ascii=False)
    except RecursionError:
        raise GrammarError(f"structured_outputs.{spec.kind} is nested too deeply") from None


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet checked)."""
    import llguidance

    kind, value = spec.kind, getattr(spec, spec.kind)
    options = _COMPACT_JSON if spec.disable_any_whitespace else None
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"structured_outputs.json must be a JSON schema object, got "
                                   f"{type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(value), ensure_ascii=False))
        return llguidance.grammar_from("grammar", value)  # Lark, or GBNF converted to Lark
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(f"structured_outputs.{kind}: {e}") from None
    except RecursionError:
        raise GrammarError(f"structured_outputs.{kind} is nested too deeply") from None


class GrammarMatcher:
    """One sequence's place in its grammar (an llguidance `LLMatcher`)."""

    __slots__ = ("_matcher", "_closer", "_budget", "_used", "estimate")

    def __init__(self, matcher: Any, closer: Closer | None = None, budget: int | None = None):
        self._matcher = matcher
        self._closer = closer if budget is not None else None  # close_at_limit: see jserve.structured.closing
        self._budget = budget  # the tokens the sequence may generate
        self._used = 0
        self.estimate: int | None = None  # the last closing estimate (None: not near the budget)

    def consume(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the matcher is then in error)."""
        self._used += 1
        return bool(self._matcher.consume_token(int(token)))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar would accept from here (nothing is consumed); none
        once a closing sequence nears its budget (its masks must come from `close_mask`)."""
        if not tokens or (self._closer is not None and self._budget - self._used <= CLOSE_HORIZON + len(tokens)):
            return 0
        return int(self._matcher.validate_tokens([int(t) for t in tokens]))

    def close_mask(self, row: np.ndarray) -> None:
        """Narrow this step's filled mask `row` to closing tokens when the budget is near."""
        if self._closer is not None:
            self.estimate = self._closer.narrow(self._matcher, row, self._budget - self._used)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence ends)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class CompiledGrammar:
    """A checked, compiled constraint; `matcher()` gives each sequence its own copy."""

    def __init__(self, key: str, template: Any, seconds: float):
        self.key = key
        self._template = template
        self.seconds = seconds  # compile time

    def matcher(self, closer: Closer | None = None, budget: int | None = None) -> GrammarMatcher:
        """A sequence's own matcher; with a `closer` and its token `budget`, one that closes the
        output within it (`close_at_limit`)."""
        return GrammarMatcher(self._template.deep_copy(), closer, budget)


def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """llguidance's view of a `jserve.text.tokenizer.Tokenizer`, `vocab_size` ids wide (the model's)."""
    import llguidance

    eos = [int(t) for t in eos_token_ids] or list(tokenizer.eos_token_ids)
    if not eos:
        raise GrammarError("structured outputs need an end-of-sequence token, and this tokenizer has none")
    backend = tokenizer._backend
    if backend.kind == "hf":
        return llguidance.LLTokenizer(backend.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
    from llguidance._tokenizer import TokenizerWrapper

    return llguidance.LLTokenizer(TokenizerWrapper(_SentencePieceTokens(tokenizer, eos)), n_vocab=vocab_size,
                                  eos_token=eos)


class _SentencePieceTokens:
    """A sentencepiece vocabulary as llguidance reads one: each token's bytes, and an encoder."""

    def __init__(self, tokenizer: Any, eos: list[int]):
        self._tokenizer = tokenizer
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.tokens = [self._bytes(tokenizer.id_to_piece(i) or "") for i in range(tokenizer.vocab_size)]

    @staticmethod
    def _bytes(piece: str) -> bytes:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # a byte-fallback piece
        return piece.replace("\u2581", " ").encode("utf-8")

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles and caches the constraints of one tokenizer; thread-safe.

    `compile` runs the library's compilation in a pool of `workers` threads and waits at most
    `timeout` seconds from its start (the library bounds its own work too: llguidance's parser
    limits), and at most `queue_timeout` for a free thread (`GrammarBusy`).

    Why llguidance: it is a Rust library with an abi3 wheel and no Python dependencies; it computes
    a 49k-vocabulary mask in microseconds, takes JSON schema, regex, choice, Lark and GBNF; xgrammar,
    the other well-kept one, needs torch. Matchers are used on the engine thread only (compilation
    runs in a small pool of its own), which is what keeps concurrent requests apart: each sequence
    owns its matcher, nothing is shared.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *, cache_size: int = 256,
                 timeout: float = COMPILE_TIMEOUT_S, workers: int = 2):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self.timeout = timeout
        self.queue_timeout = 3 * timeout  # the most a constraint waits for a free compiler thread
        self._llg_tok: Any = None
        self._closer: Closer | None = None
        self.close_at_limit = False  # the default where a constraint leaves `close_at_limit` unset
        self._lock = threading.RLock()  # a done callback may run in compile(), under it
        self._tokenizer_lock = threading.Lock()  # the library's tokenizer is built once
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._cache_size = cache_size
        # compilations under way, by key: their future and (once a worker took it up) their start
        self._pending: dict[str, tuple[concurrent.futures.Future, list[float]]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jserve-grammar")
        self.num_compiled = 0
        self.compile_seconds = 0.0

    def _library_tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._llg_tok is None:
                self._llg_tok = _llg_tokenizer(self._tokenizer, self.vocab_size, self._eos)
            return self._llg_tok

    def closer(self) -> Closer:
        """The vocabulary's closing candidates (`close_at_limit`), built on first use."""
        tok = self._library_tokenizer()
        with self._tokenizer_lock:
            if self._closer is None:
                self._closer = Closer.for_tokenizer(tok)
            return self._closer

    def closes(self, spec: StructuredOutputsParams) -> bool:
        """Whether a constraint's sequences close within their budget (its own choice, else the default)."""
        return self.close_at_limit if spec.close_at_limit is None else spec.close_at_limit

    def prepare(self) -> None:
        """Build the library's view of the vocabulary now, in the background (a server calls this
        at start, so its first constrained request does not wait for it)."""
        self._pool.submit(self._library_tokenizer)

    def compile(self, spec: StructuredOutputsParams, timeout: float | None = None) -> CompiledGrammar:
        """The compiled constraint (from the cache when seen before; a compilation already under
        way for it is waited for, not repeated); GrammarError naming what is wrong with it, or
        saying it did not compile within `timeout` (default: the compiler's)."""
        key = canonical(spec)
        if self.closes(spec):
            self.closer()  # built here, off the engine thread
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            pending = self._pending.get(key)
            if pending is None:
                started: list[float] = []  # when a worker took it up
                future = self._pool.submit(self._timed_build, spec, key, started)
                pending = self._pending[key] = (future, started)
                future.add_done_callback(lambda f, key=key: self._done(key, f))
        future, started = pending
        limit = self.timeout if timeout is None else timeout
        queued = time.monotonic()
        while True:  # the limit counts from the compilation's start, not from its wait in the queue
            now = time.monotonic()
            wait = (started[0] + limit - now) if started else min(0.05, queued + self.queue_timeout - now)
            try:
                return future.result(timeout=max(wait, 0.0))
            except concurrent.futures.TimeoutError:
                now = time.monotonic()
                if started and now - started[0] >= limit:
                    raise GrammarError(f"structured_outputs.{spec.kind} could not be compiled within {limit:g} "
                                       f"s; simplify it") from None
                if not started and now - queued >= self.queue_timeout:
                    raise GrammarBusy(f"the grammar compiler is busy (compilations queued for "
                                      f"{self.queue_timeout:g} s); retry shortly") from None

    def _timed_build(self, spec: StructuredOutputsParams, key: str, started: list[float]) -> CompiledGrammar:
        started.append(time.monotonic())
        return self._build(spec, key)

    def _done(self, key: str, future: concurrent.futures.Future) -> None:
        """A compilation ended: cache its result (even if its caller stopped waiting)."""
        with self._lock:
            self._pending.pop(key, None)
            if future.cancelled() or future.exception() is not None:
                return
            compiled = future.result()
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
            self.compile_seconds += compiled.seconds

    def _build(self, spec: StructuredOutputsParams, key: str) -> CompiledGrammar:
        try:
            return self._compile(spec, key)
        except GrammarError:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - the library's own failure (a Rust panic is a BaseException)
            logger.exception("the grammar library failed on a %s constraint", spec.kind)
            raise GrammarError(f"structured_outputs.{spec.kind}: the grammar library failed on it "
                               f"({type(e).__name__})") from None

    def _compile(self, spec: StructuredOutputsParams, key: str) -> CompiledGrammar:
        import llguidance

        t0 = time.perf_counter()
        grammar = grammar_text(spec)
        if spec.reasoning:
            grammar = reasoning.wrap_grammar(grammar, *self._tag_ids(spec))
        tok = self._library_tokenizer()
        # An invalid grammar, and a schema keyword the library does not implement (`uniqueItems`:
        # ignoring it could break the schema), leave the matcher in error with the reason.
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs.{spec.kind}: {_first_line(matcher.get_error())}")
        unsupported = [w for w in matcher.get_grammar_warnings() if "unimplemented" in w.lower()
                       or "unsupported" in w.lower() or "ignor" in w.lower()]
        if unsupported:
            raise GrammarError(f"structured_outputs.{spec.kind}: {_first_line(unsupported[0])}")
        probe = matcher.deep_copy()  # the first mask, on a copy: a grammar that allows no output
        first = np.frombuffer(probe.compute_bitmask(), np.uint8)  # (`root ::= root`, a $ref loop) fails here
        if probe.is_error() or not first.any():
            why = _first_line(probe.get_error()) if probe.is_error() else "no token is allowed"
            raise GrammarError(f"structured_outputs.{spec.kind} can produce no text at all ({why})")
        return CompiledGrammar(key, matcher, time.perf_counter() - t0)

    def _tag_ids(self, spec: StructuredOutputsParams) -> list[int]:
        """The reasoning tags' token ids (each must be one token)."""
        ids = [self._tokenizer.encode(tag, add_special_tokens=False) for tag in (reasoning.START, reasoning.END)]
        if any(len(i) != 1 for i in ids):
            raise GrammarError(f"structured_outputs.{spec.kind}: the tokenizer writes {reasoning.START} and "
                               f"{reasoning.END} as several tokens, so the thinking before the output is not found")
        return [i[0] for i in ids]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _first_line(message: str) -> str:
    """A library message on one line, at most 300 characters."""
    message = str(message).split("<state>")[0]  # llguidance appends its parser state: not for clients
    text = " ".join(line.strip() for line in message.splitlines() if line.strip()) or message
    return text if len(text) <= 300 else text[:297] + "..."


_EXECUTOR: Any = None


def fill_bitmasks(rows: Sequence[tuple[GrammarMatcher, int]], out: np.ndarray) -> None:
    """Write each `(matcher, row)`'s allowed tokens into `out[row]` (int32 `[batch, width]`; the
    other rows are left as they are), in parallel over llguidance's thread pool."""
    global _EXECUTOR
    import llguidance
    import llguidance.numpy as llg_np

    if not rows:
        return
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    if len(rows) == 1:
        llg_np.fill_next_token_bitmask(rows[0][0]._matcher, out, rows[0][1])
    else:
        llg_np.fill_next_token_bitmask_par(_EXECUTOR, [(m._matcher, row) for m, row in rows], out)
    for matcher, row in rows:
        matcher.close_mask(out[row])


def fill_bitmasks_with_drafts(rows: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], out: np.ndarray) -> None:
    """Speculative decoding: for each `(matcher, row, drafts)`, the matcher's allowed tokens into
    `out[row]`, then after each prefix of `drafts` into `out[row + 1 ..]` (the matchers end where
    they began). The drafts must be ones the grammar accepts (`GrammarMatcher.valid_prefix`)."""
    global _EXECUTOR
    import llguidance
    import llguidance.numpy as llg_np

    fill_bitmasks([(m, row) for m, row, drafts in rows if not drafts], out)  # the library wants drafts
    drafted = [(m._matcher, row, [int(t) for t in drafts]) for m, row, drafts in rows if drafts]
    if not drafted:
        return
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    llg_np.fill_next_token_bitmask_par_with_draft_tokens(_EXECUTOR, drafted, out)


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids a bitmask row allows (the numpy reference of the sampler's unpacking)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask_row, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])
