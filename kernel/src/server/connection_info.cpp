#include "server/connection_info.hpp"

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace cellblock::kernel {

ConnectionInfo ConnectionInfo::load(const std::filesystem::path& file) {
    std::ifstream input(file);
    if (!input) {
        throw std::runtime_error("cannot read connection file " + file.string());
    }
    const auto json = nlohmann::json::parse(input, nullptr, false);
    if (json.is_discarded() || !json.is_object()) {
        throw std::runtime_error("connection file " + file.string() + " is not a JSON object");
    }
    ConnectionInfo info;
    try {
        info.transport = json.value("transport", info.transport);
        info.ip = json.value("ip", info.ip);
        info.shell_port = json.at("shell_port").get<int>();
        info.control_port = json.at("control_port").get<int>();
        info.stdin_port = json.at("stdin_port").get<int>();
        info.iopub_port = json.at("iopub_port").get<int>();
        info.hb_port = json.at("hb_port").get<int>();
        info.key = json.value("key", std::string());
        info.signature_scheme = json.value("signature_scheme", info.signature_scheme);
    } catch (const nlohmann::json::exception& error) {
        throw std::runtime_error("connection file " + file.string() + ": " + error.what());
    }
    if (info.transport != "tcp" && info.transport != "ipc") {
        throw std::runtime_error("connection file " + file.string() + ": unsupported transport " +
                                 info.transport);
    }
    return info;
}

std::string ConnectionInfo::endpoint(int port) const {
    return transport + "://" + ip + (transport == "tcp" ? ":" : "-") + std::to_string(port);
}

}  // namespace cellblock::kernel
