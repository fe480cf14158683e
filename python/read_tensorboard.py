#!/usr/bin/env python3
"""Reads TensorBoard event files independently of Tessera's C++ writer, checking every byte.

Usage: read_tensorboard.py PATH...   (event files, or directories holding events.out.tfevents.*)

Each record's framing is checked (length, masked CRC-32C of the length, data, masked CRC-32C
of the data; CRCs computed by the crc32c module) and its data parsed as a tensorboard.Event
with python3-protobuf, from classes protoc generates out of observe/tensorboard_summary.proto.
Prints one JSON object per summary value:
  {"file": ..., "step": N, "wall_time": T, "tag": ..., "value": X}
  {"file": ..., "step": N, "wall_time": T, "tag": ..., "image": {"height", "width", "colorspace", "png_bytes"}}
A file whose first record is not the file-version event, a damaged record, trailing bytes or
an event that does not parse: a message naming the file and the record on stderr, exit 1.
"""
import glob
import importlib
import json
import os
import struct
import subprocess
import sys
import tempfile

import crc32c

SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "observe", "tensorboard_summary.proto")


def load_schema():
    out = tempfile.mkdtemp(prefix="tb_schema_")
    proto_dir, proto_file = os.path.split(os.path.normpath(SCHEMA))
    subprocess.run(["protoc", "-I", proto_dir, "--python_out", out, proto_file], check=True)
    sys.path.insert(0, out)
    return importlib.import_module(proto_file[:-len(".proto")] + "_pb2")


def masked_crc(data):
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class Damaged(Exception):
    pass


def records(data):
    """Yields (index, offset, payload) for each TFRecord of `data`."""
    offset, index = 0, 0
    while offset < len(data):
        where = f"record {index} at byte {offset}"
        if len(data) - offset < 12:
            raise Damaged(f"{where}: {len(data) - offset} trailing bytes, not a record header")
        header = data[offset:offset + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
        if masked_crc(header) != length_crc:
            raise Damaged(f"{where}: the length's CRC does not match")
        end = offset + 12 + length + 4
        if end > len(data):
            raise Damaged(f"{where}: {length} bytes of data announced, the file ends first")
        payload = data[offset + 12:offset + 12 + length]
        (data_crc,) = struct.unpack("<I", data[end - 4:end])
        if masked_crc(payload) != data_crc:
            raise Damaged(f"{where}: the data's CRC does not match")
        yield index, offset, payload
        offset, index = end, index + 1


def read_file(path, schema):
    with open(path, "rb") as f:
        data = f.read()
    values = []
    for index, offset, payload in records(data):
        event = schema.Event()
        try:
            event.ParseFromString(payload)
        except Exception as e:  # the protobuf module's DecodeError
            raise Damaged(f"record {index} at byte {offset}: not an Event ({e})")
        if index == 0:
            if event.WhichOneof("what") != "file_version" or not event.file_version.startswith("brain.Event:"):
                raise Damaged("record 0: not the file-version event")
            continue
        if event.WhichOneof("what") != "summary":
            raise Damaged(f"record {index} at byte {offset}: an event without a summary")
        for v in event.summary.value:
            out = {"file": path, "step": event.step, "wall_time": event.wall_time, "tag": v.tag}
            kind = v.WhichOneof("value")
            if kind == "simple_value":
                out["value"] = v.simple_value
            elif kind == "image":
                png = v.image.encoded_image_string
                if not png.startswith(b"\x89PNG\r\n\x1a\n"):
                    raise Damaged(f"record {index}: image '{v.tag}' is not a PNG")
                out["image"] = {"height": v.image.height, "width": v.image.width,
                                "colorspace": v.image.colorspace, "png_bytes": len(png)}
            else:
                raise Damaged(f"record {index}: value '{v.tag}' holds {kind}")
            values.append(out)
    if not data:
        raise Damaged("empty file")
    return values


def main(argv):
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    files = []
    for path in argv:
        files += sorted(glob.glob(os.path.join(path, "events.out.tfevents.*"))) if os.path.isdir(path) else [path]
    if not files:
        print(f"read_tensorboard: no event files in {' '.join(argv)}", file=sys.stderr)
        return 1
    schema = load_schema()
    for path in files:
        try:
            for value in read_file(path, schema):
                print(json.dumps(value))
        except (Damaged, OSError) as e:
            print(f"read_tensorboard: {path}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
