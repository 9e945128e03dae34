#pragma once
// Owns every kernel: starts them (from the warm pool when possible), enforces max_kernels at request time,
// restarts, interrupts, shuts down and culls them, records each in the store and re-adopts the ones an
// earlier gateway left running. All methods run on the io_context thread.
//
// Kernel lifetime across gateway exits (the one place this is decided):
//   shutdown_all()  stops every kernel and forgets it (SIGINT, --shutdown-kernels-on-exit, fatal errors);
//   detach_all()    leaves every kernel running for the next gateway on the same state directory (SIGTERM);
//   a crash         leaves them running too. A kernel whose gateway stays away longer than
//                   orphan_timeout stops itself (CELLBLOCK_LEASE_S) and removes its workspace.
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>

#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/common/repeating_timer.hpp"
#include "cellblock/gateway/jupyter/kernelspec_registry.hpp"
#include "cellblock/gateway/kernels/kernel.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/observability/metrics.hpp"
#include "cellblock/gateway/store/store_writer.hpp"

namespace cellblock::gateway {

struct KernelStartRequest {
    std::string name;                        // empty = default kernelspec
    std::map<std::string, std::string> env;  // as sent by the client; filtered by the manager
    // Set by gateway code itself (e.g. the agent API's CELLBLOCK_TIMEOUT_S limits): passed to the kernel
    // unfiltered. A non-empty map means the warm pool cannot serve the request.
    std::map<std::string, std::string> trusted_env = {};
    // The agent API's policy for this kernel (its session's "network", checked against the ceiling),
    // replacing the kernelspec's and the gateway's default; nullopt = those (Kernel Gateway API kernels).
    std::optional<NetworkRequest> network = std::nullopt;
    // Whose kernel it is (the requesting principal's tenant; empty = the operator's).
    std::string tenant = {};
};

struct KernelStartError {
    enum class Kind { no_such_kernel, resource_limit, failed } kind;
    std::string message;
};

class TemplateServices;

class KernelManager {
  public:
    using StartHandler = std::function<void(std::variant<std::shared_ptr<Kernel>, KernelStartError>)>;

    // Counts warm-pool hits and misses and launch failures in `metrics`, and registers the gauges of kernels
    // by state and of the warm pool there (computed from this manager at scrape time).
    KernelManager(boost::asio::io_context& io, const Logger& logger, const GatewayConfig& config,
                  KernelSpecRegistry& registry, StoreWriter& writer, GatewayMetrics& metrics);
    ~KernelManager();

    // Creates the runtime directories, re-adopts the kernels recorded in the store that still run, and fills
    // the warm pool.
    void start();
    void start_kernel(const KernelStartRequest& request, const StartHandler& on_started);
    std::shared_ptr<Kernel> find(const std::string& kernel_id) const;
    // find(), and on a shared store (another gateway's kernels): a kernel recorded there whose process runs
    // on this machine is attached on demand (re-adopted as after a restart, without taking it from its
    // gateway). nullptr when unknown, pooled by another gateway, shut down here, or no longer running.
    // The store is read on StoreWriter's reader thread; `then` runs on the io_context thread (at once when
    // the store is not needed). No answer in time: the kernel held here if it lives, else nullptr.
    void find_or_attach(const std::string& kernel_id, std::function<void(std::shared_ptr<Kernel>)> then);
    // find_or_attach for a request about one kernel, which must tell "none" from "the store did not answer":
    // `then` gets the kernel (nullptr: none), or the store's error when it did not answer in time and no
    // live kernel of that id is held here (the request answers 503 store_unavailable).
    void look_up(const std::string& kernel_id,
                 std::function<void(StoreAnswer<std::shared_ptr<Kernel>>)> then);
    // find_or_attach's decision with the store's `record` of the kernel already read (nullopt: none).
    std::shared_ptr<Kernel> attach_stored(const std::string& kernel_id,
                                          const std::optional<KernelRecord>& record);
    // Restarts `kernel` (Kernel::restart). On a shared store only one gateway restarts a kernel at a time
    // (the kernel's restart lease, also taken before an automatic restart): a restart that finds it taken
    // fails at once, and the other gateways re-attach the new process instead of restarting it again.
    void restart_kernel(const std::shared_ptr<Kernel>& kernel, Kernel::ReadyHandler on_ready);
    // Held here or (shared store) recorded in the store: a Jupyter session of it is not stale. Reads the
    // store on the calling thread: start-up only (serving, the store is read once and known_among asked).
    bool known(const std::string& kernel_id) const;
    // known() with the ids the store records already read (`stored`); nullopt: the store did not answer,
    // and every kernel not shut down here counts as known (a session is not dropped for that).
    bool known_among(const std::string& kernel_id, const std::optional<std::set<std::string>>& stored) const;
    // This gateway in kernel records ("host:state dir"): it re-adopts its own kernels after a restart.
    const std::string& owner() const { return owner_; }
    // Returns false for an unknown id.
    bool shutdown_kernel(const std::string& kernel_id, const std::string& reason = "kernel shut down");
    // Stops everything, synchronously: SIGTERM to all kernels, a short grace period, then SIGKILL.
    void shutdown_all();
    // Leaves every kernel running and recorded for the next gateway; synchronous (the store is written).
    void detach_all();
    // Why a kernel recorded in the store could not be re-adopted at start (nullopt when it was, or unknown).
    std::optional<std::string> lost_cause(const std::string& kernel_id) const;
    std::vector<std::shared_ptr<Kernel>> list() const;
    // list(), and on a shared store every kernel recorded there by any gateway (attached on demand, as
    // find_or_attach), so /api/kernels answers the same through every gateway. The store is read on
    // StoreWriter's reader thread and `then` runs on the io_context thread; no answer in time: list() alone
    // (store_read_failed is logged).
    void list_everywhere(std::function<void(std::vector<std::shared_ptr<Kernel>>)> then);
    const KernelSpecRegistry& registry() const { return registry_; }
    std::size_t pool_ready_count() const;
    const std::filesystem::path& runtime_dir() const { return runtime_dir_; }

    // Builds the kernel environment as Kernel Gateway does: PATH and whitelisted gateway variables, the
    // spec's env, the request's KERNEL_* (and whitelisted) variables; KERNEL_GATEWAY=1 and
    // CELLBLOCK_WORKSPACE are always set. The network policy (CELLBLOCK_NETWORK_POLICY, and
    // CELLBLOCK_EGRESS_HOSTS) is `network`, else the spec's metadata.cellblock.network, else the gateway's
    // default; nothing a client sends sets it. Throws std::invalid_argument for a kernelspec policy beyond
    // the ceiling. Exposed for tests.
    std::map<std::string, std::string> kernel_environment(
        const KernelSpec& spec, const std::map<std::string, std::string>& request_env,
        const std::string& kernel_id, const std::filesystem::path& workspace,
        const std::optional<NetworkRequest>& network = std::nullopt) const;
    // The policy kernels of `spec` get without an agent's: its metadata.cellblock.network, else the
    // gateway's default. Throws std::invalid_argument when it is malformed or beyond the ceiling.
    NetworkRequest spec_network(const KernelSpec& spec) const;
    // The operator's ceiling (--network-allow), normalized.
    std::vector<std::string> network_ceiling() const { return config_.network_settings().ceiling; }

  private:
    void watch_kernel(Kernel& kernel);  // persistence after each spawn, launch failures to the metrics
    std::shared_ptr<Kernel> create_kernel(const KernelSpec& spec,
                                          const std::map<std::string, std::string>& request_env,
                                          const std::map<std::string, std::string>& trusted_env = {},
                                          const std::optional<NetworkRequest>& network = std::nullopt);
    // The kernelspec's metadata.cellblock.provisioner, else --provisioner; throws std::invalid_argument.
    std::shared_ptr<Provisioner> provisioner_for(const KernelSpec& spec) const;
    bool pool_can_serve(const KernelSpec& spec, const KernelStartRequest& request) const;
    void refill_pool();
    // After a kernel is handed out from the pool: refill once the new session's first moments are over.
    void refill_pool_soon();
    void cull();
    // Shared store: only the gateway holding the cull-leader lease culls, over every kernel in the store,
    // from the activity all gateways record there (share_activity, with the housekeeping).
    void cull_shared();
    // The leader's sweep over the records the store answered (io thread).
    void cull_recorded(const std::vector<KernelRecord>& records);
    void share_activity();
    void adopt(const std::shared_ptr<Kernel>& kernel);
    void readopt_recorded_kernels();
    // Local kernels with a connection file in this runtime directory that no record names: asked to shut
    // down, and their files removed.
    void stop_unrecorded_kernels(const std::set<std::string>& recorded);
    // One signed shutdown_request to the kernel `connection_file` describes, if it is one of this gateway's
    // (ipc endpoints in its runtime directory); nothing waits for its reply. False: nothing was sent.
    bool request_shutdown(const std::filesystem::path& connection_file);
    // A Kernel for `record`'s running process, re-adopted (probe and record fetch); pooled or handed out.
    std::shared_ptr<Kernel> attach_recorded(const KernelRecord& record, const KernelSpec& spec);
    void forget_lost_kernel(const KernelRecord& record, const std::string& cause);
    void persist(const Kernel& kernel);
    void forget(const std::string& kernel_id);
    // Shared store: shuts `kernel` down once its record's removal is committed (or after
    // store_removal_wait), so that no other gateway takes its end for a crash and restarts it.
    void stop_once_forgotten(const std::shared_ptr<Kernel>& kernel, const std::string& reason);
    static constexpr std::chrono::milliseconds store_removal_wait{2000};
    void release_lease(const std::string& lease);
    // Shared store: whether a kernel whose process ended here may be restarted here, asked of the store off
    // the io thread; `decide` gets the answer (false when the store does not answer in time).
    void ask_store_about_restart(const Kernel& died, Kernel::RestartDecision decide);
    // Whether find_or_attach must ask the store (shared store, and no live kernel of that id here).
    bool needs_store(const std::string& kernel_id) const;
    // Drops a kernel this gateway held for other gateways (shared store) without stopping its process or
    // removing its files (sockets, workspace): its clients here are disconnected and reconnect to what the
    // store records.
    void let_go(const std::shared_ptr<Kernel>& kernel, const std::string& reason);
    // Drops another gateway's kernel whose attaching failed: its process (or job) and its record untouched.
    void drop_unattached(const std::shared_ptr<Kernel>& kernel);
    // Every 200 ms: progress to the store (so that a crash replays little twice), activity shared for
    // culling, leases renewed well within their term.
    void housekeeping();
    void flush_progress();
    std::vector<std::shared_ptr<Kernel>> live_kernels() const;

    boost::asio::io_context& io_;
    const Logger& logger_;
    const GatewayConfig& config_;
    KernelSpecRegistry& registry_;
    StoreWriter& writer_;
    GatewayMetrics& metrics_;
    zmq::context_t zmq_context_;
    // By name ("local", "slurm"); after the ZMQ context, so they go first (the launch registry's socket).
    std::shared_ptr<TemplateServices> templates_;  // before the provisioners, which hold it
    std::map<std::string, std::shared_ptr<Provisioner>> provisioners_;
    std::filesystem::path runtime_dir_;
    std::filesystem::path workspace_root_;
    bool owns_runtime_dir_ = false;
    std::map<std::string, std::shared_ptr<Kernel>> kernels_;  // handed out (or starting for a request)
    std::deque<std::shared_ptr<Kernel>> pool_;                // warm, not yet handed out
    // Every kernel ever created, including ones being shut down that only their timers keep alive: at exit
    // their processes are stopped and their sockets closed before the ZMQ context goes.
    std::vector<std::weak_ptr<Kernel>> every_kernel_;
    int reserved_ = 0;  // starts in flight, counted against max_kernels
    int pool_failures_ = 0;
    RepeatingTimer cull_sweep_;  // every --cull-interval while --cull-idle-timeout is set
    boost::asio::steady_timer pool_retry_timer_;
    boost::asio::steady_timer pool_refill_timer_;
    bool pool_refill_pending_ = false;
    RepeatingTimer housekeeping_sweep_;
    std::chrono::steady_clock::time_point next_lease_renewal_;
    std::map<std::string, std::string> lost_causes_;
    std::string owner_;
    // Shut down by this gateway: never attached again from the store. On a shared store kept for the
    // gateway's life, not only until the store row is removed: another gateway still holding the kernel may
    // write the row back (agent_shared_store's culling test culled twice when the mark went with the row). On
    // an embedded store it goes once the row's removal is committed.
    std::set<std::string> shut_down_here_;
    // Attached from the store, started by another gateway: at this gateway's exit they are let go, not
    // stopped.
    std::set<std::string> attached_from_others_;
    std::map<std::string, std::chrono::system_clock::time_point> activity_shared_;  // last written, by kernel
    bool cull_leader_ = false;
    bool cull_read_pending_ = false;  // a sweep's store read is queued or running
    bool stopping_ = false;
    MetricsRegistry::SamplerHandle kernels_by_state_, pool_by_state_, pool_target_;
};

}  // namespace cellblock::gateway
