"""The one leaf builder: how every producer turns declared specs and the
futures of its tasks into ``AsyncArray`` leaves.

Two shapes of producer: one task whose future holds every leaf's value
(``async_wrap``, an ``aa.jit`` dispatch: :func:`leaves_for`,
:func:`source_leaves`), and one future a leaf (``async_map``,
``async_stream``, per shard, ``load_safetensors``: :func:`one_source_a_leaf`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from . import _core, _multiprocess
from ._array import AsyncArray, source_of
from ._errors import shallow_copy
from ._source import Call, Source
from ._spec import LeafSpecs, Sharding, declare_tree


def specs_and_paths(name: str, like: Any, sharding: Any) -> tuple[LeafSpecs, list[Any], list[Any]]:
    """``like`` flattened once: its declared specs (named ``name``), the key
    path of each leaf, and the ``like`` leaves themselves, in order.

    Raises:
      TypeError, ValueError: a bad ``like`` leaf or sharding, as ``declare_tree``.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    paths = [p for p, _ in flat]
    leaves = [leaf for _, leaf in flat]
    specs = declare_tree(LeafSpecs(name, like, treedef, paths), leaves, sharding)
    return specs, paths, leaves


def source_leaves(
    source: Source,
    avals: Sequence[Any],
    shardings: Sequence[Sharding | None],
    committed: Sequence[bool | None] | None = None,
) -> list[AsyncArray]:
    """The leaves of one task's ``source``: leaf ``i`` has ``avals[i]`` and
    ``shardings[i]`` (committed as ``committed[i]``; None: as its sharding says)."""
    if committed is None:
        committed = [None] * len(avals)
    return [
        AsyncArray(source, i, aval, sharding, commit)
        for i, (aval, sharding, commit) in enumerate(zip(avals, shardings, committed, strict=True))
    ]


def leaves_for(specs: LeafSpecs, future: _core.Future) -> Any:
    """The leaves of one call whose task's ``future`` holds every leaf's
    value: one ``AsyncArray`` (no ``like``) or a tree shaped like ``like``."""
    source = Source(future, specs.name, len(specs.avals), specs.key_path)
    _multiprocess.track(specs, [source])
    leaves = source_leaves(source, specs.avals, specs.shardings, specs.committed)
    return leaves[0] if specs.treedef is None else specs.treedef.unflatten(leaves)


def one_source_a_leaf(
    specs: LeafSpecs, futures: Sequence[_core.Future], call: Call | None = None
) -> list[AsyncArray]:
    """One leaf per future, in order (``futures[i]`` holds a one-item list:
    leaf ``i``'s value or the exception it failed with).

    With ``call``, an exception retrieved from any leaf counts for every leaf
    of the call. If interrupted part way (Ctrl-C), the futures are cancelled
    and the exception propagates."""
    # The sources share the specs' key-path table, each at its own offset
    # (a closure per leaf would cost 200 bytes a pending leaf).
    key_paths = specs.key_path
    name, avals, shardings, committed = specs.name, specs.avals, specs.shardings, specs.committed
    leaves: list[AsyncArray] = []
    append = leaves.append
    try:
        for i, future in enumerate(futures):
            append(
                AsyncArray(
                    Source(future, name, 1, key_paths, i, call),
                    0,
                    avals[i],
                    shardings[i],
                    committed[i],
                )
            )
        if leaves:
            _multiprocess.track(specs, [source_of(leaf) for leaf in leaves])
    except BaseException:
        # Nobody can read these leaves. Their tasks need not run, and dropping
        # them skips the check for an unretrieved failure (300k pending
        # leaves took 0.3 s at the raise).
        for leaf in leaves:
            source = source_of(leaf)
            if source is not None:
                source.retrieved = True
        for future in futures:
            future.cancel()
        raise
    return leaves


def fail_all_if_failed(driver: _core.Future, futures: Sequence[_core.Future]) -> None:
    """A done callback for the one task that feeds ``futures`` (a generator's
    driver, a loader's header reader): if it was cancelled, so is every leaf;
    if it raised, every leaf not yet done fails with its own copy of that
    exception. Without it such a leaf would wait forever."""
    if driver.cancelled():
        for fut in futures:
            fut.cancel()
        return
    exc = driver.exception(0)
    if exc is not None:
        for fut in futures:
            if not fut.done():
                fut.set_exception(shallow_copy(exc))
