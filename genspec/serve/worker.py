"""The engine's thread: one thread owns the :class:`~genspec.engine.SpeculativeEngine` and steps it
while there is work; HTTP handlers submit requests and cancellations to it and receive every
:class:`~genspec.engine.RequestStep` of their requests through a listener.

Why a thread of its own: a step is a blocking model pass (tens to hundreds of milliseconds); the event
loop keeps serving HTTP (new requests, streams, /metrics) meanwhile. Which thread: ``genspec serve``
steps the engine in the main thread, the one that loaded the model, and runs HTTP in another
(:func:`genspec.serve.app.run_server` says why); an app embedded in someone else's server steps it
in a thread the app starts (:meth:`EngineWorker.start`). Requests join the running batch at the
next step boundary (continuous batching). The queue of requests waiting for a batch slot is bounded:
a submission that would overflow it is refused at once (429), never silently delayed; one larger than
the batch and the queue together is refused as such (400: it would never fit).

The routes reach the engine through the worker only; :func:`load_engine` loads it from a server's
:class:`~genspec.serve.settings.ServerSettings`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from genspec.engine import NO_DRAFTER, GenerationConfig, SpeculativeEngine
from genspec.records import RequestStats, RequestStep, StepRecord
from genspec.serve.settings import ServerSettings

#: called in the engine's thread with (request id, step) for every step of a request
Listener = Callable[[int, RequestStep], None]


def load_engine(settings: ServerSettings, progress: Callable[[str], None] | None = None) -> SpeculativeEngine:
    """The engine a server runs, from its settings' model, backend, drafters, dtype and batch size: loaded,
    and with ``measure_costs`` its verify costs measured for batch sizes up to ``max_batch_size``
    (``progress`` sees what is being measured)."""
    import genspec
    from genspec.calibration import calibrate_engine, served_batches

    engine = genspec.load(settings.model, drafter=settings.drafter, draft_model=settings.draft_model,
                          dtype=settings.dtype, extra_drafters=settings.extra_drafters,
                          max_batch_size=settings.max_batch_size, backend=settings.model_backend,
                          kernels=settings.kernels, measure_costs=False, **settings.drafter_options)
    if settings.measure_costs:
        calibrate_engine(engine, batches=served_batches(settings.max_batch_size), progress=progress)
    return engine


class QueueFull(Exception):
    """The waiting queue has no room for the submission."""


class ShuttingDown(Exception):
    """The server no longer takes requests."""


class NeverFits(Exception):
    """The submission has more requests than the batch and the queue hold together: it would be
    refused however long it waited."""


@dataclass
class _Submission:
    prompts: list[list[int]]
    configs: list[GenerationConfig]
    sample_indices: list[int]
    listener: Listener
    future: Future


class EngineWorker:
    """Steps ``engine`` in a thread of its own. ``max_queue``: requests that may wait for a slot in the
    running batch (the engine's ``max_batch_size``) before submissions are refused. ``on_record`` sees
    every step record (metrics)."""

    def __init__(self, engine: SpeculativeEngine, max_queue: int = 64,
                 on_record: Callable[[StepRecord, "EngineWorker"], None] | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.on_record = on_record
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_Submission] = []
        self._cancels: list[int] = []
        self._listeners: dict[int, Listener] = {}
        self._queued = 0  # submitted, not yet added to the engine
        self._accepting = True
        self._deadline: float | None = None  # set by a drain: when requests still in flight are cancelled
        self._thread = threading.Thread(target=self.run, name="genspec-engine", daemon=True)

    # ------------------------------------------------------------------ the handlers' side
    def start(self) -> None:
        """Step the engine in a thread of its own (:meth:`run`)."""
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        # the engine's own queue: a request leaves it when it joins the running batch, at the start of a
        # step (a set kept here and updated after the step counted a request as running and waiting at
        # once during its first step, refusing one request too many)
        return self._queued + self.engine.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def thread_alive(self) -> bool:
        """Whether the thread :meth:`start` started is still stepping the engine."""
        return self._thread.is_alive()

    @property
    def capacity(self) -> int:
        """Requests the engine's batch and the waiting queue hold together: more are never taken at once."""
        return self.max_queue + (self.engine.max_batch_size or 0)

    @property
    def accepting(self) -> bool:
        return self._accepting

    # what the routes know of the engine (they reach it through this worker only)
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_context(self) -> int | None:
        """The model's context length (None: unbounded)."""
        return self.engine.target.max_context

    @property
    def default_drafter(self) -> str:
        return self.engine.default_drafter

    @property
    def drafters(self) -> list[str]:
        """The drafters a request may choose, ``none`` first."""
        return [NO_DRAFTER, *self.engine.drafters]

    def submit(self, prompts: list[list[int]], configs: list[GenerationConfig], sample_indices: list[int],
               listener: Listener) -> Future:
        """Queue requests (one per prompt); the future resolves to their ids once the engine took them,
        or to the engine's error (a bad drafter name, a prompt too long, ...), in which case none runs."""
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(prompts) > self.capacity:
                raise NeverFits(f"this request asks for {len(prompts)} sequences at once (prompts x n), and the "
                                f"server holds at most {self.capacity} (running and waiting): send fewer prompts "
                                f"or a smaller n")
            if self.num_waiting + len(prompts) > self.max_queue + max(0, self._free_slots()):
                raise QueueFull(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
            future: Future = Future()
            self._inbox.append(_Submission(prompts, configs, sample_indices, listener, future))
            self._queued += len(prompts)
        self._wake.set()
        return future

    def cancel(self, request_ids: list[int]) -> None:
        """Stop these requests (a client went away): their rows are freed at the next step boundary."""
        with self._lock:
            self._cancels.extend(request_ids)
        self._wake.set()

    def stop_accepting(self) -> None:
        self._accepting = False

    def begin_drain(self, grace_s: float) -> None:
        """Stop taking requests; those in flight may run ``grace_s`` seconds more, then are cancelled, and
        :meth:`run` returns once nothing is left. Only sets attributes (no lock), so a signal handler may
        call it while the same thread is inside :meth:`run`. Called again, it keeps the earlier deadline
        (the same signal is heard twice: by the HTTP thread at once, by the main thread's handler later)."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline

    def drain(self, grace_s: float) -> None:
        """:meth:`begin_drain`, then wait for the thread :meth:`start` started to finish."""
        self.begin_drain(grace_s)
        self._wake.set()
        if self.thread_alive:
            self._thread.join(timeout=grace_s + 30)

    def _free_slots(self) -> int:
        limit = self.engine.max_batch_size
        return 0 if limit is None else limit - self.engine.num_running

    # ------------------------------------------------------------------ the engine's thread
    def run(self, keep_running: Callable[[], bool] | None = None) -> None:
        """Step the engine in the calling thread while there is work, until a drain finishes (or,
        when ``keep_running`` turns false, at once: whatever is in flight is cancelled)."""
        while True:
            if keep_running is not None and self._deadline is None and not keep_running():
                self.begin_drain(0.0)
            self._take_inbox()
            if self._deadline is not None and time.monotonic() >= self._deadline:
                for request_id in list(self._listeners):  # grace is over: cancel (idempotent)
                    self.engine.cancel(request_id)
            if self.engine.has_unfinished():
                try:
                    record = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - fail what was in flight, keep serving
                    self._fail_in_flight(exc)
                    continue
                self._dispatch(record)
            elif self._deadline is not None and not self._inbox:
                return
            else:
                self._wake.wait(0.1)
                self._wake.clear()

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for submission in inbox:
            ids = []
            try:
                for prompt, config, index in zip(submission.prompts, submission.configs, submission.sample_indices):
                    ids.append(self.engine.add_request(prompt, config, sample_index=index))
            except Exception as exc:  # noqa: BLE001 - the submission's own error: none of it runs
                for request_id in ids:
                    self.engine.cancel(request_id)
                submission.future.set_exception(exc)
                continue
            finally:  # counted as queued until the engine holds them, so num_waiting never dips
                with self._lock:
                    self._queued -= len(submission.prompts)
            for request_id in ids:
                self._listeners[request_id] = submission.listener
            submission.future.set_result(ids)
        for request_id in cancels:
            self.engine.cancel(request_id)

    def _dispatch(self, record: StepRecord) -> None:
        if self.on_record is not None:
            self.on_record(record, self)
        for request_id, step in record.requests.items():
            listener = self._listeners.get(request_id)
            if step.finish_reason is not None:
                self._listeners.pop(request_id, None)
            if listener is not None:
                listener(request_id, step)

    def _fail_in_flight(self, exc: Exception) -> None:
        """A step failed outside any one request's drafting (a bug, or the model itself): the requests in
        that step fail with the error, the engine is emptied, and the server goes on; the traceback goes
        to the log (the clients get the one-line message)."""
        logging.getLogger("genspec.serve").error("a step failed", exc_info=exc)
        message = f"{type(exc).__name__}: {exc}"
        for request_id in list(self._listeners):
            self.engine.cancel(request_id)
        self.engine.step()  # reports the cancellations; nothing runs any more
        for request_id, listener in list(self._listeners.items()):
            listener(request_id, RequestStep([], 0, 0, [], "error", RequestStats(), error=message))
        self._listeners.clear()
