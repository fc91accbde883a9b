"""The reference implementation's side of tests/weights/oracle_test.cpp.

  oracle.py write DIR   writes DIR/python.safetensors (every dtype, a scalar, an empty tensor,
                        one metadata key) with safetensors.torch.save_file, DIR/expected.json
                        (each tensor's dtype, shape and bytes in hex, and the metadata), and a
                        sharded copy under DIR/sharded/ with its model.safetensors.index.json
  oracle.py load FILE EXPECTED.json
                        loads FILE with safetensors.torch and compares every tensor, bit for bit,
                        and the metadata with EXPECTED.json
Exit 3: safetensors is not installed (the test is skipped, saying so).
"""
import json
import os
import sys

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
except ImportError as e:  # the test skips with this reason
    print(f"oracle: {e}; scripts/install-deps.sh installs safetensors")
    sys.exit(3)

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def tensors():
    g = torch.Generator().manual_seed(7)
    out = {}
    for i, (dtype, name) in enumerate(DTYPES.items()):
        if dtype.is_floating_point:
            t = torch.randn(3, 5, generator=g, dtype=torch.float64).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, (2, 7), generator=g).bool()
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(max(info.min, -1000), min(info.max, 1000), (4, 3), generator=g,
                              dtype=torch.int64).to(dtype)
        out[f"layers.{i}.{name.lower()}"] = t
    out["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    out["empty"] = torch.zeros(0, 4, dtype=torch.float32)
    out["embed.weight"] = torch.randn(16, 8, generator=g)
    return out


def raw_bytes(t):
    if t.numel() == 0:
        return b""
    return bytes(t.contiguous().view(-1).view(torch.uint8).tolist())


def write(d):
    ts = tensors()
    metadata = {"format": "pt"}
    save_file(ts, os.path.join(d, "python.safetensors"), metadata=metadata)
    desc = {
        "tensors": {n: {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "hex": raw_bytes(t).hex()}
                    for n, t in ts.items()},
        "metadata": metadata,
    }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(desc, f, sort_keys=True)
    shard_dir = os.path.join(d, "sharded")
    os.makedirs(shard_dir, exist_ok=True)
    names = sorted(ts)
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: ts[n] for n in part}, os.path.join(shard_dir, file), metadata=metadata)
        weight_map.update({n: file for n in part})
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(len(raw_bytes(t)) for t in ts.values())},
                   "weight_map": weight_map}, f, indent=2)


def load(path, expected_path):
    with open(expected_path) as f:
        expected = json.load(f)
    got = load_file(path)
    assert sorted(got) == sorted(expected["tensors"]), (sorted(got), sorted(expected["tensors"]))
    for n, e in expected["tensors"].items():
        t = got[n]
        assert DTYPES[t.dtype] == e["dtype"], (n, t.dtype, e["dtype"])
        assert list(t.shape) == e["shape"], (n, t.shape, e["shape"])
        assert raw_bytes(t).hex() == e["hex"], n
    with safe_open(path, framework="pt") as f:
        assert (f.metadata() or {}) == expected["metadata"], (f.metadata(), expected["metadata"])
    print(f"oracle: {len(got)} tensors of {path} equal")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2])
    elif sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    else:
        sys.exit(f"oracle: unknown command {sys.argv[1]}")
