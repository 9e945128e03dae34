#include "cellblock/gateway/http/rest_handlers.hpp"

#include <fstream>
#include <sstream>

#include "cellblock/contract/environment.hpp"
#include "cellblock/gateway/common/time_format.hpp"
#include "cellblock/gateway/http/websocket_channel.hpp"

namespace cellblock::gateway {

using nlohmann::json;

bool looks_like_kernel_id(std::string_view id) {
    int dashes = 0;
    bool word_before = false;
    for (char c : id) {
        if (c == '-') {
            if (!word_before)
                return false;
            ++dashes;
            word_before = false;
        } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '_') {
            word_before = true;
        } else {
            return false;
        }
    }
    return dashes == 4 && word_before;
}

namespace {

// A creation or deletion is answered once it is in the store, so that another gateway on a shared store
// (which the client may ask next) already sees it.
void answer_once_stored(GatewayServices& services, Responder respond, HttpResponse response) {
    services.writer.after_pending([respond = std::move(respond), response = std::move(response)]() mutable {
        respond(std::move(response));
    });
}

HttpResponse kernel_not_found(const std::string& id) {
    return json_error(http::status::not_found, "Kernel does not exist: " + id);
}

// The kernel `id` as `principal` sees it: another tenant's kernel is no kernel (principal.hpp).
std::shared_ptr<Kernel> visible(std::shared_ptr<Kernel> kernel, const Principal& principal) {
    return kernel && principal.sees(kernel->tenant()) ? std::move(kernel) : nullptr;
}

// A request about one kernel whose store lookup was not answered in time (KernelManager::look_up).
HttpResponse store_unavailable(const std::string& error) {
    return json_error(http::status::service_unavailable, "the store did not answer: " + error,
                      "store_unavailable");
}

// `kernel` as a viewer may watch it: the kernel of an agent session the viewer reads (principal.hpp); null
// for anyone else and any other kernel.
std::shared_ptr<Kernel> watched(std::shared_ptr<Kernel> kernel, const Principal& principal) {
    return kernel && principal.role == Principal::Role::viewer && !kernel->agent_session().empty() &&
                   principal.sees_session(kernel->tenant(), kernel->agent_session())
               ? std::move(kernel)
               : nullptr;
}

// The live agent session whose kernel is `kernel_id`, as the store records it; empty when none (reader
// thread).
std::string stored_session_of(SessionStore& store, const std::string& kernel_id) {
    for (const json& record : store.agent_sessions()) {
        if (!record.is_object() || record.value("deleted", false))
            continue;
        auto kernel = record.find("kernel_id");
        auto id = record.find("id");
        if (kernel != record.end() && kernel->is_string() && *kernel == kernel_id && id != record.end() &&
            id->is_string())
            return id->get<std::string>();
    }
    return {};
}

// A resource of one kernel: before its handler runs, a kernel another gateway runs (shared store) is
// attached with the store read off the io thread, so that the handler finds it with `held_kernel(context)`.
class OneKernelResource : public RestResource {
  public:
    explicit OneKernelResource(GatewayServices& services) : services_(services) {}
    bool serves_tenants() const override { return true; }
    void prepare(RequestContext& context, const std::function<void(RequestContext&)>& proceed) override {
        const std::string& id = context.param("kernel_id");
        if (!looks_like_kernel_id(id))
            return proceed(context);
        services_.kernels.find_or_attach(id, [kept = std::make_shared<RequestContext>(context),
                                              proceed = std::function<void(RequestContext&)>(proceed)](
                                                 const std::shared_ptr<Kernel>&) { proceed(*kept); });
    }

  protected:
    std::shared_ptr<Kernel> held_kernel(RequestContext& context) const {
        const std::string& id = context.param("kernel_id");
        return looks_like_kernel_id(id) ? visible(services_.kernels.find(id), context.principal) : nullptr;
    }
    GatewayServices& services_;
};

// A new kernel counts against the requesting tenant's quota (tenant_quotas.hpp, counted through every gateway
// of a shared store): `start` runs once it fits; past it, 429 quota_exceeded.
void start_admitted(const GatewayServices& services, const Principal& principal, const Responder& respond,
                    std::function<void()> start) {
    services.quotas.admit_session(
        principal, services.quotas.kernel_memory_mb(),
        [respond, start = std::move(start)](const std::optional<HttpError>& refused) {
            if (refused)
                return respond(json_error(refused->status(), refused->what(), refused->reason()));
            try {
                start();
            } catch (const HttpError& error) {  // possibly after the handler returned: answered here
                respond(json_error(error.status(), error.what(), error.reason()));
            } catch (const std::exception& error) {
                respond(json_error(http::status::internal_server_error, error.what()));
            }
        });
}

HttpResponse created(const json& model, const std::string& location) {
    HttpResponse response = json_response(http::status::created, model);
    response.set(http::field::location, location);
    return response;
}

// Maps a start failure to Kernel Gateway's status codes.
HttpResponse start_error_response(const KernelStartError& error) {
    switch (error.kind) {
        case KernelStartError::Kind::resource_limit:
            return json_error(http::status::forbidden, "Resource Limit: " + error.message);
        case KernelStartError::Kind::no_such_kernel:
            return json_error(http::status::internal_server_error, "NoSuchKernel: " + error.message);
        case KernelStartError::Kind::failed:
            break;
    }
    return json_error(http::status::internal_server_error, "Kernel failed to start: " + error.message);
}

// Validates the `env` of POST /api/kernels: a dict of strings (400 otherwise).
std::map<std::string, std::string> request_env(const json& body) {
    std::map<std::string, std::string> env;
    auto found = body.find("env");
    if (found == body.end() || found->is_null())
        return env;
    if (!found->is_object())
        throw HttpError(http::status::bad_request, "env must be a JSON object of strings", "bad_env");
    for (const auto& [name, value] : found->items()) {
        if (!value.is_string())
            throw HttpError(http::status::bad_request, "env value of " + name + " must be a string",
                            "bad_env");
        env[name] = value.get<std::string>();
    }
    // Every provisioner: a name is never a shell word (a Slurm job's script), whatever the kernel runs on.
    try {
        contract::check_environment(env);
    } catch (const contract::InvalidEnvironment& error) {
        throw HttpError(http::status::bad_request, error.what(), "bad_env");
    }
    return env;
}

std::string optional_string(const json& body, const char* key) {
    auto found = body.find(key);
    if (found == body.end() || found->is_null())
        return {};
    if (!found->is_string())
        throw HttpError(http::status::bad_request, std::string(key) + " must be a string");
    return found->get<std::string>();
}

// Nobody's own: the version, and the kernelspecs every client lists before it starts a kernel.
class ApiRootResource : public RestResource {
  public:
    bool serves_tenants() const override { return true; }
    void get(RequestContext&, Responder respond) override {
        respond(json_response(http::status::ok, {{"version", CELLBLOCK_GATEWAY_VERSION},
                                                 {"gateway_version", CELLBLOCK_GATEWAY_VERSION},
                                                 {"implementation", "cellblock-gateway"}}));
    }
};

class StatusResource : public RestResource {
  public:
    explicit StatusResource(GatewayServices& services)
        : services_(services), started_(std::chrono::system_clock::now()) {}
    void get(RequestContext&, Responder respond) override {
        auto last_activity = started_;
        int connections = 0;
        const auto kernels = services_.kernels.list();
        for (const auto& kernel : kernels) {
            last_activity = std::max(last_activity, kernel->last_activity());
            connections += kernel->connections();
        }
        respond(json_response(http::status::ok, {{"started", format_iso8601_utc(started_)},
                                                 {"last_activity", format_iso8601_utc(last_activity)},
                                                 {"kernels", kernels.size()},
                                                 {"connections", connections},
                                                 {"warm_pool_ready", services_.kernels.pool_ready_count()}}));
    }

  private:
    GatewayServices& services_;
    std::chrono::system_clock::time_point started_;
};

class KernelSpecsResource : public RestResource {
  public:
    explicit KernelSpecsResource(GatewayServices& services) : services_(services) {}
    bool serves_tenants() const override { return true; }
    void get(RequestContext& context, Responder respond) override {
        services_.kernelspecs.refresh();
        respond(json_response(http::status::ok, services_.kernelspecs.list_model(context.base_url)));
    }

  private:
    GatewayServices& services_;
};

class KernelSpecResource : public RestResource {
  public:
    explicit KernelSpecResource(GatewayServices& services) : services_(services) {}
    bool serves_tenants() const override { return true; }
    void get(RequestContext& context, Responder respond) override {
        const std::string& name = context.param("name");
        auto spec = services_.kernelspecs.find(name);
        if (!spec) {
            respond(json_error(http::status::not_found, "Kernel spec " + name + " not found"));
            return;
        }
        respond(json_response(http::status::ok, services_.kernelspecs.spec_model(*spec, context.base_url)));
    }

  private:
    GatewayServices& services_;
};

class KernelSpecFileResource : public RestResource {
  public:
    explicit KernelSpecFileResource(GatewayServices& services) : services_(services) {}
    bool serves_tenants() const override { return true; }
    void get(RequestContext& context, Responder respond) override {
        auto path = services_.kernelspecs.resource_path(context.param("name"), context.param("file"));
        if (!path) {
            respond(json_error(http::status::not_found, "Kernel spec resource not found: " + context.path));
            return;
        }
        std::ifstream input(*path, std::ios::binary);
        std::ostringstream content;
        content << input.rdbuf();
        HttpResponse response{http::status::ok, context.request.version()};
        const std::string extension = path->extension().string();
        const char* type = extension == ".png"    ? "image/png"
                           : extension == ".svg"  ? "image/svg+xml"
                           : extension == ".js"   ? "application/javascript"
                           : extension == ".css"  ? "text/css"
                           : extension == ".json" ? "application/json"
                                                  : "application/octet-stream";
        response.set(http::field::content_type, type);
        if (extension == ".png")
            response.set(http::field::cache_control, "max-age=2592000");
        response.body() = content.str();
        response.prepare_payload();
        respond(std::move(response));
    }

  private:
    GatewayServices& services_;
};

class KernelsResource : public RestResource {
  public:
    explicit KernelsResource(GatewayServices& services) : services_(services) {}
    std::string allowed_methods() const override { return "GET, POST, OPTIONS"; }
    bool serves_tenants() const override { return true; }
    void get(RequestContext& context, Responder respond) override {
        if (!services_.config.list_kernels) {
            respond(json_error(http::status::forbidden, "Forbidden"));
            return;
        }
        services_.kernels.list_everywhere(
            [principal = context.principal, respond](const std::vector<std::shared_ptr<Kernel>>& kernels) {
                json models = json::array();
                for (const auto& kernel : kernels)
                    if (principal.sees(kernel->tenant()))
                        models.push_back(kernel->model());
                respond(json_response(http::status::ok, models));
            });
    }
    void post(RequestContext& context, Responder respond) override {
        const json body = context.json_body();
        KernelStartRequest request{optional_string(body, "name"), request_env(body)};
        request.tenant = context.principal.tenant;
        start_admitted(services_, context.principal, respond,
                       [this, request, respond, base_url = context.base_url] {
                           services_.kernels.start_kernel(request, [respond, base_url](auto result) {
                               if (auto* error = std::get_if<KernelStartError>(&result)) {
                                   respond(start_error_response(*error));
                                   return;
                               }
                               const auto& kernel = std::get<std::shared_ptr<Kernel>>(result);
                               respond(created(kernel->model(), base_url + "api/kernels/" + kernel->id()));
                           });
                       });
    }

  private:
    GatewayServices& services_;
};

class KernelResource : public OneKernelResource {
  public:
    using OneKernelResource::OneKernelResource;
    std::string allowed_methods() const override { return "GET, DELETE, OPTIONS"; }
    void get(RequestContext& context, Responder respond) override {
        auto kernel = held_kernel(context);
        if (!kernel)
            return respond(kernel_not_found(context.param("kernel_id")));
        respond(json_response(http::status::ok, kernel->model()));
    }
    void delete_(RequestContext& context, Responder respond) override {
        const std::string& id = context.param("kernel_id");
        // Another gateway's kernel (a shared store) is attached first, then shut down like one of ours.
        if (!held_kernel(context) || !services_.kernels.shutdown_kernel(id))
            return respond(kernel_not_found(id));
        answer_once_stored(services_, std::move(respond), empty_response(http::status::no_content));
    }
};

class KernelInterruptResource : public OneKernelResource {
  public:
    using OneKernelResource::OneKernelResource;
    std::string allowed_methods() const override { return "POST, OPTIONS"; }
    void post(RequestContext& context, Responder respond) override {
        auto kernel = held_kernel(context);
        if (!kernel)
            return respond(kernel_not_found(context.param("kernel_id")));
        kernel->interrupt();  // the body (none, {} or {"kernel_id": ...}) is ignored, as in Kernel Gateway
        respond(empty_response(http::status::no_content));
    }
};

class KernelRestartResource : public OneKernelResource {
  public:
    using OneKernelResource::OneKernelResource;
    std::string allowed_methods() const override { return "POST, OPTIONS"; }
    void post(RequestContext& context, Responder respond) override {
        auto kernel = held_kernel(context);
        if (!kernel)
            return respond(kernel_not_found(context.param("kernel_id")));
        // Answers once the restarted kernel replied to kernel_info_request, as Jupyter does.
        services_.kernels.restart_kernel(kernel, [respond, kernel](std::optional<std::string> error) {
            if (error) {
                respond(json_error(http::status::internal_server_error,
                                   "Exception restarting kernel: " + *error));
                return;
            }
            respond(json_response(http::status::ok, kernel->model()));
        });
    }
};

class KernelChannelsResource : public RestResource {
  public:
    explicit KernelChannelsResource(GatewayServices& services) : services_(services) {}
    bool accepts_websocket() const override { return true; }
    bool serves_tenants() const override { return true; }
    // Attaching reads; a principal that may not run attaches as a watcher (on_upgraded), which sends nothing.
    Principal::Action action(http::verb) const override { return Principal::Action::read; }
    void get(RequestContext&, Responder respond) override {
        respond(json_error(http::status::bad_request, "This endpoint only accepts WebSocket upgrades"));
    }
    // Before the upgrade, off the io thread: a kernel another gateway runs (shared store) is attached, and
    // for a viewer the agent session of a kernel attached so is read from the store, so that kernel_for
    // decides from what is held here on every gateway.
    void prepare(RequestContext& context, const std::function<void(RequestContext&)>& proceed) override {
        const std::string& id = context.param("kernel_id");
        if (!looks_like_kernel_id(id))
            return proceed(context);
        services_.kernels.find_or_attach(id, [this, kept = std::make_shared<RequestContext>(context),
                                              proceed = std::function<void(RequestContext&)>(proceed)](
                                                 const std::shared_ptr<Kernel>& kernel) {
            if (kernel && kernel->agent_session().empty() &&
                kept->principal.role == Principal::Role::viewer && services_.writer.shared())
                return with_stored_session(kernel, [kept, proceed] { proceed(*kept); });
            proceed(*kept);
        });
    }
    // A viewer link attaches read-only to its session's kernel (KernelChannelsConnection::Watcher); any other
    // principal to a kernel it sees. Only what is held here (prepare attached the rest).
    std::shared_ptr<Kernel> kernel_for(const RequestContext& context) const {
        const std::string& id = context.param("kernel_id");
        auto kernel = looks_like_kernel_id(id) ? services_.kernels.find(id) : nullptr;
        const Principal& principal = context.principal;
        return principal.role == Principal::Role::viewer ? watched(std::move(kernel), principal)
                                                         : visible(std::move(kernel), principal);
    }
    std::optional<HttpResponse> check_upgrade(RequestContext& context) override {
        if (!kernel_for(context))
            return kernel_not_found(context.param("kernel_id"));
        return std::nullopt;
    }
    std::string select_subprotocol(const RequestContext& context) const override {
        auto offered = context.request.find(http::field::sec_websocket_protocol);
        if (offered == context.request.end())
            return {};
        std::string_view protocols = offered->value();
        std::size_t at = 0;
        while (at <= protocols.size()) {
            std::size_t next = protocols.find(',', at);
            if (next == std::string_view::npos)
                next = protocols.size();
            std::string_view item = protocols.substr(at, next - at);
            while (!item.empty() && item.front() == ' ')
                item.remove_prefix(1);
            while (!item.empty() && item.back() == ' ')
                item.remove_suffix(1);
            if (item == "v1.kernel.websocket.jupyter.org")
                return std::string(item);
            at = next + 1;
        }
        return {};
    }
    void on_upgraded(RequestContext& context, std::shared_ptr<WebSocketTransport> transport) override {
        auto kernel = kernel_for(context);
        if (!kernel) {
            transport->close("kernel does not exist");
            return;
        }
        auto connection = std::make_shared<KernelChannelsConnection>(
            kernel, std::move(transport), services_.logger, services_.config.max_pending_send_bytes);
        auto session_id = context.query.find("session_id");
        std::optional<KernelChannelsConnection::Watcher> watcher;
        if (const Principal& principal = context.principal; !principal.may(Principal::Action::run)) {
            watcher.emplace(KernelChannelsConnection::Watcher{services_.io, std::nullopt});
            if (principal.expires != 0)
                watcher->expires =
                    std::chrono::system_clock::time_point(std::chrono::seconds(principal.expires));
        }
        connection->open(session_id == context.query.end() ? std::string() : session_id->second, watcher);
    }

  private:
    // A kernel attached from the store serves the agent session the store records for it, which this gateway
    // may not hold: marked with it, the kernel is watched through any gateway as through its own.
    void with_stored_session(const std::shared_ptr<Kernel>& kernel, std::function<void()> then) {
        services_.writer.read<std::string>(
            [id = kernel->id()](SessionStore& store) { return stored_session_of(store, id); },
            StoreWriter::default_read_limit,
            [kernel, then = std::move(then)](const StoreAnswer<std::string>& session) {
                if (session.ok() && !session.value->empty() && kernel->agent_session().empty())
                    kernel->set_agent_session(*session.value);
                then();
            });
    }
    GatewayServices& services_;
};

// ------------------------------------------------------------------------------------------------ metrics

class MetricsResource : public RestResource {
  public:
    explicit MetricsResource(const MetricsRegistry& registry) : registry_(registry) {}
    void get(RequestContext& context, Responder respond) override {
        HttpResponse response{http::status::ok, context.request.version()};
        response.set(http::field::content_type, MetricsRegistry::content_type);
        response.set(http::field::cache_control, "no-store");
        response.body() = registry_.render();
        response.prepare_payload();
        respond(std::move(response));
    }

  private:
    const MetricsRegistry& registry_;
};

// ------------------------------------------------------------------------------------------------ sessions

// The kernels a session names are attached before its handler runs (refresh_sessions): only what is held
// here is asked.
json session_model(GatewayServices& services, const JupyterSessionRecord& record) {
    auto kernel = services.kernels.find(record.kernel_id);
    json kernel_model = kernel ? kernel->model() : json{{"id", record.kernel_id}};
    return {{"id", record.id},        {"path", record.path},
            {"name", record.name},    {"type", record.type},
            {"kernel", kernel_model}, {"notebook", {{"path", record.path}, {"name", record.name}}}};
}

// What a Jupyter sessions request needs of a shared store, read at once on StoreWriter's reader thread.
struct StoredSessions {
    std::vector<json> sessions;
    std::vector<KernelRecord> kernels;
};

// Before a sessions request's handler runs: on a shared store, the sessions other gateways created are taken
// in and those they deleted dropped, and the kernels of the sessions `attach` picks are attached (as
// find_or_attach does), from one store read off the io thread. Then sessions whose kernel is gone are
// forgotten. A store that does not answer in time leaves what this gateway holds (store_read_failed is
// logged); the handler decides from what is held here.
void refresh_sessions(GatewayServices& services, std::function<bool(const JupyterSessionRecord&)> attach,
                      std::function<void()> then) {
    if (!services.writer.shared()) {
        services.sessions.prune(
            [&services](const std::string& id) { return services.kernels.known_among(id, std::nullopt); });
        return then();
    }
    services.writer.read<StoredSessions>(
        [](SessionStore& store) {
            return StoredSessions{store.jupyter_sessions(), store.kernels()};
        },
        StoreWriter::default_read_limit,
        [&services, attach = std::move(attach),
         then = std::move(then)](const StoreAnswer<StoredSessions>& answer) {
            std::optional<std::set<std::string>> stored;
            std::map<std::string, const KernelRecord*> records;
            if (answer.ok()) {
                stored.emplace();
                for (const KernelRecord& record : answer.value->kernels) {
                    stored->insert(record.id);
                    records.emplace(record.id, &record);
                }
            } else {
                services.logger.error("store_read_failed",
                                      {{"operation", "list sessions"}, {"error", answer.error}});
            }
            auto known = [&services, &stored](const std::string& id) {
                return services.kernels.known_among(id, stored);
            };
            if (answer.ok())
                services.sessions.refresh(answer.value->sessions, known);
            services.sessions.prune(known);
            for (const auto& [id, record] : services.sessions.all()) {
                if (!answer.ok() || !attach(record))
                    continue;
                auto found = records.find(record.kernel_id);
                services.kernels.attach_stored(
                    record.kernel_id, found == records.end() ? std::nullopt : std::optional(*found->second));
            }
            then();
        });
}

// A RestResource's prepare() over refresh_sessions, keeping the request's context until it proceeds.
void prepare_sessions(GatewayServices& services, RequestContext& context,
                      const std::function<void(RequestContext&)>& proceed,
                      std::function<bool(const JupyterSessionRecord&)> attach) {
    refresh_sessions(services, std::move(attach),
                     [kept = std::make_shared<RequestContext>(context),
                      proceed = std::function<void(RequestContext&)>(proceed)] { proceed(*kept); });
}

class SessionsResource : public RestResource {
  public:
    explicit SessionsResource(GatewayServices& services) : services_(services) {}
    std::string allowed_methods() const override { return "GET, POST, OPTIONS"; }
    bool serves_tenants() const override { return true; }
    void prepare(RequestContext& context, const std::function<void(RequestContext&)>& proceed) override {
        prepare_sessions(services_, context, proceed, [](const JupyterSessionRecord&) { return true; });
    }
    void get(RequestContext& context, Responder respond) override {
        if (!services_.config.list_kernels)
            return respond(json_error(http::status::forbidden, "Forbidden"));
        json models = json::array();
        for (const auto& [id, record] : services_.sessions.all())
            if (context.principal.sees(record.tenant))
                models.push_back(session_model(services_, record));
        respond(json_response(http::status::ok, models));
    }
    void post(RequestContext& context, Responder respond) override {
        const json body = context.json_body();
        std::string path = optional_string(body, "path");
        std::string type = optional_string(body, "type");
        if (path.empty() && body.contains("notebook") && body["notebook"].is_object()) {  // legacy shape
            path = optional_string(body["notebook"], "path");
            if (type.empty())
                type = "notebook";
        }
        if (path.empty())
            throw HttpError(http::status::bad_request, "Missing field in JSON data: path");
        if (type.empty())
            throw HttpError(http::status::bad_request, "Missing field in JSON data: type");
        std::string name = optional_string(body, "name");
        const std::string location_base = context.base_url + "api/sessions/";
        const std::string tenant = context.principal.tenant;
        if (JupyterSessionRecord* existing = services_.sessions.find_by_path(path, tenant)) {
            respond(created(session_model(services_, *existing), location_base + existing->id));
            return;
        }
        json kernel_request =
            body.contains("kernel") && body["kernel"].is_object() ? body["kernel"] : json::object();
        const std::string kernel_id = optional_string(kernel_request, "id");
        if (!kernel_id.empty()) {
            if (!looks_like_kernel_id(kernel_id))
                throw HttpError(http::status::not_found, "Kernel does not exist: " + kernel_id);
            JupyterSessionRecord draft{{}, path, name, type, kernel_id, tenant};
            services_.kernels.look_up(kernel_id,
                                      [this, draft, respond, location_base, principal = context.principal](
                                          const StoreAnswer<std::shared_ptr<Kernel>>& kernel) {
                                          create_on_kernel(kernel, principal, draft, respond, location_base);
                                      });
            return;
        }
        KernelStartRequest request{optional_string(kernel_request, "name"), request_env(kernel_request)};
        request.tenant = tenant;
        start_admitted(services_, context.principal, respond,
                       [this, request, respond, path, name, type, location_base] {
                           start_with_kernel(request, respond, path, name, type, location_base);
                       });
    }

  private:
    // A new session on the existing kernel `draft` names, once looked up (KernelManager::look_up).
    void create_on_kernel(const StoreAnswer<std::shared_ptr<Kernel>>& kernel, const Principal& principal,
                          const JupyterSessionRecord& draft, const Responder& respond,
                          const std::string& location_base) {
        if (!kernel.ok())
            return respond(store_unavailable(kernel.error));
        if (!visible(*kernel.value, principal))
            return respond(json_error(http::status::not_found, "Kernel does not exist: " + draft.kernel_id));
        JupyterSessionRecord& record =
            services_.sessions.create(draft.path, draft.name, draft.type, draft.kernel_id, draft.tenant);
        answer_once_stored(services_, respond,
                           created(session_model(services_, record), location_base + record.id));
    }
    // A new session on a new kernel, once the kernel is admitted within its tenant's quota.
    void start_with_kernel(const KernelStartRequest& request, const Responder& respond,
                           const std::string& path, const std::string& name, const std::string& type,
                           const std::string& location_base) {
        GatewayServices& services = services_;
        services_.kernels.start_kernel(request, [&services, respond, path, name, type, location_base,
                                                 tenant = request.tenant,
                                                 kernel_name = request.name](auto result) {
            if (auto* error = std::get_if<KernelStartError>(&result)) {
                if (error->kind == KernelStartError::Kind::no_such_kernel) {
                    respond(json_response(
                        http::status::not_implemented,
                        {{"message", error->message}, {"short_message", kernel_name + " not found"}}));
                } else {
                    respond(start_error_response(*error));
                }
                return;
            }
            const auto& kernel = std::get<std::shared_ptr<Kernel>>(result);
            JupyterSessionRecord& record = services.sessions.create(path, name, type, kernel->id(), tenant);
            answer_once_stored(services, respond,
                               created(session_model(services, record), location_base + record.id));
        });
    }

    GatewayServices& services_;
};

class SessionResource : public RestResource {
  public:
    explicit SessionResource(GatewayServices& services) : services_(services) {}
    std::string allowed_methods() const override { return "GET, PATCH, DELETE, OPTIONS"; }
    bool serves_tenants() const override { return true; }
    void prepare(RequestContext& context, const std::function<void(RequestContext&)>& proceed) override {
        prepare_sessions(services_, context, proceed,
                         [id = context.param("session_id")](const JupyterSessionRecord& record) {
                             return record.id == id;
                         });
    }
    void get(RequestContext& context, Responder respond) override {
        JupyterSessionRecord* record = visible_session(context);
        if (!record)
            return respond(session_not_found(context));
        respond(json_response(http::status::ok, session_model(services_, *record)));
    }
    void patch(RequestContext& context, Responder respond) override {
        const json body = context.json_body();
        JupyterSessionRecord* record = visible_session(context);
        if (!record)
            return respond(session_not_found(context));
        if (body.contains("path"))
            record->path = optional_string(body, "path");
        if (body.contains("name"))
            record->name = optional_string(body, "name");
        if (body.contains("type"))
            record->type = optional_string(body, "type");
        const json kernel_request =
            body.contains("kernel") && body["kernel"].is_object() ? body["kernel"] : json::object();
        const std::string kernel_id = optional_string(kernel_request, "id");
        const std::string kernel_name = optional_string(kernel_request, "name");
        if (!kernel_id.empty()) {
            if (!looks_like_kernel_id(kernel_id))
                throw HttpError(http::status::bad_request, "Kernel does not exist: " + kernel_id);
            services_.kernels.look_up(
                kernel_id, [this, respond, kernel_id, session_id = record->id, principal = context.principal](
                               const StoreAnswer<std::shared_ptr<Kernel>>& kernel) {
                    move_to_kernel(kernel, principal, session_id, kernel_id, respond);
                });
            return;
        }
        if (!kernel_name.empty()) {
            // A new kernel of another spec replaces the old one, which is shut down once the new one runs.
            GatewayServices& services = services_;
            const std::string session_id = record->id;
            KernelStartRequest request{kernel_name, {}};
            request.tenant = record->tenant;
            services_.kernels.start_kernel(request, [&services, respond, session_id](auto result) {
                if (auto* error = std::get_if<KernelStartError>(&result))
                    return respond(start_error_response(*error));
                JupyterSessionRecord* current = services.sessions.find(session_id);
                const auto& kernel = std::get<std::shared_ptr<Kernel>>(result);
                if (!current) {
                    services.kernels.shutdown_kernel(kernel->id());
                    return respond(json_error(http::status::not_found, "Session not found: " + session_id));
                }
                const std::string old_kernel = current->kernel_id;
                current->kernel_id = kernel->id();
                services.sessions.save(*current);
                services.kernels.shutdown_kernel(old_kernel);
                respond(json_response(http::status::ok, session_model(services, *current)));
            });
            return;
        }
        services_.sessions.save(*record);
        respond(json_response(http::status::ok, session_model(services_, *record)));
    }
    void delete_(RequestContext& context, Responder respond) override {
        JupyterSessionRecord* record = visible_session(context);
        if (!record)
            return respond(session_not_found(context));
        // The kernel goes with the session, also one another gateway runs (shared store): without the
        // store's answer the session stays, so that the client may delete it again.
        GatewayServices& services = services_;
        services_.kernels.look_up(
            record->kernel_id, [&services, respond, kernel_id = record->kernel_id,
                                session_id = record->id](const StoreAnswer<std::shared_ptr<Kernel>>& kernel) {
                if (!kernel.ok())
                    return respond(store_unavailable(kernel.error));
                services.sessions.remove(session_id);
                if (*kernel.value)
                    services.kernels.shutdown_kernel(kernel_id);
                answer_once_stored(services, respond, empty_response(http::status::no_content));
            });
    }

  private:
    // PATCH with a kernel id: the session moves to that existing kernel, once looked up.
    void move_to_kernel(const StoreAnswer<std::shared_ptr<Kernel>>& kernel, const Principal& principal,
                        const std::string& session_id, const std::string& kernel_id,
                        const Responder& respond) {
        if (!kernel.ok())
            return respond(store_unavailable(kernel.error));
        if (!visible(*kernel.value, principal))
            return respond(json_error(http::status::bad_request, "Kernel does not exist: " + kernel_id));
        JupyterSessionRecord* current = services_.sessions.find(session_id);
        if (!current)
            return respond(json_error(http::status::not_found, "Session not found: " + session_id));
        current->kernel_id = kernel_id;
        services_.sessions.save(*current);
        respond(json_response(http::status::ok, session_model(services_, *current)));
    }
    // The session named by the path, as the request's principal sees it (another tenant's is none).
    JupyterSessionRecord* visible_session(RequestContext& context) {
        JupyterSessionRecord* record = services_.sessions.find(context.param("session_id"));
        return record && context.principal.sees(record->tenant) ? record : nullptr;
    }
    static HttpResponse session_not_found(RequestContext& context) {
        return json_error(http::status::not_found, "Session not found: " + context.param("session_id"));
    }
    GatewayServices& services_;
};

}  // namespace

void register_jupyter_api(Router& router, GatewayServices& services) {
    router.add("/api", std::make_shared<ApiRootResource>());
    router.add("/api/status", std::make_shared<StatusResource>(services));
    router.add("/api/kernelspecs", std::make_shared<KernelSpecsResource>(services));
    router.add("/api/kernelspecs/{name}", std::make_shared<KernelSpecResource>(services));
    router.add("/kernelspecs/{name}/{file}", std::make_shared<KernelSpecFileResource>(services));
    router.add("/api/kernels", std::make_shared<KernelsResource>(services));
    router.add("/api/kernels/{kernel_id}", std::make_shared<KernelResource>(services));
    router.add("/api/kernels/{kernel_id}/interrupt", std::make_shared<KernelInterruptResource>(services));
    router.add("/api/kernels/{kernel_id}/restart", std::make_shared<KernelRestartResource>(services));
    router.add("/api/kernels/{kernel_id}/channels", std::make_shared<KernelChannelsResource>(services));
    router.add("/api/sessions", std::make_shared<SessionsResource>(services));
    router.add("/api/sessions/{session_id}", std::make_shared<SessionResource>(services));
}

void register_metrics_endpoint(Router& router, GatewayServices& services) {
    router.add("/metrics", std::make_shared<MetricsResource>(services.metrics.registry));
}

}  // namespace cellblock::gateway
