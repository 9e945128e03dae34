// A gateway kernel's lifecycle (gateway/include/cellblock/gateway/kernels/kernel_lifecycle.hpp): every
// transition of the table there, and what clients are shown in each phase.
#include "cellblock/gateway/kernels/kernel_lifecycle.hpp"

#include <gtest/gtest.h>

namespace cellblock::gateway {
namespace {

constexpr ProcessExit died{};
constexpr ProcessExit died_awaited{false, true};
constexpr ProcessExit cancelled{true, false};

// A lifecycle driven to `phase` through the transitions a kernel makes.
KernelLifecycle in(KernelPhase phase) {
    KernelLifecycle lifecycle;
    auto no_restart = [] { return false; };
    switch (phase) {
        case KernelPhase::starting:
            break;
        case KernelPhase::ready:
            lifecycle.became_ready();
            break;
        case KernelPhase::restart_pending:
            lifecycle.became_ready();
            lifecycle.restart(true);
            break;
        case KernelPhase::deciding:
            lifecycle.became_ready();
            lifecycle.process_exited(
                died, [] { return true; }, true);
            break;
        case KernelPhase::restarting:
            lifecycle.became_ready();
            lifecycle.restart(false);
            break;
        case KernelPhase::stopping:
            lifecycle.shutdown();
            break;
        case KernelPhase::stopped:
            lifecycle.shutdown();
            lifecycle.process_exited(died, no_restart);
            break;
        case KernelPhase::dead:
            lifecycle.launch_failed();
            break;
        case KernelPhase::released:
            lifecycle.release();
            break;
    }
    EXPECT_EQ(lifecycle.phase(), phase) << kernel_phase_name(phase);
    return lifecycle;
}

constexpr KernelPhase all_phases[] = {
    KernelPhase::starting, KernelPhase::ready,      KernelPhase::restart_pending,
    KernelPhase::deciding, KernelPhase::restarting, KernelPhase::stopping,
    KernelPhase::stopped,  KernelPhase::dead,       KernelPhase::released};

TEST(KernelLifecycle, AKernelStartsAsStartingAndIsShownStarting) {
    KernelLifecycle lifecycle;
    EXPECT_EQ(lifecycle.phase(), KernelPhase::starting);
    EXPECT_TRUE(lifecycle.launching());
    EXPECT_EQ(lifecycle.client_state(false), KernelState::starting);
}

TEST(KernelLifecycle, ReadinessIsReachedOnlyFromALaunch) {
    for (KernelPhase phase : all_phases) {
        KernelLifecycle lifecycle = in(phase);
        const bool launching = phase == KernelPhase::starting || phase == KernelPhase::restarting;
        EXPECT_EQ(lifecycle.became_ready(), launching) << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.phase(), launching ? KernelPhase::ready : phase) << kernel_phase_name(phase);
    }
}

TEST(KernelLifecycle, ALaunchFailureKillsOnlyALaunch) {
    for (KernelPhase phase : all_phases) {
        KernelLifecycle lifecycle = in(phase);
        const bool launching = phase == KernelPhase::starting || phase == KernelPhase::restarting;
        EXPECT_EQ(lifecycle.launch_failed(), launching) << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.phase(), launching ? KernelPhase::dead : phase) << kernel_phase_name(phase);
    }
}

TEST(KernelLifecycle, ARestartWaitsForARunningProcessAndLaunchesAtOnceOtherwise) {
    KernelLifecycle running = in(KernelPhase::ready);
    EXPECT_TRUE(running.restart(true));
    EXPECT_EQ(running.phase(), KernelPhase::restart_pending);
    KernelLifecycle gone = in(KernelPhase::dead);  // a dead kernel may be revived
    EXPECT_TRUE(gone.restart(false));
    EXPECT_EQ(gone.phase(), KernelPhase::restarting);
}

TEST(KernelLifecycle, EveryPhaseButAnEndingOneRestarts) {
    for (KernelPhase phase : all_phases) {
        for (bool process_running : {true, false}) {
            KernelLifecycle lifecycle = in(phase);
            const bool ending = lifecycle.ending();
            EXPECT_EQ(lifecycle.restart(process_running), !ending)
                << kernel_phase_name(phase) << (process_running ? " running" : " exited");
            const KernelPhase after =
                process_running ? KernelPhase::restart_pending : KernelPhase::restarting;
            EXPECT_EQ(lifecycle.phase(), ending ? phase : after)
                << kernel_phase_name(phase) << (process_running ? " running" : " exited");
        }
    }
}

TEST(KernelLifecycle, NothingRestartsAKernelThatIsEnding) {
    for (KernelPhase phase : {KernelPhase::stopping, KernelPhase::stopped, KernelPhase::released}) {
        KernelLifecycle lifecycle = in(phase);
        EXPECT_TRUE(lifecycle.ending());
        EXPECT_FALSE(lifecycle.restart(true)) << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.phase(), phase);
    }
}

TEST(KernelLifecycle, AShutdownHappensOnce) {
    for (KernelPhase phase : all_phases) {
        KernelLifecycle lifecycle = in(phase);
        const bool ending = lifecycle.ending();
        EXPECT_EQ(lifecycle.shutdown(), !ending) << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.phase(), ending ? phase : KernelPhase::stopping) << kernel_phase_name(phase);
    }
}

TEST(KernelLifecycle, AnExitWhileStoppingFinishesTheStop) {
    KernelLifecycle lifecycle = in(KernelPhase::stopping);
    bool asked = false;
    EXPECT_EQ(lifecycle.process_exited(died, [&] { return asked = true; }), ExitAction::finish_stop);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::stopped);
    EXPECT_FALSE(asked) << "a stopping kernel is never restarted";
}

TEST(KernelLifecycle, AnExitAfterARestartRequestLaunchesTheReplacement) {
    KernelLifecycle lifecycle = in(KernelPhase::restart_pending);
    EXPECT_EQ(lifecycle.process_exited(died_awaited, [] { return false; }), ExitAction::respawn);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::restarting);
    EXPECT_EQ(lifecycle.client_state(true), KernelState::restarting);
}

TEST(KernelLifecycle, AnExitBeforeReadinessFailsTheStartItsWaitersAwait) {
    for (KernelPhase phase : {KernelPhase::starting, KernelPhase::restarting}) {
        KernelLifecycle lifecycle = in(phase);
        EXPECT_EQ(lifecycle.process_exited(died_awaited, [] { return true; }), ExitAction::fail_start);
        EXPECT_EQ(lifecycle.phase(), KernelPhase::dead);
    }
}

TEST(KernelLifecycle, AServingKernelThatDiesIsRestartedWhenAllowed) {
    KernelLifecycle lifecycle = in(KernelPhase::ready);
    EXPECT_EQ(lifecycle.process_exited(died, [] { return true; }), ExitAction::auto_restart);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::restarting);
}

TEST(KernelLifecycle, AServingKernelThatDiesPastItsRestartsIsDead) {
    KernelLifecycle lifecycle = in(KernelPhase::ready);
    EXPECT_EQ(lifecycle.process_exited(died, [] { return false; }), ExitAction::die);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::dead);
    EXPECT_EQ(lifecycle.client_state(false), KernelState::dead);
}

// A shared store: whether another gateway deleted or restarted the kernel is asked off the io thread, so the
// restart waits in `deciding` for the answer.
TEST(KernelLifecycle, ADeathTheStoreMustJudgeWaitsForItsAnswerShownRestarting) {
    KernelLifecycle lifecycle = in(KernelPhase::ready);
    EXPECT_EQ(lifecycle.process_exited(
                  died, [] { return true; }, true),
              ExitAction::ask);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::deciding);
    EXPECT_EQ(lifecycle.client_state(false), KernelState::restarting);
    EXPECT_FALSE(lifecycle.launching()) << "no process launches until the store has answered";
    EXPECT_EQ(lifecycle.process_exited(
                  died, [] { return true; }, true),
              ExitAction::ignore);
    EXPECT_EQ(lifecycle.restart_decided(true), ExitAction::auto_restart);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::restarting);
}

TEST(KernelLifecycle, ARestartTheStoreRefusesLeavesTheKernelDead) {
    KernelLifecycle lifecycle = in(KernelPhase::deciding);
    EXPECT_EQ(lifecycle.restart_decided(false), ExitAction::die);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::dead);
}

TEST(KernelLifecycle, NoStoreQuestionWithoutARestartLeft) {
    KernelLifecycle lifecycle = in(KernelPhase::ready);
    EXPECT_EQ(lifecycle.process_exited(
                  died, [] { return false; }, true),
              ExitAction::die);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::dead);
}

TEST(KernelLifecycle, AnAnswerAfterAShutdownOrRestartMovesNothing) {
    KernelLifecycle stopped = in(KernelPhase::deciding);
    EXPECT_TRUE(stopped.shutdown());
    EXPECT_EQ(stopped.restart_decided(true), ExitAction::ignore);
    EXPECT_EQ(stopped.phase(), KernelPhase::stopping);
    KernelLifecycle restarted = in(KernelPhase::deciding);
    EXPECT_TRUE(restarted.restart(false));
    EXPECT_EQ(restarted.restart_decided(false), ExitAction::ignore);
    EXPECT_EQ(restarted.phase(), KernelPhase::restarting);
    for (KernelPhase phase : all_phases) {
        if (phase == KernelPhase::deciding)
            continue;
        KernelLifecycle other = in(phase);
        EXPECT_EQ(other.restart_decided(true), ExitAction::ignore) << kernel_phase_name(phase);
        EXPECT_EQ(other.phase(), phase) << kernel_phase_name(phase);
    }
}

TEST(KernelLifecycle, AKernelTheSchedulerEndedIsNotRestartedBehindItsBack) {
    KernelLifecycle lifecycle = in(KernelPhase::ready);
    bool asked = false;
    EXPECT_EQ(lifecycle.process_exited(cancelled, [&] { return asked = true; }), ExitAction::end_externally);
    EXPECT_EQ(lifecycle.phase(), KernelPhase::dead);
    EXPECT_FALSE(asked) << "the restart lease is not even asked for";
}

TEST(KernelLifecycle, AnExitBeforeReadinessNobodyAwaitsCountsAsADeathWhileServing) {
    // A kernel re-adopted in the background has no waiter: its exit is judged as a ready kernel's.
    for (KernelPhase phase : {KernelPhase::starting, KernelPhase::restarting}) {
        KernelLifecycle restarted = in(phase);
        EXPECT_EQ(restarted.process_exited(died, [] { return true; }), ExitAction::auto_restart)
            << kernel_phase_name(phase);
        EXPECT_EQ(restarted.phase(), KernelPhase::restarting) << kernel_phase_name(phase);
        KernelLifecycle gone = in(phase);
        EXPECT_EQ(gone.process_exited(died, [] { return false; }), ExitAction::die)
            << kernel_phase_name(phase);
        EXPECT_EQ(gone.phase(), KernelPhase::dead) << kernel_phase_name(phase);
        KernelLifecycle ended = in(phase);
        bool asked = false;
        EXPECT_EQ(ended.process_exited(cancelled, [&] { return asked = true; }), ExitAction::end_externally)
            << kernel_phase_name(phase);
        EXPECT_EQ(ended.phase(), KernelPhase::dead) << kernel_phase_name(phase);
        EXPECT_FALSE(asked) << kernel_phase_name(phase);
    }
}

TEST(KernelLifecycle, AReleaseHandsOverAKernelInAnyPhaseForGood) {
    for (KernelPhase phase : all_phases) {
        KernelLifecycle lifecycle = in(phase);
        lifecycle.release();
        EXPECT_EQ(lifecycle.phase(), KernelPhase::released) << kernel_phase_name(phase);
        EXPECT_TRUE(lifecycle.ending()) << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.client_state(false), KernelState::dead) << kernel_phase_name(phase);
        // Final: nothing this gateway does moves it on.
        EXPECT_FALSE(lifecycle.became_ready()) << kernel_phase_name(phase);
        EXPECT_FALSE(lifecycle.launch_failed()) << kernel_phase_name(phase);
        EXPECT_FALSE(lifecycle.restart(false)) << kernel_phase_name(phase);
        EXPECT_FALSE(lifecycle.shutdown()) << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.process_exited(died, [] { return true; }), ExitAction::ignore)
            << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.phase(), KernelPhase::released) << kernel_phase_name(phase);
    }
}

TEST(KernelLifecycle, AnExitOfAFinishedKernelIsIgnored) {
    for (KernelPhase phase : {KernelPhase::stopped, KernelPhase::dead, KernelPhase::released}) {
        KernelLifecycle lifecycle = in(phase);
        EXPECT_EQ(lifecycle.process_exited(died, [] { return true; }), ExitAction::ignore)
            << kernel_phase_name(phase);
        EXPECT_EQ(lifecycle.phase(), phase);
    }
}

TEST(KernelLifecycle, ClientsSeeBusyOrIdleOnlyWhileReady) {
    for (KernelPhase phase : all_phases) {
        const KernelLifecycle lifecycle = in(phase);
        const KernelState shown = lifecycle.client_state(true);
        if (phase == KernelPhase::ready)
            EXPECT_EQ(shown, KernelState::busy);
        else
            EXPECT_NE(shown, KernelState::busy) << kernel_phase_name(phase);
    }
    EXPECT_EQ(in(KernelPhase::ready).client_state(false), KernelState::idle);
    EXPECT_EQ(in(KernelPhase::restart_pending).client_state(false), KernelState::restarting);
    EXPECT_EQ(in(KernelPhase::stopping).client_state(false), KernelState::dead);
}

}  // namespace
}  // namespace cellblock::gateway
