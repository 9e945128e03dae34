#include "cellblock/gateway/kernels/provisioner.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <csignal>
#include <fstream>
#include <set>
#include <sstream>
#include <system_error>

#include "cellblock/contract/environment.hpp"
#include "cellblock/gateway/common/crypto.hpp"
#include "cellblock/gateway/jupyter/zmq_channel.hpp"
#include "cellblock/gateway/kernels/kernel_process.hpp"
#include "cellblock/gateway/kernels/template_services.hpp"

extern char** environ;

namespace cellblock::gateway {

using nlohmann::json;
namespace fs = std::filesystem;

bool known_provisioner(std::string_view name) {
    return name == "local" || name == "slurm";
}

// ------------------------------------------------------------------------------------------------ local

namespace {

class LocalInstance final : public KernelInstance {
  public:
    LocalInstance(boost::asio::io_context& io, const InstanceLaunch& launch,
                  std::unique_ptr<TemplateServices::Hold> template_hold)
        : template_hold_(std::move(template_hold)),
          process_(io, launch.argv, launch.environment, launch.working_directory.string(),
                   launch.output_file.string()),
          identity_(ProcessIdentity::of(process_.pid())) {}
    LocalInstance(boost::asio::io_context& io, pid_t pid) : process_(io, ChildProcess::Adopt{}, pid) {}
    bool running() const override { return process_.running(); }
    bool signal(int signal_number) override { return process_.signal_group(signal_number); }
    void on_exit(std::function<void(InstanceExit)> handler) override {
        process_.on_exit([handler = std::move(handler)](ProcessExit exit) {
            handler({exit.describe(), false});
        });
    }
    bool wait_for_exit(std::chrono::milliseconds timeout) override { return process_.wait_for_exit(timeout); }
    void release() override { process_.release(); }
    std::optional<ProcessIdentity> process_identity() const override { return identity_; }
    json describe() const override { return {{"name", "local"}, {"pid", process_.pid()}}; }

  private:
    std::unique_ptr<TemplateServices::Hold> template_hold_;  // its worker zygote template runs meanwhile
    ChildProcess process_;
    std::optional<ProcessIdentity> identity_;
};

class LocalProvisioner final : public Provisioner {
  public:
    LocalProvisioner(boost::asio::io_context& io, std::shared_ptr<TemplateServices> templates)
        : io_(io), templates_(std::move(templates)) {}
    std::string_view name() const override { return "local"; }
    bool reports_connection() const override { return false; }
    std::unique_ptr<KernelInstance> launch(const InstanceLaunch& launch, Connected) override {
        InstanceLaunch supervised = launch;
        auto hold = templates_->hold(supervised);
        if (!hold)
            // Not a kernel a template service here serves (another program, or its service could not start):
            // a kernel left to start its tenant's template itself would leave one running after every kernel.
            supervised.environment.erase("CELLBLOCK_ZYGOTE_TENANT");
        return std::make_unique<LocalInstance>(io_, supervised, std::move(hold));
    }

  private:
    boost::asio::io_context& io_;
    std::shared_ptr<TemplateServices> templates_;
};

// ------------------------------------------------------------------------------------------------ slurm

std::map<std::string, std::string> gateway_environment() {
    std::map<std::string, std::string> environment;
    for (char** entry = environ; entry && *entry; ++entry) {
        const std::string line = *entry;
        const auto equals = line.find('=');
        if (equals != std::string::npos)
            environment[line.substr(0, equals)] = line.substr(equals + 1);
    }
    return environment;
}

std::string trimmed(std::string text) {
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r'))
        text.pop_back();
    return text;
}

// Slurm's client commands, each a child of the gateway watched on the io_context (kernel_process.hpp), its
// output (stdout and stderr) collected in a private file and handed to `done` when it exits.
class SlurmCommands : public std::enable_shared_from_this<SlurmCommands> {
  public:
    using Done = std::function<void(bool succeeded, std::string output)>;
    SlurmCommands(boost::asio::io_context& io, const Logger& logger, fs::path directory)
        : io_(io), logger_(logger), directory_(std::move(directory)), environment_(gateway_environment()) {}
    ~SlurmCommands() {
        // A scancel still on its way at gateway exit is let finish: killing it could leave the job running.
        for (auto& [number, command] : running_)
            command.process->wait_for_exit(std::chrono::seconds(5));
    }

    void run(std::vector<std::string> argv, Done done) {
        const std::uint64_t number = ++counter_;
        const fs::path output = directory_ / ("slurm-command-" + std::to_string(number) + ".out");
        auto process =
            std::make_unique<ChildProcess>(io_, argv, environment_, std::string(), output.string());
        process->on_exit([weak = weak_from_this(), number](ProcessExit exit) {
            // Deferred: the ChildProcess that reports the exit is destroyed by the handler.
            auto self = weak.lock();
            if (!self)
                return;
            boost::asio::post(self->io_, [weak, number, exit] {
                if (auto owner = weak.lock())
                    owner->finish(number, exit);
            });
        });
        running_.emplace(number, Running{std::move(process), output, std::move(argv), std::move(done)});
    }

    // Gateway shutdown: waits for the commands on their way (scancel), outside the io_context.
    void wait_all(std::chrono::milliseconds timeout) {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        for (auto& [number, command] : running_) {
            const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            command.process->wait_for_exit(std::max(left, std::chrono::milliseconds(0)));
        }
    }

  private:
    struct Running {
        std::unique_ptr<ChildProcess> process;
        fs::path output;
        std::vector<std::string> argv;
        Done done;
    };
    void finish(std::uint64_t number, const ProcessExit& exit) {
        auto found = running_.find(number);
        if (found == running_.end())
            return;
        Running command = std::move(found->second);
        running_.erase(found);
        std::ifstream input(command.output);
        std::stringstream text;
        text << input.rdbuf();
        std::error_code ignored;
        fs::remove(command.output, ignored);
        const bool succeeded = !exit.signaled && exit.exit_code == 0;
        if (!succeeded)
            logger_.info("slurm_command_failed",
                         {{"command", command.argv}, {"exit", exit.describe()}, {"output", text.str()}});
        if (command.done)
            command.done(succeeded, text.str());
    }

    boost::asio::io_context& io_;
    const Logger& logger_;
    fs::path directory_;
    std::map<std::string, std::string> environment_;
    std::map<std::uint64_t, Running> running_;
    std::uint64_t counter_ = 0;
};

// Where reporting kernels send their connection: a ROUTER with a CurveZMQ server key, so a report (which
// holds the kernel's HMAC key) is never readable on the wire; a report counts only with a token the gateway
// gave out and not used before.
class LaunchRegistry {
  public:
    LaunchRegistry(boost::asio::io_context& io, zmq::context_t& context, const Logger& logger,
                   const std::string& ip)
        : logger_(logger) {
        if (!zmq_has("curve"))
            throw std::runtime_error("libzmq has no CURVE support: the slurm provisioner needs it");
        std::array<char, 41> public_key{}, secret_key{};
        if (zmq_curve_keypair(public_key.data(), secret_key.data()) != 0)
            throw std::runtime_error(std::string("zmq_curve_keypair: ") + zmq_strerror(zmq_errno()));
        public_key_ = public_key.data();
        const std::string secret = secret_key.data();
        channel_ = ZmqChannel::bind(
            io, context, zmq::socket_type::router, "tcp://" + ip + ":0",
            [this](std::vector<std::string>&& frames) { receive(std::move(frames)); },
            [&secret](zmq::socket_t& socket) {
                // A report is a few hundred bytes: anything larger is dropped by libzmq before it is read.
                socket.set(zmq::sockopt::maxmsgsize, std::int64_t{64} * 1024);
                socket.set(zmq::sockopt::curve_server, true);
                socket.set(zmq::sockopt::curve_secretkey, secret);
            });
        endpoint_ = channel_->last_endpoint();
        logger_.info("launch_registry_listening", {{"endpoint", endpoint_}});
    }
    ~LaunchRegistry() { channel_->close(); }

    const std::string& endpoint() const { return endpoint_; }
    const std::string& public_key() const { return public_key_; }

    std::string expect(Provisioner::Connected connected) {
        std::string token = random_hex(32);
        expected_[token] = std::move(connected);
        return token;
    }
    void forget(const std::string& token) { expected_.erase(token); }

  private:
    void receive(std::vector<std::string>&& frames) {
        if (frames.size() != 2)
            return;
        const json report = json::parse(frames[1], nullptr, false);
        auto answer = [&](const json& verdict) { channel_->send({frames[0], verdict.dump()}); };
        const std::string token = report.is_object() ? report.value("token", std::string()) : std::string();
        auto found = expected_.find(token);
        if (found == expected_.end()) {
            logger_.warn("launch_report_refused", {{"reason", "unknown or already used token"}});
            answer({{"status", "error"}, {"reason", "unknown or already used token"}});
            return;
        }
        Provisioner::Connected connected = std::move(found->second);
        expected_.erase(found);  // one time, whatever the report says
        ReportedConnection connection;
        try {
            connection.ip = report.at("ip").get<std::string>();
            connection.shell = report.at("shell_port").get<int>();
            connection.control = report.at("control_port").get<int>();
            connection.stdin_ = report.at("stdin_port").get<int>();
            connection.iopub = report.at("iopub_port").get<int>();
            connection.heartbeat = report.at("hb_port").get<int>();
            connection.key = report.at("key").get<std::string>();
            connection.curve_public_key = report.at("curve_public_key").get<std::string>();
            connection.host = report.value("host", std::string());
            for (int port : {connection.shell, connection.control, connection.stdin_, connection.iopub,
                             connection.heartbeat})
                if (port <= 0 || port > 65535)
                    throw std::invalid_argument("port out of range");
            if (connection.key.size() < 32 || connection.curve_public_key.size() != 40)
                throw std::invalid_argument("key or Curve public key malformed");
        } catch (const std::exception& error) {
            answer({{"status", "error"}, {"reason", std::string("malformed report: ") + error.what()}});
            connected(std::string("the kernel sent a malformed launch report: ") + error.what());
            return;
        }
        answer({{"status", "ok"}});
        connected(std::move(connection));
    }

    const Logger& logger_;
    std::shared_ptr<ZmqChannel> channel_;
    std::string endpoint_, public_key_;
    std::map<std::string, Provisioner::Connected> expected_;
};

// `'it'\''s'`: one word for /bin/sh whatever it contains.
std::string shell_quoted(const std::string& word) {
    std::string quoted = "'";
    for (char c : word) {
        if (c == '\'')
            quoted += "'\\''";
        else
            quoted += c;
    }
    return quoted + "'";
}

}  // namespace

std::string slurm_job_script(const std::vector<std::string>& argv,
                             const std::map<std::string, std::string>& environment) {
    // The document is one line of printable ASCII JSON: it cannot be the delimiter line.
    const std::string document = contract::encode_environment(environment);
    std::string script = "#!/bin/sh\n";
    if (auto path = environment.find("PATH"); path != environment.end())
        script += "PATH=" + shell_quoted(path->second) + "\nexport PATH\n";
    script += "exec";
    for (const std::string& argument : argv)
        script += " " + shell_quoted(argument);
    script += " --environment-stdin <<'CELLBLOCK_LAUNCH_ENVIRONMENT'\n" + document +
              "\nCELLBLOCK_LAUNCH_ENVIRONMENT\n";
    return script;
}

namespace {

bool terminal_job_state(std::string_view state) {
    static const std::set<std::string_view> terminal = {
        "COMPLETED",     "CANCELLED", "FAILED",   "TIMEOUT",      "NODE_FAIL", "PREEMPTED",
        "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"};
    return terminal.contains(state);
}

class SlurmProvisioner;

// One kernel process as one batch job. The handle (SlurmJob) is owned by the Kernel; what the asynchronous
// commands update lives in JobState, which they reach through weak pointers.
struct JobState {
    std::string kernel_id;
    std::string job_id;  // empty until sbatch answered
    std::string state = "SUBMITTING";
    std::string reason;
    std::string host;
    std::string token;
    bool ended = false;
    bool released = false;
    bool cancel_requested = false;
    std::function<void(InstanceExit)> exit_handler;
    std::optional<InstanceExit> early_exit;  // ended before a handler was set

    void end(InstanceExit exit) {
        if (ended)
            return;
        ended = true;
        if (exit_handler) {
            auto handler = std::move(exit_handler);
            handler(std::move(exit));
        } else {
            early_exit = std::move(exit);
        }
    }
};

class SlurmProvisioner final : public Provisioner, public std::enable_shared_from_this<SlurmProvisioner> {
  public:
    SlurmProvisioner(boost::asio::io_context& io, zmq::context_t& zmq_context, const Logger& logger,
                     const GatewayConfig& config, std::shared_ptr<JobWatchLeases> watch_leases)
        : io_(io),
          zmq_context_(zmq_context),
          logger_(logger),
          config_(config),
          watch_leases_(std::move(watch_leases)),
          poll_timer_(io) {}

    std::string_view name() const override { return "slurm"; }
    bool reports_connection() const override { return true; }
    std::unique_ptr<KernelInstance> launch(const InstanceLaunch& launch, Connected connected) override;
    std::unique_ptr<KernelInstance> adopt(const json& record, const std::string& kernel_id,
                                          const fs::path& runtime_dir) override;

    void cancel(JobState& job) {
        job.cancel_requested = true;
        if (!job.job_id.empty())
            commands(job).run({"scancel", job.job_id}, nullptr);
    }
    void signal(JobState& job, int signal_number) {
        commands(job).run({"scancel", "--batch", "--signal=" + std::to_string(signal_number), job.job_id},
                          nullptr);
    }
    void wait_for_commands(std::chrono::milliseconds timeout) {
        if (commands_)
            commands_->wait_all(timeout);
    }
    // Only `job`'s own entry: a handle released and then destroyed must not end the watch of the same job
    // attached again meanwhile under a new handle.
    void unwatch(const std::string& job_id, const JobState& job) {
        if (auto found = watched_.find(job_id);
            found != watched_.end() && found->second.job.lock().get() == &job) {
            stop_watching(found->first, found->second.kernel_id);
            watched_.erase(found);
        }
    }
    void forget_token(const std::string& token) {
        if (registry_)
            registry_->forget(token);
    }
    std::string log_file_of(const std::string&) const { return {}; }

  private:
    SlurmCommands& commands(const JobState&) { return *commands_; }
    void ensure_started(const fs::path& runtime_dir) {
        if (!commands_)
            commands_ = std::make_shared<SlurmCommands>(io_, logger_, runtime_dir);
        if (!registry_)
            registry_ =
                std::make_unique<LaunchRegistry>(io_, zmq_context_, logger_, config_.launch_registry_ip);
    }
    void submitted(const std::shared_ptr<JobState>& job, bool succeeded, const std::string& output);
    void watch(const std::shared_ptr<JobState>& job);
    void schedule_poll();
    void poll();
    void took_watch_leases(const std::vector<WatchedJob>& taken);
    void poll_watching();
    void stop_watching(const std::string& job_id, const std::string& kernel_id);
    void apply_poll(const std::string& output, const std::vector<std::string>& asked);

    // A job this gateway holds: polled while `leased` (its watch lease is this gateway's).
    struct Watched {
        std::weak_ptr<JobState> job;
        std::string kernel_id;
        bool leased = false;
    };

    boost::asio::io_context& io_;
    zmq::context_t& zmq_context_;
    const Logger& logger_;
    const GatewayConfig& config_;
    std::shared_ptr<SlurmCommands> commands_;
    std::unique_ptr<LaunchRegistry> registry_;
    std::shared_ptr<JobWatchLeases> watch_leases_;
    std::map<std::string, Watched> watched_;  // by job id
    boost::asio::steady_timer poll_timer_;
    bool polling_ = false;
};

class SlurmJob final : public KernelInstance {
  public:
    SlurmJob(std::shared_ptr<SlurmProvisioner> provisioner, std::shared_ptr<JobState> state)
        : provisioner_(std::move(provisioner)), state_(std::move(state)) {}
    ~SlurmJob() override {
        if (!state_->released && !state_->ended)
            provisioner_->cancel(*state_);
        if (!state_->job_id.empty())
            provisioner_->unwatch(state_->job_id, *state_);
        provisioner_->forget_token(state_->token);
        state_->exit_handler = nullptr;
    }
    bool running() const override { return !state_->ended; }
    bool signal(int signal_number) override {
        if (state_->ended || state_->released)  // a released job is another gateway's
            return false;
        if (signal_number == SIGTERM || signal_number == SIGKILL) {
            provisioner_->cancel(*state_);
            return true;
        }
        if (state_->job_id.empty() || state_->state != "RUNNING")
            return false;
        provisioner_->signal(*state_, signal_number);
        return true;
    }
    void on_exit(std::function<void(InstanceExit)> handler) override {
        if (state_->early_exit) {
            auto exit = std::move(*state_->early_exit);
            state_->early_exit.reset();
            handler(std::move(exit));
            return;
        }
        state_->exit_handler = std::move(handler);
    }
    bool wait_for_exit(std::chrono::milliseconds timeout) override {
        // Gateway shutdown: the scancel sent by signal() is let finish; Slurm ends the job.
        provisioner_->wait_for_commands(timeout);
        state_->ended = true;
        return true;
    }
    void release() override {
        state_->released = true;
        state_->exit_handler = nullptr;
        if (!state_->job_id.empty())
            provisioner_->unwatch(state_->job_id, *state_);
    }
    json describe() const override {
        return {{"name", "slurm"},
                {"job_id", state_->job_id},
                {"job_name", "cellblock-" + state_->kernel_id},
                {"host", state_->host},
                {"state", state_->state}};
    }
    std::string waiting_for() const override {
        if (state_->job_id.empty())
            return "the Slurm job is being submitted";
        if (state_->state == "PENDING")
            return "Slurm job " + state_->job_id + " is pending (" + state_->reason + ")";
        return "Slurm job " + state_->job_id + " is " + state_->state +
               (state_->host.empty() ? "" : " on " + state_->host) + " and its kernel has not reported";
    }

  private:
    std::shared_ptr<SlurmProvisioner> provisioner_;
    std::shared_ptr<JobState> state_;
};

std::unique_ptr<KernelInstance> SlurmProvisioner::launch(const InstanceLaunch& launch, Connected connected) {
    ensure_started(launch.runtime_dir);
    auto job = std::make_shared<JobState>();
    job->kernel_id = launch.kernel_id;
    std::weak_ptr<JobState> weak_job = job;
    job->token = registry_->expect(
        [weak_job, connected = std::move(connected)](std::variant<ReportedConnection, std::string> result) {
            auto reporting = weak_job.lock();
            if (!reporting || reporting->ended)
                return;
            if (auto* connection = std::get_if<ReportedConnection>(&result))
                reporting->host = connection->host;
            connected(std::move(result));
        });

    // The job's script: the kernel's environment and command, reporting instead of a connection file. No path
    // of the gateway's is used on the node (no shared filesystem): the kernel makes its own workspace there.
    std::vector<std::string> argv;
    for (std::size_t i = 0; i < launch.argv.size(); ++i) {
        const std::string& argument = launch.argv[i];
        if ((argument == "-f" || argument == "--connection-file") && i + 1 < launch.argv.size()) {
            ++i;
            continue;
        }
        if (argument.starts_with("--connection-file="))
            continue;
        argv.push_back(argument);
    }
    argv.insert(argv.end(), {"--report-to", registry_->endpoint()});
    std::map<std::string, std::string> environment = launch.environment;
    // The node makes its own workspace; no path of the gateway's means anything there.
    environment.erase("CELLBLOCK_WORKSPACE");
    environment.erase("CELLBLOCK_LEASE_CLEANUP_DIR");
    // No template service runs on a node (the gateway supervises only its own host's templates), and a
    // template a kernel started there itself would outlive the job: a Slurm kernel's workers go by exec.
    environment.erase("CELLBLOCK_ZYGOTE_TENANT");
    environment["CELLBLOCK_REPORT_TOKEN"] = job->token;
    environment["CELLBLOCK_REPORT_SERVER_KEY"] = registry_->public_key();
    std::string script;
    try {
        script = slurm_job_script(argv, environment);
    } catch (const std::exception&) {
        registry_->forget(job->token);
        throw;
    }
    const fs::path script_file = launch.runtime_dir / ("slurm-job-" + launch.kernel_id + ".sh");
    {
        const int fd = ::open(script_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0700);
        if (fd < 0)
            throw std::system_error(errno, std::generic_category(), "cannot create " + script_file.string());
        const ssize_t written = ::write(fd, script.data(), script.size());
        const int saved = errno;
        ::close(fd);
        if (written != static_cast<ssize_t>(script.size()))
            throw std::system_error(saved, std::generic_category(), "cannot write " + script_file.string());
    }

    std::vector<std::string> sbatch = {"sbatch",
                                       "--parsable",
                                       "--job-name=cellblock-" + launch.kernel_id,
                                       "--output=" + config_.slurm_job_output,
                                       "--chdir=/tmp",
                                       "--export=NONE",
                                       "--cpus-per-task=" + std::to_string(config_.slurm_cpus_per_task)};
    if (auto memory = launch.environment.find("CELLBLOCK_MEMORY_MB"); memory != launch.environment.end())
        sbatch.push_back(
            "--mem=" + std::to_string(std::stoll(memory->second) + config_.slurm_memory_overhead_mb) + "M");
    else if (config_.slurm_mem_mb > 0)
        sbatch.push_back("--mem=" + std::to_string(config_.slurm_mem_mb) + "M");
    if (!config_.slurm_time_limit.empty())
        sbatch.push_back("--time=" + config_.slurm_time_limit);
    for (const auto& [option, value] : {std::pair{"--partition=", &config_.slurm_partition},
                                        {"--account=", &config_.slurm_account},
                                        {"--qos=", &config_.slurm_qos},
                                        {"--constraint=", &config_.slurm_constraint}})
        if (!value->empty())
            sbatch.push_back(option + *value);
    sbatch.push_back(script_file.string());
    commands_->run(sbatch,
                   [weak = weak_from_this(), job, script_file](bool succeeded, const std::string& output) {
                       std::error_code ignored;
                       fs::remove(script_file, ignored);
                       if (auto self = weak.lock())
                           self->submitted(job, succeeded, output);
                   });
    logger_.info("kernel_job_submitting", {{"kernel_id", launch.kernel_id}});
    return std::make_unique<SlurmJob>(shared_from_this(), job);
}

std::unique_ptr<KernelInstance> SlurmProvisioner::adopt(const json& record, const std::string& kernel_id,
                                                        const fs::path& runtime_dir) {
    ensure_started(runtime_dir);
    auto job = std::make_shared<JobState>();
    job->kernel_id = kernel_id;
    job->job_id = record.at("job_id").get<std::string>();
    if (job->job_id.empty())
        throw std::runtime_error("the record has no Slurm job id");
    job->host = record.value("host", std::string());
    job->state = "RUNNING";  // until the first poll says otherwise
    watch(job);
    logger_.info("kernel_job_adopting", {{"kernel_id", kernel_id}, {"job_id", job->job_id}});
    return std::make_unique<SlurmJob>(shared_from_this(), job);
}

void SlurmProvisioner::submitted(const std::shared_ptr<JobState>& job, bool succeeded,
                                 const std::string& output) {
    if (!succeeded) {
        forget_token(job->token);
        job->state = "REFUSED";
        job->end({"Slurm refused the job: " + trimmed(output), true});
        return;
    }
    // "12345" or "12345;cluster"; warnings may come before it.
    std::string last_line;
    std::istringstream lines(output);
    for (std::string line; std::getline(lines, line);)
        if (!trimmed(line).empty())
            last_line = trimmed(line);
    job->job_id = last_line.substr(0, last_line.find(';'));
    job->state = "PENDING";
    logger_.info("kernel_job_submitted", {{"kernel_id", job->kernel_id}, {"job_id", job->job_id}});
    if (job->cancel_requested || job->released) {
        if (job->cancel_requested)
            commands_->run({"scancel", job->job_id}, nullptr);
        return;
    }
    watch(job);
}

void SlurmProvisioner::watch(const std::shared_ptr<JobState>& job) {
    auto& watched = watched_[job->job_id];
    watched.job = job;
    watched.kernel_id = job->kernel_id;
    schedule_poll();
}

void SlurmProvisioner::schedule_poll() {
    if (polling_ || watched_.empty())
        return;
    polling_ = true;
    poll_timer_.expires_after(std::chrono::milliseconds(
        static_cast<long long>(std::max(0.05, config_.slurm_poll_interval) * 1000)));
    poll_timer_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
        if (error)
            return;
        if (auto self = weak.lock())
            self->poll();
    });
}

void SlurmProvisioner::poll() {
    for (auto entry = watched_.begin(); entry != watched_.end();) {
        auto job = entry->second.job.lock();
        if (job && !job->ended && !job->released) {
            ++entry;
            continue;
        }
        stop_watching(entry->first, entry->second.kernel_id);
        entry = watched_.erase(entry);
    }
    if (watched_.empty()) {
        polling_ = false;
        return;
    }
    // The jobs another gateway watches: this one polls them only once their lease is its own.
    std::vector<WatchedJob> unleased;
    for (const auto& [job_id, watched] : watched_)
        if (!watched.leased)
            unleased.push_back({watched.kernel_id, job_id});
    if (unleased.empty())
        return poll_watching();
    watch_leases_->take(std::move(unleased), [weak = weak_from_this()](const std::vector<WatchedJob>& taken) {
        if (auto self = weak.lock()) {
            self->took_watch_leases(taken);
            self->poll_watching();
        }
    });
}

void SlurmProvisioner::took_watch_leases(const std::vector<WatchedJob>& taken) {
    for (const WatchedJob& job : taken) {
        auto found = watched_.find(job.job_id);
        if (found == watched_.end()) {  // let go while its lease was being taken
            watch_leases_->release(job);
            continue;
        }
        found->second.leased = true;
        logger_.debug("kernel_job_watching", {{"kernel_id", job.kernel_id}, {"job_id", job.job_id}});
    }
}

void SlurmProvisioner::stop_watching(const std::string& job_id, const std::string& kernel_id) {
    if (auto found = watched_.find(job_id); found != watched_.end() && found->second.leased) {
        found->second.leased = false;
        watch_leases_->release({kernel_id, job_id});
    }
}

void SlurmProvisioner::poll_watching() {
    // One squeue for every job this gateway watches (not one per kernel): the controller's load grows with
    // the interval, not with the number of kernels or of gateways. `-t all` keeps ended jobs visible for
    // MinJobAge.
    std::vector<std::string> asked;
    std::string ids;
    for (const auto& [job_id, watched] : watched_)
        if (watched.leased) {
            asked.push_back(job_id);
            ids += (ids.empty() ? "" : ",") + job_id;
        }
    if (asked.empty()) {
        polling_ = false;
        return schedule_poll();
    }
    commands_->run({"squeue", "-h", "-t", "all", "-o", "%i|%T|%r|%B", "-j", ids},
                   [weak = weak_from_this(), asked](bool, const std::string& output) {
                       if (auto self = weak.lock()) {
                           self->apply_poll(output, asked);
                           self->polling_ = false;
                           self->schedule_poll();
                       }
                   });
}

void SlurmProvisioner::apply_poll(const std::string& output, const std::vector<std::string>& asked) {
    std::map<std::string, std::array<std::string, 3>> seen;  // id -> state, reason, batch host
    std::istringstream lines(output);
    for (std::string line; std::getline(lines, line);) {
        std::array<std::string, 4> fields;
        std::size_t field = 0, start = 0;
        for (std::size_t at = 0; at <= line.size() && field < 4; ++at)
            if (at == line.size() || line[at] == '|') {
                fields[field++] = line.substr(start, at - start);
                start = at + 1;
            }
        if (field == 4)
            seen[fields[0]] = {fields[1], fields[2], fields[3]};
    }
    // squeue answers "Invalid job id" (and nothing) when every job asked for is gone from the controller.
    const bool answered = !seen.empty() || output.find("Invalid job id") != std::string::npos;
    for (const std::string& job_id : asked) {
        auto watched = watched_.find(job_id);
        if (watched == watched_.end())
            continue;
        auto job = watched->second.job.lock();
        if (!job || job->ended)
            continue;
        auto found = seen.find(job_id);
        if (found == seen.end()) {
            if (answered) {
                job->state = "GONE";
                job->end({"Slurm job " + job_id + " is no longer known to Slurm", true});
            }
            continue;
        }
        const auto& [state, reason, host] = found->second;
        job->state = state;
        job->reason = reason;
        if (!host.empty() && host != "(null)")
            job->host = host;
        if (terminal_job_state(state)) {
            std::string cause = "Slurm job " + job_id + " ended: " + state;
            if (!reason.empty() && reason != "None")
                cause += " (" + reason + ")";
            // COMPLETED/FAILED: the kernel process itself exited (shutdown, crash); anything else was Slurm's
            // or an operator's doing.
            job->end({cause, state != "COMPLETED" && state != "FAILED"});
        }
    }
}

}  // namespace

std::unique_ptr<KernelInstance> adopt_local_process(boost::asio::io_context& io, pid_t pid) {
    return std::make_unique<LocalInstance>(io, pid);
}

std::shared_ptr<Provisioner> make_local_provisioner(boost::asio::io_context& io,
                                                    std::shared_ptr<TemplateServices> templates) {
    return std::make_shared<LocalProvisioner>(io, std::move(templates));
}

std::shared_ptr<Provisioner> make_slurm_provisioner(boost::asio::io_context& io, zmq::context_t& zmq_context,
                                                    const Logger& logger, const GatewayConfig& config,
                                                    std::shared_ptr<JobWatchLeases> watch_leases) {
    return std::make_shared<SlurmProvisioner>(io, zmq_context, logger, config, std::move(watch_leases));
}

}  // namespace cellblock::gateway
