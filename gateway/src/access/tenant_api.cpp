#include "cellblock/gateway/access/tenant_api.hpp"

namespace cellblock::gateway {

using nlohmann::json;

namespace {

HttpResponse refusal(const TenantRequestError& error) {
    const http::status status = error.kind() == TenantRequestError::Kind::exists ? http::status::conflict
                                : error.kind() == TenantRequestError::Kind::not_found
                                    ? http::status::not_found
                                    : http::status::bad_request;
    json body = {{"reason", error.reason()}, {"message", error.what()}};
    if (!error.field().empty())
        body["field"] = error.field();
    return json_response(status, body);
}

json token_json(const TenantToken& token) {
    return {{"id", token.id}, {"role", token.role}, {"created", token.created}};
}

json issued_json(const TenantDirectory::IssuedToken& issued) {
    json model = token_json(issued.record);
    model["token"] = issued.token;
    return model;
}

// Every handler of this API: the operator only (tenant tokens are refused before dispatch today; this
// holds when routes start serving them), refusals as {reason, message, field}, and the answer sent once
// what changed is in the store.
class TenantResource : public RestResource {
  public:
    TenantResource(GatewayServices& services, TenantDirectory& tenants)
        : services_(services), tenants_(tenants) {}

  protected:
    template <class Body>
    void answer(RequestContext& context, Responder respond, Body&& body) {
        if (!context.principal.is_operator())
            return respond(operator_only());
        std::optional<HttpResponse> response;
        try {
            response = body();
        } catch (const TenantRequestError& error) {
            return respond(refusal(error));
        }
        services_.writer.after_pending(
            [respond = std::move(respond), response = std::move(*response)]() mutable {
                respond(std::move(response));
            });
    }
    static json body_of(RequestContext& context) {
        try {
            return context.json_body();
        } catch (const HttpError& error) {
            throw TenantRequestError(TenantRequestError::Kind::malformed, "bad_json", error.what());
        }
    }
    // answer() for one tenant's model (the tenant `body` finds or changes), with its tokens and its `usage`
    // counted through every gateway of a shared store (tenant_quotas.hpp; null when the store did not
    // answer).
    template <class Body>
    void answer_tenant(RequestContext& context, Responder respond, Body&& body) {
        if (!context.principal.is_operator())
            return respond(operator_only());
        json model;
        try {
            model = with_tokens(body());
        } catch (const TenantRequestError& error) {
            return respond(refusal(error));
        }
        services_.writer.after_pending(
            [this, model = std::move(model), respond = std::move(respond)]() mutable {
                const std::string name = model["name"].get<std::string>();
                services_.quotas.usage_everywhere(
                    name, [model = std::move(model), respond](const StoreAnswer<TenantUsage>& usage) mutable {
                        model["usage"] = usage.ok() ? usage.value->to_json() : json(nullptr);
                        respond(json_response(http::status::ok, model));
                    });
            });
    }
    static HttpResponse operator_only() {
        return json_error(http::status::forbidden, "only the operator manages tenants", "operator_only");
    }
    json with_tokens(const Tenant& tenant) const {
        json model = tenant.to_json();
        model["tokens"] = json::array();
        for (const auto& token : tenants_.tokens_of(tenant.name))
            model["tokens"].push_back(token_json(token));
        return model;
    }
    GatewayServices& services_;
    TenantDirectory& tenants_;
};

class TenantsResource : public TenantResource {
  public:
    using TenantResource::TenantResource;
    std::string allowed_methods() const override { return "GET, POST, OPTIONS"; }
    void get(RequestContext& context, Responder respond) override {
        answer(context, std::move(respond), [&] {
            json list = json::array();
            for (const Tenant& tenant : tenants_.list())
                list.push_back(tenant.to_json());
            return json_response(http::status::ok, {{"tenants", list}});
        });
    }
    void post(RequestContext& context, Responder respond) override {
        answer(context, std::move(respond), [&] {
            auto [tenant, issued] = tenants_.add(body_of(context));
            json model = tenant.to_json();
            model["token"] = issued.token;
            model["token_id"] = issued.record.id;
            HttpResponse response = json_response(http::status::created, model);
            response.set(http::field::location, context.base_url + "agent/v1/tenants/" + tenant.name);
            return response;
        });
    }
};

class TenantItemResource : public TenantResource {
  public:
    TenantItemResource(GatewayServices& services, TenantDirectory& tenants, TenantSessionsEnd end_sessions)
        : TenantResource(services, tenants), end_sessions_(std::move(end_sessions)) {}
    std::string allowed_methods() const override { return "GET, PATCH, DELETE, OPTIONS"; }
    void get(RequestContext& context, Responder respond) override {
        answer_tenant(context, std::move(respond),
                      [&]() -> const Tenant& { return tenants_.get(context.param("tenant")); });
    }
    void patch(RequestContext& context, Responder respond) override {
        answer_tenant(context, std::move(respond), [&]() -> const Tenant& {
            return tenants_.set_quota(context.param("tenant"), body_of(context));
        });
    }
    void delete_(RequestContext& context, Responder respond) override {
        answer(context, std::move(respond), [&] {
            const std::string name = context.param("tenant");
            tenants_.remove(name);
            end_sessions_(name);
            for (const auto& kernel : services_.kernels.list())
                if (kernel->tenant() == name)
                    services_.kernels.shutdown_kernel(kernel->id(), "its tenant was removed");
            return empty_response(http::status::no_content);
        });
    }

  private:
    TenantSessionsEnd end_sessions_;
};

class TenantTokensResource : public TenantResource {
  public:
    using TenantResource::TenantResource;
    std::string allowed_methods() const override { return "POST, OPTIONS"; }
    void post(RequestContext& context, Responder respond) override {
        answer(context, std::move(respond), [&] {
            const std::string& name = context.param("tenant");
            tenants_.get(name);  // an unknown tenant is 404 before a malformed body is 400
            return json_response(http::status::created,
                                 issued_json(tenants_.issue_token(name, body_of(context))));
        });
    }
};

class TenantTokenResource : public TenantResource {
  public:
    using TenantResource::TenantResource;
    std::string allowed_methods() const override { return "DELETE, OPTIONS"; }
    void delete_(RequestContext& context, Responder respond) override {
        answer(context, std::move(respond), [&] {
            tenants_.revoke_token(context.param("tenant"), context.param("token"));
            return empty_response(http::status::no_content);
        });
    }
};

}  // namespace

void register_tenant_api(Router& router, GatewayServices& services, TenantDirectory& tenants,
                         TenantSessionsEnd end_sessions) {
    router.add("/agent/v1/tenants", std::make_shared<TenantsResource>(services, tenants));
    router.add("/agent/v1/tenants/{tenant}",
               std::make_shared<TenantItemResource>(services, tenants, std::move(end_sessions)));
    router.add("/agent/v1/tenants/{tenant}/tokens",
               std::make_shared<TenantTokensResource>(services, tenants));
    router.add("/agent/v1/tenants/{tenant}/tokens/{token}",
               std::make_shared<TenantTokenResource>(services, tenants));
}

}  // namespace cellblock::gateway
