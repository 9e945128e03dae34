#include "cellblock/gateway/kernels/kernel_manager.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/post.hpp>
#include <cstdlib>
#include <system_error>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/kernels/template_services.hpp"

extern char** environ;

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {
// A tenant's worker zygote template stays this long after its last kernel here ends, for a restart or the
// next session (a template's start costs about a second of CPU).
constexpr auto template_service_grace = std::chrono::seconds(10);

fs::path make_private_directory(const fs::path& path) {
    if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST)
        throw std::system_error(errno, std::generic_category(), "cannot create " + path.string());
    if (::chmod(path.c_str(), 0700) != 0)
        throw std::system_error(errno, std::generic_category(), "cannot chmod 0700 " + path.string());
    return path;
}

fs::path make_temporary_runtime_dir() {
    const char* xdg = std::getenv("XDG_RUNTIME_DIR");
    std::string base = (xdg && *xdg && fs::is_directory(xdg)) ? xdg : "/tmp";
    // Short: ipc:// socket paths must fit into sun_path (108 bytes).
    std::string pattern = base + "/cbgw-XXXXXX";
    if (!::mkdtemp(pattern.data()))
        throw std::system_error(errno, std::generic_category(), "mkdtemp " + pattern);
    return pattern;
}

std::optional<std::string> process_env(const std::string& name) {
    const char* value = std::getenv(name.c_str());
    if (!value)
        return std::nullopt;
    return std::string(value);
}

// The worker zygote's tenant of a store tenant's kernels: its own template, never the operator's nor another
// tenant's (forks of one template share its hash secret and layout, sandbox/README.md). Templates are the
// host's, so the name also carries a digest of the store and of this gateway's state directory: a tenant
// "acme" of another store on this host is another tenant, and each gateway supervises templates of its own
// (template_services.hpp), so two gateways on one host never start or retire each other's.
std::string store_digest(const GatewayConfig& config, const std::string& tenant) {
    const std::string state_dir = fs::absolute(config.state_dir).string();
    const std::array<std::string_view, 4> parts = {config.store, state_dir, tenant, ""};
    return HmacSigner("cellblock zygote tenant").sign(parts).substr(0, 8);
}

std::string zygote_tenant_of(const GatewayConfig& config, const std::string& tenant) {
    return "t" + store_digest(config, tenant) + "_" + tenant;
}

// The operator's kernels (and the warm pool's): `--zygote-tenant`, else one of this store's own, which no
// store tenant's name can make ("o" where theirs begin with "t").
std::string operator_zygote_tenant(const GatewayConfig& config) {
    return config.zygote_tenant.empty() ? "o" + store_digest(config, "") + "_operator" : config.zygote_tenant;
}

}  // namespace

KernelManager::KernelManager(boost::asio::io_context& io, const Logger& logger, const GatewayConfig& config,
                             KernelSpecRegistry& registry, StoreWriter& writer, GatewayMetrics& metrics)
    : io_(io),
      logger_(logger),
      config_(config),
      registry_(registry),
      writer_(writer),
      metrics_(metrics),
      zmq_context_(1),
      cull_sweep_(io),
      pool_retry_timer_(io),
      pool_refill_timer_(io),
      housekeeping_sweep_(io) {
    templates_ = std::make_shared<TemplateServices>(io, logger, template_service_grace);
    provisioners_["local"] = make_local_provisioner(io, templates_);
    provisioners_["slurm"] =
        make_slurm_provisioner(io, zmq_context_, logger, config, make_job_watch_leases(writer, logger));
    std::array<char, 256> host{};
    if (::gethostname(host.data(), host.size() - 1) != 0)
        host = {};
    owner_ = std::string(host.data()) + ":" + config.state_dir;
    kernels_by_state_ = metrics.registry.sampled_gauge(
        "cellblock_kernels",
        "Kernels handed out (listed in /api/kernels; warm-pool kernels excluded) by state.", "state", [this] {
            std::vector<GaugeSample> samples;
            for (KernelState state : {KernelState::starting, KernelState::idle, KernelState::busy,
                                      KernelState::restarting, KernelState::dead})
                samples.emplace_back(std::string(kernel_state_name(state)), 0.0);
            for (const auto& [id, kernel] : kernels_)
                for (auto& [state, count] : samples)
                    if (state == kernel_state_name(kernel->state()))
                        count += 1;
            return samples;
        });
    pool_by_state_ = metrics.registry.sampled_gauge(
        "cellblock_warm_pool_kernels", "Kernels in the warm pool: ready to hand out, or still starting.",
        "state", [this] {
            const auto ready = static_cast<double>(pool_ready_count());
            return std::vector<GaugeSample>{{"ready", ready},
                                            {"starting", static_cast<double>(pool_.size()) - ready}};
        });
    pool_target_ = metrics.registry.sampled_gauge(
        "cellblock_warm_pool_target", "Kernels the warm pool is configured to hold (--warm-pool).", {},
        [this] {
            return std::vector<GaugeSample>{{{}, static_cast<double>(std::max(0, config_.warm_pool))}};
        });
}

KernelManager::~KernelManager() {
    shutdown_all();
    std::error_code ignored;
    if (owns_runtime_dir_)
        remove_workspace(runtime_dir_, logger_);
}

void KernelManager::start() {
    if (config_.runtime_dir.empty()) {
        runtime_dir_ = make_temporary_runtime_dir();
        owns_runtime_dir_ = true;
    } else {
        runtime_dir_ = make_private_directory(config_.runtime_dir);
    }
    workspace_root_ =
        config_.workspace_root.empty() ? runtime_dir_ / "workspaces" : fs::path(config_.workspace_root);
    make_private_directory(workspace_root_);
    readopt_recorded_kernels();
    refill_pool();
    if (config_.cull_idle_timeout > 0)
        cull_sweep_.start(std::chrono::duration<double>(std::max(0.05, config_.cull_interval)),
                          [this] { cull(); });
    housekeeping_sweep_.start(std::chrono::milliseconds(200), [this] { housekeeping(); });
}

void KernelManager::restart_kernel(const std::shared_ptr<Kernel>& kernel, Kernel::ReadyHandler on_ready) {
    if (!writer_.shared())
        return kernel->restart(std::move(on_ready));
    const std::string lease = "kernel-restart:" + kernel->id();
    // The lease is asked for on the store's reader thread; one taken after the limit is released there.
    writer_.read<bool>(
        [lease](SessionStore& store) { return store.try_lease(lease).has_value(); },
        StoreWriter::default_read_limit,
        [this, kernel, lease, on_ready = std::move(on_ready)](StoreAnswer<bool> held) mutable {
            if (!held.ok()) {
                logger_.error("store_read_failed", {{"kernel_id", kernel->id()}, {"error", held.error}});
                return on_ready(std::string("the store did not answer: the kernel was not restarted"));
            }
            if (!*held.value)
                return on_ready(std::string("the kernel is being restarted through another gateway"));
            kernel->restart([this, lease, on_ready = std::move(on_ready)](std::optional<std::string> error) {
                // The new process is recorded (persisted at spawn) before another gateway may restart it.
                writer_.after_pending([this, lease] { release_lease(lease); });
                on_ready(std::move(error));
            });
        },
        [this, lease](bool taken_late) {
            if (taken_late)
                release_lease(lease);
        });
}

void KernelManager::release_lease(const std::string& lease) {
    // Behind this gateway's earlier lease calls on the one reader thread: never before the try_lease.
    writer_.read<bool>(
        [lease](SessionStore& store) {
            store.release_lease(lease);
            return true;
        },
        StoreWriter::default_read_limit,
        [this, lease](const StoreAnswer<bool>& answer) {
            if (!answer.ok())
                logger_.error("store_write_failed", {{"lease", lease}, {"error", answer.error}});
        });
}

void KernelManager::persist(const Kernel& kernel) {
    const bool pooled = std::any_of(pool_.begin(), pool_.end(), [&kernel](const auto& pooled_kernel) {
        return pooled_kernel.get() == &kernel;
    });
    KernelRecord record = kernel.record(pooled);
    record.owner = owner_;
    record.last_activity = format_iso8601_utc(kernel.last_activity());
    writer_.submit([record = std::move(record)](SessionStore& store) { store.put_kernel(record); });
}

void KernelManager::forget(const std::string& kernel_id) {
    writer_.submit([kernel_id](SessionStore& store) { store.remove_kernel(kernel_id); });
}

std::vector<std::shared_ptr<Kernel>> KernelManager::live_kernels() const {
    std::vector<std::shared_ptr<Kernel>> all;
    // A released kernel's process is another gateway's (let go, or dropped while attaching): never stopped
    // or recorded here again.
    for (const auto& known : every_kernel_)
        if (auto kernel = known.lock(); kernel && kernel->phase() != KernelPhase::released)
            all.push_back(kernel);
    return all;
}

std::map<std::string, std::string> KernelManager::kernel_environment(
    const KernelSpec& spec, const std::map<std::string, std::string>& request_env,
    const std::string& kernel_id, const fs::path& workspace,
    const std::optional<NetworkRequest>& network) const {
    std::map<std::string, std::string> environment;
    if (auto path = process_env("PATH"))
        environment["PATH"] = *path;
    else
        environment["PATH"] = "/usr/local/bin:/usr/bin:/bin";
    for (const std::string& name : config_.env_process_whitelist)
        if (auto value = process_env(name))
            environment[name] = *value;
    if (spec.spec.contains("env") && spec.spec["env"].is_object())
        for (const auto& [name, value] : spec.spec["env"].items())
            if (value.is_string())
                environment[name] = value.get<std::string>();
    for (const auto& [name, value] : request_env) {
        const bool whitelisted = std::find(config_.env_whitelist.begin(), config_.env_whitelist.end(),
                                           name) != config_.env_whitelist.end();
        if (name.starts_with("KERNEL_") || whitelisted)
            environment[name] = value;
    }
    environment["KERNEL_GATEWAY"] = "1";
    environment["KERNEL_ID"] = kernel_id;
    environment["CELLBLOCK_WORKSPACE"] = workspace.string();
    if (config_.orphan_timeout > 0) {
        // The kernel stops itself (and removes its workspace) when no gateway renews this lease.
        environment["CELLBLOCK_LEASE_S"] = json(config_.orphan_timeout).dump();
        environment["CELLBLOCK_LEASE_CLEANUP_DIR"] = workspace.string();
    }
    environment.erase("KG_AUTH_TOKEN");
    // The tenant names who may share a template's hash secret and layout: the operator's word only.
    environment["CELLBLOCK_ZYGOTE_TENANT"] = operator_zygote_tenant(config_);
    // The network policy is the operator's and the agent API's word only (never a client's env or spec env).
    environment.erase("CELLBLOCK_NETWORK_POLICY");
    environment.erase("CELLBLOCK_EGRESS_HOSTS");
    const std::string policy =
        kernel_policy_value(network ? *network : spec_network(spec), config_.network_settings());
    if (!policy.empty()) {
        environment["CELLBLOCK_NETWORK_POLICY"] = policy;
        if (!config_.egress_hosts.empty())
            environment["CELLBLOCK_EGRESS_HOSTS"] = fs::absolute(config_.egress_hosts).string();
    }
    return environment;
}

NetworkRequest KernelManager::spec_network(const KernelSpec& spec) const {
    const json* policy = nullptr;
    if (spec.spec.contains("metadata") && spec.spec["metadata"].is_object()) {
        const json& metadata = spec.spec["metadata"];
        if (metadata.contains("cellblock") && metadata["cellblock"].is_object() &&
            metadata["cellblock"].contains("network"))
            policy = &metadata["cellblock"]["network"];
    }
    try {
        if (!policy)
            return config_.default_network();
        NetworkRequest request = parse_network_request(*policy);
        check_within_ceiling(request, config_.network_settings().ceiling);
        return request;
    } catch (const NetworkPolicyError& error) {
        throw std::invalid_argument((policy ? "kernelspec " + spec.name + ": metadata.cellblock.network: "
                                            : std::string("network: ")) +
                                    error.what());
    }
}

std::shared_ptr<Kernel> KernelManager::create_kernel(const KernelSpec& spec,
                                                     const std::map<std::string, std::string>& request_env,
                                                     const std::map<std::string, std::string>& trusted_env,
                                                     const std::optional<NetworkRequest>& network) {
    KernelLaunch launch;
    launch.id = new_uuid();
    launch.spec = spec;
    launch.provisioner = provisioner_for(spec);
    launch.runtime_dir = runtime_dir_;
    // A kernelspec policy beyond the ceiling fails the start before anything is made for the kernel.
    const NetworkRequest policy = network ? *network : spec_network(spec);
    try {
        launch.workspace_dir = make_private_directory(workspace_root_ / launch.id);
    } catch (const std::exception&) {
        metrics_.count_launch_failure(GatewayMetrics::cause_workspace_failed);
        throw;
    }
    launch.environment = kernel_environment(spec, request_env, launch.id, launch.workspace_dir, policy);
    for (const auto& [name, value] : trusted_env)
        launch.environment[name] = value;
    auto kernel = std::make_shared<Kernel>(io_, zmq_context_, logger_, config_, std::move(launch));
    std::erase_if(every_kernel_, [](const std::weak_ptr<Kernel>& known) { return known.expired(); });
    every_kernel_.push_back(kernel);
    watch_kernel(*kernel);
    return kernel;
}

std::shared_ptr<Provisioner> KernelManager::provisioner_for(const KernelSpec& spec) const {
    std::string name = config_.provisioner;
    if (spec.spec.contains("metadata") && spec.spec["metadata"].is_object()) {
        const json& metadata = spec.spec["metadata"];
        if (metadata.contains("cellblock") && metadata["cellblock"].is_object() &&
            metadata["cellblock"].contains("provisioner") && metadata["cellblock"]["provisioner"].is_string())
            name = metadata["cellblock"]["provisioner"].get<std::string>();
    }
    auto found = provisioners_.find(name);
    if (found == provisioners_.end())
        throw std::invalid_argument("kernelspec " + spec.name + ": unknown provisioner '" + name +
                                    "' (local or slurm)");
    return found->second;
}

void KernelManager::watch_kernel(Kernel& kernel) {
    kernel.on_spawned([this](const Kernel& spawned) { persist(spawned); });
    if (writer_.shared())
        kernel.on_unexpected_exit([this](const Kernel& died, Kernel::RestartDecision decide) {
            ask_store_about_restart(died, std::move(decide));
        });
    kernel.on_launch_failed(
        [&metrics = metrics_](std::string_view cause) { metrics.count_launch_failure(cause); });
}

namespace {
// What the store says of a kernel whose process ended here: whether this gateway holds its restart lease, and
// (if it does) the kernel's record.
struct RestartQuestion {
    bool leased = false;
    std::optional<KernelRecord> record;
};

// Whether a record still names the process (local) or job (slurm) that ended. A Slurm kernel has no process
// identity here: its job id tells a job another gateway submitted since from the one that ended.
bool same_instance(const KernelRecord& recorded, const KernelRecord& ended) {
    return recorded.process == ended.process && recorded.provisioner.value("job_id", std::string()) ==
                                                    ended.provisioner.value("job_id", std::string());
}
}  // namespace

void KernelManager::ask_store_about_restart(const Kernel& died, Kernel::RestartDecision decide) {
    // Being restarted through another gateway (its restart lease is taken), deleted through one (its record
    // is gone) or restarted by one already (the record names another process): restarting it here would run
    // it twice or resurrect it. Such a kernel stays dead here; the next request for it attaches what the
    // store records (find_or_attach). Asked off the io thread: a store that stalls stalls no other kernel.
    const std::string lease = "kernel-restart:" + died.id();
    auto let_go_later = [this, id = died.id()](const char* why) {
        logger_.info("kernel_ended_elsewhere", {{"kernel_id", id}, {"why", why}});
        boost::asio::post(io_, [this, id, why] {
            if (auto held = find(id); held && held->state() == KernelState::dead)
                let_go(held, why);
        });
    };
    writer_.read<RestartQuestion>(
        [lease, id = died.id()](SessionStore& store) {
            RestartQuestion answer;
            answer.leased = store.try_lease(lease).has_value();
            try {
                if (answer.leased)
                    answer.record = store.kernel(id);
            } catch (...) {
                store.release_lease(lease);
                throw;
            }
            return answer;
        },
        StoreWriter::default_read_limit,
        [this, lease, id = died.id(), ended = died.record(false), decide = std::move(decide),
         let_go_later](const StoreAnswer<RestartQuestion>& answer) {
            if (!answer.ok()) {
                logger_.error("store_read_failed", {{"kernel_id", id}, {"error", answer.error}});
                return decide(false);
            }
            if (!answer.value->leased) {
                decide(false);
                return let_go_later("restarted through another gateway");
            }
            const auto& record = answer.value->record;
            if (!record || !same_instance(*record, ended)) {
                release_lease(lease);
                decide(false);
                return let_go_later(record ? "restarted through another gateway"
                                           : "deleted through another gateway");
            }
            decide(true);
            // Held until the new process is recorded: a local respawn queued its record. A Slurm kernel's new
            // job is recorded once it reported (Kernel::on_connected), seconds later: until then another
            // gateway that saw the old job end would find it still recorded and submit a second job.
            const bool reported_later = ended.provisioner.contains("job_id");
            boost::asio::post(io_, [this, lease, id, reported_later] {
                auto release = [this, lease] {
                    writer_.after_pending([this, lease] { release_lease(lease); });
                };
                auto kernel = find(id);
                if (reported_later && kernel && kernel->state() == KernelState::restarting)
                    return kernel->when_ready([release](const std::optional<std::string>&) { release(); });
                release();
            });
        },
        [this, lease](const RestartQuestion& late) {
            if (late.leased)
                release_lease(lease);
        });
}

void KernelManager::adopt(const std::shared_ptr<Kernel>& kernel) {
    kernels_[kernel->id()] = kernel;
    kernel->on_terminated([this](const std::string& id) {
        // Only a kernel still registered under this id is forgotten (a shut-down one was removed already).
        kernels_.erase(id);
    });
}

void KernelManager::start_kernel(const KernelStartRequest& original, const StartHandler& on_started) {
    KernelStartRequest request = original;
    if (!request.tenant.empty())
        // Trusted, so a warm kernel (whose worker may be a fork of the operator's template) never serves it.
        request.trusted_env["CELLBLOCK_ZYGOTE_TENANT"] = zygote_tenant_of(config_, request.tenant);
    std::string name = !config_.force_kernel_name.empty() ? config_.force_kernel_name
                       : request.name.empty()             ? registry_.default_name()
                                                          : request.name;
    auto spec = registry_.find(name);
    if (!spec) {
        registry_.refresh();
        spec = registry_.find(name);
    }
    if (!spec) {
        on_started(KernelStartError{KernelStartError::Kind::no_such_kernel, "No such kernel named " + name});
        return;
    }
    // Quota is reserved before anything starts, so concurrent requests cannot overshoot max_kernels.
    if (config_.max_kernels > 0 && static_cast<int>(kernels_.size()) + reserved_ >= config_.max_kernels) {
        on_started(KernelStartError{
            KernelStartError::Kind::resource_limit,
            "Maximum number of kernels (" + std::to_string(config_.max_kernels) + ") reached"});
        return;
    }
    std::shared_ptr<Kernel> kernel;
    if (request.trusted_env.empty() && pool_can_serve(*spec, request)) {
        // A create within the pause starts the refill now and takes it, as it would have without a pause.
        if (pool_.empty() && pool_refill_pending_)
            refill_pool();
        // Prefer a ready warm kernel, else one that is still warming up (it is ahead of a cold start).
        auto ready = std::find_if(pool_.begin(), pool_.end(), [](const auto& k) { return k->ready(); });
        auto chosen = ready != pool_.end() ? ready : pool_.begin();
        if (chosen != pool_.end() && (*chosen)->state() != KernelState::dead) {
            kernel = *chosen;
            pool_.erase(chosen);
            metrics_.warm_pool_hits.increment();
        } else if (config_.warm_pool > 0) {
            metrics_.warm_pool_misses.increment();
        }
    }
    const bool from_pool = kernel != nullptr;
    try {
        if (!kernel)
            kernel = create_kernel(*spec, request.env, request.trusted_env, request.network);
    } catch (const std::exception& error) {
        on_started(KernelStartError{KernelStartError::Kind::failed, error.what()});
        return;
    }
    kernel->set_tenant(request.tenant);
    ++reserved_;
    auto finish = [this, kernel, on_started](std::optional<std::string> error) {
        --reserved_;
        if (error) {
            kernel->shutdown("kernel failed to start");
            forget(kernel->id());
            on_started(KernelStartError{KernelStartError::Kind::failed, *error});
            return;
        }
        adopt(kernel);
        persist(*kernel);  // no longer pooled
        on_started(kernel);
    };
    if (from_pool) {
        logger_.info("kernel_from_pool", {{"kernel_id", kernel->id()}});
        kernel->when_ready(finish);
        refill_pool_soon();
    } else {
        kernel->start(finish);
    }
}

std::shared_ptr<Kernel> KernelManager::find(const std::string& kernel_id) const {
    auto found = kernels_.find(kernel_id);
    return found == kernels_.end() ? nullptr : found->second;
}

std::vector<std::shared_ptr<Kernel>> KernelManager::list() const {
    std::vector<std::shared_ptr<Kernel>> all;
    for (const auto& [id, kernel] : kernels_)
        all.push_back(kernel);
    return all;
}

void KernelManager::list_everywhere(std::function<void(std::vector<std::shared_ptr<Kernel>>)> then) {
    if (!writer_.shared())
        return then(list());
    writer_.read<std::vector<KernelRecord>>(
        [](SessionStore& store) { return store.kernels(); }, StoreWriter::default_read_limit,
        [this, then = std::move(then)](const StoreAnswer<std::vector<KernelRecord>>& answer) {
            if (!answer.ok()) {
                logger_.error("store_read_failed", {{"operation", "list kernels"}, {"error", answer.error}});
                return then(list());
            }
            for (const KernelRecord& record : *answer.value)
                if (!record.pooled && !kernels_.contains(record.id))
                    attach_stored(record.id, record);
            then(list());
        });
}

bool KernelManager::shutdown_kernel(const std::string& kernel_id, const std::string& reason) {
    auto found = kernels_.find(kernel_id);
    if (found == kernels_.end())
        return false;
    auto kernel = found->second;
    kernels_.erase(found);
    shut_down_here_.insert(kernel_id);
    forget(kernel_id);
    if (writer_.store().shared()) {
        stop_once_forgotten(kernel, reason);
    } else {
        kernel->shutdown(reason);
        // An embedded store has this gateway alone: once the row is gone nobody writes it back, so the mark
        // goes too (kept, it cost every deleted kernel ~110 bytes for the gateway's life).
        writer_.after_pending([this, kernel_id] { shut_down_here_.erase(kernel_id); });
    }
    return true;
}

void KernelManager::stop_once_forgotten(const std::shared_ptr<Kernel>& kernel, const std::string& reason) {
    // The record goes before the process. Another gateway holding this kernel sees its process end and
    // restarts it unless the record is gone (watch_kernel): stopped first, the process could be seen ended
    // while the removal still waited in the writer's queue. Bounded, so a store that does not answer does not
    // keep a deleted kernel running.
    auto limit = std::make_shared<boost::asio::steady_timer>(io_, store_removal_wait);
    auto stop = [kernel, reason, limit] {
        limit->cancel();
        kernel->shutdown(reason);  // once: a second call finds the kernel stopping already
    };
    limit->async_wait([stop](const boost::system::error_code& error) {
        if (!error)
            stop();
    });
    writer_.after_pending(stop);
}

void KernelManager::detach_all() {
    stopping_ = true;
    cull_sweep_.stop();
    pool_retry_timer_.cancel();
    pool_refill_timer_.cancel();
    housekeeping_sweep_.stop();
    // Kernels handed out or pooled are kept; ones already being shut down finish stopping.
    std::vector<std::shared_ptr<Kernel>> kept, stopping;
    for (const auto& kernel : live_kernels()) {
        const bool listed = kernels_.contains(kernel->id()) && kernels_.at(kernel->id()) == kernel;
        const bool pooled = std::find(pool_.begin(), pool_.end(), kernel) != pool_.end();
        (listed || pooled ? kept : stopping).push_back(kernel);
    }
    for (const auto& kernel : kept)
        persist(*kernel);  // with the last IOPub id and whether it is pooled
    writer_.drain();
    for (const auto& kernel : kept)
        kernel->release();
    for (const auto& kernel : stopping)
        kernel->begin_termination();
    for (const auto& kernel : stopping) {
        kernel->finish_termination(std::chrono::milliseconds(1000));
        kernel->close_sockets();
    }
    logger_.info("kernels_detached", {{"count", kept.size()}});
    pool_.clear();
    kernels_.clear();
    every_kernel_.clear();
}

void KernelManager::shutdown_all() {
    stopping_ = true;
    cull_sweep_.stop();
    pool_retry_timer_.cancel();
    pool_refill_timer_.cancel();
    housekeeping_sweep_.stop();
    // Taken before the pool lets go of its kernels: a pooled kernel is stopped and forgotten like the others
    // (dropped first, it would die in its destructor and stay recorded in the store).
    auto all = live_kernels();
    // Other gateways' kernels held here keep running for them.
    std::erase_if(all, [this](const std::shared_ptr<Kernel>& kernel) {
        if (!attached_from_others_.contains(kernel->id()) || shut_down_here_.contains(kernel->id()))
            return false;
        kernel->release();
        return true;
    });
    pool_.clear();
    kernels_.clear();
    for (const auto& kernel : all) {
        kernel->begin_termination();
        forget(kernel->id());
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
    for (const auto& kernel : all) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        kernel->finish_termination(std::max(left, std::chrono::milliseconds(0)));
        kernel->close_sockets();
    }
    // After the kernels: a template ends once its last worker has (their kernels closed its connections).
    templates_->stop_all(std::chrono::milliseconds(6000));
    writer_.drain();
}

}  // namespace cellblock::gateway
