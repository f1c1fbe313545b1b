"""Sentence embeddings from all-MiniLM-L6-v2, its weights streaming over HTTP while JAX compiles.

Serves ``model.safetensors`` from a local server that behaves like a network
(``--bandwidth`` MB/s shared by all requests, ``--latency`` ms a request), then
computes the embeddings twice, in one process:

* async_array: ``aa.load_safetensors`` reads the header (shapes and dtypes) and
  returns the weights as ``AsyncArray`` leaves while the Rust core fetches them
  (range requests, without the GIL, straight into the memory JAX then uses);
  the encoder compiles from the shapes while the weights arrive and runs once
  they have;
* sequential: download every weight, then ``jax.jit`` (compiled afresh: caches
  cleared) and run.

Prints ``{"sentence": [384 floats], ...}`` as JSON on stdout (from the
async_array run) and the timeline of both runs on stderr, in seconds from each
run's start, with each run's wall time over max(load, compile) + run from that
run's own phases (the async run's ``run`` is its encoder run again once the
weights are there, timed alone). The server shares this
machine's CPUs: with few cores the download is slower while XLA compiles beside
it, so compare the async ``loaded at`` with the sequential ``load``.

Run: python examples/minilm/embed.py [--bandwidth MBPS] [--latency MS] SENTENCE...
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import model
import numpy as np
from server import WeightServer

import async_array as aa


def embed_async(url: str, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, float]]:
    """The async_array way: compiles from the header's shapes while the weights arrive.

    Args:
      url: the safetensors file's URL.
      batch: ``model.tokenize``'s int32 arrays, shape ``(sentences, tokens)``.

    Returns:
      The embeddings (float32, ``(sentences, 384)``) and the timeline in seconds
      from the start: ``header`` (the header read, the leaves returned),
      ``load`` (the last tensor arrived),
      ``compile`` (compiled), ``wall`` (embeddings on the host); ``run`` (the
      compiled encoder run again alone, a duration); and ``megabytes`` fetched.
    """
    t0 = time.perf_counter()
    params = model.load(url, timeout=60)  # returns once the header is read
    t_header = time.perf_counter()
    last_arrival = _arrival_clock(params)
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    compiled = jax.jit(model.embed).trace(like, **specs).lower().compile()
    t_compiled = time.perf_counter()
    if not aa.jax_hooks_active():
        # A JAX whose private names moved: the public route waits here instead
        # of at dispatch (the compile above still overlapped the download).
        params = aa.materialize(params)
    out = np.asarray(compiled(params, **batch))  # waits for the weights at dispatch
    t_end = time.perf_counter()
    # This run's own run phase: the same program on the same (now ready)
    # weights, timed alone after the wall clock stopped.
    ready = aa.materialize(params)
    t_run = time.perf_counter()
    np.asarray(compiled(ready, **batch))
    run = time.perf_counter() - t_run
    return out, {
        "header": t_header - t0,
        "load": last_arrival() - t0,
        "compile": t_compiled - t0,  # tracing, lowering and XLA, beside the download
        "run": run,
        "wall": t_end - t0,
        "megabytes": sum(leaf.nbytes for leaf in jax.tree.leaves(ready)) / 1e6,
    }


def embed_sequential(url: str, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, float]]:
    """The sequential way: downloads every weight, then compiles afresh and runs.

    Args:
      url: the safetensors file's URL.
      batch: ``model.tokenize``'s int32 arrays, shape ``(sentences, tokens)``.

    Returns:
      The embeddings (float32, ``(sentences, 384)``) and the durations in
      seconds of ``load``, then ``compile``, then ``run``; ``header`` and
      ``wall`` from the start.
    """
    jax.clear_caches()  # so the compile is not the async run's, cached
    t0 = time.perf_counter()
    params = model.load(url, timeout=60)
    t_header = time.perf_counter()
    params = aa.materialize(params)  # every weight, as jax.Array
    t_loaded = time.perf_counter()
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    compiled = jax.jit(model.embed).trace(params, **specs).lower().compile()
    t_compiled = time.perf_counter()
    out = np.asarray(compiled(params, **batch))
    t_end = time.perf_counter()
    return out, {
        "header": t_header - t0,
        "load": t_loaded - t0,
        "compile": t_compiled - t_loaded,
        "run": t_end - t_compiled,
        "wall": t_end - t0,
    }


def _arrival_clock(tree: Any) -> Callable[[], float]:
    """Notes when each ``AsyncArray`` leaf of ``tree`` is done (a done-callback).

    Returns:
      A function that waits for every leaf and returns the last one's
      ``time.perf_counter()``.
    """
    leaves = jax.tree.leaves(tree)
    times: list[float] = []
    lock, all_done = threading.Lock(), threading.Event()

    def record(_: aa.AsyncArray) -> None:
        with lock:
            times.append(time.perf_counter())
            if len(times) == len(leaves):
                all_done.set()

    for leaf in leaves:
        leaf.add_done_callback(record)

    def last() -> float:
        all_done.wait()
        return max(times)

    return last


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of MB/s, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or more milliseconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", type=_positive, default=100.0, help="MB/s (default 100)")
    parser.add_argument(
        "--latency", type=_non_negative, default=20.0, help="ms a request (default 20)"
    )
    parser.add_argument("sentences", nargs="+", metavar="SENTENCE")
    args = parser.parse_args(argv)

    tokenizer = model.load_tokenizer()
    for i, cut in model.truncated(tokenizer, args.sentences):
        print(
            f"embed.py: sentence {i + 1} has {cut} tokens; the model reads the first "
            f"{model.MAX_TOKENS}, so its embedding ignores the rest",
            file=sys.stderr,
        )
    batch = model.tokenize(tokenizer, args.sentences)
    # JAX's one-time start-up (backend, first jit) is paid here, by neither way.
    jax.jit(jnp.sin)(1.0).block_until_ready()

    with WeightServer(model.WEIGHTS, bandwidth=args.bandwidth, latency=args.latency) as server:
        out, fast = embed_async(server.url, batch)
        ref, slow = embed_sequential(server.url, batch)
    if not np.allclose(out, ref, rtol=0, atol=1e-6):
        raise SystemExit(f"embed.py: the two ways disagree by {np.abs(out - ref).max()}")

    # One member per sentence, in order, repeats included (a dict would drop them).
    members = (
        f"{json.dumps(s)}: {json.dumps(v.tolist())}"
        for s, v in zip(args.sentences, out, strict=True)
    )
    print("{" + ", ".join(members) + "}")
    log = lambda text: print(text, file=sys.stderr)  # noqa: E731
    log(
        f"timeline: {fast['megabytes']:.1f} MB of weights at {args.bandwidth:g} MB/s, "
        f"{args.latency:g} ms a request; seconds from each run's start"
    )
    # Each run's limit comes from its own phases: load and compile side by side
    # (async) or one after the other (sequential) run at different speeds here.
    fast_limit = max(fast["load"], fast["compile"]) + fast["run"]
    slow_limit = max(slow["load"], slow["compile"]) + slow["run"]
    log(
        f"  async_array: header read {fast['header']:.3f}, loaded at {fast['load']:.3f}, "
        f"compiled at {fast['compile']:.3f}, run {fast['run']:.3f} (again, alone), "
        f"wall {fast['wall']:.3f}; "
        f"wall / (max(load, compile) + run) = {fast['wall']:.3f} / {fast_limit:.3f} "
        f"= {fast['wall'] / fast_limit:.3f}"
    )
    log(
        f"  sequential:  header read {slow['header']:.3f}, load {slow['load']:.3f}, "
        f"then compile {slow['compile']:.3f}, then run {slow['run']:.3f}, wall {slow['wall']:.3f}; "
        f"wall / (max(load, compile) + run) = {slow['wall']:.3f} / {slow_limit:.3f} "
        f"= {slow['wall'] / slow_limit:.3f}"
    )
    log(f"  sequential wall / async_array wall = {slow['wall'] / fast['wall']:.2f}x")


if __name__ == "__main__":
    main()
