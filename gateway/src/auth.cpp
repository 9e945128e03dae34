#include "cellblock/gateway/auth.hpp"

#include <algorithm>
#include <cctype>

#include "cellblock/gateway/crypto.hpp"
#include "cellblock/gateway/tenants.hpp"

namespace cellblock::gateway {

namespace {
bool starts_with_ignoring_case(std::string_view text, std::string_view prefix) {
    if (text.size() < prefix.size())
        return false;
    return std::equal(prefix.begin(), prefix.end(), text.begin(), [](char a, char b) {
        return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
    });
}

std::string_view trim(std::string_view text) {
    while (!text.empty() && (text.front() == ' ' || text.front() == '\t'))
        text.remove_prefix(1);
    while (!text.empty() && (text.back() == ' ' || text.back() == '\t'))
        text.remove_suffix(1);
    return text;
}
}  // namespace

namespace {
// The token of "Authorization: token X" or "Authorization: Bearer X".
std::optional<std::string_view> header_token(const HttpRequest& request) {
    auto header = request.find(http::field::authorization);
    if (header == request.end())
        return std::nullopt;
    std::string_view value = trim(header->value());
    for (std::string_view scheme : {"token ", "bearer "}) {
        if (starts_with_ignoring_case(value, scheme))
            return trim(value.substr(scheme.size()));
    }
    return std::nullopt;
}
}  // namespace

std::optional<Principal> TokenAuthenticator::authenticate(
    const HttpRequest& request, const std::map<std::string, std::string>& query) const {
    if (!enabled())
        return Principal{};
    // ?token= first, then the header, as Kernel Gateway accepts either.
    std::optional<std::string_view> candidates[2] = {std::nullopt, header_token(request)};
    if (auto token = query.find("token"); token != query.end())
        candidates[0] = token->second;
    for (const auto& token : candidates) {
        if (!token)
            continue;
        if (constant_time_equals(*token, token_))
            return Principal{};
        if (tenants_) {
            if (auto tenant = tenants_->resolve(*token))
                return tenant;
        }
    }
    return std::nullopt;
}

CorsPolicy::CorsPolicy(const GatewayConfig& config)
    : allow_origin_(config.allow_origin),
      allow_credentials_(config.allow_credentials),
      allow_headers_(config.allow_headers),
      allow_methods_(config.allow_methods),
      expose_headers_(config.expose_headers),
      max_age_(config.max_age) {}

void CorsPolicy::apply(HttpResponse& response) const {
    if (!allow_origin_.empty())
        response.set(http::field::access_control_allow_origin, allow_origin_);
    if (!allow_credentials_.empty())
        response.set(http::field::access_control_allow_credentials, allow_credentials_);
    if (!allow_headers_.empty())
        response.set(http::field::access_control_allow_headers, allow_headers_);
    if (!allow_methods_.empty())
        response.set(http::field::access_control_allow_methods, allow_methods_);
    if (!expose_headers_.empty())
        response.set(http::field::access_control_expose_headers, expose_headers_);
    if (!max_age_.empty())
        response.set(http::field::access_control_max_age, max_age_);
}

bool CorsPolicy::origin_allowed(const HttpRequest& request) const {
    auto origin = request.find(http::field::origin);
    if (origin == request.end())
        return true;
    if (allow_origin_ == "*")
        return true;
    const std::string_view origin_value = origin->value();
    if (!allow_origin_.empty() && origin_value == allow_origin_)
        return true;
    // Same host: the origin's authority equals the Host header.
    auto scheme_end = origin_value.find("://");
    std::string_view authority =
        scheme_end == std::string_view::npos ? origin_value : origin_value.substr(scheme_end + 3);
    auto host = request.find(http::field::host);
    return host != request.end() && authority == host->value();
}

}  // namespace cellblock::gateway
