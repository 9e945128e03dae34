#pragma once
// REST plumbing shared by the Jupyter API and the agent API: a request context, one handler object per REST
// resource (one virtual per HTTP method), a router from path patterns ("/api/kernels/{kernel_id}") to
// resources, and the JSON error shape {"reason", "message"} that Kernel Gateway clients expect.
#include <boost/beast/http.hpp>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cellblock/gateway/access/principal.hpp"
#include "cellblock/gateway/http/websocket_transport.hpp"

namespace cellblock::gateway {

namespace http = boost::beast::http;
using HttpRequest = http::request<http::string_body>;
using HttpResponse = http::response<http::string_body>;
// Completes a request; must be called exactly once, possibly later (after a kernel started).
using Responder = std::function<void(HttpResponse)>;

// A response whose body is sent as it is produced (chunked transfer encoding), e.g. NDJSON execution events.
// Obtained instead of calling the Responder; everything runs on the io_context thread.
class ResponseStream {
  public:
    virtual ~ResponseStream() = default;
    // Queues one piece of the body; ignored once the client is gone or after finish().
    virtual void write(std::string data) = 0;
    // Ends the body; the connection then serves its next request (keep-alive) or closes.
    virtual void finish() = 0;
    // Runs once if the client disconnects before finish() (it is watched for EOF while the body is streamed).
    virtual void on_disconnect(std::function<void()> handler) = 0;
    virtual bool client_gone() const = 0;
};
// Sends the status line and headers of `head` (its body is ignored) and returns the stream for the body.
using StreamStarter = std::function<std::shared_ptr<ResponseStream>(HttpResponse head)>;

struct RequestContext {
    const HttpRequest& request;
    // The path as received: percent-escapes intact (raw), without query and base_url, starts with "/".
    // Decoding belongs to the router alone (see Router): handlers read params, never decode again.
    std::string path;
    std::map<std::string, std::string> query;   // decoded query parameters
    std::map<std::string, std::string> params;  // captured {placeholders}, decoded by the router
    std::string base_url;                       // e.g. "/" or "/gw/"
    // Set by the HTTP server for plain requests: a handler may call it (once) instead of the Responder.
    StreamStarter start_stream = {};
    std::string client_address = {};  // peer IP address, for audit trails
    Principal principal = {};         // who sent it (TokenAuthenticator), resolved once per request
    const std::string& param(const std::string& name) const { return params.at(name); }
    // Parses the body as a JSON object; an empty body gives {}. Throws HttpError(400) otherwise.
    nlohmann::json json_body() const;
};

// Thrown by handlers for a clean JSON error response.
class HttpError : public std::runtime_error {
  public:
    HttpError(http::status status, const std::string& message, std::string reason = {})
        : std::runtime_error(message), status_(status), reason_(std::move(reason)) {}
    http::status status() const { return status_; }
    const std::string& reason() const { return reason_; }

  private:
    http::status status_;
    std::string reason_;
};

HttpResponse json_response(http::status status, const nlohmann::json& body, unsigned version = 11);
// {"reason": <reason or the HTTP phrase>, "message": message}
HttpResponse json_error(http::status status, std::string_view message, std::string_view reason = {},
                        unsigned version = 11);
HttpResponse empty_response(http::status status, unsigned version = 11);
// A request target as logs show it: the path only. The query may hold ?token=, which no log may keep.
std::string loggable_target(std::string_view target);

class RestResource {
  public:
    virtual ~RestResource() = default;
    virtual void get(RequestContext& context, Responder respond);
    virtual void head(RequestContext& context, Responder respond);  // default: GET without the body
    virtual void post(RequestContext& context, Responder respond);
    virtual void put(RequestContext& context, Responder respond);
    virtual void patch(RequestContext& context, Responder respond);
    // NOLINTNEXTLINE(readability-identifier-naming): `delete` is a keyword.
    virtual void delete_(RequestContext& context, Responder respond);
    // Runs before the method (and its handler): a resource that needs something the io thread must not wait
    // for (a store read) calls `proceed` once it has it, with a context it keeps alive until then (the
    // request it refers to lives until the response). Default: at once.
    virtual void prepare(RequestContext& context, const std::function<void(RequestContext&)>& proceed) {
        proceed(context);
    }
    // Methods this resource implements, for 405 Allow headers.
    virtual std::string allowed_methods() const { return "GET, OPTIONS"; }
    // Whether tenants' tokens may use this resource at all: one that shows each principal only what it sees
    // (Principal::sees, principal.hpp) says so. Any other resource is the operator's alone.
    virtual bool serves_tenants() const { return false; }
    // What `method` does here, for the role check (Principal::may): GET and HEAD read, anything else runs,
    // including a WebSocket upgrade (asked as http::verb::connect: a kernel's channels can execute).
    virtual Principal::Action action(http::verb method) const {
        return method == http::verb::get || method == http::verb::head ? Principal::Action::read
                                                                       : Principal::Action::run;
    }

    // WebSocket endpoints override these. check_upgrade runs before the 101 and may refuse with a response.
    virtual bool accepts_websocket() const { return false; }
    virtual std::optional<HttpResponse> check_upgrade(RequestContext&) { return std::nullopt; }
    virtual std::string select_subprotocol(const RequestContext&) const { return {}; }
    // By value: an override keeps the transport.
    // NOLINTNEXTLINE(performance-unnecessary-value-param)
    virtual void on_upgraded(RequestContext&, std::shared_ptr<WebSocketTransport>) {}
};

class Router {
  public:
    // Pattern segments are literals or {name} (one non-empty segment); "{name...}" at the end matches the
    // rest. Literals match the raw segment. The one decoding rule: every captured segment is percent-decoded
    // exactly once, here; "{name...}" is its decoded segments joined with '/', so each '/' in it was a real
    // separator. A captured segment that is not valid percent-encoding or decodes to a '/' or NUL byte is
    // refused (dispatch answers 400 with reason "bad_path"; the match carries `refusal`).
    void add(const std::string& pattern, std::shared_ptr<RestResource> resource);
    struct Match {
        RestResource* resource;
        std::map<std::string, std::string> params;
        std::string refusal;  // non-empty: the route matched but a captured segment is refused
    };
    std::optional<Match> match(std::string_view path) const;
    // Dispatches to the resource method; unknown paths give a JSON 404, unknown methods 405, and a handler
    // that throws gets its HttpError (or a 500) as JSON. Never throws.
    void dispatch(RequestContext& context, Responder respond) const;

  private:
    struct Route {
        std::vector<std::string> segments;
        std::shared_ptr<RestResource> resource;
    };
    std::vector<Route> routes_;
};

// The answer to a request `resource` must not serve for its principal (403 "operator_only" for a tenant on a
// resource that is not isolated, 403 "role_forbidden" for a role that may not do the method's action);
// nullopt when it may proceed. Asked by dispatch and by the WebSocket upgrade alike.
std::optional<HttpResponse> principal_refusal(const RestResource& resource, const RequestContext& context,
                                              http::verb method);

// Percent-decoding of one path segment or query component; nullopt for malformed escapes.
std::optional<std::string> url_decode(std::string_view text, bool plus_is_space);
std::map<std::string, std::string> parse_query(std::string_view query);
std::vector<std::string> split_path(std::string_view path);

}  // namespace cellblock::gateway
