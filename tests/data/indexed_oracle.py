"""megatron-core's side of tests/data/indexed_dataset_test.cpp: its IndexedDatasetBuilder writes
datasets pipemat reads, its IndexedDataset reads the datasets pipemat writes.

  indexed_oracle.py write SPEC.json   for each entry {"prefix", "dtype", "documents"} of SPEC's
                                      "datasets" (documents: lists of sequences, a sequence a list
                                      of token ids), writes PREFIX.bin / PREFIX.idx with
                                      IndexedDatasetBuilder: add_item per sequence, end_document
                                      per document, finalize
  indexed_oracle.py read PREFIX...    prints one JSON object per line for each dataset, read with
                                      IndexedDataset: {"prefix", "dtype", "sequences",
                                      "document_indices"}
  indexed_oracle.py seeds DIR         writes the seed corpus of tests/fuzz/indexed_idx_fuzz.cpp
                                      into DIR: .idx files of the builder and damaged copies

Commands may follow each other in one call (`write SPEC.json read P1 P2`): importing megatron-core
takes seconds, so the test calls this once. Exit 3: megatron-core is not installed (the test is
skipped, saying so).
"""
import json
import os
import struct
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
try:
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
except ImportError as e:  # the test skips with this reason
    print(f"indexed_oracle: {e}; scripts/install-deps.sh installs megatron-core")
    sys.exit(3)

COMMANDS = ("write", "read", "seeds")


def build(prefix, dtype, documents):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=getattr(numpy, dtype))
    for document in documents:
        for sequence in document:
            builder.add_item(torch.tensor(sequence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def write(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    for d in spec["datasets"]:
        build(d["prefix"], d["dtype"], d["documents"])


def read(prefix):
    ds = IndexedDataset(prefix)
    out = {
        "prefix": prefix,
        "dtype": ds.index.dtype.__name__,
        "sequences": [ds[i].tolist() for i in range(len(ds))],
        "document_indices": ds.document_indices.tolist(),
    }
    # Slices read the same (one read of the whole run of sequences).
    if len(ds) > 0:
        assert [s.tolist() for s in ds[0:len(ds)]] == out["sequences"]
    print(json.dumps(out))


def seeds(directory):
    """The fuzz target's input: byte 0 even: 8 bytes of the .bin's size, then the .idx; odd: the
    .idx alone, the .bin's size derived from it (tests/fuzz/indexed_idx_fuzz.cpp)."""
    os.makedirs(directory, exist_ok=True)

    def put(name, idx, bin_bytes=None):
        data = (b"\x00" + struct.pack("<Q", bin_bytes) + idx) if bin_bytes is not None \
            else b"\x01" + idx
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)

    datasets = {
        "uint16-three-documents": ("uint16", [[[1, 2, 3], [], [65535]], [[7] * 5], []]),
        "int32-one-sequence": ("int32", [[[-5, 0, 2**31 - 1]]]),
        "uint8-empty-documents": ("uint8", [[], [[255, 0]], []]),
        "int64-wide": ("int64", [[[2**62, -(2**62)], [1]], [[3, 4, 5]]]),
        "int8": ("int8", [[[-128, 127]]]),
        "int16": ("int16", [[[-300], [300, 1]]]),
        "empty": ("uint16", []),
    }
    with tempfile.TemporaryDirectory() as tmp:
        idx_of = {}
        for name, (dtype, documents) in datasets.items():
            prefix = os.path.join(tmp, name)
            build(prefix, dtype, documents)
            with open(prefix + ".idx", "rb") as f:
                idx = f.read()
            bin_bytes = os.path.getsize(prefix + ".bin")
            idx_of[name] = (idx, bin_bytes)
            put(name + ".sized", idx, bin_bytes)
            put(name + ".derived", idx)
    idx, bin_bytes = idx_of["uint16-three-documents"]
    n = struct.unpack_from("<Q", idx, 18)[0]
    lengths_at, pointers_at = 34, 34 + 4 * n
    documents_at = pointers_at + 8 * n

    def patched(offset, fmt, value):
        b = bytearray(idx)
        struct.pack_into(fmt, b, offset, value)
        return bytes(b)

    damaged = {
        "damaged-magic": (b"MMIDIDY\x00\x00" + idx[9:], bin_bytes),
        "damaged-version": (patched(9, "<Q", 2), bin_bytes),
        "damaged-dtype-float32": (patched(17, "<B", 7), bin_bytes),
        "damaged-dtype-unknown": (patched(17, "<B", 9), bin_bytes),
        "damaged-sequence-count": (patched(18, "<Q", 2**63), bin_bytes),
        "damaged-document-count": (patched(26, "<Q", 2**40), bin_bytes),
        "damaged-negative-length": (patched(lengths_at, "<i", -1), bin_bytes),
        "damaged-pointer": (patched(pointers_at + 8, "<q", 4), bin_bytes),
        "damaged-document-order": (patched(documents_at + 8, "<q", 9), bin_bytes),
        "damaged-first-document": (patched(documents_at, "<q", 1), bin_bytes),
        "damaged-truncated-bin": (idx, bin_bytes - 2),
        "damaged-truncated-idx": (idx[:-5], bin_bytes),
        "damaged-modes": (idx + b"\x00" * n, bin_bytes),
        "damaged-trailing": (idx + b"\x00", bin_bytes),
        "damaged-header-only": (idx[:20], 0),
    }
    for name, (data, size) in damaged.items():
        put(name, data, size)


def main(argv):
    i = 0
    while i < len(argv):
        command = argv[i]
        if command not in COMMANDS:
            print(f"indexed_oracle: unknown command {command!r}; expected one of {COMMANDS}")
            return 2
        j = i + 1
        while j < len(argv) and argv[j] not in COMMANDS:
            j += 1
        args = argv[i + 1:j]
        if command == "write":
            for spec in args:
                write(spec)
        elif command == "read":
            for prefix in args:
                read(prefix)
        else:
            for directory in args:
                seeds(directory)
        i = j
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
