"""transformers' side of tests/weights/hf_config_test.cpp.

  hf_config_oracle.py DIR...   loads DIR/config.json with transformers' LlamaConfig.from_pretrained
                               for every DIR and prints one JSON object: {DIR: the values that
                               decide the model, or {"error": the exception's type}}
Exit 3: transformers is not installed (the test is skipped, saying so).
"""
import json
import logging
import sys
import warnings

try:
    from transformers import LlamaConfig
    from transformers.utils import logging as hf_logging
except ImportError as e:  # the test skips with this reason
    print(f"hf_config_oracle: {e}; scripts/install-deps.sh installs transformers")
    sys.exit(3)

hf_logging.set_verbosity_error()
logging.disable(logging.WARNING)
warnings.simplefilter("ignore")

out = {}
for d in sys.argv[1:]:
    try:
        c = LlamaConfig.from_pretrained(d)
        rope = c.rope_parameters or {}
        out[d] = {
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": rope.get("rope_theta"),
            "rope_type": rope.get("rope_type"),
            "tie_word_embeddings": c.tie_word_embeddings,
            "hidden_act": c.hidden_act,
            "attention_bias": c.attention_bias,
            "mlp_bias": c.mlp_bias,
        }
    except Exception as e:  # noqa: BLE001 - the test compares refusals too
        out[d] = {"error": type(e).__name__}
print(json.dumps(out))
