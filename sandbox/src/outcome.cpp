// Outcome: how a confined program ended, in words a person understands.
#include <cstring>

#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::sandbox {

std::string Outcome::describe() const {
    switch (reason) {
        case Reason::exited:
            return "exited with status " + std::to_string(exit_code);
        case Reason::signaled: {
            const char* name = signal > 0 ? ::strsignal(signal) : nullptr;
            return "killed by signal " + std::to_string(signal) +
                   (name ? " (" + std::string(name) + ")" : "");
        }
        case Reason::memory_limit:
            return "killed by the memory limit";
        case Reason::time_limit:
            return "killed by the time limit";
        case Reason::cpu_limit:
            return "killed by the CPU time limit";
        case Reason::output_limit:
            return "killed by the output limit";
    }
    return "ended for an unknown reason";
}

int Outcome::shell_status() const {
    if (reason == Reason::exited) {
        return exit_code;
    }
    return 128 + (signal > 0 ? signal : 9);
}

}  // namespace cellblock::sandbox
