"""The header checks of aa.load_safetensors against the ``safetensors``
package's own reader, file by file: every file the loader accepts, safetensors
accepts too, with the same bytes in every tensor. Hand-made cases for each
rule, then a seeded fuzz of corrupted files (a few seconds here; run this file
as a script for a longer one: ``python tests/test_safetensors_strict.py 100000``).
"""

import json
import os
import random
import struct
import sys
import tempfile

import numpy as np
import pytest
import safetensors.numpy
from safetensors import _safetensors_rust as st_rust

import async_array as aa


def raw(header, data: bytes = b"", pad: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += pad
    return struct.pack("<Q", len(text)) + text + data


def entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def safetensors_reads(blob: bytes):
    """safetensors' verdict: name -> (dtype, shape, bytes), or the error."""
    try:
        return {
            name: (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
            for name, t in st_rust.deserialize(blob)
        }
    except Exception as exc:  # its SafetensorError, or a ValueError of its parser
        return exc


def loader_reads(blob: bytes, folder: str):
    """The loader's verdict on the same bytes, as a file: name -> (dtype,
    shape, bytes), or the error it raised (at the call or from a leaf)."""
    path = os.path.join(folder, "f.safetensors")
    with open(path, "wb") as f:
        f.write(blob)
    try:
        values = aa.materialize(aa.load_safetensors(path), 30)
    except (ValueError, OSError, TypeError) as exc:
        return exc
    return {name: np.asarray(v).tobytes() for name, v in values.items()}


def agree(blob: bytes, folder: str) -> str:
    """Checks the loader is at least as strict as safetensors on ``blob``;
    returns which of "both", "neither", "only safetensors" accepted it."""
    theirs = safetensors_reads(blob)
    ours = loader_reads(blob, folder)
    if isinstance(ours, Exception):
        return "neither" if isinstance(theirs, Exception) else "only safetensors"
    assert not isinstance(theirs, Exception), (
        f"the loader accepted what safetensors refuses ({theirs}): {blob[:200]!r}"
    )
    assert set(ours) == set(theirs)
    for name, data in ours.items():
        # 64-bit tensors come narrowed without x64; the files here hold none.
        assert data == theirs[name][2], name
    return "both"


F4 = b"\0\0\x80?"  # 1.0 as float32

CASES = {
    # what the fault attack found the loader accepting
    "bytes after the last tensor": raw({}, b" ", pad=b" "),
    "a gap before the first tensor": raw({"a": entry(offsets=(4, 8))}, 8 * b"\0"),
    "a gap between tensors": raw(
        {"a": entry(offsets=(0, 4)), "b": entry(offsets=(8, 12))}, 12 * b"\0"
    ),
    "bytes after a tensor": raw({"a": entry()}, F4 + b"\0"),
    "__metadata__ of a number": raw({"__metadata__": {"a": 1}}),
    "__metadata__ of a list": raw({"__metadata__": []}),
    "a tensor named __metadata__": raw({"__metadata__": entry()}, F4),
    "overlapping tensors": raw(
        {"a": entry(shape=(2,), offsets=(0, 8)), "b": entry(offsets=(4, 8))}, 8 * b"\0"
    ),
    "a shape that needs other bytes": raw({"a": entry(shape=(2,))}, F4),
}

ACCEPTED = {
    "null __metadata__": raw({"__metadata__": None, "a": entry()}, F4),
    "metadata of strings": raw({"__metadata__": {"k": "v"}, "a": entry()}, F4),
    "no tensor": raw({}),
    "a zero-sized tensor": raw({"e": entry(shape=(0,), offsets=(4, 4)), "a": entry()}, F4),
    "header padded with spaces": raw({"a": entry()}, F4, pad=b"    "),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_loader_refuses_what_safetensors_refuses(case, tmp_path):
    assert agree(CASES[case], str(tmp_path)) == "neither"


def test_a_duplicate_key_is_refused_though_safetensors_keeps_the_last(tmp_path):
    # Its JSON parser keeps the last of a duplicated key; the earlier entry
    # would go unchecked, so the loader refuses the file.
    blob = raw(
        b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
        b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        F4,
    )
    assert agree(blob, str(tmp_path)) == "only safetensors"
    with pytest.raises(ValueError, match='key "a" appears more than once'):
        aa.load_safetensors(tmp_path / "f.safetensors")


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_the_loader_accepts_what_safetensors_accepts(case, tmp_path):
    assert agree(ACCEPTED[case], str(tmp_path)) == "both"


def test_each_refusal_names_the_file_and_the_bytes(tmp_path):
    blob = CASES["a gap between tensors"]
    data_start = 8 + struct.unpack("<Q", blob[:8])[0]
    path = tmp_path / "f.safetensors"
    path.write_bytes(blob)
    with pytest.raises(ValueError) as info:
        aa.load_safetensors(path)
    assert str(info.value) == (
        f"load_safetensors: {path}: file bytes [{data_start + 4}, {data_start + 8}) between "
        'tensors "a" and "b" belong to no tensor: the tensors must cover the data section '
        "exactly, as safetensors requires"
    )


def corrupted(rng: random.Random) -> bytes:
    """A small valid file, then one corruption: a byte of the header changed,
    bytes cut or appended, or an offset, a shape or a dtype rewritten."""
    arrays = {
        f"t{i}": np.frombuffer(rng.randbytes(4 * n), np.float32).reshape(n)
        for i, n in enumerate(rng.choices(range(0, 5), k=rng.randint(0, 4)))
    }
    blob = bytearray(safetensors.numpy.save(arrays))
    n = struct.unpack("<Q", blob[:8])[0]
    kind = rng.randrange(6)
    if kind == 0 and n:  # a header byte
        blob[8 + rng.randrange(n)] = rng.randrange(256)
    elif kind == 1:  # cut
        del blob[rng.randrange(len(blob) + 1) :]
    elif kind == 2:  # appended
        blob += rng.randbytes(rng.randint(1, 8))
    elif kind in (3, 4, 5) and arrays:
        header = json.loads(blob[8 : 8 + n])
        name = rng.choice(sorted(k for k in header if k != "__metadata__"))
        if kind == 3:
            header[name]["data_offsets"][rng.randrange(2)] += rng.choice([-4, -1, 1, 4])
        elif kind == 4:
            header[name]["shape"] = [rng.randint(0, 3) for _ in range(rng.randint(0, 2))]
        else:
            header[name]["dtype"] = rng.choice(["F16", "I32", "U8", "F64", "BF16", "X"])
        blob = bytearray(raw(header, bytes(blob[8 + n :])))
    return bytes(blob)


def fuzz(cases: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    seen = {"both": 0, "neither": 0, "only safetensors": 0}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(cases):
            seen[agree(corrupted(rng), folder)] += 1
    return seen


def test_a_seeded_fuzz_finds_the_loader_never_looser():
    seen = fuzz(300)
    # The fuzz reaches both verdicts, and the loader refuses nothing safetensors reads.
    assert seen["both"] > 20 and seen["neither"] > 20, seen
    assert seen["only safetensors"] == 0, seen


if __name__ == "__main__":
    cases = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    print(fuzz(cases, seed))
