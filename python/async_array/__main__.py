"""``python -m async_array``: the versions in use and which route JAX takes.

Prints async_array's, Python's, JAX's, jaxlib's and numpy's versions, whether
``jax.jit`` takes an ``AsyncArray`` directly (the private hooks were all
found) or only the public route works (``aa.jit``, ``aa.materialize``), and
each private hook that is missing, with why. Exit status 0 either way.
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

import async_array as aa
from async_array import _jax_hooks


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    print(f"async_array {aa.__version__}")
    print(f"Python {platform.python_version()} ({platform.python_implementation()})")
    for name in ("jax", "jaxlib", "numpy", "ml_dtypes"):
        print(f"{name} {_version(name)}")
    if aa.jax_hooks_active():
        print("route: jax.jit, jnp and aa.jit all take AsyncArray leaves (JAX hooks active)")
    else:
        print("route: public only: aa.jit, aa.materialize, result() (jax.jit hooks missing)")
    for name, (purpose, needed) in _jax_hooks.HOOKS.items():
        why = _jax_hooks.MISSING.get(name)
        state = "ok" if why is None else f"missing: {why}"
        kind = "jax.jit" if needed else "optional"
        print(f"  hook {name} [{kind}: {purpose}]: {state}")


if __name__ == "__main__":
    main()
