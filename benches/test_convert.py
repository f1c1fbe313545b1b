"""Dtype conversion while reading: a float32 checkpoint loaded as bfloat16.

``aa.load_safetensors(path, dtype=jnp.bfloat16)`` converts each tensor in the
Rust core as it is read (a 256 KiB stage at a time, still in cache), so the
load costs about what the unconverted load costs. Twins, in the same process,
each round from the page cache: the unconverted load, and the unconverted
load followed by ``x.astype(jnp.bfloat16)`` on every leaf (a second pass over
every byte, what a user does without ``dtype=``). Target: converted at most
1.1x the unconverted wall (``make bench``'s table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import async_array as aa

TENSORS = 64
ELEMENTS = 1 << 20  # 4 MiB of float32 a tensor: 256 MiB in all
GROUP = "load 256 MiB of float32 as bfloat16"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(0)
    arrays = {
        f"layer.{i:02d}": rng.standard_normal(ELEMENTS, dtype=np.float32) for i in range(TENSORS)
    }
    path = tmp_path_factory.mktemp("convert") / "model.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    path.read_bytes()  # in the page cache, as for every way
    return path


def load(path, **kw):
    tree = aa.materialize(aa.load_safetensors(path, **kw), timeout=600)
    jax.block_until_ready(tree)
    return tree


@pytest.mark.parametrize("way", ["converted", "unconverted", "load then astype"])
def test_convert(benchmark, rounds, checkpoint, way):
    benchmark.group = GROUP
    if way == "converted":
        run = lambda: load(checkpoint, dtype=jnp.bfloat16)  # noqa: E731
    elif way == "unconverted":
        run = lambda: load(checkpoint)  # noqa: E731
    else:

        def run():
            tree = load(checkpoint)
            return jax.block_until_ready({k: v.astype(jnp.bfloat16) for k, v in tree.items()})

    out = benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=1)
    want = jnp.bfloat16 if way != "unconverted" else jnp.float32
    assert all(v.dtype == want for v in out.values())
