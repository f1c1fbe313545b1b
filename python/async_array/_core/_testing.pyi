"""Type stubs of the core's test hooks (``async_array._core._testing``): not part of the API."""

from async_array._core import Future

__all__ = ["_submit_rust_panic", "live_host_buffers", "tensor_bytes_read"]

# How many aligned host allocations are alive (for leak tests).
def live_host_buffers() -> int: ...

# Bytes of tensor data read from safetensors files and URLs by this process so far.
def tensor_bytes_read() -> int: ...

# A task that panics in Rust: its future fails with an ordinary RuntimeError.
def _submit_rust_panic(message: str) -> Future: ...
