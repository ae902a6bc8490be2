"""Plans over one long-lived PlanStream call (AsyncKVClient.plan, KVClient.plan); each
answer is turned into a `kvcraft.plans.Plan` record (kvclient.messages.plan_of).

A unary call pays grpcio's per-call setup each time (on loopback about half of a Plan's
round trip); a stream pays it once. The service answers a stream's requests in the order
they came, so each request is queued with its caller's future in one step (nothing in
between: a cancel cannot split them), the queue is sent in order and a reader hands each
answer to the oldest future. A caller that gives up (timeout, cancel) stays queued until
its answer arrives, which keeps the order; the lease that answer holds is released then.
A broken call fails the callers still waiting on it; the next Plan opens a new one (after
a restart of the service, say).

`PlanStream` does this with asyncio tasks; `BlockingPlanStream` with threads, for the
blocking client: grpcio's own thread sends the request queue, a reader thread answers
`concurrent.futures.Future`s, and one watchdog thread fails those whose timeout passed
(grpcio's blocking stream cannot wait for one message with a timeout).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Iterator

import grpc

from kvclient.errors import DeadlineExceededError, KVCraftError, UnavailableError, from_rpc_error, from_status
from kvclient.messages import plan_of
from kvcraft.plans import Plan
from kvcraft.v1 import kvcraft_pb2 as pb


# How a call that broke ends on the client: the service stopped (UNAVAILABLE), the call
# was cancelled, or grpcio lost the status in a write's race with the end (INTERNAL,
# grpc/grpc#36066). Refusals of one request come in the stream; an auth failure ends the
# call with its own code.
_BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
_ENDED = "the service ended the PlanStream call"


def _call_error(e: grpc.RpcError) -> KVCraftError:
    """What the callers still waiting on a call that ended with `e` are told."""
    error = from_rpc_error(e)
    if error.code in _BROKEN:
        return UnavailableError(grpc.StatusCode.UNAVAILABLE, f"the PlanStream call broke ({error.code.name}): "
                                "this Plan was not answered; the next one opens a new call")
    return error


def _answer(got: pb.PlanStreamResponse) -> Plan:
    if got.WhichOneof("result") == "error":
        raise from_status(got.error.code, got.error.message)
    return plan_of(got.plan)


class _Call:
    """One PlanStream call: its queue of requests to send and of callers to answer."""

    def __init__(self, call: Any, release: Callable[[str], None]) -> None:
        self.call = call
        self.release = release
        self.outbox: asyncio.Queue[pb.PlanRequest] = asyncio.Queue()
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.ended = False
        self.writer = asyncio.create_task(self._write())
        self.reader = asyncio.create_task(self._read())

    def send(self, request: pb.PlanRequest) -> asyncio.Future:
        answer = asyncio.get_running_loop().create_future()
        self.waiting.append(answer)
        self.outbox.put_nowait(request)
        return answer

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self.outbox.get())
        except (grpc.RpcError, asyncio.InvalidStateError):
            self.call.cancel()  # the reader sees the end and fails those waiting

    async def _read(self) -> None:
        error: KVCraftError = UnavailableError(grpc.StatusCode.UNAVAILABLE, _ENDED)
        try:
            async for got in self.call:
                answer = self.waiting.popleft()
                if not answer.done():
                    answer.set_result(got)
                elif got.WhichOneof("result") == "plan" and got.plan.lease_id:
                    self.release(got.plan.lease_id)  # its caller gave up: free what the plan holds
        except grpc.RpcError as e:
            error = _call_error(e)
        finally:
            self.ended = True
            self.writer.cancel()
            while self.waiting:
                answer = self.waiting.popleft()
                if not answer.done():
                    answer.set_exception(error)

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.gather(self.reader, self.writer, return_exceptions=True)


class PlanStream:
    def __init__(self, open_call: Callable[[], Any], release: Callable[[str], Any]) -> None:
        """open_call: starts a PlanStream call; release: ends a lease (a coroutine), for
        the answers nobody waits for any more."""
        self._open_call = open_call
        self._release = release
        self._current: _Call | None = None
        self._orphans: set[asyncio.Task] = set()

    async def plan(self, request: pb.PlanRequest, timeout: float) -> Plan:
        if self._current is None or self._current.ended:
            self._current = _Call(self._open_call(), self._forget)
        answer = self._current.send(request)
        try:
            got = await asyncio.wait_for(answer, timeout)  # cancels `answer` on a timeout or a cancel
        except TimeoutError:
            raise DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"no Plan answer within {timeout} s") from None
        return _answer(got)

    def _forget(self, lease_id: str) -> None:
        task = asyncio.create_task(self._release_quietly(lease_id))
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _release_quietly(self, lease_id: str) -> None:
        try:
            await self._release(lease_id)
        except KVCraftError:
            pass  # the service is gone or the lease expired: either way nothing is held

    async def close(self) -> None:
        if self._current is not None:
            await self._current.close()
        await asyncio.gather(*self._orphans, return_exceptions=True)


_END = object()  # ends a blocking call's request iterator


class _BlockingCall:
    """One PlanStream call of the blocking client. `send` runs with the stream's lock held."""

    def __init__(self, open_call: Callable[[Iterator[pb.PlanRequest]], Any], release: Callable[[str], None],
                 lock: threading.Lock) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: collections.deque[Future] = collections.deque()
        self.ended = False
        self.release = release
        self.lock = lock
        self.call = open_call(iter(self.requests.get, _END))  # grpcio's thread sends what the queue gets
        self.reader = threading.Thread(target=self._read, name="kvcraft-plan-reader", daemon=True)
        self.reader.start()

    def send(self, request: pb.PlanRequest, deadline: float, timeout: float) -> Future:
        answer = _Answer(deadline, timeout)
        self.waiting.append(answer)
        self.requests.put(request)
        return answer

    def _read(self) -> None:
        error: KVCraftError = UnavailableError(grpc.StatusCode.UNAVAILABLE, _ENDED)
        try:
            for got in self.call:
                with self.lock:
                    answer = self.waiting.popleft()
                try:
                    if time.monotonic() > answer.deadline:  # late, as a unary call's answer past its deadline
                        raise answer.expired()
                    answer.set_result(_answer(got))
                except DeadlineExceededError as late:
                    _settle(answer, late)
                    if got.plan.lease_id:  # nobody uses this Plan: free what it holds
                        self.release(got.plan.lease_id)
                except KVCraftError as refused:
                    _settle(answer, refused)
                except InvalidStateError:  # its caller gave up (timeout, cancel): free what the plan holds
                    if got.plan.lease_id:
                        self.release(got.plan.lease_id)
        except grpc.RpcError as e:
            error = _call_error(e)
        finally:
            with self.lock:
                self.ended = True
                waiting, self.waiting = self.waiting, collections.deque()
            self.requests.put(_END)  # grpcio's sending thread waits on the queue: let it end
            for answer in waiting:
                _settle(answer, error)


class _Answer(Future):
    """The Future of one Plan sent on a blocking call, with the deadline it was sent with."""

    def __init__(self, deadline: float, timeout: float) -> None:
        super().__init__()
        self.deadline = deadline
        self.timeout = timeout

    def expired(self) -> DeadlineExceededError:
        return DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no Plan answer within {self.timeout} s")


def _settle(answer: Future, error: Exception) -> None:
    """Fail `answer` unless it is done already (answered, timed out or cancelled)."""
    try:
        answer.set_exception(error)
    except InvalidStateError:
        pass


class BlockingPlanStream:
    def __init__(self, open_call: Callable[[Iterator[pb.PlanRequest]], Any],
                 release: Callable[[str], Any]) -> None:
        """open_call: starts a PlanStream call that sends what the iterator yields;
        release: starts a Release call without waiting (and keeps it until it ends), for
        the answers nobody waits for any more. Neither may refer to the client: its
        threads would keep it alive (a client dropped without close() ends them through
        `close(wait=False)`)."""
        self._open_call = open_call
        self._release = release
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._current: _BlockingCall | None = None
        # (deadline, n, future) of the Plans sent. The watchdog drops answered ones
        # as they reach the top and fails those past their deadline; it is woken only when a
        # new deadline is the earliest, so a Plan costs it nothing when timeouts are alike.
        # `plan_future` drops the answered ones when they outnumber the waiting ones.
        self._deadlines: list[tuple[float, int, _Answer]] = []
        self._numbers = itertools.count()
        self._watchdog: threading.Thread | None = None
        self._closed = False

    def plan_future(self, request: pb.PlanRequest, timeout: float) -> Future:
        """A Future of the Plan; its exception a KVCraftError (DeadlineExceededError
        after `timeout`). Cancel it to give up: the lease its answer holds is released. Its
        callbacks run on the client's reader or watchdog thread: they must not wait for a Plan."""
        with self._lock:
            if self._closed:
                raise UnavailableError(grpc.StatusCode.UNAVAILABLE, "the client is closed")
            if self._current is None or self._current.ended:
                self._current = _BlockingCall(self._open_call, self._forget, self._lock)
            answer = self._current.send(request, time.monotonic() + timeout, timeout)
            entry = (answer.deadline, next(self._numbers), answer)
            heap = self._deadlines
            if len(heap) > 2 * len(self._current.waiting) + 64:  # mostly answered: keep it to what waits
                heap[:] = [e for e in heap if not e[2].done()]
                heapq.heapify(heap)
            heapq.heappush(heap, entry)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._expire, name="kvcraft-plan-deadlines", daemon=True)
                self._watchdog.start()
            elif heap[0] is entry:
                self._wake.notify()
        return answer

    def plan(self, request: pb.PlanRequest, timeout: float) -> Plan:
        answer = self.plan_future(request, timeout)
        try:
            return answer.result()
        except BaseException:
            answer.cancel()  # interrupted (KeyboardInterrupt): its answer's lease is released when it comes
            raise

    def _expire(self) -> None:
        while True:
            expired = []
            with self._lock:
                now = time.monotonic()
                heap = self._deadlines
                while heap and (heap[0][2].done() or heap[0][0] <= now):
                    _, _, answer = heapq.heappop(heap)
                    if not answer.done():
                        expired.append(answer)
                if not expired:
                    if self._closed:
                        return
                    self._wake.wait(heap[0][0] - now if heap else None)
            for answer in expired:  # outside the lock: a future's callbacks may plan again
                _settle(answer, answer.expired())

    def _forget(self, lease_id: str) -> None:
        try:
            self._release(lease_id)
        except Exception:  # noqa: BLE001 - the client is closing, or the service gone: the lease expires by its ttl
            pass

    def close(self, wait: bool = True) -> None:
        """Fail what still waits and end the threads (wait: until they have ended)."""
        with self._lock:
            self._closed = True
            current, watchdog = self._current, self._watchdog
            self._wake.notify()
        if current is not None:
            current.call.cancel()
        if wait:
            for t in (current.reader if current is not None else None, watchdog):
                if t is not None and t is not threading.current_thread():
                    t.join(5)
