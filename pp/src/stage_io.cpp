// What goes into the stages and across their boundaries: a step's batch split into
// micro-batches, the boundary signature checks on both sides (Note [Stage boundary signature])
// and the detached copies that go on the wire.

#include <memory>
#include <string>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"

namespace pipemat::pp {

namespace {

Signature signature_of(const Tensors& ts) {
  Signature s;
  for (const auto& t : ts) s.push_back(t.defined() ? static_cast<int>(t.scalar_type()) : -1);
  return s;
}

std::string describe(const Tensors& ts) {
  std::string out = "[";
  for (size_t i = 0; i < ts.size(); ++i) {
    if (i) out += ", ";
    out += ts[i].defined() ? comm::TensorMeta::of(ts[i]).to_string() : "undefined";
  }
  return out + "] (" + std::to_string(ts.size()) + (ts.size() == 1 ? " tensor)" : " tensors)");
}

std::string describe(const Signature& sig) {
  std::string out = "[";
  for (size_t i = 0; i < sig.size(); ++i) {
    if (i) out += ", ";
    out += sig[i] < 0 ? "undefined" : comm::dtype_name(static_cast<at::ScalarType>(sig[i]));
  }
  return out + "] (" + std::to_string(sig.size()) + (sig.size() == 1 ? " tensor)" : " tensors)");
}

}  // namespace

// A data source over `batch` split along dim 0 into `parts` micro-batches (the tensors this
// rank uses: inputs on the first stage's rank, targets on the last's). It holds the chunks.
DataSource Pipeline::Impl::split_batch(const MicroBatch& batch, int64_t parts,
                                       const char* call) const {
  PIPEMAT_CHECK(parts >= 1, ConfigError, call, ": micro_batches must be at least 1, got ", parts);
  auto split = [&](const Tensors& ts, const char* what) {
    std::vector<Tensors> out(parts);
    for (size_t j = 0; j < ts.size(); ++j) {
      const at::Tensor& t = ts[j];
      PIPEMAT_CHECK(t.defined() && t.dim() > 0 && t.size(0) % parts == 0, PipelineError, call, ": ",
                    what, "[", j, "] is ",
                    t.defined() ? comm::TensorMeta::of(t).to_string() : "undefined",
                    ", whose dim 0 does not split into ", parts,
                    " micro-batches; give a batch whose dim 0 is a multiple of them");
      auto chunks = t.chunk(parts, 0);
      for (int64_t i = 0; i < parts; ++i) out[i].push_back(chunks[i]);
    }
    return out;
  };
  auto inputs = std::make_shared<std::vector<Tensors>>(
      is_first_stage_rank() ? split(batch.inputs, "inputs") : std::vector<Tensors>(parts));
  auto targets = std::make_shared<std::vector<Tensors>>(
      is_last_stage_rank() ? split(batch.targets, "targets") : std::vector<Tensors>(parts));
  return [inputs, targets](int64_t, int64_t i) { return MicroBatch{(*inputs)[i], (*targets)[i]}; };
}

// Note [Stage boundary signature]: learns boundary `b` from its first message; afterwards
// returns the learned signature when `ts` differs from it (nullptr when it matches).
const Signature* Pipeline::Impl::boundary_mismatch(int b, const Tensors& ts) {
  Signature sig = signature_of(ts);
  auto [it, fresh] = boundary.emplace(b, sig);
  return fresh || it->second == sig ? nullptr : &it->second;
}

// The sender's side. Returns the error text ("" if fine).
std::string Pipeline::Impl::check_sent(int stage, int64_t step, int64_t micro_batch,
                                       const Tensors& out) {
  const Signature* learned = boundary_mismatch(stage, out);
  if (learned == nullptr) return "";
  return ::pipemat::detail::concat(
      "stage ", stage, " on rank ", rank, " returned ", describe(out), " for micro-batch ",
      micro_batch, " of step ", step, ", but earlier micro-batches on its boundary to stage ",
      stage + 1, " carried ", describe(*learned),
      "; every micro-batch must pass the same number of tensors with the same dtypes (shapes "
      "may change)");
}

// The receiver's side: `from_rank` sent `in` over boundary stage - 1 -> stage.
void Pipeline::Impl::check_received(int stage, int from_rank, int64_t step, int64_t micro_batch,
                                    const Tensors& in) {
  const Signature* learned = boundary_mismatch(stage - 1, in);
  if (learned == nullptr) return;
  PIPEMAT_THROW(PipelineError, "stage ", stage, " on rank ", rank, " received ", describe(in),
                " from stage ", stage - 1, " on rank ", from_rank, " for micro-batch ", micro_batch,
                " of step ", step,
                ", but earlier micro-batches on this boundary "
                "carried ",
                describe(*learned),
                "; every micro-batch must pass the same number of tensors with the same dtypes "
                "(shapes may change)");
}

// Detached copies with the same requires_grad: what goes on the wire, and what a receive of
// it gives (the next stage's leaves when it sits on this rank).
Tensors Pipeline::Impl::as_received(const Tensors& out) {
  Tensors in;
  for (const auto& t : out) {
    if (!t.defined()) {
      in.emplace_back();
      continue;
    }
    in.push_back(t.detach().requires_grad_(t.requires_grad()));
  }
  return in;
}

}  // namespace pipemat::pp
