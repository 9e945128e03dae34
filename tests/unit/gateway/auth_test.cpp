#include "cellblock/gateway/access/auth.hpp"

#include <gtest/gtest.h>

using namespace cellblock::gateway;

namespace {
HttpRequest with_authorization(const std::string& value) {
    HttpRequest request{http::verb::get, "/api", 11};
    if (!value.empty())
        request.set(http::field::authorization, value);
    return request;
}
}  // namespace

TEST(TokenAuthenticator, AcceptsQueryTokenAndBothHeaderSchemes) {
    TokenAuthenticator auth("s3cret");
    EXPECT_TRUE(auth.authorized(with_authorization(""), {{"token", "s3cret"}}));
    EXPECT_TRUE(auth.authorized(with_authorization("token s3cret"), {}));
    EXPECT_TRUE(auth.authorized(with_authorization("Token s3cret"), {}));
    EXPECT_TRUE(auth.authorized(with_authorization("Bearer s3cret"), {}));
    EXPECT_TRUE(auth.authorized(with_authorization("bearer  s3cret "), {}));
}

TEST(TokenAuthenticator, RejectsMissingWrongAndPrefixTokens) {
    TokenAuthenticator auth("s3cret");
    EXPECT_FALSE(auth.authorized(with_authorization(""), {}));
    EXPECT_FALSE(auth.authorized(with_authorization("token wrong"), {}));
    EXPECT_FALSE(auth.authorized(with_authorization("token s3cre"), {}));
    EXPECT_FALSE(auth.authorized(with_authorization("token s3cretX"), {}));
    EXPECT_FALSE(auth.authorized(with_authorization("Basic s3cret"), {}));
    EXPECT_FALSE(auth.authorized(with_authorization("s3cret"), {}));
    EXPECT_FALSE(auth.authorized(with_authorization(""), {{"token", ""}}));
}

TEST(TokenAuthenticator, EmptyTokenDisablesAuth) {
    TokenAuthenticator auth("");
    EXPECT_FALSE(auth.enabled());
    EXPECT_TRUE(auth.authorized(with_authorization("token "), {}));  // what GatewayClient sends with no token
}

TEST(CorsPolicy, EmitsOnlyConfiguredHeaders) {
    GatewayConfig config;
    config.allow_origin = "*";
    config.max_age = "60";
    CorsPolicy cors(config);
    HttpResponse response{http::status::ok, 11};
    cors.apply(response);
    EXPECT_EQ(response[http::field::access_control_allow_origin], "*");
    EXPECT_EQ(response[http::field::access_control_max_age], "60");
    EXPECT_EQ(response.find(http::field::access_control_allow_methods), response.end());
}

TEST(CorsPolicy, OriginCheckFollowsKernelGateway) {
    GatewayConfig config;
    CorsPolicy strict(config);
    HttpRequest request{http::verb::get, "/api", 11};
    EXPECT_TRUE(strict.origin_allowed(request));  // no Origin header
    request.set(http::field::host, "127.0.0.1:8888");
    request.set(http::field::origin, "http://127.0.0.1:8888");
    EXPECT_TRUE(strict.origin_allowed(request));  // same host
    request.set(http::field::origin, "http://fake.com:8888");
    EXPECT_FALSE(strict.origin_allowed(request));
    config.allow_origin = "http://fake.com:8888";
    EXPECT_TRUE(CorsPolicy(config).origin_allowed(request));
    config.allow_origin = "*";
    EXPECT_TRUE(CorsPolicy(config).origin_allowed(request));
}
