#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <system_error>
#include <zmq.hpp>

#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/jupyter/jupyter_message.hpp"
#include "cellblock/gateway/kernels/kernel_manager.hpp"

// KernelManager: the kernels recorded in the store. At start the ones this gateway left running are
// re-adopted (or forgotten with the cause); on a shared store another gateway's kernel (a local process on
// this host, or a Slurm job anywhere) is attached on demand, released (left running) when this gateway exits,
// and let go again when it ends through that gateway. The rest of the manager is in kernel_manager.cpp.

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {
// Whether another gateway's kernel can be attached from its record: a local process while it lives (this
// host's), a Slurm job by its job id, node, ports and Curve key (a job that has ended is found out by the
// first squeue poll of its adoption, which then fails).
bool attachable(const KernelRecord& record) {
    const std::string provisioner = record.provisioner.value("name", std::string("local"));
    if (provisioner == "local")
        return record.process.alive();
    return provisioner == "slurm" && !record.provisioner.value("job_id", std::string()).empty();
}
}  // namespace

void KernelManager::readopt_recorded_kernels() {
    const auto records = writer_.store().kernels();
    std::set<std::string> recorded;
    for (const KernelRecord& record : records)
        recorded.insert(record.id);
    stop_unrecorded_kernels(recorded);
    for (const KernelRecord& record : records) {
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

void KernelManager::stop_unrecorded_kernels(const std::set<std::string>& recorded) {
    // A kernel is recorded just after its spawn, on the store's writer thread: a gateway killed in between
    // leaves a kernel no record names, which would run until its orphan lease ran out. Its connection file
    // in this runtime directory still names its sockets and key, so it is asked to shut down like any kernel.
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(runtime_dir_, error)) {
        const std::string name = entry.path().filename().string();
        if (!name.starts_with("kernel-") || entry.path().extension() != ".json")
            continue;
        const std::string id = entry.path().stem().string().substr(std::string_view("kernel-").size());
        if (recorded.contains(id) || !request_shutdown(entry.path()))
            continue;
        logger_.warn(
            "kernel_unrecorded_stopped",
            {{"kernel_id", id}, {"cause", "no record names it (its gateway ended before recording it)"}});
        std::error_code ignored;
        fs::remove(entry.path(), ignored);
        fs::remove(runtime_dir_ / ("kernel-" + id + ".log"), ignored);
        if (fs::is_directory(workspace_root_ / id, ignored))
            remove_workspace(workspace_root_ / id, logger_);
    }
}

bool KernelManager::request_shutdown(const fs::path& connection_file) {
    try {
        std::ifstream file(connection_file);
        const json connection = json::parse(file);
        KernelEndpoints endpoints;
        endpoints.base = connection.at("ip").get<std::string>();
        // This gateway's kernels listen on ipc endpoints inside its runtime directory. Anything else (a
        // runtime directory shared with Jupyter's own, whose kernels use tcp) is not this gateway's to stop.
        std::error_code unknown;
        if (connection.value("transport", "") != "ipc" ||
            !fs::equivalent(fs::path(endpoints.base).parent_path(), runtime_dir_, unknown))
            return false;
        zmq::socket_t control(zmq_context_, zmq::socket_type::dealer);
        control.set(zmq::sockopt::linger, 200);  // a kernel already gone must not hold up the gateway's exit
        control.connect(endpoints.endpoint(KernelEndpoints::control));
        const HmacSigner signer(connection.at("key").get<std::string>());
        const auto frames = encode_wire(
            make_message(Channel::control, "shutdown_request", {{"restart", false}}, new_uuid()), signer);
        for (std::size_t index = 0; index < frames.size(); ++index)
            control.send(zmq::buffer(frames[index]),
                         index + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
        return true;
    } catch (const std::exception& failure) {
        logger_.error("kernel_shutdown_request_failed",
                      {{"connection_file", connection_file.string()}, {"error", failure.what()}});
        return false;
    }
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
    const bool elsewhere = launch.owned_elsewhere;
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
    kernel->adopt(record, [this, weak, id = record.id, elsewhere](std::optional<std::string> error) {
        if (!error)
            return;
        auto failed = weak.lock();
        logger_.warn("kernel_readoption_failed", {{"kernel_id", id}, {"error", *error}});
        if (elsewhere && !shut_down_here_.contains(id)) {
            // Another gateway's kernel: not this one's to end or forget (that gateway may be submitting its
            // job again right now). Dropped here, its process untouched; the next request attaches what the
            // store records then. One shut down here while attaching (a cull) is this gateway's to end.
            if (failed)
                drop_unattached(failed);
            return;
        }
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

void KernelManager::find_or_attach(const std::string& kernel_id,
                                   std::function<void(std::shared_ptr<Kernel>)> then) {
    look_up(kernel_id, [then = std::move(then)](StoreAnswer<std::shared_ptr<Kernel>> answer) {
        then(answer.ok() ? std::move(*answer.value) : nullptr);
    });
}

void KernelManager::look_up(const std::string& kernel_id,
                            std::function<void(StoreAnswer<std::shared_ptr<Kernel>>)> then) {
    if (!needs_store(kernel_id))
        return then({attach_stored(kernel_id, std::nullopt), {}});
    writer_.read<std::optional<KernelRecord>>(
        [kernel_id](SessionStore& store) { return store.kernel(kernel_id); }, StoreWriter::default_read_limit,
        [this, kernel_id, then = std::move(then)](StoreAnswer<std::optional<KernelRecord>> answer) {
            if (!answer.ok()) {
                logger_.error("store_read_failed", {{"kernel_id", kernel_id}, {"error", answer.error}});
                // Attached meanwhile by another request: held, so no store is needed.
                if (auto held = find(kernel_id); held && held->state() != KernelState::dead)
                    return then({held, {}});
                return then({std::nullopt, answer.error});
            }
            then({attach_stored(kernel_id, *answer.value), {}});
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
    // A warm-pool kernel belongs to its gateway's pool until that gateway hands it out. A Slurm job attached
    // here is polled by whichever gateway holding it has its watch lease (provisioner.hpp). It is ended here
    // only by a delete, cull or restart through this gateway; one that does not answer its attaching in time
    // is dropped here untouched (drop_unattached); it is released at this gateway's exit (shutdown_all,
    // detach_all), and after it ended it is submitted again by whichever gateway takes its restart lease
    // (ask_store_about_restart).
    if (!record || record->pooled || !attachable(*record))
        return nullptr;
    auto spec = registry_.find(record->spec_name);
    if (!spec)
        return nullptr;
    logger_.info("kernel_attached_from_store", {{"kernel_id", kernel_id}, {"owner", record->owner}});
    if (record->owner != owner_)
        attached_from_others_.insert(kernel_id);
    return attach_recorded(*record, *spec);
}

void KernelManager::drop_unattached(const std::shared_ptr<Kernel>& kernel) {
    if (auto found = kernels_.find(kernel->id()); found != kernels_.end() && found->second == kernel)
        kernels_.erase(found);
    std::erase(pool_, kernel);
    attached_from_others_.erase(kernel->id());
    kernel->disconnect_clients("the kernel could not be attached through this gateway");
    kernel->disown_files();
    kernel->release();
}

void KernelManager::let_go(const std::shared_ptr<Kernel>& kernel, const std::string& reason) {
    if (auto found = kernels_.find(kernel->id()); found != kernels_.end() && found->second == kernel)
        kernels_.erase(found);
    std::erase(pool_, kernel);
    kernel->disown_files();    // the live process (or its gateway) uses them
    kernel->shutdown(reason);  // disconnects its clients; its process is gone or not ours
    kernel->release();
}

bool KernelManager::known_among(const std::string& kernel_id,
                                const std::optional<std::set<std::string>>& stored) const {
    if (find(kernel_id))
        return true;
    if (!writer_.shared() || shut_down_here_.contains(kernel_id))
        return false;
    return !stored || stored->contains(kernel_id);
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

}  // namespace cellblock::gateway
