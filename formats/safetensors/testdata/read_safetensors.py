"""Reads a safetensors file with the Python standard library only.

Used by safetensors_test to check that files written by fsdpp follow the
format as other readers see it: no safetensors or torch package involved, the
header is decoded with struct + json and the data with struct/array. Prints one
line per tensor, sorted by name: "name dtype [shape] v0 v1 ..." (all values,
repr'd floats; bf16 widened to f32 by shifting its bits), then "metadata k=v"
lines. Exits non-zero (with a message) when the file breaks the format.
"""

import json
import struct
import sys

# dtype -> (element size, struct format character or None for bf16).
_DTYPES = {
    "F32": (4, "f"),
    "F16": (2, "e"),
    "BF16": (2, None),
    "I32": (4, "i"),
    "I64": (8, "q"),
    "U8": (1, "B"),
}


def _fail(message):
    sys.stderr.write("read_safetensors: %s\n" % message)
    sys.exit(1)


def _values(dtype, raw):
    size, fmt = _DTYPES[dtype]
    count = len(raw) // size
    if fmt is None:  # bf16: the upper half of an f32.
        bits = struct.unpack("<%dH" % count, raw)
        return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]
    return list(struct.unpack("<%d%s" % (count, fmt), raw))


def main(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        _fail("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if n % 8 != 0:
        _fail("header length %d is not a multiple of 8" % n)
    header_bytes = blob[8:8 + n]
    if not header_bytes.startswith(b"{"):
        _fail("header does not start with '{'")
    header = json.loads(header_bytes.decode("utf-8"))
    data = memoryview(blob)[8 + n:]
    metadata = header.pop("__metadata__", {})
    spans = []
    lines = []
    for name in sorted(header):
        entry = header[name]
        dtype, shape = entry["dtype"], entry["shape"]
        begin, end = entry["data_offsets"]
        size = _DTYPES[dtype][0]
        numel = 1
        for d in shape:
            numel *= d
        if numel * size != end - begin:
            _fail("%s: size mismatch" % name)
        if begin % size != 0:
            _fail("%s: not aligned to its element size" % name)
        spans.append((begin, end))
        values = _values(dtype, bytes(data[begin:end]))
        lines.append(" ".join([name, dtype, json.dumps(shape)] +
                              [repr(v) for v in values]))
    cursor = 0
    for begin, end in sorted(spans):
        if begin != cursor:
            _fail("offsets do not tile the data buffer")
        cursor = end
    if cursor != len(data):
        _fail("trailing bytes")
    for key in sorted(metadata):
        lines.append("metadata %s=%s" % (key, metadata[key]))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
