"""A read job on the pool: the core reads its tensors (GIL released) into
``HostBuffer``s, each leaf is handed to JAX, then made ready."""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .. import _handoff
from .._convert import convert_one
from .._core import CONVERTED_WHILE_READING
from .._errors import reworded, shallow_copy
from .._per_shard import index_text, shard_host
from .._runtime import jax_work
from .._spec import LeafSpecs, numpy_dtype
from ._plan import RELEASED, Job, Load, Read
from ._sources import NAME


def read_job(load: Load, job: Job, linked: threading.Event) -> None:
    """A pool task: reads one job's tensors and shards (GIL released in the
    core), hands each leaf to JAX, starts more reads, reports progress, then
    makes the leaves ready (a leaf is ready after the progress that counts it
    unless another thread's progress call was running then). A leaf fails
    alone, with the error its own read gave."""
    file = job.file
    specs, futures = load.specs, load.futures
    done: list[tuple[int, Any]] = []
    load.started()
    try:
        reads = job.reads
        # A cancelled (or already failed) leaf is not read: over HTTP its bytes
        # leave the request, which is not sent when nothing is left.
        reads = [r for r in reads if not futures[r.leaf].done()]
        wants: list[tuple[int, DTypeLike, list[tuple[int, int]] | None]] = []
        owners: list[Any] = []  # each want's leaf future: one cancelled meanwhile is not read
        for r in reads:
            dtype = read_dtype(r.np_name, specs.avals[r.leaf].dtype)
            if r.bounds is None:
                wants.append((r.t, dtype, None))
            else:
                wants.extend((r.t, dtype, b) for b in r.bounds)
            owners.extend([futures[r.leaf]] * (len(wants) - len(owners)))
        results = file.read(wants, owners) if wants else []
        del wants, owners
        at = 0
        for r in reads:
            count = 1 if r.bounds is None else len(r.bounds)
            mine = results[at : at + count]
            at += count
            failed = next((x for x in mine if isinstance(x, BaseException)), None)
            if failed is not None:
                # The core names the source, tensor and bytes; the call goes first.
                done.append((r.leaf, reworded(failed, f"{NAME}: ")))
                continue
            with jax_work, specs.context:
                done.append((r.leaf, to_jax(specs, r, mine)))
            del mine
        del results
    except Exception as exc:
        for r in job.reads:
            done.append((r.leaf, shallow_copy(exc)))
    finally:
        progress = load.finished(job.nbytes, not file.remote)
        load.pump()  # before the callback: one that waits on a later leaf must not hold its read
        linked.wait()  # set by the pumping thread microseconds after the submit
        load.report(*progress)
        for i, entry in done:
            fut, futures[i] = futures[i], RELEASED
            if fut.done():
                continue
            if isinstance(entry, BaseException):
                fut.set_exception(entry)
            else:
                fut.set_result([entry])
        del done


def to_jax(specs: LeafSpecs, r: Read, buffers: list[Any]) -> Any:
    """A leaf's ``Source`` entry (its ``jax.Array``, or the exception its
    conversion failed with) from its read buffers."""
    i = r.leaf
    if r.layout is None:
        return convert_one(specs, i, buffers[0])
    lay = r.layout
    dtype = specs.avals[i].dtype
    try:
        hosts = [
            shard_host(b, shape, dtype, f"{specs.where(i)} shard {index_text(index)}")
            for b, shape, index in zip(buffers, lay.shapes, lay.indices, strict=True)
        ]
        return _handoff.put_shards(
            [hosts[k] for k in lay.slots],
            lay.devices,
            specs.avals[i],
            specs.shardings[i],
            specs.committed[i],
            True,
        )
    except Exception as exc:
        return exc


@functools.cache
def read_dtype(np_name: str, leaf: np.dtype) -> np.dtype:
    """What the core reads a tensor of dtype ``np_name`` as: the leaf's dtype
    where the core converts between the two as it reads (float16, bfloat16,
    float32, float64), else the file's (``convert_one`` then casts)."""
    if np_name in CONVERTED_WHILE_READING and leaf.name in CONVERTED_WHILE_READING:
        return leaf
    return numpy_dtype(np_name)
