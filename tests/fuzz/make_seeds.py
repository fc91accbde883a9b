#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (Note [Fuzz targets] in tests/fuzz/CMakeLists.txt).

  make_seeds.py [safetensors|hf_config|tcp_wire ...]   (default: every one)

Small valid inputs made by the reference implementations (Python's safetensors package,
transformers' LlamaConfig) and damaged copies of them. Run with the project's Python
(/opt/pipemat-venv/bin/python), which has both. Seeds named crash-* or finding-* are inputs that
once found something: this script never writes or removes them.
"""
import json
import os
import struct
import sys

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
    write("hf_config", "pipemat-export.json", b"""{
  "architectures": [
    "LlamaForCausalLM"
  ],
  "model_type": "llama",
  "hidden_size": 16,
  "intermediate_size": 32,
  "num_hidden_layers": 4,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 8,
  "rope_theta": 500000.0,
  "rope_parameters": {
    "rope_theta": 500000.0,
    "rope_type": "default"
  },
  "rms_norm_eps": 1e-05,
  "vocab_size": 256,
  "max_position_embeddings": 16,
  "tie_word_embeddings": true,
  "hidden_act": "silu",
  "attention_bias": false,
  "mlp_bias": false,
  "torch_dtype": "float32"
}
""")
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


TARGETS = {"safetensors": safetensors_seeds, "hf_config": hf_config_seeds}

if __name__ == "__main__":
    for target in sys.argv[1:] or TARGETS:
        TARGETS[target]()
        print(f"make_seeds: wrote the seeds of {target}")
