"""Independent safetensors reader for the checkpoint tests (standard library only, plus
torch when it can be imported). Reads FILE and checks it against EXPECTED (JSON:
{name: {"dtype": "F32", "shape": [...], "sum": float, "first": float}}): names, dtypes,
shapes and values. Prints "ok stdlib" and, when torch is present, "ok torch"; exits 1 with
the reason otherwise.

    python3 read_safetensors.py FILE EXPECTED_JSON
"""
import json
import math
import struct
import sys

FORMATS = {"F32": ("f", 4), "F64": ("d", 8), "I64": ("q", 8), "I32": ("i", 4), "I16": ("h", 2),
           "I8": ("b", 1), "U8": ("B", 1), "BOOL": ("?", 1), "F16": ("e", 2), "BF16": (None, 2)}


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def decode(dtype, raw):
    fmt, size = FORMATS[dtype]
    n = len(raw) // size
    if dtype == "BF16":
        # bf16 is the top half of a float32.
        halves = struct.unpack("<%dH" % n, raw)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    return list(struct.unpack("<%d%s" % (n, fmt), raw))


def main():
    path, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        expected = json.load(f)
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    if (8 + n) % 8 != 0:
        fail("header not padded to 8 bytes")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    if header.get("__metadata__", {}).get("format") != "pt":
        fail("__metadata__.format is not pt")
    body = data[8 + n:]
    names = sorted(k for k in header if k != "__metadata__")
    if names != sorted(expected):
        fail("names %s != expected %s" % (names, sorted(expected)))
    spans = sorted(tuple(header[k]["data_offsets"]) for k in names)
    pos = 0
    for b, e in spans:
        if b != pos:
            fail("hole or overlap at %d" % b)
        pos = e
    if pos != len(body):
        fail("data section is %d bytes, tensors cover %d" % (len(body), pos))
    for name in names:
        h, want = header[name], expected[name]
        if h["dtype"] != want["dtype"] or h["shape"] != want["shape"]:
            fail("%s: %s %s, expected %s %s" % (name, h["dtype"], h["shape"], want["dtype"], want["shape"]))
        b, e = h["data_offsets"]
        values = decode(h["dtype"], body[b:e])
        count = 1
        for d in h["shape"]:
            count *= d
        if len(values) != count:
            fail("%s: %d values for shape %s" % (name, len(values), h["shape"]))
        total = float(sum(values))
        if not math.isclose(total, want["sum"], rel_tol=1e-6, abs_tol=1e-6):
            fail("%s: sum %r, expected %r" % (name, total, want["sum"]))
        if values and not math.isclose(float(values[0]), want["first"], rel_tol=1e-6, abs_tol=1e-9):
            fail("%s: first value %r, expected %r" % (name, values[0], want["first"]))
    print("ok stdlib")

    try:
        import torch
    except ImportError:
        return
    dtypes = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
              "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8, "I8": torch.int8,
              "I16": torch.int16, "BOOL": torch.bool}
    for name in names:
        h, want = header[name], expected[name]
        b, e = h["data_offsets"]
        raw = bytearray(body[b:e])
        if len(raw) == 0:
            t = torch.empty(h["shape"], dtype=dtypes[h["dtype"]])
        else:
            t = torch.frombuffer(raw, dtype=dtypes[h["dtype"]]).reshape(h["shape"])
        if list(t.shape) != want["shape"]:
            fail("torch: %s shape %s" % (name, list(t.shape)))
        total = float(t.double().sum())
        if not math.isclose(total, want["sum"], rel_tol=1e-6, abs_tol=1e-6):
            fail("torch: %s sum %r, expected %r" % (name, total, want["sum"]))
    print("ok torch " + torch.__version__)


if __name__ == "__main__":
    main()
