// Note [Tied weights] (pipemat/pp/pipeline.h): one weight held as a copy by several stages; the
// copies are checked equal at the first step and given the sum of their gradients every step.

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/digest.h"
#include "pipemat/core/error.h"
#include "pipemat/core/format.h"
#include "pipemat/core/parse.h"
#include "pipemat/pp/device.h"

namespace pipemat::pp {
namespace {

// One declaration as it travels: stage, key, name, dtype, shape and the SHA-256 of its bytes.
struct Declaration {
  int stage = 0;
  int rank = 0;
  std::string key, name, dtype, shape, digest;
};

std::string shape_text(const at::Tensor& t) {
  std::vector<std::string> dims;
  for (int64_t d : t.sizes()) dims.push_back(std::to_string(d));
  return "[" + join(dims, ", ") + "]";
}

std::string digest_of(const at::Tensor& t) {
  const at::Tensor host = t.detach().to(at::kCPU).contiguous();
  return sha256_hex(std::string_view(static_cast<const char*>(host.data_ptr()),
                                     static_cast<size_t>(host.nbytes())));
}

std::string where(const Declaration& d) {
  return ::pipemat::detail::concat("stage ", d.stage, " (rank ", d.rank, ", '", d.name, "')");
}

}  // namespace

void Pipeline::Impl::check_ties() {
  if (ties_checked) return;
  ties_checked = true;
  // "stage \t key \t name \t dtype \t shape \t sha256", one line per copy on this rank.
  std::vector<std::string> mine;
  for (const auto& [s, stage] : stages) {
    for (const auto& [name, key] : stage.tied) {
      const at::Tensor p = stage.module->named_parameters()[name];
      mine.push_back(::pipemat::detail::concat(s, "\t", key, "\t", name, "\t",
                                               c10::toString(p.scalar_type()), "\t", shape_text(p),
                                               "\t", digest_of(p)));
    }
  }
  std::vector<std::string> all = lines_of_all_ranks(transport, tie_declarations_tag(), mine);
  std::map<std::string, std::vector<Declaration>> by_key;
  for (const std::string& line : all) {
    const std::vector<std::string> f = split(line, '\t');
    PIPEMAT_CHECK(f.size() == 6, CommError, "tied weights on rank ", rank,
                  ": a peer sent a malformed declaration");
    const std::optional<int64_t> stage = parse_int_in(f[0], 0, plan.stages_count - 1);
    PIPEMAT_CHECK(stage.has_value(), CommError, "tied weights on rank ", rank,
                  ": a peer declared a copy on stage '", f[0], "', not a stage of this pipeline");
    Declaration d;
    d.stage = static_cast<int>(*stage);
    d.rank = plan.rank_of(d.stage);
    d.key = f[1];
    d.name = f[2];
    d.dtype = f[3];
    d.shape = f[4];
    d.digest = f[5];
    by_key[d.key].push_back(std::move(d));
  }
  ties.clear();
  tie_followers.clear();
  for (auto& [key, copies] : by_key) {
    std::sort(copies.begin(), copies.end(),
              [](const Declaration& a, const Declaration& b) { return a.stage < b.stage; });
    PIPEMAT_CHECK(copies.size() >= 2, PipelineError, "tied weight '", key, "': only ",
                  where(copies.front()),
                  " declares it; a tie needs a copy on every stage that uses the weight (two or "
                  "more stages; a stage that uses it twice shares the parameter and declares "
                  "nothing)");
    const Declaration& first = copies.front();
    Tie tie;
    tie.key = key;
    for (const Declaration& d : copies) {
      PIPEMAT_CHECK(d.stage != first.stage || &d == &first, PipelineError, "tied weight '", key,
                    "': stage ", d.stage, " declares two copies ('", first.name, "' and '", d.name,
                    "'); a stage holds one copy of a weight");
      PIPEMAT_CHECK(d.dtype == first.dtype && d.shape == first.shape, PipelineError,
                    "tied weight '", key, "': the copy on ", where(d), " is ", d.dtype, " ",
                    d.shape, " but the one on ", where(first), " is ", first.dtype, " ",
                    first.shape, "; every copy of a tied weight has one shape and dtype");
      PIPEMAT_CHECK(d.digest == first.digest, PipelineError, "tied weight '", key,
                    "': the copy on ", where(d), " differs from the one on ", where(first),
                    " (SHA-256 ", d.digest.substr(0, 16), "... against ",
                    first.digest.substr(0, 16),
                    "...); the copies must start equal (build them from one tensor, and load "
                    "both from the same weights)");
      const at::Tensor p =
          d.rank == rank ? stages.at(d.stage).module->named_parameters()[d.name] : at::Tensor();
      tie.copies.push_back({d.stage, d.rank, d.name, p});
      if (&d == &first || d.rank != rank) continue;
      // A follower on this rank: its index in the stage's parameters, for the norm.
      const std::vector<at::Tensor>& ps = stage_params.at(d.stage);
      for (size_t i = 0; i < ps.size(); ++i) {
        if (ps[i].is_same(p)) tie_followers.insert({d.stage, i});
      }
    }
    ties.push_back(std::move(tie));
  }
}

void Pipeline::Impl::sum_tied_gradients(int64_t step) {
  if (ties.empty()) return;
  // To each peer: for every tie (key order) with copies on both sides, this rank's copies'
  // [has a gradient (int64 0/1), the gradient or zeros] in stage order.
  std::map<int, Tensors> outgoing;
  std::map<int, int64_t> expected;  // tensors from each peer
  for (const Tie& tie : ties) {
    std::vector<const TieCopy*> here;
    std::map<int, int64_t> there;
    for (const TieCopy& c : tie.copies) {
      if (c.rank == rank) {
        here.push_back(&c);
      } else {
        ++there[c.rank];
      }
    }
    if (here.empty()) continue;
    for (const auto& [peer, count] : there) {
      expected[peer] += 2 * count;
      for (const TieCopy* c : here) {
        const at::Tensor& p = c->param;
        const bool has = p.grad().defined();
        outgoing[peer].push_back(at::tensor({int64_t{has ? 1 : 0}}, at::kLong));
        outgoing[peer].push_back(has ? p.grad().detach() : at::zeros_like(p));
      }
    }
  }
  std::vector<comm::TensorListWork> sends;
  std::map<int, comm::TensorListWork> recvs;
  for (auto& [peer, list] : outgoing) {
    sends.push_back(comm::send_tensors(transport, peer, tie_gradients_tag(), on_host(list)));
    recvs[peer] = comm::recv_tensors(transport, peer, tie_gradients_tag());
  }
  std::map<int, Tensors> incoming;
  std::map<int, size_t> taken;
  for (auto& [peer, work] : recvs) {
    incoming[peer] = work.wait();
    PIPEMAT_CHECK(static_cast<int64_t>(incoming[peer].size()) == expected[peer], PipelineError,
                  "tied weights: rank ", peer, " sent ", incoming[peer].size(),
                  " tensors of tied gradients to rank ", rank, " in step ", step, " for ",
                  expected[peer], "; every rank must build the same stages");
  }
  for (const Tie& tie : ties) {
    bool mine = false;
    for (const TieCopy& c : tie.copies) mine = mine || c.rank == rank;
    if (!mine) continue;
    // Every copy's gradient in stage order: this rank's own, the others' as received.
    at::Tensor sum;
    bool any = false;
    at::Tensor like;
    for (const TieCopy& c : tie.copies) {
      at::Tensor g;
      bool has = false;
      if (c.rank == rank) {
        const at::Tensor& p = c.param;
        like = p;
        has = p.grad().defined();
        g = has ? p.grad().detach() : at::Tensor();
      } else {
        Tensors& got = incoming.at(c.rank);
        size_t& k = taken[c.rank];
        const at::Tensor flag = got.at(k++);
        const at::Tensor value = got.at(k++);
        PIPEMAT_CHECK(flag.scalar_type() == at::kLong && flag.numel() == 1, PipelineError,
                      "tied weights: rank ", c.rank, " sent a malformed gradient of '", tie.key,
                      "' in step ", step);
        has = flag.item<int64_t>() != 0;
        g = has ? value.to(options.device) : at::Tensor();
      }
      if (!has) continue;  // adds nothing
      any = true;
      if (sum.defined()) {
        sum.add_(g);
      } else {
        sum = g.clone();
      }
    }
    if (!any) continue;
    PIPEMAT_CHECK(sum.sizes() == like.sizes() && sum.scalar_type() == like.scalar_type(),
                  PipelineError, "tied weights: a peer sent a gradient of '", tie.key,
                  "' of another shape or dtype in step ", step);
    bool first_here = true;
    for (const TieCopy& c : tie.copies) {
      if (c.rank != rank) continue;
      at::Tensor p = c.param;
      p.mutable_grad() = first_here ? sum : sum.clone();
      first_here = false;
    }
  }
  for (auto& w : sends) w.wait();
}

}  // namespace pipemat::pp
