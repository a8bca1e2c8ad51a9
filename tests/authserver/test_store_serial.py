"""The SQLite store's worker thread (store/serial.py): calls run one at a time in the order
they were made, each caller gets its own result or exception, a call cancelled before it
started does not run, and calls that queue up behind a busy worker are answered together."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from authserver.store.serial import SerialWorker


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


async def test_calls_run_one_at_a_time_in_the_order_they_were_made(
    executor: ThreadPoolExecutor,
) -> None:
    worker = SerialWorker(executor)
    ran: list[int] = []
    threads: set[int] = set()
    inside = threading.Lock()

    def step(i: int) -> int:
        assert inside.acquire(blocking=False), "two calls ran at once"
        try:
            ran.append(i)
            threads.add(threading.get_ident())
            return i * i
        finally:
            inside.release()

    results = await asyncio.gather(*(worker.call(lambda i=i: step(i)) for i in range(200)))

    assert results == [i * i for i in range(200)]
    assert ran == list(range(200))
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_each_caller_gets_its_own_exception(executor: ThreadPoolExecutor) -> None:
    worker = SerialWorker(executor)

    def fail(i: int) -> int:
        if i % 3 == 0:
            raise ValueError(f"call {i}")
        return i

    outcomes = await asyncio.gather(
        *(worker.call(lambda i=i: fail(i)) for i in range(9)), return_exceptions=True
    )

    for i, outcome in enumerate(outcomes):
        if i % 3 == 0:
            assert isinstance(outcome, ValueError) and str(outcome) == f"call {i}"
        else:
            assert outcome == i


async def test_calls_queued_behind_a_busy_worker_are_answered_together(
    executor: ThreadPoolExecutor,
) -> None:
    worker = SerialWorker(executor)
    release = threading.Event()
    first = asyncio.ensure_future(worker.call(lambda: release.wait(5)))
    await asyncio.sleep(0.05)  # the worker now holds the first call
    queued = [asyncio.ensure_future(worker.call(lambda i=i: i)) for i in range(50)]
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in queued)  # still one at a time

    release.set()
    assert await first is True
    assert await asyncio.gather(*queued) == list(range(50))
    # The first call's answer, then the fifty queued behind it in one.
    assert worker.batches == 2


async def test_a_call_cancelled_before_it_started_does_not_run(
    executor: ThreadPoolExecutor,
) -> None:
    worker = SerialWorker(executor)
    release = threading.Event()
    ran: list[str] = []
    blocker = asyncio.ensure_future(worker.call(lambda: release.wait(5)))
    await asyncio.sleep(0.05)
    cancelled = asyncio.ensure_future(worker.call(lambda: ran.append("cancelled")))
    kept = asyncio.ensure_future(worker.call(lambda: ran.append("kept")))
    await asyncio.sleep(0)
    cancelled.cancel()
    release.set()

    await blocker
    await kept
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert ran == ["kept"]


async def test_a_call_cancelled_while_running_runs_to_its_end(
    executor: ThreadPoolExecutor,
) -> None:
    worker = SerialWorker(executor)
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def long_call() -> None:
        started.set()
        release.wait(5)
        finished.set()

    task = asyncio.ensure_future(worker.call(long_call))
    assert await asyncio.to_thread(started.wait, 5)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(finished.wait, 5)
    assert await worker.call(lambda: "next") == "next"  # the worker goes on


async def test_a_shut_down_executor_refuses_calls(executor: ThreadPoolExecutor) -> None:
    worker = SerialWorker(executor)
    assert await worker.call(lambda: 1) == 1
    executor.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        await worker.call(lambda: 2)


async def test_calls_made_while_the_loop_runs_what_is_ready_are_answered_together(
    executor: ThreadPoolExecutor,
) -> None:
    # Twenty requests in hand, each making its call before the loop turns: the worker is
    # started once for them all, and answers them in one batch.
    worker = SerialWorker(executor)
    threads: set[int] = set()

    def step(i: int) -> int:
        threads.add(threading.get_ident())
        return i

    assert await asyncio.gather(*(worker.call(lambda i=i: step(i)) for i in range(20))) == list(
        range(20)
    )
    assert worker.batches == 1
    assert len(threads) == 1 and threading.get_ident() not in threads


async def test_calls_waiting_for_a_worker_that_was_shut_down_are_refused(
    executor: ThreadPoolExecutor,
) -> None:
    worker = SerialWorker(executor)
    calls = [asyncio.ensure_future(worker.call(lambda i=i: i)) for i in range(3)]
    await asyncio.sleep(0)  # each call is queued; the worker is not started yet
    executor.shutdown(wait=True)
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
    with pytest.raises(RuntimeError):
        await worker.call(lambda: 4)  # and the next one too: nothing is left queued
