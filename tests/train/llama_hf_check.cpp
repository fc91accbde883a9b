// The pipemat side of tests/train/llama_oracle.py and scripts/bench_smollm.py: loads the llama
// of a config (its training.init_from, e.g. a Hugging Face directory) as one stage, and writes to
// a safetensors file the token windows the config's training reads (ids.<step>.<micro-batch> and
// next.<step>.<micro-batch> of steps [0, STEPS): the text's bytes, or its token ids with
// data.tokenizer, read by load_token_data as the training reads them), the logits of the first
// micro-batch's ids ("logits", float32) and their loss ("loss", the training's loss of that
// micro-batch).
//
//   llama_hf_check CONFIG.yaml OUT.safetensors STEPS

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "pipemat/models/gpt.h"
#include "pipemat/pp/pipeline.h"
#include "pipemat/train/config.h"
#include "pipemat/train/model_run.h"
#include "pipemat/train/text_data.h"
#include "pipemat/train/weights.h"
#include "pipemat/weights/safetensors.h"

namespace {

using pipemat::weights::Dtype;
using pipemat::weights::TensorBytes;

TensorBytes bytes_of(const std::string& name, const at::Tensor& t, Dtype dtype) {
  return {name, dtype, t.sizes().vec(),
          std::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())};
}

int run(const std::string& config_path, const std::string& out, int64_t steps) {
  namespace train = pipemat::train;
  const train::TrainConfig config = train::load_config(config_path);
  const train::ModelRun run = train::make_model_weights(config, 1);
  const pipemat::pp::PipelineStage stage = run.stage(0);
  stage.module->eval();
  train::load_weights(config.training.init_from, "training.init_from",
                      train::model_weight_shapes(run, config.model.kind), run.global_name,
                      config.model.kind, {{0, stage.module.get()}});

  const train::TokenData data =
      train::load_token_data(config.data, config.model.vocab, config.model.seq_len + 1);
  std::vector<at::Tensor> keep;
  std::vector<TensorBytes> tensors;
  at::Tensor first_ids, first_next;
  for (int64_t step = 0; step < steps; ++step) {
    for (int64_t mb = 0; mb < config.schedule.micro_batches; ++mb) {
      auto [ids, next] = train::token_windows(*data.train, config.model.batch, config.model.seq_len,
                                              config.training.seed, step, mb);
      if (step == 0 && mb == 0) {
        first_ids = ids;
        first_next = next;
      }
      const std::string suffix = "." + std::to_string(step) + "." + std::to_string(mb);
      keep.push_back(ids.contiguous());
      tensors.push_back(bytes_of("ids" + suffix, keep.back(), Dtype::kI64));
      keep.push_back(next.contiguous());
      tensors.push_back(bytes_of("next" + suffix, keep.back(), Dtype::kI64));
    }
  }
  c10::AutoGradMode no_grad(false);
  keep.push_back(stage.forward({first_ids}).at(0).contiguous());
  const at::Tensor logits = keep.back();
  tensors.push_back(bytes_of("logits", logits, Dtype::kF32));
  keep.push_back(pipemat::models::gpt_loss(logits, first_next).reshape({1}).contiguous());
  tensors.push_back(bytes_of("loss", keep.back(), Dtype::kF32));
  pipemat::weights::write_safetensors_file(out, std::move(tensors), {});
  std::cout << "llama_hf_check: " << run.summary << "; loss " << keep.back().item<float>() << " -> "
            << out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: llama_hf_check CONFIG.yaml OUT.safetensors STEPS\n";
    return 2;
  }
  try {
    return run(argv[1], argv[2], std::atoll(argv[3]));
  } catch (const std::exception& e) {
    std::cerr << "llama_hf_check: error: " << e.what() << "\n";
    return 1;
  }
}
