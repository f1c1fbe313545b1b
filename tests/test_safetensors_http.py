"""aa.load_safetensors over HTTP(S): a local server on 127.0.0.1 started by
each test, with fault knobs (slow bytes, 5xx then OK, 404, a truncated body,
a wrong Content-Range or Content-Length, a Range request ignored), coalesced
requests, multi-file indexes, and HTTPS with a certificate made in the test."""

import errno
import itertools
import json
import re
import shutil
import socket
import ssl
import subprocess
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import WAIT, Gate, kill_group, run_script, spawn, wait_for
from helpers.http_server import FaultServer
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import async_array as aa
from async_array import _core
from async_array._core import _testing


@pytest.fixture
def weights(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"small.{i:02d}": rng.standard_normal((8, 4)).astype(np.float32) for i in range(20)}
    arrays["big"] = rng.standard_normal((600, 600)).astype(np.float32)  # 1.4 MB: its own request
    arrays["ids"] = np.arange(7, dtype=np.int32)
    arrays["half"] = rng.standard_normal((5, 3)).astype(np.float16)
    safetensors.numpy.save_file(arrays, str(tmp_path / "model.safetensors"))
    return arrays


def check(got, arrays):
    assert set(got) == set(arrays)
    for k, v in arrays.items():
        out = np.asarray(got[k])
        assert out.dtype == v.dtype, k
        assert out.tobytes() == v.tobytes(), k


def test_loads_bit_exact_with_small_tensors_coalesced(server, weights):
    tree = aa.load_safetensors(server.url("model.safetensors"), timeout=30)
    check(aa.materialize(tree, timeout=60), weights)
    with server.lock:
        data_requests = [r for r in server.requests if r[1] > 0]
    # 22 small tensors (under 1 MiB, side by side) share requests; "big" has its own.
    assert len(data_requests) < 5, data_requests
    assert len(server.requests) == len(data_requests) + 1  # one request for the header


@pytest.fixture
def parallel_ranges():
    """Sets the size over which a request is split into concurrent parts, and
    the most bytes of a part, for one test."""
    before: list[tuple[int, int]] = []

    def set_(above: int, part: int) -> None:
        before.append(_testing.set_parallel_ranges(above, part))

    yield set_
    if before:
        _testing.set_parallel_ranges(*before[0])


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_a_large_tensor_is_read_by_concurrent_range_requests(
    server, tmp_path, parallel_ranges, dtype, sharded
):
    # 1.4 MB, split into 4 parts (of 361,802 bytes before the cuts move back
    # to float32 boundaries: each part converts whole elements).
    stored = np.random.default_rng(3).standard_normal((602, 601)).astype(np.float32)
    stored[0, :3] = [np.inf, -0.0, np.nan]
    safetensors.numpy.save_file({"w": stored, "small": np.arange(3.0)}, str(tmp_path / "m.st"))
    parallel_ranges(1_000_000, 400_000)
    # Each request is held until all four are in flight: one after another,
    # the first would wait 30 s alone and hold_expired would tell.
    server.hold_until = 4
    sharding = None
    if sharded:
        mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
        sharding = {"w": NamedSharding(mesh, P("x", None))}
    before = _testing.tensor_bytes_read()
    like = {"w": jax.ShapeDtypeStruct(stored.shape, dtype or np.float32)}
    tree = aa.load_safetensors(server.url("m.st"), like=like, sharding=sharding, timeout=2 * WAIT)
    out = tree["w"].result(timeout=2 * WAIT)
    assert not server.hold_expired.is_set(), "the parts were not in flight together"
    assert server.most_held == 4
    want = stored if dtype is None else stored.astype(np.dtype(dtype))
    assert np.asarray(out).dtype == want.dtype
    assert np.asarray(out).tobytes() == want.tobytes()
    if sharded:
        assert out.sharding == sharding["w"]
    with server.lock:
        parts = sorted((s, e) for _, s, e in server.requests if s > 0)
    # Four parts, back to back, each cut on a float32 boundary of the tensor.
    assert len(parts) == 4, parts
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts)), parts
    assert parts[-1][1] - parts[0][0] == stored.nbytes
    assert all((e - parts[0][0]) % 4 == 0 for _, e in parts), parts
    assert _testing.tensor_bytes_read() - before == stored.nbytes


def test_a_failed_part_fails_its_tensor_naming_it_and_the_parts_bytes(
    server, tmp_path, parallel_ranges
):
    stored = np.arange(602 * 600, dtype=np.float32).reshape(602, 600)
    safetensors.numpy.save_file({"w": stored}, str(tmp_path / "m.st"))
    parallel_ranges(1_000_000, 400_000)
    server.status_first = [404]  # the first part's request fails, the others not
    tree = aa.load_safetensors(server.url("m.st"), timeout=WAIT, retries=0)
    with pytest.raises(FileNotFoundError) as info:
        tree["w"].result(timeout=WAIT)
    begin = int.from_bytes((tmp_path / "m.st").read_bytes()[:8], "little") + 8
    message = str(info.value)
    assert message.startswith(
        f"load_safetensors: {server.url('m.st')}: "
        f'tensor "w" (bytes [{begin}, {begin + stored.nbytes})): HTTP 404'
    ), message
    assert re.search(r"\(the read of bytes \[\d+, \d+\) that held it\)", message), message


def test_every_part_of_a_cancelled_tensor_is_dropped(server, tmp_path, parallel_ranges):
    stored = np.zeros((602, 601), np.float32)
    safetensors.numpy.save_file({"w": stored}, str(tmp_path / "m.st"))
    parallel_ranges(1_000_000, 400_000)
    server.hold_until = 4
    server.slow = 0.01  # a byte each 10 ms: each 360 kB part would take an hour
    like = {"w": jax.ShapeDtypeStruct(stored.shape, np.float32)}
    tree = aa.load_safetensors(server.url("m.st"), like=like)
    wait_for(server.hold_full, "the four parts in flight at once")
    assert tree["w"].cancel()
    for n in range(4):  # their bytes flow, to readers that want none
        assert server.clients_gone.acquire(timeout=WAIT), (
            f"{n} of 4 parts dropped, the rest went on"
        )
    assert tree["w"].cancelled()


def test_like_over_http_returns_at_once(server, weights):
    like = {"small": {"03": jax.ShapeDtypeStruct((8, 4), np.float32)}}
    tree = aa.load_safetensors(server.url("model.safetensors"), like=like, timeout=30)
    np.testing.assert_array_equal(
        np.asarray(tree["small"]["03"].result(timeout=30)), weights["small.03"]
    )


def test_reads_wait_without_the_gil(server, weights):
    """While every read is stuck in the core (the server holds the answers),
    Python runs: this thread, and pool tasks beside the reads."""
    server.gate = threading.Event()
    try:
        tree = aa.load_safetensors(server.url("model.safetensors"), timeout=30)
        assert server.gated.wait(30), "no read reached the server"
        assert not tree["big"].done()
        other = aa.async_wrap(lambda: np.arange(3), shape=(3,), dtype=np.int32)
        np.testing.assert_array_equal(np.asarray(other.result(timeout=30)), [0, 1, 2])
        assert not tree["big"].done()  # still held
    finally:
        server.gate.set()
    check(aa.materialize(tree, timeout=60), weights)


def test_requests_in_flight_stay_bounded_however_many_workers(server, tmp_path, pool_size):
    # Once a bug: with 208 workers every tensor's request connected at once; the
    # server's listen backlog dropped most of them, whose connects then waited
    # out TCP's retransmission backoff (28 s of a 3 s load). Without the bound
    # this fails only when a ninth request arrives before the first eight end
    # (1 run in 3 here); with it, it cannot fail.
    bound = 8  # POOL_CONNECTIONS in rust/core/src/safetensors/http.rs
    pool_size(64)
    arrays = {f"w{i:02d}": np.full((300, 900), i, np.float32) for i in range(20)}  # 1 MB each
    safetensors.numpy.save_file(arrays, str(tmp_path / "many.safetensors"))
    lock, full = threading.Lock(), threading.Event()
    counts = {"now": 0, "most": 0}
    handle = server.handle

    def counting(h):
        with lock:
            counts["now"] += 1
            counts["most"] = max(counts["most"], counts["now"])
            if counts["now"] == bound:
                full.set()
        try:
            if not h.headers.get("Range", "").startswith("bytes=0-"):
                full.wait(WAIT)  # data requests wait for a full house
            handle(h)
        finally:
            with lock:
                counts["now"] -= 1

    server.handle = counting
    # Twenty idle workers, so that every read starts as soon as it is queued.
    started = threading.Barrier(20)
    idle = [_core.submit(started.wait, WAIT) for _ in range(20)]
    assert sorted(f.result(WAIT) for f in idle) == list(range(20))
    got = aa.materialize(aa.load_safetensors(server.url("many.safetensors"), timeout=WAIT))
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)
    assert counts["most"] == bound


def test_requests_one_after_another_share_one_connection(server, weights, pool_size):
    # Every request opened a new connection (and over HTTPS paid a handshake):
    # ureq reuses one only after its body was read to the end.
    pool_size(1)
    got = aa.materialize(aa.load_safetensors(server.url("model.safetensors"), timeout=WAIT))
    check(got, weights)
    assert len(server.requests) >= 3
    assert len(server.client_ports) == 1


def test_loads_one_after_another_share_the_process_connections(server, weights, pool_size):
    # Each load kept its own idle connections: 20 loads opened at least 20.
    pool_size(1)
    for _ in range(20):
        check(aa.materialize(aa.load_safetensors(server.url("model.safetensors")), WAIT), weights)
    # One, unless the pool's idle connection aged out (15 s) between two loads.
    assert len(server.client_ports) <= 2, len(server.client_ports)


def test_concurrent_loads_keep_the_connections_to_a_server_bounded(server, weights):
    loads = [aa.load_safetensors(server.url("model.safetensors")) for _ in range(12)]
    for load in loads:
        check(aa.materialize(load, WAIT), weights)
    # At most 8 requests at once to a server, and the idle connections they
    # leave are the process's to reuse: 12 loads open no more than 8.
    assert len(server.client_ports) <= 8, len(server.client_ports)


def test_5xx_is_retried_then_succeeds(server, weights):
    server.status_first = [503, 500]
    tree = aa.load_safetensors(server.url("model.safetensors"), timeout=30, retries=3)
    check(aa.materialize(tree, timeout=60), weights)


BIG = {"big": jax.ShapeDtypeStruct((600, 600), np.float32)}
BIG_BYTES = r'tensor "big" \(bytes \[\d+, \d+\)\)'


def test_5xx_beyond_the_retries_fails_naming_url_and_bytes(server, weights):
    server.status = 503
    tree = aa.load_safetensors(server.url("model.safetensors"), like=BIG, timeout=30, retries=1)
    message = rf"model\.safetensors: {BIG_BYTES}: HTTP 503 \(server error\) \(after 2 attempts\)"
    with pytest.raises(OSError, match=message):
        tree["big"].result(timeout=30)


def test_404_raises_file_not_found_at_the_call(server, weights):
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors: header .*HTTP 404"):
        aa.load_safetensors(server.url("nope.safetensors"), timeout=30)


def test_a_refused_connection_is_connection_refused_error_with_its_errno():
    # A port bound but not listening refuses connections, and stays ours for the test.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/model.safetensors"
        with pytest.raises(ConnectionRefusedError) as info:
            aa.load_safetensors(url, timeout=30, retries=0)
    assert info.value.errno == errno.ECONNREFUSED
    assert info.value.strerror == (
        f"load_safetensors: {url}: header (bytes [0, 65536)): Connection refused (after 1 attempt)"
    )


def test_truncated_body_fails_its_leaf(server, weights):
    server.truncate = 100
    tree = aa.load_safetensors(server.url("model.safetensors"), like=BIG, timeout=30, retries=0)
    with pytest.raises(OSError, match=rf"{BIG_BYTES}: truncated body: 100 of 1440000 bytes"):
        tree["big"].result(timeout=30)


def test_a_body_cut_short_is_retried_asking_for_the_rest(server, weights):
    server.truncate = 100
    server.truncate_times = 2
    tree = aa.load_safetensors(server.url("model.safetensors"), like=BIG, timeout=30, retries=2)
    np.testing.assert_array_equal(np.asarray(tree["big"].result(timeout=30)), weights["big"])
    with server.lock:
        (first, *resumed) = [(s, e) for _, s, e in server.requests if s > 0]
    # Each retry asked only for the bytes not yet received.
    assert resumed == [(first[0] + 100, first[1]), (first[0] + 200, first[1])]


def test_a_body_cut_short_beyond_the_retries_names_tensor_and_bytes(server, weights):
    server.truncate = 100
    tree = aa.load_safetensors(server.url("model.safetensors"), like=BIG, timeout=30, retries=2)
    message = rf"{BIG_BYTES}: truncated body: 300 of 1440000 bytes received.* \(after 3 attempts\)"
    with pytest.raises(OSError, match=message):
        tree["big"].result(timeout=30)


def test_a_failed_shared_request_names_each_leafs_own_tensor(server, weights, tmp_path):
    """Small neighbours share one request; when it fails, each leaf's error
    names its own tensor and bytes, never a neighbour."""
    server.status = 503
    like = {f"small.{i:02d}": jax.ShapeDtypeStruct((8, 4), np.float32) for i in (3, 4, 5)}
    tree = aa.load_safetensors(server.url("model.safetensors"), like=like, timeout=30, retries=0)
    with open(tmp_path / "model.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    for name in like:
        begin, end = (8 + n + o for o in header[name]["data_offsets"])
        with pytest.raises(OSError) as info:
            tree[name].result(timeout=30)
        message = str(info.value)
        assert message.startswith(
            f"load_safetensors: {server.url('model.safetensors')}: "
            f'tensor "{name}" (bytes [{begin}, {end})): HTTP 503 (server error)'
        ), message
        others = [o for o in like if o != name]
        assert not any(o in message for o in others), message
    with server.lock:
        assert len([r for r in server.requests if r[1] > 0]) == 1  # one request for the three


def test_wrong_content_range_fails(server, weights):
    server.content_range_shift = 1
    tree = aa.load_safetensors(server.url("model.safetensors"), like=BIG, timeout=30)
    with pytest.raises(OSError, match=r"tensor \"big\" .*wrong Content-Range"):
        tree["big"].result(timeout=30)


def test_wrong_content_length_fails(server, weights):
    server.content_length_delta = -1
    tree = aa.load_safetensors(server.url("model.safetensors"), like=BIG, timeout=30)
    with pytest.raises(OSError, match=r"tensor \"big\" .*wrong Content-Length"):
        tree["big"].result(timeout=30)


def test_a_server_ignoring_range_is_read_in_one_pass_with_one_warning(server, weights, caplog):
    server.ignore_range = True
    check(aa.materialize(aa.load_safetensors(server.url("model.safetensors")), WAIT), weights)
    with server.lock:
        assert len(server.headers) == 2  # the header's request, then one for every tensor
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert [r.getMessage() for r in warned] == [
        f"load_safetensors: {server.url('model.safetensors')}: the server ignores Range "
        "requests (it answered one with the whole file): ranged reads are unavailable, so the "
        "tensors wanted are read in one pass over the file from its first byte"
    ]


def test_slow_bytes_fail_within_the_timeout(server, weights):
    # One byte every 0.2 s: no single read stalls, the whole request does.
    server.slow = 0.2
    like = {"ids": jax.ShapeDtypeStruct((7,), np.int32)}
    tree = aa.load_safetensors(server.url("model.safetensors"), like=like, timeout=1)
    with pytest.raises(TimeoutError, match=r"tensor \"ids\" .*not finished within the 1(\.0)? s"):
        tree["ids"].result(timeout=30)


def test_malformed_header_over_http(server, tmp_path):
    (tmp_path / "bad.safetensors").write_bytes((3_000_000_000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"bad\.safetensors: header length 3000000000"):
        aa.load_safetensors(server.url("bad.safetensors"), timeout=30)


def write_index(folder, arrays):
    names = sorted(arrays)
    half = len(names) // 2
    parts = {"model-1.safetensors": names[:half], "model-2.safetensors": names[half:]}
    weight_map = {}
    for file, keys in parts.items():
        safetensors.numpy.save_file({k: arrays[k] for k in keys}, str(folder / file))
        weight_map.update(dict.fromkeys(keys, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_index_of_several_files_over_http(server, weights, tmp_path):
    write_index(tmp_path, weights)
    tree = aa.load_safetensors(server.url("model.safetensors.index.json"), timeout=30)
    check(aa.materialize(tree, timeout=60), weights)
    with server.lock:
        paths = {p for p, _, _ in server.requests}
    assert paths == {
        "/model.safetensors.index.json",
        "/model-1.safetensors",
        "/model-2.safetensors",
    }


def test_index_of_several_local_files_with_like(weights, tmp_path):
    write_index(tmp_path, weights)
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in weights.items()}
    tree = aa.load_safetensors(tmp_path / "model.safetensors.index.json", like=like)
    check(aa.materialize(tree, timeout=60), weights)


@pytest.mark.parametrize("over_http", [False, True])
def test_an_index_naming_a_missing_file_names_it_and_its_tensors(
    server, weights, tmp_path, over_http
):
    write_index(tmp_path, weights)
    (tmp_path / "model-2.safetensors").unlink()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    lost = sorted(k for k, v in index["weight_map"].items() if v == "model-2.safetensors")
    source = (
        server.url("model.safetensors.index.json")
        if over_http
        else str(tmp_path / "model.safetensors.index.json")
    )
    why = r".*model-2\.safetensors.*HTTP 404.*" if over_http else "no such file"
    message = (
        rf"^(\[Errno 2\] )?load_safetensors: {re.escape(source)}: names model-2\.safetensors, "
        rf"which does not exist \({why}\); it was to hold {len(lost)} tensors: "
        + re.escape(", ".join(repr(k) for k in lost[:3]))
    )
    with pytest.raises(FileNotFoundError, match=message) as info:
        aa.load_safetensors(source, timeout=30)
    if not over_http:  # as open() raises it: errno and the missing file's name
        assert info.value.errno == errno.ENOENT
        assert info.value.filename == str(tmp_path / "model-2.safetensors")
    # With like=, the leaves fail with it.
    like = {lost[0]: jax.ShapeDtypeStruct(weights[lost[0]].shape, weights[lost[0]].dtype)}
    tree = aa.load_safetensors(source, like=like, timeout=30)
    with pytest.raises(FileNotFoundError, match=message):
        tree[lost[0]].result(timeout=30)


def test_like_loads_what_it_names_when_another_file_of_the_index_is_missing(weights, tmp_path):
    # A partial download: only the files that hold what like= names are opened.
    write_index(tmp_path, weights)
    (tmp_path / "model-2.safetensors").unlink()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    kept = sorted(k for k, v in index["weight_map"].items() if v == "model-1.safetensors")
    like = {k: jax.ShapeDtypeStruct(weights[k].shape, weights[k].dtype) for k in kept}
    tree = aa.load_safetensors(tmp_path / "model.safetensors.index.json", like=like)
    check(aa.materialize(tree, timeout=60), {k: weights[k] for k in kept})


def test_an_index_naming_a_tensor_its_file_lacks(weights, tmp_path):
    write_index(tmp_path, weights)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-1.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match=r"tensor 'ghost' in .*model-1\.safetensors, which lacks it"):
        aa.load_safetensors(tmp_path / "model.safetensors.index.json")


def self_signed(tmp_path, *extensions):
    """A certificate and key made as ``openssl req -x509`` makes them, with
    ``extensions`` (``-addext`` values) added."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    added = [arg for ext in extensions for arg in ("-addext", ext)]
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", *added, "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.parametrize(
    "extensions",
    [
        # What a plain `openssl req -x509` makes: a CA certificate (CA:TRUE),
        # which Python's ssl and curl accept as a trusted server's own.
        ("subjectAltName=DNS:localhost",),
        ("subjectAltName=DNS:localhost", "basicConstraints=critical,CA:FALSE"),
    ],
    ids=["CA:TRUE", "CA:FALSE"],
)
def test_https_with_a_self_signed_certificate(tmp_path, weights, monkeypatch, extensions):
    cert, key = self_signed(tmp_path, *extensions)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    srv = FaultServer(tmp_path, tls_context=context)
    try:
        url = srv.url("model.safetensors")
        # Not trusted by default: a clear TLS error.
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        with pytest.raises(OSError, match=r"model\.safetensors: header .*certificate"):
            aa.load_safetensors(url, timeout=30, retries=0)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        check(aa.materialize(aa.load_safetensors(url, timeout=30), timeout=60), weights)
    finally:
        srv.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_trusted_self_signed_certificate_for_another_host_is_refused(tmp_path, monkeypatch):
    cert, key = self_signed(tmp_path, "subjectAltName=DNS:elsewhere.example")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    srv = FaultServer(tmp_path, tls_context=context)
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        with pytest.raises(OSError, match=r"header .*certificate"):
            aa.load_safetensors(srv.url("model.safetensors"), timeout=30, retries=0)
    finally:
        srv.close()


# -- a file that changes on its server during a load --------------------------------


def replace_during_the_reads(server, tmp_path, weights, **save):
    """Loads model.safetensors with every data request held at the server,
    replaces the file meanwhile (same tensors, new values, ``save``'s
    metadata), lets the requests go, and returns the leaves' exceptions."""
    server.gate = threading.Event()
    try:
        tree = aa.load_safetensors(server.url("model.safetensors"), timeout=30)
        assert server.gated.wait(WAIT)
        changed = {k: (v + 1).astype(v.dtype) for k, v in weights.items()}
        safetensors.numpy.save_file(changed, str(tmp_path / "model.safetensors"), **save)
    finally:
        server.gate.set()
    return {k: leaf.exception(timeout=WAIT) for k, leaf in tree.items()}


def test_a_file_replaced_by_a_longer_one_fails_every_leaf_read_after(server, tmp_path, weights):
    # The new header is longer: the old offsets would read shifted bytes.
    failures = replace_during_the_reads(server, tmp_path, weights, metadata={"padding": "x" * 64})
    for k, exc in failures.items():
        assert isinstance(exc, OSError), (k, exc)
        assert re.search(
            r"tensor .* the file changed on the server since its header was read "
            r"\(its size was \d+ bytes, now \d+\)",
            str(exc),
        ), str(exc)


def test_a_file_of_the_same_size_replaced_is_refused_by_its_etag(server, tmp_path, weights):
    server.etag = server.if_match = True
    failures = replace_during_the_reads(server, tmp_path, weights)
    for exc in failures.values():
        assert isinstance(exc, OSError) and "HTTP 412: its ETag no longer matches" in str(exc)


def test_a_server_ignoring_if_match_is_caught_by_the_etag_it_sends(server, tmp_path, weights):
    server.etag = True
    failures = replace_during_the_reads(server, tmp_path, weights)
    for exc in failures.values():
        assert isinstance(exc, OSError) and re.search(r"its ETag was \S+, now \S+", str(exc))


def test_an_unchanged_file_with_an_etag_loads(server, weights):
    server.etag = server.if_match = True
    check(aa.materialize(aa.load_safetensors(server.url("model.safetensors")), WAIT), weights)


# -- rate limits and servers that answer a range with the whole file ------------------


@pytest.mark.parametrize("status", [429, 503])
def test_a_rate_limit_is_retried_after_what_the_server_asks(server, weights, status):
    server.status_first = [status, status]
    server.retry_after = "0"
    check(aa.materialize(aa.load_safetensors(server.url("model.safetensors")), WAIT), weights)
    assert not server.status_first  # both answered, then retried


def test_a_rate_limit_beyond_the_retries_names_it(server, weights):
    server.status = 429
    server.retry_after = "0"
    tree = aa.load_safetensors(server.url("model.safetensors"), retries=2)
    with pytest.raises(OSError, match=r"HTTP 429 \(too many requests\) \(after 3 attempts\)"):
        aa.materialize(tree, WAIT)


def test_a_retry_after_beyond_the_timeout_fails_at_once_saying_so(server, weights):
    server.status_first = [429]
    server.retry_after = "Fri, 31 Dec 9999 23:59:59 GMT"
    tree = aa.load_safetensors(server.url("model.safetensors"), timeout=60)
    with pytest.raises(TimeoutError, match=r"HTTP 429 .*no time left for a retry \(it asks for"):
        aa.materialize(tree, WAIT)


def test_a_200_with_the_whole_file_answers_a_range_that_covers_it(server, tmp_path):
    small = {"w": np.arange(6, dtype=np.float32)}
    safetensors.numpy.save_file(small, str(tmp_path / "small.safetensors"))
    server.whole_as_200 = True  # the header read asks for 64 KiB: all of this file
    check(aa.materialize(aa.load_safetensors(server.url("small.safetensors")), WAIT), small)


# -- interpreter exit during a download ------------------------------------------------


def test_exit_during_a_download_abandons_it_at_once(server, weights):
    # The server trickles a byte every 0.05 s: the download would take days,
    # and exit used to wait for it for its whole grace (an hour here).
    server.slow = 0.05
    code = f"""
        import threading
        import async_array as aa
        started = threading.Event()
        def progress(done, total):
            started.set()
        tree = aa.load_safetensors({server.url("model.safetensors")!r}, progress=progress)
        assert started.wait(60), "no read started"
        print("exiting", flush=True)
    """
    proc = run_script(code, env={"ASYNC_ARRAY_EXIT_GRACE": "3600"}, timeout=WAIT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "exiting\n"
    assert "exit waits" not in proc.stderr, proc.stderr


def test_exit_during_a_read_the_server_never_answers_abandons_it_at_once(server, weights):
    # The tensor requests reach the server, which answers none of them: each
    # read waits in recv, where no chunk or retry check can see the exit.
    server.gate = threading.Event()  # never set: a gated request waits 30 s
    code = f"""
        import sys
        import async_array as aa
        tree = aa.load_safetensors({server.url("model.safetensors")!r})
        sys.stdin.readline()  # the test says when a read waits at the server
        print("exiting", flush=True)
    """
    proc = spawn(code, {"ASYNC_ARRAY_EXIT_GRACE": "3600"}, stdin=True)
    try:
        assert server.gated.wait(WAIT), "no tensor request reached the server"
        out, err = proc.communicate("go\n", timeout=WAIT + 30)
    finally:
        kill_group(proc)
    # Gone before the server's 30 s wait ended: the exit did not wait for it.
    assert server.gates_expired == 0, err
    assert proc.returncode == 0, err
    assert out == "exiting\n"


def test_a_request_in_flight_for_cancelled_leaves_only_is_dropped(server, weights):
    server.gate = threading.Event()
    server.slow = 0.01  # a byte each 10 ms: the 1.4 MB tensor would take four hours
    like = {"big": jax.ShapeDtypeStruct(weights["big"].shape, np.float32)}
    tree = aa.load_safetensors(server.url("model.safetensors"), like=like)
    assert server.gated.wait(WAIT), "the tensor's request never reached the server"
    assert tree["big"].cancel()
    server.gate.set()  # its bytes start to flow, to a reader that wants none
    assert server.client_gone.wait(WAIT), "the download went on"
    assert tree["big"].cancelled()


def test_a_url_scheme_in_capitals_is_the_same_scheme(server, weights):
    # Found by a first-time user: HTTP:// was taken for a file name.
    url = server.url("model.safetensors").replace("http://", "HTTP://")
    check(aa.materialize(aa.load_safetensors(url, timeout=30), WAIT), weights)


def test_an_index_missing_on_its_server_names_the_call_and_url(server):
    url = server.url("model.safetensors.index.json")
    with pytest.raises(FileNotFoundError, match=rf"^load_safetensors: {url}: .*HTTP 404"):
        aa.load_safetensors(url, timeout=30, retries=0)


def test_cancelled_leaves_are_not_downloaded(server, weights, pool_size):
    pool_size(1)
    blocker = Gate(np.zeros(1, np.float32))
    blocker.leaf()
    wait_for(blocker.started, "the only worker to be taken")
    tree = aa.load_safetensors(server.url("model.safetensors"))
    keep = "small.05"
    for name, leaf in tree.items():
        if name != keep:
            assert leaf.cancel(), name
    blocker.open()
    np.testing.assert_array_equal(tree[keep].result(timeout=WAIT), weights[keep])
    with server.lock:
        data = [(start, end) for _, start, end in server.requests if start > 0]
    # Only the kept tensor's 128 bytes were asked for, in one request.
    assert len(data) == 1 and data[0][1] - data[0][0] == weights[keep].nbytes, data
