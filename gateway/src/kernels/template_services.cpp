#include "cellblock/gateway/kernels/template_services.hpp"

#include <boost/asio/post.hpp>
#include <csignal>
#include <cstdlib>

#include "cellblock/gateway/kernels/kernel_process.hpp"
#include "cellblock/gateway/kernels/provisioner.hpp"

namespace cellblock::gateway {

namespace fs = std::filesystem;

namespace {

// What kernel/src/launch/template_service.hpp exits with when its config switches the zygote off.
constexpr int service_found_zygote_off = 3;

// The kernel config of a cellblock kernel's argv (`cellblock-kernel --config FILE ...`); empty for any other.
std::string cellblock_kernel_config(const std::vector<std::string>& argv) {
    if (argv.empty() || fs::path(argv.front()).filename() != "cellblock-kernel")
        return {};
    for (std::size_t i = 1; i + 1 < argv.size(); ++i)
        if (argv[i] == "--config")
            return argv[i + 1];
    return {};
}

}  // namespace

TemplateServices::Hold::Hold(std::weak_ptr<TemplateServices> services, std::string tenant)
    : services_(std::move(services)), tenant_(std::move(tenant)) {}

TemplateServices::Hold::~Hold() {
    if (auto services = services_.lock())
        services->release(tenant_);
}

TemplateServices::TemplateServices(boost::asio::io_context& io, const Logger& logger,
                                   std::chrono::milliseconds grace)
    : io_(io), logger_(logger), grace_(grace) {}

TemplateServices::~TemplateServices() {
    for (auto& [tenant, service] : services_)
        service.process->release();
}

std::unique_ptr<TemplateServices::Hold> TemplateServices::hold(InstanceLaunch& launch) {
    const auto tenant = launch.environment.find("CELLBLOCK_ZYGOTE_TENANT");
    const std::string config = cellblock_kernel_config(launch.argv);
    if (tenant == launch.environment.end() || tenant->second.empty() || config.empty() ||
        off_.contains(config))
        return nullptr;
    auto found = services_.find(tenant->second);
    if (found == services_.end()) {
        try {
            start(tenant->second, launch.argv.front(), config,
                  launch.runtime_dir / ("zygote-" + tenant->second + ".log"));
        } catch (const std::exception& error) {
            logger_.error("zygote_service_failed", {{"tenant", tenant->second}, {"error", error.what()}});
            return nullptr;  // the kernel starts its workers by exec
        }
        found = services_.find(tenant->second);
    }
    ++found->second.holders;
    found->second.grace.reset();
    launch.environment["CELLBLOCK_ZYGOTE_SUPERVISED"] = "1";
    return std::make_unique<Hold>(weak_from_this(), tenant->second);
}

void TemplateServices::start(const std::string& tenant, const std::string& kernel, const std::string& config,
                             const fs::path& output) {
    std::map<std::string, std::string> environment = {{"CELLBLOCK_ZYGOTE_TENANT", tenant}};
    if (const char* path = std::getenv("PATH"))
        environment["PATH"] = path;
    auto process = std::make_unique<ChildProcess>(
        io_, std::vector<std::string>{kernel, "--config", config, "--template-service"}, environment, "/",
        output.string());
    const pid_t pid = process->pid();
    process->on_exit([weak = weak_from_this(), tenant, pid](ProcessExit exit) {
        // Deferred: the ChildProcess that reports the exit is destroyed by the handler.
        auto self = weak.lock();
        if (!self)
            return;
        boost::asio::post(self->io_, [weak, tenant, pid, exit] {
            auto owner = weak.lock();
            if (!owner)
                return;
            auto found = owner->services_.find(tenant);
            if (found == owner->services_.end() || found->second.process->pid() != pid)
                return;
            if (!exit.signaled && exit.exit_code == service_found_zygote_off)
                owner->off_.insert(found->second.config);
            else
                owner->logger_.info("zygote_service_ended", {{"tenant", tenant}, {"exit", exit.describe()}});
            std::error_code ignored;
            fs::remove(found->second.output, ignored);
            owner->services_.erase(found);
        });
    });
    logger_.info("zygote_service_started", {{"tenant", tenant}, {"pid", pid}});
    services_[tenant] = Service{std::move(process), config, 0, nullptr, output};
}

void TemplateServices::release(const std::string& tenant) {
    auto found = services_.find(tenant);
    if (found == services_.end() || --found->second.holders > 0)
        return;
    // A grace before the stop: a restart or the next session of the tenant finds its template still there.
    found->second.grace = std::make_unique<boost::asio::steady_timer>(io_, grace_);
    found->second.grace->async_wait(
        [weak = weak_from_this(), tenant](const boost::system::error_code& error) {
            auto self = weak.lock();
            if (error || !self)
                return;
            auto service = self->services_.find(tenant);
            if (service != self->services_.end() && service->second.holders == 0)
                self->stop(tenant);
        });
}

void TemplateServices::stop(const std::string& tenant) {
    auto found = services_.find(tenant);
    if (found == services_.end())
        return;
    logger_.info("zygote_service_stopping", {{"tenant", tenant}});
    found->second.process->signal_group(
        SIGTERM);  // it retires its template, which ends after its last worker
    found->second.grace.reset();
}

void TemplateServices::stop_all(std::chrono::milliseconds timeout) {
    for (auto& [tenant, service] : services_)
        service.process->signal_group(SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto& [tenant, service] : services_) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        service.process->wait_for_exit(std::max(left, std::chrono::milliseconds(0)));
    }
    for (auto& [tenant, service] : services_) {
        std::error_code ignored;
        fs::remove(service.output, ignored);
    }
    services_.clear();
}

}  // namespace cellblock::gateway
