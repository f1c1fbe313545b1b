"""A smoke test of the encoder benchmark's own code (``benches/encoder.py``):
the model's size, the hand-written loaders' reads (file and HTTP) and the
forward pass on a tiny encoder. No clock: the benchmark itself runs only in
``make bench``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import encoder  # puts examples/minilm on the path too
from server import WeightServer

TINY = encoder.Config(layers=2, hidden=8, heads=2, ff=16, vocab=11, positions=8, batch=2, seq=4)


def test_bert_base_is_202_float32_tensors_of_110m_parameters():
    shapes = encoder.tensor_shapes(encoder.BERT_BASE)
    assert len(shapes) == 202
    assert sum(int(np.prod(s)) for s in shapes.values()) == 109_514_298


def test_reader_reads_every_tensor_from_a_file_and_over_http(tmp_path):
    tensors = {
        "a": np.arange(10, dtype=np.float32),
        "b": np.full((3, 4), 7, np.float32),
        "c": np.arange(6, dtype=np.float32).reshape(2, 3) - 2,
    }
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    with WeightServer(path, latency=0) as server:
        for source in (str(path), server.url):
            reader = encoder.Reader(source)
            header = reader.header()
            assert sorted(header) == ["a", "b", "c"]
            for name, want in tensors.items():
                dtype, shape, start, end = header[name]
                assert (dtype, shape, end - start) == ("F32", want.shape, want.nbytes)
                got = np.empty(shape, np.float32)
                reader.read_into(start, encoder._byte_view(got))
                np.testing.assert_array_equal(got, want)
            reader.close()


def test_forward_of_a_tiny_encoder_gives_finite_logits_that_depend_on_the_weights():
    shapes = encoder.tensor_shapes(TINY)
    assert len(shapes) == 5 + 16 * TINY.layers + 5
    weights = encoder.make_weights(TINY)
    assert {k: v.shape for k, v in weights.items()} == shapes
    ids = encoder.make_inputs(TINY)
    assert ids.shape == (2, 4) and ids.dtype == np.int32
    forward = jax.jit(encoder.make_forward(TINY))
    out = np.asarray(forward(weights, ids))
    assert out.shape == (2, 11) and np.isfinite(out).all()
    np.testing.assert_array_equal(out, np.asarray(forward(encoder.make_weights(TINY), ids)))
    other = dict(weights, **{"cls.predictions.bias": weights["cls.predictions.bias"] + 1})
    np.testing.assert_allclose(np.asarray(forward(other, ids)), out + 1, rtol=1e-5, atol=1e-5)
