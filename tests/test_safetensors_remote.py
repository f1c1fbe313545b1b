"""aa.load_safetensors from servers behind redirects: an origin on 127.0.0.1
that redirects to a CDN on 127.0.0.2 (both started by each test), the final
location reused by every later read and asked again when it refuses one;
headers= and credentials= kept to the source's own server; hf:// sources
read through a fake Hub; Python's http.server, which ignores Range."""

import json
import re
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

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
    assert str(info.value).startswith(f'load_safetensors: {url}: tensor "a" (bytes ['), info.value
    assert f"HTTP {refusal}" in str(info.value)
    assert origin.paths() == ["/model.safetensors"] * 2  # asked again once, not more


# -- headers= and credentials= -----------------------------------------------------------

SECRET = "s3cr3t-t0ken-value"


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


@pytest.mark.parametrize("refusal", [401, 403])
def test_credentials_are_asked_again_once_after_a_refusal(model, server, refusal):
    server.auth = "Bearer fresh"
    server.auth_status = refusal
    tokens = iter(["stale", "fresh"])
    asked = []

    def credentials(url):
        asked.append(url)
        return {"Authorization": f"Bearer {next(tokens)}"}

    url = server.url("model.safetensors")
    headers = {"Authorization": "Bearer fixed", "X-Key": "k1"}
    tree = aa.load_safetensors(url, headers=headers, credentials=credentials, timeout=30)
    check(tree, model)
    assert asked == [url, url]  # before the first request, and after its refusal
    with server.lock:
        seen = [(h["authorization"], h["x-key"]) for h in server.headers]
    # The stale token's refusal, then the fresh one overriding headers=, for every read.
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
    )
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
        ({"X-Key": f"a\r\nX-Other: {SECRET}"}, ValueError, "value of 'X-Key' holds a character"),
        # Found by a first-time user: these went to the network and came back
        # as an OSError after four attempts.
        ({"X-Key": f"{SECRET}\u00e9"}, ValueError, "value of 'X-Key' holds a character"),
        ({"X-Key": f"{SECRET}\x01"}, ValueError, "value of 'X-Key' holds a character"),
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
        (SECRET, " must be a dict of str to str, got str"),
        ({"Authorization": 7}, "got a value of type int for 'Authorization'"),
        ({"Authorization": f"Bearer {SECRET}\n"}, "value of 'Authorization' holds a character"),
    ],
)
def test_what_credentials_return_is_checked_without_showing_it(server, model, returned, message):
    url = server.url("model.safetensors")
    with pytest.raises((TypeError, ValueError)) as info:
        aa.load_safetensors(url, credentials=lambda u: returned, timeout=30)
    text = str(info.value)
    assert text.startswith(
        f"load_safetensors: {url}: header (bytes [0, 65536)): the result of credentials({url!r})"
    )
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


# -- hf:// sources -----------------------------------------------------------------------

TOKEN = "hf_t0k3n"
RESOLVE = re.compile(r"/(?:datasets/|spaces/)?[^/]+/[^/]+/resolve/[^/]+/(?P<file>.+)$")


class FakeHub:
    """A Hub on 127.0.0.1 whose ``/resolve/`` URLs redirect to a CDN on
    127.0.0.2 serving the test's folder (and refusing any Authorization).
    A repo named ``private`` wants ``Authorization: Bearer {TOKEN}``."""

    def __init__(self, folder):
        self.cdn = FaultServer(folder, host="127.0.0.2")
        self.cdn.refuse_auth = True
        self.folder = folder
        self.origin = Redirector(self.answer)

    def answer(self, path, headers):
        match = RESOLVE.match(path)
        if match is None:
            return 400, None
        if "/private/" in path and headers.get("authorization") != f"Bearer {TOKEN}":
            return 401, None
        if not (self.folder / match["file"]).is_file():
            return 404, None
        return 302, self.cdn.url(match["file"])

    def close(self):
        self.origin.close()
        self.cdn.close()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    srv = FakeHub(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", srv.origin.base.rstrip("/"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file
    yield srv
    srv.close()


@pytest.mark.parametrize(
    ("source", "path"),
    [
        ("hf://org/repo/model.safetensors", "/org/repo/resolve/main/model.safetensors"),
        ("hf://org/repo@v1.0/model.safetensors", "/org/repo/resolve/v1.0/model.safetensors"),
        (
            "hf://datasets/org/repo@refs/pr/1/model.safetensors",
            "/datasets/org/repo/resolve/refs%2Fpr%2F1/model.safetensors",
        ),
        (
            "hf://spaces/org/repo@refs%2Fpr%2F12/model.safetensors",
            "/spaces/org/repo/resolve/refs%2Fpr%2F12/model.safetensors",
        ),
    ],
)
def test_an_hf_url_reads_the_endpoints_resolve_url_once_then_the_cdn(model, hub, source, path):
    check(aa.load_safetensors(source, timeout=30), model)
    assert hub.origin.paths() == [path]
    assert len(data_requests(hub.cdn)) == 4


def test_the_hub_token_goes_to_the_endpoint_only(model, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    check(aa.load_safetensors("hf://org/private/model.safetensors", timeout=30), model)
    assert [h.get("authorization") for _, h in hub.origin.requests] == [f"Bearer {TOKEN}"]
    with hub.cdn.lock:
        assert len(hub.cdn.headers) == 5  # none refused (400) for an Authorization


def test_the_hub_token_is_read_from_hf_home_without_hf_token(model, hub, tmp_path, monkeypatch):
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text(f"{TOKEN}\n")
    specs = aa.safetensors_header("hf://org/private/model.safetensors").specs
    assert list(specs) == list(SHAPES)


def test_credentials_override_the_hub_token(model, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    asked = []

    def credentials(url):
        asked.append(url)
        return {"Authorization": f"Bearer {TOKEN}"}

    source = "hf://org/private@v2/model.safetensors"
    check(aa.load_safetensors(source, credentials=credentials, timeout=30), model)
    assert asked == [source]  # the URL as given


def test_a_private_repo_without_a_token_is_permission_error_naming_the_hf_url(model, hub):
    source = "hf://org/private/model.safetensors"
    with pytest.raises(PermissionError) as info:
        aa.load_safetensors(source, timeout=30)
    assert str(info.value) == (
        f"load_safetensors: {source}: header (bytes [0, 65536)): HTTP 401 (unauthorized: "
        "credentials missing or refused) (a private or gated repo needs a token: set HF_TOKEN, "
        "or log in with `hf auth login` (it writes $HF_HOME/token))"
    )


def test_a_private_index_without_a_token_says_so_too(hub, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    source = "hf://org/private/model.safetensors.index.json"
    with pytest.raises(PermissionError) as info:
        aa.load_safetensors(source, timeout=30)
    assert str(info.value) == (
        f"load_safetensors: {source}: bytes [0, 67108864): HTTP 401 (unauthorized: "
        "credentials missing or refused) (a private or gated repo needs a token: set "
        "HF_TOKEN, or log in with `hf auth login` (it writes $HF_HOME/token))"
    )


def test_a_missing_hub_file_is_file_not_found_naming_the_hf_url(model, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    source = "hf://org/repo@v1/nope.safetensors"
    with pytest.raises(FileNotFoundError) as info:
        aa.load_safetensors(source, timeout=30)
    assert str(info.value) == (
        f"load_safetensors: {source}: header (bytes [0, 65536)): HTTP 404 (not found)"
    )
    assert TOKEN not in str(info.value)


def test_an_hf_index_reads_its_files_from_the_same_repo_and_revision(model, hub, tmp_path):
    weight_map = {"a": "model-1.safetensors", "b": "model-1.safetensors"}
    weight_map |= {"c": "model-2.safetensors", "d": "model-2.safetensors"}
    for file in ("model-1.safetensors", "model-2.safetensors"):
        part = {k: v for k, v in model.items() if weight_map[k] == file}
        safetensors.numpy.save_file(part, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    tree = aa.load_safetensors("hf://org/repo@refs/pr/3/model.safetensors.index.json")
    check(tree, model)
    assert sorted(hub.origin.paths()) == [
        f"/org/repo/resolve/refs%2Fpr%2F3/{file}"
        for file in ("model-1.safetensors", "model-2.safetensors", "model.safetensors.index.json")
    ]


@pytest.mark.parametrize(
    "source",
    [
        "hf://org",
        "hf://org/repo",
        "hf://org/repo/",
        "hf://org/repo@/model.safetensors",
        "hf:///x/y",
    ],
)
def test_an_hf_url_that_names_no_file_is_refused_at_the_call(source):
    with pytest.raises(ValueError) as info:
        aa.load_safetensors(source)
    assert str(info.value) == (
        f"load_safetensors: {source}: not an hf:// URL of a file "
        "(hf://[datasets/|spaces/]org/repo[@revision]/path/in/repo)"
    )


def test_an_error_of_credentials_names_the_hf_url_as_given(model, hub):
    def credentials(url):
        raise KeyError("no token for this repo")

    source = "hf://org/private/model.safetensors"
    with pytest.raises(OSError) as info:
        aa.load_safetensors(source, credentials=credentials, timeout=30)
    assert str(info.value) == (
        f"load_safetensors: {source}: header (bytes [0, 65536)): credentials({source!r}) "
        "raised KeyError: 'no token for this repo'"
    )


# -- a server that ignores Range ---------------------------------------------------------


@pytest.fixture
def plain_server(tmp_path):
    """Python's own ``http.server`` (it answers every GET with the whole file,
    200), counting the GETs."""
    gets = []

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):
            pass

        def do_GET(self):
            gets.append(self.headers.get("Range"))
            try:
                super().do_GET()
            except OSError:  # the client took what it needed and closed
                self.close_connection = True

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", gets
    httpd.shutdown()
    httpd.server_close()


def test_http_server_is_read_once_streaming_into_every_tensor(model, plain_server, caplog):
    base, gets = plain_server
    url = base + "model.safetensors"
    check(aa.load_safetensors(url, timeout=30), model)
    assert len(gets) == 2  # the header's request, then one for every tensor
    assert gets[0] == "bytes=0-65535"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith(
        f"load_safetensors: {url}: the server ignores Range requests"
    ), warned


def test_http_server_loads_what_like_names_in_one_request(model, plain_server):
    base, gets = plain_server
    like = {k: jax.ShapeDtypeStruct(SHAPES[k], np.float32) for k in ("d", "b")}
    tree = aa.load_safetensors(base + "model.safetensors", like=like, timeout=30)
    got = aa.materialize(tree, WAIT)
    for k in like:
        np.testing.assert_array_equal(np.asarray(got[k]), model[k])
    assert len(gets) == 2
