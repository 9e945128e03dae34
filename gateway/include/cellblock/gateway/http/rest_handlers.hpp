#pragma once
// The Jupyter Kernel Gateway REST surface and the /channels WebSocket, one RestResource per resource.
#include <boost/asio/io_context.hpp>

#include "cellblock/gateway/access/auth.hpp"
#include "cellblock/gateway/access/tenant_quotas.hpp"
#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/http/router.hpp"
#include "cellblock/gateway/jupyter/kernelspec_registry.hpp"
#include "cellblock/gateway/jupyter/session_manager.hpp"
#include "cellblock/gateway/kernels/kernel_manager.hpp"
#include "cellblock/gateway/observability/log.hpp"
#include "cellblock/gateway/observability/metrics.hpp"

namespace cellblock::gateway {

// Everything a handler may need; owned by main(), outlives the server.
struct GatewayServices {
    boost::asio::io_context& io;
    const Logger& logger;
    const GatewayConfig& config;
    KernelSpecRegistry& kernelspecs;
    KernelManager& kernels;
    JupyterSessionManager& sessions;
    StoreWriter& writer;
    const TokenAuthenticator& auth;
    const CorsPolicy& cors;
    GatewayMetrics& metrics;
    TenantQuotas& quotas;
};

// Registers /api, /api/status, /api/kernelspecs..., /kernelspecs/{name}/{file}, /api/kernels...,
// /api/sessions... and /api/kernels/{kernel_id}/channels on `router` (paths are relative to base_url).
void register_jupyter_api(Router& router, GatewayServices& services);

// Registers GET /metrics: services.metrics in the Prometheus text format, behind the same token as the API.
void register_metrics_endpoint(Router& router, GatewayServices& services);

// Kernel ids look like UUIDs (Kernel Gateway's route regex \w+-\w+-\w+-\w+-\w+).
bool looks_like_kernel_id(std::string_view id);

}  // namespace cellblock::gateway
