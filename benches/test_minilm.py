"""The main job: all-MiniLM-L6-v2, its 90 MB of weights over HTTP at 100 MB/s
and 20 ms a request, loaded while the encoder compiles.

The two ways of ``examples/minilm/embed.py``, round after round: the async one
(``aa.load_safetensors``, compile from the header's shapes meanwhile) and the
sequential twin (download everything, then compile, then run). Each round
clears JAX's caches first, so both compile from scratch. The timelines go to
``extra_info``: ``run_s`` (first execution once compiled) comes from the
sequential rounds, ``load_s`` and ``compile_s`` from both (in the async way
they overlap and share the CPUs, so each is slower than alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "minilm"))
import embed
import model
from server import WeightServer

BANDWIDTH = 100.0  # MB/s
LATENCY = 20.0  # ms a request
SENTENCES = ["The cat sat quietly on the warm windowsill.", "Weights stream in while JAX compiles."]
WAYS = {"async_array": embed.embed_async, "sequential": embed.embed_sequential}
EMBEDDINGS: list[np.ndarray] = []  # every round's output, to check that the ways agree

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server():
    with WeightServer(model.WEIGHTS, bandwidth=BANDWIDTH, latency=LATENCY) as s:
        yield s


@pytest.fixture(scope="module")
def batch():
    return model.tokenize(model.load_tokenizer(), SENTENCES)


@pytest.mark.benchmark(group="MiniLM: 90 MB at 100 MB/s, 20 ms latency")
@pytest.mark.parametrize("way", list(WAYS))
def test_minilm(benchmark, rounds, server, batch, way):
    timelines: dict[str, list[float]] = {}

    def setup():
        jax.clear_caches()
        return (), {}

    def one_round():
        out, timeline = WAYS[way](server.url, batch)
        EMBEDDINGS.append(out)
        for key in ("load", "compile", "run", "wall"):
            if key in timeline:
                timelines.setdefault(f"{key}_s", []).append(timeline[key])

    benchmark.pedantic(one_round, setup=setup, rounds=rounds, iterations=1)
    benchmark.extra_info.update(timelines)
    for out in EMBEDDINGS:
        np.testing.assert_allclose(out, EMBEDDINGS[0], rtol=0, atol=1e-6)
