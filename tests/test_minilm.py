"""The main job (examples/minilm): all-MiniLM-L6-v2 with its weights loaded over HTTP.

Checks the embeddings, hidden states and token ids against
``tests/data/minilm_reference.json`` (from sentence-transformers), loading
through the example's local server and ``aa.load_safetensors``; each fault of
the server (a connection dropped mid-tensor, a 404, a stall) gives an
``OSError`` naming the tensor where the weight is used, a file cut short a
``ValueError`` naming the tensor beyond its end, and nothing hangs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

# `make install` puts the model's files and the [minilm] extra in place; a
# missing one is a failure here (model.py raises), not a skip.
import numpy as np
import pytest
import tokenizers  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minilm"
sys.path.insert(0, str(EXAMPLE))

import jax  # noqa: E402
import model  # noqa: E402
from server import WeightServer, tensor_ranges  # noqa: E402

import async_array as aa  # noqa: E402

# A copy of the project's shared/minilm/reference.json.
REFERENCE = Path(__file__).resolve().parent / "data" / "minilm_reference.json"
RECORDS = json.loads(REFERENCE.read_text())["records"]

# Shared by the tests: same shapes, so XLA compiles each once.
EMBED = jax.jit(model.embed)
HIDDEN = jax.jit(model.hidden_states)
BATCH = model.tokenize(model.load_tokenizer(), [r["sentence"] for r in RECORDS] or ["Hi."])

RANGES = tensor_ranges(model.WEIGHTS)
VICTIM = "encoder.layer.3.intermediate.dense.weight"  # (1536, 384) float32
VICTIM_PATH = "['encoder']['layer']['3']['intermediate']['dense']['weight']"
# s: deadline of each request from a faulty server: a whole tensor (47 MB for
# one) on a loaded 2-core machine; a stall waits for STALL_TIMEOUT.
TIMEOUT = 60.0
STALL_TIMEOUT = 10.0


def file_tensor(name: str) -> np.ndarray:
    """A float32 tensor read straight from the local file (the ground truth)."""
    start, end = RANGES[name]
    with open(model.WEIGHTS, "rb") as f:
        f.seek(start)
        return np.frombuffer(f.read(end - start), "<f4")


@pytest.fixture(scope="module")
def remote():
    """(None, params tree of AsyncArray, requests the server answered) from a
    fault-free server at full speed."""
    with WeightServer(model.WEIGHTS) as server:
        params = model.load(server.url, timeout=60)
        _, not_done = aa.wait(params, timeout=60)
        assert not not_done
        yield None, params, server.requests


def test_load_gives_the_nested_tree(remote):
    _, params, requests = remote
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    assert sorted(like) == ["embeddings", "encoder"]
    assert sorted(like["encoder"]["layer"]) == [str(i) for i in range(6)]
    word = like["embeddings"]["word_embeddings"]["weight"]
    assert (word.shape, word.dtype) == ((30522, 384), np.float32)
    query = like["encoder"]["layer"]["5"]["attention"]["self"]["query"]["weight"]
    assert (query.shape, query.dtype) == ((384, 384), np.float32)
    assert "position_ids" not in like["embeddings"]
    assert "pooler" not in like
    assert len(jax.tree.leaves(like)) == 101
    # The file less its header (8 + 11408 bytes), position_ids (512 int64) and the pooler.
    kept = 90_868_376 - 8 - 11_408 - 512 * 8 - (384 * 384 + 384) * 4
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(params)) == kept == 90_261_504
    # The header, then a request for each tensor over 1 MiB and fewer for the
    # small ones, which neighbours share.
    big = sum(1 for s, e in RANGES.values() if e - s > 1 << 20)
    assert 1 + big < requests < 1 + len(RANGES)


def test_loaded_tensors_are_the_files_bytes(remote):
    _, params, _ = remote
    for name in ("embeddings.LayerNorm.bias", VICTIM, "encoder.layer.5.output.dense.weight"):
        leaf = params
        for key in name.split("."):
            leaf = leaf[key]
        assert isinstance(leaf, aa.AsyncArray)
        assert leaf.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(leaf).ravel(), file_tensor(name))


def test_token_ids_match_reference():
    longest = max(len(r["input_ids"]) for r in RECORDS)
    assert BATCH["input_ids"].shape == (len(RECORDS), longest)
    for i, r in enumerate(RECORDS):
        n = len(r["input_ids"])
        assert BATCH["input_ids"][i, :n].tolist() == r["input_ids"]
        assert BATCH["attention_mask"][i].tolist() == r["attention_mask"] + [0] * (longest - n)
        assert BATCH["token_type_ids"][i].tolist() == [0] * longest
        assert (BATCH["input_ids"][i, n:] == 0).all()  # [PAD]


@pytest.mark.needs_jax_hooks  # the model calls jax.jit on the leaves
def test_embeddings_match_reference(remote):
    _, params, _ = remote
    out = np.asarray(EMBED(params, **BATCH))  # jit of AsyncArray leaves
    assert out.shape == (len(RECORDS), 384)
    assert out.dtype == np.float32
    for got, r in zip(out, RECORDS, strict=True):
        want = np.array(r["embedding"], np.float64)
        cosine = got @ want / np.linalg.norm(got) / np.linalg.norm(want)
        assert cosine >= 0.99999, r["sentence"]
        assert np.abs(got - want).max() <= 1e-4, r["sentence"]
        assert np.linalg.norm(got) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.needs_jax_hooks  # the model calls jax.jit on the leaves
def test_hidden_states_match_reference(remote):
    _, params, _ = remote
    hidden = np.asarray(HIDDEN(params, **BATCH))
    assert hidden.shape == (*BATCH["input_ids"].shape, 384)
    for h, r in zip(hidden, RECORDS, strict=True):
        np.testing.assert_allclose(h[:3, :8], r["last_hidden_state_first3x8"], rtol=0, atol=1e-4)


def _fails_where_used(
    server: WeightServer,
    victim: str,
    expected: list[str],
    kind: type[OSError] = OSError,
    timeout: float = TIMEOUT,
) -> str:
    """Loads from ``server``; checks that ``victim`` fails with ``kind``
    raised by the jitted encoder (not by ``load``), that its message names the
    URL, the tensor and its bytes and holds each of ``expected``, and that an
    intact leaf is right. Returns the message."""
    params = model.load(server.url, timeout=timeout, retries=0)  # returns once the header is in
    _, not_done = aa.wait(params, timeout=30)  # fails the test rather than hang
    assert not not_done
    with pytest.raises(kind) as info:
        EMBED(params, **BATCH)
    message = str(info.value)
    start, end = RANGES[victim]
    assert message.startswith(
        f'load_safetensors: {server.url}: tensor "{victim}" (bytes [{start}, {end})): '
    )
    for text in expected:
        assert text in message
    # The note names the leaf load_safetensors made: the flat tensor name.
    assert any(f"leaf ['{victim}']" in note for note in info.value.__notes__)
    # Only the victim's leaf failed; an intact one holds the file's bytes.
    bias = params["embeddings"]["LayerNorm"]["bias"]
    np.testing.assert_array_equal(np.asarray(bias), file_tensor("embeddings.LayerNorm.bias"))
    return message


@pytest.mark.needs_jax_hooks  # the model calls jax.jit on the leaves
def test_connection_dropped_mid_tensor_names_it():
    with WeightServer(model.WEIGHTS, faults={VICTIM: "drop"}) as server:
        nbytes = 1536 * 384 * 4
        _fails_where_used(server, VICTIM, [f"truncated body: {nbytes // 2} of {nbytes} bytes"])


@pytest.mark.needs_jax_hooks  # the model calls jax.jit on the leaves
def test_404_for_a_tensor_names_it():
    with WeightServer(model.WEIGHTS, faults={VICTIM: "404"}) as server:
        _fails_where_used(server, VICTIM, ["HTTP 404 (not found)"], FileNotFoundError)


@pytest.mark.needs_jax_hooks  # the model calls jax.jit on the leaves
def test_stalled_server_times_out_naming_the_tensor():
    with WeightServer(model.WEIGHTS, faults={VICTIM: "stall"}) as server:
        expected = ["not finished within the 10 s timeout"]
        _fails_where_used(server, VICTIM, expected, TimeoutError, STALL_TIMEOUT)


def test_truncated_file_fails_at_the_header_naming_the_tensor_cut_short():
    last = max(RANGES, key=lambda name: RANGES[name][0])
    assert last == "pooler.dense.weight"
    with WeightServer(model.WEIGHTS, truncate_to=RANGES[last][0] + 1000) as server:
        # The server says the file is that short: its header is out of bounds.
        message = rf'tensor "{re.escape(last)}": data_offsets .* out of bounds'
        with pytest.raises(ValueError, match=message):
            model.load(server.url, timeout=TIMEOUT)


def test_missing_file_fails_at_the_header_naming_the_url():
    with WeightServer(model.WEIGHTS) as server:
        url = server.url.replace("model.safetensors", "missing.safetensors")
        with pytest.raises(FileNotFoundError) as info:
            model.load(url, timeout=TIMEOUT)
    assert str(info.value).startswith(
        f"load_safetensors: {url}: header (bytes [0, 65536)): HTTP 404"
    )


def test_server_ranges_and_bandwidth_knob():
    with WeightServer(model.WEIGHTS, bandwidth=50, latency=5) as server:
        assert server.link.bytes_per_s == 50e6
        assert server.latency_s == 0.005
        flat = aa.load_safetensors(server.url, like={}, timeout=30)
    assert flat == {}
    with pytest.raises(ValueError, match="fault 'slow'"):
        WeightServer(model.WEIGHTS, faults={VICTIM: "slow"})
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        WeightServer(model.WEIGHTS, faults={"nope": "drop"})


def test_load_on_other_dtypes_and_a_long_header(tmp_path):
    """Not MiniLM: a file whose header needs a second request (over 64 KiB), with
    float16, bfloat16 and int32 tensors beside float32."""
    rng = np.random.default_rng(0)
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": jax.numpy.bfloat16, "I32": np.int32}
    tensors = {
        f"block.{i}.a_long_parameter_name_to_make_the_header_big.{code.lower()}": (
            rng.normal(size=(2, 3 + i % 5)) * 100
        ).astype(dt)
        for i in range(150)
        for code, dt in dtypes.items()
    }
    header, offset = {}, 0
    for name, array in tensors.items():
        code = next(c for c, dt in dtypes.items() if array.dtype == dt)
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header).encode()
    assert len(text) > 64 * 1024
    path = tmp_path / "other.safetensors"
    path.write_bytes(
        len(text).to_bytes(8, "little") + text + b"".join(a.tobytes() for a in tensors.values())
    )
    with WeightServer(path) as server:
        params = aa.materialize(model.load(server.url, timeout=30), timeout=30)
        assert server.requests == 3  # the header took two; the small tensors share one
    assert len(jax.tree.leaves(params)) == len(tensors)
    for name, array in tensors.items():
        leaf = params
        for key in name.split("."):
            leaf = leaf[key]
        assert leaf.dtype == array.dtype, name
        np.testing.assert_array_equal(np.asarray(leaf), array)


def test_cli_prints_embeddings_and_timeline():
    long = "word " * 300  # 302 tokens with [CLS] and [SEP]: cut at 256
    sentences = [RECORDS[1]["sentence"], "A second sentence.", RECORDS[1]["sentence"], long]
    proc = subprocess.run(
        [sys.executable, EXAMPLE / "embed.py", "--bandwidth", "1000", "--latency", "1", *sentences],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # One member per sentence, in order, the repeated one too.
    pairs = json.loads(proc.stdout, object_pairs_hook=lambda items: items)
    assert [k for k, _ in pairs] == sentences
    assert all(len(v) == 384 for _, v in pairs)
    np.testing.assert_allclose(pairs[0][1], RECORDS[1]["embedding"], rtol=0, atol=1e-4)
    np.testing.assert_array_equal(pairs[0][1], pairs[2][1])
    timeline = proc.stderr
    assert "sentence 4 has 302 tokens; the model reads the first 256" in timeline
    for text in ("timeline: 90.3 MB", "header read", "loaded at", "compiled at", "sequential:"):
        assert text in timeline, timeline
    # Each ratio is computed from its own run's phases: the printed figures agree.
    for run in ("async_array:", "sequential: "):
        line = next(x for x in timeline.splitlines() if x.strip().startswith(run.strip()))
        nums = dict(re.findall(r"(load|loaded at|compile|compiled at|run|wall) ([0-9.]+)", line))
        load = float(nums.get("loaded at", nums.get("load")))
        comp = float(nums.get("compiled at", nums.get("compile")))
        limit = max(load, comp) + float(nums["run"])
        wall, shown_limit, ratio = map(
            float, re.search(r"= ([0-9.]+) / ([0-9.]+) = ([0-9.]+)", line).groups()
        )
        # Every figure is printed to 0.001 (off by at most h = 0.0005): the recomputed limit sums
        # two rounded figures (2h) against one rounded (h); the ratio is off by h itself plus
        # what the rounded wall and limit move wall / limit, to first order h (1 + ratio) / limit.
        h = 5e-4
        assert abs(shown_limit - limit) <= 3 * h + 1e-9, line
        assert abs(ratio - wall / shown_limit) <= h + h * (1 + ratio) / shown_limit + 1e-5, line
