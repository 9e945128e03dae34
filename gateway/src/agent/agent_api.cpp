#include "cellblock/gateway/agent/agent_api.hpp"

#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cellblock/gateway/agent/live_view.hpp"
#include "cellblock/gateway/agent/output_shield.hpp"
#include "cellblock/gateway/common/config.hpp"
#include "cellblock/gateway/common/time_format.hpp"

namespace cellblock::gateway::agent {

using nlohmann::json;

// ------------------------------------------------------------------------------------------------ helpers

std::string workspace_relative_path(const std::string& decoded_path) {
    try {
        return workspace_path(decoded_path);
    } catch (const OperationError& error) {
        throw HttpError(http::status::bad_request, error.what(), error.reason());
    }
}

http::status http_status(OperationErrorKind kind) {
    switch (kind) {
        case OperationErrorKind::malformed:
        case OperationErrorKind::refused:
            return http::status::bad_request;
        case OperationErrorKind::not_found:
            return http::status::not_found;
        case OperationErrorKind::conflict:
            return http::status::conflict;
        case OperationErrorKind::gone:
            return http::status::gone;
        case OperationErrorKind::too_large:
            return http::status::payload_too_large;
        case OperationErrorKind::busy:
            return http::status::too_many_requests;
        case OperationErrorKind::unavailable:
            return http::status::service_unavailable;
        case OperationErrorKind::internal:
            break;
    }
    return http::status::internal_server_error;
}

namespace {

HttpResponse error_response(const OperationError& error) {
    return json_response(http_status(error.kind()), error.to_json());
}

// Runs a handler's body; a refusal it throws becomes the error's JSON with its status.
template <class Body>
void translated(const Responder& respond, Body&& body) {
    try {
        body();
    } catch (const OperationError& error) {
        respond(error_response(error));
    }
}

// Answers `outcome` with `to_response(value)` or the error.
template <class Value, class ToResponse>
std::function<void(Outcome<Value>)> answer_with(Responder respond, ToResponse to_response) {
    return [respond = std::move(respond), to_response = std::move(to_response)](Outcome<Value> outcome) {
        if (!outcome.ok())
            return respond(error_response(outcome.error()));
        respond(to_response(outcome.value()));
    };
}

json request_body(RequestContext& context) {
    try {
        return context.json_body();
    } catch (const HttpError& error) {
        throw HttpError(error.status(), error.what(), "bad_json");
    }
}

// The error of an execute that never ran because the store did not answer (AgentSession), else nullptr.
const json* store_unavailable(const json& answer) {
    const auto error = answer.find("error");
    if (error == answer.end() || !error->is_object() ||
        error->value("ename", std::string()) != AgentSession::store_unavailable_ename)
        return nullptr;
    return &*error;
}

Caller caller_of(const RequestContext& context, std::string via = "http") {
    return {context.client_address, std::move(via), context.principal};
}

class AgentResource : public RestResource {
  public:
    explicit AgentResource(AgentService& service) : service_(service), operations_(service.operations()) {}
    // Every agent resource shows a principal only the sessions it sees (AgentOperations).
    bool serves_tenants() const override { return true; }

    // A request naming a session waits (off the io thread) for the shared store's word on it: deleted or
    // created through another gateway. Its handler then finds it without touching the store.
    void prepare(RequestContext& context, const std::function<void(RequestContext&)>& proceed) override {
        const auto named = context.params.find("session");
        if (named == context.params.end())
            return proceed(context);
        operations_.resolve(context.principal, named->second,
                            [kept = std::make_shared<RequestContext>(context),
                             proceed = std::function<void(RequestContext&)>(proceed)] { proceed(*kept); });
    }

  protected:
    std::shared_ptr<AgentSession> session(RequestContext& context) const {
        return operations_.session(context.principal, context.param("session"));
    }
    AgentService& service_;
    AgentOperations& operations_;
};

// ------------------------------------------------------------------------------------------------ sessions

class SessionsResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "GET, POST, OPTIONS"; }

    void get(RequestContext& context, Responder respond) override {
        json sessions = json::array();
        for (const auto& session : operations_.sessions(context.principal))
            sessions.push_back(session->model());
        respond(json_response(http::status::ok, {{"sessions", sessions}}));
    }

    void post(RequestContext& context, Responder respond) override {
        const json body = request_body(context);
        const std::string base = context.base_url;
        translated(respond, [&] {
            operations_.create_session(
                body, caller_of(context),
                answer_with<std::shared_ptr<AgentSession>>(respond, [base](const auto& session) {
                    HttpResponse response = json_response(http::status::created, session->model());
                    response.set(http::field::location, base + "agent/v1/sessions/" + session->id());
                    return response;
                }));
        });
    }
};

class SessionResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "GET, DELETE, OPTIONS"; }

    void get(RequestContext& context, Responder respond) override {
        translated(respond, [&] { respond(json_response(http::status::ok, session(context)->model())); });
    }
    void delete_(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            operations_.delete_session(session(context), caller_of(context), "deleted through the agent API",
                                       [respond] { respond(empty_response(http::status::no_content)); });
        });
    }
};

class ResetResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "POST, OPTIONS"; }
    void post(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            operations_.reset(session(context), caller_of(context),
                              answer_with<std::shared_ptr<AgentSession>>(respond, [](const auto& session) {
                                  return json_response(http::status::ok, session->model());
                              }));
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

    // `request` comes from AgentOperations::check_execute in this same turn.
    void start(AgentOperations& operations, const std::shared_ptr<AgentSession>& session,
               ExecuteRequest request) {
        write({{"type", "start"}, {"session", session->id()}});
        std::weak_ptr<NdjsonExecution> weak = weak_from_this();
        ExecuteHandlers handlers;
        handlers.on_event = [weak](const json& event) {
            if (auto self = weak.lock())
                self->on_event(event);
        };
        handlers.on_done = [self = shared_from_this()](const json& answer) {
            json end = {{"type", "end"}};
            end.update(answer);
            self->write(end);
            self->finished_ = true;
            self->keepalive_.cancel();
            self->stream_->finish();
        };
        const std::uint64_t ticket =
            operations.queue_checked(session, std::move(request), std::move(handlers));
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
        const auto accept = context.request[http::field::accept];
        const bool streaming =
            accept.find("application/x-ndjson") != std::string_view::npos && context.start_stream;
        translated(respond, [&] {
            auto target = session(context);
            const ExecuteArguments arguments =
                AgentOperations::parse_execute_arguments(request_body(context));
            if (!streaming) {
                ExecuteHandlers handlers;
                handlers.on_done = [respond](const json& answer) {
                    if (const json* error = store_unavailable(answer))
                        return respond(json_error(http::status::service_unavailable,
                                                  error->value("evalue", std::string()),
                                                  "store_unavailable"));
                    respond(json_response(http::status::ok, answer));
                };
                operations_.execute(target, arguments, caller_of(context), std::move(handlers));
                return;
            }
            ExecuteRequest request =
                operations_.check_execute(target, arguments, caller_of(context, "ndjson"));
            HttpResponse head{http::status::ok, 11};
            head.set(http::field::content_type, "application/x-ndjson");
            head.set(http::field::cache_control, "no-store");
            auto execution = std::make_shared<NdjsonExecution>(
                context.start_stream(std::move(head)), service_.gateway().io, service_.config().keepalive_s,
                service_.config().inline_output_bytes);
            execution->start(operations_, target, std::move(request));
        });
    }
};

// ------------------------------------------------------------------------------------------------ files

class FilesResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    void get(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            operations_.list_files(
                session(context),
                answer_with<std::vector<WorkspaceFile>>(respond, [](const std::vector<WorkspaceFile>& found) {
                    json files = json::array();
                    for (const WorkspaceFile& file : found)
                        files.push_back({{"path", file.path}, {"size", file.size}});
                    return json_response(http::status::ok, {{"files", files}});
                }));
        });
    }
};

class FileResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "GET, PUT, DELETE, OPTIONS"; }

    void get(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            const std::string path = workspace_path(context.param("path"));
            operations_.read_file(session(context), path,
                                  answer_with<std::string>(respond, [](std::string& bytes) {
                                      HttpResponse response{http::status::ok, 11};
                                      response.set(http::field::content_type, "application/octet-stream");
                                      response.body() = std::move(bytes);
                                      response.prepare_payload();
                                      return response;
                                  }));
        });
    }

    void put(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            const std::string path = workspace_path(context.param("path"));
            const std::size_t size = context.request.body().size();
            operations_.write_file(
                session(context), path, context.request.body(), caller_of(context),
                answer_with<std::string>(respond, [size](const std::string& relative) {
                    return json_response(http::status::created, {{"path", relative}, {"size", size}});
                }));
        });
    }

    void delete_(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            const std::string path = workspace_path(context.param("path"));
            operations_.delete_file(session(context), path, caller_of(context),
                                    answer_with<std::string>(respond, [](const std::string&) {
                                        return empty_response(http::status::no_content);
                                    }));
        });
    }
};

// ------------------------------------------------------------------------------------------------ notebook,
// audit

class NotebookResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    void get(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            auto target = session(context);
            const auto errors = context.query.find("errors");
            const bool only_ok =
                errors != context.query.end() && (errors->second == "skip" || errors->second == "omit");
            HttpResponse response = json_response(http::status::ok, operations_.notebook(target, only_ok));
            response.set(http::field::content_disposition,
                         "attachment; filename=\"" + target->name() + ".ipynb\"");
            respond(std::move(response));
        });
    }
};

class AuditResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    void get(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            auto target = session(context);
            const bool ndjson =
                context.request[http::field::accept].find("application/x-ndjson") != std::string_view::npos;
            auto parameter = [&context](const char* name) {
                const auto found = context.query.find(name);
                return found == context.query.end() ? std::string() : found->second;
            };
            AuditQuery query{"", parameter("event"), parameter("since"), parameter("until")};
            operations_.audit_trail(
                target, std::move(query),
                answer_with<std::vector<json>>(respond, [ndjson,
                                                         id = target->id()](std::vector<json>& entries) {
                    if (!ndjson)
                        return json_response(http::status::ok, {{"session", id}, {"entries", json(entries)}});
                    HttpResponse response{http::status::ok, 11};
                    response.set(http::field::content_type, "application/x-ndjson");
                    for (const json& entry : entries)
                        response.body() += entry.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
                    response.prepare_payload();
                    return response;
                }));
        });
    }
};

// ------------------------------------------------------------------------------------------------ approvals

// ------------------------------------------------------------------------------------------------ viewer
// links

// POST {"ttl_s"?} → 201 {"token", "expires", "view"}: a token that reads this one session (its model,
// notebook, audit, events and live page) until it expires or the session ends (principal.hpp, "viewer").
// Sharing runs (Principal::Action::run): a viewer or an approver cannot share further.
class ShareResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    static constexpr double max_ttl_s = 7 * 24 * 3600;
    std::string allowed_methods() const override { return "POST, OPTIONS"; }
    void post(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            auto target = session(context);
            const json body = request_body(context);
            double ttl_s = 3600;
            if (body.contains("ttl_s") && !body["ttl_s"].is_null()) {
                if (!body["ttl_s"].is_number() || body["ttl_s"].get<double>() <= 0 ||
                    body["ttl_s"].get<double>() > max_ttl_s)
                    throw OperationError(
                        OperationErrorKind::malformed, "bad_ttl",
                        "ttl_s must be a number of seconds above 0 and at most 604800 (7 days)");
                ttl_s = body["ttl_s"].get<double>();
            }
            const auto expires = std::chrono::system_clock::now() +
                                 std::chrono::seconds(static_cast<std::int64_t>(std::ceil(ttl_s)));
            const std::int64_t expires_s =
                std::chrono::duration_cast<std::chrono::seconds>(expires.time_since_epoch()).count();
            const std::string token =
                service_.gateway().auth.issue_viewer(target->id(), target->tenant(), expires_s);
            if (token.empty())
                throw OperationError(OperationErrorKind::unavailable, "no_viewers",
                                     "this gateway runs without authentication: there is nothing to share");
            respond(json_response(http::status::created, {{"token", token},
                                                          {"expires", format_iso8601_utc(expires)},
                                                          {"view", context.base_url + "agent/v1/sessions/" +
                                                                       target->id() + "/view"}}));
        });
    }
};

class ApprovalsResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    void get(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            auto target = session(context);
            respond(json_response(http::status::ok,
                                  {{"session", target->id()}, {"approvals", operations_.approvals(target)}}));
        });
    }
};

class ApprovalResource : public AgentResource {
  public:
    using AgentResource::AgentResource;
    std::string allowed_methods() const override { return "GET, POST, OPTIONS"; }
    Principal::Action action(http::verb method) const override {
        return method == http::verb::post ? Principal::Action::decide : AgentResource::action(method);
    }
    void get(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            const std::string approval_id = context.param("approval");
            for (const json& approval : operations_.approvals(session(context)))
                if (approval.value("id", std::string()) == approval_id)
                    return respond(json_response(http::status::ok, approval));
            throw OperationError(OperationErrorKind::not_found, "unknown_approval",
                                 "no approval " + approval_id + " in this session",
                                 {{"approval", approval_id}});
        });
    }
    void post(RequestContext& context, Responder respond) override {
        translated(respond, [&] {
            auto target = session(context);
            const std::string decision = AgentOperations::parse_decision(request_body(context));
            operations_.decide_approval(target, context.param("approval"), decision, caller_of(context),
                                        answer_with<json>(respond, [](json& approval) {
                                            return json_response(http::status::ok, approval);
                                        }));
        });
    }
};

}  // namespace

// ------------------------------------------------------------------------------------------------ service

AgentService::AgentService(GatewayServices& gateway, const AgentConfig& config)
    : gateway_(gateway),
      config_(config),
      session_services_{gateway.io,     gateway.logger,  gateway.kernels, config_,
                        gateway.writer, gateway.metrics, gateway.quotas},
      registry_(session_services_),
      operations_(session_services_, registry_) {
    gateway.quotas.count_holdings_with([this](const std::string& tenant) { return tenant_holdings(tenant); });
}

void AgentService::end_sessions_of(const std::string& tenant) {
    for (const auto& session : registry_.list())
        if (session->tenant() == tenant)
            operations_.delete_session(session, Caller{"", "tenants"}, "its tenant was removed", [] {});
}

TenantHoldings AgentService::tenant_holdings(const std::string& tenant) const {
    TenantHoldings held;
    for (const auto& session : registry_.list()) {
        if (session->tenant() != tenant)
            continue;
        held.sessions[session->id()] = static_cast<std::int64_t>(session->record().limits.memory_mb);
        held.executes += static_cast<std::int64_t>(session->executes_in_flight());
        if (auto kernel = session->kernel())
            held.session_kernels.insert(kernel->id());
    }
    for (const auto& kernel : gateway_.kernels.list())
        if (kernel->tenant() == tenant)
            held.kernels.insert(kernel->id());
    return held;
}

AgentService::~AgentService() {
    gateway_.quotas.count_holdings_with({});  // the count above refers to this service
}

void AgentService::start() {
    registry_.start();
}

std::shared_ptr<AgentSession> AgentService::require_session(const Principal& principal,
                                                            const std::string& id_or_name) const {
    try {
        return operations_.session(principal, id_or_name);
    } catch (const OperationError& error) {
        throw HttpError(http_status(error.kind()), error.what(), error.reason());
    }
}

// ------------------------------------------------------------------------------------------------ openapi

// The API's description (share/cellblock/openapi/agent-v1.json), read once when the routes are made: a client
// generator or a fuzzer (tests/agent/test_openapi.py) gets the installed file as it is.
class OpenApiResource : public RestResource {
  public:
    bool serves_tenants() const override { return true; }  // nobody's own: the API's description
    explicit OpenApiResource(const std::filesystem::path& file) {
        std::ifstream in(file, std::ios::binary);
        std::ostringstream text;
        text << in.rdbuf();
        if (in && json::accept(text.str()))
            document_ = text.str();
    }
    void get(RequestContext&, Responder respond) override {
        if (document_.empty()) {
            respond(
                json_error(http::status::service_unavailable,
                           "the OpenAPI document is not installed (share/cellblock/openapi/agent-v1.json)",
                           "openapi_missing"));
            return;
        }
        HttpResponse response{http::status::ok, 11};
        response.set(http::field::content_type, "application/json");
        response.body() = document_;
        response.prepare_payload();
        respond(std::move(response));
    }

  private:
    std::string document_;
};

void AgentService::register_routes(Router& router) {
    router.add("/agent/v1/sessions", std::make_shared<SessionsResource>(*this));
    router.add("/agent/v1/sessions/{session}", std::make_shared<SessionResource>(*this));
    router.add("/agent/v1/sessions/{session}/execute", std::make_shared<ExecuteResource>(*this));
    router.add("/agent/v1/sessions/{session}/reset", std::make_shared<ResetResource>(*this));
    router.add("/agent/v1/sessions/{session}/files", std::make_shared<FilesResource>(*this));
    router.add("/agent/v1/sessions/{session}/files/{path...}", std::make_shared<FileResource>(*this));
    router.add("/agent/v1/sessions/{session}/notebook", std::make_shared<NotebookResource>(*this));
    router.add("/agent/v1/sessions/{session}/audit", std::make_shared<AuditResource>(*this));
    router.add("/agent/v1/sessions/{session}/approvals", std::make_shared<ApprovalsResource>(*this));
    router.add("/agent/v1/sessions/{session}/share", std::make_shared<ShareResource>(*this));
    router.add("/agent/v1/sessions/{session}/approvals/{approval}",
               std::make_shared<ApprovalResource>(*this));
    router.add("/agent/v1/openapi.json",
               std::make_shared<OpenApiResource>(installed_data_dir() + "/cellblock/openapi/agent-v1.json"));
    register_mcp_endpoint(router, *this);
    register_live_view(router, *this);
}

}  // namespace cellblock::gateway::agent
