#include "cellblock/gateway/kernels/kernel_manager.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/post.hpp>
#include <cstdlib>
#include <fstream>
#include <system_error>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/kernels/template_services.hpp"

extern char** environ;

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {
// A kernel handed out from the pool is replaced after this pause, not at once: a kernel's start takes tens of
// ms of CPU, which on a small machine competes with the new session's WebSocket connect and first requests
// (tests/bench/README.md, "A warm create without the pool's refill beside it").
constexpr auto pool_refill_pause = std::chrono::milliseconds(100);
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
    provisioners_["slurm"] = make_slurm_provisioner(io, zmq_context_, logger, config);
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

void KernelManager::readopt_recorded_kernels() {
    for (const KernelRecord& record : writer_.store().kernels()) {
        // Another gateway's kernel (a shared store): it is attached on demand, never taken at start.
        if (!record.owner.empty() && record.owner != owner_)
            continue;
        auto spec = registry_.find(record.spec_name);
        if (!spec) {
            forget_lost_kernel(record, "its kernelspec " + record.spec_name + " is no longer installed");
            continue;
        }
        const std::string provisioner_name = record.provisioner.value("name", std::string("local"));
        if (provisioner_name == "local" && !record.process.alive()) {
            std::string cause = record.process.boot_id != ProcessIdentity::of(::getpid())->boot_id
                                    ? "the machine restarted since the kernel was started"
                                    : "the kernel process ended while no gateway was running";
            std::ifstream log(record.log_file);
            for (std::string line; std::getline(log, line);)
                if (line.find("\"lease_expired\"") != std::string::npos)
                    cause = "the kernel stopped itself after no gateway renewed its lease for " +
                            json(config_.orphan_timeout).dump() + " s (orphan_timeout)";
            forget_lost_kernel(record, cause);
            continue;
        }
        if (!provisioners_.contains(provisioner_name)) {
            forget_lost_kernel(record, "its provisioner " + provisioner_name + " is unknown to this gateway");
            continue;
        }
        attach_recorded(record, *spec);
    }
    if (!every_kernel_.empty())
        logger_.info("kernels_readopting", {{"count", every_kernel_.size()}});
}

std::shared_ptr<Kernel> KernelManager::attach_recorded(const KernelRecord& record, const KernelSpec& spec) {
    KernelLaunch launch;
    launch.id = record.id;
    launch.spec = spec;
    launch.runtime_dir = runtime_dir_;
    launch.workspace_dir = record.workspace_dir;
    launch.provisioner = provisioners_.at(record.provisioner.value("name", std::string("local")));
    for (const auto& [name, value] : record.environment.items())
        if (value.is_string())
            launch.environment[name] = value.get<std::string>();
    launch.key = record.key;
    launch.endpoint_base = record.endpoint_base;
    launch.created = record.created;
    launch.last_iopub_id = record.last_iopub_id;
    launch.owned_elsewhere = !record.owner.empty() && record.owner != owner_;
    auto kernel = std::make_shared<Kernel>(io_, zmq_context_, logger_, config_, std::move(launch));
    kernel->set_tenant(record.tenant);
    std::erase_if(every_kernel_, [](const std::weak_ptr<Kernel>& known) { return known.expired(); });
    every_kernel_.push_back(kernel);
    watch_kernel(*kernel);
    if (record.pooled)
        pool_.push_back(kernel);
    else
        adopt(kernel);
    std::weak_ptr<Kernel> weak = kernel;
    kernel->adopt(record, [this, weak, id = record.id](std::optional<std::string> error) {
        if (!error)
            return;
        auto failed = weak.lock();
        logger_.warn("kernel_readoption_failed", {{"kernel_id", id}, {"error", *error}});
        lost_causes_[id] = *error;
        if (!failed)
            return;
        std::erase(pool_, failed);
        kernels_.erase(id);
        failed->shutdown("the kernel could not be re-adopted");
        forget(id);
    });
    return kernel;
}

std::shared_ptr<Kernel> KernelManager::find_or_attach(const std::string& kernel_id) {
    if (!needs_store(kernel_id))
        return attach_stored(kernel_id, std::nullopt);
    std::optional<KernelRecord> record;
    try {
        record = writer_.store().kernel(kernel_id);
    } catch (const std::exception& error) {
        logger_.error("store_read_failed", {{"kernel_id", kernel_id}, {"error", error.what()}});
        return nullptr;
    }
    return attach_stored(kernel_id, record);
}

void KernelManager::find_or_attach(const std::string& kernel_id,
                                   std::function<void(std::shared_ptr<Kernel>)> then) {
    if (!needs_store(kernel_id))
        return then(attach_stored(kernel_id, std::nullopt));
    writer_.read<std::optional<KernelRecord>>(
        [kernel_id](SessionStore& store) { return store.kernel(kernel_id); }, StoreWriter::default_read_limit,
        [this, kernel_id, then = std::move(then)](StoreAnswer<std::optional<KernelRecord>> answer) {
            if (!answer.ok()) {
                logger_.error("store_read_failed", {{"kernel_id", kernel_id}, {"error", answer.error}});
                auto held = find(kernel_id);
                return then(held && held->state() != KernelState::dead ? held : nullptr);
            }
            then(attach_stored(kernel_id, *answer.value));
        });
}

bool KernelManager::needs_store(const std::string& kernel_id) const {
    auto held = find(kernel_id);
    if (held && held->state() != KernelState::dead)
        return false;
    return writer_.shared() && !stopping_ && !shut_down_here_.contains(kernel_id);
}

std::shared_ptr<Kernel> KernelManager::attach_stored(const std::string& kernel_id,
                                                     const std::optional<KernelRecord>& record) {
    auto held = find(kernel_id);
    if (held && (held->state() != KernelState::dead || !writer_.shared()))
        return held;
    if (stopping_ || !writer_.shared() || shut_down_here_.contains(kernel_id))
        return held;
    if (held) {
        // Dead here: another gateway deleted it (then it is gone) or restarted it (then the store names
        // the new process, attached below).
        let_go(held, "the kernel ended through another gateway");
    }
    // A warm-pool kernel belongs to its gateway's pool until that gateway hands it out. Only local kernels
    // are attached from another gateway: a Slurm job is watched (and cancelled) by the gateway that submitted
    // it.
    if (!record || record->pooled || record->provisioner.value("name", std::string("local")) != "local" ||
        !record->process.alive())
        return nullptr;
    auto spec = registry_.find(record->spec_name);
    if (!spec)
        return nullptr;
    logger_.info("kernel_attached_from_store", {{"kernel_id", kernel_id}, {"owner", record->owner}});
    if (record->owner != owner_)
        attached_from_others_.insert(kernel_id);
    return attach_recorded(*record, *spec);
}

void KernelManager::restart_kernel(const std::shared_ptr<Kernel>& kernel, Kernel::ReadyHandler on_ready) {
    if (!writer_.shared())
        return kernel->restart(std::move(on_ready));
    const std::string lease = "kernel-restart:" + kernel->id();
    // The lease is asked for on the store's reader thread; one taken after the limit is released there.
    writer_.read<bool>(
        [lease](SessionStore& store) { return store.try_lease(lease); }, StoreWriter::default_read_limit,
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

void KernelManager::let_go(const std::shared_ptr<Kernel>& kernel, const std::string& reason) {
    if (auto found = kernels_.find(kernel->id()); found != kernels_.end() && found->second == kernel)
        kernels_.erase(found);
    std::erase(pool_, kernel);
    kernel->disown_files();    // the live process (or its gateway) uses them
    kernel->shutdown(reason);  // disconnects its clients; its process is gone or not ours
    kernel->release();
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

bool KernelManager::known(const std::string& kernel_id) const {
    if (find(kernel_id))
        return true;
    if (!writer_.store().shared() || shut_down_here_.contains(kernel_id))
        return false;
    try {
        return writer_.store().kernel(kernel_id).has_value();
    } catch (const std::exception&) {
        return true;  // unknown: a session is not dropped because the store did not answer
    }
}

void KernelManager::forget_lost_kernel(const KernelRecord& record, const std::string& cause) {
    logger_.warn("kernel_lost", {{"kernel_id", record.id}, {"cause", cause}});
    lost_causes_[record.id] = cause;
    std::error_code ignored;
    if (!record.workspace_dir.empty())
        remove_workspace(record.workspace_dir, logger_);
    fs::remove(record.connection_file, ignored);
    fs::remove(record.log_file, ignored);
    for (int port = 1; port <= 5; ++port)
        fs::remove(record.endpoint_base + "-" + std::to_string(port), ignored);
    forget(record.id);
}

std::optional<std::string> KernelManager::lost_cause(const std::string& kernel_id) const {
    auto found = lost_causes_.find(kernel_id);
    if (found == lost_causes_.end())
        return std::nullopt;
    return found->second;
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
    for (const auto& known : every_kernel_)
        if (auto kernel = known.lock())
            all.push_back(kernel);
    return all;
}

void KernelManager::flush_progress() {
    for (const auto& kernel : live_kernels())
        if (auto progress = kernel->take_progress())
            writer_.submit([id = kernel->id(), last = *progress](SessionStore& store) {
                store.set_kernel_progress(id, last);
            });
}

void KernelManager::housekeeping() {
    flush_progress();
    if (writer_.store().shared() && config_.cull_idle_timeout > 0)
        share_activity();
    const auto now = std::chrono::steady_clock::now();
    if (config_.orphan_timeout > 0 && now >= next_lease_renewal_) {
        for (const auto& kernel : live_kernels())
            kernel->renew_lease();
        next_lease_renewal_ = now + std::chrono::milliseconds(static_cast<long long>(
                                        std::clamp(config_.orphan_timeout / 4, 0.2, 30.0) * 1000));
    }
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
    if (writer_.store().shared())
        kernel.on_unexpected_exit([this](const Kernel& died) {
            // Being restarted through another gateway (its restart lease is taken), deleted through one (its
            // record is gone) or restarted by one already (the record names another process): restarting it
            // here would run it twice or resurrect it. Such a kernel stays dead here; the next request for
            // it attaches what the store records (find_or_attach).
            const std::string lease = "kernel-restart:" + died.id();
            auto let_go_later = [this, &died](const char* why) {
                logger_.info("kernel_ended_elsewhere", {{"kernel_id", died.id()}, {"why", why}});
                boost::asio::post(io_, [this, id = died.id(), why] {
                    if (auto held = find(id); held && held->state() == KernelState::dead)
                        let_go(held, why);
                });
                return false;
            };
            try {
                if (!writer_.store().try_lease(lease))
                    return let_go_later("restarted through another gateway");
                auto record = writer_.store().kernel(died.id());
                if (!record || record->process != died.record(false).process) {
                    writer_.store().release_lease(lease);
                    return let_go_later(record ? "restarted through another gateway"
                                               : "deleted through another gateway");
                }
            } catch (const std::exception& error) {
                logger_.error("store_read_failed", {{"kernel_id", died.id()}, {"error", error.what()}});
                return false;
            }
            // Held until the new process is recorded: the respawn (right after this returns) queues it.
            boost::asio::post(
                io_, [this, lease] { writer_.after_pending([this, lease] { release_lease(lease); }); });
            return true;
        });
    kernel.on_launch_failed(
        [&metrics = metrics_](std::string_view cause) { metrics.count_launch_failure(cause); });
}

bool KernelManager::pool_can_serve(const KernelSpec& spec, const KernelStartRequest& request) const {
    const auto& request_env = request.env;
    auto pool_spec = registry_.find(registry_.default_name());
    if (!pool_spec || pool_spec->directory != spec.directory)
        return false;
    // Pooled kernels have the spec's (or the gateway's default) network policy in their environment.
    if (request.network) {
        try {
            const NetworkSettings settings = config_.network_settings();
            if (kernel_policy_value(*request.network, settings) !=
                kernel_policy_value(spec_network(spec), settings))
                return false;
        } catch (const std::exception&) {
            return false;
        }
    }
    // A warm kernel already has its environment: only requests whose variables would not change it qualify.
    for (const auto& [name, value] : request_env) {
        const bool passed = name.starts_with("KERNEL_") ||
                            std::find(config_.env_whitelist.begin(), config_.env_whitelist.end(), name) !=
                                config_.env_whitelist.end();
        if (!passed)
            continue;
        if (std::find(config_.pool_ignored_env.begin(), config_.pool_ignored_env.end(), name) ==
            config_.pool_ignored_env.end())
            return false;
    }
    return true;
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

std::size_t KernelManager::pool_ready_count() const {
    return static_cast<std::size_t>(
        std::count_if(pool_.begin(), pool_.end(), [](const auto& k) { return k->ready(); }));
}

void KernelManager::refill_pool_soon() {
    if (pool_refill_pending_)
        return;
    pool_refill_pending_ = true;
    pool_refill_timer_.expires_after(pool_refill_pause);
    pool_refill_timer_.async_wait([this](const boost::system::error_code& timer_error) {
        if (!timer_error)  // else cancelled: refilled already, or the manager is stopping (or gone)
            refill_pool();
    });
}

void KernelManager::refill_pool() {
    if (pool_refill_pending_) {
        pool_refill_pending_ = false;
        pool_refill_timer_.cancel();
    }
    if (stopping_ || config_.warm_pool <= 0)
        return;
    auto spec = registry_.find(registry_.default_name());
    if (!spec)
        return;
    while (static_cast<int>(pool_.size()) < config_.warm_pool) {
        std::shared_ptr<Kernel> kernel;
        try {
            kernel = create_kernel(*spec, {});
        } catch (const std::exception& error) {
            logger_.error("pool_kernel_create_failed", {{"error", error.what()}});
            return;
        }
        pool_.push_back(kernel);
        std::weak_ptr<Kernel> weak = kernel;
        kernel->start([this, weak](std::optional<std::string> error) {
            auto started = weak.lock();
            if (!error) {
                pool_failures_ = 0;
                return;
            }
            logger_.warn("pool_kernel_failed", {{"error", *error}});
            if (started) {
                auto position = std::find(pool_.begin(), pool_.end(), started);
                if (position != pool_.end())
                    pool_.erase(position);
                started->shutdown("failed");
                forget(started->id());
            }
            // Back off so a broken kernelspec does not turn into a fork loop.
            ++pool_failures_;
            pool_retry_timer_.expires_after(
                std::chrono::seconds(std::min(30, 1 << std::min(pool_failures_, 5))));
            pool_retry_timer_.async_wait([this](const boost::system::error_code& timer_error) {
                if (!timer_error)
                    refill_pool();
            });
        });
        if (pool_failures_ > 0)
            break;  // one at a time while failing
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

std::vector<std::shared_ptr<Kernel>> KernelManager::list_everywhere() {
    if (writer_.store().shared()) {
        try {
            for (const KernelRecord& record : writer_.store().kernels())
                if (!record.pooled && !kernels_.contains(record.id))
                    find_or_attach(record.id);
        } catch (const std::exception& error) {
            logger_.error("store_read_failed", {{"operation", "list kernels"}, {"error", error.what()}});
        }
    }
    return list();
}

bool KernelManager::shutdown_kernel(const std::string& kernel_id, const std::string& reason) {
    auto found = kernels_.find(kernel_id);
    if (found == kernels_.end())
        return false;
    auto kernel = found->second;
    kernels_.erase(found);
    shut_down_here_.insert(kernel_id);
    kernel->shutdown(reason);
    forget(kernel_id);
    if (!writer_.store().shared()) {
        // An embedded store has this gateway alone: once the row is gone nobody writes it back, so the mark
        // goes too (kept, it cost every deleted kernel ~110 bytes for the gateway's life).
        writer_.after_pending([this, kernel_id] { shut_down_here_.erase(kernel_id); });
    }
    return true;
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

void KernelManager::share_activity() {
    const auto now = std::chrono::system_clock::now();
    std::erase_if(activity_shared_, [this](const auto& entry) { return !kernels_.contains(entry.first); });
    for (const auto& [id, kernel] : kernels_) {
        auto active = kernel->last_activity();
        // Kept in use by what the cull rules spare (connected clients, running code): recorded as active now.
        if ((kernel->connections() > 0 && !config_.cull_connected) ||
            (kernel->state() == KernelState::busy && !config_.cull_busy))
            active = now;
        auto& shared = activity_shared_[id];
        if (active - shared < std::chrono::seconds(1))
            continue;
        shared = active;
        writer_.submit([id = id, when = format_iso8601_utc(active)](SessionStore& store) {
            store.set_kernel_activity(id, when);
        });
    }
}

void KernelManager::cull_shared() {
    for (const auto& [id, kernel] : kernels_)
        kernel->expire_detached_sessions();
    if (cull_read_pending_)
        return;  // the store has not answered the previous sweep yet
    cull_read_pending_ = true;
    // The cull-leader lease and every kernel's record, read together on the store's reader thread.
    struct Sweep {
        bool leader = false;
        std::vector<KernelRecord> records;
    };
    writer_.read<Sweep>(
        [was_leader = cull_leader_](SessionStore& store) {
            Sweep sweep{was_leader || store.try_lease("cull-leader"), {}};
            if (sweep.leader)
                sweep.records = store.kernels();
            return sweep;
        },
        std::chrono::milliseconds(static_cast<long long>(std::max(1.0, config_.cull_interval) * 1000)),
        [this](StoreAnswer<Sweep> answer) {
            cull_read_pending_ = false;
            if (!answer.ok())
                return logger_.error("store_read_failed",
                                     {{"lease", "cull-leader"}, {"error", answer.error}});
            if (answer.value->leader && !std::exchange(cull_leader_, true))
                logger_.info("cull_leader", {{"owner", owner_}});
            if (cull_leader_ && !stopping_)
                cull_recorded(answer.value->records);
        },
        [this](const Sweep& late) {
            cull_read_pending_ = false;
            if (late.leader && !std::exchange(cull_leader_, true))
                logger_.info("cull_leader", {{"owner", owner_}});  // kept: the next sweep culls
        });
}

void KernelManager::cull_recorded(const std::vector<KernelRecord>& records) {
    const auto now = std::chrono::system_clock::now();
    const auto idle_limit =
        std::chrono::milliseconds(static_cast<long long>(config_.cull_idle_timeout * 1000));
    for (const KernelRecord& record : records) {
        if (record.pooled || shut_down_here_.contains(record.id))
            continue;
        auto active = parse_iso8601_utc(record.last_activity).value_or(now);  // unknown: not idle
        if (auto held = find(record.id)) {
            if (held->connections() > 0 && !config_.cull_connected)
                continue;
            if (held->state() == KernelState::busy && !config_.cull_busy)
                continue;
            active = std::max(active, held->last_activity());
        }
        if (now - active < idle_limit)
            continue;
        auto kernel = attach_stored(record.id, record);
        if (!kernel)
            continue;  // not running: its own gateway forgets it
        const auto idle_seconds = std::chrono::duration_cast<std::chrono::seconds>(now - active).count();
        logger_.info("kernel_culled", {{"kernel_id", record.id}, {"idle_seconds", idle_seconds}});
        kernel->notify_clients("[cellblock-gateway] kernel " + record.id + " is being shut down after " +
                               std::to_string(idle_seconds) + " s of inactivity (cull_idle_timeout)\n");
        shutdown_kernel(record.id,
                        "kernel culled after " + std::to_string(idle_seconds) + " s of inactivity");
    }
}

void KernelManager::cull() {
    if (writer_.shared())
        return cull_shared();
    const auto now = std::chrono::system_clock::now();
    const auto idle_limit =
        std::chrono::milliseconds(static_cast<long long>(config_.cull_idle_timeout * 1000));
    std::vector<std::string> victims;
    for (const auto& [id, kernel] : kernels_) {
        kernel->expire_detached_sessions();
        if (now - kernel->last_activity() < idle_limit)
            continue;
        if (kernel->connections() > 0 && !config_.cull_connected)
            continue;
        if (kernel->state() == KernelState::busy && !config_.cull_busy)
            continue;
        victims.push_back(id);
    }
    for (const std::string& id : victims) {
        auto kernel = find(id);
        const auto idle_seconds =
            std::chrono::duration_cast<std::chrono::seconds>(now - kernel->last_activity()).count();
        logger_.info("kernel_culled", {{"kernel_id", id}, {"idle_seconds", idle_seconds}});
        // Tell connected clients why the kernel is about to disappear (Kernel Gateway culls silently).
        kernel->notify_clients("[cellblock-gateway] kernel " + id + " is being shut down after " +
                               std::to_string(idle_seconds) + " s of inactivity (cull_idle_timeout)\n");
        shutdown_kernel(id, "kernel culled after " + std::to_string(idle_seconds) + " s of inactivity");
    }
}

}  // namespace cellblock::gateway
