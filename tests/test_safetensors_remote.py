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


# -- headers= and credentials= -----------------------------------------------------------

SECRET = "s3cr3t-t0ken-value"


@pytest.fixture
def server(tmp_path):
    srv = FaultServer(tmp_path)
    yield srv
    srv.close()


def test_headers_go_with_every_request_to_the_sources_server(model, server):
    headers = {"X-Key": "k1", "Authorization": f"Bearer {SECRET}"}
    url = server.url("model.safetensors")
    assert list(aa.safetensors_header(url, headers=headers).specs) == list(SHAPES)
    check(aa.load_safetensors(url, headers=headers, timeout=30), model)
    with server.lock:
        seen = list(server.headers)
    assert len(seen) == 6  # the header twice, then a tensor a request
    for h in seen:
        assert (h["x-key"], h["authorization"]) == ("k1", f"Bearer {SECRET}")


def test_headers_follow_a_redirect_on_the_same_server_only(model, cdn, server, servers):
    server.redirect = {"/moved.safetensors": "/model.safetensors"}
    headers = {"Authorization": f"Bearer {SECRET}"}
    check(aa.load_safetensors(server.url("moved.safetensors"), headers=headers), model)
    with server.lock:
        assert all(h["authorization"] == f"Bearer {SECRET}" for h in server.headers)
    origin = servers(Redirector, to(cdn))  # 127.0.0.1 -> 127.0.0.2
    check(aa.load_safetensors(origin.url("model.safetensors"), headers=headers), model)
    assert [h["authorization"] for _, h in origin.requests] == [f"Bearer {SECRET}"]
    with cdn.lock:
        assert len(cdn.headers) == 5
        assert not any("authorization" in h for h in cdn.headers)


def test_credentials_are_asked_again_once_after_a_401(model, server):
    server.auth = "Bearer fresh"
    tokens = iter(["stale", "fresh"])
    asked = []

    def credentials(url):
        asked.append(url)
        return {"Authorization": f"Bearer {next(tokens)}"}

    url = server.url("model.safetensors")
    headers = {"Authorization": "Bearer fixed", "X-Key": "k1"}
    tree = aa.load_safetensors(url, headers=headers, credentials=credentials, timeout=30)
    check(tree, model)
    assert asked == [url, url]  # before the first request, and after its 401
    with server.lock:
        seen = [(h["authorization"], h["x-key"]) for h in server.headers]
    # The stale token's 401, then the fresh one overriding headers=, for every read.
    assert seen == [("Bearer stale", "k1")] + [("Bearer fresh", "k1")] * 5


def test_a_second_refusal_after_the_refresh_stands_naming_the_url(model, server):
    server.auth = "Bearer never"
    asked = []

    def credentials(url):
        asked.append(url)
        return {"Authorization": f"Bearer {SECRET}"}

    url = server.url("model.safetensors")
    with pytest.raises(PermissionError) as info:
        aa.load_safetensors(url, credentials=credentials, timeout=30)
    assert str(info.value) == (
        f"load_safetensors: {url}: header (bytes [0, 65536)): HTTP 401 (unauthorized: "
        "credentials missing or refused)"
    )
    assert asked == [url, url]


def test_an_exception_of_credentials_fails_the_load_naming_it(model, server):
    def credentials(url):
        raise RuntimeError("no token today")

    url = server.url("model.safetensors")
    with pytest.raises(OSError) as info:
        aa.load_safetensors(url, credentials=credentials, timeout=30)
    assert str(info.value) == (
        f"load_safetensors: {url}: header (bytes [0, 65536)): credentials({url!r}) raised "
        "RuntimeError: no token today"
    ).replace(f"({url!r})", f'("{url}")')
    with server.lock:
        assert server.requests == []  # no request without its credentials


@pytest.mark.parametrize(
    ("headers", "error", "message"),
    [
        ([("X-Key", SECRET)], TypeError, "headers must be a dict of str to str, got list"),
        ({"X-Key": 7}, TypeError, "got a value of type int for 'X-Key'"),
        ({7: SECRET}, TypeError, "got a key of type int"),
        ({"X Key": SECRET}, ValueError, "headers: 'X Key' is not a valid header name"),
        ({"Range": "bytes=0-1"}, ValueError, "'Range' is set by the loader itself"),
        ({"X-Key": f"a\r\nX-Other: {SECRET}"}, ValueError, "value of 'X-Key' holds a line break"),
    ],
)
@pytest.mark.parametrize("function", ["load_safetensors", "safetensors_header"])
def test_bad_headers_are_refused_at_the_call_without_their_values(
    server, headers, error, message, function
):
    with pytest.raises(error) as info:
        getattr(aa, function)(server.url("model.safetensors"), headers=headers)
    text = str(info.value)
    assert text.startswith(f"{function}: headers") and message in text, text
    assert SECRET not in text
    with server.lock:
        assert server.requests == []


@pytest.mark.parametrize("function", ["load_safetensors", "safetensors_header"])
def test_credentials_must_be_callable(server, function):
    with pytest.raises(TypeError) as info:
        getattr(aa, function)(server.url("model.safetensors"), credentials=SECRET)
    assert str(info.value) == (
        f"{function}: credentials must be a callable credentials(url) -> dict[str, str], "
        "or None, got str"
    )


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (SECRET, "it must be a dict of str to str, got str"),
        ({"Authorization": 7}, "got a value of type int for 'Authorization'"),
        ({"Authorization": f"Bearer {SECRET}\n"}, "value of 'Authorization' holds a line break"),
    ],
)
def test_what_credentials_return_is_checked_without_showing_it(server, model, returned, message):
    url = server.url("model.safetensors")
    with pytest.raises((TypeError, ValueError)) as info:
        aa.load_safetensors(url, credentials=lambda u: returned, timeout=30)
    text = str(info.value)
    assert text.startswith(f"load_safetensors: {url}: header (bytes [0, 65536)): credentials(")
    assert message in text and SECRET not in text, text


def test_no_error_nor_log_shows_a_header_value(model, cdn, server, servers, caplog):
    """Refusals, a missing file, a redirect loop, failed tensor reads: the
    token in headers= is in none of their messages, nor in any log record."""
    headers = {"Authorization": f"Bearer {SECRET}", "X-Key": SECRET}
    texts = []

    def failure(call):
        with pytest.raises(Exception) as info:
            call()
        texts.append(f"{info.value!r} {info.value} {info.value.__cause__!r}")

    url = server.url("model.safetensors")
    server.auth = "Bearer other"
    failure(lambda: aa.load_safetensors(url, headers=headers, timeout=30))
    server.auth = None
    failure(lambda: aa.safetensors_header(server.url("nope.safetensors"), headers=headers))
    loop = servers(Redirector, lambda path, h: (302, path))
    failure(lambda: aa.load_safetensors(loop.url("m"), headers=headers, timeout=30))
    server.status = 403
    like = {"a": jax.ShapeDtypeStruct(SHAPES["a"], np.float32)}
    tree = aa.load_safetensors(url, like=like, headers=headers, timeout=30)
    failure(lambda: tree["a"].result(timeout=WAIT))
    assert len(texts) == 4
    assert all(SECRET not in text for text in texts), texts
    assert SECRET not in caplog.text
