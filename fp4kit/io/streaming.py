"""Overlapping reads, compute and writes of every streaming command (quantize, convert, layout): a reader thread
runs ahead of the consumer, a writer thread places finished tensors, both through queues of bounded depth, so memory
holds ``depth`` jobs per queue.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

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
