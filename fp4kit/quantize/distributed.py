"""Several processes on one job under torchrun (WORLD_SIZE / RANK / LOCAL_RANK): which rank does what, and how ranks
agree, so that the output is byte-identical to a single process.

- Quantization jobs (a fused group or a passthrough tensor, ``ModelPlan.jobs``) are assigned largest first to the
  least loaded rank; every rank computes the same assignment from the same plan. Rank 0 lays out the output shards,
  every rank writes its own tensors at their planned offsets, rank 0 writes index and config and renames last.
- Calibration is data-parallel over whole batches (the batches one process forms, round-robin over ranks), so every
  per-batch computation is the single process's; amax statistics are combined with a max, routing counts with a sum.
- Ranks meet only at ``sync`` points, each an all-gather of an error flag and message: a rank that fails joins the
  next one with its error, so the others raise instead of waiting, and exactly one rank prints the message.

Without torchrun's variables every function here is a no-op for a world of one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import heapq
import importlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from fp4kit.errors import Fp4kitError

if TYPE_CHECKING:
    from fp4kit.io.checkpoint import PlannedTensor, ShardWriter
    from fp4kit.quantize.calibrate import CalibrationResult

T = TypeVar("T")
# A rank that failed waits at its next sync for the others to reach theirs, which can take as long as one rank's share
# of a calibration or quantization pass: the timeout must outlast that, not torch's default of 30 minutes.
SYNC_TIMEOUT = datetime.timedelta(hours=6)
MESSAGE_BYTES = 1024  # an error message travels truncated to this many UTF-8 bytes
_NOT_RECORDED = -1.0  # amax is never negative: marks a module this rank saw no input for


class RankFailed(Fp4kitError):
    """Raised on every rank but one when some rank failed; that one rank prints the message, these stay silent."""

    silent = True


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    device: str  # this rank's compute device: under torchrun `cuda` means cuda:LOCAL_RANK

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def batch_share(self) -> tuple[int, int]:
        return self.rank, self.world

    def sync(self, failure: BaseException | None = None) -> None:
        """Wait for every rank; raise if any rank arrived with a failure (see ``fail``)."""
        if self.world == 1:
            return
        message = b"" if failure is None else _describe(failure).encode()[: MESSAGE_BYTES - 3]
        mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        mine[0] = failure is not None
        mine[1], mine[2] = len(message) // 256, len(message) % 256
        mine[3 : 3 + len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8) if message else 0
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(everyone, mine)
        failed = [r for r, got in enumerate(everyone) if got[0]]
        if not failed:
            return
        first = everyone[failed[0]]
        length = int(first[1]) * 256 + int(first[2])
        text = bytes(first[3 : 3 + length].tolist()).decode(errors="replace")
        if failure is None or failed[0] != self.rank:
            raise RankFailed(f"rank {failed[0]} failed: {text}")

    def fail(self, exc: BaseException) -> BaseException:
        """The exception to raise for ``exc`` on this rank: joins the next sync so the other ranks stop; the lowest
        failing rank keeps its own exception (and prints it), the others get a silent RankFailed."""
        if self.world == 1 or isinstance(exc, RankFailed | KeyboardInterrupt) or getattr(exc, "fp4kit_synced", False):
            return exc
        try:
            self.sync(exc)
        except RankFailed as other:
            other.fp4kit_synced = True  # type: ignore[attr-defined]
            return other
        exc.fp4kit_synced = True  # type: ignore[attr-defined]
        return exc

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """All ranks leave the block together (a sync at the end), or all raise when one fails inside it."""
        try:
            yield
        except BaseException as exc:
            raised = self.fail(exc)
            if raised is exc:
                raise
            raise raised from exc
        self.sync()

    def agree(self, decision: bool) -> bool:
        """Rank 0's ``decision`` on every rank (e.g. whether a pipeline step is already complete)."""
        if self.world == 1:
            return decision
        self.sync()
        flag = torch.tensor([int(decision)])
        torch.distributed.broadcast(flag, src=0)
        return bool(flag.item())

    def assign(self, jobs: Sequence[T], sizes: Sequence[int]) -> list[T]:
        """This rank's jobs, in plan order (see ``assign_jobs``)."""
        if self.world == 1:
            return list(jobs)
        return [jobs[i] for i in assign_jobs(sizes, self.world)[self.rank]]

    @contextlib.contextmanager
    def output_directory(self, dst: Path, src: Path, overwrite: bool) -> Iterator[Path]:
        """fp4kit.io.output.atomic_directory on rank 0 (it holds the lock, checks ``dst`` and renames the work
        directory into place at the end); the other ranks get the same work directory once rank 0 created it."""
        from fp4kit.io.output import atomic_directory

        if self.world == 1:
            with atomic_directory(dst, src, overwrite) as work:
                yield work
        elif self.main:
            with atomic_directory(dst, src, overwrite) as work:
                self.sync()
                self.share(str(work))
                yield work
        else:
            self.sync()  # raises rank 0's failure if it could not take the lock or create the directory
            yield Path(self.share(""))

    @contextlib.contextmanager
    def exclusive(self, path: Path) -> Iterator[None]:
        """fp4kit.io.output.exclusive held by rank 0 for the block; every rank raises if rank 0 cannot take it."""
        from fp4kit.io.output import exclusive

        if self.world == 1:
            with exclusive(path):
                yield
            return
        with contextlib.ExitStack() as held:
            failure = None
            if self.main:
                try:
                    held.enter_context(exclusive(path))
                except Fp4kitError as exc:
                    failure = exc
            self.sync(failure)
            if failure is not None:
                failure.fp4kit_synced = True  # type: ignore[attr-defined]
                raise failure
            yield

    def share(self, text: str) -> str:
        """Rank 0's ``text`` (at most MESSAGE_BYTES of UTF-8) on every rank."""
        if self.world == 1:
            return text
        data = torch.zeros(MESSAGE_BYTES + 2, dtype=torch.uint8)
        if self.main:
            encoded = text.encode()
            if len(encoded) > MESSAGE_BYTES:
                raise Fp4kitError(f"internal: {len(encoded)} bytes to share between ranks, at most {MESSAGE_BYTES}")
            data[0], data[1] = len(encoded) // 256, len(encoded) % 256
            if encoded:
                data[2 : 2 + len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        torch.distributed.broadcast(data, src=0)
        length = int(data[0]) * 256 + int(data[1])
        return bytes(data[2 : 2 + length].tolist()).decode()

    def shard_writer(self, work: Path, planned: list[PlannedTensor], max_shard_bytes: int,
                     metadata: dict[str, str], written_here: list[PlannedTensor]) -> ShardWriter:
        """Rank 0 creates every planned shard (headers, sizes); then each rank opens them for its own tensors."""
        from fp4kit.io.checkpoint import ShardWriter

        if self.world == 1:
            return ShardWriter(work, planned, max_shard_bytes, metadata)
        here = [t.name for t in written_here]
        writer = None
        if self.main:
            try:
                writer = ShardWriter(work, planned, max_shard_bytes, metadata, written_here=here)
            except BaseException as exc:
                raise self.fail(exc) from None
        self.sync()
        return writer or ShardWriter(work, planned, max_shard_bytes, metadata, written_here=here, create=False)

    def combine_calibration(self, result: CalibrationResult, modules: list[str], kv_names: list[str] | None = None
                            ) -> CalibrationResult:
        """Every rank's statistics combined as one process computing all batches would have: the max of the
        amax (NaN wins, as torch.maximum lets it), the KV-cache amax (``kv_names``) likewise, and the sum of the
        routing counts."""
        if self.world == 1:
            return result
        from fp4kit.quantize.calibrate import CalibrationResult

        self.sync()  # nobody enters the collectives below while another rank has failed
        nccl = "nccl" in str(torch.distributed.get_backend())
        device = torch.device(self.device if nccl and self.device.startswith("cuda") else "cpu")
        kv_names = kv_names or []
        recorded = [result.input_amax.get(m, _NOT_RECORDED) for m in modules] + \
            [result.kv_amax.get(m, _NOT_RECORDED) for m in kv_names]
        amax = torch.tensor(recorded, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(amax) for _ in range(self.world)]
        torch.distributed.all_gather(gathered, amax)
        combined = torch.stack(gathered).amax(dim=0).tolist()
        layers = sorted(result.routing_counts)
        flat = [c for layer in layers for c in result.routing_counts[layer]]
        counts = torch.tensor(flat, dtype=torch.int64, device=device)
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
        total = counts.tolist()
        routing: dict[int, list[int]] = {}
        for layer in layers:
            size = len(result.routing_counts[layer])
            routing[layer], total = total[:size], total[size:]
        combined_kv = combined[len(modules):]
        combined = combined[: len(modules)]
        return CalibrationResult(
            {m: value for m, value in zip(modules, combined, strict=True) if value != _NOT_RECORDED}, routing,
            {m: value for m, value in zip(kv_names, combined_kv, strict=True) if value != _NOT_RECORDED},
        )


def assign_jobs(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Job indices per rank: largest job first to the least loaded rank (ties: plan order, lowest rank), each
    rank's list in plan order. Deterministic, so every rank computes the same split."""
    loads = [(0, r) for r in range(world)]
    owned: list[list[int]] = [[] for _ in range(world)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(loads)
        owned[r].append(index)
        heapq.heappush(loads, (load + sizes[index], r))
    return [sorted(indices) for indices in owned]


def shared_failure(exc: BaseException) -> BaseException:
    """For the CLI: the exception to report for ``exc`` once every rank knows about it (see ``Ranks.fail``)."""
    return exc if world_size() == 1 else ranks().fail(exc)


def settle() -> None:
    """For the CLI, after a failure was reported: wait until every rank got here. torchrun stops the remaining ranks
    as soon as one exits with an error, which must not catch another rank before it printed the error or removed
    the partial output."""
    if world_size() == 1:
        return
    here = ranks()
    with contextlib.suppress(RuntimeError):  # a rank that already died: nothing left to wait for
        torch.distributed.all_gather([torch.empty(1) for _ in range(here.world)], torch.zeros(1))


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, Fp4kitError) else f"{type(exc).__name__}: {exc}"


def ranks(device: str = "cpu") -> Ranks:
    """This process's place in the job; under torchrun, joins the process group on first use (gloo for the
    CPU; with a CUDA device, NCCL for CUDA tensors beside gloo for the small CPU ones)."""
    world = world_size()
    if world == 1:
        return Ranks(0, 1, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        device = f"cuda:{local_rank}"
    if not torch.distributed.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is first imported,
        # and transformers imports it (loading a config is enough): imported after the process group exists, those
        # defaults hold it for good, so `destroy_process_group` at exit leaves gloo's threads running into the
        # interpreter's finalization, which then sometimes aborts ("terminate called without an active exception").
        # Imported first, the defaults are None.
        importlib.import_module("torch.distributed.nn")

        backend = "gloo"
        if device.startswith("cuda") and torch.cuda.is_available():  # without CUDA, quantize's checks say so
            torch.cuda.set_device(torch.device(device))
            backend = "cpu:gloo,cuda:nccl"
        torch.distributed.init_process_group(backend, timeout=SYNC_TIMEOUT)
        atexit.register(_leave)
    return Ranks(rank(), world, device)


def _leave() -> None:
    """At exit, while the interpreter is whole: the process group and its threads go before finalization starts."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
