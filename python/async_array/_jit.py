"""``aa.jit``: deferred dispatch, so a whole pipeline compiles while its inputs load.

``jax.jit(f)(x)`` with a pending ``x`` compiles at once, then waits for ``x``
before it returns, so the next stage cannot start compiling. ``aa.jit(f)(x)``
returns ``AsyncArray`` outputs right after tracing: compilation runs on the
pool, and the compiled program runs on the pool once every input is ready and
compilation is done. Public JAX API only:
``jax.jit(f).trace(specs).lower().compile()``.

JAX owns the traces and the compiled programs: its own caches answer a repeat
``trace``, ``lower`` and ``compile`` of the same function, avals and settings
in about 0.1 ms, and threads compiling one program at once share one compile.
This module keeps only what JAX cannot: the compilations still running, so
that the calls made while a program compiles share one pool task, instead of
each holding a pool worker (that loaders need) inside JAX for the whole compile.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _core, _jax_hooks, _multiprocess
from ._array import AsyncArray, source_of
from ._errors import frames_freed, free_frames, noted
from ._leaves import source_leaves
from ._runtime import exit_hooks, jax_work
from ._source import Source, pending
from ._spec import is_extended, qualname

_Sharding = jax.sharding.Sharding
_keystr = jax.tree_util.keystr
_ArrayImpl = _jax_hooks.array_type()

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
        _mark_launched(call)


exit_hooks.append(_cancel_waiting_at_exit)

# Program order. Calls launch (hand their program to JAX's dispatch) out of
# call order only where that cannot change a result: a call that donates
# launches after every earlier call (one of them may read what it donates),
# and calls with an input or output on another process's devices launch in
# call order (collectives pair by launch order across processes). Each entry
# is a call's `launched` future, by call number, until it launches.
_order_lock = threading.Lock()
_unlaunched: dict[int, _core.Future] = {}
_call_numbers = itertools.count()
_last_spanning: list[_core.Future] = []  # the latest call spanning processes, if unlaunched


def _order(call: _Call, donates: bool, spans: bool) -> list[_core.Future]:
    """Numbers ``call`` and returns the ``launched`` futures of the earlier
    calls it must launch after."""
    launched = call.launched
    with _order_lock:
        call.number = next(_call_numbers)
        if donates:
            before = list(_unlaunched.values())
        else:
            before = [f for f in _last_spanning if spans and not f.done()]
        if spans:
            _last_spanning[:] = [launched]
        _unlaunched[call.number] = launched
    return before


def _mark_launched(call: _Call) -> None:
    """``call``'s program is handed to JAX (or never will be): later calls
    ordered after it may launch."""
    with _order_lock:
        _unlaunched.pop(call.number, None)
    call.launched.set_result(None)


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


def _describe(spec: tuple[Any, ...]) -> str:
    shape, dtype, weak, sharding = spec
    name = str(dtype) if is_extended(dtype) else np.dtype(dtype).name  # key<fry> has no numpy dtype
    text = f"{'~' if weak else ''}{name}{list(shape)}"
    return text if sharding is None else f"{text} on {sharding}"


def _meshless(aval: Any) -> bool:
    """Whether an output's type names no mesh (False where JAX's avals do not say)."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    return getattr(mesh, "empty", False) is True


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


class _Compile:
    """One compilation running on the pool, shared by every call that needs
    the same program meanwhile. Its future's one callback runs every waiter,
    so they all run inside the compile's count in ``jax_work``."""

    __slots__ = ("_lock", "_waiters", "future", "jaxpr")

    def __init__(self, traced: Any, context: _jax_hooks.JaxContext) -> None:
        self.jaxpr = traced.jaxpr  # the table's key holds its id: keep it alive meanwhile
        self._lock = threading.Lock()
        self._waiters: list[Callable[[], None]] | None = []
        jax_work.enter()
        try:
            # Urgent: never behind loads.
            self.future = _core.submit_urgent(_compile, traced, context, label="aa.jit compilation")
        except BaseException:
            jax_work.leave()
            raise

    def watch(self) -> None:
        """Arranges for the waiters to run once compilation is done (here, if
        it is); call once, after the first waiter is added."""
        self.future.add_done_callback(self._compiled)

    def done(self) -> bool:
        """True once compilation is done and every waiter was called."""
        return self._waiters is None

    def on_done(self, fn: Callable[[], None]) -> None:
        """Calls ``fn()`` once compilation is done (here, if it is)."""
        with self._lock:
            if self._waiters is not None:
                self._waiters.append(fn)
                return
        fn()

    def _compiled(self, _: _core.Future) -> None:
        try:
            with self._lock:
                waiters, self._waiters = self._waiters or [], None
            waiters.reverse()
            while waiters:
                try:
                    waiters.pop()()
                except Exception:  # pragma: no cover - a bug here; keep the others going
                    _LOG.exception("async_array: exception in a dispatch callback")
        finally:
            jax_work.leave()  # the waiters (their inputs) are freed by now


def _compile(traced: Any, context: _jax_hooks.JaxContext) -> Any:
    with frames_freed, context:  # the caller's settings: default device, mesh, precision...
        return traced.lower().compile()


class _Call:
    """One dispatch: its inputs and their specs, the traced program's outputs,
    the compilation it waits for, and the future every output leaf reads."""

    __slots__ = (
        "_in_paths",
        "_out_paths",
        "compiling",
        "context",
        "dyn_pos",
        "in_tree",
        "launched",
        "leaves",
        "number",
        "out",
        "out_avals",
        "out_shardings",
        "out_tree",
        "owner",
        "span_number",
        "spanning_inputs",
        "specs",
    )

    def __init__(
        self,
        owner: JitFunction,
        dyn_pos: tuple[int, ...],
        in_tree: Any,
        specs: tuple[tuple[Any, ...], ...],
        leaves: list[Any],
    ) -> None:
        self.owner = owner
        # The caller's thread-local JAX settings, for the compile and the run on the pool.
        self.context = _jax_hooks.thread_context()
        self.dyn_pos = dyn_pos
        self.in_tree = in_tree  # of (dynamic positional args, dynamic keyword args)
        self.specs = specs
        self.leaves: list[Any] | None = leaves
        self.out = _core.Future()
        self.launched = _core.Future()  # set once the program is handed to JAX
        self.number = -1
        self.span_number = -1  # among calls spanning processes, if this is one
        self.spanning_inputs: list[tuple[int, int]] = []  # (global leaf number, input index)
        self.compiling: _Compile | None = None
        self.out_tree: Any = None
        self.out_avals: list[Any] = []
        self.out_shardings: list[Any] = []
        self._in_paths: list[str] | None = None
        self._out_paths: list[str] | None = None

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
        _mark_launched(call)
        return
    try:
        jax_work.enter()
        try:
            # Urgent: its inputs are ready, so it runs now.
            task = _core.submit_urgent(_execute, call, label=call.owner._name)
        except BaseException:
            jax_work.leave()
            raise
    except BaseException as exc:  # the interpreter is exiting, or the pool is shut down
        call.leaves = None
        out.set_exception(exc)
        _mark_launched(call)
        return
    task.add_done_callback(functools.partial(_task_ended, [out], call))


def _task_ended(holder: list[_core.Future], call: _Call, task: _core.Future) -> None:
    # _execute completes the output future itself; this covers a task
    # cancelled at interpreter exit, so that no output waits forever. The
    # output (and the arrays it holds) comes in a list emptied here, so that
    # it is never freed after jax_work.leave(), when the interpreter may be exiting.
    out = holder.pop()
    _mark_launched(call)  # normally already, by _execute
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
    """Runs on the pool once the compilation and every input are done, and
    every earlier call it is ordered after has launched."""
    try:
        _execute_in_order(call)
    finally:
        _mark_launched(call)


def _execute_in_order(call: _Call) -> None:
    out, values, name = call.out, call.leaves, call.owner._name
    call.leaves = None  # a donated or large input is held only as long as needed
    if out.done() or values is None:
        return
    assert call.compiling is not None
    try:
        compiled = call.compiling.future.result(0)
    except BaseException as exc:
        _tell_others(call, f"compiling failed: {_multiprocess.describe(exc)}")
        out.set_exception(
            noted(exc, f"async_array: compiling {name} for ({call.inputs_text()}) failed")
        )
        return
    for i, value in enumerate(values):
        if type(value) is AsyncArray:
            try:
                values[i] = value.result()
            except BaseException as exc:
                _tell_others(call, f"input {call.in_path(i)} failed: {_multiprocess.describe(exc)}")
                out.set_exception(
                    noted(exc, f"async_array: input {call.in_path(i)} of {name} failed")
                )
                return
    if call.span_number >= 0:
        try:
            _multiprocess.agree(
                call.span_number,
                None,
                [(n, call.in_path(i)) for n, i in call.spanning_inputs],
                name,
            )
        except BaseException as exc:
            out.set_exception(exc)
            return
    try:
        with call.context:
            result = _run(compiled, call.in_tree, values)
    except BaseException as exc:
        free_frames(exc)
        exc.add_note(f"async_array: raised while running {name}")
        out.set_exception(exc)
        return
    out.set_result(call.out_tree.flatten_up_to(result))


def _tell_others(call: _Call, why: str) -> None:
    """A call spanning processes that will not run here: says so to the
    other processes, so that they raise instead of waiting in a collective."""
    if call.span_number < 0:
        return
    me = jax.process_index()
    try:
        _multiprocess.agree(
            call.span_number, f"{call.owner._name} failed on process {me}: {why}", [], ""
        )
    except Exception:  # the store is gone: nothing to tell
        _LOG.debug("async_array: could not tell the other processes", exc_info=True)


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
        self._out_shardings_given = jit_kwargs.get("out_shardings") is not None
        self._donates = bool(
            jit_kwargs.get("donate_argnums") not in (None, (), [])
            or jit_kwargs.get("donate_argnames") not in (None, (), [])
        )
        self._pos_names: list[str] = []
        self._var_pos: str | None = None
        if sig is not None:
            for p in sig.parameters.values():
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    self._pos_names.append(p.name)
                elif p.kind == p.VAR_POSITIONAL:
                    self._var_pos = p.name
        # Compilations running now, by (traced jaxpr, input specs); see _compiling_for.
        self._compiling: dict[Any, _Compile] = {}
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
        """Asks JAX to forget this function's traces (``jax.jit(fun).clear_cache()``),
        so the next call traces, lowers and compiles again. Compilations
        already running still finish and serve the calls that wait for them."""
        jitted: Any = self.jitted  # clear_cache: not in JAX's stubs
        jitted.clear_cache()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Traces ``fun`` now (JAX reuses a trace of the same avals), and
        returns its outputs as ``AsyncArray`` leaves at once.

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
                # A PRNG key array has no weak_type of its own: never weak.
                weak = getattr(leaf, "weak_type", False)
                specs.append((leaf.shape, leaf.dtype, weak, sharding))
            elif isinstance(leaf, jax.core.Tracer):  # inside jit, vmap or grad
                return self.jitted(*args, **kwargs)
            else:
                leaves[i], spec = self._concrete(leaf, i, dyn_pos, in_tree)
                specs.append(spec)
        self._check_hashable(args, statics, kwargs)
        call = _Call(self, dyn_pos, in_tree, tuple(specs), leaves)
        traced = self._trace(call, args, kwargs)
        call.out_tree = traced.out_tree
        call.out_avals = traced.out_tree.flatten_up_to(traced.out_avals)
        declared = self._declared_shardings(traced, call.out_avals)
        call.compiling = self._compiling_for(traced, call.specs, call.context)
        del traced
        call.out_shardings = self._out_shardings(call, declared)
        return self._dispatch(call)

    def _check_hashable(
        self, args: tuple[Any, ...], statics: list[int], kwargs: dict[str, Any]
    ) -> None:
        try:
            hash(tuple(args[i] for i in statics))
            hash(tuple(v for k, v in kwargs.items() if k in self._static_names))
        except TypeError:
            bad = [self._arg_name(i) for i in statics] + sorted(
                k for k in kwargs if k in self._static_names
            )
            raise TypeError(
                f"{self._name}: static arguments must be hashable, as in jax.jit; "
                f"one of {', '.join(bad)} is not"
            ) from None

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

    def _trace(self, call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``jax.jit(fun).trace`` from the inputs' specs (JAX's cache answers a
        repeat); raises what tracing raises, with a note naming the inputs."""
        structs = [
            jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=weak)
            for shape, dtype, weak, sharding in call.specs
        ]
        dyn_args, dyn_kwargs = call.in_tree.unflatten(structs)
        trace_args = list(args)
        for j, pos in enumerate(call.dyn_pos):
            trace_args[pos] = dyn_args[j]
        trace_kwargs = {k: v for k, v in kwargs.items() if k in self._static_names}
        trace_kwargs.update(dyn_kwargs)
        try:
            return self.jitted.trace(*trace_args, **trace_kwargs)
        except Exception as exc:
            exc.add_note(f"async_array: raised while tracing {self._name}({call.inputs_text()})")
            raise

    def _declared_shardings(self, traced: Any, out_avals: list[Any]) -> list[Any]:
        """Each output's sharding as the traced program declares it
        (``traced.out_info``): from ``out_shardings``, or from a mesh in the
        output's type (explicit axes). With neither, each is None, known
        without building ``out_info`` (microseconds a leaf, every call)."""
        if not self._out_shardings_given and all(map(_meshless, out_avals)):
            return [None] * len(out_avals)
        return [o.sharding for o in traced.out_tree.flatten_up_to(traced.out_info)]

    def _compiling_for(
        self, traced: Any, specs: tuple[tuple[Any, ...], ...], context: _jax_hooks.JaxContext
    ) -> _Compile:
        """The compilation of ``traced``: the one still running for the same
        program, or a new task on the pool.

        The same program is the same traced jaxpr (JAX's trace cache returns
        the very object for the same function, avals, static arguments and
        settings) on the same input shardings. A finished compilation leaves
        the table: the next call's task gets the program from JAX's caches.
        """
        key = (id(traced.jaxpr), specs, context.key)
        with self._lock:
            running = self._compiling.get(key)
            if running is not None:
                return running
            running = self._compiling[key] = _Compile(traced, context)
        running.on_done(functools.partial(self._compiled, key, running))
        running.watch()
        return running

    def _compiled(self, key: Any, done: _Compile) -> None:
        with self._lock:
            if self._compiling.get(key) is done:
                del self._compiling[key]

    def _out_shardings(self, call: _Call, declared: list[Any]) -> list[Any]:
        """Each output's sharding (None: the default device, uncommitted), as
        the compiled program will place it.

        Known at once when ``out_shardings`` names it, when no input is
        committed (outputs stay uncommitted on the default device, as with
        jax.jit), or when the committed inputs and ``in_shardings`` share one
        device. Otherwise XLA chooses, and only the compiled program knows:
        this waits for compilation.
        """
        committed = [s for *_, s in call.specs if s is not None]
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
        assert call.compiling is not None
        try:
            compiled = call.compiling.future.result()
        except Exception:
            return [None] * len(declared)  # every output fails with the compile error
        return call.out_tree.flatten_up_to(compiled.output_shardings)

    def _dispatch(self, call: _Call) -> Any:
        """The output leaves of one call; the program runs once the
        compilation and every pending input are done."""
        source = Source(call.out, self._name, len(call.out_avals), call.out_path)
        # An output's NamedSharding is part of its type, as in the jax.Array it becomes.
        avals = [
            _jax_hooks.aval_with_sharding(aval, s)
            if type(s) is jax.sharding.NamedSharding
            else aval
            for aval, s in zip(call.out_avals, call.out_shardings, strict=True)
        ]
        outputs = source_leaves(source, avals, call.out_shardings)
        compiling = call.compiling
        assert compiling is not None and call.leaves is not None
        spans = any(
            s is not None and not s.is_fully_addressable
            for s in [*(spec[3] for spec in call.specs), *call.out_shardings]
        )
        subscribes: list[Callable[[Callable[..., None]], None]] = [
            f.add_done_callback for f in _order(call, self._donates, spans)
        ]
        if spans and _multiprocess.client() is not None:
            call.span_number = _multiprocess.next_call_number()
            for i, leaf in enumerate(call.leaves):
                if type(leaf) is AsyncArray:
                    input_source = source_of(leaf)
                    ids = None if input_source is None else input_source.global_ids
                    if ids is not None and ids[leaf._index] >= 0:
                        call.spanning_inputs.append((ids[leaf._index], i))
        if not compiling.done():
            subscribes.append(compiling.on_done)
        inputs = [leaf for leaf in call.leaves if type(leaf) is AsyncArray]
        waits_on = pending(map(source_of, inputs)).futures
        subscribes += [fut.add_done_callback for fut in waits_on]
        if waits_on:
            # The outputs need these inputs: a wait on an output from a task
            # that an input waits for is a cycle. (Once launched, the run waits
            # on nothing: every input is done then.)
            _core.depends_on([call.out], waits_on, self._name)
        if subscribes:
            with _waiting_lock:
                _waiting.add(call)
            _when_all_done(subscribes, functools.partial(_launch, call))
        else:
            _launch(call)
        return call.out_tree.unflatten(outputs)


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
    reuse the trace and the compiled program from JAX's own caches (as
    ``jax.jit`` does; ``JitFunction.clear_cache()`` clears them). Calls that
    need a program while it still compiles share that one compilation.

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
