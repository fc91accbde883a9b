#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (Note [Fuzz targets] in tests/fuzz/CMakeLists.txt).

  make_seeds.py [safetensors|hf_config|tcp_wire|manifest ...]   (default: every one)

Small valid inputs made by the reference implementations (Python's safetensors package,
transformers' LlamaConfig) or as pipemat writes them (a rank's handshake and frames, a checkpoint's
manifest), and damaged copies of them. Run with the project's Python
(/opt/pipemat-venv/bin/python), which has both. Seeds named crash-* or finding-* are inputs that
once found something: this script never writes or removes them.

The manifests of format 4 (tests/fuzz/corpus/manifest/format-4*.json) are real: with
PIPEMAT=build/launch/pipemat in the environment this script writes them anew from tiny runs of
that binary (configs/zoo.yaml and configs/llama.yaml, ranks as threads); without it, it keeps the
corpus's copies. Their damaged seeds are made from them either way.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors_seeds():
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(7)
    files = {
        "two-f32": ({"a": torch.randn(2, 3, generator=g), "b": torch.randn(4, generator=g)}, None),
        "every-dtype": ({f"t.{i}": t for i, t in enumerate([
            torch.zeros(2, dtype=d) for d in (torch.float64, torch.float32, torch.float16,
                                              torch.bfloat16, torch.int64, torch.int32,
                                              torch.int16, torch.int8, torch.uint8, torch.bool)])},
                        {"format": "pt"}),
        "scalar-and-empty": ({"s": torch.tensor(2.5), "e": torch.zeros(0, 4)}, None),
        "llama-names": ({"model.embed_tokens.weight": torch.zeros(4, 2),
                         "model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
                         "lm_head.weight": torch.zeros(4, 2)}, {"format": "pt"}),
        "empty": ({}, None),
    }
    for name, (tensors, metadata) in files.items():
        data = save(tensors, metadata=metadata)
        write("safetensors", f"{name}.raw", b"\x00" + data)
        (n,) = struct.unpack("<Q", data[:8])
        header, buffer = data[8:8 + n], data[8 + n:]
        write("safetensors", f"{name}.header", b"\x01" + struct.pack("<H", len(buffer)) + header)
    base = save({"t": torch.zeros(2)})
    (n,) = struct.unpack("<Q", base[:8])
    header = base[8:8 + n].decode().rstrip()

    def structured(text, buffer=8):
        return b"\x01" + struct.pack("<H", buffer) + (text if isinstance(text, bytes) else text.encode())

    damaged = {
        "truncated": b"\x00" + base[:-3],
        "huge-length": b"\x00" + struct.pack("<Q", 2**63) + base[8:],
        "short": b"\x00" + base[:5],
        "duplicate-name": structured(header[:-1] + "," + header[1:], 16),
        "duplicate-field": structured(header.replace('"dtype":"F32"', '"dtype":"F32","dtype":"F32"')),
        "nan-shape": structured(header.replace("[2]", "[NaN]")),
        "overflow-shape": structured(header.replace("[2]", "[4294967296,4294967296]")),
        "hole": structured(header.replace("[0,8]", "[4,12]"), 12),
        "unknown-dtype": structured(header.replace("F32", "F8")),
        "not-utf8": structured(header.encode().replace(b'"t"', b'"t\xff"')),
        "deep": structured('{"t":' + "[" * 300 + "]" * 300 + "}", 0),
        "metadata-number": structured('{"__metadata__":{"k":1}}', 0),
    }
    for name, data in damaged.items():
        write("safetensors", f"damaged-{name}", data)


def hf_config_seeds():
    from transformers import LlamaConfig

    write("hf_config", "transformers-default.json", LlamaConfig().to_json_string().encode())
    small = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                        max_position_embeddings=64, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    text = small.to_json_string()
    write("hf_config", "transformers-small.json", text.encode())
    # As pipemat export writes it (weights::write_llama_config: keys in this order, indent 2).
    export = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
              "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 8, "rope_theta": 500000.0,
              "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
              "rms_norm_eps": 1e-05, "vocab_size": 256, "max_position_embeddings": 16,
              "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
              "mlp_bias": False, "torch_dtype": "float32"}
    write("hf_config", "pipemat-export.json", (json.dumps(export, indent=2) + "\n").encode())
    minimal = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256}
    write("hf_config", "minimal.json", json.dumps(minimal).encode())
    write("hf_config", "transformers4.json", json.dumps(dict(
        minimal, rope_theta=10000.0, rope_scaling=None, torch_dtype="bfloat16",
        num_key_value_heads=None, head_dim=None)).encode())
    damaged = {
        "duplicate-key": text.replace('"hidden_size": 48,', '"hidden_size": 48, "hidden_size": 64,'),
        "nan": text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'),
        "overflow": text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e999'),
        "no-model-type": json.dumps({k: v for k, v in minimal.items() if k != "model_type"}),
        "no-vocab": json.dumps({k: v for k, v in minimal.items() if k != "vocab_size"}),
        "rope-scaling": json.dumps(dict(minimal, rope_scaling={"rope_type": "linear", "factor": 2.0})),
        "null-eps": json.dumps(dict(minimal, rms_norm_eps=None)),
        "huge": json.dumps(dict(minimal, hidden_size=2**64 - 1)),
        "array": "[1, 2]",
    }
    for name, data in damaged.items():
        write("hf_config", f"damaged-{name}.json", data.encode())


def tcp_wire_seeds():
    # comm/src/tcp/wire.h's structs, little-endian; the magics as the C++ constants.
    frame, beat, hello_v1, hello_v2, challenge_magic, ack_magic = (
        0x504D4331, 0x504D4231, 0x504D4831, 0x504D4832, 0x504D4E31, 0x504D4131)
    max_user_tag = (1 << 30) - 1

    def challenge(magic=challenge_magic, version=5, flags=1):
        return struct.pack("<IIII32s32s", magic, version, flags, 0, bytes(range(32)), bytes(32))

    def hello(rank=1, world=4, host=b"127.0.0.1", magic=hello_v2, version=5, port=29501):
        return struct.pack("<IIiiII64s32s32s32s", magic, version, rank, world, port, 1, host,
                           bytes(range(32, 64)), bytes(32), bytes(32))

    def ack(status=0):
        return struct.pack("<II32s", ack_magic, status, bytes(32))

    def table(entries=((0, b""), (29501, b"127.0.0.1"), (29502, b"::1"), (29503, b"10.0.0.3"))):
        return b"".join(struct.pack("<I60s", port, host) for port, host in entries)

    def frames(*items):
        out = b""
        for magic, tag, size, payload in items:
            out += struct.pack("<IiQ", magic, tag, size) + payload
        return out

    good_frames = frames((frame, 3, 5, b"hello"), (beat, 0, 0, b""), (frame, 0, 0, b""),
                         (frame, max_user_tag + 1, 0, b""), (frame, max_user_tag + 3, 8, bytes(8)))
    seeds = {
        "handshake-and-frames": b"\x03" + challenge() + hello() + ack() + table() + good_frames,
        "ipv6-rank-3": b"\x03" + challenge() + hello(rank=3, host=b"::1") + ack() + table()
        + frames((frame, 7, 3, b"abc")),
        "unauthenticated": b"\x00" + challenge() + hello() + ack() + table(),
        "claimed-rank": b"\x07" + challenge() + hello(rank=2) + ack(4) + table(),
        "old-hello": b"\x01" + challenge() + hello(magic=hello_v1) + ack(5) + table(),
        "other-world": b"\x03" + challenge() + hello(world=3) + ack(2) + table(),
        "bad-rank": b"\x03" + challenge() + hello(rank=0) + ack(3) + table(),
        "no-address": b"\x03" + challenge() + hello(host=b"example.org") + ack(6) + table(),
        "old-protocol": b"\x03" + challenge(version=4) + hello(version=4) + ack(1) + table(),
        "bad-table": b"\x03" + challenge() + hello() + ack() + table(
            ((70000, b"127.0.0.1"), (0, b"127.0.0.1"), (1, b"x" * 60), (5, b"1.2.3.4"))),
        "bad-tag": b"\x03" + challenge() + hello() + ack() + table() + frames((frame, -1, 0, b"")),
        "too-large": b"\x03" + challenge() + hello() + ack() + table()
        + frames((frame, 1, 2**64 - 1, b"")),
        "bad-magic": b"\x03" + challenge() + hello() + ack() + table()
        + frames((beat, 0, 4, b"abcd")),
    }
    for name, data in seeds.items():
        write("tcp_wire", name, data)


def manifest_seeds():
    # As pp/src/checkpoint.cpp writes a manifest (nlohmann's dump(2): keys sorted).
    sha = "0123456789abcdef" * 4
    base = {"format": 2, "pipemat": "0.1.0", "step": 40, "world_size": 2,
            "schedule_kind": "1f1b", "stages": 2, "micro_batches": 4, "stage_to_rank": [0, 1],
            "metadata": "model: {kind: gpt}", "run": {"id": "run-1", "config_digest": sha},
            "files": {"rank-0.pt": {"sha256": sha, "bytes": 1234},
                      "rank-1.pt": {"sha256": sha, "bytes": 1234}}}

    def dump(m):
        return (json.dumps(m, indent=2, sort_keys=True) + "\n").encode()

    sharded = dict(base, format=3, replicas=2, files=dict(base["files"], **{
        f"rank-{r}.shard-{d}-of-2.pt": {"sha256": sha, "bytes": 99} for r in (0, 1) for d in (0, 1)}))
    format1 = {k: v for k, v in base.items() if k not in ("files", "run")}
    format1["format"] = 1
    interleaved = dict(base, schedule_kind="interleaved", stages=4, stage_to_rank=[0, 1, 0, 1])
    seeds = {
        "format-2.json": dump(base),
        "format-3-sharded.json": dump(sharded),
        "format-1.json": dump(format1),
        "interleaved.json": dump(interleaved),
        "damaged-duplicate.json": dump(base).replace(b'"step": 40,', b'"step": 40,\n  "step": 41,'),
        "damaged-world-size.json": dump(dict(base, world_size=3)),
        "damaged-stage-map.json": dump(dict(base, stage_to_rank=[0, 2])),
        "damaged-format.json": dump(dict(base, format=5)),
        "damaged-replicas.json": dump(dict(sharded, replicas=3)),
        "damaged-sha.json": dump(dict(base, files={"rank-0.pt": {"sha256": "x", "bytes": 1}})),
        "damaged-huge.json": dump(dict(base, step=2**64 - 1, micro_batches=2**40)),
        "damaged-nan.json": dump(base).replace(b'"step": 40', b'"step": NaN'),
    }
    for name, data in seeds.items():
        write("manifest", name, data)
    format4_seeds()


# Format 4 (pp/src/checkpoint_write.cpp): the manifest of 2 ranks, of 2 ranks x 2 replicas with
# the optimizer sharded (pieces of a tensor in two shard files), and of a llama with tied
# embeddings ("ties"); nlohmann's dump(1), keys sorted.
FORMAT4_RUNS = {
    "format-4.json": ("zoo.yaml", []),
    "format-4-sharded.json": ("zoo.yaml", ["parallel.data=2", "parallel.shard_optimizer=true"]),
    "format-4-tied.json": ("llama.yaml", [
        "model.layers=2", "model.hidden=8", "model.heads=2", "model.kv_heads=1", "model.ffn=16",
        "model.seq_len=8", "model.batch=1", "model.tie_embeddings=true", "training.eval_every=0",
        "training.warmup=0", "output.loss_svg=\"\"", "output.metrics=\"\"", "sample.tokens=0",
        "output.reference_steps=0"]),
}
ZOO_TINY = ["model.layers=2", "model.hidden=4", "model.tokens=4", "training.optimizer=adamw"]


def written_manifest(pipemat, config, sets):
    """The manifest.json of a 1-step run of `pipemat train` on configs/`config` with `sets`."""
    root = os.path.dirname(os.path.dirname(HERE))
    extra = ZOO_TINY if config == "zoo.yaml" else []
    with tempfile.TemporaryDirectory() as work:
        command = [pipemat, "train", "--config", os.path.join(root, "configs", config),
                   "--set", "transport.kind=local", "--set", "training.steps=1",
                   "--set", "output.progress=false", "--set", "checkpoint.dir=ck"]
        for s in extra + sets:
            command += ["--set", s]
        subprocess.run(command, cwd=work, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(work, "ck", "step-000001", "manifest.json"), "rb") as f:
            return f.read()


def format4_seeds():
    corpus = os.path.join(HERE, "corpus", "manifest")
    pipemat = os.environ.get("PIPEMAT")
    real = {}
    for name, (config, sets) in FORMAT4_RUNS.items():
        if pipemat:
            write("manifest", name, written_manifest(pipemat, config, sets))
        with open(os.path.join(corpus, name), "rb") as f:
            real[name] = json.loads(f.read())

    def dump(m):
        return (json.dumps(m, indent=1, sort_keys=True) + "\n").encode()

    def edited(name, edit):
        m = json.loads(json.dumps(real[name]))
        edit(m)
        return dump(m)

    plain, sharded, tied = "format-4.json", "format-4-sharded.json", "format-4-tied.json"
    first = sorted(real[plain]["tensors"])[0]  # a parameter of stage 0
    split = next(n for n, t in sorted(real[sharded]["tensors"].items()) if len(t["pieces"]) > 1)

    def set_in(path, value, name=None):
        def edit(m):
            at = m["tensors"][name or first]
            for step in path[:-1]:
                at = at[step]
            at[path[-1]] = value
        return edit

    def remove(key):
        return lambda m: m.pop(key)

    def twice(m):
        m["tensors"][first]["pieces"].append(m["tensors"][first]["pieces"][0])

    def short(m):
        m["tensors"][first]["pieces"][0]["end"] -= 1

    def gap(m):  # the second piece of a split tensor starts one element late
        m["tensors"][split]["pieces"][1]["begin"] += 1

    def swapped(m):  # a split tensor's pieces out of order
        m["tensors"][split]["pieces"].reverse()

    seeds = {
        "no-tensors": (plain, remove("tensors")),
        "tensors-array": (plain, lambda m: m.update(tensors=[])),
        "dtype": (plain, set_in(["dtype"], "F8")),
        "shape-huge": (plain, set_in(["shape"], [2**40, 2**40])),
        "shape-negative": (plain, set_in(["shape"], [-4])),
        "stage": (plain, set_in(["stage"], 2)),
        "no-pieces": (plain, set_in(["pieces"], [])),
        "piece-twice": (plain, twice),
        "piece-short": (plain, short),
        "piece-file": (plain, set_in(["pieces", 0, "file"], "rank-7.safetensors")),
        "piece-sha": (plain, set_in(["pieces", 0, "sha256"], "x")),
        "piece-key": (plain, set_in(["pieces", 0, "key"], "")),
        "piece-end-huge": (plain, set_in(["pieces", 0, "end"], 2**63)),
        "piece-gap": (sharded, gap),
        "pieces-swapped": (sharded, swapped),
        "no-sharded": (sharded, remove("sharded")),
        "sharded-false": (sharded, lambda m: m.update(sharded=False)),
        "sharded-string": (sharded, lambda m: m.update(sharded="true")),
        "replicas": (sharded, lambda m: m.update(replicas=3)),
        "no-optimizer": (plain, remove("optimizer")),
        "seed-number": (plain, lambda m: m.update(seed=5)),
        "no-ties": (tied, remove("ties")),
        "tie-unknown": (tied, lambda m: m["ties"].update({"embed_tokens.weight": "lm_head.weight"})),
        "tie-number": (tied, lambda m: m["ties"].update({"embed_tokens.weight": 3})),
        "world-size": (plain, lambda m: m.update(world_size=3)),
    }
    for name, (base, edit) in seeds.items():
        write("manifest", f"damaged-4-{name}.json", edited(base, edit))


TARGETS = {"safetensors": safetensors_seeds, "hf_config": hf_config_seeds,
           "tcp_wire": tcp_wire_seeds, "manifest": manifest_seeds}

if __name__ == "__main__":
    for target in sys.argv[1:] or TARGETS:
        TARGETS[target]()
        print(f"make_seeds: wrote the seeds of {target}")
