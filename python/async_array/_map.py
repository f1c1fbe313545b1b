"""Many-leaf producers: ``async_map`` (one task a leaf) and ``async_stream``
(one generator whose leaves become ready one by one)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax

from . import _core
from ._convert import convert_one
from ._errors import frames_freed, free_frames, shallow_copy
from ._leaves import fail_all_if_failed, one_source_a_leaf, specs_and_paths
from ._per_shard import submit_per_shard
from ._runtime import jax_work, paused_gc
from ._spec import LeafSpecs, qualname

_LOG = logging.getLogger("async_array")
_keystr = jax.tree_util.keystr


def _run_leaf(fn: Callable[[Any, Any], Any], path: Any, spec: Any, specs: LeafSpecs, i: int):
    with frames_freed:
        value = fn(path, spec)
    with jax_work, specs.context:
        return [convert_one(specs, i, value)]


def _check_takes(fn: Callable[..., Any], per_shard: bool) -> None:
    """Refuses at the call an ``fn`` that cannot take ``(key_path, spec)``
    (``(key_path, spec, index)`` per shard), rather than failing every leaf
    with the same TypeError later."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: the leaves will say
        return
    try:
        signature.bind(*([None] * (3 if per_shard else 2)))
    except TypeError:
        wanted = "(key_path, spec, index)" if per_shard else "(key_path, spec)"
        raise TypeError(
            f"async_map: fn must take {wanted}, got {qualname(fn)}{signature}"
        ) from None


def _leaf_label(fn: Any, path: Any, spec: Any, specs: Any, i: int) -> str:
    """How cycle messages name a leaf's task (see _core.WaitCycleError); called
    only when one needs it."""
    return specs.where(i)


def async_map(
    fn: Callable[..., Any], like: Any, *, sharding: Any = None, per_shard: bool = False
) -> Any:
    """Runs ``fn(key_path, spec)`` for every leaf of ``like``, one pool task a
    leaf (with ``per_shard=True``, ``fn(key_path, spec, index)`` once per leaf
    and distinct index among this process's devices), and returns the tree of
    ``AsyncArray`` at once.

    The per-tensor loader: one HTTP range request per tensor, say. Each leaf is
    ready as soon as its own task finishes.

    Args:
      fn: called as ``fn(key_path, spec)`` with the leaf's JAX key path (a
        tuple of ``DictKey``/``SequenceKey``/...) and its ``like`` leaf; returns
        what ``async_wrap``'s ``f`` may return for one leaf.
      like: a pytree of specs (``.shape``, ``.dtype``).
      sharding: as in ``async_wrap``: a ``Sharding``, ``jax.Device`` or
        ``PartitionSpec`` (under ``jax.set_mesh``), or a pytree prefix of them.
      per_shard: call ``fn(key_path, spec, index)`` once per leaf and distinct
        index (a tuple of slices into the global array, as
        ``jax.make_array_from_callback`` passes it) held by this process's
        devices; ``spec`` is a ``jax.ShapeDtypeStruct`` with the leaf's global
        shape, dtype and resolved sharding, and ``fn`` returns that shard (of
        the index's shape). Under ``jax.distributed`` each process reads only
        its share; a replicated shard is read once. All calls are submitted
        at once and run concurrently; each leaf is ready when its last shard
        is placed on every local device holding its index.

    Returns:
      A pytree of ``AsyncArray`` shaped like ``like``.

    Raises:
      TypeError, ValueError: bad arguments, as ``async_wrap``; an ``fn`` that
      cannot take two arguments (three with ``per_shard``). A failure of one
      ``fn`` call fails only that leaf (its exception, with a note naming it,
      and per shard the index and devices). A shard of the wrong shape is a
      ``ValueError``; a cast across kinds a ``TypeError``; a value that does
      not fit the dtype an ``OverflowError``.

    Note:
      Per shard, a ``HostBuffer`` result of the index's shape and the leaf's
      dtype reaches its CPU devices without a copy; others are copied once.
    """
    if not callable(fn):
        raise TypeError(f"async_map: fn must be callable, got {type(fn).__name__}")
    _check_takes(fn, per_shard)
    with paused_gc():
        if per_shard:
            specs, paths, _ = specs_and_paths(f"async_map({qualname(fn)})", like, sharding)
            return specs.treedef.unflatten(submit_per_shard(fn, specs, paths))
        return _async_map(fn, like, sharding)


def _async_map(fn: Callable[[Any, Any], Any], like: Any, sharding: Any) -> Any:
    specs, paths, specs_in = specs_and_paths(f"async_map({qualname(fn)})", like, sharding)
    # One lock and one wake-up round for the whole tree, not one per leaf.
    args = [
        (fn, path, spec, specs, i)
        for i, (path, spec) in enumerate(zip(paths, specs_in, strict=True))
    ]
    futures = _core.submit_many(_run_leaf, args, label=_leaf_label)
    leaves = one_source_a_leaf(specs, futures)
    return specs.treedef.unflatten(leaves)


def _key_text(key_path: Any) -> str:
    """The keystr text of a yielded key path; for something that is not a
    key path (``0``, say), its repr and type, so that it is named as unknown."""
    if isinstance(key_path, str):
        return key_path
    if isinstance(key_path, tuple):
        try:
            return _keystr(key_path)
        except Exception:
            pass
    return f"{key_path!r} ({type(key_path).__name__}, not a key path)"


def _drive_stream(
    gen_fn: Callable[[], Iterable[tuple[Any, Any]]],
    specs: LeafSpecs,
    paths: list[Any],
    futures: list[_core.Future],
) -> None:
    index = {_keystr(p): i for i, p in enumerate(paths)}
    unknown: list[str] = []
    try:
        items = gen_fn()
        if not isinstance(items, Iterable):
            raise TypeError(
                f"{specs.name}: gen_fn() must return an iterable of (key_path, value) "
                f"pairs, got {type(items).__name__}"
            )
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(
                    f"{specs.name}: the generator must yield (key_path, value) pairs, "
                    f"got {type(item).__name__}"
                )
            key_path, value = item
            del item
            text = _key_text(key_path)
            i = index.get(text)
            if i is None:
                unknown.append(text)
                _LOG.error("%s: yielded key path %s, which like does not have", specs.name, text)
                continue
            with jax_work, specs.context:
                entry = convert_one(specs, i, value)
            del value
            if not futures[i].set_result([entry]):
                _LOG.error(
                    "%s: yielded key path %s twice; the leaf keeps the first value",
                    specs.name,
                    text,
                )
    except BaseException as exc:
        free_frames(exc)
        for fut in futures:
            if not fut.done():  # only leaves not yet yielded take it, each its own copy
                fut.set_exception(shallow_copy(exc))
        return
    hint = (
        f"; it yielded unknown key paths {', '.join(unknown[:5])} (key paths are "
        f"jax.tree_util key paths or their keystr text, e.g. {_keystr(paths[0])})"
        if unknown and paths
        else ""
    )
    for i, fut in enumerate(futures):
        if not fut.done():
            fut.set_result(
                [ValueError(f"{specs.where(i)}: the generator ended without yielding it{hint}")]
            )


def async_stream(
    gen_fn: Callable[[], Iterable[tuple[Any, Any]]], like: Any, *, sharding: Any = None
) -> Any:
    """Runs the generator ``gen_fn()`` in one pool task; each leaf is ready as
    soon as the generator yields it.

    Args:
      gen_fn: returns an iterable of ``(key_path, value)`` pairs in any order;
        ``key_path`` is a JAX key path (as ``jax.tree_util.tree_flatten_with_path``
        gives) or its ``jax.tree_util.keystr`` text.
      like: a pytree of specs (``.shape``, ``.dtype``).
      sharding: as in ``async_wrap``.

    Returns:
      A pytree of ``AsyncArray`` shaped like ``like``.

    A leaf never yielded fails with ``ValueError`` once the generator ends; a
    yielded key path that ``like`` lacks, or a second yield of a leaf, is
    logged to the ``async_array`` logger (the leaf keeps its first value) and
    named in the error of leaves never yielded. An exception in the generator
    fails only the leaves not yet yielded.
    """
    if not callable(gen_fn):
        raise TypeError(f"async_stream: gen_fn must be callable, got {type(gen_fn).__name__}")
    with paused_gc():
        return _async_stream(gen_fn, like, sharding)


def _async_stream(gen_fn: Callable[[], Iterable[tuple[Any, Any]]], like: Any, sharding: Any) -> Any:
    specs, paths, _ = specs_and_paths(f"async_stream({qualname(gen_fn)})", like, sharding)
    futures = [_core.Future() for _ in paths]
    leaves = one_source_a_leaf(specs, futures)
    driver = _core.submit(_drive_stream, gen_fn, specs, paths, futures, label=specs.name)
    # Each leaf needs the generator's task: a wait on a leaf from a task that
    # the generator itself waits for is a cycle.
    _core.depends_on(futures, [driver])
    # The driver itself only fails on a bug here; then no leaf may hang.
    driver.add_done_callback(lambda d: fail_all_if_failed(d, futures))
    return specs.treedef.unflatten(leaves)
