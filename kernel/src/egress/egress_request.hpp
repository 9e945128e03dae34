// The proxy's reading of a request head (egress_proxy.hpp): which methods it
// forwards, CONNECT's host:port, the absolute http:// URL of a plain request
// and its Host header, each refused with a BadRequest that says why; and how
// durations are written in its answers.
#pragma once

#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cellblock::kernel::egress {

// A request the proxy answers 400 (or 405): the message says what is wrong.
class BadRequest : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// The methods the proxy forwards: a worker's made-up token never reaches an
// approval (egress_session.cpp).
bool forwarded_method(boost::beast::http::verb method);

struct Authority {
    std::string host;  // validated and normalized (egress_policy.hpp)
    std::uint16_t port = 0;
};

// "host:port", "[v6]:port", or without the port when `default_port` is given;
// `what` names the part of the request in the error.
Authority parse_authority(std::string_view text, std::optional<std::uint16_t> default_port,
                          std::string_view what);

struct AbsoluteTarget {
    Authority authority;
    std::string origin_form;  // the path and query, what the server is sent
};

// A plain request's target: an absolute http:// URL without user information.
AbsoluteTarget parse_absolute_target(std::string_view target);

// A plain request's Host header, if any, must name the URL's host and port.
void check_host_header(const boost::beast::http::request<boost::beast::http::empty_body>& request,
                       const Authority& uri);

// "30 s", "0.5 s": a limit as the proxy's answers name it.
std::string seconds_text(std::chrono::milliseconds duration);

}  // namespace cellblock::kernel::egress
