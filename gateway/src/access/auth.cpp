#include "cellblock/gateway/access/auth.hpp"

#include <algorithm>
#include <cctype>
#include <vector>

#include "cellblock/contract/html_text.hpp"
#include "cellblock/gateway/access/tenants.hpp"
#include "cellblock/gateway/common/crypto.hpp"

namespace cellblock::gateway {

using contract::html_escaped;

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

namespace {
constexpr std::string_view list_scope = "/agent/v1/view", sessions_prefix = "/agent/v1/sessions/";

// `prefix` followed by one non-empty segment ("/static/page.js").
bool one_segment_after(std::string_view rest, std::string_view prefix) {
    return rest.starts_with(prefix) && rest.size() > prefix.size() &&
           rest.substr(prefix.size()).find('/') == std::string_view::npos;
}
bool is_static_file(std::string_view rest) {
    return one_segment_after(rest, "/static/");
}

std::string_view path_of(const HttpRequest& request) {
    const std::string_view target = request.target();
    return target.substr(0, target.find('?'));
}

// Every value of a `cellblock_view` cookie in the request's Cookie headers.
std::vector<std::string_view> view_cookies(const HttpRequest& request) {
    std::vector<std::string_view> values;
    for (auto field = request.find(http::field::cookie);
         field != request.end() && field->name() == http::field::cookie; ++field) {
        std::string_view rest = field->value();
        while (!rest.empty()) {
            const auto end = rest.find(';');
            const std::string_view pair = trim(rest.substr(0, end));
            rest = end == std::string_view::npos ? std::string_view{} : rest.substr(end + 1);
            const auto equals = pair.find('=');
            if (equals != std::string_view::npos &&
                trim(pair.substr(0, equals)) == TokenAuthenticator::view_cookie_name)
                values.push_back(trim(pair.substr(equals + 1)));
        }
    }
    return values;
}
}  // namespace

std::optional<std::string_view> TokenAuthenticator::view_cookie_scope(std::string_view path) {
    if (const auto at = path.rfind(list_scope); at != std::string_view::npos) {
        const std::string_view rest = path.substr(at + list_scope.size());
        if (rest.empty() || rest == "/sessions" || is_static_file(rest) || one_segment_after(rest, "/open/"))
            return path.substr(0, at + list_scope.size());
    }
    const auto at = path.rfind(sessions_prefix);
    if (at == std::string_view::npos)
        return std::nullopt;
    const std::string_view after = path.substr(at + sessions_prefix.size());
    const auto slash = after.find('/');
    if (slash == 0 || slash == std::string_view::npos)
        return std::nullopt;
    const std::string_view rest = after.substr(slash);
    if (rest == "/view" || rest == "/events" ||
        (rest.starts_with("/view/") && is_static_file(rest.substr(std::string_view("/view").size()))))
        return path.substr(0, at + sessions_prefix.size() + slash);
    return std::nullopt;
}

std::string TokenAuthenticator::view_cookie(std::string_view scope) const {
    // HMAC-SHA256 over "view:" + scope (the signer's four frames are hashed in sequence), hex.
    const HmacSigner signer(token_);
    const std::string_view parts[4] = {"view:", scope, "", ""};
    return signer.sign(parts);
}

HttpResponse TokenAuthenticator::refusal(const HttpRequest& request) const {
    const std::string_view path = path_of(request);
    const auto scope = request.method() == http::verb::get ? view_cookie_scope(path) : std::nullopt;
    const std::string_view rest = scope ? path.substr(scope->size()) : std::string_view("-");
    if (!scope || !(rest.empty() || rest == "/view"))
        return json_error(http::status::unauthorized, "Missing or invalid token");
    HttpResponse response{http::status::unauthorized, request.version()};
    response.set(http::field::content_type, "text/html; charset=utf-8");
    response.set(http::field::cache_control, "no-store");
    response.set("Content-Security-Policy", "default-src 'none'");
    response.set("X-Content-Type-Options", "nosniff");
    response.set("Referrer-Policy", "no-referrer");
    response.body() =
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>cellblock: open with a "
        "token</title></head>\n<body><h1>401: this page needs a token</h1>\n<p>Open this page "
        "once "
        "with <code>?token=</code> and the token added to its address (<code>" +
        html_escaped(path) +
        "?token=...</code>). The gateway then answers with a cookie for this page alone and takes the token "
        "out of the address.</p></body></html>\n";
    response.prepare_payload();
    return response;
}

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
            if (auto viewer = tenants_->resolve_viewer(*token))
                return viewer;
        }
    }
    // The live page's cookie: only on a GET of its own paths, and only the one derived for that scope.
    if (request.method() == http::verb::get) {
        if (const auto scope = view_cookie_scope(path_of(request))) {
            const std::vector<std::string_view> cookies = view_cookies(request);
            if (!cookies.empty()) {
                const std::string expected = view_cookie(*scope);
                for (const std::string_view value : cookies) {
                    if (constant_time_equals(value, expected))
                        return Principal{};
                    // A viewer's cookie is its token, good on its own session's page only (a tenant's list
                    // reader's on the list page only).
                    auto viewer = tenants_ ? tenants_->resolve_viewer(value) : std::nullopt;
                    if (viewer && (viewer->reads_list()
                                       ? scope->ends_with(list_scope)
                                       : scope->ends_with(std::string(sessions_prefix) + viewer->session)))
                        return viewer;
                }
            }
        }
    }
    return std::nullopt;
}

std::string TokenAuthenticator::issue_viewer(const std::string& session, const std::string& tenant,
                                             std::int64_t expires, const std::string& issuer) const {
    return tenants_ ? tenants_->issue_viewer(session, tenant, expires, issuer) : std::string();
}

void TokenAuthenticator::close_on_revocation(const Principal& principal, std::weak_ptr<void> target,
                                             std::function<void()> close) const {
    // A viewer link of no issuer (POST .../share) has no token to revoke: it ends when it expires.
    if (tenants_ && !principal.is_operator() && !principal.token_id.empty())
        tenants_->watch_revocation(principal.token_id, std::move(target), std::move(close));
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
