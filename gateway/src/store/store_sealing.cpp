#include "cellblock/gateway/store/store_sealing.hpp"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "cellblock/contract/message_signer.hpp"
#include "cellblock/gateway/common/crypto.hpp"

namespace cellblock::gateway {

namespace {

constexpr std::string_view sealed_prefix = "sealed:v1:";
constexpr std::size_t nonce_bytes = 12;
constexpr std::size_t tag_bytes = 16;

using CipherContext = std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)>;

CipherContext new_context() {
    CipherContext context(EVP_CIPHER_CTX_new(), &EVP_CIPHER_CTX_free);
    if (!context)
        throw StoreError("EVP_CIPHER_CTX_new failed");
    return context;
}

const unsigned char* bytes_of(std::string_view text) {
    return reinterpret_cast<const unsigned char*>(text.data());
}

int length_of(std::string_view text) {
    return static_cast<int>(text.size());
}

std::array<unsigned char, StoreSecret::size> parse_hex(const std::string& text,
                                                       const std::filesystem::path& file) {
    std::array<unsigned char, StoreSecret::size> bytes{};
    if (text.size() != 2 * StoreSecret::size)
        throw StoreError(file.string() + " does not hold a store secret (64 hex digits)");
    for (std::size_t i = 0; i < bytes.size(); ++i) {
        unsigned value = 0;
        for (char c : text.substr(2 * i, 2)) {
            const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            if (digit < 0)
                throw StoreError(file.string() + " does not hold a store secret (64 hex digits)");
            value = value * 16 + static_cast<unsigned>(digit);
        }
        bytes[i] = static_cast<unsigned char>(value);
    }
    return bytes;
}

void write_new_secret(const std::filesystem::path& file) {
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        throw StoreError("cannot create the store secret " + file.string() + ": " + std::strerror(errno));
    const std::string text = random_hex(StoreSecret::size) + "\n";
    const ssize_t written = ::write(fd, text.data(), text.size());
    const bool synced = ::fsync(fd) == 0;
    ::close(fd);
    if (written != static_cast<ssize_t>(text.size()) || !synced)
        throw StoreError("cannot write the store secret " + file.string());
}

}  // namespace

StoreSecret StoreSecret::load(const std::filesystem::path& file, bool create) {
    if (create && !std::filesystem::exists(file))
        write_new_secret(file);
    std::ifstream input(file);
    if (!input)
        throw StoreError("cannot read the store secret " + file.string());
    std::string text;
    std::getline(input, text);
    return StoreSecret(parse_hex(text, file));
}

bool StoreSecret::is_sealed(std::string_view text) {
    return text.starts_with(sealed_prefix);
}

std::string StoreSecret::seal(std::string_view plain, std::string_view associated) const {
    std::string nonce(nonce_bytes, '\0');
    if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) != 1)
        throw StoreError("RAND_bytes failed");
    auto context = new_context();
    std::string cipher(plain.size(), '\0');
    int length = 0;
    std::string tag(tag_bytes, '\0');
    const bool ok =
        EVP_EncryptInit_ex(context.get(), EVP_aes_256_gcm(), nullptr, bytes_.data(), bytes_of(nonce)) == 1 &&
        EVP_EncryptUpdate(context.get(), nullptr, &length, bytes_of(associated), length_of(associated)) ==
            1 &&
        EVP_EncryptUpdate(context.get(), reinterpret_cast<unsigned char*>(cipher.data()), &length,
                          bytes_of(plain), length_of(plain)) == 1 &&
        EVP_EncryptFinal_ex(context.get(), nullptr, &length) == 1 &&
        EVP_CIPHER_CTX_ctrl(context.get(), EVP_CTRL_GCM_GET_TAG, static_cast<int>(tag_bytes), tag.data()) ==
            1;
    if (!ok)
        throw StoreError("sealing a key failed (AES-256-GCM)");
    return std::string(sealed_prefix) + base64_encode(nonce + cipher + tag);
}

std::string StoreSecret::open(std::string_view sealed, std::string_view associated) const {
    if (!is_sealed(sealed))
        return std::string(sealed);
    const auto raw = base64_decode(sealed.substr(sealed_prefix.size()));
    if (!raw || raw->size() < nonce_bytes + tag_bytes)
        throw StoreError("a sealed key in the store is malformed");
    const std::string_view all(*raw);
    const std::string_view nonce = all.substr(0, nonce_bytes);
    const std::string_view cipher = all.substr(nonce_bytes, all.size() - nonce_bytes - tag_bytes);
    std::string tag(all.substr(all.size() - tag_bytes));
    auto context = new_context();
    std::string plain(cipher.size(), '\0');
    int length = 0;
    const bool ok =
        EVP_DecryptInit_ex(context.get(), EVP_aes_256_gcm(), nullptr, bytes_.data(), bytes_of(nonce)) == 1 &&
        EVP_DecryptUpdate(context.get(), nullptr, &length, bytes_of(associated), length_of(associated)) ==
            1 &&
        EVP_DecryptUpdate(context.get(), reinterpret_cast<unsigned char*>(plain.data()), &length,
                          bytes_of(cipher), length_of(cipher)) == 1 &&
        EVP_CIPHER_CTX_ctrl(context.get(), EVP_CTRL_GCM_SET_TAG, static_cast<int>(tag_bytes), tag.data()) ==
            1 &&
        EVP_DecryptFinal_ex(context.get(), nullptr, &length) == 1;
    if (!ok)
        throw StoreError(
            "a kernel key in the store was sealed under another store secret (every gateway on a "
            "shared store needs the same --store-key-file) or was altered");
    return plain;
}

std::string StoreSecret::token_digest(std::string_view token) const {
    // A key of its own for tokens (HMAC of a fixed label under the secret): the sealing key is never used
    // for anything else.
    constexpr std::string_view label = "cellblock tenant token digest v1";
    std::array<unsigned char, EVP_MAX_MD_SIZE> key{}, digest{};
    unsigned int key_length = 0, digest_length = 0;
    if (!HMAC(EVP_sha256(), bytes_.data(), static_cast<int>(bytes_.size()), bytes_of(label), label.size(),
              key.data(), &key_length) ||
        !HMAC(EVP_sha256(), key.data(), static_cast<int>(key_length), bytes_of(token), token.size(),
              digest.data(), &digest_length))
        throw StoreError("HMAC-SHA256 of a token failed");
    return contract::to_hex({digest.data(), digest_length});
}

namespace {

// Forwards everything to the store it wraps; only kernel records pass through the secret.
class SealingStore final : public SessionStore {
  public:
    SealingStore(std::unique_ptr<SessionStore> inner, StoreSecret secret)
        : inner_(std::move(inner)), secret_(secret) {}

    void put_kernel(const KernelRecord& kernel) override {
        KernelRecord sealed = kernel;
        if (!StoreSecret::is_sealed(sealed.key))
            sealed.key = secret_.seal(kernel.key, kernel.id);
        inner_->put_kernel(sealed);
    }
    std::vector<KernelRecord> kernels() override {
        auto records = inner_->kernels();
        for (auto& record : records)
            record.key = secret_.open(record.key, record.id);
        return records;
    }
    std::optional<KernelRecord> kernel(const std::string& kernel_id) override {
        auto record = inner_->kernel(kernel_id);
        if (record)
            record->key = secret_.open(record->key, record->id);
        return record;
    }
    void write_batch(const std::vector<std::function<void(SessionStore&)>>& writes,
                     const std::function<void(const std::exception&)>& on_failure) override {
        // Each write sees this store, so a put_kernel inside the batch is sealed too.
        std::vector<std::function<void(SessionStore&)>> through_this;
        through_this.reserve(writes.size());
        for (const auto& write : writes)
            through_this.emplace_back([this, &write](SessionStore&) { write(*this); });
        inner_->write_batch(through_this, on_failure);
    }

    void remove_kernel(const std::string& id) override { inner_->remove_kernel(id); }
    void set_kernel_progress(const std::string& id, const std::string& last) override {
        inner_->set_kernel_progress(id, last);
    }
    void set_kernel_activity(const std::string& id, const std::string& last) override {
        inner_->set_kernel_activity(id, last);
    }
    void put_jupyter_session(const std::string& id, const nlohmann::json& model) override {
        inner_->put_jupyter_session(id, model);
    }
    void remove_jupyter_session(const std::string& id) override { inner_->remove_jupyter_session(id); }
    std::vector<nlohmann::json> jupyter_sessions() override { return inner_->jupyter_sessions(); }
    void put_agent_session(const nlohmann::json& record) override { inner_->put_agent_session(record); }
    std::vector<nlohmann::json> agent_sessions() override { return inner_->agent_sessions(); }
    std::optional<nlohmann::json> agent_session(const std::string& id) override {
        return inner_->agent_session(id);
    }
    void append_cell(const std::string& session, const nlohmann::json& cell) override {
        inner_->append_cell(session, cell);
    }
    void clear_cells(const std::string& session) override { inner_->clear_cells(session); }
    std::vector<nlohmann::json> cells(const std::string& session) override { return inner_->cells(session); }
    std::size_t purge_deleted_agent_sessions(const std::string& before) override {
        return inner_->purge_deleted_agent_sessions(before);
    }
    void put_inflight(const InflightExecute& execute) override { inner_->put_inflight(execute); }
    void remove_inflight(const std::string& session, const std::string& msg_id) override {
        inner_->remove_inflight(session, msg_id);
    }
    std::vector<InflightExecute> inflight(const std::string& session) override {
        return inner_->inflight(session);
    }
    void append_audit(const nlohmann::json& entry) override { inner_->append_audit(entry); }
    std::vector<nlohmann::json> audit(const AuditQuery& query) override { return inner_->audit(query); }
    void put_tenant(const nlohmann::json& tenant) override { inner_->put_tenant(tenant); }
    void remove_tenant(const std::string& name) override { inner_->remove_tenant(name); }
    std::vector<nlohmann::json> tenants() override { return inner_->tenants(); }
    void put_tenant_token(const TenantToken& token) override { inner_->put_tenant_token(token); }
    void remove_tenant_token(const std::string& id) override { inner_->remove_tenant_token(id); }
    std::vector<TenantToken> tenant_tokens() override { return inner_->tenant_tokens(); }
    bool shared() const override { return inner_->shared(); }
    std::optional<std::int64_t> try_lease(const std::string& name) override {
        return inner_->try_lease(name);
    }
    void release_lease(const std::string& name) override { inner_->release_lease(name); }
    bool holds_lease(const std::string& name) override { return inner_->holds_lease(name); }
    std::unique_ptr<LeaseReleases> listen_for_lease_releases() override {
        return inner_->listen_for_lease_releases();
    }
    bool append_cell_fenced(const std::string& session, const nlohmann::json& cell,
                            const LeaseFence& fence) override {
        return inner_->append_cell_fenced(session, cell, fence);
    }
    bool put_inflight_fenced(const InflightExecute& execute, const LeaseFence& fence) override {
        return inner_->put_inflight_fenced(execute, fence);
    }

  private:
    std::unique_ptr<SessionStore> inner_;
    StoreSecret secret_;
};

}  // namespace

std::unique_ptr<SessionStore> seal_kernel_keys(std::unique_ptr<SessionStore> store, StoreSecret secret) {
    return std::make_unique<SealingStore>(std::move(store), secret);
}

}  // namespace cellblock::gateway
