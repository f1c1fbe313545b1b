"""The README and the guide run as written.

Every ```python block of ``README.md`` and ``docs/guide.md`` runs in a fresh
namespace and must print exactly what its ``# prints ...`` comments say, in
order. The recipes load a small model that the test writes into a fresh folder
(the working directory while a block runs), with numpy and the ``safetensors``
package; a block's ``http(s)://`` URL is pointed at a thread server on
127.0.0.1 that serves that folder with Range support, started and stopped by
the test (no block reaches the network).

Also: the README's API table has one row for each public name, and the README
stays a map (at most 300 lines).
"""

import contextlib
import io
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import async_array as aa

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "guide.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PRINTS = re.compile(r"#[^#]*\bprints (.+)$")
URL = re.compile(r"([\"'])https?://[^\"']*/([^\"'/]+)\1")
RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


def python_blocks() -> list:
    """Each block as a pytest param ``(code, "file:line")``."""
    params = []
    for doc in DOCS:
        text = doc.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            where = f"{doc.relative_to(ROOT)}:{line}"
            params.append(pytest.param(match.group(1), where, id=where))
    return params


def write_model(folder: Path) -> None:
    """The recipes' model: one file with Flax-style names, the same tensors
    split over two files behind an index, and a PyTorch-layout file."""
    rng = np.random.default_rng(0)
    tensors = {
        "embed.embedding": rng.standard_normal((16, 8)).astype(np.float32),
        "dense.kernel": rng.standard_normal((8, 4)).astype(np.float32),
        "dense.bias": np.zeros(4, np.float32),
    }
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"))
    parts = {
        "model-00001-of-00002.safetensors": ["embed.embedding"],
        "model-00002-of-00002.safetensors": ["dense.kernel", "dense.bias"],
    }
    for file, names in parts.items():
        safetensors.numpy.save_file({n: tensors[n] for n in names}, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    torch_layout = {
        "dense.weight": np.ascontiguousarray(tensors["dense.kernel"].T),
        "dense.bias": tensors["dense.bias"],
    }
    safetensors.numpy.save_file(torch_layout, str(folder / "pytorch_model.safetensors"))


class FolderServer:
    """Serves the files of one folder on 127.0.0.1, answering ``Range``
    requests with 206 and ``Content-Range``, as a file host does."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        served = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                served.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        path = self.folder / h.path.lstrip("/")
        if not path.is_file():
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        data = path.read_bytes()
        match = RANGE.match(h.headers.get("Range", ""))
        if match is None:
            h.send_response(200)
            body = data
        else:
            start = int(match.group(1))
            last = min(int(match.group(2) or len(data) - 1), len(data) - 1)
            body = data[start : last + 1]
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{last}/{len(data)}")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def model_folder(tmp_path, monkeypatch):
    write_model(tmp_path)
    monkeypatch.chdir(tmp_path)
    server = FolderServer(tmp_path)
    yield server
    server.close()


@pytest.mark.parametrize(("code", "where"), python_blocks())
def test_python_block_runs_and_prints_what_it_says(code, where, model_folder):
    code = URL.sub(lambda m: f"{m[1]}{model_folder.base}{m[2]}{m[1]}", code)
    expected = [m.group(1).strip() for line in code.splitlines() if (m := PRINTS.search(line))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), {"__name__": "readme"})
    assert out.getvalue().splitlines() == expected


def test_the_http_recipe_is_served_locally():
    """The one block with a URL is rewritten to the local server (so the test
    above runs it without the network)."""
    blocks = [p.values[0] for p in python_blocks()]
    assert sum(bool(URL.search(code)) for code in blocks) == 1


def test_api_table_has_one_row_for_each_public_name():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## API\n") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `aa.")]
    names = [re.match(r"\| `aa\.(\w+)", row).group(1) for row in rows]
    assert sorted(names) == sorted(aa.__all__)


def test_readme_stays_a_map():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
