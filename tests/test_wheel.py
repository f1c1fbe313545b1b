"""The wheel a user installs: built as ``make wheel`` builds it (maturin,
manylinux_2_34, checked by maturin), installed with pip into a fresh venv, then
the README's quick example runs from it, and the process exits cleanly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def quick_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick example") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(900)  # a cold build of the crate, on a loaded 2-core machine
def test_wheel_installs_into_a_fresh_venv_and_runs_the_quick_example(tmp_path):
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    env = dict(os.environ, CARGO_TARGET_DIR=str(ROOT / "target" / f"wheel-{tag}"))
    dist = tmp_path / "dist"
    build = subprocess.run(
        [
            *(sys.executable, "-m", "maturin", "build", "--release"),
            *("--compatibility", "manylinux_2_34", "-i", sys.executable, "--out", str(dist)),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    # maturin tags a wheel manylinux only once it checked the symbols it links.
    assert re.fullmatch(rf"async_array-.*-{tag}-{tag}-manylinux_2_34_x86_64\.whl", wheel.name)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    # JAX and numpy come from this environment (read through a path entry, so
    # its editable async_array is not seen): no network needed.
    site = Path(venv, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}")
    (site / "site-packages" / "test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = "import async_array, sys; print(async_array.__file__, file=sys.stderr)\n"
    run = subprocess.run(
        [python, "-c", code + quick_example()],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[0 1 4 9]"
    assert run.stderr.strip().startswith(str(site)), run.stderr  # the wheel's copy
