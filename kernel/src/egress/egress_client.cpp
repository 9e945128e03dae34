#include "egress/egress_client.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "common/logging.hpp"
#include "egress/egress_wire.hpp"

namespace cellblock::kernel::egress {

namespace {

// One running helper: its pid and our end of its channel. Shared with approval answers, which may come
// after the helper is gone (sending then fails and is ignored).
struct Helper {
    pid_t pid = 0;
    UniqueFd channel;
};

std::string describe_status(int status) {
    if (WIFEXITED(status)) {
        return "exited with status " + std::to_string(WEXITSTATUS(status));
    }
    if (WIFSIGNALED(status)) {
        return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" + ::strsignal(WTERMSIG(status)) +
               ")";
    }
    return "ended";
}

}  // namespace

class EgressClient::Impl {
  public:
    Impl(HelperSpec spec, ApprovalBroker& broker, EgressObserver& observer,
         std::function<void(const std::string&)> note)
        : spec_(std::move(spec)), broker_(broker), observer_(observer), note_(std::move(note)) {}

    void start() {
        auto helper = spawn();
        {
            const std::lock_guard lock(mutex_);
            helper_ = helper;
        }
        thread_ = std::thread([this, helper] { run(helper); });
    }

    void serve(UniqueFd listener) {
        std::shared_ptr<Helper> helper;
        {
            const std::lock_guard lock(mutex_);
            listener_ = std::move(listener);  // kept, to hand to a restarted helper
            helper = helper_;
        }
        if (helper) {
            wire::send(helper->channel.get(), {{"type", "serve"}}, listener_.get());
        }
    }

    void stop() {
        std::shared_ptr<Helper> helper;
        {
            const std::lock_guard lock(mutex_);
            stopping_ = true;
            helper = helper_;
        }
        wake_.notify_all();
        if (helper) {
            ::shutdown(helper->channel.get(), SHUT_RDWR);  // the helper reads EOF and ends; our reader too
        }
        if (thread_.joinable()) {
            thread_.join();
        }
    }

    pid_t pid() const {
        const std::lock_guard lock(mutex_);
        return helper_ ? helper_->pid : 0;
    }

  private:
    // posix_spawn with a clean environment and only the channel (fd 3): nothing of the kernel's (its
    // key, its ZMQ sockets, the workers' pipes) reaches the helper.
    std::shared_ptr<Helper> spawn() {
        int pair[2];
        if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0) {
            throw std::runtime_error(std::string("egress helper: socketpair: ") + std::strerror(errno));
        }
        UniqueFd ours(pair[0]);
        UniqueFd theirs(pair[1]);
        posix_spawn_file_actions_t actions;
        ::posix_spawn_file_actions_init(&actions);
        ::posix_spawn_file_actions_adddup2(&actions, theirs.get(), 3);
        ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
        ::posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
        ::posix_spawn_file_actions_addclosefrom_np(&actions, 4);
        const std::string program = spec_.program.string();
        const std::string uid = std::to_string(spec_.uid);
        const std::string gid = std::to_string(spec_.gid);
        char* argv[] = {const_cast<char*>(program.c_str()), const_cast<char*>(uid.c_str()),
                        const_cast<char*>(gid.c_str()), nullptr};
        char* envp[] = {nullptr};
        pid_t pid = 0;
        const int error = ::posix_spawn(&pid, program.c_str(), &actions, nullptr, argv, envp);
        ::posix_spawn_file_actions_destroy(&actions);
        if (error != 0) {
            throw std::runtime_error("egress helper: cannot start " + program + ": " + std::strerror(error));
        }
        theirs.reset();
        auto helper = std::make_shared<Helper>(Helper{pid, std::move(ours)});
        const bool sent = wire::send(helper->channel.get(), {{"type", "start"},
                                                             {"policy", spec_.policy},
                                                             {"hosts", spec_.hosts},
                                                             {"hosts_origin", spec_.hosts_origin}});
        auto ready = sent ? wire::receive(helper->channel.get()) : std::nullopt;
        if (!ready || ready->body["type"] != "ready") {
            ::kill(pid, SIGKILL);
            int status = 0;
            ::waitpid(pid, &status, 0);
            throw std::runtime_error("egress helper " + program +
                                     " did not start: " + describe_status(status));
        }
        log_event(LogLevel::info, "egress_helper_started", {{"pid", pid}, {"uid", spec_.uid}});
        return helper;
    }

    void run(std::shared_ptr<Helper> helper) {
        for (;;) {
            while (auto message = wire::receive(helper->channel.get())) {
                dispatch(helper, message->body);
            }
            int status = 0;
            ::waitpid(helper->pid, &status, 0);
            {
                const std::lock_guard lock(mutex_);
                helper_.reset();
                if (stopping_) {
                    return;
                }
            }
            fail_pending();
            const std::string what = "egress proxy helper (pid " + std::to_string(helper->pid) + ") " +
                                     describe_status(status) +
                                     "; requests it held were refused, restarting it";
            log_event(LogLevel::error, "egress_helper_died",
                      {{"pid", helper->pid}, {"status", describe_status(status)}});
            if (note_) {
                note_(what);
            }
            helper = restart();
            if (!helper) {
                return;
            }
        }
    }

    // A new helper, after a pause that grows with crashes in a row (a helper that dies at once must not
    // spin); with the current listener, so the worker's next connection is served again.
    std::shared_ptr<Helper> restart() {
        auto pause = std::chrono::milliseconds(100);
        for (;;) {
            {
                std::unique_lock lock(mutex_);
                if (wake_.wait_for(lock, pause, [this] { return stopping_; })) {
                    return nullptr;
                }
            }
            try {
                auto helper = spawn();
                const std::lock_guard lock(mutex_);
                if (stopping_) {
                    return helper;  // run() reads its EOF after stop() shut it down
                }
                helper_ = helper;
                if (listener_) {
                    wire::send(helper->channel.get(), {{"type", "serve"}}, listener_.get());
                }
                return helper;
            } catch (const std::exception& error) {
                log_event(LogLevel::error, "egress_helper_restart_failed", {{"error", error.what()}});
                pause = std::min(pause * 2, std::chrono::milliseconds(10'000));
            }
        }
    }

    void dispatch(const std::shared_ptr<Helper>& helper, const nlohmann::json& body) {
        try {
            const std::string type = body.at("type");
            if (type == "connection") {
                observer_.on_connection(wire::record_from_json(body));
            } else if (type == "approval_requested") {
                auto request = wire::request_from_json(body);
                {
                    const std::lock_guard lock(mutex_);
                    pending_[request.id] = request;
                }
                observer_.on_approval_requested(request, body.at("timeout_s").get<double>());
            } else if (type == "approval_decided") {
                auto request = wire::request_from_json(body);
                const auto decision = wire::decision_from_string(body.at("decision").get<std::string>());
                {
                    const std::lock_guard lock(mutex_);
                    pending_.erase(request.id);
                }
                if (decision) {
                    observer_.on_approval_decided(request, *decision,
                                                  body.at("decided_by").get<std::string>());
                }
            } else if (type == "approval") {
                const auto request = wire::request_from_json(body);
                std::weak_ptr<Helper> weak = helper;
                broker_.request(request, [weak, id = request.id](Decision decision, std::string decided_by) {
                    if (auto alive = weak.lock()) {
                        wire::send(alive->channel.get(), {{"type", "answer"},
                                                          {"id", id},
                                                          {"decision", std::string(to_string(decision))},
                                                          {"decided_by", std::move(decided_by)}});
                    }
                });
            }
        } catch (const std::exception& error) {
            // A malformed event from the helper is dropped, never trusted.
            log_event(LogLevel::warning, "egress_helper_bad_message", {{"error", error.what()}});
        }
    }

    // The helper died holding these: they are denied (the request's connection died with the helper).
    void fail_pending() {
        std::map<std::string, ApprovalRequest> pending;
        {
            const std::lock_guard lock(mutex_);
            pending.swap(pending_);
        }
        for (const auto& [id, request] : pending) {
            observer_.on_approval_decided(request, Decision::deny, "cellblock: the egress proxy crashed");
        }
    }

    HelperSpec spec_;
    ApprovalBroker& broker_;
    EgressObserver& observer_;
    std::function<void(const std::string&)> note_;
    mutable std::mutex mutex_;
    std::condition_variable wake_;
    bool stopping_ = false;
    std::shared_ptr<Helper> helper_;
    UniqueFd listener_;
    std::map<std::string, ApprovalRequest> pending_;
    std::thread thread_;
};

EgressClient::EgressClient(HelperSpec spec, ApprovalBroker& broker, EgressObserver& observer,
                           std::function<void(const std::string&)> note)
    : impl_(std::make_shared<Impl>(std::move(spec), broker, observer, std::move(note))) {}

EgressClient::~EgressClient() {
    stop();
}

void EgressClient::start() {
    impl_->start();
}
void EgressClient::serve(UniqueFd listener) {
    impl_->serve(std::move(listener));
}
void EgressClient::stop() {
    impl_->stop();
}
pid_t EgressClient::helper_pid() const {
    return impl_->pid();
}

}  // namespace cellblock::kernel::egress
