#pragma once
// Where a kernel's process runs (how), apart from what the gateway does with it (Kernel: readiness, clients,
// restarts). A Provisioner starts one kernel process and hands back a KernelInstance, the handle on it.
//
//   local  a child of the gateway: posix_spawn in its own session, pidfd exit watch (kernel_process.hpp); the
//          gateway writes the connection file (ipc:// sockets in its runtime directory) first.
//   slurm  one Slurm batch job per kernel process, named cellblock-<kernel_id>, submitted with sbatch and
//          watched with squeue, signalled and ended with scancel (Slurm's commands on PATH, SLURM_CONF from
//          the environment), each run as a child watched on the io_context, never blocking it. No shared
//          filesystem: the job runs `cellblock-kernel --report-to <registry> --report-server-key <key>` with
//          a one-time token in its launch environment (read from its standard input, never evaluated by a
//          shell: slurm_job_script below); the kernel binds ephemeral TCP ports on its node, serves them
//          over CurveZMQ with a key pair of its own, and reports {ports, ip, HMAC key, Curve public key} to
//          the gateway's launch registry over CurveZMQ (kernel/README.md). The gateway then connects as a
//          Curve client. The store records the job (id, node, ports, Curve key; Kernel::record), so the next
//          gateway on the state directory re-adopts it and, on a shared store, any other gateway attaches it
//          (KernelManager::attach_stored). Of the gateways holding a job, one polls squeue for it: the one
//          holding its watch lease (JobWatchLeases below); the others try to take the lease once per poll
//          interval, so they see the job's end once its watcher lets the lease go (it stopped watching: the
//          job ended or was released) or dies (its store connection, and with it the lease, ends). A handle
//          cancels its job when destroyed unless the job ended or the handle was released: a gateway releases
//          the jobs it attached at its exit, and ends one only on a delete, cull or restart through it.
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>
#include <zmq.hpp>

#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/store/store.hpp"

namespace cellblock::gateway {

// Where a kernel that reported its own connection listens.
struct ReportedConnection {
    std::string ip;
    int shell = 0, control = 0, stdin_ = 0, iopub = 0, heartbeat = 0;
    std::string key;               // HMAC-SHA256 key, made by the kernel
    std::string curve_public_key;  // the kernel's CurveZMQ server key (Z85)
    std::string host;              // the node's host name, for logs and operators
};

struct InstanceLaunch {
    std::string kernel_id;
    std::vector<std::string> argv;                   // the kernelspec's, placeholders substituted
    std::map<std::string, std::string> environment;  // the kernel process's whole environment
    std::filesystem::path working_directory;
    std::filesystem::path output_file;  // stdout+stderr, empty = inherit (local only)
    std::filesystem::path runtime_dir;  // the gateway's private directory (scripts, command output)
};

struct InstanceExit {
    std::string cause;  // "exited with status 0", "Slurm job 12 ended: CANCELLED (...)"
    // Ended by the scheduler or an operator (scancel, time limit, preemption, node failure): not restarted
    // automatically.
    bool ended_externally = false;
};

class KernelInstance {
  public:
    virtual ~KernelInstance() = default;  // stops the kernel unless it ended or was released
    virtual bool running() const = 0;
    // SIGINT interrupts, SIGTERM/SIGKILL end the kernel and everything it started. False when not possible.
    virtual bool signal(int signal_number) = 0;
    // Called once, on the io_context, when the kernel process (or its job) has ended.
    virtual void on_exit(std::function<void(InstanceExit)> handler) = 0;
    // Gateway shutdown only (blocks, outside the io_context).
    virtual bool wait_for_exit(std::chrono::milliseconds timeout) = 0;
    // Lets the kernel run on after this handle (and the gateway) are gone.
    virtual void release() = 0;
    virtual std::optional<ProcessIdentity> process_identity() const { return std::nullopt; }
    // For the store, logs and /api: {"name": "local", "pid": N} or {"name": "slurm", "job_id", "host", ...}.
    virtual nlohmann::json describe() const = 0;
    // While starting: what the kernel waits for (a pending job's reason), empty when nothing is known.
    virtual std::string waiting_for() const { return {}; }
};

class Provisioner {
  public:
    using Connected = std::function<void(std::variant<ReportedConnection, std::string> connection_or_error)>;
    virtual ~Provisioner() = default;
    virtual std::string_view name() const = 0;
    // True: the kernel reports where it listens (`connected` is called on the io_context, at most once);
    // false: the gateway writes the connection file before launch and `connected` is never called.
    virtual bool reports_connection() const = 0;
    // Throws (std::system_error, std::runtime_error) when the launch cannot even begin.
    virtual std::unique_ptr<KernelInstance> launch(const InstanceLaunch& launch, Connected connected) = 0;
    // A kernel an earlier gateway launched here, from its record (KernelRecord::provisioner); throws when it
    // cannot be (a local process is adopted by pid instead: adopt_local_process).
    virtual std::unique_ptr<KernelInstance> adopt(const nlohmann::json& record, const std::string& kernel_id,
                                                  const std::filesystem::path& runtime_dir) {
        (void)record, (void)kernel_id, (void)runtime_dir;
        throw std::runtime_error(std::string(name()) + " kernels cannot be re-adopted");
    }
};

// A Slurm job as its watch lease names it.
struct WatchedJob {
    std::string kernel_id;
    std::string job_id;
};

// Which of the gateways sharing a store polls squeue for a job: the holder of the store lease
// slurm-watch:<kernel id>:<job id> (its row goes with the kernel's record). On an embedded store this gateway
// is the only one and holds them all. io_context thread only.
class JobWatchLeases {
  public:
    virtual ~JobWatchLeases() = default;
    // Tries to take the leases of `jobs` (none of them held already); `then` gets, on the io_context, the
    // jobs whose lease this gateway now holds (none when the store did not answer in time).
    virtual void take(std::vector<WatchedJob> jobs, std::function<void(std::vector<WatchedJob>)> then) = 0;
    virtual void release(const WatchedJob& job) = 0;
};
class StoreWriter;
std::shared_ptr<JobWatchLeases> make_job_watch_leases(StoreWriter& writer, const Logger& logger);

class TemplateServices;
// Local kernels hold their zygote tenant's template service (template_services.hpp) while they run.
std::shared_ptr<Provisioner> make_local_provisioner(boost::asio::io_context& io,
                                                    std::shared_ptr<TemplateServices> templates);
// A local kernel process started by an earlier gateway (re-adoption). Throws std::system_error when it is
// gone.
std::unique_ptr<KernelInstance> adopt_local_process(boost::asio::io_context& io, pid_t pid);
std::shared_ptr<Provisioner> make_slurm_provisioner(boost::asio::io_context& io, zmq::context_t& zmq_context,
                                                    const Logger& logger, const GatewayConfig& config,
                                                    std::shared_ptr<JobWatchLeases> watch_leases);

// The names `--provisioner` and metadata.cellblock.provisioner accept.
bool known_provisioner(std::string_view name);

// The batch script of a Slurm kernel job: `exec argv... --environment-stdin` with the launch environment
// document (contract/include/cellblock/contract/environment.hpp) in a quoted here-document, so no name or
// value of the environment is ever evaluated by the shell; only PATH (to find argv[0]) is a shell
// assignment, its value quoted. Throws contract::InvalidEnvironment for a bad name, wherever it came from.
std::string slurm_job_script(const std::vector<std::string>& argv,
                             const std::map<std::string, std::string>& environment);

}  // namespace cellblock::gateway
