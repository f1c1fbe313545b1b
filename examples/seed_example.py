"""The request's own program (JAX feature request, see README), with async_wrap.

``slow()`` sleeps 3 s (it releases the GIL, as a network read does);
``square`` is jitted. ``async_wrap`` returns at once, ``square(x)`` compiles
while ``slow()`` runs and waits for it only to dispatch, and ``print(y)``
shows [0 1 4 9]. Each line's return time is printed to stderr.

Run: python examples/seed_example.py [--sleep SECONDS]
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import async_array as aa

T0 = time.perf_counter()


def stamp(what: str) -> None:
    print(f"[{time.perf_counter() - T0:6.3f} s] {what}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep", type=float, default=3.0, help="seconds slow() sleeps")
    args = parser.parse_args()

    def slow():
        time.sleep(args.sleep)  # Note that this releases the GIL
        return jnp.arange(4, dtype=np.int32)

    @jax.jit
    def square(x):
        return x * x

    stamp("start")
    # Returns quickly
    x = aa.async_wrap(slow, shape=(4,), dtype=np.int32)
    stamp(f"async_wrap returned: {x!r}")

    # Add more jax computation on top of x.
    # The compilation of square is overlapped with slow().
    y = square(x)
    stamp("square(x) returned (compiled while slow() ran, then dispatched)")

    print(y)
    stamp("print(y) returned")


if __name__ == "__main__":
    main()
