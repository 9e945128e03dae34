#include "cellblock/gateway/kernels/kernel_lifecycle.hpp"

namespace cellblock::gateway {

std::string_view kernel_state_name(KernelState state) {
    switch (state) {
        case KernelState::starting:
            return "starting";
        case KernelState::idle:
            return "idle";
        case KernelState::busy:
            return "busy";
        case KernelState::restarting:
            return "restarting";
        case KernelState::dead:
            return "dead";
    }
    return "unknown";
}

std::string_view kernel_phase_name(KernelPhase phase) {
    switch (phase) {
        case KernelPhase::starting:
            return "starting";
        case KernelPhase::ready:
            return "ready";
        case KernelPhase::restart_pending:
            return "restart_pending";
        case KernelPhase::deciding:
            return "deciding";
        case KernelPhase::restarting:
            return "restarting";
        case KernelPhase::stopping:
            return "stopping";
        case KernelPhase::stopped:
            return "stopped";
        case KernelPhase::dead:
            return "dead";
        case KernelPhase::released:
            return "released";
    }
    return "unknown";
}

bool KernelLifecycle::ending() const {
    return phase_ == KernelPhase::stopping || phase_ == KernelPhase::stopped ||
           phase_ == KernelPhase::released;
}

KernelState KernelLifecycle::client_state(bool busy) const {
    switch (phase_) {
        case KernelPhase::starting:
            return KernelState::starting;
        case KernelPhase::ready:
            return busy ? KernelState::busy : KernelState::idle;
        case KernelPhase::restart_pending:
        case KernelPhase::deciding:
        case KernelPhase::restarting:
            return KernelState::restarting;
        case KernelPhase::stopping:
        case KernelPhase::stopped:
        case KernelPhase::dead:
        case KernelPhase::released:
            return KernelState::dead;
    }
    return KernelState::dead;
}

bool KernelLifecycle::became_ready() {
    if (!launching())
        return false;
    phase_ = KernelPhase::ready;
    return true;
}

bool KernelLifecycle::launch_failed() {
    if (!launching())
        return false;
    phase_ = KernelPhase::dead;
    return true;
}

bool KernelLifecycle::restart(bool process_running) {
    if (ending())
        return false;
    phase_ = process_running ? KernelPhase::restart_pending : KernelPhase::restarting;
    return true;
}

bool KernelLifecycle::shutdown() {
    if (ending())
        return false;
    phase_ = KernelPhase::stopping;
    return true;
}

ExitAction KernelLifecycle::process_exited(const ProcessExit& exit,
                                           const std::function<bool()>& may_auto_restart, bool ask_store) {
    switch (phase_) {
        case KernelPhase::stopped:
        case KernelPhase::dead:
        case KernelPhase::released:
        case KernelPhase::deciding:
            return ExitAction::ignore;
        case KernelPhase::stopping:
            phase_ = KernelPhase::stopped;
            return ExitAction::finish_stop;
        case KernelPhase::restart_pending:
            phase_ = KernelPhase::restarting;
            return ExitAction::respawn;
        case KernelPhase::starting:
        case KernelPhase::restarting:
            if (exit.start_awaited) {
                phase_ = KernelPhase::dead;
                return ExitAction::fail_start;
            }
            break;  // nobody waits (a kernel re-adopted in the background): as if it died serving
        case KernelPhase::ready:
            break;
    }
    if (exit.ended_externally) {
        phase_ = KernelPhase::dead;
        return ExitAction::end_externally;
    }
    if (may_auto_restart && may_auto_restart()) {
        phase_ = ask_store ? KernelPhase::deciding : KernelPhase::restarting;
        return ask_store ? ExitAction::ask : ExitAction::auto_restart;
    }
    phase_ = KernelPhase::dead;
    return ExitAction::die;
}

ExitAction KernelLifecycle::restart_decided(bool restart) {
    if (phase_ != KernelPhase::deciding)
        return ExitAction::ignore;
    phase_ = restart ? KernelPhase::restarting : KernelPhase::dead;
    return restart ? ExitAction::auto_restart : ExitAction::die;
}

}  // namespace cellblock::gateway
