// A kernel started where the gateway cannot place a connection file (a Slurm job on another node) binds its
// public sockets on ephemeral TCP ports itself and reports them back: to the gateway's launch registry, over
// CurveZMQ (the registry's public key comes on the command line), with the one-time token the gateway gave
// the job. The report carries the HMAC key and the kernel's own Curve public key, both made here and never
// written to disk; the kernel server then serves only Curve clients that know that key.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

#include "server/connection_info.hpp"

namespace cellblock::kernel {

struct CurveKeyPair {
    std::string public_key;  // Z85, 40 characters
    std::string secret_key;
};

// Throws std::runtime_error when libzmq was built without CURVE.
CurveKeyPair make_curve_keypair();

// The address of this host's interface that routes to the host of `endpoint` ("tcp://host:port"): where the
// kernel binds, so its ports are reachable from the gateway and only on that interface.
std::string local_address_towards(const std::string& endpoint);

// tcp on `ip`, every port 0 (ephemeral, chosen at bind), a fresh 256-bit HMAC key.
ConnectionInfo ephemeral_connection(const std::string& ip);

struct ReportTarget {
    std::string endpoint;           // the registry, tcp://host:port
    std::string server_public_key;  // the registry's Curve public key (Z85)
    std::string token;              // one-time, from CELLBLOCK_REPORT_TOKEN
};

// Sends `report` (the token is added) and waits for the registry's acceptance; throws std::runtime_error
// with the registry's reason, or on timeout.
void send_launch_report(const ReportTarget& target, nlohmann::json report, std::chrono::milliseconds timeout);

}  // namespace cellblock::kernel
