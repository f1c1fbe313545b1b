"""Every benchmark in one command, one table: ``make bench``.

Runs the Rust core benches (divan, ``rust/core/benches/core.rs``) and the pytest-benchmark
suites (``benches/test_*.py``), a short version unless ``--full``, then prints
one table: each figure, its twin (what a user would do without async_array,
measured in the same process), the ratio and the target. Raw output (divan's
table, pytest's log and JSON, this table) goes to ``.bench/``.

Run: python benches/run_all.py [--full]   (or make bench, which installs the peers)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".bench"


def machine() -> list[str]:
    cpu = platform.processor() or "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return [
        f"machine: {os.cpu_count()} cores, {cpu}, {ram:.1f} GiB RAM, {platform.system()}",
        f"software: Python {platform.python_version()}, JAX {version('jax')}, jaxlib "
        f"{version('jaxlib')}, numpy {version('numpy')}, async_array {version('async_array')} "
        f"(git {commit or '?'})",
    ]


# -- running -------------------------------------------------------------------


def run_logged(cmd: list[str], log: Path, what: str) -> int:
    print(f"running {what} (log: {log.relative_to(ROOT)}) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"  {what}: {time.monotonic() - t0:.0f} s, exit {rc}", file=sys.stderr, flush=True)
    if rc:
        print(log.read_text()[-3000:], file=sys.stderr)
    return rc


_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_ROW = re.compile(r"^(?P<indent>(?:[│ ]  )*)[├╰]─ (?P<name>\S+)(?P<rest>.*)$")


def parse_divan(text: str) -> dict[str, float]:
    """Median seconds by path (``group/bench/arg``) from divan's tree table."""
    medians: dict[str, float] = {}
    path: list[str] = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        del path[len(m["indent"]) // 3 :]
        path.append(m["name"])
        cells = [c.strip() for c in m["rest"].split("│")]
        if cells[0]:  # a leaf: fastest │ slowest │ median │ mean │ samples │ iters
            value, unit = cells[2].split()
            medians["/".join(path)] = float(value) * _UNITS[unit]
    return medians


# -- the table -----------------------------------------------------------------


def fmt_time(s: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if s >= scale or unit == "ns":
            return f"{s / scale:.3g} {unit}"
    raise AssertionError


def fmt_bytes(b: float) -> str:
    return f"{b:.0f} B"


class Table:
    """Rows of: figure, async_array, twin, twin is, ratio, target, met."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, ...]] = []

    def add(self, figure, ours, twin=None, twin_is="", fmt=fmt_time, target="", met=None):
        ratio = f"{ours / twin:.3g}" if twin else ""
        self.rows.append(
            (
                figure,
                fmt(ours) if ours is not None else "n/a",
                fmt(twin) if twin is not None else "",
                twin_is,
                ratio,
                target,
                "" if met is None else ("yes" if met else "NO"),
            )
        )

    def section(self, title: str) -> None:
        self.rows.append((title, "", "", "", "", "", ""))

    def render(self) -> str:
        head = ("figure", "async_array", "twin", "twin is", "ratio", "target", "met")
        rows = [head, *(r for r in self.rows if any(r[1:]))]  # section titles run long
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
        out = [line(head), "  ".join("-" * w for w in widths)]
        for r in self.rows:
            out.append(line(r) if any(r[1:]) else r[0])
        return "\n".join(out)


def rust_rows(t: Table, core: dict[str, float]) -> None:
    t.section("Rust core (divan medians)")
    get = core.get
    ours = get("future_create_complete_wait/async_array")
    t.add(
        "future: create + complete + wait",
        ours,
        get("future_create_complete_wait/std_mpsc"),
        "std one-shot mpsc channel",
        target="< 1 µs",
        met=ours is not None and ours < 1e-6,
    )
    t.add(
        "wake-up round trip across threads (2 wake-ups)",
        get("wake_up_round_trip/async_array"),
        get("wake_up_round_trip/std_mpsc"),
        "std mpsc ping-pong",
    )
    for case, what in (
        ("finished", "all finished"),
        ("completed_meanwhile", "completed meanwhile"),
    ):
        total = get(f"wait_all_100k/{case}")
        t.add(f"wait_all over 100k futures, {what}, per future", total and total / 1e5)
    for w in (1, 2, 4, 8):
        for mode in ("one_by_one", "batch"):
            total = get(f"pool_submit_to_done_10k/{mode}/{w}")
            label = "submit" if mode == "one_by_one" else "submit_all"
            t.add(f"pool submit→done per job, {w} worker(s), {label}", total and total / 1e4)


def python_rows(t: Table, benches: list[dict]) -> None:
    by = {(b["group"], b["params"]["way"]): b for b in benches}

    def med(group: str, way: str, key: str | None = None) -> float | None:
        b = by.get((group, way))
        if b is None:
            return None
        return b["stats"]["median"] if key is None else median(b["extra_info"][key])

    tpe = "ThreadPoolExecutor + device_put"
    t.section("Per leaf (pytest-benchmark medians)")
    g = "single leaf (16,) float32"
    ours, twin = med(g, "async_array"), med(g, tpe)
    t.add("one leaf → jax.Array", ours, twin, tpe, target="< 1", met=_lt(ours, twin, 1))

    labels = [
        lb
        for lb in ("1k", "10k", "100k", "1M")
        if (f"{lb} leaves, one function", "async_array") in by
    ]
    for lb in labels:
        g = f"{lb} leaves, one function"
        n = by[(g, "async_array")]["extra_info"]["leaves"]
        ours = med(g, "async_array")
        jax_ways = {w: med(g, w) for w in ("jax.device_put(list)", "make_array_from_callback")}
        floor_way = min((w for w in jax_ways if jax_ways[w]), key=jax_ways.get, default=None)
        floor = jax_ways.get(floor_way) if floor_way else None
        t.add(
            f"{lb} leaves: async_wrap(like=) → materialize, per leaf",
            ours and ours / n,
            floor and floor / n,
            f"JAX floor: {floor_way}",
            target="≤ 0.5",
            met=_lt(ours, floor, 0.5),
        )
        for w, v in jax_ways.items():
            if w != floor_way:
                t.add("  the other JAX way", ours and ours / n, v and v / n, w)
        g = f"{lb} leaves, one task each"
        ours, twin = med(g, "async_array"), med(g, tpe)
        t.add(
            f"{lb} leaves: async_map → materialize, per leaf",
            ours and ours / n,
            twin and twin / n,
            tpe + " per leaf",
            target="≤ 0.2 (5x faster)",
            met=_lt(ours, twin, 0.2),
        )
    rss_rows(t, by, labels)

    g = "memory per pending leaf, 100k pending"
    twin = med(g, tpe, "bytes_per_leaf")
    for way in ("async_wrap", "async_map"):
        ours = med(g, f"async_array: {way}", "bytes_per_leaf")
        t.add(
            f"RSS per pending leaf, {way}, 100k pending",
            ours,
            twin,
            "pending executor task",
            fmt=fmt_bytes,
            target="< 1024 B",
            met=ours is not None and ours < 1024,
        )

    t.section("Zero-copy hand-off of 64 aa.empty leaves (pytest-benchmark medians)")
    per_leaf = {}
    for size in ("64 MiB", "1 GiB"):
        g = f"zero-copy {size} in 64 leaves"
        ours, twin = med(g, "async_array"), med(g, "jnp.asarray")
        per_leaf[size] = (ours, twin)
        t.add(
            f"{size}: time per leaf",
            ours and ours / 64,
            twin and twin / 64,
            "jnp.asarray of unaligned numpy",
        )
        b, j = by.get((g, "async_array")), by.get((g, "jnp.asarray"))
        if b and j:
            shared = b["extra_info"]["leaves_sharing_memory"]
            t.add(
                f"{size}: leaves whose jax.Array uses the buffer's memory",
                shared,
                j["extra_info"]["leaves_sharing_memory"],
                "jnp.asarray",
                fmt=lambda n: f"{n}/64",
                target="64/64",
                met=shared == 64,
            )
    g = "first-touch fill of 512 MiB"
    ours, twin = med(g, "async_array"), med(g, "np.empty")
    huge = by.get((g, "async_array"), {}).get("extra_info", {}).get("huge_pages", True)
    # Without huge pages (a VM whose balloon reports free pages: there they
    # made a fresh process's loads slower) this in-process refill is not comparable.
    t.add(
        "aa.empty: allocate and fill 512 MiB, in one process"
        + (" (huge pages)" if huge else " (no huge pages: VM reports free pages)"),
        ours,
        twin,
        "np.empty",
        target="≤ 1.1" if huge else "n/a here",
        met=_lt(ours, twin, 1.1) if huge else None,
    )
    (small, small_twin), (big, big_twin) = per_leaf["64 MiB"], per_leaf["1 GiB"]
    if small and big and small_twin and big_twin:
        growth = big / small
        t.add(
            "per-leaf time, 1 GiB / 64 MiB (16x the bytes)",
            growth,
            big_twin / small_twin,
            "jnp.asarray",
            fmt=lambda r: f"{r:.2f}x",
            target="≈ 1x (< 2x)",
            met=growth < 2,
        )

    t.section("Streaming consumer of a 512 MiB model, max_bytes_in_flight 64 MiB (fresh processes)")
    g = "streaming consumer of 512 MiB, max_bytes_in_flight 64 MiB"
    ours_peak = med(g, "async_array: load_safetensors + as_completed", "peak_growth_bytes")
    twin_peak = med(g, "one tensor at a time + device_put", "peak_growth_bytes")
    bound = by.get((g, "one tensor at a time + device_put"), {}).get("extra_info", {})
    bound = bound.get("bound_bytes")
    t.add(
        "peak RSS growth, each leaf dropped as as_completed yields it",
        ours_peak,
        twin_peak,
        "one tensor at a time into device_put",
        fmt=lambda b: f"{b / 2**20:.0f} MiB",
        target=f"≤ {bound / 2**20:.0f} MiB (1.2 x budget + a tensor)" if bound else "",
        met=None if ours_peak is None or bound is None else ours_peak <= bound,
    )

    t.section("Dtype conversion while reading, 256 MiB from the page cache (medians)")
    g = "load 256 MiB of float32 as bfloat16"
    conv = med(g, "converted")
    plain, astype = med(g, "unconverted"), med(g, "load then astype")
    t.add(
        "load_safetensors(dtype=bfloat16) of a float32 file",
        conv,
        plain,
        "the same load, unconverted",
        target="≤ 1.1",
        met=_lt(conv, plain, 1.1),
    )
    t.add(
        "the same, against converting after the load",
        conv,
        astype,
        "load, then x.astype(bfloat16)",
        target="< 1",
        met=_lt(conv, astype, 1),
    )

    for g, title in (
        ("scenario: load 2 s + compile 1 s + run", "Scenario: load (sleep 2 s) + compile + run"),
        ("scenario: load 2 s + 3-stage pipeline", "Scenario: load (sleep 2 s) + 3-stage pipeline"),
        ("MiniLM: 90 MB at 100 MB/s, 20 ms latency", "MiniLM: 90 MB at 100 MB/s, 20 ms a request"),
    ):
        overlap_rows(t, g, title, med)

    g = "program order: second of two calls, first input loads 1 s"
    t.section("Program order: the second of two aa.jit calls, the first's input loads 1 s")
    ordered = med(g, "aa.jit, donating (program order)")
    t.add(
        "aa.jit, donating (waits for the first call's launch)",
        ordered,
        med(g, "jax.jit (the caller waits at each dispatch)"),
        "jax.jit",
        target="≈ 1 (order costs what jax.jit costs)",
        met=_lt(ordered, med(g, "jax.jit (the caller waits at each dispatch)"), 1.1),
    )
    t.add(
        "aa.jit, not donating (no order needed)",
        med(g, "aa.jit, not donating (no order needed)"),
        med(g, "jax.jit (the caller waits at each dispatch)"),
        "jax.jit",
    )


def rss_rows(t: Table, by: dict, labels: list[str]) -> None:
    """Resident memory per ready leaf (fresh processes), and how time and
    memory per leaf grow from 10k leaves to the most measured."""

    def extra(group: str, way: str, key: str) -> float | None:
        b = by.get((group, way))
        return median(b["extra_info"][key]) if b and key in b["extra_info"] else None

    tpe = "ThreadPoolExecutor + device_put"
    for lb in labels:
        g = f"RSS per ready leaf, {lb} leaves"
        floor = min(
            (
                v
                for w in ("jax.device_put(list)", "make_array_from_callback")
                if (v := extra(g, w, "rss_per_leaf"))
            ),
            default=None,
        )
        ours = extra(g, "async_wrap", "rss_per_leaf")
        t.add(
            f"{lb} leaves: RSS per ready leaf, async_wrap",
            ours,
            floor,
            "JAX's ways (the less)",
            fmt=fmt_bytes,
        )
        ours = extra(g, "async_map", "rss_per_leaf")
        t.add(
            f"{lb} leaves: RSS per ready leaf, async_map",
            ours,
            extra(g, tpe, "rss_per_leaf"),
            tpe,
            fmt=fmt_bytes,
        )
    if "10k" not in labels or labels[-1] == "10k":
        return
    big = labels[-1]
    for way, group_kind in (("async_wrap", "one function"), ("async_map", "one task each")):
        small_t = by.get((f"10k leaves, {group_kind}", "async_array"))
        big_t = by.get((f"{big} leaves, {group_kind}", "async_array"))
        if small_t and big_t:
            _growth_row(
                t,
                f"{way}: time per leaf, {big} / 10k",
                small_t["stats"]["median"] / small_t["extra_info"]["leaves"],
                big_t["stats"]["median"] / big_t["extra_info"]["leaves"],
            )
        small_m = extra("RSS per ready leaf, 10k leaves", way, "rss_per_leaf")
        big_m = extra(f"RSS per ready leaf, {big} leaves", way, "rss_per_leaf")
        if small_m and big_m:
            _growth_row(t, f"{way}: RSS per leaf, {big} / 10k", small_m, big_m)


def _growth_row(t: Table, figure: str, small: float, big: float) -> None:
    """How much a per-leaf figure grew from 10k leaves to the most (target ≤ 1.5x)."""
    growth = big / small
    t.add(figure, growth, fmt=lambda r: f"{r:.2f}x", target="≤ 1.5x", met=growth <= 1.5)


def overlap_rows(t: Table, g: str, title: str, med) -> None:
    minilm = g.startswith("MiniLM")
    seq = med(g, "sequential")
    if seq is None:
        return
    load, compile_, run = (med(g, "sequential", k) for k in ("load_s", "compile_s", "run_s"))
    ideal = max(load, compile_) + run
    t.section(
        f"{title} (sequential phases: load {load:.2f} s, compile {compile_:.2f} s, "
        f"run {run:.3f} s; pytest-benchmark medians)"
    )
    for way in ("async_array",) if minilm else ("async_wrap + aa.jit", "async_wrap + jax.jit"):
        ours = med(g, way)
        if ours is None:
            continue
        target = way != "async_wrap + jax.jit" or "pipeline" not in g
        t.add(f"{way}: wall", ours, seq, "sequential: load, then compile, then run")
        t.add(
            f"{way}: wall vs perfect overlap",
            ours,
            ideal,
            "max(load, compile) + run",
            target="≤ 1.05" if target else "",
            met=_lt(ours, ideal, 1.05) if target else None,
        )
        t.add(
            f"{way}: overlap efficiency",
            (seq - ours) / min(load, compile_),
            fmt=lambda e: f"{e:.2f}",
            target="1.0 is the limit",
        )
    if minilm:
        # embed.py's own figure: load and compile as they ran, overlapped and sharing the CPUs.
        ours = med(g, "async_array")
        shared = max(med(g, "async_array", "load_s"), med(g, "async_array", "compile_s")) + run
        t.add(
            "async_array: wall vs max(load, compile) + run as overlapped",
            ours,
            shared,
            "the same, load and compile as they ran",
            target="≤ 1.05",
            met=_lt(ours, shared, 1.05),
        )


def encoder_rows(t: Table, data: dict) -> None:
    """The encoder benchmark (``benches/encoder.py``)."""
    mb = data["bytes"] / 1e6
    for src, rows in data["summary"].items():
        first = next(iter(rows.values()))
        limit = first["limit"]
        load, compile_, run = first["limit_parts"]
        where = (
            "local file"
            if src == "file"
            else f"HTTP {data['bandwidth']:g} MB/s, {data['latency']:g} ms a request"
        )
        t.section(
            f"Encoder, {data['tensors']} tensors, {mb:.0f} MB, {where} (limit = max(load alone "
            f"{load:.2f} s, compile alone {compile_:.2f} s) + run {run:.2f} s; medians of "
            f"{data['rounds']} fresh processes each)"
        )
        wall = lambda name, rows=rows: rows.get(name, {}).get("wall")  # noqa: E731
        tpe = "ThreadPoolExecutor + AOT"
        for way in ("aa.load_safetensors + jax.jit", "aa.load_safetensors + aa.jit"):
            ours = wall(way)
            t.add(
                f"{way}: wall vs limit",
                ours,
                limit,
                "max(load alone, compile alone) + run",
                target="≤ 1.05",
                met=_lt(ours, limit, 1.05),
            )
            t.add(
                f"{way}: wall vs thread pool",
                ours,
                wall(tpe),
                tpe,
                target="< 1",
                met=_lt(ours, wall(tpe), 0.9999),
            )
        ours = wall("aa.load_safetensors + jax.jit")
        for other in rows:
            if (
                other.startswith(("aa.load_safetensors", "load alone", "compile alone"))
                or other == tpe
            ):
                continue
            t.add(f"aa.load_safetensors + jax.jit: wall vs {other}", ours, wall(other), other)
        a = rows.get("load alone: aa.load_safetensors", {})
        m = rows.get("load alone: async_map loader", {})
        t.add(
            "load alone: CPU seconds",
            a.get("cpu"),
            m.get("cpu"),
            "the async_map Python loader",
            fmt=lambda c: f"{c:.3f} s",
            target="≤ 0.5",
            met=_lt(a.get("cpu"), m.get("cpu"), 0.5),
        )
        ours_row, tpe_row = rows.get("aa.load_safetensors + jax.jit", {}), rows.get(tpe, {})
        t.add(
            "aa.load_safetensors + jax.jit: peak RSS",
            ours_row.get("peak_rss"),
            tpe_row.get("peak_rss"),
            tpe,
            fmt=lambda b: f"{b / 2**20:.0f} MiB",
        )
        n = ours_row.get("leaves") or 0
        t.add(
            "aa.load_safetensors + jax.jit: leaves that reached JAX without a copy",
            ours_row.get("zero_copy"),
            None,
            f"{tpe}: {tpe_row.get('zero_copy')}/{n}",
            fmt=lambda k, n=n: f"{k}/{n}",
            target=f"{n}/{n}",
            met=ours_row.get("zero_copy") == n,
        )
    small = data.get("small")
    if small:
        per = small["per_tensor"]
        t.section(
            f"{small['tensors']:,} small tensors ({tuple(small['shape'])} float32) in one file, "
            f"to every jax.Array ready (medians of {small['rounds']} rounds, one process)"
        )
        twin = per["safe_open + jax.device_put"]
        for way in ("aa.load_safetensors", "aa.async_map loader"):
            t.add(f"{way}: time per tensor", per.get(way), twin, "safe_open + jax.device_put")


def _lt(ours: float | None, twin: float | None, bound: float) -> bool | None:
    return None if ours is None or not twin else ours / twin <= bound


def render_encoder(data: dict) -> str:
    """The encoder benchmark's own table: every contender's figures."""
    sys.path.insert(0, str(ROOT / "benches"))
    import encoder

    text = encoder.render(data, data["summary"])
    return text + ("\n\n" + encoder.render_small(data["small"]) if "small" in data else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="more samples and rounds")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    start, t0 = datetime.datetime.now(datetime.UTC), time.monotonic()
    load_start = os.getloadavg()[0]

    samples = "100" if args.full else "20"
    cargo = ["cargo", "bench", "--quiet", "--bench", "core", "--", "--sample-count", samples]
    rc = run_logged(cargo, OUT / "core.txt", "Rust benches (cargo bench)")
    core = parse_divan((OUT / "core.txt").read_text())

    pytest = [
        sys.executable,
        "-m",
        "pytest",
        "benches",
        "-q",
        "-p",
        "no:cacheprovider",
        "--benchmark-json",
        str(OUT / "pytest.json"),
    ]
    if not args.full:
        pytest += ["--quick", "--benchmark-max-time=0.5"]
    rc |= run_logged(pytest, OUT / "pytest.log", "pytest-benchmark suites")
    encoder_json = OUT / "encoder.json"
    encoder_json.unlink(missing_ok=True)
    enc = [sys.executable, str(ROOT / "benches" / "encoder.py"), "--json", str(encoder_json)]
    rc |= run_logged(
        enc + (["--full"] if args.full else []), OUT / "encoder.log", "encoder benchmark"
    )
    encoder = json.loads(encoder_json.read_text()) if encoder_json.exists() else None
    json_path = OUT / "pytest.json"
    benches = json.loads(json_path.read_text())["benchmarks"] if json_path.exists() else []

    table = Table()
    rust_rows(table, core)
    python_rows(table, benches)
    if encoder:
        encoder_rows(table, encoder)
    took = time.monotonic() - t0
    text = "\n".join(
        [
            f"async_array benchmarks: {'full' if args.full else 'short'} run of "
            f"{start:%Y-%m-%d %H:%M} UTC, took {took / 60:.1f} min",
            *machine(),
            f"load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end",
            "ratio = async_array / twin: below 1, async_array takes less time (or memory)",
            "",
            table.render(),
        ]
    )
    if encoder:
        text += "\n\n" + render_encoder(encoder)
    (OUT / "table.txt").write_text(text + "\n")
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
