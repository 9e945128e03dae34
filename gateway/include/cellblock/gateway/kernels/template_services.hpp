#pragma once
// The worker zygote templates of this gateway's local kernels: one `cellblock-kernel --template-service` per
// zygote tenant (kernel/src/launch/template_service.hpp), started with the tenant's first local kernel here
// and stopped a short grace after its last one, or when the gateway stops its kernels (Ctrl-C). A service
// also stops by itself when the gateway's process ends, however it ends, so no template outlives the gateway
// that ran it. Kernels it supervises get CELLBLOCK_ZYGOTE_SUPERVISED=1 and never start a template themselves.
// Lives on the io thread.
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "cellblock/gateway/observability/log.hpp"

namespace cellblock::gateway {

class ChildProcess;
struct InstanceLaunch;

class TemplateServices : public std::enable_shared_from_this<TemplateServices> {
  public:
    // Held by a kernel instance for its life: the tenant's service runs while one is held.
    class Hold {
      public:
        Hold(std::weak_ptr<TemplateServices> services, std::string tenant);
        ~Hold();
        Hold(const Hold&) = delete;
        Hold& operator=(const Hold&) = delete;

      private:
        std::weak_ptr<TemplateServices> services_;
        std::string tenant_;
    };

    TemplateServices(boost::asio::io_context& io, const Logger& logger, std::chrono::milliseconds grace);
    ~TemplateServices();  // lets running services go: each stops when it sees the gateway's process end

    // For a kernel about to start: holds its zygote tenant's service (started now if none runs) and marks the
    // launch supervised. Null, and the launch unchanged, when it is not a cellblock kernel with a zygote
    // tenant.
    std::unique_ptr<Hold> hold(InstanceLaunch& launch);
    // Gateway shutdown, after its kernels were stopped: stops every service and waits up to `timeout`.
    void stop_all(std::chrono::milliseconds timeout);

  private:
    struct Service {
        std::unique_ptr<ChildProcess> process;
        std::string config;  // the kernel config it was started with
        int holders = 0;
        std::unique_ptr<boost::asio::steady_timer> grace;
        // Its stdout and stderr (<runtime_dir>/zygote-<tenant>.log), removed when it ends.
        std::filesystem::path output;
    };
    void start(const std::string& tenant, const std::string& kernel, const std::string& config,
               const std::filesystem::path& output);
    void release(const std::string& tenant);
    void stop(const std::string& tenant);

    boost::asio::io_context& io_;
    const Logger& logger_;
    std::chrono::milliseconds grace_;
    std::map<std::string, Service> services_;
    std::set<std::string> off_;  // kernel configs whose service said the zygote is off there
};

}  // namespace cellblock::gateway
