"""Type stubs of the Rust core (checked by `python -m mypy.stubtest async_array._core`)."""

import sys
from collections.abc import Callable, Sequence
from typing import Any, final

import numpy as np
from numpy.typing import DTypeLike

__all__ = [
    "ALIGNMENT",
    "BYTE_TYPES_WITHOUT_DLPACK",
    "CONVERTED_WHILE_READING",
    "DLPACK_CPU",
    "HTTP_GAP",
    "HUGE_PAGES_ENV",
    "Future",
    "HostBuffer",
    "SafetensorsFile",
    "TensorInfo",
    "WaitCycleError",
    "Watcher",
    "__version__",
    "_after_fork_child",
    "configure",
    "default_max_workers",
    "depends_on",
    "exiting",
    "huge_pages",
    "pool_stats",
    "read_url_prefix",
    "shutdown",
    "submit",
    "submit_many",
    "submit_urgent",
    "wait_all",
    "wait_all_or_failure",
    "wait_for_running_tasks",
    "wait_for_threads_to_end",
]

__version__: str
# Alignment in bytes of every HostBuffer (64: XLA's CPU client aliases such memory).
ALIGNMENT: int
# numpy names of the one-byte ml_dtypes types a HostBuffer holds by their bytes
# and hands to JAX with one copy: DLPack has no type for them that JAX takes.
BYTE_TYPES_WITHOUT_DLPACK: frozenset[str]
# numpy names of the dtypes SafetensorsFile.read converts between as it reads
# (float16, bfloat16, float32, float64).
CONVERTED_WHILE_READING: frozenset[str]
# DLPack's device type of host memory (kDLCPU, 1).
DLPACK_CPU: int
# The environment variable that turns huge pages on (1) or off (0).
HUGE_PAGES_ENV: str
# Over HTTP, byte runs at most this far apart share one range request (64 KiB).
HTTP_GAP: int

@final
class Future:
    """One task's result, shaped like ``concurrent.futures.Future``."""

    def __new__(cls) -> Future: ...
    def set_result(self, value: Any) -> bool: ...
    def set_exception(self, exception: BaseException) -> bool: ...
    @property
    def status(self) -> str: ...
    def peek(self) -> Any | None: ...
    def done(self) -> bool: ...
    def running(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def cancel(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def result(self, timeout: float | None = None) -> Any: ...
    def exception(self, timeout: float | None = None) -> BaseException | None: ...
    def add_done_callback(
        self, func: Callable[[Future], object], *, first: bool = False
    ) -> None: ...

class WaitCycleError(RuntimeError):
    """A pool task's wait that would never end: it waits on itself.
    Public as ``async_array.WaitCycleError``."""

    # Set by the core: the calls from the waiting task back to it, and the
    # position (among the futures waited on) of the one that leads back.
    cycle: tuple[str, ...]
    index: int

@final
class Watcher:
    """Indices of futures in the order they finish."""

    def __new__(cls, futures: list[Future]) -> Watcher: ...
    def next(self, timeout: float | None = None) -> int | None: ...

@final
class HostBuffer:
    """64-byte-aligned host memory owned by the Rust core."""

    def __new__(cls, shape: Sequence[int], dtype: DTypeLike) -> HostBuffer: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def exported(self) -> bool: ...
    def mark_exported(self) -> None: ...
    def jax_capsule(self) -> Any: ...
    def __len__(self) -> int: ...
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    if sys.version_info >= (3, 12):
        # The buffer protocol as Python methods (PEP 688) exists from 3.12.
        def __buffer__(self, flags: int, /) -> memoryview: ...
        def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@final
class SafetensorsFile:
    """A safetensors file opened by the core, its header validated."""

    # `headers` go to the URL's server only; `credentials(url)` returns more of them,
    # called before the first request and once more after a 401 or 403; `name` is how
    # messages and `source` name the file.
    def __new__(
        cls,
        source: str,
        *,
        timeout: float | None = None,
        retries: int = 3,
        headers: list[tuple[str, str]] = ...,
        credentials: Callable[[str], list[tuple[str, str]]] | None = None,
        name: str | None = None,
    ) -> SafetensorsFile: ...
    @property
    def source(self) -> str: ...
    # False for a server that ignores Range: each read streams the file from byte 0.
    @property
    def ranged(self) -> bool: ...
    @property
    def size(self) -> int: ...
    @property
    def remote(self) -> bool: ...
    @property
    def tensors(self) -> list[TensorInfo]: ...
    @property
    def metadata(self) -> list[tuple[str, str]]: ...
    # Per (tensor, dtype, bounds or None): its HostBuffer, or the exception it failed with;
    # with futures (one a want), a want whose future has finished is not read.
    def read(
        self,
        wants: list[tuple[int, DTypeLike, list[tuple[int, int]] | None]],
        futures: list[Future] | None = None,
    ) -> list[HostBuffer | BaseException]: ...

@final
class TensorInfo:
    """One tensor of a safetensors file, as its header describes it."""

    @property
    def name(self) -> str: ...
    # The safetensors dtype code ("F32", "BF16").
    @property
    def dtype(self) -> str: ...
    # The numpy dtype name of the same elements ("float32", "bfloat16").
    @property
    def numpy_dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    # Byte offsets from the start of the file, end exclusive.
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...

def read_url_prefix(
    url: str,
    max_bytes: int,
    *,
    timeout: float | None = None,
    retries: int = 3,
    headers: list[tuple[str, str]] = ...,
    credentials: Callable[[str], list[tuple[str, str]]] | None = None,
    name: str | None = None,
) -> tuple[bytes, int]: ...

# `label` names the task in WaitCycleError messages: a str, or a callable called with
# the task's args only when a message needs it; by default func.__qualname__.
def submit(
    func: Callable[..., Any], *args: Any, label: str | Callable[..., str] | None = None
) -> Future: ...
def submit_many(
    func: Callable[..., Any],
    args_list: list[tuple[Any, ...]],
    *,
    label: str | Callable[..., str] | None = None,
) -> list[Future]: ...
def submit_urgent(
    func: Callable[..., Any], *args: Any, label: str | Callable[..., str] | None = None
) -> Future: ...
def wait_all(futures: list[Future], timeout: float | None = None) -> bool: ...
def wait_all_or_failure(
    futures: list[Future], timeout: float | None = None
) -> tuple[bool, int | None]: ...
def depends_on(dependents: list[Future], on: list[Future], label: str | None = None) -> None: ...
def configure(max_workers: int) -> None: ...

# min(32, cpus + 4), cpus being the CPUs this process may use: its affinity mask and
# cgroup quota count (os.cpu_count() ignores both). The pool's size when none is configured.
def default_max_workers() -> int: ...
def pool_stats() -> dict[str, int]: ...
def shutdown() -> None: ...
def exiting() -> bool: ...
def wait_for_running_tasks(timeout: float | None = None) -> bool: ...
def wait_for_threads_to_end(timeout: float | None = None) -> bool: ...
def huge_pages() -> bool: ...
def _after_fork_child() -> None: ...
