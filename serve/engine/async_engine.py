"""The engine in a background thread, driven from asyncio.

Model: one thread owns the `LLMEngine` and loops: run the commands queued since the last step
(add, abort), then `step()` if anything is unfinished, else sleep until woken. Coroutines never
touch the engine: they queue a command and await its future. Each request's outputs are pushed
to its own `OutputCollector` on the event loop. So adds and aborts take effect between steps, and
a client that goes away has its request aborted (and its blocks freed) before the next step.
A constrained request's grammar is compiled before it is queued, in the grammar worker (a thread
beside the step loop, with a time bound): the engine only makes its matcher.

Each request's outputs wait in its `OutputCollector` (`output_collector.py`). A reader that
falls more than `max_unread_tokens` behind (a client that stopped reading its stream) has its
request aborted, counted with finish reason `slow_reader`: what one request can hold on the
server is bounded whatever its client does.

A failed step (`StepFailed`) fails only the requests it scheduled; the loop goes on. After
`UNHEALTHY_AFTER` failed steps in a row the engine reports itself unhealthy (until a step
succeeds again). Only a failure outside the step's computation (the scheduler's own state) stops
the loop for good (`dead`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from serve.core.sampling_params import Grammar, SamplingParams
from serve.core.stats import EngineStats
from serve.engine.llm_engine import InvalidRequest, LLMEngine, RequestOutput, StepFailed
from serve.engine.metrics import ServerMetrics
from serve.engine.output_collector import (
    EngineDeadError,
    OutputCollector,
    ReaderTooSlow,
    RequestFailed,
    Tracked,
    UnknownAdapter,
)
from serve.lora.adapter import Adapter
from serve.model.grammar import GrammarError, Prepared
from serve.model.openmp_pool import release_thread_pool

log = logging.getLogger(__name__)
T = TypeVar("T")
UNHEALTHY_AFTER = 3
"""Failed steps in a row after which /health reports the engine as not serving."""


class AsyncEngine:
    def __init__(
        self, engine: LLMEngine, metrics: ServerMetrics, max_unread_tokens: int = 4096
    ) -> None:
        self.engine, self.metrics = engine, metrics
        self.max_unread_tokens = max_unread_tokens
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats: EngineStats = engine.stats()
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        """The server's own tokenizer (encoding prompts on worker threads, decoding response
        fields on the loop); the engine thread detokenizes with the engine's, so no tokenizer
        object is used on both sides."""
        self.max_model_len: int = engine.max_model_len
        self.context_limit: int = engine.context_limit
        self.vocab_size: int = engine.vocab_size
        self.lora_enabled = engine.adapters is not None
        self.sampling_defaults = dict(engine.sampling_defaults)
        """Fixed when the engine is built: read by coroutines without reaching the engine."""
        self._adapter_names: tuple[str, ...] = ()
        """The loaded adapter names, least recently used first, as of the last load, unload or
        request that named one: written on the engine thread, read by coroutines (the table
        itself is reordered on the engine thread by every request that resolves a name)."""
        self._snapshot_adapters()
        self.dead: BaseException | None = None
        self.failed_steps_in_a_row = 0

    @property
    def healthy(self) -> bool:
        return self.dead is None and self.failed_steps_in_a_row < UNHEALTHY_AFTER

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        runner = self.engine.runner
        self.metrics.describe_cache(
            self.engine.cache_config.block_size, runner.num_blocks, runner.layout.bytes_per_token()
        )
        self.metrics.observe_stats(self.stats)
        release_thread_pool()  # the loader's OpenMP workers: the engine thread computes now
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    def _call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed: {self.dead!r}")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put((fn, future))
        self._wake.set()
        return asyncio.wrap_future(future)

    async def add(
        self, request_id: str, prompt: list[int], params: SamplingParams, adapter: str | None = None
    ) -> Tracked:
        """Queue a request (on adapter `adapter`'s current version); raises `InvalidRequest`
        when it is refused and `UnknownAdapter` when the adapter is not loaded (any more)."""
        collector = OutputCollector(params.output_kind)
        tracked = Tracked(request_id, collector, time.perf_counter(), len(prompt))
        self._tracked[request_id] = tracked
        grammars = self.engine.grammars

        def add(prepared: Prepared | None) -> None:
            version = None
            if adapter is not None:
                registry = self.engine.adapters
                version = registry.resolve(adapter) if registry is not None else None
                if version is None:
                    raise UnknownAdapter(adapter)
                self._snapshot_adapters()  # its least-recently-used order
            if prepared is not None:
                grammars.hand_over(request_id, prepared)
            try:
                self.engine.add_request(request_id, prompt, params, adapter_id=version)
            except BaseException:
                grammars.release(request_id)
                raise

        try:
            prepared = None if params.grammar is None else await self._compiled(params.grammar)
            await self._call(lambda: add(prepared))
        except BaseException:
            self._tracked.pop(request_id, None)
            raise
        return tracked

    async def _compiled(self, grammar: Grammar) -> Prepared:
        """The grammar compiled in the grammar worker, waited for at most its time bound
        (`GrammarError` past it: the compile runs on, and its result is cached)."""
        grammars = self.engine.grammars
        future = asyncio.wrap_future(grammars.prepare(grammar))
        try:
            return await asyncio.wait_for(asyncio.shield(future), grammars.compile_timeout_s)
        except TimeoutError:
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise GrammarError(
                f"the {grammar.kind} did not compile within {grammars.compile_timeout_s:g} s; "
                "simplify it (fewer or shorter alternatives, a smaller schema)"
            ) from None

    async def load_lora(
        self, name: str, path: Path, root: Path | None = None, evict: bool = False
    ) -> tuple[int, list[str]]:
        """Read (and check) the adapter off the engine thread, then register it between two
        steps; returns its version and the names evicted to make room."""
        registry, slots = self.engine.adapters, self.engine.runner.lora_slots
        if registry is None or slots is None:
            raise InvalidRequest(
                "LoRA serving is off; start the server with --max-loras N (or --lora)"
            )
        started = time.perf_counter()

        def read() -> Adapter:
            try:
                return slots.read(path, root)
            finally:  # its checks may have made OpenMP workers on this thread: one pool only
                release_thread_pool()

        adapter = await asyncio.to_thread(read)

        def register() -> tuple[int, list[str]]:
            before = set(registry.current)
            version = registry.register(name, adapter, evict)
            self._snapshot_adapters()
            return version, sorted(before - set(registry.current))

        version, evicted = await self._call(register)
        for gone in evicted:
            self.metrics.forget_adapter(gone)
        self.metrics.observe_lora_load(time.perf_counter() - started, len(self._adapter_names))
        return version, evicted

    async def unload_lora(self, name: str) -> int:
        """Unload `name`; `UnknownAdapter` when it is not loaded (decided on the engine thread,
        so of two racing unloads exactly one succeeds and the other gets 404)."""
        registry = self.engine.adapters
        if registry is None:
            raise UnknownAdapter(name)

        def unload() -> int:
            if name not in registry.current:
                raise UnknownAdapter(name)
            version = registry.unload(name)
            self._snapshot_adapters()
            return version

        version = await self._call(unload)
        self.metrics.observe_lora_load(None, len(self._adapter_names))
        self.metrics.forget_adapter(name)
        return version

    def _snapshot_adapters(self) -> None:
        """On the engine thread (or before it starts): copy the adapter table's names."""
        registry = self.engine.adapters
        self._adapter_names = tuple(registry.current) if registry else ()

    def adapter_names(self) -> list[str]:
        return list(self._adapter_names)

    async def abort(self, request_id: str, reason: str = "abort") -> None:
        await self.abort_all([request_id], reason)

    async def abort_all(self, request_ids: list[str], reason: str = "abort") -> None:
        """End these requests (those still running) in one engine command. Safe to call from a
        cancelled task (a stream whose client left: anyio cancels every await there): every
        request is ended and its abort queued before the first await."""
        now = time.perf_counter()
        ended = [r for r in request_ids if self._end(r, reason, now) is not None]
        if not ended or self.dead is not None:
            return
        engine = self.engine
        await asyncio.shield(self._call(lambda: [engine.abort(r) for r in ended]))

    async def stream(self, tracked: Tracked) -> AsyncIterator[RequestOutput]:
        """Outputs of one added request until it finishes; aborts it if the consumer leaves."""
        try:
            while True:
                item = await tracked.collector.get()
                yield item
                if item.finished:
                    return
        finally:
            if not tracked.finished:
                await self.abort(tracked.request_id)

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> RequestOutput:
        tracked = await self.add(request_id, prompt, params)
        last = None
        async for last in self.stream(tracked):  # noqa: B007
            pass
        assert last is not None
        return last

    # --- the engine thread ---

    def _run(self) -> None:
        while not self._stop.is_set():
            ran = self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                if ran:  # aborts of the last requests: no step follows to refresh the gauges
                    self._refresh_stats(step=False)
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except StepFailed as e:
                log.error("engine step failed; ending its requests %s", e.request_ids, exc_info=e)
                self.failed_steps_in_a_row += 1
                self._fail_requests(e.request_ids, e.cause)
                self._refresh_stats(step=True)
                continue
            except Exception as e:  # the scheduler's state is not to be trusted: stop
                log.exception("engine loop failed")
                self.dead = e
                self._fail_all(EngineDeadError(f"the engine failed: {e!r}"))
                return
            self.failed_steps_in_a_row = 0
            self._refresh_stats(step=True)
            now = time.perf_counter()
            self._observe_tokens(now)
            for out in outputs:
                self._deliver(out, now)

    def _refresh_stats(self, step: bool) -> None:
        self.stats = self.engine.stats()
        self.metrics.observe_stats(self.stats, step)

    def _drain_inbox(self) -> int:
        """Run the queued commands; returns how many ran."""
        ran = 0
        while True:
            try:
                fn, future = self._inbox.get_nowait()
            except queue.Empty:
                return ran
            ran += 1
            try:
                future.set_result(fn())
            except Exception as e:
                future.set_exception(e)

    def _fail_requests(self, request_ids: list[str], cause: BaseException) -> None:
        assert self._loop is not None
        error = RequestFailed(
            f"the engine failed while computing this request ({type(cause).__name__}: {cause}); "
            "it was ended, other requests are unaffected"
        )
        for request_id in request_ids:
            tracked = self._end(request_id, "error", time.perf_counter())
            if tracked is not None:
                self._loop.call_soon_threadsafe(tracked.collector.put, error)

    def _observe_tokens(self, now: float) -> None:
        """Time to first token and between tokens of every request that got tokens this step
        (whether or not an output was returned for it)."""
        for request_id, num_tokens in self.engine.progress.items():
            tracked = self._tracked.get(request_id)
            if tracked is None or num_tokens <= tracked.num_tokens:
                continue
            since = now - (tracked.last_token_at or tracked.arrival)
            first = tracked.last_token_at is None
            self.metrics.observe_token(first, since, num_tokens - tracked.num_tokens)
            tracked.last_token_at, tracked.num_tokens = now, num_tokens

    def _deliver(self, out: RequestOutput, now: float) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:  # aborted meanwhile
            return
        if out.finished:
            self._end(out.request_id, out.finish_reason or "abort", now)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._push, tracked, out)

    def _push(self, tracked: Tracked, out: RequestOutput) -> None:
        """On the event loop: hand `out` to the request's reader, or abort a request whose
        reader has fallen more than `max_unread_tokens` behind."""
        tracked.collector.put(out)
        if tracked.finished or tracked.collector.unread_tokens <= self.max_unread_tokens:
            return
        tracked.collector.fail(
            ReaderTooSlow(
                f"the client read none of the last {self.max_unread_tokens} tokens of this "
                "stream; the request was aborted (raise --max-unread-tokens to allow slower "
                "readers)"
            )
        )
        request_id = tracked.request_id
        if self._end(request_id, "slow_reader", time.perf_counter()) and self.dead is None:
            aborted = self._call(lambda: self.engine.abort(request_id))
            aborted.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _end(self, request_id: str, reason: str, now: float) -> Tracked | None:
        """Stop tracking a request and count its finish; None when it had already ended (an
        abort and the engine's last output can race: exactly one of them ends it)."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            tracked.finished = True
            self.metrics.observe_finish(reason, tracked.num_prompt_tokens, now - tracked.arrival)
        return tracked

    def _fail_all(self, error: BaseException) -> None:
        assert self._loop is not None
        for tracked in list(self._tracked.values()):
            self._loop.call_soon_threadsafe(tracked.collector.put, error)
        while True:
            try:
                _, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            future.set_exception(error)
