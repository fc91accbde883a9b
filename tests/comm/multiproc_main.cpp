// comm_multiproc: real multi-process tests of the comm module (one process per rank).
//
//   mpiexec -n N comm_multiproc <scenario> --transport mpi
//   comm_multiproc <scenario> --transport tcp --spawn N      (starts N local processes)
//   comm_multiproc expect-failure <seconds> -- <command...> (the command must fail, in time)
//
// Scenarios: exchange, mismatch, silent, alive (mpi), peer_exit, bench, progress, idle (mpi),
// driven (mpi), groups (mpi, 4 ranks). Exit code 0 = pass. Every check prints "rank R: ..." on
// failure.

#include <ATen/ATen.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pipemat/comm/bench.h"
#include "pipemat/comm/device_lane.h"
#include "pipemat/comm/launcher.h"
#include "pipemat/comm/tensor.h"
#include "pipemat/comm/transport.h"
#include "pipemat/core/error.h"

namespace pc = pipemat::comm;
using pc::Clock;

namespace {

int g_rank = -1;
int g_failures = 0;

#define CHECK_THAT(cond, msg)                                                           \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::cerr << "rank " << g_rank << ": check failed: " #cond " -- " << msg << "\n"; \
      ++g_failures;                                                                     \
    }                                                                                   \
  } while (false)

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void scenario_exchange(pc::Transport& t) {
  const int world = t.world_size();
  const int me = t.rank();
  // 1. Every pair, in order, 16 messages per (peer, tag), receives posted before the sends.
  constexpr int kCount = 16;
  std::vector<int> in(static_cast<size_t>(world * 2 * kCount), -1), out(in.size());
  std::vector<pc::WorkPtr> works;
  for (int peer = 0; peer < world; ++peer) {
    if (peer == me) continue;
    for (int tag = 0; tag < 2; ++tag) {
      for (int i = 0; i < kCount; ++i) {
        size_t slot = static_cast<size_t>((peer * 2 + tag) * kCount + i);
        works.push_back(t.recv(peer, tag, &in[slot], sizeof(int)));
      }
    }
  }
  for (int i = 0; i < kCount; ++i) {
    for (int peer = 0; peer < world; ++peer) {
      if (peer == me) continue;
      for (int tag = 0; tag < 2; ++tag) {
        size_t slot = static_cast<size_t>((peer * 2 + tag) * kCount + i);
        out[slot] = me * 100000 + tag * 1000 + i;
        works.push_back(t.send(peer, tag, &out[slot], sizeof(int)));
      }
    }
  }
  for (auto& w : works) w->wait();
  for (int peer = 0; peer < world; ++peer) {
    if (peer == me) continue;
    for (int tag = 0; tag < 2; ++tag) {
      for (int i = 0; i < kCount; ++i) {
        size_t slot = static_cast<size_t>((peer * 2 + tag) * kCount + i);
        CHECK_THAT(in[slot] == peer * 100000 + tag * 1000 + i, "pair message from "
                                                                   << peer << " tag " << tag << " #"
                                                                   << i << " got " << in[slot]);
      }
    }
  }
  // 2. Tensors around the ring: several dtypes, shapes, layouts, all receive flavours.
  const int next = (me + 1) % world;
  const int prev = (me + world - 1) % world;
  auto make = [](int r, int i) {
    at::Tensor base = at::arange(48, at::kDouble).reshape({4, 12}) * (r + 1) + i;
    switch (i % 4) {
      case 0:
        return base.to(at::kFloat);
      case 1:
        return base.to(at::kLong).t();  // non-contiguous
      case 2:
        return base.to(at::kBFloat16).slice(1, 0, 12, 2);
      default:
        return base.to(at::kInt).reshape({2, 2, 12});
    }
  };
  constexpr int kTensors = 40;
  std::vector<pc::TensorWork> recvs, sends;
  for (int i = 0; i < kTensors; ++i) {
    at::Tensor expect = make(prev, i);
    if (i % 3 == 0) {
      recvs.push_back(pc::recv_tensor(t, prev, 100 + i % 5));
    } else if (i % 3 == 1) {
      recvs.push_back(pc::recv_tensor(t, prev, 100 + i % 5, pc::TensorMeta::of(expect)));
    } else {
      recvs.push_back(pc::recv_tensor_into(t, prev, 100 + i % 5, at::empty_like(expect)));
    }
  }
  for (int i = 0; i < kTensors; ++i)
    sends.push_back(pc::send_tensor(t, next, 100 + i % 5, make(me, i)));
  for (int i = 0; i < kTensors; ++i) {
    at::Tensor got = recvs[static_cast<size_t>(i)].wait();
    CHECK_THAT(at::equal(got, make(prev, i)), "tensor #" << i << " from rank " << prev);
  }
  for (auto& s : sends) s.wait();
  // 3. A large message (rendezvous protocols).
  at::Tensor big = at::full({1 << 20}, float(me));
  auto r = pc::recv_tensor(t, prev, 200, pc::TensorMeta{at::kFloat, {1 << 20}});
  pc::send_tensor(t, next, 200, big).wait();
  at::Tensor got = r.wait();
  CHECK_THAT(got[12345].item<float>() == float(prev), "big tensor from rank " << prev);
  t.barrier();
}

void scenario_mismatch(pc::Transport& t) {
  if (t.rank() == 0) {
    pc::send_tensor(t, 1, 5, at::ones({4, 8})).wait();
  } else if (t.rank() == 1) {
    try {
      pc::recv_tensor(t, 0, 5, pc::TensorMeta{at::kFloat, {4, 16}}).wait();
      CHECK_THAT(false, "expected a tensor mismatch");
    } catch (const pipemat::CommError& e) {
      std::cerr << "rank 1 got the expected error: " << e.what() << "\n";
      CHECK_THAT(contains(e.what(),
                          "tensor mismatch on tag 5: rank 0 sent float32 [4, 8], rank 1 "
                          "expected float32 [4, 16]"),
                 e.what());
    }
  }
  t.barrier();
}

// Waits for `w` (wait(*timeout), or wait() without one) and checks that it times out with a
// message holding `text`, after `least` to `most` seconds.
void expect_timeout(const pc::WorkPtr& w, std::optional<std::chrono::milliseconds> timeout,
                    const std::string& text, double least, double most) {
  const auto start = Clock::now();
  try {
    if (timeout) {
      w->wait(*timeout);
    } else {
      w->wait();
    }
    CHECK_THAT(false, "expected a timeout");
  } catch (const pipemat::TimeoutError& e) {
    std::cerr << "rank 0 got the expected error: " << e.what() << "\n";
    CHECK_THAT(contains(e.what(), text), e.what());
  }
  const double waited = seconds_since(start);
  CHECK_THAT(waited >= least && waited < most, "waited " << waited << " s");
}

void scenario_silent(pc::Transport& t) {
  if (t.rank() == 0) {
    int value = 0;
    expect_timeout(t.recv(1, 9, &value, sizeof(value)), std::chrono::milliseconds(1000),
                   "timed out after 1000 ms waiting for recv of 4 bytes from rank 1 with tag 9 on "
                   "rank 0",
                   0.9, 5.0);
  }
  t.barrier();
}

// Note [Liveness of a peer]: rank 1 is idle but alive (it waits for tag 10), so rank 0's wait()
// for tag 9, which rank 1 never sends, lasts twice the timeout (main sets 2 s; beats every
// 500 ms) and says that rank 1 is alive. Then rank 0 sends tag 10.
void scenario_alive(pc::Transport& t) {
  int value = 0;
  if (t.rank() == 0) {
    expect_timeout(t.recv(1, 9, &value, sizeof(value)), std::nullopt,
                   "from rank 1 with tag 9 on rank 0 (mpi). Rank 1 is alive (it was last heard "
                   "from ",
                   4.0, 10.0);
    t.send(1, 10, &value, sizeof(value))->wait();
  } else if (t.rank() == 1) {
    t.recv(0, 10, &value, sizeof(value))->wait(std::chrono::seconds(30));
  }
  t.barrier();
}

int scenario_peer_exit(pc::Transport& t) {
  if (t.rank() == 1) {
    for (int i = 0; i < 3; ++i) pc::send_tensor(t, 0, 3, at::full({256}, float(i))).wait();
    std::cerr << "rank 1: exiting abruptly mid-exchange\n";
    ::_exit(0);  // no transport shutdown, no MPI_Finalize: as if the process died
  }
  if (t.rank() != 0) return 0;
  for (int i = 0; i < 3; ++i) {
    at::Tensor got = pc::recv_tensor(t, 1, 3).wait();
    CHECK_THAT(got[0].item<float>() == float(i), "message " << i);
  }
  const auto start = Clock::now();
  try {
    pc::recv_tensor(t, 1, 3).wait(std::chrono::seconds(30));
    CHECK_THAT(false, "expected CommError after rank 1 exited");
  } catch (const pipemat::TimeoutError& e) {
    CHECK_THAT(false, "expected a prompt CommError, got a timeout: " << e.what());
  } catch (const pipemat::CommError& e) {
    std::cerr << "rank 0 got the expected error after " << seconds_since(start)
              << " s: " << e.what() << "\n";
    CHECK_THAT(contains(e.what(), "rank 1 closed the connection"), e.what());
    CHECK_THAT(contains(e.what(),
                        "while rank 0 was waiting for recv (any size) from rank 1 with "
                        "tag 3"),
               e.what());
  }
  CHECK_THAT(seconds_since(start) < 10.0, "took " << seconds_since(start) << " s");
  return 0;
}

void scenario_bench(pc::Transport& t) {
  pc::P2PBenchOptions options;
  options.sizes = {4096, 1 << 20};
  options.iters = 20;
  auto results = pc::run_p2p_bench(t, options);
  if (t.rank() == 0) {
    std::cout << pc::format_p2p_json(pc::to_string(t.kind()), results) << "\n";
    CHECK_THAT(results.size() == 2, "results");
    for (const auto& r : results) {
      CHECK_THAT(r.gbps > 0 && r.raw_gbps > 0 && r.latency_us > 0, "bytes " << r.bytes);
    }
  }
}

// A large message moves while its receiver computes and makes no transport call (Note [MPI
// progress thread]; tcp: the I/O thread): rank 1's send of 4 MiB completes while rank 0 sleeps
// for 400 ms after posting the receive. Without the progress thread the send completed only
// when rank 0 waited, after the sleep.
void scenario_progress(pc::Transport& t) {
  constexpr size_t kBytes = size_t{4} << 20;
  std::vector<uint8_t> data(kBytes);
  t.barrier();
  if (t.rank() == 0) {
    pc::WorkPtr recv = t.recv(1, 9, data.data(), data.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(400));  // "computing"
    recv->wait();
    bool intact = true;
    for (size_t i = 0; i < kBytes; i += 4093) intact = intact && data[i] == uint8_t(i * 7);
    CHECK_THAT(intact, "the received bytes differ from the sent ones");
  } else if (t.rank() == 1) {
    for (size_t i = 0; i < kBytes; ++i) data[i] = uint8_t(i * 7);
    const auto start = Clock::now();
    t.send(0, 9, data.data(), data.size())->wait();
    const double took = seconds_since(start);
    std::cerr << "rank 1: a 4 MiB send to a computing rank completed in " << took * 1000 << " ms\n";
    CHECK_THAT(took < 0.2,
               "the send took " << took * 1000 << " ms: it did not progress while rank 0 computed");
  }
  t.barrier();
}

// Note [Idle progress rounds]: a receive posted long before its message comes costs its computing
// rank few wake-ups, and the message still moves at once when it comes. Rank 0 posts a receive
// and computes (sleeps) for 800 ms; rank 1 sends 4 MiB 400 ms after the barrier. The send
// completes while rank 0 still computes, and rank 0's process switches context voluntarily
// fewer than 1,000 times over the 800 ms (2,295 with a round every 100 us, before the idle
// rounds).
void scenario_idle(pc::Transport& t) {
  constexpr size_t kBytes = size_t{4} << 20;
  std::vector<uint8_t> data(kBytes);
  t.barrier();
  if (t.rank() == 0) {
    pc::WorkPtr recv = t.recv(1, 9, data.data(), data.size());
    rusage before{}, after{};
    getrusage(RUSAGE_SELF, &before);
    std::this_thread::sleep_for(std::chrono::milliseconds(800));  // "computing"
    getrusage(RUSAGE_SELF, &after);
    recv->wait();
    const long switches = after.ru_nvcsw - before.ru_nvcsw;
    std::cerr << "rank 0: " << switches << " voluntary context switches in 800 ms of computing\n";
    CHECK_THAT(switches < 1000, switches << " voluntary context switches while one receive "
                                            "waited: the progress thread did not idle");
    bool intact = true;
    for (size_t i = 0; i < kBytes; i += 4093) intact = intact && data[i] == uint8_t(i * 7);
    CHECK_THAT(intact, "the received bytes differ from the sent ones");
  } else if (t.rank() == 1) {
    for (size_t i = 0; i < kBytes; ++i) data[i] = uint8_t(i * 7);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    const auto start = Clock::now();
    t.send(0, 9, data.data(), data.size())->wait();
    const double took = seconds_since(start);
    std::cerr << "rank 1: a 4 MiB send to a rank computing for 400 ms already completed in "
              << took * 1000 << " ms\n";
    CHECK_THAT(took < 0.2,
               "the send took " << took * 1000 << " ms: the idle receiver did not find it at once");
  }
  t.barrier();
}

// A thread blocked in wait() drives its transfer itself (Note [MPI progress thread]); it does not
// sleep while only the progress thread moves the message. Run with a progress interval of an
// hour (main sets it for this scenario): the progress thread does one round when work is posted
// and then sleeps, but for a round at each heartbeat (every second here: Note [Liveness of a
// peer]), so every transfer below completes in time only if its waiters drive it. A 16 MiB
// tensor (header and data: a non-contiguous MPI message that Open MPI moves in 32 KiB fragments,
// about 170 rounds of progress on each side) goes both ways, then 16 MiB of plain bytes (a
// single copy), then 4 MiB tensors from two threads at once. Before waiters drove their
// transfers, the first wait here ran into its timeout.
void scenario_driven(pc::Transport& t) {
  if (t.rank() > 1) {
    t.barrier();
    return;
  }
  const int peer = 1 - t.rank();
  constexpr int64_t kBytes = int64_t{16} << 20;
  const auto timeout = std::chrono::seconds(30);
  const auto pattern = [&](int rank) {
    return (at::arange(kBytes, at::kInt).remainder(251) + rank).to(at::kByte);
  };
  const at::Tensor out = pattern(t.rank()), expected = pattern(peer);
  at::Tensor in = at::zeros({kBytes}, at::kByte);
  t.barrier();
  for (int i = 0; i < 3; ++i) {
    if (t.rank() == 0) {
      pc::TensorWork r = pc::recv_tensor_into(t, peer, 11, in);
      pc::send_tensor(t, peer, 11, out).wait(timeout);
      r.wait(timeout);
    } else {
      pc::recv_tensor_into(t, peer, 11, in).wait(timeout);
      pc::send_tensor(t, peer, 11, out).wait(timeout);
    }
    CHECK_THAT(at::equal(in, expected), "tensor #" << i);
    in.zero_();
  }
  // Held by the Works: MPI may still touch them after a wait timed out.
  auto bytes = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(kBytes), t.rank() + 1);
  auto got = std::make_shared<std::vector<uint8_t>>(bytes->size());
  pc::WorkPtr r = t.recv(peer, 12, {pc::MutableSpan{got->data(), got->size()}}, got);
  t.send(peer, 12, {pc::ConstSpan{bytes->data(), bytes->size()}}, bytes)->wait(timeout);
  r->wait(timeout);
  CHECK_THAT(*got == std::vector<uint8_t>(got->size(), uint8_t(peer + 1)), "plain bytes");
  // Two threads of each rank at once, on their own tags: each waiter drives its own operation
  // and lets the other thread have the transport between its MPI calls.
  std::string errors[2];
  bool intact[2] = {false, false};
  auto exchange = [&](int k) {
    try {
      const int tag = 20 + k;
      at::Tensor mine = at::full({kBytes / 4}, uint8_t(10 * k + t.rank()), at::kByte);
      at::Tensor theirs = at::zeros({kBytes / 4}, at::kByte);
      pc::TensorWork incoming = pc::recv_tensor_into(t, peer, tag, theirs);
      pc::send_tensor(t, peer, tag, mine).wait(timeout);
      incoming.wait(timeout);
      intact[k] = at::equal(theirs, at::full({kBytes / 4}, uint8_t(10 * k + peer), at::kByte));
    } catch (const std::exception& e) {
      errors[k] = e.what();
    }
  };
  std::thread second(exchange, 1);
  exchange(0);
  second.join();
  for (int k = 0; k < 2; ++k) {
    CHECK_THAT(errors[k].empty() && intact[k], "thread " << k << ": " << errors[k]);
  }
  std::cerr << "rank " << t.rank() << ": 16 MiB moved both ways with the progress thread asleep\n";
  t.barrier();
}

int usage() {
  std::cerr << "usage: comm_multiproc "
               "<exchange|mismatch|silent|peer_exit|bench|progress|idle|driven|groups|lanes> "
               "--transport mpi|tcp [--spawn N]\n"
               "       comm_multiproc expect-failure <seconds> -- <command...>\n";
  return 2;
}

}  // namespace

// Note [Groups of ranks] under MPI, 4 ranks: two groups of the same ranks ({0, 1} and {2, 3}
// twice) are sub-communicators of their own, so messages with the same tag between the same
// pair never mix (views on one communicator would hand the first message to the first receive);
// a group's errors and job_rank() name job ranks; group barriers and a data x pipeline grid.
void scenario_groups(pc::Transport& t) {
  CHECK_THAT(t.world_size() == 4, "needs 4 ranks, has " << t.world_size());
  const int r = t.rank();
  const std::vector<int> pair = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
  auto first = pc::make_group(t, pair);
  auto second = pc::make_group(t, pair);
  CHECK_THAT(first->world_size() == 2 && first->rank() == r % 2, "rank " << first->rank());
  CHECK_THAT(first->job_rank() == r, "job rank " << first->job_rank());
  int32_t got_first = 0, got_second = 0;
  if (r % 2 == 0) {
    const int32_t one = 1, two = 2;
    first->send(1, 5, &one, sizeof(one))->wait();
    second->send(1, 5, &two, sizeof(two))->wait();
  } else {
    // The second group's receive first: it must get the second group's message.
    auto b = second->recv(0, 5, &got_second, sizeof(got_second));
    auto a = first->recv(0, 5, &got_first, sizeof(got_first));
    b->wait();
    a->wait();
    CHECK_THAT(got_first == 1 && got_second == 2,
               "first group got " << got_first << ", second " << got_second);
  }
  first->barrier();
  second->barrier();
  // A receive that times out names the job's ranks, not the group's.
  if (r == 2) {
    int32_t value = 0;
    try {
      first->recv(1, 6, &value, sizeof(value))->wait(std::chrono::milliseconds(300));
      CHECK_THAT(false, "expected a timeout");
    } catch (const pipemat::TimeoutError& e) {
      CHECK_THAT(contains(e.what(), "from rank 3 with tag 6 on rank 2 (mpi)"), e.what());
    }
  }
  first->barrier();
  // A 2 x 2 grid as the training driver makes it: pipelines {0, 2}, {1, 3}; data {0, 1}, {2, 3}.
  auto pipeline = pc::make_group(t, r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3});
  auto data = pc::make_group(t, pair);
  const int32_t mine = 10 * r;
  int32_t from_pipeline = -1, from_data = -1;
  auto rp = pipeline->recv(1 - pipeline->rank(), 7, &from_pipeline, sizeof(from_pipeline));
  auto rd = data->recv(1 - data->rank(), 7, &from_data, sizeof(from_data));
  auto sp = pipeline->send(1 - pipeline->rank(), 7, &mine, sizeof(mine));
  auto sd = data->send(1 - data->rank(), 7, &mine, sizeof(mine));
  for (auto* w : {&rp, &rd, &sp, &sd}) (*w)->wait();
  CHECK_THAT(from_pipeline == 10 * (r < 2 ? r + 2 : r - 2), "pipeline peer sent " << from_pipeline);
  CHECK_THAT(from_data == 10 * (r ^ 1), "data peer sent " << from_data);
  t.barrier();
}

// Note [Device lanes] over real processes, 4 ranks, with the transport link (CPU tensors of 64
// elements or more take it): lists between every pair, taken in reverse tag order, and on the
// groups of a 2 x 2 grid (mpi sub-communicators, tcp views), which use the job's lane with job
// ranks. The lane's control receives are posted from the start and end with the transport.
void scenario_lanes(pc::Transport& t) {
  CHECK_THAT(t.world_size() == 4, "needs 4 ranks, has " << t.world_size());
  t.attach_device_lane(pc::make_device_lane(t, pc::make_transport_link(t, 64)));
  const int r = t.rank();
  auto list = [](int from, int to, int tag) {
    return std::vector<at::Tensor>{at::full({16, 8}, double(100 * from + 10 * to + tag)),
                                   at::tensor(int64_t{from * 10 + tag})};
  };
  auto expect = [&](const std::vector<at::Tensor>& got, int from, int to, int tag) {
    const auto want = list(from, to, tag);
    CHECK_THAT(got.size() == 2 && at::equal(got[0], want[0]) && at::equal(got[1], want[1]),
               "list from rank " << from << " with tag " << tag);
  };
  std::vector<pc::TensorListWork> sends;
  for (int peer = 0; peer < 4; ++peer) {
    if (peer == r) continue;
    for (int tag = 0; tag < 3; ++tag)
      sends.push_back(pc::send_tensors(t, peer, tag, list(r, peer, tag)));
  }
  for (int peer = 0; peer < 4; ++peer) {
    if (peer == r) continue;
    for (int tag = 2; tag >= 0; --tag) expect(pc::recv_tensors(t, peer, tag).wait(), peer, r, tag);
  }
  for (auto& w : sends) w.wait();
  auto pipeline = pc::make_group(t, r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3});
  auto data = pc::make_group(t, r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3});
  CHECK_THAT(pipeline->device_lane() == t.device_lane() && data->device_lane() == t.device_lane(),
             "a group without the job's lane");
  const int pipeline_peer = r < 2 ? r + 2 : r - 2, data_peer = r ^ 1;
  auto sp = pc::send_tensors(*pipeline, 1 - pipeline->rank(), 7, list(r, pipeline_peer, 7));
  auto sd = pc::send_tensors(*data, 1 - data->rank(), 8, list(r, data_peer, 8));
  expect(pc::recv_tensors(*data, 1 - data->rank(), 8).wait(), data_peer, r, 8);
  expect(pc::recv_tensors(*pipeline, 1 - pipeline->rank(), 7).wait(), pipeline_peer, r, 7);
  sp.wait();
  sd.wait();
  t.barrier();
}

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return usage();
  if (args[0] == "expect-failure") {
    if (args.size() < 4 || args[2] != "--") return usage();
    pc::SpawnOptions spawn;
    spawn.world_size = 1;
    spawn.argv.assign(args.begin() + 3, args.end());
    spawn.timeout = std::chrono::milliseconds(static_cast<long long>(std::stod(args[1]) * 1000));
    const auto start = Clock::now();
    pc::SpawnResult result = pc::spawn_local_ranks(spawn);
    std::cerr << "expect-failure: command ended after " << seconds_since(start) << " s with "
              << result.describe() << "\n";
    if (result.timed_out) {
      std::cerr << "expect-failure: FAIL, the job hung\n";
      return 1;
    }
    return result.exit_codes[0] != 0 ? 0 : 1;
  }
  const std::string scenario = args[0];
  std::string kind = "mpi";
  int spawn = 0;
  for (size_t i = 1; i + 1 < args.size(); ++i) {
    if (args[i] == "--transport") kind = args[i + 1];
    if (args[i] == "--spawn") spawn = std::stoi(args[i + 1]);
  }
  try {
    if (spawn > 0) {
      pc::SpawnOptions options;
      options.world_size = spawn;
      options.timeout = std::chrono::seconds(100);
      options.argv = {"/proc/self/exe", scenario, "--transport", kind};
      pc::SpawnResult result = pc::spawn_local_ranks(options);
      std::cerr << "comm_multiproc " << scenario << " x" << spawn << ": " << result.describe()
                << "\n";
      return result.ok() ? 0 : 1;
    }
    pc::TransportOptions options;
    options.kind = pc::parse_transport_kind(kind);
    options.timeout = std::chrono::seconds(60);
    options.connect_retry_interval = std::chrono::milliseconds(50);
    options.connect_retries = 600;  // rank 0 may load libtorch slowly on a loaded machine
    if (scenario == "driven") options.mpi_progress_interval = std::chrono::hours(1);
    if (scenario == "alive") options.timeout = std::chrono::seconds(2);
    auto transport = pc::make_transport(options);
    g_rank = transport->rank();
    if (kind == "tcp") {
      // spawn_local_ranks gives every job a fresh secret, as pipemat-run does.
      const char* secret = std::getenv("PIPEMAT_JOB_SECRET");
      CHECK_THAT(secret != nullptr && std::strlen(secret) == 32,
                 "PIPEMAT_JOB_SECRET: " << (secret ? secret : "(unset)"));
    }
    if (scenario == "exchange") {
      scenario_exchange(*transport);
    } else if (scenario == "mismatch") {
      scenario_mismatch(*transport);
    } else if (scenario == "silent") {
      scenario_silent(*transport);
    } else if (scenario == "alive") {
      scenario_alive(*transport);
    } else if (scenario == "peer_exit") {
      scenario_peer_exit(*transport);
    } else if (scenario == "bench") {
      scenario_bench(*transport);
    } else if (scenario == "progress") {
      scenario_progress(*transport);
    } else if (scenario == "idle") {
      scenario_idle(*transport);
    } else if (scenario == "driven") {
      scenario_driven(*transport);
    } else if (scenario == "groups") {
      scenario_groups(*transport);
    } else if (scenario == "lanes") {
      scenario_lanes(*transport);
    } else {
      return usage();
    }
    std::cerr << "rank " << g_rank << ": " << scenario << " " << (g_failures ? "FAILED" : "ok")
              << "\n";
  } catch (const std::exception& e) {
    std::cerr << "rank " << g_rank << ": " << scenario << " threw: " << e.what() << "\n";
    return 1;
  }
  return g_failures == 0 ? 0 : 1;
}
