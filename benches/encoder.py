"""The encoder benchmark: load a BERT-base-sized encoder's
weights while its forward pass compiles, against what a JAX user would pick instead.

The weights (202 float32 tensors, 110M parameters, 440 MB: BERT-base's
embeddings, 12 layers and masked-LM head, random but fixed by a seed) are
written once to ``.cache/bench-encoder/`` as one safetensors file and as an
orbax checkpoint. Two sources: the local file (warm in the page cache) and
the same file over HTTP from ``examples/minilm/server.py`` on 127.0.0.1 with
a bandwidth cap and a latency per request; the server runs in this (driver)
process, whose CPU time while a contender runs is the server's.

Every contender runs in a fresh interpreter (so JAX compiles from scratch and
peak RSS is its own), round after round in a rotating order, and must give
the reference output (asserted). Contenders:

* ``aa.load_safetensors + jax.jit``: the leaves go straight into ``jax.jit``,
  which compiles from their shapes while they load and waits at dispatch;
* ``aa.load_safetensors + aa.jit``: the compile runs on async_array's pool;
* ``aa.async_map loader + jax.jit``: the previous way, a Python loader (one
  ``pread`` or HTTP range request a tensor into ``aa.empty``) on ``async_map``;
* ``ThreadPoolExecutor + AOT``: the same reads into numpy on a thread pool,
  ``jax.device_put`` each, ``jax.jit(f).trace(...).lower().compile()`` on
  another thread of the pool;
* ``orbax restore, then jit`` (file only: orbax reads no HTTP): orbax's own
  restore is TensorStore-based (zarr arrays in an OCDBT database);
* ``TensorStore reads + AOT``: the orbax checkpoint's arrays read directly
  with TensorStore's asynchronous reads while the main thread compiles
  (file only);
* ``sequential safetensors``: ``safe_open`` + ``jax.device_put`` per tensor
  (from HTTP: one GET of the file, then ``safetensors.numpy.load``), then jit.

And three that set the limit ``max(load alone, compile alone) + run``:
``load alone`` with ``aa.load_safetensors`` (and with the ``async_map``
loader, for the CPU comparison), ``compile alone``, and ``run``: the first
execution once compiled, in the sequential contender.

Each contender reports wall (from before the first read to the output on
the host), the marks of its phases (all weights ready, compile done, from the
same start), CPU seconds of the process over the wall, peak RSS, and how many
leaves reached JAX without a copy (the ``jax.Array``'s buffer is the memory
the loader read into).

Run: .venv/bin/python benches/encoder.py [--full] [--json OUT]
(``make bench`` runs it through ``benches/run_all.py``.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench-encoder"
sys.path.insert(0, str(ROOT / "examples" / "minilm"))
from server import WeightServer  # noqa: E402  (the MiniLM example's server)

FORMAT = 1  # bump when the weights or the files change, to rebuild the cache


@dataclasses.dataclass(frozen=True)
class Config:
    """The encoder's sizes (BERT-base) and the batch it runs on."""

    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ff: int = 3072
    vocab: int = 30522
    positions: int = 512
    batch: int = 2
    seq: int = 8


BERT_BASE = Config()


# -- the model -----------------------------------------------------------------------


def tensor_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, in file order (PyTorch layout: a
    ``Linear``'s weight is ``(out, in)``): 5 + 16 a layer + 5 tensors."""
    h, f = cfg.hidden, cfg.ff
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (cfg.vocab, h),
        "embeddings.position_embeddings.weight": (cfg.positions, h),
        "embeddings.token_type_embeddings.weight": (2, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (h, h)
            shapes[f"{p}attention.self.{name}.bias"] = (h,)
        shapes[f"{p}attention.output.dense.weight"] = (h, h)
        shapes[f"{p}attention.output.dense.bias"] = (h,)
        shapes[f"{p}attention.output.LayerNorm.weight"] = (h,)
        shapes[f"{p}attention.output.LayerNorm.bias"] = (h,)
        shapes[f"{p}intermediate.dense.weight"] = (f, h)
        shapes[f"{p}intermediate.dense.bias"] = (f,)
        shapes[f"{p}output.dense.weight"] = (h, f)
        shapes[f"{p}output.dense.bias"] = (h,)
        shapes[f"{p}output.LayerNorm.weight"] = (h,)
        shapes[f"{p}output.LayerNorm.bias"] = (h,)
    shapes["cls.predictions.transform.dense.weight"] = (h, h)
    shapes["cls.predictions.transform.dense.bias"] = (h,)
    shapes["cls.predictions.transform.LayerNorm.weight"] = (h,)
    shapes["cls.predictions.transform.LayerNorm.bias"] = (h,)
    shapes["cls.predictions.bias"] = (cfg.vocab,)
    return shapes


def make_weights(cfg: Config, seed: int = 0) -> dict[str, Any]:
    """The weights, fixed by ``seed``: normal(0, 0.02) matrices and biases,
    LayerNorm scales near 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        if name.endswith("LayerNorm.weight"):
            w += np.float32(1)
        out[name] = w
    return out


def make_inputs(cfg: Config):
    import numpy as np

    rng = np.random.default_rng(1)
    return rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq), dtype=np.int32)


def make_forward(cfg: Config):
    """A fresh encoder function (so no process shares a cache): embeddings,
    ``cfg.layers`` post-LayerNorm BERT layers, then the masked-LM head's
    logits at each sequence's first token, shape ``(batch, vocab)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    heads = cfg.heads

    def dense(p, name, x):
        return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    def layer_norm(p, name, x):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-12) * p[f"{name}.weight"] + p[f"{name}.bias"]

    def forward(p, ids):
        b, s = ids.shape
        x = (
            p["embeddings.word_embeddings.weight"][ids]
            + p["embeddings.position_embeddings.weight"][jnp.arange(s)][None]
            + p["embeddings.token_type_embeddings.weight"][0]
        )
        x = layer_norm(p, "embeddings.LayerNorm", x)
        hd = x.shape[-1] // heads
        for i in range(cfg.layers):
            pre = f"encoder.layer.{i}."

            def split(y):
                return y.reshape(b, s, heads, hd).transpose(0, 2, 1, 3)

            q, k, v = (
                split(dense(p, f"{pre}attention.self.{n}", x)) for n in ("query", "key", "value")
            )
            att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(hd)), axis=-1)
            ctx = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, -1)
            x = layer_norm(
                p,
                f"{pre}attention.output.LayerNorm",
                x + dense(p, f"{pre}attention.output.dense", ctx),
            )
            h = jax.nn.gelu(dense(p, f"{pre}intermediate.dense", x), approximate=False)
            x = layer_norm(p, f"{pre}output.LayerNorm", x + dense(p, f"{pre}output.dense", h))
        t = jax.nn.gelu(dense(p, "cls.predictions.transform.dense", x[:, 0]), approximate=False)
        t = layer_norm(p, "cls.predictions.transform.LayerNorm", t)
        return t @ p["embeddings.word_embeddings.weight"].T + p["cls.predictions.bias"]

    return forward


# -- the cache: the weights as a safetensors file and an orbax checkpoint ----------


@dataclasses.dataclass(frozen=True)
class Files:
    folder: Path

    @property
    def safetensors(self) -> Path:
        return self.folder / "model.safetensors"

    @property
    def orbax(self) -> Path:
        return self.folder / "orbax"

    @property
    def reference(self) -> Path:
        return self.folder / "reference.npy"

    @property
    def stamp(self) -> Path:
        return self.folder / "stamp.json"


def cache_files(cfg: Config) -> Files:
    return Files(CACHE / f"L{cfg.layers}-H{cfg.hidden}-V{cfg.vocab}")


def prepare(cfg: Config) -> Files:
    """Writes the weights once (a child process: this one does not import
    JAX): safetensors with the ``safetensors`` package, orbax with
    ``StandardCheckpointer``, and the reference output, computed by plain
    ``jax.jit`` on the arrays themselves."""
    files = cache_files(cfg)
    with_orbax = "orbax restore, then jit" not in missing_peers()
    want = {"format": FORMAT, "config": dataclasses.asdict(cfg), "orbax": with_orbax}
    if files.stamp.is_file() and json.loads(files.stamp.read_text()) == want:
        return files
    print(f"encoder.py: writing the weights to {files.folder} (once)", file=sys.stderr, flush=True)
    shutil.rmtree(files.folder, ignore_errors=True)
    files.folder.mkdir(parents=True)
    script = [sys.executable, __file__, "--layers", str(cfg.layers)]
    subprocess.run([*script, "--write"], check=True)
    files.stamp.write_text(json.dumps(want))
    return files


def _write(cfg: Config) -> None:
    import jax
    import numpy as np
    import safetensors.numpy

    files = cache_files(cfg)
    weights = make_weights(cfg)
    safetensors.numpy.save_file(weights, str(files.safetensors))
    arrays = jax.device_put(weights)
    if "orbax restore, then jit" not in missing_peers():
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(files.orbax, arrays)
        checkpointer.wait_until_finished()
    out = jax.jit(make_forward(cfg))(arrays, make_inputs(cfg))
    np.save(files.reference, np.asarray(out))


# -- the Python loaders' reads -------------------------------------------------------


class Reader:
    """Byte ranges of a local file (``os.preadv``) or a URL (an HTTP range
    request each, on one keep-alive connection a thread): the reads a
    hand-written loader does, for the ``async_map`` loader and the thread pool."""

    def __init__(self, source: str) -> None:
        import urllib.parse

        self.source = source
        self.remote = source.startswith("http://")
        self._local = threading.local()
        self._conns: list[Any] = []  # every thread's connection, for close()
        if self.remote:
            url = urllib.parse.urlsplit(source)
            self.host, self.port, self.path = url.hostname, url.port, url.path
        else:
            self.fd = os.open(source, os.O_RDONLY)

    def read_into(self, start: int, out: memoryview) -> None:
        """Fills ``out`` (a writable byte view) with the bytes from ``start``."""
        size = len(out)
        if not self.remote:
            done = 0
            while done < size:
                n = os.preadv(self.fd, [out[done:]], start + done)
                if n == 0:
                    raise OSError(f"{self.source}: ends before byte {start + size}")
                done += n
            return
        import http.client

        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            self._conns.append(conn)
        conn.request("GET", self.path, headers={"Range": f"bytes={start}-{start + size - 1}"})
        resp = conn.getresponse()
        if resp.status != 206:
            raise OSError(f"{self.source}: HTTP {resp.status} for bytes {start}-{start + size - 1}")
        done = 0
        while done < size:
            n = resp.readinto(out[done:])
            if not n:
                raise OSError(f"{self.source}: the body ended at {done} of {size} bytes")
            done += n
        resp.read()  # the (empty) rest, so the connection is free for the next request

    def close(self) -> None:
        """Closes the file or every thread's connection."""
        if self.remote:
            for conn in self._conns:
                conn.close()
        else:
            os.close(self.fd)

    def header(self) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
        """name -> (safetensors dtype, shape, first byte, end byte) from the file's start."""
        import struct

        head = bytearray(8)
        self.read_into(0, memoryview(head))
        (n,) = struct.unpack("<Q", head)
        raw = bytearray(n)
        self.read_into(8, memoryview(raw))
        entries = json.loads(raw)
        return {
            name: (
                e["dtype"],
                tuple(e["shape"]),
                8 + n + e["data_offsets"][0],
                8 + n + e["data_offsets"][1],
            )
            for name, e in entries.items()
            if name != "__metadata__"
        }


def _byte_view(array) -> memoryview:
    return memoryview(array.reshape(-1).view("uint8"))


# -- the contenders (each runs in a child process) -----------------------------------


class Run:
    """One contender's run in this process: the source, the specs, the clock
    and the marks, and the host addresses each leaf was read into."""

    def __init__(self, cfg: Config, files: Files, source: str) -> None:
        import jax
        import numpy as np

        self.cfg, self.files, self.source = cfg, files, source
        self.forward = make_forward(cfg)
        self.ids = make_inputs(cfg)
        self.specs = {
            name: jax.ShapeDtypeStruct(shape, np.float32)
            for name, shape in tensor_shapes(cfg).items()
        }
        self.read_at: dict[str, int] = {}  # tensor -> the host address it was read into
        self.marks: dict[str, float] = {}
        self.compiles: list[tuple[float, float]] = []  # (duration, end) of each XLA compile
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self.t0 = 0.0

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles.append((duration, time.perf_counter()))

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.cpu0 = _cpu()

    def mark(self, name: str, at: float | None = None) -> None:
        self.marks[name] = (time.perf_counter() if at is None else at) - self.t0

    def aot(self):
        import jax

        return jax.jit(self.forward).trace(self.specs, self.ids).lower().compile()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ready_clock(tree) -> Any:
    """A function that waits for every ``AsyncArray`` leaf of ``tree`` and
    returns the last one's ``time.perf_counter()`` (done-callbacks)."""
    import jax

    leaves = jax.tree.leaves(tree)
    times: list[float] = []
    lock, done = threading.Lock(), threading.Event()

    def record(_):
        with lock:
            times.append(time.perf_counter())
            if len(times) == len(leaves):
                done.set()

    for leaf in leaves:
        leaf.add_done_callback(record)

    def last() -> float:
        done.wait()
        return max(times)

    return last


def _recording_safetensors(run: Run) -> None:
    """Notes the HostBuffer each ``aa.load_safetensors`` tensor was read into
    (its ``address``), to count the leaves JAX took without a copy."""
    from async_array import _safetensors

    convert = _safetensors._read.convert_one

    def recording(specs, i, value):
        address = getattr(value, "address", None)
        if address is not None:
            run.read_at[f"leaf {i}"] = address
        return convert(specs, i, value)

    _safetensors._read.convert_one = recording


def _load_safetensors_then(run: Run, jit_name: str):
    """aa.load_safetensors, then the forward pass through ``jax.jit`` or
    ``aa.jit`` (``jit_name``), compiled while the tensors load."""
    import jax

    import async_array as aa

    jit = {"jax.jit": jax.jit, "aa.jit": aa.jit}[jit_name]
    _recording_safetensors(run)
    run.start()
    params = aa.load_safetensors(run.source)
    loaded = _ready_clock(params)
    out = jit(run.forward)(params, run.ids)
    host = out.block_until_ready()
    run.mark("load", loaded())
    return params, host


def c_aa_jax_jit(run: Run):
    return _load_safetensors_then(run, "jax.jit")


def c_aa_aa_jit(run: Run):
    return _load_safetensors_then(run, "aa.jit")


def python_loader(run: Run):
    """The previous way: the header read in Python, then ``aa.async_map``
    with one read a tensor into an ``aa.empty`` buffer, returned to JAX."""
    import async_array as aa

    reader = Reader(run.source)
    header = reader.header()

    def fetch(path, spec):
        name = path[0].key
        buf = aa.empty(spec.shape, spec.dtype)
        view = np_view(buf)
        reader.read_into(header[name][2], _byte_view(view))
        del view
        run.read_at[name] = buf.address
        return buf

    return aa.async_map(fetch, run.specs)


def np_view(buf):
    import numpy as np

    return np.asarray(buf)


def c_map_jax_jit(run: Run):
    import jax

    run.start()
    params = python_loader(run)
    loaded = _ready_clock(params)
    host = jax.jit(run.forward)(params, run.ids).block_until_ready()
    run.mark("load", loaded())
    return params, host


def c_thread_pool(run: Run):
    import concurrent.futures

    import jax
    import numpy as np

    run.start()
    workers = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        compiling = ex.submit(run.aot)  # first, so no read waits ahead of it
        reader = Reader(run.source)
        header = reader.header()

        def fetch(name):
            spec = run.specs[name]
            a = np.empty(spec.shape, spec.dtype)
            reader.read_into(header[name][2], _byte_view(a))
            run.read_at[name] = a.ctypes.data
            return name, jax.device_put(a)

        reads = [ex.submit(fetch, name) for name in run.specs]
        params = dict(f.result() for f in reads)
        run.mark("load")
        compiled = compiling.result()
        host = compiled(params, run.ids).block_until_ready()
    return params, host


def c_orbax(run: Run):
    import jax
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device) for k, s in run.specs.items()
    }
    checkpointer = ocp.StandardCheckpointer()
    run.start()
    params = checkpointer.restore(run.files.orbax, abstract)
    run.mark("load")
    host = jax.jit(run.forward)(params, run.ids).block_until_ready()
    return params, host


def c_tensorstore(run: Run):
    import jax
    import tensorstore as ts

    base = run.files.orbax.as_uri() + "/"
    run.start()
    context = ts.Context()
    opening = {
        name: ts.open(
            {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": base, "path": f"{name}/"}},
            context=context,
            open=True,
        )
        for name in run.specs
    }
    reading = {name: f.result().read() for name, f in opening.items()}  # all in flight
    compiled = run.aot()  # meanwhile, on this thread
    arrays = {name: f.result() for name, f in reading.items()}
    for name, a in arrays.items():
        run.read_at[name] = a.ctypes.data
    params = jax.device_put(arrays)
    run.mark("load")
    host = compiled(params, run.ids).block_until_ready()
    return params, host


def c_sequential(run: Run):
    import jax

    run.start()
    if run.source.startswith("http://"):
        import urllib.request

        import safetensors.numpy

        with urllib.request.urlopen(run.source, timeout=60) as resp:
            arrays = safetensors.numpy.load(resp.read())
        params = {}
        for name, a in arrays.items():
            run.read_at[name] = a.ctypes.data
            params[name] = jax.device_put(a)
    else:
        from safetensors import safe_open

        params = {}
        with safe_open(run.source, framework="numpy") as f:
            for name in f.keys():
                a = f.get_tensor(name)
                run.read_at[name] = a.ctypes.data
                params[name] = jax.device_put(a)
    jax.block_until_ready(params)
    run.mark("load")
    compiled = jax.jit(run.forward).trace(params, run.ids).lower().compile()
    run.mark("compile")
    host = compiled(params, run.ids).block_until_ready()
    run.marks["run"] = time.perf_counter() - run.t0 - run.marks["compile"]
    return params, host


def c_load_alone(run: Run):
    import async_array as aa

    _recording_safetensors(run)
    run.start()
    params = aa.materialize(aa.load_safetensors(run.source))
    run.mark("load")
    return params, None


def c_map_load_alone(run: Run):
    import async_array as aa

    run.start()
    params = aa.materialize(python_loader(run))
    run.mark("load")
    return params, None


def c_compile_alone(run: Run):
    run.start()
    run.aot()
    run.mark("compile")
    return None, None


CONTENDERS = {
    "aa.load_safetensors + jax.jit": c_aa_jax_jit,
    "aa.load_safetensors + aa.jit": c_aa_aa_jit,
    "aa.async_map loader + jax.jit": c_map_jax_jit,
    "ThreadPoolExecutor + AOT": c_thread_pool,
    "orbax restore, then jit": c_orbax,
    "TensorStore reads + AOT": c_tensorstore,
    "sequential safetensors": c_sequential,
    "load alone: aa.load_safetensors": c_load_alone,
    "load alone: async_map loader": c_map_load_alone,
    "compile alone": c_compile_alone,
}
FILE_ONLY = {"orbax restore, then jit", "TensorStore reads + AOT"}
# Peers that `make bench` installs (the bench-peers extra); a contender whose
# peer is missing is left out and named in the table.
PEERS = {"orbax restore, then jit": "orbax", "TensorStore reads + AOT": "tensorstore"}


def missing_peers() -> dict[str, str]:
    """Contender -> the package it needs and this Python lacks."""
    import importlib.util

    return {name: mod for name, mod in PEERS.items() if importlib.util.find_spec(mod) is None}


def child(name: str, cfg: Config, files: Files, source: str) -> dict[str, Any]:
    """Runs one contender in this (fresh) process; returns its figures."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import async_array as aa

    jax.jit(jnp.sin)(1.0).block_until_ready()  # JAX's start-up, paid by no contender
    aa.materialize(aa.async_wrap(lambda: np.zeros(1, np.float32), shape=(1,), dtype=np.float32))
    run = Run(cfg, files, source)
    rss_start = _rss_now()
    params, host = CONTENDERS[name](run)
    wall = time.perf_counter() - run.t0
    cpu = _cpu() - run.cpu0
    if run.compiles and "compile" not in run.marks:
        run.mark("compile", max(run.compiles)[1])  # the encoder's: the longest compile
    out: dict[str, Any] = {"wall": wall, "cpu": cpu, "marks": run.marks}
    if host is not None:
        ref = np.load(files.reference)
        got = np.asarray(host)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=f"{name} from {source}")
        out["max_diff"] = float(np.abs(got - ref).max())
    if params is not None:
        arrays = aa.materialize(params)
        read_at = set(run.read_at.values())
        out["leaves"] = len(arrays)
        out["zero_copy"] = (
            sum(a.unsafe_buffer_pointer() in read_at for a in arrays.values())
            if run.read_at
            else None
        )
    out["peak_rss"] = peak_rss()
    out["rss_start"] = rss_start
    return out


def peak_rss() -> int:
    """Peak RSS in bytes: VmHWM, which starts afresh at exec (ru_maxrss
    would carry the forking driver's peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- 10,000 small tensors ---------------------------------------------------------------

SMALL_TENSORS = 10_000
SMALL_SHAPE = (256,)  # float32: 1 KiB a tensor


def small_file() -> Path:
    """A safetensors file of 10,000 (256,) float32 tensors (10 MB), written once."""
    path = CACHE / f"small-{SMALL_TENSORS}x{SMALL_SHAPE[0]}-v{FORMAT}.safetensors"
    if not path.is_file():
        import numpy as np
        import safetensors.numpy

        path.parent.mkdir(parents=True, exist_ok=True)
        base = np.arange(SMALL_SHAPE[0], dtype=np.float32)
        tensors = {f"t.{i:05d}": base + np.float32(i) for i in range(SMALL_TENSORS)}
        safetensors.numpy.save_file(tensors, str(path) + ".tmp")
        os.replace(str(path) + ".tmp", path)
    return path


def small_child(rounds: int) -> dict[str, list[float]]:
    """In this (fresh) process: seconds to turn every tensor of the small file
    into a ready ``jax.Array``, each way in turn, round after round."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from safetensors import safe_open

    import async_array as aa

    path = str(small_file())
    jax.jit(jnp.sin)(1.0).block_until_ready()

    def with_aa():
        return aa.materialize(aa.load_safetensors(path))

    def with_safe_open():
        with safe_open(path, framework="numpy") as f:
            return {name: jax.device_put(f.get_tensor(name)) for name in f.keys()}

    def with_map():
        run = Run.__new__(Run)  # only what python_loader needs: the source, specs, addresses
        run.source, run.read_at = path, {}
        spec = jax.ShapeDtypeStruct(SMALL_SHAPE, np.float32)
        run.specs = {f"t.{i:05d}": spec for i in range(SMALL_TENSORS)}
        return aa.materialize(python_loader(run))

    ways = {
        "aa.load_safetensors": with_aa,
        "aa.async_map loader": with_map,
        "safe_open + jax.device_put": with_safe_open,
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    for way, fn in ways.items():  # a warm-up round each: threads, caches
        out = jax.block_until_ready(fn())
        assert len(out) == SMALL_TENSORS, way
        np.testing.assert_array_equal(out["t.09999"], np.arange(256, dtype=np.float32) + 9999)
    for _ in range(rounds):
        for way, fn in ways.items():
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn())
            times[way].append(time.perf_counter() - t0)
            assert len(out) == SMALL_TENSORS, way
            del out
    return times


# -- the driver: rounds, the server, medians, the table -----------------------------


def run_child(name: str, cfg: Config, files: Files, source: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--layers", str(cfg.layers), "--child", name, source]
    load_avg = os.getloadavg()[0]  # the machine's load as it starts (others' jobs)
    cpu0 = _cpu()  # this process's CPU while the child runs: the server's
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    server_cpu = _cpu() - cpu0
    if proc.returncode:
        raise RuntimeError(f"encoder.py: {name} from {source} failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    result["server_cpu"] = server_cpu
    result["load_avg"] = load_avg
    return result


def measure(
    cfg: Config,
    rounds: int,
    bandwidth: float,
    latency: float,
    only: list[str] | None = None,
    only_source: str | None = None,
) -> dict[str, Any]:
    files = prepare(cfg)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {"file": {}, "http": {}}
    missing = missing_peers()
    names = [n for n in CONTENDERS if n not in missing and (not only or any(o in n for o in only))]
    with WeightServer(files.safetensors, bandwidth=bandwidth, latency=latency) as server:
        sources = {"file": str(files.safetensors), "http": server.url}
        if only_source:
            sources = {only_source: sources[only_source]}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: noise hits all
            for src, source in sources.items():
                for name in order:
                    if src == "http" and name in FILE_ONLY:
                        continue
                    res = run_child(name, cfg, files, source)
                    results[src].setdefault(name, []).append(res)
                    print(
                        f"  round {r + 1}/{rounds} {src:4} {name:34} wall {res['wall']:.3f} s, "
                        f"cpu {res['cpu']:.2f} s, server cpu {res['server_cpu']:.2f} s, "
                        f"load average {res['load_avg']:.1f}",
                        file=sys.stderr,
                        flush=True,
                    )
    return {
        "config": dataclasses.asdict(cfg),
        "tensors": len(tensor_shapes(cfg)),
        "bytes": os.path.getsize(files.safetensors),
        "rounds": rounds,
        "bandwidth": bandwidth,
        "latency": latency,
        "results": results,
        "missing": missing,
    }


def measure_small(rounds: int) -> dict[str, Any]:
    """The 10,000-tensor file, every way in one fresh process, back to back."""
    small_file()
    cmd = [sys.executable, __file__, "--small-child", str(rounds)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"encoder.py: the small-tensor run failed:\n{proc.stderr[-4000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    times = json.loads(line[len("RESULT ") :])
    return {
        "tensors": SMALL_TENSORS,
        "shape": list(SMALL_SHAPE),
        "rounds": rounds,
        "times": times,
        "per_tensor": {way: median(t) / SMALL_TENSORS for way, t in times.items()},
    }


def render_small(small: dict[str, Any]) -> str:
    per = small["per_tensor"]
    twin = per["safe_open + jax.device_put"]
    lines = [
        f"{small['tensors']:,} tensors of {tuple(small['shape'])} float32 in one file (page cache "
        f"warm), to every jax.Array ready: medians of {small['rounds']} rounds in one process",
    ]
    for way, t in per.items():
        lines.append(f"  {way:28} {t * 1e6:8.2f} µs a tensor   {t / twin:.3f}x safe_open")
    return "\n".join(lines)


def summarize(data: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Medians per source and contender, and each one's wall / limit, where
    limit = max(load alone, compile alone) + run, from that source's runs."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    # The run phase does not depend on the source: the sequential runs of both.
    runs = [
        r["marks"]["run"]
        for by_name in data["results"].values()
        for r in by_name.get("sequential safetensors", [])
    ]
    run = median(runs) if runs else None
    for src, by_name in data["results"].items():
        if not by_name:
            continue
        rows: dict[str, dict[str, Any]] = {}
        for name, runs in by_name.items():
            row: dict[str, Any] = {
                k: median(r[k] for r in runs)
                for k in ("wall", "cpu", "peak_rss", "rss_start", "server_cpu")
            }
            for mark in ("load", "compile", "run"):
                got = [r["marks"][mark] for r in runs if mark in r["marks"]]
                row[mark] = median(got) if got else None
            copies = [r.get("zero_copy") for r in runs]
            row["zero_copy"] = None if None in copies else min(copies)
            row["leaves"] = runs[0].get("leaves")
            row["runs"] = len(runs)
            rows[name] = row
        load = rows.get("load alone: aa.load_safetensors", {}).get("load")
        compile_ = rows.get("compile alone", {}).get("compile")
        limit = max(load, compile_) + run if None not in (load, compile_, run) else None
        # What two cores allow at best when load and compile overlap: their CPU
        # seconds (and the server's) shared by the cores, then the run.
        alone = rows.get("load alone: aa.load_safetensors", {})
        cpu_parts = (
            alone.get("cpu"),
            alone.get("server_cpu"),
            rows.get("compile alone", {}).get("cpu"),
        )
        cores = os.cpu_count() or 1
        cpu_bound = sum(cpu_parts) / cores + run if None not in (*cpu_parts, run) else None
        for row in rows.values():
            row["limit"] = limit
            row["limit_parts"] = (load, compile_, run)
            row["cpu_parts"] = cpu_parts
            row["cpu_bound"] = cpu_bound
            bound = max(limit or 0, cpu_bound or 0)
            row["wall_over_bound"] = row["wall"] / bound if bound else None
            row["wall_over_limit"] = row["wall"] / limit if limit else None
        out[src] = rows
    return out


def render(data: dict[str, Any], summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    mb = data["bytes"] / 1e6
    lines = [
        f"Encoder: {data['tensors']} float32 tensors, {mb:.0f} MB; file (page cache warm) and HTTP "
        f"on 127.0.0.1 at {data['bandwidth']:g} MB/s, {data['latency']:g} ms a request; "
        f"medians of {data['rounds']} round(s), a fresh process each",
    ]
    loads = [
        r["load_avg"]
        for by_name in data["results"].values()
        for runs in by_name.values()
        for r in runs
        if "load_avg" in r
    ]
    if loads:
        lines.append(
            f"load average (1 min) as each process started: median {median(loads):.1f}, "
            f"{min(loads):.1f} to {max(loads):.1f} (2 cores; other jobs shared the machine)"
        )
    head = (
        "source",
        "contender",
        "wall",
        "/limit",
        "load at",
        "compiled at",
        "CPU s",
        "server CPU",
        "peak RSS",
        "no copy",
    )
    table = [head]
    for src, rows in summary.items():
        limit = next(iter(rows.values()))["limit"]
        for name, r in rows.items():
            f = lambda v, spec="{:.3f}": "" if v is None else spec.format(v)  # noqa: E731
            table.append(
                (
                    src,
                    name,
                    f(r["wall"]),
                    f(r["wall_over_limit"], "{:.2f}")
                    if not name.startswith(("load alone", "compile alone"))
                    else "",
                    f(r["load"]),
                    f(r["compile"]),
                    f(r["cpu"], "{:.2f}"),
                    f(r["server_cpu"], "{:.2f}") if src == "http" else "",
                    f"{r['peak_rss'] / 2**20:.0f} MiB",
                    ""
                    if r["leaves"] is None
                    else ("n/a" if r["zero_copy"] is None else f"{r['zero_copy']}/{r['leaves']}"),
                )
            )
        if limit:
            load, compile_, run = next(iter(rows.values()))["limit_parts"]
            what = (
                f"limit: max(load alone {load:.3f}, compile alone {compile_:.3f}) + run {run:.3f}"
            )
            table.append((src, what, f"{limit:.3f}", *[""] * 7))
            first = next(iter(rows.values()))
            if first["cpu_bound"]:
                (cl, cs, cc), cores = first["cpu_parts"], os.cpu_count()
                what = (
                    f"CPU bound: (load {cl:.2f} + server {cs:.2f} + compile {cc:.2f} CPU s) "
                    f"/ {cores} cores + run {run:.3f}"
                )
                table.append((src, what, f"{first['cpu_bound']:.3f}", *[""] * 7))
    for name, mod in data.get("missing", {}).items():
        table.append(("", f"{name}: not measured ({mod} not installed)", *[""] * 8))
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for i, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="more rounds (5; default 2)")
    parser.add_argument("--rounds", type=int, help="rounds (overrides --full)")
    parser.add_argument("--bandwidth", type=float, default=200.0, help="MB/s (default 200)")
    parser.add_argument("--latency", type=float, default=20.0, help="ms a request (default 20)")
    parser.add_argument("--layers", type=int, default=BERT_BASE.layers, help="encoder layers (12)")
    parser.add_argument("--only", action="append", help="contenders whose name contains this")
    parser.add_argument("--source", choices=["file", "http"], help="only this source")
    parser.add_argument("--json", type=Path, help="write the runs and medians here")
    parser.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--small-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=2, metavar=("CONTENDER", "SOURCE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(BERT_BASE, layers=args.layers)
    if args.write:  # prepare()'s child
        _write(cfg)
        return 0
    if args.small_child:  # measure_small()'s child
        print("RESULT", json.dumps(small_child(args.small_child)))
        return 0
    if args.child:  # run_child()'s child: one contender, its figures as JSON
        name, source = args.child
        print("RESULT", json.dumps(child(name, cfg, cache_files(cfg), source)))
        return 0
    rounds = args.rounds or (5 if args.full else 2)
    data = measure(cfg, rounds, args.bandwidth, args.latency, args.only, args.source)
    summary = summarize(data)
    data["summary"] = summary
    data["small"] = measure_small(5 if args.full else 3)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1))
    print(render(data, summary))
    print()
    print(render_small(data["small"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
