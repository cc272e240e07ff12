"""Structured output: one matcher per constrained request, one token mask per step.

Model: each request's grammar is enforced by the engine `grammar_engines.route` chose for it
(xgrammar for JSON schemas, JSON objects, regexes and choices it enforces exactly; llguidance for
Lark grammars and the schemas xgrammar would not enforce exactly), with its own matcher (its
parser state). A step's masks (the tokens that keep each output inside its grammar) are computed
for all constrained requests at once into one packed bitmask (32 tokens a word, both engines'
layout; the sampler reads it as is, `greedy.argmax_rows`): xgrammar's matchers in one batched
call, llguidance's one after another. On a CPU this runs before the forward, on the forward's thread (a worker thread beside a forward that uses
every core slowed the forward by more than the masks cost); with `overlap` (the forward runs on
a GPU) in a worker thread while the model runs. After sampling, the matchers consume their
tokens the same way. Once a grammar is complete, or a matcher has rejected a token, only
end-of-sequence is allowed, so the request ends by itself.

Compiling a grammar (seconds for 256 choices of 600 characters) happens before the request
reaches the engine: `prepare` runs `compile` in the grammar worker, a thread beside the step
loop (xgrammar releases the GIL), the server waits for it at most `compile_timeout_s`, and the
compiled grammar is handed over with the request's add; the engine thread only builds the
matcher. Compiled grammars stay in xgrammar's cache, bounded by `cache_bytes` (least recently
used evicted); the offline API, with nothing handed over, compiles on add.

Deferred masks (`deferrable` requests: greedy, nothing else acting on the row, an xgrammar
matcher, a CPU forward): the mask is not computed before the forward; the row's free argmax is
offered to the matcher instead, and only when it rejects it is the mask computed and the masked
argmax taken (llama.cpp samples grammars the same way). Exact, not approximate: the argmax over
the allowed tokens is the free argmax whenever that is allowed, xgrammar accepts a token exactly
when its mask allows it, and a rejected token leaves the matcher's state as it was (both checked
over every token of a vocabulary, `test_a_rejected_token_leaves_the_matcher_as_it_was`). A
request whose token was rejected gets its next mask up front, then is deferred again.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from serve.core.sampling_params import MAX_GRAMMAR_CHARS, Grammar
from serve.model.grammar_engines import (
    JSON_SEPARATORS,
    GrammarError,
    Route,
    _llguidance,
    _xgrammar,
    route,
)
from serve.model.greedy import pack_allowed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Bitmasks", "GrammarBackend", "GrammarError", "Prepared"]

COMPILE_TIMEOUT_S = 60.0
"""How long a request waits for its grammar to compile (queued behind others included) before
it is refused (the compile itself runs on to its end in the worker, and its result is cached).
256 choices of 600 characters took 8 s on an idle 2-core CPU, over 30 s on a loaded one."""
CACHE_BYTES = 256 << 20
"""Compiled xgrammar grammars kept (xgrammar's own cache, least recently used evicted)."""


@dataclass(frozen=True)
class Prepared:
    """A grammar made ready for a matcher: its route, and xgrammar's compiled grammar (None
    for llguidance, whose matcher reads the route's grammar text)."""

    route: Route
    compiled: Any = None


@dataclass(frozen=True)
class Bitmasks:
    """A step's next-token masks, packed (bit t % 32 of int32 word t / 32 allows token t): row
    `rows[request id]` of `words` ([requests, ceil(vocab / 32)]); unconstrained rows allow all."""

    rows: dict[str, int]
    words: torch.Tensor

    def aligned(self, request_ids: list[str]) -> torch.Tensor:
        """The rows of these requests, in this order."""
        index = [self.rows[r] for r in request_ids]
        if index == list(range(len(self.rows))):
            return self.words
        return self.words[index]


class GrammarBackend:
    """The engine's side: both engines' views of the tokenizer (each built on first use, 0.2-1.5
    s for a 49k-262k vocabulary) and one matcher per constrained request."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_ids: list[int],
        overlap: bool = False,
    ) -> None:
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        # NOTE: a config may name an end-of-sequence id the model's vocabulary lacks (GPT-2's
        # 50256 on a small vocabulary); no logits row can pick it, so no mask allows it.
        self.eos_ids = [t for t in eos_ids if 0 <= t < vocab_size]
        self.matchers: dict[str, Any] = {}
        """request id: its xgrammar `GrammarMatcher` or llguidance `LLMatcher`."""
        self.batched: set[str] = set()
        """The requests whose matchers are xgrammar's (masks and tokens in batched calls)."""
        self.ended: set[str] = set()
        """Requests whose matcher accepted end-of-sequence or rejected a token."""
        self.deferrable: set[str] = set()
        """Requests whose masks may be deferred (see the module's docstring)."""
        self.deferred: set[str] = set()
        """Those whose mask this step was deferred: their token is offered to the matcher."""
        self.up_front: set[str] = set()
        """Deferrable requests whose last offered token was rejected: mask before the next."""
        self.counts = {"masks": 0, "deferred": 0, "rejected": 0}
        """Masks computed, masks deferred, deferred tokens rejected (so masked after all)."""
        self.overlap = overlap
        self.cache_bytes = CACHE_BYTES
        """The compiled-grammar cache's bound (read when the compiler is first built)."""
        self.compile_timeout_s = COMPILE_TIMEOUT_S
        self._llg_tokenizer: Any = None
        self._xgr_compiler: Any = None
        self._xgr_batch: Any = None
        self._worker: ThreadPoolExecutor | None = None
        self._compiling = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._lazy = threading.Lock()
        self._prepared: dict[str, Prepared] = {}
        """Grammars compiled off the step loop, by the request id that will add them."""
        eos = torch.zeros(vocab_size, dtype=torch.bool)
        eos[self.eos_ids] = True
        self._eos_words = pack_allowed(eos)

    def _llguidance_tokenizer(self) -> Any:
        with self._lazy:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = _llguidance().hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
        return self._llg_tokenizer

    def _xgrammar_compiler(self) -> Any:
        xgr = _xgrammar()
        with self._lazy:
            if self._xgr_compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.hf_tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_ids or None,
                )
                self._xgr_compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=self.cache_bytes
                )
                self._xgr_batch = xgr.BatchGrammarMatcher(max_threads="auto" if self.overlap else 1)
        return self._xgr_compiler

    @property
    def cached_bytes(self) -> int:
        """Bytes held by the compiled-grammar cache."""
        compiler = self._xgr_compiler
        return 0 if compiler is None else int(compiler.get_cache_size_bytes())

    def compile(self, grammar: Grammar) -> Prepared:
        """Route and compile `grammar` (blocking: seconds for a large one; `prepare` runs it
        off the step loop); raises `GrammarError` naming what cannot be enforced."""
        if len(grammar.spec) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"the {grammar.kind} is {len(grammar.spec)} characters; at most {MAX_GRAMMAR_CHARS}"
            )
        chosen = route(grammar)
        if chosen.engine != "xgrammar":
            self._llguidance_tokenizer()
            return Prepared(chosen)
        compiler, (kind, text) = self._xgrammar_compiler(), chosen.source
        if kind == "json":
            compiled = compiler.compile_json_schema(
                text, any_whitespace=False, separators=JSON_SEPARATORS
            )
        elif kind == "regex":
            compiled = compiler.compile_regex(text)
        else:
            compiled = compiler.compile_grammar(text)
        return Prepared(chosen, compiled)

    def prepare(self, grammar: Grammar) -> Future[Prepared]:
        """`compile` in the grammar worker (one thread, beside the step loop): a request waits
        there for its grammar, not in the engine, so it holds up no other request."""
        return self._compiling.submit(self.compile, grammar)

    def hand_over(self, request_id: str, prepared: Prepared) -> None:
        """The grammar `prepare` made for `request_id`, for its `add` (on the engine thread)."""
        self._prepared[request_id] = prepared

    def add(self, request_id: str, grammar: Grammar, deferrable: bool = False) -> None:
        """`deferrable`: the request is greedy and nothing but the grammar acts on its row.
        Uses the grammar handed over for this request, else compiles it here."""
        prepared = self._prepared.pop(request_id, None) or self.compile(grammar)
        if prepared.compiled is not None:
            self.matchers[request_id] = _xgrammar().GrammarMatcher(prepared.compiled)
            self.batched.add(request_id)
            if deferrable and not self.overlap:
                self.deferrable.add(request_id)
            return
        text = prepared.route.source[1]
        matcher = _llguidance().LLMatcher(self._llguidance_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {grammar.kind} cannot be enforced: {matcher.get_error()}")
        self.matchers[request_id] = matcher

    def release(self, request_id: str) -> None:
        self._prepared.pop(request_id, None)
        self.matchers.pop(request_id, None)
        self.batched.discard(request_id)
        self.ended.discard(request_id)
        self.deferrable.discard(request_id)
        self.deferred.discard(request_id)
        self.up_front.discard(request_id)

    def start_masks(self, request_ids: list[str]) -> Future[Bitmasks] | None:
        """Begin computing the next-token bitmasks of these requests (rows of those without a
        grammar, or whose mask is deferred, allow every token). None when no row needs one."""
        self.deferred = {
            r
            for r in request_ids
            if r in self.deferrable and r not in self.ended and r not in self.up_front
        }
        self.up_front.difference_update(request_ids)
        self.counts["deferred"] += len(self.deferred)
        if not any(r in self.matchers and r not in self.deferred for r in request_ids):
            return None
        if not self.overlap:  # no core to spare: computed here, before the forward
            done: Future[Bitmasks] = Future()
            done.set_result(self._masks(request_ids))
            return done
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._worker.submit(self._masks, request_ids)

    def masks_now(self, request_ids: list[str]) -> Bitmasks:
        """The masks of deferred requests whose offered token was rejected."""
        self.deferred.difference_update(request_ids)
        return self._masks(request_ids)

    def _masks(self, request_ids: list[str]) -> Bitmasks:
        words = torch.full((len(request_ids), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row_bytes = words.shape[1] * 4
        batched: list[Any] = []
        batched_rows: list[int] = []
        for i, request_id in enumerate(request_ids):
            matcher = self.matchers.get(request_id)
            if matcher is None or request_id in self.deferred:
                continue
            self.counts["masks"] += 1
            if request_id in self.ended:
                words[i] = self._eos_words
            elif request_id in self.batched:
                batched.append(matcher)
                batched_rows.append(i)
            else:
                matcher.unsafe_compute_mask_ptr(words.data_ptr() + i * row_bytes, row_bytes)
        if batched:
            self._xgr_batch.batch_fill_next_token_bitmask(batched, words, batched_rows)
        return Bitmasks({r: i for i, r in enumerate(request_ids)}, words)

    def consume(self, tokens: dict[str, int]) -> list[str]:
        """Advance the matchers of the constrained requests among `tokens` (request id: the
        token it sampled). Returns the deferred requests whose token was rejected (their
        matchers unchanged): they need `masks_now` and a token drawn under it."""
        batched: list[tuple[str, Any, int]] = []
        for request_id, token in tokens.items():
            matcher = self.matchers.get(request_id)
            if matcher is None or request_id in self.ended:
                continue
            if request_id in self.batched:
                batched.append((request_id, matcher, token))
            else:  # llguidance ends a matcher itself: its masks allow only end-of-sequence then
                matcher.consume_token(token)
        if not batched:
            return []
        accepted = self._xgr_batch.batch_accept_token(
            [m for _, m, _ in batched], [t for _, _, t in batched]
        )
        rejected = []
        for (request_id, _, token), ok in zip(batched, accepted):
            if not ok and request_id in self.deferred:
                rejected.append(request_id)
                self.up_front.add(request_id)
                continue
            if not ok or token in self.eos_ids:  # only a stop token ends an xgrammar matcher
                self.ended.add(request_id)
        self.counts["rejected"] += len(rejected)
        return rejected
