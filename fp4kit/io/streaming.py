"""Overlapping reads, compute and writes of every streaming command (quantize, convert, layout): a reader thread
runs ahead of the consumer, a writer thread places finished tensors, both through queues of bounded depth, so memory
holds ``depth`` jobs per queue. Where the work of a job is reads and C loops that release the GIL (data-free
quantization on the CPU), ``produced_in_parallel`` runs whole jobs on a pool of threads, still in bounded memory.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fp4kit.io.checkpoint import ShardWriter


def prefetched(jobs: list, produce: Callable[[object], object], depth: int) -> Iterator[tuple[object, object]]:
    """(job, produce(job)) in order, produced a few jobs ahead on a thread (file reads release the GIL)."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def run() -> None:
        try:
            for job in jobs:
                if stop.is_set():
                    return
                slots.put((job, produce(job)))
            slots.put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            slots.put(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while (item := slots.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                slots.get_nowait()
            except queue.Empty:
                thread.join(0.05)


# each job's Python holds the GIL for a part of its time, so threads beyond this add contention, not speed
MAX_CPU_WORKERS = 16


def cpu_workers() -> int:
    """Threads for CPU work: the CPUs this process may run on, shared among the ranks torchrun started on this node,
    at most MAX_CPU_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks_here = 1
    return max(1, min(MAX_CPU_WORKERS, cpus // ranks_here))


def produced_in_parallel(jobs: list, produce: Callable[[object], object], workers: int, depth: int,
                         cost: Callable[[object], int], max_cost: int) -> Iterator[tuple[object, object]]:
    """(job, produce(job)) in the order of ``jobs``, each produced on one of ``workers`` threads: at most
    ``workers + depth`` jobs are started ahead of the consumer, and no more than ``max_cost`` of their ``cost``
    (bytes read) unless a single job exceeds it alone. The first failing job (in order) raises its error here; jobs
    not started by then are not run, and those running are waited for."""
    if workers <= 1:
        yield from prefetched(jobs, produce, depth)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="fp4kit-work")
    running: collections.deque[tuple[object, Future, int]] = collections.deque()
    queued = 0  # cost of the jobs in ``running``
    upcoming = collections.deque(jobs)
    try:
        while True:
            while upcoming and len(running) < workers + depth:
                job_cost = cost(upcoming[0])
                if running and queued + job_cost > max_cost:
                    break
                job = upcoming.popleft()
                running.append((job, pool.submit(produce, job), job_cost))
                queued += job_cost
            if not running:
                return
            done_job, future, job_cost = running.popleft()
            queued -= job_cost
            yield done_job, future.result()
    finally:
        for _, future, _ in running:
            future.cancel()
        pool.shutdown(wait=True)


class BackgroundWriter:
    """ShardWriter.write on a thread, fed through a bounded queue; the first error is raised to the producer."""

    def __init__(self, writer: ShardWriter, depth: int):
        self.writer, self.error = writer, None
        self.pending: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (tensors := self.pending.get()) is not None:
            if self.error is None:
                try:
                    for name, tensor in tensors.items():
                        self.writer.write(name, tensor)
                except BaseException as exc:
                    self.error = exc

    def put(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.error is not None:
            raise self.error
        self.pending.put(tensors)

    def close(self) -> None:
        self.pending.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
