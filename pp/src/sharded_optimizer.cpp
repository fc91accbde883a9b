// Note [Sharded optimizer] (pipemat/pp/pipeline.h): each replica owns a slice of every gradient
// bucket, steps its pieces of the parameters and sends them to the others; the optimizer state
// of all of a rank's parameters loaded into this replica's pieces, or joined from the shards of a
// format-3 checkpoint.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "optimizer_state.h"
#include "pipeline_impl.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/core/error.h"
#include "pipemat/remat/memory.h"

namespace pipemat::pp {
namespace {

using detail::set_state_tensors;
using detail::state_tensors;

// A parameter's elements as one flat tensor sharing its storage (make_shards checks that the
// parameters are contiguous).
at::Tensor flat(const at::Tensor& t) { return t.detach().view({-1}); }

// `to`'s param groups take `from`'s options (the LR the schedule set, ...), where both have as
// many groups.
void copy_group_options(const torch::optim::Optimizer& from, torch::optim::Optimizer& to) {
  if (from.param_groups().size() != to.param_groups().size()) return;
  for (size_t g = 0; g < from.param_groups().size(); ++g)
    to.param_groups()[g].set_options(from.param_groups()[g].options().clone());
}

}  // namespace

std::vector<ShardSlice> shard_slices(const std::vector<int64_t>& numels, int replicas) {
  PIPEMAT_CHECK(replicas >= 1, ConfigError, "shard_slices: replicas must be >= 1, got ", replicas);
  int64_t total = 0;
  for (int64_t n : numels) {
    PIPEMAT_CHECK(n >= 0, ConfigError, "shard_slices: a parameter of ", n, " elements");
    total += n;
  }
  std::vector<ShardSlice> out(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    out[static_cast<size_t>(d)].begin = d * total / replicas;
    out[static_cast<size_t>(d)].end = (d + 1) * total / replicas;
  }
  int64_t at = 0;  // the parameter's first element in the bucket
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    if (n == 0) {
      int d = 0;
      while (d + 1 < replicas && out[static_cast<size_t>(d)].end <= at) ++d;
      out[static_cast<size_t>(d)].pieces.push_back({i, 0, 0});
      continue;
    }
    for (ShardSlice& s : out) {
      const int64_t lo = std::max(at, s.begin), hi = std::min(at + n, s.end);
      if (lo < hi) s.pieces.push_back({i, lo - at, hi - at});
    }
    at += n;
  }
  return out;
}

void Pipeline::Impl::make_shards() {
  const int replicas = options.data_group->world_size(), me = options.data_group->rank();
  optimized.clear();
  for (const auto& [stage, ranges] : buckets) {
    const std::vector<at::Tensor>& ps = stage_params.at(stage);
    std::vector<std::vector<PieceRef>>& refs = pieces_of[stage];
    refs.assign(ps.size(), {});
    for (size_t b = 0; b < ranges.size(); ++b) {
      const auto [first, end] = ranges[b];
      std::vector<int64_t> numels;
      for (size_t i = first; i < end; ++i) {
        PIPEMAT_CHECK(ps[i].is_contiguous(), ConfigError, "shard_optimizer: parameter ", i,
                      " of stage ", stage, " on rank ", rank,
                      " is not contiguous; the optimizer steps flat slices of the parameters");
        numels.push_back(ps[i].numel());
      }
      slices[stage].push_back(shard_slices(numels, replicas));
      std::vector<at::Tensor>& mine = my_pieces[stage].emplace_back();
      for (int d = 0; d < replicas; ++d) {
        const ShardSlice& slice = slices[stage][b][static_cast<size_t>(d)];
        for (size_t k = 0; k < slice.pieces.size(); ++k) {
          const ShardPiece& piece = slice.pieces[k];
          const size_t i = first + piece.param;
          refs[i].push_back({d, b, k});
          if (d != me) continue;
          mine.push_back(flat(ps[i]).slice(0, piece.begin, piece.end));
          optimized.push_back(mine.back());
        }
      }
    }
  }
}

void Pipeline::Impl::check_shardable() const {
  const bool elementwise = !detail::optimizer_kind(*optimizer).empty();
  PIPEMAT_CHECK(elementwise, ConfigError, "shard_optimizer on rank ", rank,
                ": PipelineOptions::optimizer made an optimizer other than torch's SGD, Adam, "
                "AdamW, RMSprop or Adagrad; a sharded optimizer steps slices of the parameters, "
                "which only an elementwise optimizer gives the unsharded bits for");
}

Pipeline::Impl::Bucket Pipeline::Impl::post_slices(int stage, size_t index) {
  const auto [first, end] = buckets.at(stage)[index];
  const std::vector<at::Tensor>& ps = stage_params.at(stage);
  const std::vector<ShardSlice>& of = slices.at(stage)[index];
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  Posted out;
  out.recvs.resize(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    const ShardSlice& slice = of[static_cast<size_t>(d)];
    if (slice.pieces.empty()) continue;  // d owns none of the bucket
    // [which pieces this replica produced (int64 0/1), their gradients or zeros, flat]
    std::vector<int64_t> produced;
    std::vector<at::Tensor> parts;
    for (const ShardPiece& piece : slice.pieces) {
      const at::Tensor& p = ps[first + piece.param];
      produced.push_back(p.grad().defined() ? 1 : 0);
      parts.push_back(p.grad().defined()
                          ? p.grad().detach().reshape({-1}).slice(0, piece.begin, piece.end)
                          : at::zeros({piece.end - piece.begin}, p.options()));
    }
    Tensors list{at::tensor(produced, at::kLong), at::cat(parts)};
    if (d == me) {
      out.mine = std::move(list);
      for (int from = 0; from < replicas; ++from) {
        if (from != me)
          out.recvs[static_cast<size_t>(from)] = comm::recv_tensors(group, from, kGradientsTag);
      }
    } else {
      out.sends.push_back(comm::send_tensors(group, d, kGradientsTag, std::move(list)));
    }
  }
  return {index, first, end, std::move(out)};
}

void Pipeline::Impl::finish_slices(int stage, Bucket& bucket, int64_t step) {
  const int replicas = options.data_group->world_size(), me = options.data_group->rank();
  const std::vector<at::Tensor>& ps = stage_params.at(stage);
  // The parameters keep no gradient: what this replica sums belongs to its pieces (the sent
  // lists are copies).
  for (size_t i = bucket.first; i < bucket.end; ++i) ps[i].mutable_grad().reset();
  const ShardSlice& slice = slices.at(stage)[bucket.index][static_cast<size_t>(me)];
  if (slice.pieces.empty()) {
    for (auto& w : bucket.posted.sends) w.wait();
    return;
  }
  const std::vector<Tensors> all = collect_data(bucket.posted, "gradients", step);
  const c10::Device device = ps[bucket.first].device();
  at::Tensor sum = all[0][1].to(device).clone();  // received ones are on the host
  for (int d = 1; d < replicas; ++d) sum.add_(all[static_cast<size_t>(d)][1].to(device));
  sum.div_(replicas);
  std::vector<at::Tensor>& pieces = my_pieces.at(stage)[bucket.index];
  int64_t at = 0;
  for (size_t k = 0; k < slice.pieces.size(); ++k) {
    const int64_t n = slice.pieces[k].end - slice.pieces[k].begin;
    bool any = false;  // no replica produced it: no gradient, as in one pipeline
    for (const Tensors& r : all) any = any || r[0].accessor<int64_t, 1>()[k] != 0;
    pieces[k].mutable_grad() = any ? sum.slice(0, at, at + n) : at::Tensor();
    at += n;
  }
}

void Pipeline::Impl::gather_parameters(int64_t step) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  struct Pending {
    std::vector<at::Tensor> into;  // views of the parameters the slice fills, in order
    comm::TensorListWork recv;
    int from = 0;
  };
  std::vector<Pending> pending;
  std::vector<comm::TensorListWork> sends;
  for (const auto& [stage, ranges] : buckets) {
    const std::vector<at::Tensor>& ps = stage_params.at(stage);
    for (size_t b = 0; b < ranges.size(); ++b) {
      for (int d = 0; d < replicas; ++d) {
        const ShardSlice& slice = slices.at(stage)[b][static_cast<size_t>(d)];
        if (slice.end == slice.begin) continue;
        if (d == me) {
          const at::Tensor mine = at::cat(my_pieces.at(stage)[b]).detach();
          for (int to = 0; to < replicas; ++to) {
            if (to != me) sends.push_back(comm::send_tensors(group, to, kGatherTag, {mine}));
          }
          continue;
        }
        Pending p{{}, comm::recv_tensors(group, d, kGatherTag), d};
        for (const ShardPiece& piece : slice.pieces) {
          if (piece.end > piece.begin)
            p.into.push_back(
                flat(ps[ranges[b].first + piece.param]).slice(0, piece.begin, piece.end));
        }
        pending.push_back(std::move(p));
      }
    }
  }
  c10::NoGradGuard no_grad;
  for (Pending& p : pending) {
    const Tensors got = p.recv.wait();
    int64_t n = 0;
    for (const auto& t : p.into) n += t.numel();
    const at::Tensor expected = at::empty({n}, p.into.front().options());
    check_same(got, {expected}, p.from, "updated parameters", step);
    int64_t at = 0;
    for (at::Tensor& t : p.into) {
      t.copy_(got[0].slice(0, at, at + t.numel()));
      at += t.numel();
    }
  }
  for (auto& w : sends) w.wait();
}

std::map<int, at::Tensor> Pipeline::Impl::sharded_norms(int64_t step) {
  comm::Transport& group = *options.data_group;
  const int replicas = group.world_size(), me = group.rank();
  // A parameter cut by a slice boundary: its later pieces' gradients to the replica holding its
  // first one, in stage then parameter order per sender.
  std::vector<Tensors> outgoing(static_cast<size_t>(replicas));
  std::vector<int> expected(static_cast<size_t>(replicas), 0);
  for (const auto& [s, refs] : pieces_of) {
    for (const std::vector<PieceRef>& r : refs) {
      for (size_t k = 1; k < r.size(); ++k) {  // one piece per replica: r[k] is not r[0]'s
        if (r[k].replica == me) {
          const at::Tensor& piece = my_pieces.at(s)[r[k].bucket][r[k].piece];
          if (piece.grad().defined())
            outgoing[static_cast<size_t>(r[0].replica)].push_back(piece.grad().detach());
        } else if (r[0].replica == me) {
          const at::Tensor& first = my_pieces.at(s)[r[0].bucket][r[0].piece];
          if (first.grad().defined()) ++expected[static_cast<size_t>(r[k].replica)];
        }
      }
    }
  }
  std::vector<comm::TensorListWork> sends;
  std::vector<comm::TensorListWork> recvs(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    if (!outgoing[static_cast<size_t>(d)].empty())
      sends.push_back(comm::send_tensors(group, d, kPiecesTag, outgoing[static_cast<size_t>(d)]));
    if (expected[static_cast<size_t>(d)] > 0)
      recvs[static_cast<size_t>(d)] = comm::recv_tensors(group, d, kPiecesTag);
  }
  std::vector<Tensors> incoming(static_cast<size_t>(replicas));
  for (int d = 0; d < replicas; ++d) {
    if (expected[static_cast<size_t>(d)] == 0) continue;
    incoming[static_cast<size_t>(d)] = recvs[static_cast<size_t>(d)].wait();
    PIPEMAT_CHECK(static_cast<int>(incoming[static_cast<size_t>(d)].size()) ==
                      expected[static_cast<size_t>(d)],
                  PipelineError, "data parallelism: replica ", d, " sent ",
                  incoming[static_cast<size_t>(d)].size(), " gradient pieces for ",
                  expected[static_cast<size_t>(d)], " to replica ", me, " on pipeline rank ", rank,
                  " in step ", step, "; every replica must build the same stages");
  }
  for (auto& w : sends) w.wait();

  // [has a gradient here (int64 0/1) per parameter of the rank, its norm or 0], stage order
  std::vector<int64_t> has;
  std::vector<at::Tensor> norms;
  std::vector<size_t> taken(static_cast<size_t>(replicas), 0);
  const at::TensorOptions on_device = at::TensorOptions().device(options.device);
  for (const auto& [s, ps] : stage_params) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::vector<PieceRef>& r = pieces_of.at(s)[i];
      const at::Tensor* first =
          r[0].replica == me ? &my_pieces.at(s)[r[0].bucket][r[0].piece] : nullptr;
      const bool mine = first != nullptr && first->grad().defined();
      has.push_back(mine ? 1 : 0);
      if (!mine) {
        norms.push_back(at::zeros({}, on_device.dtype(ps[i].scalar_type())));
        continue;
      }
      // The whole reduced gradient, in the parameter's shape: the norm unsharded takes.
      std::vector<at::Tensor> parts{first->grad()};
      for (size_t k = 1; k < r.size(); ++k) {  // the later pieces are other replicas'
        const int d = r[k].replica;
        const at::Tensor got =
            incoming[static_cast<size_t>(d)].at(taken[static_cast<size_t>(d)]++).to(options.device);
        const ShardPiece& piece =
            slices.at(s)[r[k].bucket][static_cast<size_t>(d)].pieces[r[k].piece];
        PIPEMAT_CHECK(got.dim() == 1 && got.numel() == piece.end - piece.begin &&
                          got.scalar_type() == first->grad().scalar_type(),
                      PipelineError, "data parallelism: replica ", d, " sent a piece of ",
                      got.numel(), " elements for elements [", piece.begin, ", ", piece.end,
                      ") of parameter ", i, " of stage ", s, " to replica ", me,
                      " on pipeline rank ", rank, " in step ", step,
                      "; every replica must build the same stages");
        parts.push_back(got);
      }
      const at::Tensor whole = parts.size() == 1 ? parts[0] : at::cat(parts);
      norms.push_back(whole.view(ps[i].sizes()).norm(2.0));
    }
  }
  std::map<int, at::Tensor> by_stage;
  if (norms.empty()) {
    for (const auto& [s, ps] : stage_params) by_stage[s] = at::empty({0}, on_device);
    return by_stage;
  }
  const std::vector<Tensors> all = exchange_data(
      kNormsTag, {at::tensor(has, at::kLong), at::stack(norms)}, "gradient norms", step);
  int64_t j = 0;
  for (const auto& [s, ps] : stage_params) {
    std::vector<at::Tensor> picked;
    for (size_t i = 0; i < ps.size(); ++i, ++j) {
      const Tensors& from = all[static_cast<size_t>(owner_of(s, i))];
      if (is_tie_follower(s, i)) continue;  // Note [Tied weights]: the weight counts once
      if (from[0].accessor<int64_t, 1>()[j] != 0) picked.push_back(from[1][j].to(options.device));
    }
    by_stage[s] = picked.empty() ? at::empty({0}, on_device) : at::stack(picked);
  }
  return by_stage;
}

std::unique_ptr<torch::optim::Optimizer> Pipeline::Impl::join_optimizer_shards(
    std::vector<torch::serialize::InputArchive>& shards, const std::string& where) const {
  const int replicas = static_cast<int>(shards.size());
  PIPEMAT_CHECK(replicas >= 1, PipelineError, where, ": no optimizer shards");
  auto read_long = [&](torch::serialize::InputArchive& a, const std::string& key, int d) {
    at::Tensor t;
    PIPEMAT_CHECK(a.try_read(key, t) && t.scalar_type() == at::kLong && t.dim() == 1, PipelineError,
                  where, ": optimizer shard ", d, " has no ", key, " entry");
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  // Every shard's layout: this rank's stages, their parameters' sizes, the same buckets.
  std::map<int, std::vector<std::pair<size_t, size_t>>> ranges;
  for (int d = 0; d < replicas; ++d) {
    torch::serialize::InputArchive& a = shards[static_cast<size_t>(d)];
    PIPEMAT_CHECK(read_long(a, "replica", d) == std::vector<int64_t>{d} &&
                      read_long(a, "replicas", d) == std::vector<int64_t>{replicas},
                  PipelineError, where, ": optimizer shard ", d, " is not replica ", d, " of ",
                  replicas);
    for (const auto& [s, ps] : stage_params) {
      std::vector<int64_t> numels;
      for (const at::Tensor& p : ps) numels.push_back(p.numel());
      PIPEMAT_CHECK(read_long(a, "numels/" + std::to_string(s), d) == numels, PipelineError, where,
                    ": optimizer shard ", d, " holds other parameters of stage ", s, " than rank ",
                    rank, " has; it was written by another model");
      std::vector<std::pair<size_t, size_t>> mine;
      size_t first = 0;
      for (int64_t n : read_long(a, "buckets/" + std::to_string(s), d)) {
        PIPEMAT_CHECK(n >= 1 && first + static_cast<size_t>(n) <= ps.size(), PipelineError, where,
                      ": optimizer shard ", d, " has a bucket layout that does not fit stage ", s);
        mine.emplace_back(first, first + static_cast<size_t>(n));
        first += static_cast<size_t>(n);
      }
      PIPEMAT_CHECK(first == ps.size(), PipelineError, where, ": optimizer shard ", d,
                    "'s buckets do not cover stage ", s);
      if (d == 0) ranges[s] = mine;
      PIPEMAT_CHECK(ranges[s] == mine, PipelineError, where, ": optimizer shards 0 and ", d,
                    " lay out stage ", s, "'s buckets differently");
    }
  }
  // The slices of the writing run, and each replica's optimizer over stand-ins of its pieces
  // (in the order make_shards gave them: stage, bucket, piece), loaded from its shard.
  std::map<int, std::vector<std::vector<ShardSlice>>> old;
  std::vector<std::vector<at::Tensor>> keys(static_cast<size_t>(replicas));
  for (const auto& [s, rs] : ranges) {
    const std::vector<at::Tensor>& ps = stage_params.at(s);
    for (const auto& [first, end] : rs) {
      std::vector<int64_t> numels;
      for (size_t i = first; i < end; ++i) numels.push_back(ps[i].numel());
      old[s].push_back(shard_slices(numels, replicas));
      for (int d = 0; d < replicas; ++d) {
        for (const ShardPiece& piece : old[s].back()[static_cast<size_t>(d)].pieces) {
          keys[static_cast<size_t>(d)].push_back(
              at::zeros({piece.end - piece.begin}, ps[first + piece.param].options()));
        }
      }
    }
  }
  std::vector<std::unique_ptr<torch::optim::Optimizer>> loaded;
  for (int d = 0; d < replicas; ++d) {
    torch::serialize::InputArchive state;
    PIPEMAT_CHECK(shards[static_cast<size_t>(d)].try_read("optimizer", state), PipelineError, where,
                  ": optimizer shard ", d, " has no optimizer state");
    loaded.push_back(options.optimizer(keys[static_cast<size_t>(d)]));
    PIPEMAT_CHECK(loaded.back() != nullptr, ConfigError,
                  "PipelineOptions::optimizer returned no optimizer on rank ", rank);
    loaded.back()->load(state);
  }
  std::unique_ptr<torch::optim::Optimizer> full = options.optimizer(params);
  PIPEMAT_CHECK(full != nullptr, ConfigError,
                "PipelineOptions::optimizer returned no optimizer on rank ", rank);
  copy_group_options(*loaded[0], *full);
  // Replica d's state of its next piece, or null where it has none.
  std::vector<size_t> next(static_cast<size_t>(replicas), 0);
  auto state_of = [&](int d) -> const torch::optim::OptimizerParamState* {
    const torch::optim::Optimizer& o = *loaded[static_cast<size_t>(d)];
    const at::Tensor& key = keys[static_cast<size_t>(d)].at(next[static_cast<size_t>(d)]++);
    auto it = o.state().find(key.unsafeGetTensorImpl());
    return it == o.state().end() ? nullptr : it->second.get();
  };
  // Every parameter's pieces joined, in the order each replica's pieces run (a slice's pieces
  // are in parameter order: one cursor per replica walks them).
  for (const auto& [s, rs] : ranges) {
    const std::vector<at::Tensor>& ps = stage_params.at(s);
    for (size_t b = 0; b < rs.size(); ++b) {
      std::vector<size_t> cursor(static_cast<size_t>(replicas), 0);
      for (size_t j = 0; j < rs[b].second - rs[b].first; ++j) {
        const at::Tensor& p = ps[rs[b].first + j];
        std::vector<const torch::optim::OptimizerParamState*> parts;
        for (int d = 0; d < replicas; ++d) {
          const std::vector<ShardPiece>& pieces = old[s][b][static_cast<size_t>(d)].pieces;
          size_t& c = cursor[static_cast<size_t>(d)];
          if (c < pieces.size() && pieces[c].param == j) ++c, parts.push_back(state_of(d));
        }
        const bool none = std::all_of(parts.begin(), parts.end(), [](auto* x) { return !x; });
        if (none) continue;  // never stepped
        const bool all = std::none_of(parts.begin(), parts.end(), [](auto* x) { return !x; });
        PIPEMAT_CHECK(all, PipelineError, where, ": parameter ", rs[b].first + j, " of stage ", s,
                      " has optimizer state in some of the shards holding its pieces only");
        std::vector<std::vector<at::Tensor>> cut;  // per piece its state tensors
        for (const auto* x : parts) cut.push_back(state_tensors(*x));
        std::vector<at::Tensor> fields(cut[0].size());
        for (size_t f = 0; f < fields.size(); ++f) {
          std::vector<at::Tensor> field;
          for (const auto& c : cut) field.push_back(c.at(f));
          if (!std::all_of(field.begin(), field.end(),
                           [](const at::Tensor& t) { return t.defined(); }))
            continue;  // unused by this optimizer (AdamW's max_exp_avg_sq without amsgrad)
          fields[f] = at::cat(field);
          PIPEMAT_CHECK(fields[f].numel() == p.numel(), PipelineError, where,
                        ": the optimizer state of parameter ", rs[b].first + j, " of stage ", s,
                        " does not have its size in the shards");
          fields[f] = fields[f].view(p.sizes());
        }
        std::unique_ptr<torch::optim::OptimizerParamState> joined = parts[0]->clone();
        set_state_tensors(*joined, fields);
        full->state()[p.unsafeGetTensorImpl()] = std::move(joined);
      }
    }
  }
  return full;
}

void Pipeline::Impl::load_optimizer_state(torch::serialize::InputArchive& archive) {
  if (!sharded()) {
    optimizer->load(archive);
    return;
  }
  std::unique_ptr<torch::optim::Optimizer> full = options.optimizer(params);
  PIPEMAT_CHECK(full != nullptr, ConfigError,
                "PipelineOptions::optimizer returned no optimizer on rank ", rank);
  full->load(archive);
  load_optimizer_state(*full);
}

void Pipeline::Impl::load_optimizer_state(const torch::optim::Optimizer& full) {
  optimizer->state().clear();
  copy_group_options(full, *optimizer);
  if (!sharded()) {
    for (const auto& [key, state] : full.state()) optimizer->state()[key] = state->clone();
    return;
  }
  const int me = options.data_group->rank();
  for (const auto& [s, per_bucket] : slices) {
    const std::vector<at::Tensor>& ps = stage_params.at(s);
    for (size_t b = 0; b < per_bucket.size(); ++b) {
      const ShardSlice& slice = per_bucket[b][static_cast<size_t>(me)];
      for (size_t k = 0; k < slice.pieces.size(); ++k) {
        const ShardPiece& piece = slice.pieces[k];
        const at::Tensor& p = ps[buckets.at(s)[b].first + piece.param];
        auto it = full.state().find(p.unsafeGetTensorImpl());
        if (it == full.state().end()) continue;
        std::unique_ptr<torch::optim::OptimizerParamState> mine = it->second->clone();
        std::vector<at::Tensor> fields = state_tensors(*it->second);
        for (at::Tensor& f : fields) {
          if (f.defined()) f = f.reshape({-1}).slice(0, piece.begin, piece.end).clone();
        }
        set_state_tensors(*mine, fields);
        optimizer->state()[my_pieces.at(s)[b][k].unsafeGetTensorImpl()] = std::move(mine);
      }
    }
  }
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> tensors;
  for (const auto& [key, state] : optimizer.state()) {
    for (at::Tensor& t : state_tensors(*state)) tensors.push_back(std::move(t));
  }
  return remat::storage_bytes(tensors);
}

}  // namespace pipemat::pp
