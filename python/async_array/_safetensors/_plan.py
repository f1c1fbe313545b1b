"""The reads of one load: each leaf checked against its tensor's header
record, grouped into jobs (file order; neighbouring small tensors share a job),
and started within the byte budget and the local-reader limit."""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax

from .. import _core, _handoff
from .._convert import castable
from .._per_shard import Layout, layout
from .._runtime import jax_work
from .._spec import LeafSpecs, numpy_dtype
from ._sources import Header

_LOG = logging.getLogger("async_array")
# Over HTTP, neighbouring tensors of at most _SMALL bytes each share one range
# request while the request stays under _GROUP bytes and the bytes skipped
# between two of them under _GAP (the core's gap for the runs of one read):
# a request costs a round trip.
_SMALL = 1 << 20
_GROUP = 4 << 20
_GAP = _core.HTTP_GAP
# From a file, tensors of at most _FILE_SMALL bytes share one pool task (a
# pread each) up to _FILE_GROUP bytes: the per-task cost, not the reads, is
# what 10,000 small tensors would pay.
_FILE_SMALL = 64 << 10
_FILE_GROUP = 1 << 20


def local_readers() -> int:
    """How many reads of local files run at once: one core fewer than this
    process may use (at least one). A read from the page cache is CPU work
    (the kernel's copy, page faults), and with a reader on every core the
    compile that overlaps the load lost its core: on 2 cores, 6 readers
    stretched the encoder's compile from 0.95 to 1.2-1.4 s. Reads over HTTP
    wait on the network and are not limited here."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


SingleDevice = jax.sharding.SingleDeviceSharding


#: What a load holds in place of a leaf's future once it made the leaf: a
#: future already done, so every "is it done?" check passes over it.
RELEASED = _core.Future()
RELEASED.set_result(None)


class Load:
    """One ``load_safetensors`` call: which tensor each leaf reads, the jobs
    still to start, the bytes in flight, progress."""

    def __init__(
        self,
        specs: LeafSpecs,
        names: list[str],
        futures: list[_core.Future],
        max_bytes_in_flight: int | None,
        progress: Callable[[int, int], None] | None,
        run_job: Callable[[Load, Job, threading.Event], None],
    ) -> None:
        self.specs = specs
        self.run_job = run_job  # a pool task per job (_read.read_job)
        self.names = names
        # A copy: entries are replaced by RELEASED as leaves are made, so that
        # the load keeps no leaf's value alive once the leaf is handed out.
        self.futures = list(futures)
        self.budget = max_bytes_in_flight
        self.progress = progress
        self.lock = threading.Lock()
        self.queue: list[Job] = []
        self.next_job = 0
        self.in_flight = 0
        self.local_jobs = 0  # local-file jobs running (at most local_readers())
        self.local_limit = local_readers()
        self.done_bytes = 0
        self.total_bytes = 0
        # Reports go out one at a time and only forward: two reads that end
        # together on two threads must not report 80 and then 40 bytes. A
        # report made while another thread's call runs is left for that
        # thread to deliver, so no read waits for the callback (one that waits
        # on a leaf would otherwise hold up the read that makes it).
        self.report_lock = threading.Lock()
        self.reporting = False  # a thread is delivering reports
        self.latest = (-1, 0)  # the newest (bytes_done, bytes_total) made
        self.reported = -1  # bytes_done last reported; -1: none yet

    def fail(self, i: int, exc: BaseException) -> None:
        self.futures[i].set_exception(exc)
        self.futures[i] = RELEASED

    def plan(self, where: dict[str, tuple[Header, int]], sources: str) -> None:
        """Checks every leaf against its file's header (a mismatch fails that
        leaf alone) and queues the reads in file order: one job a tensor
        (all its local shards) from a file, neighbouring small tensors
        together from a URL."""
        specs = self.specs
        jobs: dict[int, tuple[Header, list[tuple[int, int, Read]]]] = {}  # by header
        for i, name in enumerate(self.names):
            found_at = where.get(name)
            if found_at is None:
                self.fail(
                    i,
                    KeyError(
                        f"{specs.where(i)}: tensor {name!r} is not in {sources} "
                        f"(it has {len(where)} tensors)"
                    ),
                )
                continue
            header, t = found_at
            entry = header.entries[t]
            st_dtype, np_name, shape = entry.dtype, entry.numpy_dtype, entry.shape
            start, end = entry.start, entry.end
            aval = specs.avals[i]
            found = numpy_dtype(np_name)
            if tuple(shape) != aval.shape or not castable(found, aval.dtype):
                self.fail(
                    i,
                    ValueError(
                        f"{specs.where(i)}: tensor {name!r} in {header.file.source} (bytes "
                        f"[{start}, {end})): expected shape {aval.shape} and dtype "
                        f"{aval.dtype}, found shape {tuple(shape)} and dtype {found} "
                        f"({st_dtype})"
                        + (
                            ""
                            if castable(found, aval.dtype)
                            else f"; {found} does not cast to {aval.dtype} (numpy's same_kind, "
                            "or integers of any width)"
                        )
                    ),
                )
                continue
            read = leaf_read(specs, i, t, np_name, end - start)
            if read.layout is not None and not read.layout.indices:
                # No device of this process holds any of it: the global array
                # (this process's part of it is empty) at once.
                self.place_nothing(i, read)
                continue
            jobs.setdefault(id(header), (header, []))[1].append((t, i, read))
        queue = []
        for header, leaves in jobs.values():
            leaves.sort(key=lambda x: x[:2])
            if not header.file.ranged:
                # A server that ignores Range sends the whole file to every
                # request: one job, one request, one pass over the file.
                queue.append(job(header, leaves))
                continue
            entries = header.entries
            small, limit = (_SMALL, _GROUP) if header.file.remote else (_FILE_SMALL, _FILE_GROUP)
            if self.budget is not None:
                limit = min(limit, self.budget)
            group: list[tuple[int, int, Read]] = []
            for t, i, read in leaves:
                start, end = entries[t].start, entries[t].end
                joins = (
                    group
                    and read.nbytes <= small
                    and group[0][2].nbytes <= small
                    and start - entries[group[-1][0]].end <= _GAP
                    and end - entries[group[0][0]].start <= limit
                )
                if group and not joins:
                    queue.append(job(header, group))
                    group = []
                group.append((t, i, read))
            if group:
                queue.append(job(header, group))
        with self.lock:
            self.queue.extend(queue)
            self.total_bytes += sum(job.nbytes for job in queue)

    def place_nothing(self, i: int, read: Read) -> None:
        specs = self.specs
        try:
            with jax_work, specs.context:
                array = _handoff.put_shards(
                    [], [], specs.avals[i], specs.shardings[i], specs.committed[i], True
                )
        except Exception as exc:
            self.fail(i, exc)
            return
        self.futures[i].set_result([array])
        self.futures[i] = RELEASED

    def pump(self) -> None:
        """Starts the queued jobs that fit in the byte budget (always at
        least one when nothing is in flight, so a tensor larger than the
        budget still loads, alone)."""
        start: list[tuple[Load, Job, threading.Event]] = []
        linked = threading.Event()
        with self.lock:
            while self.next_job < len(self.queue):
                job = self.queue[self.next_job]
                nbytes = job.nbytes
                if (
                    self.budget is not None
                    and self.in_flight > 0
                    and self.in_flight + nbytes > self.budget
                ):
                    break
                local = not job.file.remote
                if local and self.local_jobs >= self.local_limit:
                    break
                self.queue[self.next_job] = None  # type: ignore[call-overload]
                self.next_job += 1
                self.in_flight += nbytes
                self.local_jobs += local
                start.append((self, job, linked))
        if start:
            try:
                tasks = _core.submit_many(self.run_job, start)
                # Each leaf is made by its job's task: a wait on it from that
                # task (its progress callback, say) is a cycle, raised as
                # WaitCycleError. A job reports progress only once `linked`
                # says this is recorded.
                for task, (_, job, _) in zip(tasks, start, strict=True):
                    _core.depends_on([self.futures[r.leaf] for r in job.reads], [task])
            finally:
                linked.set()

    def finished(self, nbytes: int, local: bool) -> tuple[int, int]:
        """Counts a job's bytes as handed to JAX; returns the progress to
        report (``bytes_done``, ``bytes_total``) once the caller has pumped."""
        with self.lock:
            self.in_flight -= nbytes
            self.local_jobs -= local
            self.done_bytes += nbytes
            return self.done_bytes, self.total_bytes

    def started(self) -> None:
        """A read job starts: the first reports ``(0, total)``, so that a
        bar shows before the first read ends (over HTTP, seconds later)."""
        if self.reported < 0:
            self.report(0, self.total_bytes)

    def report(self, done: int, total: int) -> None:
        progress = self.progress
        if progress is None:
            return
        with self.report_lock:
            if done > self.latest[0]:
                self.latest = (done, total)
            if self.reporting:
                return  # the thread delivering reports sends this one too
            self.reporting = True
        while True:
            with self.report_lock:
                done, total = self.latest
                if done <= self.reported:
                    self.reporting = False
                    return
                self.reported = done
            try:
                progress(done, total)
            except Exception:  # the user's callback: logged, and the load goes on
                _LOG.exception("%s: the progress callback raised", self.specs.name)


class Read(NamedTuple):
    """What one leaf reads: tensor ``t`` of its file, as ``np_name``; whole
    (``layout`` None: one buffer, handed to JAX as the leaf) or the distinct
    local shards of ``layout`` (``bounds[k]`` the (start, stop) per axis of
    ``layout.indices[k]``, None when that index is the whole tensor);
    ``nbytes`` the bytes it allocates and reads."""

    leaf: int
    t: int
    np_name: str
    layout: Layout | None
    bounds: list[list[tuple[int, int]] | None] | None
    nbytes: int


def leaf_read(specs: LeafSpecs, i: int, t: int, np_name: str, nbytes: int) -> Read:
    sharding = specs.shardings[i]
    if type(sharding) is SingleDevice:
        return Read(i, t, np_name, None, None, nbytes)
    shape = specs.avals[i].shape
    lay = layout(sharding, shape)
    bounds: list[list[tuple[int, int]] | None] = []
    itemsize = nbytes // max(1, math.prod(shape))
    total = 0
    for index, block in zip(lay.indices, lay.shapes, strict=True):
        pairs = [s.indices(d)[:2] for s, d in zip(index, shape, strict=True)]
        whole = all(a == 0 and b == d for (a, b), d in zip(pairs, shape, strict=True))
        bounds.append(None if whole else pairs)
        total += math.prod(block) * itemsize
    return Read(i, t, np_name, lay, bounds, total)


class Job(NamedTuple):
    """A read job: one file, its leaves' reads (in file order), their bytes."""

    file: _core.SafetensorsFile
    reads: list[Read]
    nbytes: int


def job(header: Header, group: list[tuple[int, int, Read]]) -> Job:
    reads = [read for _, _, read in group]
    return Job(header.file, reads, sum(r.nbytes for r in reads))
