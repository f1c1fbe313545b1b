"""``aa.jit``: deferred dispatch, so a whole pipeline compiles while its inputs load.

``jax.jit(f)(x)`` with a pending ``x`` compiles at once, then waits for ``x``
before it returns, so the next stage cannot start compiling. ``aa.jit(f)(x)``
returns ``AsyncArray`` outputs right after tracing: compilation runs on the
pool, and the compiled program runs on the pool once every input is ready and
compilation is done. Public JAX API only:
``jax.jit(f).trace(specs).lower().compile()``.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _core, _jax_hooks
from ._array import AsyncArray, source_of
from ._errors import frames_freed, free_frames, noted
from ._pool import exit_hooks, jax_work
from ._source import Source, pending
from ._spec import qualname

_Sharding = jax.sharding.Sharding
_keystr = jax.tree_util.keystr
_ArrayImpl = _jax_hooks.array_type()

#: Compiled programs kept per ``aa.jit`` function (least recently used go first).
CACHE_SIZE = 1024

_LOG = logging.getLogger("async_array")

# Dispatches still waiting for their inputs or compilation; at interpreter
# exit they are cancelled (their arrays dropped on the main thread) and their
# compiles and runs are counted in `jax_work`, so exit waits for those.
_waiting_lock = threading.Lock()
_waiting: set[_Call] = set()


def _cancel_waiting_at_exit() -> None:
    with _waiting_lock:
        calls = list(_waiting)
        _waiting.clear()
    for call in calls:
        call.leaves = None
        call.out.cancel()


exit_hooks.append(_cancel_waiting_at_exit)


def _index_tuple(value: Any) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


def _str_tuple(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _static_argnums_argnames(
    sig: inspect.Signature | None, argnums: Any, argnames: Any
) -> tuple[tuple[int, ...], frozenset[str]]:
    """Which arguments are static, completed as ``jax.jit`` does: numbers
    given only as names (or names only as numbers) are inferred from the
    signature's positional-or-keyword parameters."""
    nums = None if argnums is None else _index_tuple(argnums)
    names = None if argnames is None else _str_tuple(argnames)
    if sig is not None and (nums is None) != (names is None):
        params = list(sig.parameters.items())
        pok = inspect.Parameter.POSITIONAL_OR_KEYWORD
        if names is not None:
            nums = tuple(i for i, (k, p) in enumerate(params) if p.kind == pok and k in names)
        elif nums is not None:
            names = tuple(k for i, (k, p) in enumerate(params) if p.kind == pok and i in nums)
    return nums or (), frozenset(names or ())


def _in_shardings_devices(in_shardings: Any) -> frozenset[Any] | None:
    """The devices ``in_shardings`` places inputs on; None when it names no
    concrete devices (a ``PartitionSpec``, say), so outputs' places are
    known only after compiling."""
    if in_shardings is None:
        return frozenset()
    leaves = jax.tree_util.tree_leaves(
        in_shardings, is_leaf=lambda s: isinstance(s, (_Sharding, jax.sharding.PartitionSpec))
    )
    if not all(isinstance(s, _Sharding) for s in leaves):
        return None
    return frozenset(d for s in leaves for d in s.device_set)


_CONFIG_NAMES = (
    "jax_enable_x64",
    "jax_default_device",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
)


def _config_key() -> tuple[Any, ...]:
    # The settings that change what a trace produces; jax.jit keys on them too.
    config = jax.config
    return (*(getattr(config, name) for name in _CONFIG_NAMES), jax.sharding.get_abstract_mesh())


def _describe(spec: tuple[Any, ...]) -> str:
    shape, dtype, weak, sharding = spec
    text = f"{'~' if weak else ''}{np.dtype(dtype).name}{list(shape)}"
    return text if sharding is None else f"{text} on {sharding}"


def _input_paths(owner: JitFunction, dyn_pos: tuple[int, ...], in_tree: Any) -> list[str]:
    """Each input leaf's key path as the caller wrote it (``params['w']``),
    from the tree of (dynamic positional args, dynamic keyword args)."""
    dummy = in_tree.unflatten(range(in_tree.num_leaves))
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]:
        if path[0].idx == 0:
            head = owner._arg_name(dyn_pos[path[1].idx])
        else:
            head = str(path[1].key)
        paths.append(head + _keystr(path[2:]))
    return paths


class _Entry:
    """One trace and its compilation, shared by every call with the same input
    avals, shardings and static arguments."""

    __slots__ = (
        "_in_paths",
        "_lock",
        "_out_paths",
        "_waiters",
        "compiled",
        "dyn_pos",
        "in_tree",
        "key",
        "name",
        "out_avals",
        "out_shardings",
        "out_tree",
        "owner",
        "specs",
    )

    def __init__(
        self, owner: JitFunction, key: Any, dyn_pos: tuple[int, ...], in_tree: Any, specs: Any
    ):
        self.owner = owner
        self.key = key
        self.name = owner._name
        self.dyn_pos = dyn_pos
        self.in_tree = in_tree  # of (dynamic positional args, dynamic keyword args)
        self.specs = specs
        self.compiled: _core.Future | None = None
        self.out_tree: Any = None
        self.out_avals: list[Any] = []
        self.out_shardings: list[Any] = []
        self._in_paths: list[str] | None = None
        self._out_paths: list[str] | None = None
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], None]] | None = []

    def in_path(self, index: int) -> str:
        """Input leaf ``index`` as the caller wrote it: ``x``, ``params['w']``."""
        if self._in_paths is None:
            self._in_paths = _input_paths(self.owner, self.dyn_pos, self.in_tree)
        return self._in_paths[index]

    def out_path(self, index: int) -> str:
        if self._out_paths is None:
            dummy = self.out_tree.unflatten(range(self.out_tree.num_leaves))
            self._out_paths = [
                _keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]
            ]
        return self._out_paths[index]

    def inputs_text(self) -> str:
        return ", ".join(f"{self.in_path(i)}: {_describe(s)}" for i, s in enumerate(self.specs))

    def start_compile(self, traced: Any) -> None:
        """Compiles ``traced`` on the pool. The compile future's one callback
        runs every waiter, so they all run inside the task's activity."""
        jax_work.enter()
        try:
            self.compiled = _core.submit(_compile, traced)
        except BaseException:
            jax_work.leave()
            raise
        self.compiled.add_done_callback(self._compiled)

    def compiled_done(self) -> bool:
        """True once compilation is done and every waiter was called."""
        return self._waiters is None

    def on_compiled(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once compilation is done (here, if it is)."""
        with self._lock:
            if self._waiters is not None:
                self._waiters.append(fn)
                return
        fn()

    def failed(self) -> bool:
        fut = self.compiled
        return fut is not None and fut.done() and (fut.cancelled() or fut.exception(0) is not None)

    def _compiled(self, _: _core.Future) -> None:
        try:
            if self.failed():
                self.owner._forget(self)
            with self._lock:
                waiters, self._waiters = self._waiters or [], None
            waiters.reverse()
            while waiters:
                try:
                    waiters.pop()()
                except Exception:  # pragma: no cover - a bug here; keep the others going
                    _LOG.exception("async_array: %s: exception in a dispatch callback", self.name)
        finally:
            jax_work.leave()  # nothing of the waiters (their inputs) is left to free after this


class _Call:
    """One dispatch: the inputs to run the compiled program on, and the future
    every output leaf reads."""

    __slots__ = ("entry", "leaves", "out")

    def __init__(self, entry: _Entry, leaves: list[Any], out: _core.Future):
        self.entry = entry
        self.leaves: list[Any] | None = leaves
        self.out = out


def _compile(traced: Any) -> Any:
    with frames_freed:
        return traced.lower().compile()


def _when_all_done(
    subscribes: Sequence[Callable[[Callable[..., None]], None]], fn: Callable[[], None]
) -> None:
    """Calls ``fn()`` once every event is done, on the thread that finishes
    the last one (here, if all are), without any thread waiting for them.
    ``subscribe(cb)`` arranges for ``cb`` to be called once its event is done."""
    remaining = len(subscribes)
    lock = threading.Lock()

    def one_done(*_: Any) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining == 0
        if last:
            fn()

    for subscribe in subscribes:
        subscribe(one_done)


def _launch(call: _Call) -> None:
    """Submits the run of ``call`` (inputs and compilation are done)."""
    with _waiting_lock:
        _waiting.discard(call)
    out = call.out
    if out.done():  # cancelled by the caller, or at exit: nothing to run
        call.leaves = None
        return
    jax_work.enter()
    try:
        task = _core.submit(_execute, call)
    except BaseException as exc:  # the pool is shut down
        jax_work.leave()
        call.leaves = None
        out.set_exception(exc)
        return
    task.add_done_callback(functools.partial(_task_ended, [out]))


def _task_ended(holder: list[_core.Future], task: _core.Future) -> None:
    # _execute completes the output future itself; this covers a task
    # cancelled at interpreter exit, so that no output waits forever. The
    # output (and the arrays it holds) comes in a list emptied here, so that
    # it is never freed after jax_work.leave(), when the interpreter may be exiting.
    out = holder.pop()
    try:
        if out.done():
            return
        if task.cancelled():
            out.cancel()
            return
        exc = task.exception(0)
        out.set_exception(exc if exc is not None else RuntimeError("aa.jit: task ended early"))
    finally:
        del out
        jax_work.leave()


def _execute(call: _Call) -> None:
    """Runs on the pool once the compilation and every input are done."""
    out, entry, values = call.out, call.entry, call.leaves
    call.leaves = None  # a donated or large input is held only as long as needed
    if out.done() or values is None:
        return
    assert entry.compiled is not None
    try:
        compiled = entry.compiled.result(0)
    except BaseException as exc:
        out.set_exception(
            noted(exc, f"async_array: compiling {entry.name} for ({entry.inputs_text()}) failed")
        )
        return
    for i, value in enumerate(values):
        if type(value) is AsyncArray:
            try:
                values[i] = value.result()
            except BaseException as exc:
                out.set_exception(
                    noted(exc, f"async_array: input {entry.in_path(i)} of {entry.name} failed")
                )
                return
    try:
        result = _run(compiled, entry.in_tree, values)
    except BaseException as exc:
        free_frames(exc)
        exc.add_note(f"async_array: raised while running {entry.name}")
        out.set_exception(exc)
        return
    out.set_result(entry.out_tree.flatten_up_to(result))


def _run(compiled: Any, in_tree: Any, values: list[Any]) -> Any:
    # Its own frame, so that a traceback does not keep the inputs alive.
    dyn_args, dyn_kwargs = in_tree.unflatten(values)
    values.clear()
    return compiled(*dyn_args, **dyn_kwargs)


class JitFunction:
    """What ``aa.jit(fun)`` returns: call it like ``fun``; it returns at once.

    Attributes:
      jitted: the ``jax.jit(fun, **jit_kwargs)`` it traces and compiles with.
    """

    def __init__(self, fun: Callable[..., Any], jit_kwargs: dict[str, Any]):
        # First, so that attributes copied from fun (its __dict__) never shadow ours.
        functools.update_wrapper(self, fun)
        self.jitted = jax.jit(fun, **jit_kwargs)  # validates the arguments now
        self._name = f"aa.jit({qualname(fun)})"
        try:
            sig: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            sig = None
        self._static_nums, self._static_names = _static_argnums_argnames(
            sig, jit_kwargs.get("static_argnums"), jit_kwargs.get("static_argnames")
        )
        self._in_devices = _in_shardings_devices(jit_kwargs.get("in_shardings"))
        self._pos_names: list[str] = []
        self._var_pos: str | None = None
        if sig is not None:
            for p in sig.parameters.values():
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    self._pos_names.append(p.name)
                elif p.kind == p.VAR_POSITIONAL:
                    self._var_pos = p.name
        self._cache: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<{self._name}>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # As jax.jit: decorating a method binds it to the instance.
        return self if instance is None else functools.partial(self, instance)

    def _arg_name(self, pos: int) -> str:
        if pos < len(self._pos_names):
            return self._pos_names[pos]
        if self._var_pos is not None:
            return f"{self._var_pos}[{pos - len(self._pos_names)}]"
        return f"args[{pos}]"

    def clear_cache(self) -> None:
        """Forgets every trace and compiled program of this function."""
        with self._lock:
            self._cache.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Traces ``fun`` now (or reuses a trace), and returns its outputs as
        ``AsyncArray`` leaves at once.

        Args:
          *args: as ``fun`` takes them: ``AsyncArray``, ``jax.Array``, numpy
            arrays, Python scalars, or pytrees of them; static arguments as
            ``jax.jit`` takes them.
          **kwargs: likewise.

        Returns:
          ``fun``'s output structure with an ``AsyncArray`` per array leaf,
          with the traced shapes and dtypes. Inside a JAX transformation (an
          argument is a tracer), what ``jax.jit(fun)`` returns.

        Raises:
          Exception: whatever tracing raises (the type JAX raises), with a note
            naming the function and the inputs' shapes and dtypes.
          TypeError: an input leaf that is not an array or a scalar, or an
            unhashable static argument.
          OverflowError: a Python int that does not fit the default integer
            type (int32 with x64 off).
        """
        n = len(args)
        statics = sorted({i % n if i < 0 else i for i in self._static_nums if -n <= i < n})
        dyn_pos = tuple(i for i in range(n) if i not in statics)
        dyn = (
            tuple(args[i] for i in dyn_pos),
            {k: v for k, v in kwargs.items() if k not in self._static_names},
        )
        leaves, in_tree = jax.tree_util.tree_flatten(dyn)
        specs = []
        for i, leaf in enumerate(leaves):
            kind = type(leaf)
            if kind is AsyncArray:
                sharding = leaf.sharding if leaf.committed else None
                specs.append(
                    (leaf.shape, leaf.dtype, getattr(leaf.aval, "weak_type", False), sharding)
                )
            elif kind is _ArrayImpl or (
                isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
            ):
                sharding = leaf.sharding if leaf.committed else None
                specs.append((leaf.shape, leaf.dtype, leaf.weak_type, sharding))
            elif isinstance(leaf, jax.core.Tracer):  # inside jit, vmap or grad
                return self.jitted(*args, **kwargs)
            else:
                leaves[i], spec = self._concrete(leaf, i, dyn_pos, in_tree)
                specs.append(spec)
        key = (
            in_tree,
            tuple(specs),
            tuple((i, type(args[i]), args[i]) for i in statics),
            tuple(sorted((k, type(v), v) for k, v in kwargs.items() if k in self._static_names)),
            _config_key(),
        )
        try:
            with self._lock:
                entry = self._cache.get(key)
                if entry is not None:
                    self._cache.move_to_end(key)
        except TypeError:
            bad = [self._arg_name(i) for i in statics] + sorted(
                k for k in kwargs if k in self._static_names
            )
            raise TypeError(
                f"{self._name}: static arguments must be hashable, as in jax.jit; "
                f"one of {', '.join(bad)} is not"
            ) from None
        if entry is None:
            entry = self._build(key, args, kwargs, dyn_pos, in_tree, specs)
        return self._dispatch(entry, leaves)

    def _concrete(
        self, leaf: Any, index: int, dyn_pos: tuple[int, ...], in_tree: Any
    ) -> tuple[Any, tuple[Any, ...]]:
        """A numpy or scalar input leaf as it will be passed, and its spec."""
        try:
            if isinstance(leaf, (np.ndarray, np.generic)):
                # jax.jit reads it at the call, so later writes must not change the
                # result: hand JAX a private copy (device_put alone may alias the
                # caller's memory or read it later, even with may_alias=False).
                leaf = jax.device_put(np.array(leaf, copy=True))
                return leaf, (leaf.shape, leaf.dtype, leaf.weak_type, None)
            aval = jax.typeof(leaf)  # a Python scalar is weakly typed, as in jax.jit
        except OverflowError as exc:
            where = _input_paths(self, dyn_pos, in_tree)[index]
            raise OverflowError(f"{self._name}: input {where}: {exc}") from None
        except TypeError as exc:
            where = _input_paths(self, dyn_pos, in_tree)[index]
            raise TypeError(
                f"{self._name}: input {where} must be an array or a scalar, got "
                f"{type(leaf).__name__} ({exc}); mark it static (static_argnums or "
                "static_argnames) if it is not data"
            ) from None
        return leaf, (aval.shape, aval.dtype, aval.weak_type, None)

    def _build(
        self,
        key: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dyn_pos: tuple[int, ...],
        in_tree: Any,
        specs: list[tuple[Any, ...]],
    ) -> _Entry:
        """Traces here (raising what tracing raises), starts compiling on the
        pool, and caches the result."""
        entry = _Entry(self, key, dyn_pos, in_tree, specs)
        structs = [
            jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=weak)
            for shape, dtype, weak, sharding in specs
        ]
        dyn_args, dyn_kwargs = in_tree.unflatten(structs)
        trace_args = list(args)
        for j, pos in enumerate(dyn_pos):
            trace_args[pos] = dyn_args[j]
        trace_kwargs = {k: v for k, v in kwargs.items() if k in self._static_names}
        trace_kwargs.update(dyn_kwargs)
        try:
            traced = self.jitted.trace(*trace_args, **trace_kwargs)
        except Exception as exc:
            exc.add_note(f"async_array: raised while tracing {self._name}({entry.inputs_text()})")
            raise
        entry.out_tree = traced.out_tree
        entry.out_avals = traced.out_tree.flatten_up_to(traced.out_avals)
        declared = [o.sharding for o in traced.out_tree.flatten_up_to(traced.out_info)]
        entry.start_compile(traced)
        del traced
        entry.out_shardings = self._out_shardings(entry, declared)
        with self._lock:
            raced = self._cache.get(key)
            if raced is not None:  # another thread traced the same key meanwhile
                assert entry.compiled is not None
                entry.compiled.cancel()
                return raced
            self._cache[key] = entry
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        if entry.failed():  # already: its callback found it not yet cached
            self._forget(entry)
        return entry

    def _forget(self, entry: _Entry) -> None:
        # A failed compile is not kept: the next call tries again, as jax.jit does.
        with self._lock:
            if self._cache.get(entry.key) is entry:
                del self._cache[entry.key]

    def _out_shardings(self, entry: _Entry, declared: list[Any]) -> list[Any]:
        """Each output's sharding (None: the default device, uncommitted), as
        the compiled program will place it.

        Known at once when ``out_shardings`` names it, when no input is
        committed (outputs stay uncommitted on the default device, as with
        jax.jit), or when the committed inputs and ``in_shardings`` share one
        device. Otherwise XLA chooses, and only the compiled program knows:
        this waits for compilation.
        """
        committed = [s for *_, s in entry.specs if s is not None]
        meshes = {
            s.mesh.abstract_mesh: s.mesh
            for s in committed
            if isinstance(s, jax.sharding.NamedSharding)
            and not isinstance(s.mesh, jax.sharding.AbstractMesh)
        }
        devices = {d for s in committed for d in s.device_set}
        unknown = self._in_devices is None
        if self._in_devices is not None:
            devices |= self._in_devices
        out: list[Any] = []
        for s in declared:
            if isinstance(s, jax.sharding.NamedSharding) and isinstance(
                s.mesh, jax.sharding.AbstractMesh
            ):
                # Sharding in types (explicit axes): place it on the input's concrete mesh.
                mesh = meshes.get(s.mesh)
                s = None if mesh is None else jax.sharding.NamedSharding(mesh, s.spec)
                unknown |= s is None
            elif not isinstance(s, _Sharding):
                s = jax.sharding.SingleDeviceSharding(next(iter(devices))) if devices else None
                unknown |= len(devices) > 1
            out.append(s)
        if not unknown:
            return out
        assert entry.compiled is not None
        try:
            compiled = entry.compiled.result()
        except Exception:
            return [None] * len(declared)  # every output fails with the compile error
        return entry.out_tree.flatten_up_to(compiled.output_shardings)

    def _dispatch(self, entry: _Entry, leaves: list[Any]) -> Any:
        """The output leaves of one call; the program runs once the
        compilation and every pending input are done."""
        out = _core.Future()
        source = Source(out, self._name, len(entry.out_avals), entry.out_path)
        outputs = [
            AsyncArray(source, i, aval, sharding)
            for i, (aval, sharding) in enumerate(
                zip(entry.out_avals, entry.out_shardings, strict=True)
            )
        ]
        subscribes: list[Callable[[Callable[..., None]], None]] = []
        if not entry.compiled_done():
            subscribes.append(entry.on_compiled)
        inputs = [leaf for leaf in leaves if type(leaf) is AsyncArray]
        subscribes += [fut.add_done_callback for fut in pending(map(source_of, inputs)).futures]
        call = _Call(entry, leaves, out)
        if subscribes:
            with _waiting_lock:
                _waiting.add(call)
            _when_all_done(subscribes, functools.partial(_launch, call))
        else:
            _launch(call)
        return entry.out_tree.unflatten(outputs)


def jit(fun: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """``jax.jit`` with deferred dispatch: calls return at once, compile in the
    background, and run when their inputs are ready.

    Calling the result traces ``fun`` from the inputs' shapes, dtypes and
    shardings (an ``AsyncArray`` need not be ready), returns ``AsyncArray``
    outputs right after tracing, compiles on the pool, and runs the compiled
    program on the pool once compilation is done and every input is ready. The
    outputs feed further ``aa.jit`` calls, ``jax.jit`` and ``jnp`` like any
    ``jax.Array``; only reading a value waits.

    Same input shapes, dtypes, weak types, shardings and static arguments
    reuse the trace and the compiled program (per function, up to
    :data:`CACHE_SIZE` of them).

    Args:
      fun: the function, as for ``jax.jit``. Omitted, ``jit`` returns a
        decorator (``@aa.jit(static_argnums=1)``).
      **jit_kwargs: anything ``jax.jit`` takes: ``static_argnums``,
        ``static_argnames``, ``in_shardings``, ``out_shardings``,
        ``donate_argnums``, ``donate_argnames``, ``keep_unused``,
        ``compiler_options``, ...

    Returns:
      A callable with ``fun``'s signature. Its outputs are ``AsyncArray``
      leaves in ``fun``'s output structure, with the shapes, dtypes and weak
      types ``jax.jit(fun)`` would give.

    Raises:
      Exception: at ``jit``, what ``jax.jit`` raises for bad arguments. At a
        call, what tracing raises, with a note naming the function and its
        inputs (see ``JitFunction.__call__``).

    Each output then fails, at every use, with: the compile error (a note says
    compiling failed, with the inputs' shapes and dtypes); a failed input's
    own exception (same type, a note naming the input by key path, e.g.
    ``params['w']``); or an error raised while running.

    Note:
      Inputs are read as ``jax.jit`` reads them: numpy arrays are copied to the
      device at the call (later writes do not matter); Python scalars are
      weakly typed. Donating an ``AsyncArray`` input (``donate_argnums``)
      donates its ``jax.Array`` value: using that input afterwards raises.
      Output shardings are known at the call when ``out_shardings`` gives
      them, when no input is committed, or when the committed inputs share
      one device; with inputs over several devices and no ``out_shardings``,
      XLA chooses them, so the call waits for compilation (not for inputs).
      Inside ``jax.jit``, ``vmap`` or ``grad`` (an argument is a tracer) it
      behaves as ``jax.jit(fun)``.

    Examples:
      >>> import time, numpy as np, async_array as aa
      >>> def slow():
      ...     time.sleep(0.5)
      ...     return np.arange(4, dtype=np.int32)
      >>> x = aa.async_wrap(slow, shape=(4,), dtype=np.int32)
      >>> square = aa.jit(lambda v: v * v)
      >>> y = square(x)  # returns at once; compiles while slow() runs
      >>> y.is_ready()
      False
      >>> print(y)
      [0 1 4 9]
    """
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    if not callable(fun):
        raise TypeError(f"aa.jit: fun must be callable, got {type(fun).__name__}")
    return JitFunction(fun, jit_kwargs)
