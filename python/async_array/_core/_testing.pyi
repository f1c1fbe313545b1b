"""Type stubs of the core's test hooks (``async_array._core._testing``): not part of the API."""

from async_array._core import Future

__all__ = [
    "_submit_rust_panic",
    "live_host_buffers",
    "set_parallel_ranges",
    "tensor_bytes_read",
]

# How many aligned host allocations are alive (for leak tests).
def live_host_buffers() -> int: ...

# Bytes of tensor data read from safetensors files and URLs by this process so far.
def tensor_bytes_read() -> int: ...

# Over HTTP, a range request of more than `above` bytes is read as concurrent parts of at
# most `part` bytes from now on, in this process; returns the values before.
def set_parallel_ranges(above: int, part: int) -> tuple[int, int]: ...

# A task that panics in Rust: its future fails with an ordinary RuntimeError.
def _submit_rust_panic(message: str) -> Future: ...
