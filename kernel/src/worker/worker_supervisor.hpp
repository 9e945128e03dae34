// Starts the confined Python worker through the sandbox library, keeps one ready, interrupts and kills
// it, and relaunches it after it dies.
//
// Every launch happens on one long-lived launcher thread: the sandbox ties PR_SET_PDEATHSIG to the thread
// that forked, so a short-lived thread would take the worker with it when it ends. The first launch
// starts with the supervisor, so kernel_info is answered at once while the worker warms up.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cellblock/sandbox/sandbox.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/unique_fd.hpp"
#include "common/utf8_decoder.hpp"
#include "worker/worker_channel.hpp"
#include "worker/zygote_template.hpp"

namespace cellblock::kernel {

struct WorkerLaunchSpec {
    std::filesystem::path python = "/usr/bin/python3";
    std::filesystem::path worker_script;  // host path; its directory is bind-mounted read-only
    std::filesystem::path policy_file;    // sandbox policy JSON
    std::filesystem::path workspace;      // host directory mounted at the policy's workspace target
                                          // (the sandbox gives it to the session's uid)
    std::uint64_t memory_bytes = 0;       // overrides the policy's memory limit (0 = keep the policy's)
    std::chrono::milliseconds ready_timeout{60000};
    std::vector<std::string> environment;  // NAME=value, added to the worker's

    // A socket listening on 127.0.0.1:port in every worker's own network namespace (each launch, the first
    // and every relaunch, gets a new one), handed to `serve` right after the launch, before the worker
    // reports ready and so before any code of the user's runs. Unset: no listener, and the worker's
    // seccomp filter admits no inet socket at all.
    struct LoopbackService {
        std::uint16_t port = 0;
        std::function<void(UniqueFd listener)> serve;
    };
    std::optional<LoopbackService> loopback_service;

    // Workers forked from a preloaded template shared by the sessions of one tenant (sandbox/README.md
    // "Worker zygote"), listening on <state_dir>/zygote-<tenant>.sock. A launch the template cannot serve
    // goes by exec, with one `zygote_fallback` log line. A supervised kernel leaves the template to its
    // template service (the gateway runs one per tenant, launch/template_service.cpp); one without a
    // supervisor starts a dead template again itself (worker/zygote_template.hpp). Unset: every launch is by
    // exec.
    struct Zygote {
        TemplateSpec template_spec;
        bool supervised = false;
    };
    std::optional<Zygote> zygote;
};

// One running worker. The shell thread reads its fds; other threads may only signal or kill it.
class LiveWorker {
  public:
    LiveWorker(sandbox::Process process, UniqueFd channel, UniqueFd stdout_pipe, UniqueFd stderr_pipe);
    ~LiveWorker();
    LiveWorker(const LiveWorker&) = delete;
    LiveWorker& operator=(const LiveWorker&) = delete;

    int channel_fd() const noexcept { return channel_.get(); }
    int stdout_fd() const noexcept { return stdout_.get(); }
    int stderr_fd() const noexcept { return stderr_.get(); }
    // Readable once the worker has ended. The worker's own duplicate, open for this object's whole life:
    // terminate() (from any thread) closes the sandbox's descriptor but never this one, so a reader
    // polling it sees the end instead of a closed or reused number.
    int pidfd() const noexcept { return pidfd_.get(); }
    pid_t pid() const noexcept { return pid_; }
    uid_t host_uid() const noexcept { return host_uid_; }

    void signal(int signo);
    void kill();
    // Kills and reaps now and releases the sandbox (cgroup, uid lease), whoever else holds this object.
    void terminate();
    // Reaps the worker once its pidfd is readable (waits at most `timeout`).
    std::optional<sandbox::Outcome> wait_for(std::chrono::milliseconds timeout);

    // Shell-thread state.
    FrameDecoder frames;
    Utf8StreamDecoder stdout_text;  // of the pipes (fd-level output)
    Utf8StreamDecoder stderr_text;
    Utf8StreamDecoder stdout_frame_text;  // of stream frames (Python-level output, cut anywhere)
    Utf8StreamDecoder stderr_frame_text;
    nlohmann::json ready_info;

  private:
    std::mutex mutex_;
    std::optional<sandbox::Process> process_;
    UniqueFd channel_, stdout_, stderr_;
    UniqueFd pidfd_;
    pid_t pid_ = 0;
    uid_t host_uid_ = 0;
};

class WorkerSupervisor {
  public:
    explicit WorkerSupervisor(WorkerLaunchSpec spec);
    ~WorkerSupervisor();
    // Starts the launcher thread, which launches the first worker right away.
    void start();
    WorkerSupervisor(const WorkerSupervisor&) = delete;
    WorkerSupervisor& operator=(const WorkerSupervisor&) = delete;

    // The ready worker; starts one if there is none and waits up to `timeout` for it. On failure returns
    // nullptr and sets `error` to a sentence naming the cause.
    std::shared_ptr<LiveWorker> acquire(std::chrono::milliseconds timeout, std::string& error);
    // The worker has ended or must go (protocol error, timeout): kill it if needed, reap it, report why
    // it ended, and start a replacement in the background.
    sandbox::Outcome retire(const std::shared_ptr<LiveWorker>& worker);

    // Kills the current worker and stops relaunching (kernel shutdown). Thread-safe, idempotent.
    void shutdown();

    // Set when a worker that had run code died; the next execute tells the user state was lost.
    std::optional<std::string> take_lost_state_note();
    // The worker's Python version once a worker has reported ready.
    std::optional<std::string> worker_python_version();

  private:
    void launcher_loop();
    std::shared_ptr<LiveWorker> launch_one(sandbox::Launcher& launcher);
    // Launches a worker with its channel and output pipes, not yet ready.
    std::shared_ptr<LiveWorker> start_worker(sandbox::Launcher& launcher);
    sandbox::LaunchRequest worker_request(sandbox::Launcher& launcher, int stdout_fd, int stderr_fd,
                                          int channel_fd) const;
    // Waits for the worker's 'ready' (kept as its ready_info); throws, with the tail of its output, if it
    // sends something else first, ends, or takes longer than the spec's ready_timeout.
    void await_ready(LiveWorker& worker);
    // Through the tenant's template if there is one, else (and on any failure of it) by exec.
    sandbox::Process launch_process(sandbox::Launcher& launcher, sandbox::LaunchRequest& request);

    WorkerLaunchSpec spec_;
    std::mutex mutex_;
    std::condition_variable changed_;
    enum class State { idle, starting, ready, failed, stopped } state_ = State::idle;
    bool launch_requested_ = true;
    std::shared_ptr<LiveWorker> current_;
    std::string launch_error_;
    std::optional<std::string> lost_state_note_;
    std::optional<std::string> python_version_;
    std::atomic<bool> stopping_{false};  // read by a launch in progress, which then gives up
    std::thread launcher_thread_;
};

}  // namespace cellblock::kernel
