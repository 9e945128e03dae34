#include "cellblock/gateway/agent/agent_api.hpp"

#include <boost/asio/steady_timer.hpp>
#include <fstream>
#include <sstream>

#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/sandbox/sandbox.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;
namespace fs = std::filesystem;

// ------------------------------------------------------------------------------------------------ helpers

std::string workspace_relative_path(const std::string& decoded_path) {
    if (decoded_path.find('\0') != std::string::npos)
        throw HttpError(http::status::bad_request, "file paths must not contain NUL bytes", "bad_path");
    std::string relative;
    for (const std::string& component : split_path(decoded_path)) {
        if (component == "." || component == "..")
            throw HttpError(http::status::bad_request,
                            "file paths must stay inside the workspace ('.' and '..' are refused)",
                            "bad_path");
        if (!relative.empty())
            relative.push_back('/');
        relative += component;
    }
    if (relative.empty())
        throw HttpError(http::status::bad_request, "empty file path", "bad_path");
    return relative;
}

namespace {

HttpError workspace_http_error(const sandbox::WorkspaceError& error) {
    using Kind = sandbox::WorkspaceError::Kind;
    switch (error.kind()) {
        case Kind::not_found:
            return HttpError(http::status::not_found, error.what(), "file_not_found");
        case Kind::too_large:
            return HttpError(http::status::payload_too_large, error.what(), "file_too_large");
        case Kind::not_regular:
            return HttpError(http::status::bad_request, error.what(), "not_a_regular_file");
        case Kind::bad_path:
            return HttpError(http::status::bad_request, error.what(), "bad_path");
        case Kind::io:
            break;
    }
    return HttpError(http::status::internal_server_error, error.what(), "workspace_error");
}

// Runs `action` against the session's workspace once it has a kernel (and so a workspace); errors become
// JSON.
void with_workspace(const std::shared_ptr<AgentSession>& session, Responder respond,
                    std::function<HttpResponse(sandbox::Workspace&)> action) {
    session->touch();
    session->ensure_kernel([session, respond, action = std::move(action)](std::optional<std::string> error) {
        if (error) {
            respond(json_error(http::status::service_unavailable, "the session has no kernel: " + *error,
                               "kernel_unavailable"));
            return;
        }
        auto root = session->workspace();
        if (!root) {
            respond(json_error(http::status::service_unavailable, "the session has no workspace",
                               "kernel_unavailable"));
            return;
        }
        try {
            sandbox::Workspace workspace(*root);
            respond(action(workspace));
        } catch (const sandbox::WorkspaceError& failure) {
            const HttpError mapped = workspace_http_error(failure);
            respond(json_error(mapped.status(), mapped.what(), mapped.reason()));
        } catch (const HttpError& failure) {
            respond(json_error(failure.status(), failure.what(), failure.reason()));
        } catch (const std::exception& failure) {
            respond(json_error(http::status::internal_server_error, failure.what()));
        }
    });
}

json request_body(RequestContext& context) {
    try {
        return context.json_body();
    } catch (const HttpError& error) {
        throw HttpError(error.status(), error.what(), "bad_json");
    }
}

class AgentResource : public RestResource {
  public:
    explicit AgentResource(AgentService& service) : service_(service) {}

  protected:
    std::shared_ptr<AgentSession> session(RequestContext& context) const {
        return service_.require_session(context.param("session"));
    }
    AgentService& service_;
};

// ------------------------------------------------------------------------------------------------ sessions

class SessionsResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "GET, POST, OPTIONS"; }

    void get(RequestContext&, Responder respond) override {
        json sessions = json::array();
        for (const auto& session : service_.sessions().list())
            sessions.push_back(session->model());
        respond(json_response(http::status::ok, {{"sessions", sessions}}));
    }

    void post(RequestContext& context, Responder respond) override {
        const json body = request_body(context);
        std::string name;
        if (body.contains("name") && !body["name"].is_null()) {
            if (!body["name"].is_string())
                throw HttpError(http::status::bad_request, "name must be a string", "bad_type");
            name = body["name"].get<std::string>();
        }
        AgentLimits limits;
        try {
            limits = parse_limits(body.contains("limits") ? body["limits"] : json(nullptr),
                                  service_.config().default_limits, service_.config().max_limits);
        } catch (const LimitError& error) {
            HttpResponse response =
                json_response(http::status::bad_request,
                              {{"reason", "bad_limit"}, {"message", error.what()}, {"limit", error.field()}});
            return respond(std::move(response));
        }
        const std::string base = context.base_url;
        service_.sessions().create(
            name, limits, context.client_address,
            [respond, base](std::shared_ptr<AgentSession> session, std::optional<HttpError> error) {
                if (error)
                    return respond(json_error(error->status(), error->what(), error->reason()));
                HttpResponse response = json_response(http::status::created, session->model());
                response.set(http::field::location, base + "agent/v1/sessions/" + session->id());
                respond(std::move(response));
            });
    }
};

class SessionResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "GET, DELETE, OPTIONS"; }

    void get(RequestContext& context, Responder respond) override {
        respond(json_response(http::status::ok, session(context)->model()));
    }
    void delete_(RequestContext& context, Responder respond) override {
        service_.sessions().remove(session(context), "deleted through the agent API", context.client_address);
        respond(empty_response(http::status::no_content));
    }
};

class ResetResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "POST, OPTIONS"; }
    void post(RequestContext& context, Responder respond) override {
        auto target = session(context);
        target->reset(context.client_address, [target, respond](std::optional<std::string> error) {
            if (error)
                return respond(json_error(http::status::service_unavailable, "reset failed: " + *error,
                                          "kernel_unavailable"));
            respond(json_response(http::status::ok, target->model()));
        });
    }
};

// ------------------------------------------------------------------------------------------------ execute

// Streams one execute as NDJSON: each event on its own line as it happens, keepalives while nothing happens,
// the full answer as the final "end" event. Stream text beyond the inline cap is not streamed (the end event
// has head and tail); a client that disconnects gets its execution interrupted.
class NdjsonExecution : public std::enable_shared_from_this<NdjsonExecution> {
  public:
    NdjsonExecution(std::shared_ptr<ResponseStream> stream, boost::asio::io_context& io, double keepalive_s,
                    std::size_t stream_cap)
        : stream_(std::move(stream)), keepalive_(io), keepalive_s_(keepalive_s), stream_cap_(stream_cap) {}

    void start(const std::shared_ptr<AgentSession>& session, ExecuteRequest request) {
        write({{"type", "start"}, {"session", session->id()}});
        std::weak_ptr<NdjsonExecution> weak = weak_from_this();
        ExecuteHandlers handlers;
        handlers.on_event = [weak](const json& event) {
            if (auto self = weak.lock())
                self->on_event(event);
        };
        handlers.on_done = [self = shared_from_this()](json answer) {
            json end = {{"type", "end"}};
            end.update(answer);
            self->write(end);
            self->finished_ = true;
            self->keepalive_.cancel();
            self->stream_->finish();
        };
        const std::uint64_t ticket = session->execute(std::move(request), std::move(handlers));
        std::weak_ptr<AgentSession> weak_session = session;
        stream_->on_disconnect([weak_session, ticket, weak] {
            if (auto target = weak_session.lock())
                target->abandon(ticket);
            if (auto self = weak.lock())
                self->keepalive_.cancel();
        });
        schedule_keepalive();
    }

  private:
    void write(const json& event) {
        stream_->write(event.dump(-1, ' ', false, json::error_handler_t::replace) + "\n");
        last_write_ = std::chrono::steady_clock::now();
    }

    void on_event(const json& event) {
        const std::string type = event.value("type", "");
        if (type == "stdout" || type == "stderr") {
            std::size_t& sent = type == "stdout" ? stdout_sent_ : stderr_sent_;
            const std::string& text = event["text"].get_ref<const std::string&>();
            if (sent >= stream_cap_)
                return;
            if (sent + text.size() > stream_cap_) {
                const std::string_view part = utf8_head(text, stream_cap_ - sent);
                sent = stream_cap_;
                if (!part.empty())
                    write({{"type", type}, {"text", part}});
                write({{"type", "notice"},
                       {"text", "further " + type + " is not streamed (more than " +
                                    std::to_string(stream_cap_) +
                                    " bytes); the end event carries its head and tail"}});
                return;
            }
            sent += text.size();
        }
        write(event);
    }

    void schedule_keepalive() {
        keepalive_.expires_after(std::chrono::milliseconds(static_cast<long long>(keepalive_s_ * 1000)));
        keepalive_.async_wait([weak = weak_from_this()](const boost::system::error_code& error) {
            auto self = weak.lock();
            if (error || !self || self->finished_ || self->stream_->client_gone())
                return;
            if (std::chrono::steady_clock::now() - self->last_write_ >=
                std::chrono::milliseconds(static_cast<long long>(self->keepalive_s_ * 900)))
                self->write({{"type", "keepalive"}});
            self->schedule_keepalive();
        });
    }

    std::shared_ptr<ResponseStream> stream_;
    boost::asio::steady_timer keepalive_;
    double keepalive_s_;
    std::size_t stream_cap_;
    std::size_t stdout_sent_ = 0, stderr_sent_ = 0;
    bool finished_ = false;
    std::chrono::steady_clock::time_point last_write_ = std::chrono::steady_clock::now();
};

class ExecuteResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "POST, OPTIONS"; }

    void post(RequestContext& context, Responder respond) override {
        auto target = session(context);
        const json body = request_body(context);
        if (target->queued() >= AgentSession::max_queued)
            throw HttpError(
                http::status::too_many_requests,
                std::to_string(target->queued()) + " executes are already waiting in this session",
                "session_busy");
        if (!body.contains("code"))
            throw HttpError(http::status::bad_request, "missing \"code\": the Python source to run",
                            "missing_code");
        if (!body["code"].is_string())
            throw HttpError(http::status::bad_request, "\"code\" must be a string", "bad_type");
        ExecuteRequest request;
        request.code = body["code"].get<std::string>();
        request.client_address = context.client_address;
        if (body.contains("timeout_s") && !body["timeout_s"].is_null()) {
            const json& timeout = body["timeout_s"];
            if (!timeout.is_number() || timeout.get<double>() <= 0)
                throw HttpError(http::status::bad_request, "\"timeout_s\" must be a number greater than 0",
                                "bad_type");
            request.timeout_s = timeout.get<double>();
            if (request.timeout_s > target->record().limits.timeout_s)
                throw HttpError(http::status::bad_request,
                                "timeout_s = " + timeout.dump() +
                                    " exceeds the session's limits.timeout_s of " +
                                    json(target->record().limits.timeout_s).dump(),
                                "bad_limit");
        }
        const auto accept = context.request[http::field::accept];
        const bool streaming = accept.find("application/x-ndjson") != std::string_view::npos;
        if (!streaming || !context.start_stream) {
            request.client_kind = "http";
            ExecuteHandlers handlers;
            handlers.on_done = [respond](json answer) { respond(json_response(http::status::ok, answer)); };
            target->execute(std::move(request), std::move(handlers));
            return;
        }
        request.client_kind = "ndjson";
        HttpResponse head{http::status::ok, 11};
        head.set(http::field::content_type, "application/x-ndjson");
        head.set(http::field::cache_control, "no-store");
        auto execution = std::make_shared<NdjsonExecution>(
            context.start_stream(std::move(head)), service_.gateway().io, service_.config().keepalive_s,
            service_.config().inline_output_bytes);
        execution->start(target, std::move(request));
    }
};

// ------------------------------------------------------------------------------------------------ files

class FilesResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    void get(RequestContext& context, Responder respond) override {
        with_workspace(session(context), respond, [](sandbox::Workspace& workspace) {
            json files = json::array();
            for (const auto& entry : workspace.list()) {
                if (entry.is_directory)
                    continue;
                files.push_back({{"path", entry.path}, {"size", entry.size}});
            }
            return json_response(http::status::ok, {{"files", files}});
        });
    }
};

class FileResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "GET, PUT, DELETE, OPTIONS"; }

    void get(RequestContext& context, Responder respond) override {
        const std::string relative = workspace_relative_path(context.param("path"));
        const std::uint64_t cap = service_.config().max_file_bytes;
        with_workspace(session(context), respond, [relative, cap](sandbox::Workspace& workspace) {
            HttpResponse response{http::status::ok, 11};
            response.set(http::field::content_type, "application/octet-stream");
            response.body() = workspace.read_file(relative, cap);
            response.prepare_payload();
            return response;
        });
    }

    void put(RequestContext& context, Responder respond) override {
        const std::string relative = workspace_relative_path(context.param("path"));
        auto target = session(context);
        auto body = std::make_shared<std::string>(context.request.body());
        const std::uint64_t cap = service_.config().max_file_bytes;
        const std::string client = context.client_address;
        with_workspace(target, respond, [relative, body, cap, target, client](sandbox::Workspace& workspace) {
            workspace.write_file(relative, *body, cap);
            target->audit({{"event", "file_put"},
                           {"client", client},
                           {"path", relative},
                           {"bytes", body->size()},
                           {"sha256", sha256_hex(*body)}});
            return json_response(http::status::created, {{"path", relative}, {"size", body->size()}});
        });
    }

    void delete_(RequestContext& context, Responder respond) override {
        const std::string relative = workspace_relative_path(context.param("path"));
        auto target = session(context);
        const std::string client = context.client_address;
        with_workspace(target, respond, [relative, target, client](sandbox::Workspace& workspace) {
            workspace.remove_file(relative);
            target->audit({{"event", "file_delete"}, {"client", client}, {"path", relative}});
            return empty_response(http::status::no_content);
        });
    }
};

// ------------------------------------------------------------------------------------------------ notebook,
// audit

class NotebookResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    void get(RequestContext& context, Responder respond) override {
        auto target = session(context);
        const auto errors = context.query.find("errors");
        const bool only_ok =
            errors != context.query.end() && (errors->second == "skip" || errors->second == "omit");
        HttpResponse response = json_response(http::status::ok, target->notebook(only_ok));
        response.set(http::field::content_disposition,
                     "attachment; filename=\"" + target->name() + ".ipynb\"");
        respond(std::move(response));
    }
};

class AuditResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    void get(RequestContext& context, Responder respond) override {
        auto target = session(context);
        const bool ndjson =
            context.request[http::field::accept].find("application/x-ndjson") != std::string_view::npos;
        AuditQuery query{target->id(), context.query.contains("event") ? context.query.at("event") : "",
                         context.query.contains("since") ? context.query.at("since") : "",
                         context.query.contains("until") ? context.query.at("until") : ""};
        StoreWriter& writer = service_.services().writer;
        // Entries queued for the store are included: answer once the writer has reached this point.
        writer.after_pending([&writer, target, respond, ndjson, query] {
            std::vector<json> entries;
            try {
                entries = writer.store().audit(query);
            } catch (const std::exception& error) {
                return respond(json_error(http::status::internal_server_error,
                                          std::string("cannot read the audit trail: ") + error.what()));
            }
            if (ndjson) {
                HttpResponse response{http::status::ok, 11};
                response.set(http::field::content_type, "application/x-ndjson");
                for (const json& entry : entries)
                    response.body() += entry.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
                response.prepare_payload();
                return respond(std::move(response));
            }
            respond(json_response(http::status::ok, {{"session", target->id()}, {"entries", json(entries)}}));
        });
    }
};

}  // namespace

// ------------------------------------------------------------------------------------------------ service

AgentService::AgentService(GatewayServices& gateway, const AgentConfig& config)
    : gateway_(gateway),
      config_(config),
      session_services_{gateway.io, gateway.logger, gateway.kernels,
                        config_,    gateway.writer, gateway.metrics},
      registry_(session_services_) {}

AgentService::~AgentService() = default;

void AgentService::start() {
    registry_.start();
}

std::shared_ptr<AgentSession> AgentService::require_session(const std::string& id_or_name) const {
    auto session = registry_.find(id_or_name);
    if (!session)
        throw HttpError(http::status::not_found, "no agent session with id or name '" + id_or_name + "'",
                        "unknown_session");
    return session;
}

void AgentService::register_routes(Router& router) {
    router.add("/agent/v1/sessions", std::make_shared<SessionsResource>(*this));
    router.add("/agent/v1/sessions/{session}", std::make_shared<SessionResource>(*this));
    router.add("/agent/v1/sessions/{session}/execute", std::make_shared<ExecuteResource>(*this));
    router.add("/agent/v1/sessions/{session}/reset", std::make_shared<ResetResource>(*this));
    router.add("/agent/v1/sessions/{session}/files", std::make_shared<FilesResource>(*this));
    router.add("/agent/v1/sessions/{session}/files/{path...}", std::make_shared<FileResource>(*this));
    router.add("/agent/v1/sessions/{session}/notebook", std::make_shared<NotebookResource>(*this));
    router.add("/agent/v1/sessions/{session}/audit", std::make_shared<AuditResource>(*this));
    register_mcp_endpoint(router, *this);
}

}  // namespace cellblock::gateway::agent
