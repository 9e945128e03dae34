#include "cellblock/gateway/http/router.hpp"

namespace cellblock::gateway {

using nlohmann::json;

json RequestContext::json_body() const {
    const std::string& body = request.body();
    if (body.find_first_not_of(" \t\r\n") == std::string::npos)
        return json::object();
    json parsed = json::parse(body, nullptr, false);
    if (parsed.is_discarded())
        throw HttpError(http::status::bad_request, "Request body is not valid JSON (or not UTF-8)");
    if (parsed.is_null())
        return json::object();
    if (!parsed.is_object())
        throw HttpError(http::status::bad_request, "Request body must be a JSON object");
    return parsed;
}

HttpResponse json_response(http::status status, const json& body, unsigned version) {
    HttpResponse response{status, version};
    response.set(http::field::content_type, "application/json");
    response.body() = body.dump(-1, ' ', false, json::error_handler_t::replace);
    response.prepare_payload();
    return response;
}

HttpResponse json_error(http::status status, std::string_view message, std::string_view reason,
                        unsigned version) {
    std::string phrase = reason.empty() ? std::string(http::obsolete_reason(status)) : std::string(reason);
    return json_response(status, {{"reason", phrase}, {"message", message}}, version);
}

std::string loggable_target(std::string_view target) {
    return std::string(target.substr(0, target.find('?')));
}

HttpResponse empty_response(http::status status, unsigned version) {
    HttpResponse response{status, version};
    response.prepare_payload();
    return response;
}

namespace {
void method_not_allowed(RestResource& resource, Responder& respond) {
    HttpResponse response = json_error(http::status::method_not_allowed, "Method not allowed");
    response.set(http::field::allow, resource.allowed_methods());
    respond(std::move(response));
}

void call_method(RestResource& resource, RequestContext& context, Responder respond) {
    try {
        switch (context.request.method()) {
            case http::verb::get:
                resource.get(context, respond);
                break;
            case http::verb::head:
                resource.head(context, respond);
                break;
            case http::verb::post:
                resource.post(context, respond);
                break;
            case http::verb::put:
                resource.put(context, respond);
                break;
            case http::verb::patch:
                resource.patch(context, respond);
                break;
            case http::verb::delete_:
                resource.delete_(context, respond);
                break;
            default:
                method_not_allowed(resource, respond);
                break;
        }
    } catch (const HttpError& error) {
        respond(json_error(error.status(), error.what(), error.reason()));
    } catch (const std::exception& error) {
        respond(json_error(http::status::internal_server_error, error.what()));
    } catch (...) {
        respond(json_error(http::status::internal_server_error,
                           "the handler failed with a non-standard exception"));
    }
}
}  // namespace

void RestResource::get(RequestContext&, Responder respond) {
    method_not_allowed(*this, respond);
}
void RestResource::post(RequestContext&, Responder respond) {
    method_not_allowed(*this, respond);
}
void RestResource::put(RequestContext&, Responder respond) {
    method_not_allowed(*this, respond);
}
void RestResource::patch(RequestContext&, Responder respond) {
    method_not_allowed(*this, respond);
}
void RestResource::delete_(RequestContext&, Responder respond) {
    method_not_allowed(*this, respond);
}
void RestResource::head(RequestContext& context, Responder respond) {
    get(context, [respond = std::move(respond)](HttpResponse response) {
        const auto length = response.body().size();
        response.body().clear();
        response.content_length(length);
        respond(std::move(response));
    });
}

std::vector<std::string> split_path(std::string_view path) {
    std::vector<std::string> segments;
    std::size_t at = 0;
    while (at <= path.size()) {
        std::size_t next = path.find('/', at);
        if (next == std::string_view::npos)
            next = path.size();
        if (next > at)
            segments.emplace_back(path.substr(at, next - at));
        at = next + 1;
    }
    return segments;
}

void Router::add(const std::string& pattern, std::shared_ptr<RestResource> resource) {
    routes_.push_back(Route{split_path(pattern), std::move(resource)});
}

namespace {

// The one decoding of a captured path segment: nullopt when it is not valid percent-encoding or would
// decode to a '/' (a separator smuggled inside a segment) or a NUL byte.
std::optional<std::string> decode_segment(std::string_view raw) {
    auto decoded = url_decode(raw, false);
    if (!decoded || decoded->find('/') != std::string::npos || decoded->find('\0') != std::string::npos) {
        return std::nullopt;
    }
    return decoded;
}

}  // namespace

std::optional<Router::Match> Router::match(std::string_view path) const {
    const std::vector<std::string> segments = split_path(path);
    for (const Route& route : routes_) {
        Match match{route.resource.get(), {}, {}};
        const auto capture = [&match](std::string_view raw) -> std::string {
            auto decoded = decode_segment(raw);
            if (!decoded) {
                match.refusal = "path segment '" + std::string(raw) +
                                "' is not valid percent-encoding or encodes a '/' or NUL byte";
                return std::string(raw);
            }
            return std::move(*decoded);
        };
        bool matched = true;
        std::size_t i = 0;
        for (; i < route.segments.size(); ++i) {
            const std::string& pattern = route.segments[i];
            const bool placeholder = pattern.size() > 2 && pattern.front() == '{' && pattern.back() == '}';
            if (placeholder && pattern.ends_with("...}")) {
                if (i >= segments.size()) {
                    matched = false;
                    break;
                }
                const std::string name = pattern.substr(1, pattern.size() - 5);
                std::string rest;
                for (std::size_t j = i; j < segments.size(); ++j)
                    rest += (j > i ? "/" : "") + capture(segments[j]);
                match.params[name] = rest;
                i = segments.size();
                break;
            }
            if (i >= segments.size()) {
                matched = false;
                break;
            }
            if (placeholder) {
                match.params[pattern.substr(1, pattern.size() - 2)] = capture(segments[i]);
            } else if (pattern != segments[i]) {
                matched = false;
                break;
            }
        }
        if (matched && i == segments.size())
            return match;
    }
    return std::nullopt;
}

std::optional<HttpResponse> principal_refusal(const RestResource& resource, const RequestContext& context,
                                              http::verb method) {
    const Principal& principal = context.principal;
    if (principal.is_operator())
        return std::nullopt;
    if (!resource.serves_tenants())
        return json_error(http::status::forbidden, "only the operator's token may use " + context.path,
                          "operator_only");
    if (!principal.may(resource.action(method)))
        return json_error(http::status::forbidden,
                          std::string("a token of role ") + role_name(principal.role) + " may not " +
                              std::string(http::to_string(method)) + " " + context.path,
                          "role_forbidden");
    return std::nullopt;
}

void Router::dispatch(RequestContext& context, Responder respond) const {
    auto found = match(context.path);
    if (!found) {
        respond(json_error(http::status::not_found, "Not Found: " + context.path));
        return;
    }
    if (!found->refusal.empty()) {
        respond(json_error(http::status::bad_request, found->refusal, "bad_path"));
        return;
    }
    context.params = std::move(found->params);
    RestResource& resource = *found->resource;
    if (auto refusal = principal_refusal(resource, context, context.request.method()))
        return respond(std::move(*refusal));
    auto invoke = [&resource, respond](RequestContext& ready) { call_method(resource, ready, respond); };
    try {
        resource.prepare(context, invoke);
    } catch (const HttpError& error) {
        respond(json_error(error.status(), error.what(), error.reason()));
    } catch (const std::exception& error) {
        respond(json_error(http::status::internal_server_error, error.what()));
    }
}

std::optional<std::string> url_decode(std::string_view text, bool plus_is_space) {
    std::string out;
    out.reserve(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) {
        char c = text[i];
        if (c == '%') {
            auto hex = [](char h) -> int {
                if (h >= '0' && h <= '9')
                    return h - '0';
                if (h >= 'a' && h <= 'f')
                    return h - 'a' + 10;
                if (h >= 'A' && h <= 'F')
                    return h - 'A' + 10;
                return -1;
            };
            if (i + 2 >= text.size())
                return std::nullopt;
            int high = hex(text[i + 1]), low = hex(text[i + 2]);
            if (high < 0 || low < 0)
                return std::nullopt;
            out.push_back(static_cast<char>(high * 16 + low));
            i += 2;
        } else if (c == '+' && plus_is_space) {
            out.push_back(' ');
        } else {
            out.push_back(c);
        }
    }
    return out;
}

std::map<std::string, std::string> parse_query(std::string_view query) {
    std::map<std::string, std::string> parameters;
    std::size_t at = 0;
    while (at < query.size()) {
        std::size_t next = query.find('&', at);
        if (next == std::string_view::npos)
            next = query.size();
        std::string_view pair = query.substr(at, next - at);
        std::size_t equals = pair.find('=');
        auto key = url_decode(pair.substr(0, equals), true);
        auto value =
            url_decode(equals == std::string_view::npos ? std::string_view{} : pair.substr(equals + 1), true);
        if (key && value && !key->empty() && !parameters.contains(*key))
            parameters[*key] = *value;
        at = next + 1;
    }
    return parameters;
}

}  // namespace cellblock::gateway
