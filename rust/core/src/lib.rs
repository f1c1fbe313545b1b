//! async-array-core: the plain-Rust half of async_array, with no Python in
//! it. It holds the worker pool, one-shot futures and the waits over them,
//! the detection of waits that would never end, 64-byte-aligned host buffers,
//! the DLPack structs, and the safetensors loader's parts: the header parser,
//! read plans, and the file and HTTP readers. The `async-array-py` crate
//! wraps it as the Python module `async_array._core`.
//!
//! # Threading rules
//!
//! * Every lock and every condition-variable wait goes through [`sync`]
//!   ([`sync::lock`], [`sync::wait_once`]); clippy refuses the raw std
//!   methods elsewhere. Poisoning is ignored: no code here panics while
//!   holding a lock.
//! * No lock is held while user code runs: a future's callbacks and a pool
//!   job run after their lock is released, so a job may take other locks
//!   (the bindings' rule: never wait for the GIL while holding one of these).
//! * The pool's threads start lazily and a thread that blocks on other work
//!   ([`pool::Pool::blocking`]) lets the pool start a stand-in.
//! * A future's outcome is written once and read without a lock.
//! * Outside the pool, only a read over HTTP starts threads: the parts of a
//!   large range request ([`safetensors::plan::PARALLEL_ABOVE`]), scoped to
//!   the read, which waits for them; they run no user code.
//! * Across `fork()`, [`pool::Pool::lock_for_fork`] keeps the pool's state
//!   consistent; the child fails what the parent's threads were running.

#![deny(missing_docs)]

pub mod buffer;
pub mod dlpack;
pub mod error;
pub mod future;
pub mod pool;
pub mod safetensors;
pub mod sync;
pub mod time;

pub use error::Error;
