#include "cellblock/gateway/agent/live_view.hpp"

#include <algorithm>
#include <boost/asio/steady_timer.hpp>
#include <cctype>
#include <charconv>
#include <fstream>
#include <sstream>

#include "cellblock/gateway/access/auth.hpp"
#include "cellblock/gateway/agent/agent_operations.hpp"
#include "cellblock/gateway/agent/agent_session.hpp"
#include "cellblock/gateway/common/config.hpp"

namespace cellblock::gateway::agent {

namespace {

// The id after which a reader resumes: the Last-Event-ID header an EventSource sends when it reconnects, or
// the last_event_id query (a page opened anew); 0 = from the start.
std::uint64_t resume_after(const RequestContext& context) {
    std::string_view text = context.request["Last-Event-ID"];
    if (text.empty()) {
        const auto query = context.query.find("last_event_id");
        if (query != context.query.end())
            text = query->second;
    }
    std::uint64_t id = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), id);
    if (!text.empty() && (error != std::errc() || end != text.data() + text.size()))
        throw HttpError(http::status::bad_request, "Last-Event-ID must be a number, not " + std::string(text),
                        "bad_last_event_id");
    return id;
}

// One reader of a session's events as text/event-stream: "id: N\ndata: {json}\n\n" per event, a comment
// line while nothing happens (so proxies and the browser keep the connection), unsubscribed when the client
// goes, finished when the session goes.
class EventStream : public std::enable_shared_from_this<EventStream> {
  public:
    EventStream(std::shared_ptr<ResponseStream> stream, boost::asio::io_context& io, double keepalive_s)
        : stream_(std::move(stream)), keepalive_(io), expiry_(io), keepalive_s_(keepalive_s) {}

    // `expires`: a viewer's end (seconds since the epoch; 0 = none): the stream finishes then.
    void start(const std::shared_ptr<AgentSession>& session, std::uint64_t after_id, std::int64_t expires) {
        std::weak_ptr<EventStream> weak = weak_from_this();
        LiveLog::Reader reader;
        reader.on_event = [weak](std::uint64_t id, const std::string& data) {
            if (auto self = weak.lock())
                self->stream_->write("id: " + std::to_string(id) + "\ndata: " + data + "\n\n");
        };
        // The reader holds the stream alive as long as the log has it.
        reader.closed = [self = shared_from_this()] {
            self->keepalive_.cancel();
            self->expiry_.cancel();
            self->stream_->finish();
        };
        // A dropped page's EventSource reconnects after a second (with Last-Event-ID), not the default three.
        stream_->write("retry: 1000\n\n");
        key_ = session->live().subscribe(after_id, std::move(reader));
        std::weak_ptr<AgentSession> weak_session = session;
        stream_->on_disconnect([weak_session, weak, key = key_] {
            if (auto self = weak.lock()) {
                self->keepalive_.cancel();
                self->expiry_.cancel();
            }
            if (auto target = weak_session.lock())
                target->live().unsubscribe(key);
        });
        schedule_keepalive();
        if (expires != 0) {
            expiry_.expires_after(std::chrono::system_clock::time_point(std::chrono::seconds(expires)) -
                                  std::chrono::system_clock::now());
            expiry_.async_wait([weak, weak_session, key = key_](const boost::system::error_code& error) {
                auto self = weak.lock();
                if (error || !self)
                    return;
                self->keepalive_.cancel();
                if (auto target = weak_session.lock())
                    target->live().unsubscribe(key);
                self->stream_->finish();
            });
        }
    }

  private:
    void schedule_keepalive() {
        keepalive_.expires_after(std::chrono::milliseconds(static_cast<long long>(keepalive_s_ * 1000)));
        keepalive_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
            auto self = weak.lock();
            if (error || !self || self->stream_->client_gone())
                return;
            self->stream_->write(": keepalive\n\n");
            self->schedule_keepalive();
        });
    }

    std::shared_ptr<ResponseStream> stream_;
    boost::asio::steady_timer keepalive_;
    boost::asio::steady_timer expiry_;
    double keepalive_s_;
    std::uint64_t key_ = 0;
};

class EventsResource : public RestResource {
  public:
    explicit EventsResource(AgentService& service) : service_(service) {}
    bool serves_tenants() const override { return true; }  // require_session: only a session it sees

    void get(RequestContext& context, Responder respond) override {
        auto session = service_.require_session(context.principal, context.param("session"));
        const std::uint64_t after_id = resume_after(context);
        // Only a reader that asks for the stream gets it (EventSource does): a plain GET never hangs open.
        if (context.request[http::field::accept].find("text/event-stream") == std::string_view::npos ||
            !context.start_stream)
            return respond(json_error(http::status::not_acceptable,
                                      "the session's events are a stream: ask with Accept: text/event-stream",
                                      "not_acceptable"));
        HttpResponse head{http::status::ok, 11};
        head.set(http::field::content_type, "text/event-stream");
        head.set(http::field::cache_control, "no-store");
        head.set("X-Accel-Buffering", "no");
        auto events = std::make_shared<EventStream>(context.start_stream(std::move(head)),
                                                    service_.gateway().io, service_.config().keepalive_s);
        events->start(session, after_id, context.principal.expires);
    }

  private:
    AgentService& service_;
};

// ----------------------------------------------------------------------------------------------- the pages

// The page's own policy: nothing but its own files and its own origin; outputs render in frames of
// view/static/frame.html, which carries its own, stricter policy.
constexpr const char* page_policy =
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'self'";
// The frame of one output (agent-written HTML, SVG, Markdown, JavaScript): a sandbox without same-origin
// even when opened directly, no fetch, no request to the gateway or anywhere (only inline script and style,
// data: images).
constexpr const char* frame_policy =
    "sandbox allow-scripts; default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "script-src 'unsafe-inline'; base-uri 'none'; form-action 'none'";

struct StaticFile {
    std::string_view name, content_type, policy;
    std::string_view path = {};  // where it is read from; empty: share/cellblock/view/<name>
};
// The only files served: the rest of share/cellblock/view/ (the two pages) is served by its own route.
// marked.js is Debian's Markdown renderer (libjs-marked, share/scripts/install-deps.sh).
constexpr StaticFile static_files[] = {
    {"page.js", "text/javascript; charset=utf-8", page_policy},
    {"page.css", "text/css; charset=utf-8", page_policy},
    {"frame.html", "text/html; charset=utf-8", frame_policy},
    {"marked.js", "text/javascript; charset=utf-8", page_policy,
     "/usr/share/javascript/marked/marked.min.js"},
};

// A file of share/cellblock/view/ (or at `path`), read per request (they are small; a reinstall shows at
// once).
std::string view_file(std::string_view name, std::string_view at = {}) {
    const std::string path =
        at.empty() ? installed_data_dir() + "/cellblock/view/" + std::string(name) : std::string(at);
    std::ifstream in(path, std::ios::binary);
    if (!in)
        throw HttpError(http::status::internal_server_error, "the live page's file " + path + " is missing",
                        "view_missing");
    std::ostringstream text;
    text << in.rdbuf();
    return text.str();
}

HttpResponse view_response(const RequestContext& context, std::string body, std::string_view content_type,
                           std::string_view policy) {
    HttpResponse response{http::status::ok, context.request.version()};
    response.set(http::field::content_type, content_type);
    response.set(http::field::cache_control, "no-cache");
    response.set("Content-Security-Policy", policy);
    response.set("X-Content-Type-Options", "nosniff");
    response.set("Referrer-Policy", "no-referrer");
    response.body() = std::move(body);
    response.prepare_payload();
    return response;
}

// The path as the client sent it, base_url included: what the browser matches a cookie's Path against.
std::string client_path(const RequestContext& context) {
    std::string base = context.base_url;
    if (base.ends_with('/'))
        base.pop_back();
    return base + context.path;
}

// The session of that id (or name) held here as `context`'s principal sees it (the operator any; a tenant its
// own; a viewer its one), or 404 unknown_session.
std::shared_ptr<AgentSession> listed_session(AgentService& service, const RequestContext& context,
                                             const std::string& id_or_name) {
    return service.require_session(context.principal, id_or_name);
}

// The token the request presented (?token= or the Authorization header), empty when none.
std::string presented_token(const RequestContext& context) {
    if (const auto query = context.query.find("token"); query != context.query.end())
        return query->second;
    const std::string_view header = context.request[http::field::authorization];
    const auto space = header.find(' ');
    return space == std::string_view::npos ? std::string() : std::string(header.substr(space + 1));
}

// How long a page's cookie opens it when a tenant's token opened the page (a viewer token, principal.hpp): a
// working day; the operator's cookie derives from its token and lasts as long as it does.
constexpr std::chrono::hours tenant_page_lifetime{12};

// The cookie value that opens the page of `scope` for `principal`: the operator's derives from its token; a
// viewer of that very page presented its token, which is the cookie; a tenant's agent or approver (or its
// list reader opening one of the list's sessions) gets a viewer token of the session (of its list when
// `session` is empty) that expires, and dies with the token that opened the page (its issuer).
std::string page_cookie_value(AgentService& service, const RequestContext& context, std::string_view scope,
                              const std::string& session) {
    const Principal& principal = context.principal;
    const TokenAuthenticator& auth = service.gateway().auth;
    if (principal.is_operator())
        return auth.view_cookie(scope);
    if (principal.role == Principal::Role::viewer && principal.session == session) {
        // Only a presented token that is this viewer becomes the cookie (not a stale ?token= or a proxy's
        // Basic credential beside a valid cookie).
        const std::string token = presented_token(context);
        const auto presented = auth.authenticate(HttpRequest{}, {{"token", token}});
        return presented && presented->role == Principal::Role::viewer && presented->session == session
                   ? token
                   : std::string();
    }
    const auto lifetime = std::chrono::system_clock::now() + tenant_page_lifetime;
    std::int64_t expires =
        std::chrono::duration_cast<std::chrono::seconds>(lifetime.time_since_epoch()).count();
    if (principal.expires != 0)  // a list reader's pages end with it
        expires = std::min(expires, principal.expires);
    return auth.issue_viewer(session, principal.tenant, expires, principal.token_id);
}

std::string page_cookie(std::string_view value, std::string_view scope) {
    return std::string(TokenAuthenticator::view_cookie_name) + "=" + std::string(value) +
           "; HttpOnly; SameSite=Strict; Path=" + std::string(scope);
}

// A page (the session's, or the list's when `session` is empty), opened with a token once: ?token= answers
// 303 to the same path without it and a cookie for the page's scope; a header token gets the page and the
// cookie; the cookie alone the page.
void answer_page(AgentService& service, const RequestContext& context, std::string_view file,
                 const std::string& session, const Responder& respond) {
    const TokenAuthenticator& auth = service.gateway().auth;
    const std::string path = client_path(context);
    const auto scope = TokenAuthenticator::view_cookie_scope(path);
    std::string cookie;
    const bool token_in_query = context.query.contains("token");
    if (auth.enabled() && scope &&
        (token_in_query || context.request.find(http::field::authorization) != context.request.end()))
        if (const std::string value = page_cookie_value(service, context, *scope, session); !value.empty())
            cookie = page_cookie(value, *scope);
    if (token_in_query) {
        // Every other parameter stays; the token leaves the address (and so history and Referer).
        std::string location = path, separator = "?";
        const std::string_view target = context.request.target();
        const auto query_start = target.find('?');
        std::string_view query = query_start == std::string_view::npos ? "" : target.substr(query_start + 1);
        while (!query.empty()) {
            const auto end = query.find('&');
            const std::string_view pair = query.substr(0, end);
            query = end == std::string_view::npos ? std::string_view{} : query.substr(end + 1);
            if (pair.empty() || pair == "token" || pair.starts_with("token="))
                continue;
            location += separator + std::string(pair);
            separator = "&";
        }
        HttpResponse response{http::status::see_other, context.request.version()};
        response.set(http::field::location, location);
        response.set(http::field::cache_control, "no-store");
        response.set("Referrer-Policy", "no-referrer");
        if (!cookie.empty())
            response.set(http::field::set_cookie, cookie);
        response.prepare_payload();
        return respond(std::move(response));
    }
    HttpResponse response = view_response(context, view_file(file), "text/html; charset=utf-8", page_policy);
    if (!cookie.empty())
        response.set(http::field::set_cookie, cookie);
    respond(std::move(response));
}

class SessionPageResource : public RestResource {
  public:
    explicit SessionPageResource(AgentService& service) : service_(service) {}
    bool serves_tenants() const override { return true; }  // listed_session: only a session it sees
    void get(RequestContext& context, Responder respond) override {
        const auto session = listed_session(service_, context, context.param("session"));
        if (context.param("session") != session->id())
            return respond(page_by_id(context, session->id()));
        answer_page(service_, context, "session.html", session->id(), respond);
    }

  private:
    // A page opened by the session's name moves to its id's path (query kept), where its cookie's scope and a
    // viewer token's session agree.
    static HttpResponse page_by_id(const RequestContext& context, const std::string& id) {
        std::string base = context.base_url;
        if (base.ends_with('/'))
            base.pop_back();
        const std::string_view target = context.request.target();
        const auto query = target.find('?');
        HttpResponse response{http::status::see_other, context.request.version()};
        response.set(
            http::field::location,
            base + "/agent/v1/sessions/" + id + "/view" +
                (query == std::string_view::npos ? std::string() : std::string(target.substr(query))));
        response.set(http::field::cache_control, "no-store");
        response.set("Referrer-Policy", "no-referrer");
        response.prepare_payload();
        return response;
    }

    AgentService& service_;
};

// The list page and its data are for those who read a list: the operator (all sessions) and a tenant's
// tokens and list reader (its own); a viewer of one session has no list.
void require_list_reader(const Principal& principal) {
    if (principal.role == Principal::Role::viewer && !principal.reads_list())
        throw HttpError(http::status::forbidden, "a viewer link opens its one session's page, not the list",
                        "role_forbidden");
}

class ListPageResource : public RestResource {
  public:
    explicit ListPageResource(AgentService& service) : service_(service) {}
    bool serves_tenants() const override { return true; }  // require_list_reader; the data lists its own
    void get(RequestContext& context, Responder respond) override {
        require_list_reader(context.principal);
        answer_page(service_, context, "list.html", "", respond);
    }

  private:
    AgentService& service_;
};

// What the list page polls (under its cookie's scope): each session's model, as GET /agent/v1/sessions.
class ListDataResource : public RestResource {
  public:
    explicit ListDataResource(AgentService& service) : service_(service) {}
    bool serves_tenants() const override { return true; }  // only the sessions the principal sees
    void get(RequestContext& context, Responder respond) override {
        require_list_reader(context.principal);
        nlohmann::json sessions = nlohmann::json::array();
        for (const auto& session : service_.sessions().list())
            if (context.principal.sees_session(session->tenant(), session->id()))
                sessions.push_back(session->model());
        HttpResponse response = json_response(http::status::ok, {{"sessions", sessions}});
        response.set(http::field::cache_control, "no-store");
        response.set("X-Content-Type-Options", "nosniff");
        respond(std::move(response));
    }

  private:
    AgentService& service_;
};

// A link of the list page: the list's cookie (or a token) opens a session's page by a 303 with that page's
// own cookie (the list's cookie is not sent to a session's path).
class OpenResource : public RestResource {
  public:
    explicit OpenResource(AgentService& service) : service_(service) {}
    bool serves_tenants() const override { return true; }  // listed_session: only a session it sees
    void get(RequestContext& context, Responder respond) override {
        require_list_reader(context.principal);
        const std::string& id = context.param("session");
        const auto session = listed_session(service_, context, id);
        std::string base = context.base_url;
        if (base.ends_with('/'))
            base.pop_back();
        const std::string scope = base + "/agent/v1/sessions/" + escaped_segment(id);
        HttpResponse response{http::status::see_other, context.request.version()};
        response.set(http::field::location, scope + "/view");
        response.set(http::field::cache_control, "no-store");
        response.set("Referrer-Policy", "no-referrer");
        if (service_.gateway().auth.enabled())
            response.set(http::field::set_cookie,
                         page_cookie(page_cookie_value(service_, context, scope, session->id()), scope));
        response.prepare_payload();
        respond(std::move(response));
    }

  private:
    // A session id as one path segment (ids are [A-Za-z0-9-]; anything else is percent-encoded).
    static std::string escaped_segment(std::string_view id) {
        static constexpr char hex[] = "0123456789ABCDEF";
        std::string out;
        for (const unsigned char c : id) {
            if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
                out += static_cast<char>(c);
            } else {
                out += '%';
                out += hex[c >> 4];
                out += hex[c & 15];
            }
        }
        return out;
    }
    AgentService& service_;
};

class StaticResource : public RestResource {
  public:
    explicit StaticResource(AgentService& service) : service_(service) {}
    bool serves_tenants() const override { return true; }  // fixed files; a session's only if it sees it
    void get(RequestContext& context, Responder respond) override {
        if (const auto session = context.params.find("session"); session != context.params.end())
            listed_session(service_, context, session->second);
        const std::string& name = context.param("file");
        for (const StaticFile& file : static_files)
            if (file.name == name)
                return respond(
                    view_response(context, view_file(file.name, file.path), file.content_type, file.policy));
        respond(json_error(http::status::not_found, "no such file of the live page: " + name, "not_found"));
    }

  private:
    AgentService& service_;
};

}  // namespace

void register_live_view(Router& router, AgentService& service) {
    router.add("/agent/v1/sessions/{session}/events", std::make_shared<EventsResource>(service));
    router.add("/agent/v1/sessions/{session}/view", std::make_shared<SessionPageResource>(service));
    router.add("/agent/v1/sessions/{session}/view/static/{file}", std::make_shared<StaticResource>(service));
    router.add("/agent/v1/view", std::make_shared<ListPageResource>(service));
    router.add("/agent/v1/view/sessions", std::make_shared<ListDataResource>(service));
    router.add("/agent/v1/view/open/{session}", std::make_shared<OpenResource>(service));
    router.add("/agent/v1/view/static/{file}", std::make_shared<StaticResource>(service));
}

}  // namespace cellblock::gateway::agent
