#pragma once
// A gateway kernel's lifecycle: one phase and the functions that move it. `Kernel` (kernel.cpp) asks this
// type what an event means and acts on the answer; nothing else decides whether a kernel is ready, restarting
// or gone. The execution state clients see (KernelState: starting, idle, busy, restarting, dead) is derived
// from the phase, so a late status message of an old process can never hide "restarting" or "dead".
//
//   phase            what it means                                        the way out
//   starting         first launch or re-adoption, readiness not reached   became_ready, launch_failed
//   ready            serving; busy or idle as the kernel last said         restart, process_exited
//   restart_pending  a restart asked the old process to exit               process_exited -> respawn
//   deciding         died while serving; the shared store is asked first  restart_decided, restart, shutdown
//   restarting       a replacement process is launching                   became_ready, launch_failed
//   stopping         shut down (or the gateway exits); awaiting the exit  process_exited -> stopped
//   stopped          shut down and exited: final
//   dead             died or failed to launch; a restart may revive it     restart, shutdown
//   released         handed to the next gateway, untouched: final
//
// Every transition returns false, changing nothing, where its event does not apply to the phase.
#include <functional>
#include <string_view>

namespace cellblock::gateway {

enum class KernelState { starting, idle, busy, restarting, dead };
std::string_view kernel_state_name(KernelState state);

enum class KernelPhase {
    starting,
    ready,
    restart_pending,
    deciding,
    restarting,
    stopping,
    stopped,
    dead,
    released
};
std::string_view kernel_phase_name(KernelPhase phase);

// What the kernel must do when its process exits.
enum class ExitAction {
    ignore,          // stopped, dead or released already: nothing is owed
    finish_stop,     // a shutdown completes: clean up, report the kernel terminated
    respawn,         // a restart's old process is gone: launch the replacement
    fail_start,      // died before it became ready: the waiters get the error
    end_externally,  // the scheduler or an operator ended it: dead, not restarted behind their back
    auto_restart,    // died while serving, and may be restarted
    die,             // died while serving, no restart left (or not allowed)
    ask,             // died while serving and may be restarted here, but the store decides: ask it, then
                     // restart_decided
};

struct ProcessExit {
    bool ended_externally = false;  // scancel, time limit, preemption (the provisioner says)
    bool start_awaited = false;     // someone waits for readiness (a start, adopt or restart handler)
};

class KernelLifecycle {
  public:
    KernelPhase phase() const { return phase_; }
    bool ready() const { return phase_ == KernelPhase::ready; }
    // A process is launching: its reports and readiness probes count.
    bool launching() const { return phase_ == KernelPhase::starting || phase_ == KernelPhase::restarting; }
    // Shut down, shutting down or released: nothing may start it again.
    bool ending() const;
    // What clients see, `busy` being the kernel's own last status while ready.
    KernelState client_state(bool busy) const;

    bool became_ready();   // starting | restarting -> ready
    bool launch_failed();  // starting | restarting -> dead
    // ready | starting | restarting | restart_pending | deciding | dead -> restart_pending while the old
    // process runs, restarting otherwise.
    bool restart(bool process_running);
    bool shutdown();  // any but stopping, stopped, released -> stopping
    void release() { phase_ = KernelPhase::released; }
    // `may_auto_restart` is asked only when its answer decides. With `ask_store` (a shared store: another
    // gateway may have deleted or restarted the kernel), a restart it allows is not made yet: the kernel is
    // `deciding` until restart_decided says what the store answered.
    ExitAction process_exited(const ProcessExit& exit, const std::function<bool()>& may_auto_restart,
                              bool ask_store = false);
    // deciding -> restarting (auto_restart) or dead (die); ignore in any other phase (a shutdown, restart or
    // release came first).
    ExitAction restart_decided(bool restart);

  private:
    KernelPhase phase_ = KernelPhase::starting;
};

}  // namespace cellblock::gateway
