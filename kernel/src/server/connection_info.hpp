// The Jupyter connection file: where the public sockets go and how messages are signed.
#pragma once

#include <filesystem>
#include <string>

namespace cellblock::kernel {

struct ConnectionInfo {
    std::string transport = "tcp";
    std::string ip = "127.0.0.1";
    int shell_port = 0;
    int control_port = 0;
    int stdin_port = 0;
    int iopub_port = 0;
    int hb_port = 0;
    std::string signature_scheme = "hmac-sha256";
    std::string key;  // empty = messages are not signed

    // Throws std::runtime_error naming the file and the problem.
    static ConnectionInfo load(const std::filesystem::path& file);
    // "tcp://127.0.0.1:5555" or "ipc://path-5" (the Jupyter convention for ipc).
    std::string endpoint(int port) const;
};

}  // namespace cellblock::kernel
