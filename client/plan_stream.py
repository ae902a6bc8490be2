"""Plans over one long-lived PlanStream call (AsyncKVClient.plan).

A unary call pays grpcio's per-call setup each time (on loopback about half of a Plan's
round trip); a stream pays it once. The service answers a stream's requests in the order
they came, so each request is queued with its caller's future in one step (no await
between: a cancel cannot split them), a writer task sends the queue in order and a
reader task hands each answer to the oldest future. A caller that gives up (timeout,
cancel) stays queued until its answer arrives, which keeps the order; the lease that
answer holds is released then. A broken call fails the callers still waiting on it;
the next Plan opens a new one (after a restart of the service, say).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable

import grpc

from kvclient.errors import DeadlineExceededError, KVCraftError, UnavailableError, from_rpc_error, from_status
from kvcraft.v1 import kvcraft_pb2 as pb


# How a call that broke ends on the client: the service stopped (UNAVAILABLE), the call
# was cancelled, or grpcio lost the status in a write's race with the end (INTERNAL,
# grpc/grpc#36066). Refusals of one request come in the stream; an auth failure ends the
# call with its own code.
_BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)


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
        error: KVCraftError = UnavailableError(grpc.StatusCode.UNAVAILABLE, "the service ended the PlanStream call")
        try:
            async for got in self.call:
                answer = self.waiting.popleft()
                if not answer.done():
                    answer.set_result(got)
                elif got.WhichOneof("result") == "plan" and got.plan.lease_id:
                    self.release(got.plan.lease_id)  # its caller gave up: free what the plan holds
        except grpc.RpcError as e:
            error = from_rpc_error(e)
            if error.code in _BROKEN:
                error = UnavailableError(grpc.StatusCode.UNAVAILABLE,
                                         f"the PlanStream call broke ({error.code.name}): this Plan was not "
                                         "answered; the next one opens a new call")
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

    async def plan(self, request: pb.PlanRequest, timeout: float) -> pb.PlanResponse:
        if self._current is None or self._current.ended:
            self._current = _Call(self._open_call(), self._forget)
        answer = self._current.send(request)
        try:
            got = await asyncio.wait_for(answer, timeout)  # cancels `answer` on a timeout or a cancel
        except TimeoutError:
            raise DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"no Plan answer within {timeout} s") from None
        if got.WhichOneof("result") == "error":
            raise from_status(got.error.code, got.error.message)
        return got.plan

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
