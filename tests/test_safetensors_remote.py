"""aa.load_safetensors from servers behind redirects: an origin on 127.0.0.1
that redirects to a CDN on 127.0.0.2 (both started by each test), the final
location reused by every later read and asked again when it refuses one."""

import jax
import numpy as np
import pytest
import safetensors.numpy
from conftest import WAIT
from helpers.http_server import FaultServer, Redirector

import async_array as aa

# Three tensors of over 1 MiB each and a small one: a request each.
SHAPES = {"a": (600, 600), "b": (500, 600), "c": (520, 600), "d": (8, 4)}


@pytest.fixture
def model(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    safetensors.numpy.save_file(arrays, str(tmp_path / "model.safetensors"))
    return arrays


@pytest.fixture
def cdn(tmp_path):
    srv = FaultServer(tmp_path, host="127.0.0.2")
    yield srv
    srv.close()


@pytest.fixture
def servers():
    """Starts servers for a test (``servers(make, ...)``) and closes them after it."""
    made = []

    def start(make, *args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    yield start
    for srv in made:
        srv.close()


def check(got, arrays):
    got = aa.materialize(got, WAIT)
    assert list(got) == list(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)


def to(srv, status=302):
    """An origin's answer: a redirect to the same path on ``srv``."""
    return lambda path, headers: (status, srv.url(path.lstrip("/")))


def data_requests(srv):
    with srv.lock:
        return [r for r in srv.requests if r[1] > 0]


# -- redirects ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_followed_once_and_its_target_serves_every_read(model, cdn, servers, status):
    origin = servers(Redirector, to(cdn, status))
    check(aa.load_safetensors(origin.url("model.safetensors"), timeout=30), model)
    assert origin.paths() == ["/model.safetensors"]  # the header read's, only
    with cdn.lock:
        assert len(cdn.requests) == 5  # the header's, then one a tensor
    assert len(data_requests(cdn)) == 4


def test_ten_redirects_are_followed_and_an_eleventh_fails_naming_the_url(model, cdn, servers):
    def hop(path, headers):  # /hop/N/... -> /hop/N+1/..., and /hop/10/... -> the CDN
        n = int(path.split("/")[2])
        return 302, cdn.url("model.safetensors") if n == 10 else f"/hop/{n + 1}/model.safetensors"

    origin = servers(Redirector, hop)
    check(aa.load_safetensors(origin.url("hop/1/model.safetensors"), timeout=30), model)
    url = origin.url("hop/0/model.safetensors")
    with pytest.raises(OSError) as info:
        aa.load_safetensors(url, timeout=30)
    assert str(info.value).startswith(
        f"load_safetensors: {url}: header (bytes [0, 65536)): more than 10 redirects "
        f"(the last to {cdn.url('model.safetensors')})"
    ), info.value


def test_a_redirect_loop_fails_naming_the_url(servers):
    origin = servers(Redirector, lambda path, h: (307, "/b" if path == "/a" else "/a"))
    with pytest.raises(OSError) as info:
        aa.load_safetensors(origin.url("a"), timeout=30)
    assert str(info.value) == (
        f"load_safetensors: {origin.url('a')}: header (bytes [0, 65536)): a redirect loop: "
        f"{origin.url('b')} redirects back to {origin.url('a')} (2 redirects)"
    )
    assert origin.paths() == ["/a", "/b"]


def test_a_redirect_without_a_location_fails_saying_so(servers):
    origin = servers(Redirector, lambda path, h: (302, None))
    with pytest.raises(OSError, match=r"HTTP 302 \(a redirect\) from .* without a Location"):
        aa.load_safetensors(origin.url("model.safetensors"), timeout=30)


@pytest.mark.parametrize("refusal", [403, 404, 410])
def test_a_location_that_refuses_a_read_is_asked_again_from_the_url_once(
    model, tmp_path, servers, refusal
):
    """The first CDN refuses tensor reads (an expired signed URL): the read
    goes back to the origin, which now redirects to another CDN."""
    old = servers(FaultServer, tmp_path, host="127.0.0.2")
    new = servers(FaultServer, tmp_path, host="127.0.0.2")
    old.status = refusal  # to every read but the header's
    answers = iter([old, new])
    origin = servers(Redirector, lambda path, h: (302, next(answers).url(path.lstrip("/"))))
    like = {"a": jax.ShapeDtypeStruct(SHAPES["a"], np.float32)}
    tree = aa.load_safetensors(origin.url("model.safetensors"), like=like, timeout=30)
    np.testing.assert_array_equal(np.asarray(tree["a"].result(timeout=WAIT)), model["a"])
    assert origin.paths() == ["/model.safetensors"] * 2  # the header read, the re-resolve
    assert len(data_requests(old)) == 1 and len(data_requests(new)) == 1


@pytest.mark.parametrize(("refusal", "error"), [(403, PermissionError), (404, FileNotFoundError)])
def test_a_location_that_refuses_again_after_the_url_was_asked_fails_naming_the_url(
    model, cdn, servers, refusal, error
):
    cdn.status = refusal
    origin = servers(Redirector, to(cdn))
    url = origin.url("model.safetensors")
    like = {"a": jax.ShapeDtypeStruct(SHAPES["a"], np.float32)}
    tree = aa.load_safetensors(url, like=like, timeout=30)
    with pytest.raises(error) as info:
        tree["a"].result(timeout=WAIT)
    assert str(info.value).startswith(f'{url}: tensor "a" (bytes ['), info.value
    assert f"HTTP {refusal}" in str(info.value)
    assert origin.paths() == ["/model.safetensors"] * 2  # asked again once, not more
