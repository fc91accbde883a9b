#include "pipemat/comm/launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include "pipemat/comm/work.h"
#include "pipemat/core/error.h"

extern char** environ;

namespace pipemat::comm {

bool SpawnResult::ok() const {
  if (timed_out) return false;
  for (int code : exit_codes) {
    if (code != 0) return false;
  }
  return true;
}

std::string SpawnResult::describe() const {
  std::string out;
  for (size_t r = 0; r < exit_codes.size(); ++r) {
    if (r) out += ", ";
    out += "rank " + std::to_string(r) + ": ";
    int code = exit_codes[r];
    out += code > 128 ? "signal " + std::to_string(code - 128) : "exit " + std::to_string(code);
  }
  if (timed_out) out += " (timed out)";
  return out;
}

int pick_free_port(const std::string& host) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  PIPEMAT_CHECK(fd >= 0, CommError, "pick_free_port: socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = INADDR_ANY;
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  if (rc == 0) rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int err = errno;
  ::close(fd);
  PIPEMAT_CHECK(rc == 0, CommError, "pick_free_port: cannot bind on ", host, ": ",
                std::strerror(err));
  return ntohs(addr.sin_port);
}

void end_with_launcher() {
#ifdef __linux__
  // Note [Ranks end with their launcher] in pipemat/comm/launcher.h says why.
  const char* announced = std::getenv("PIPEMAT_LAUNCHER_PID");
  if (announced == nullptr && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) return;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (announced == nullptr) return;
  const long launcher = std::strtol(announced, nullptr, 10);
  ::unsetenv("PIPEMAT_LAUNCHER_PID");
  if (launcher > 0 && ::getppid() != static_cast<pid_t>(launcher)) ::raise(SIGKILL);
#endif
}

namespace {

// 128 bits from /dev/urandom as 32 hex characters.
std::string random_secret() {
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  unsigned char bytes[16] = {};
  PIPEMAT_CHECK(urandom.read(reinterpret_cast<char*>(bytes), sizeof(bytes)), CommError,
                "spawn_local_ranks: cannot read a job secret from /dev/urandom");
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

// The environment of this process without the variables that differ by rank, plus a fresh
// secret per job (as pipemat-run makes) unless the environment gives one: the ranks
// authenticate every rendezvous connection with it (TransportOptions::secret).
std::vector<std::string> job_environment() {
  std::vector<std::string> base_env;
  for (char** e = environ; e && *e; ++e) {
    std::string entry = *e;
    if (entry.rfind("PIPEMAT_RANK=", 0) == 0 || entry.rfind("PIPEMAT_WORLD_SIZE=", 0) == 0 ||
        entry.rfind("PIPEMAT_MASTER=", 0) == 0) {
      continue;
    }
    base_env.push_back(entry);
  }
  if (std::getenv("PIPEMAT_JOB_SECRET") == nullptr) {
    base_env.push_back("PIPEMAT_JOB_SECRET=" + random_secret());
  }
  return base_env;
}

std::vector<std::vector<std::string>> rank_environments(const SpawnOptions& options, int port) {
  const std::vector<std::string> base_env = job_environment();
  std::vector<std::vector<std::string>> envs;
  for (int r = 0; r < options.world_size; ++r) {
    auto env = base_env;
    env.push_back("PIPEMAT_RANK=" + std::to_string(r));
    env.push_back("PIPEMAT_WORLD_SIZE=" + std::to_string(options.world_size));
    env.push_back("PIPEMAT_MASTER=" + options.host + ":" + std::to_string(port));
    envs.push_back(std::move(env));
  }
  return envs;
}

// The null-terminated array of pointers execve takes; `strings` must outlive it.
std::vector<char*> c_string_array(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

// Forks one child per environment; on a failed fork kills and reaps the children so far.
std::vector<pid_t> fork_ranks(const std::string& program, std::vector<char*>& argv,
                              std::vector<std::vector<char*>>& envps) {
  std::vector<pid_t> pids;
  for (int r = 0; r < static_cast<int>(envps.size()); ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::execve(program.c_str(), argv.data(), envps[static_cast<size_t>(r)].data());
      ::_exit(127);
    }
    if (pid < 0) {
      int err = errno;
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      PIPEMAT_THROW(CommError, "spawn_local_ranks: fork() for rank ", r,
                    " failed: ", std::strerror(err));
    }
    pids.push_back(pid);
  }
  return pids;
}

// Sends `sig` to every child that has not exited yet.
void signal_running(const std::vector<pid_t>& pids, const SpawnResult& result, int sig) {
  for (size_t r = 0; r < pids.size(); ++r) {
    if (result.exit_codes[r] == -1) ::kill(pids[r], sig);
  }
}

// Waits for every child: SIGTERM to the rest `options.grace` after the first failure, SIGKILL
// at `options.timeout`.
SpawnResult wait_for_ranks(const std::vector<pid_t>& pids, const SpawnOptions& options) {
  SpawnResult result;
  result.exit_codes.assign(pids.size(), -1);
  const auto deadline = Clock::now() + options.timeout;
  Clock::time_point failure_deadline = Clock::time_point::max();
  bool terminated = false;
  size_t running = pids.size();
  while (running > 0) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (result.exit_codes[r] != -1) continue;
      int status = 0;
      pid_t done = ::waitpid(pids[r], &status, WNOHANG);
      if (done != pids[r]) continue;
      result.exit_codes[r] = WIFEXITED(status) ? WEXITSTATUS(status)
                                               : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
      --running;
      if (result.exit_codes[r] != 0 && failure_deadline == Clock::time_point::max()) {
        failure_deadline = Clock::now() + options.grace;
      }
    }
    if (running == 0) break;
    const auto now = Clock::now();
    if (now >= deadline) {
      result.timed_out = true;
      signal_running(pids, result, SIGKILL);
    } else if (now >= failure_deadline && !terminated) {
      terminated = true;
      signal_running(pids, result, SIGTERM);
    }
    // A launcher polls its children; no test logic depends on this pause.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return result;
}

}  // namespace

SpawnResult spawn_local_ranks(const SpawnOptions& options) {
  PIPEMAT_CHECK(options.world_size >= 1, ConfigError, "spawn_local_ranks: world size ",
                options.world_size, " must be at least 1");
  const int port = options.port > 0 ? options.port : pick_free_port(options.host);
  std::string program =
      options.argv.empty() || options.argv[0].empty() ? "/proc/self/exe" : options.argv[0];
  // Everything the children need is built before fork(): only async-signal-safe calls after.
  std::vector<std::string> args = options.argv;
  if (args.empty()) args.push_back(program);
  std::vector<char*> argv = c_string_array(args);
  std::vector<std::vector<std::string>> envs = rank_environments(options, port);
  std::vector<std::vector<char*>> envps;
  for (auto& env : envs) envps.push_back(c_string_array(env));
  const std::vector<pid_t> pids = fork_ranks(program, argv, envps);
  return wait_for_ranks(pids, options);
}

}  // namespace pipemat::comm
