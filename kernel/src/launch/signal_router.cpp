#include "launch/signal_router.hpp"

#include <pthread.h>
#include <signal.h>

#include "common/logging.hpp"

namespace cellblock::kernel {
namespace {

sigset_t kernel_signals() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGQUIT);
    sigaddset(&set, SIGUSR2);  // only used to wake the router for destruction
    return set;
}

}  // namespace

void block_kernel_signals() {
    const sigset_t set = kernel_signals();
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
}

SignalRouter::SignalRouter(std::function<void()> on_interrupt, std::function<void(int)> on_terminate)
    : on_interrupt_(std::move(on_interrupt)), on_terminate_(std::move(on_terminate)) {
    thread_ = std::thread([this] {
        const sigset_t set = kernel_signals();
        while (true) {
            int signo = 0;
            if (sigwait(&set, &signo) != 0) {
                continue;
            }
            if (signo == SIGUSR2) {
                return;
            }
            if (signo == SIGHUP) {
                // The kernel outlives the gateway that started it (its own session, no terminal): a hang-up
                // from whoever still holds an old session must not end the user's state.
                log_event(LogLevel::info, "signal_ignored", {{"signal", "SIGHUP"}});
                continue;
            }
            if (signo == SIGINT) {
                log_event(LogLevel::debug, "signal", {{"signal", "SIGINT"}});
                if (on_interrupt_) {
                    on_interrupt_();
                }
                continue;
            }
            log_event(LogLevel::info, "signal", {{"signal", signo}});
            if (on_terminate_) {
                on_terminate_(signo);
            }
        }
    });
}

SignalRouter::~SignalRouter() {
    if (thread_.joinable()) {
        pthread_kill(thread_.native_handle(), SIGUSR2);
        thread_.join();
    }
}

}  // namespace cellblock::kernel
