"""async_array: futures for JAX arrays.

Wrap a slow function (a loader fetching weights over a network, say) whose
result's shapes and dtypes you know: ``async_wrap`` returns ``AsyncArray``
leaves at once, ``jax.jit`` compiles the computation that uses them while the
function still runs, and only reading a value waits.
"""

from . import _core, _jax_hooks, _waits
from ._array import AsyncArray
from ._buffer import empty
from ._core import HostBuffer
from ._errors import RemoteFailure, WaitCycleError
from ._jax_hooks import active as jax_hooks_active
from ._jit import jit
from ._map import async_map, async_stream
from ._runtime import configure, max_workers
from ._safetensors import SafetensorsHeader, load_safetensors, safetensors_header
from ._shards import make_array_from_callback
from ._waits import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    DoneAndNotDone,
    as_completed,
    future,
    materialize,
    wait,
)
from ._wrap import async_wrap

# The one registration with JAX (a no-op where its hooks are missing):
# jax.jit traces an AsyncArray from its aval and, at dispatch, resolves every
# AsyncArray argument of the call in one wait.
_jax_hooks.install(AsyncArray, _waits.resolve_all)

__version__ = _core.__version__

__all__ = [
    "ALL_COMPLETED",
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
    "AsyncArray",
    "DoneAndNotDone",
    "HostBuffer",
    "RemoteFailure",
    "SafetensorsHeader",
    "WaitCycleError",
    "__version__",
    "as_completed",
    "async_map",
    "async_stream",
    "async_wrap",
    "configure",
    "empty",
    "future",
    "jax_hooks_active",
    "jit",
    "load_safetensors",
    "make_array_from_callback",
    "materialize",
    "max_workers",
    "safetensors_header",
    "wait",
]
