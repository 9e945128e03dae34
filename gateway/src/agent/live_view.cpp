#include "cellblock/gateway/agent/live_view.hpp"

#include <boost/asio/steady_timer.hpp>
#include <charconv>

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
        : stream_(std::move(stream)), keepalive_(io), keepalive_s_(keepalive_s) {}

    void start(const std::shared_ptr<AgentSession>& session, std::uint64_t after_id) {
        std::weak_ptr<EventStream> weak = weak_from_this();
        LiveLog::Reader reader;
        reader.on_event = [weak](std::uint64_t id, const std::string& data) {
            if (auto self = weak.lock())
                self->stream_->write("id: " + std::to_string(id) + "\ndata: " + data + "\n\n");
        };
        // The reader holds the stream alive as long as the log has it.
        reader.closed = [self = shared_from_this()] {
            self->keepalive_.cancel();
            self->stream_->finish();
        };
        key_ = session->live().subscribe(after_id, std::move(reader));
        std::weak_ptr<AgentSession> weak_session = session;
        stream_->on_disconnect([weak_session, weak, key = key_] {
            if (auto self = weak.lock())
                self->keepalive_.cancel();
            if (auto target = weak_session.lock())
                target->live().unsubscribe(key);
        });
        schedule_keepalive();
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
    double keepalive_s_;
    std::uint64_t key_ = 0;
};

class EventsResource : public RestResource {
  public:
    explicit EventsResource(AgentService& service) : service_(service) {}

    void get(RequestContext& context, Responder respond) override {
        auto session = service_.require_session(context.param("session"));
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
        events->start(session, after_id);
    }

  private:
    AgentService& service_;
};

}  // namespace

void register_live_view(Router& router, AgentService& service) {
    router.add("/agent/v1/sessions/{session}/events", std::make_shared<EventsResource>(service));
}

}  // namespace cellblock::gateway::agent
