// Fuzz target: a Hugging Face Llama config.json (weights::parse_llama_config; Note [Llama
// config.json] and Note [Fuzz targets] in tests/fuzz/CMakeLists.txt).
//
// Bad input must end in a WeightsError. What the reader accepts must be a llama it models (sizes
// >= 1, heads dividing hidden, key/value heads dividing heads, a finite epsilon and RoPE base
// > 0), and the writer's config.json of it must read back equal.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_expect.h"
#include "pipemat/weights/hf_config.h"

namespace {

void expect(bool ok, const char* what) { pipemat::fuzz::expect(ok, "hf_config", what); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  pipemat::weights::LlamaConfig c;
  try {
    c = pipemat::weights::parse_llama_config(text, "config.json");
  } catch (const pipemat::WeightsError&) {
    return 0;  // bad input, refused as documented
  }
  expect(c.vocab_size >= 1 && c.hidden_size >= 1 && c.intermediate_size >= 1 &&
             c.num_hidden_layers >= 1 && c.max_position_embeddings >= 1,
         "sizes >= 1");
  expect(c.num_attention_heads >= 1 && c.hidden_size % c.num_attention_heads == 0,
         "heads divide hidden");
  expect(c.num_key_value_heads >= 1 && c.num_attention_heads % c.num_key_value_heads == 0,
         "key/value heads divide heads");
  expect(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0, "epsilon > 0");
  expect(std::isfinite(c.rope_theta) && c.rope_theta > 0, "RoPE base > 0");
  // Written, read back equal (with nothing defaulted: the writer gives every field).
  const pipemat::weights::LlamaConfig back =
      pipemat::weights::parse_llama_config(pipemat::weights::write_llama_config(c), "written");
  c.defaulted.clear();
  expect(back == c, "the written config.json reads back equal");
  return 0;
}
