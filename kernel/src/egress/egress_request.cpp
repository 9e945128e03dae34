#include "egress/egress_request.hpp"

#include <cctype>
#include <charconv>
#include <cmath>

#include "egress/egress_policy.hpp"

namespace cellblock::kernel::egress {

namespace http = boost::beast::http;

namespace {

std::uint16_t parse_port(std::string_view text, std::string_view what) {
    unsigned value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || error != std::errc{} || end != text.data() + text.size() || value < 1 ||
        value > 65535) {
        throw BadRequest("bad port \"" + std::string(text) + "\" in " + std::string(what));
    }
    return static_cast<std::uint16_t>(value);
}

bool starts_with_nocase(std::string_view text, std::string_view prefix) {
    if (text.size() < prefix.size()) {
        return false;
    }
    for (std::size_t i = 0; i < prefix.size(); ++i) {
        if (std::tolower(static_cast<unsigned char>(text[i])) != prefix[i]) {
            return false;
        }
    }
    return true;
}

}  // namespace

bool forwarded_method(http::verb method) {
    switch (method) {
        case http::verb::connect:
        case http::verb::get:
        case http::verb::head:
        case http::verb::post:
        case http::verb::put:
        case http::verb::patch:
        case http::verb::delete_:
        case http::verb::options:
            return true;
        default:
            return false;
    }
}

Authority parse_authority(std::string_view text, std::optional<std::uint16_t> default_port,
                          std::string_view what) {
    std::string_view host = text;
    std::optional<std::string_view> port;
    if (text.starts_with('[')) {
        const auto close = text.find(']');
        if (close == std::string_view::npos) {
            throw BadRequest("unterminated [IPv6] address in " + std::string(what));
        }
        host = text.substr(1, close - 1);
        const auto rest = text.substr(close + 1);
        if (!rest.empty()) {
            if (!rest.starts_with(':')) {
                throw BadRequest("unexpected text after the [IPv6] address in " + std::string(what));
            }
            port = rest.substr(1);
        }
        if (host.find(':') == std::string_view::npos) {
            throw BadRequest("brackets around something that is not an IPv6 address in " + std::string(what));
        }
    } else if (const auto colon = text.rfind(':'); colon != std::string_view::npos) {
        host = text.substr(0, colon);
        port = text.substr(colon + 1);
        if (host.find(':') != std::string_view::npos) {
            throw BadRequest("an IPv6 address must be in brackets in " + std::string(what));
        }
    }
    Authority authority;
    try {
        authority.host = validated_host(host);
    } catch (const PolicyError& error) {
        throw BadRequest("bad host \"" + std::string(host) + "\" in " + std::string(what) + ": " +
                         error.what());
    }
    if (port) {
        authority.port = parse_port(*port, what);
    } else if (default_port) {
        authority.port = *default_port;
    } else {
        throw BadRequest(std::string(what) + " needs a port (host:port)");
    }
    return authority;
}

AbsoluteTarget parse_absolute_target(std::string_view target) {
    if (starts_with_nocase(target, "https://")) {
        throw BadRequest("https:// URLs go through CONNECT, not as a plain proxy request");
    }
    if (!starts_with_nocase(target, "http://")) {
        throw BadRequest(
            "this is a proxy: send an absolute http:// URL or CONNECT "
            "host:port, got \"" +
            std::string(target.substr(0, 200)) + "\"");
    }
    auto rest = target.substr(7);
    const auto end = rest.find_first_of("/?#");
    const auto authority_text = rest.substr(0, end);
    if (authority_text.find('@') != std::string_view::npos) {
        throw BadRequest("user information in the URL is not accepted");
    }
    AbsoluteTarget parsed{parse_authority(authority_text, 80, "the URL"), {}};
    auto path = end == std::string_view::npos ? std::string_view{} : rest.substr(end);
    if (const auto fragment = path.find('#'); fragment != std::string_view::npos) {
        path = path.substr(0, fragment);
    }
    parsed.origin_form = path.starts_with('/') ? std::string(path) : "/" + std::string(path);
    return parsed;
}

void check_host_header(const http::request<http::empty_body>& request, const Authority& uri) {
    if (request.count(http::field::host) > 1) {
        throw BadRequest("more than one Host header");
    }
    const auto host_header = request.find(http::field::host);
    if (host_header == request.end()) {
        return;  // HTTP/1.0 without Host: the proxy sends the URL's
    }
    const auto header = parse_authority(host_header->value(), 80, "the Host header");
    if (header.host != uri.host || header.port != uri.port) {
        throw BadRequest("the Host header (" + std::string(host_header->value()) +
                         ") does not match the URL's host (" + uri.host + ":" + std::to_string(uri.port) +
                         ")");
    }
}

std::string seconds_text(std::chrono::milliseconds duration) {
    const double seconds = std::chrono::duration<double>(duration).count();
    if (seconds == std::floor(seconds)) {
        return std::to_string(static_cast<long long>(seconds)) + " s";
    }
    auto text = std::to_string(seconds);
    text.erase(text.find_last_not_of('0') + 1);
    return text + " s";
}

}  // namespace cellblock::kernel::egress
