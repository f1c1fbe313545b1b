"""Prints what pyproject.toml asks pip to install, as a requirements file.

Usage: python .ci/requirements.py [EXTRA ...] > requirements.txt

The package's dependencies, the given optional extras and the build
requirements (maturin), so that the Makefile installs every dependency in one
pip call, before and apart from building the package itself: the build then
runs without build isolation and so without the network.
"""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
reqs = list(project["build-system"]["requires"]) + list(project["project"]["dependencies"])
extras = project["project"].get("optional-dependencies", {})
for extra in sys.argv[1:]:
    if extra not in extras:
        sys.exit(f"{sys.argv[0]}: pyproject.toml has no extra {extra!r} (it has {sorted(extras)})")
    reqs += extras[extra]
print("\n".join(dict.fromkeys(reqs)))
