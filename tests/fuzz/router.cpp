// Request targets as the gateway's HTTP server takes them apart (gateway/src/http/http_server.cpp
// handle_request, gateway/src/http/router.cpp): query split and parse_query, then Router::match over the
// gateway's route table, which percent-decodes every captured segment exactly once and refuses encoded '/'
// and NUL bytes.
//
// Input: the request target (path and query) as a client sends it.
// Invariants: nothing throws; a match without refusal captures {name} parameters that are one decoded segment
// (no '/', no NUL) and {name...} parameters made of such segments joined by '/'; every captured parameter
// decodes from the raw segment it came from; url_decode inverts percent-encoding; query keys are never empty.
#include "cellblock/gateway/http/router.hpp"

#include <memory>
#include <string>
#include <string_view>

#include "fuzz_support.hpp"

using namespace cellblock::gateway;
using cellblock::fuzz::require;

namespace {
// The routes rest_handlers.cpp, agent_api.cpp and mcp_endpoint.cpp register (the shapes matter, not the
// handlers: literals, {name} segments and a trailing {name...}).
constexpr std::string_view routes[] = {
    "/api",
    "/api/status",
    "/api/kernelspecs",
    "/api/kernelspecs/{name}",
    "/kernelspecs/{name}/{file}",
    "/api/kernels",
    "/api/kernels/{kernel_id}",
    "/api/kernels/{kernel_id}/interrupt",
    "/api/kernels/{kernel_id}/restart",
    "/api/kernels/{kernel_id}/channels",
    "/api/sessions",
    "/api/sessions/{session_id}",
    "/agent/v1/sessions",
    "/agent/v1/sessions/{session}",
    "/agent/v1/sessions/{session}/execute",
    "/agent/v1/sessions/{session}/reset",
    "/agent/v1/sessions/{session}/files",
    "/agent/v1/sessions/{session}/files/{path...}",
    "/agent/v1/sessions/{session}/notebook",
    "/agent/v1/sessions/{session}/audit",
    "/mcp",
};

class NullResource : public RestResource {};

const Router& gateway_router() {
    static const Router router = [] {
        Router built;
        for (std::string_view route : routes) {
            built.add(std::string(route), std::make_shared<NullResource>());
        }
        return built;
    }();
    return router;
}

std::string percent_encode_all(std::string_view text) {
    static constexpr char hex[] = "0123456789ABCDEF";
    std::string out;
    for (const char c : text) {
        const auto byte = static_cast<unsigned char>(c);
        out += '%';
        out += hex[byte >> 4];
        out += hex[byte & 15];
    }
    return out;
}

bool is_one_segment(std::string_view value) {
    return value.find('/') == std::string_view::npos && value.find('\0') == std::string_view::npos;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view target = cellblock::fuzz::as_text(data, size);

    auto decoded = url_decode(target, false);
    auto round_trip = url_decode(percent_encode_all(target), false);
    require(round_trip && *round_trip == target, "url_decode does not invert percent-encoding");
    if (decoded) {
        require(decoded->size() <= target.size(), "url_decode grew the text");
    }

    const auto query_start = target.find('?');
    const std::string_view path = target.substr(0, query_start);
    if (query_start != std::string_view::npos) {
        for (const auto& [name, value] : parse_query(target.substr(query_start + 1))) {
            require(!name.empty(), "parse_query kept an empty key");
        }
    }

    const auto match = gateway_router().match(path);
    if (!match || !match->refusal.empty()) {
        return 0;
    }
    const std::vector<std::string> segments = split_path(path);
    for (const auto& [name, value] : match->params) {
        if (name == "path") {
            require(value.find('\0') == std::string::npos, "a {path...} parameter holds a NUL byte");
            require(!value.starts_with('/') && !value.ends_with('/') && value.find("//") == std::string::npos,
                    "a {path...} parameter has an empty segment");
            continue;
        }
        require(!value.empty() && is_one_segment(value), "a {name} parameter is not one decoded segment");
        bool from_a_segment = false;
        for (const std::string& segment : segments) {
            const auto decoded_segment = url_decode(segment, false);
            from_a_segment = from_a_segment || (decoded_segment && *decoded_segment == value);
        }
        require(from_a_segment, "a {name} parameter is not the decoding of a path segment");
    }
    return 0;
}
