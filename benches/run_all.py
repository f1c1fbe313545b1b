"""Every benchmark in one command, one table: ``make bench``.

Runs the Rust core benches (divan, ``benches/core.rs``) and the pytest-benchmark
suites (``benches/test_*.py``), a short version unless ``--full``, then prints
one table: each figure, its twin (what a user would do without async_array,
measured in the same process), the ratio and the target. Raw output (divan's
table, pytest's log and JSON, this table) goes to ``.bench/``.

Run: python benches/run_all.py [--full]   (cargo needs PYO3_PYTHON: use make bench)
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

    g = "100k leaves, one function"
    ours = med(g, "async_array")
    jax_ways = {w: med(g, w) for w in ("jax.device_put(list)", "make_array_from_callback")}
    floor_way = min((w for w in jax_ways if jax_ways[w]), key=jax_ways.get, default=None)
    floor = jax_ways.get(floor_way) if floor_way else None
    t.add(
        "100k leaves: async_wrap(like=) → materialize",
        ours,
        floor,
        f"JAX floor: {floor_way}",
        target="≤ 1.25",
        met=_lt(ours, floor, 1.25),
    )
    for w, v in jax_ways.items():
        if w != floor_way:
            t.add("  the other JAX way", ours, v, w)

    g = "100k leaves, one task each"
    ours, twin = med(g, "async_array"), med(g, tpe)
    t.add(
        "100k leaves: async_map → materialize",
        ours,
        twin,
        tpe + " per leaf",
        target="≤ 0.333 (3x faster)",
        met=_lt(ours, twin, 1 / 3),
    )

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
    t.add(
        "aa.empty: allocate and fill 512 MiB (huge pages)",
        ours,
        twin,
        "np.empty",
        target="≤ 1.1",
        met=_lt(ours, twin, 1.1),
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

    for g, title in (
        ("scenario: load 2 s + compile 1 s + run", "Scenario: load (sleep 2 s) + compile + run"),
        ("scenario: load 2 s + 3-stage pipeline", "Scenario: load (sleep 2 s) + 3-stage pipeline"),
        ("MiniLM: 90 MB at 100 MB/s, 20 ms latency", "MiniLM: 90 MB at 100 MB/s, 20 ms a request"),
    ):
        overlap_rows(t, g, title, med)


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


def _lt(ours: float | None, twin: float | None, bound: float) -> bool | None:
    return None if ours is None or not twin else ours / twin <= bound


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
    json_path = OUT / "pytest.json"
    benches = json.loads(json_path.read_text())["benchmarks"] if json_path.exists() else []

    table = Table()
    rust_rows(table, core)
    python_rows(table, benches)
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
    (OUT / "table.txt").write_text(text + "\n")
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
