// FileStore: one file per key under a root directory. A put writes a temp
// file in the key's directory, fsyncs it, renames it over the key and fsyncs
// the directory, so a reader (or a crash) sees the old object or the new one.
// put_if_absent link()s the temp file to the key instead: link fails with
// EEXIST rather than replacing, which makes the check-and-write one step.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/error.h"
#include "store/store.h"

namespace ls {

namespace fs = std::filesystem;

namespace {

// Temp files start with this; list() skips them and keys may not use it.
const char kTmpPrefix[] = ".lockstep-tmp.";

bool is_tmp_name(const std::string& name) { return name.rfind(kTmpPrefix, 0) == 0; }

// Process-wide, so two stores on one directory never pick the same temp name.
std::atomic<uint64_t> tmp_seq{0};

class FileStore : public ObjectStore {
 public:
  FileStore(std::string root, std::string url) : root_(std::move(root)), url_(std::move(url)) {}

  void put(const std::string& key, const void* data, size_t n) override {
    CallTimer t(this);
    check_key(key);
    const std::string path = full(key);
    const std::string tmp = write_temp(key, path, data, n);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      fail("rename", key, e);
    }
    sync_dir(key, path);
    count_put(n);
  }

  bool put_if_absent(const std::string& key, const void* data, size_t n) override {
    CallTimer t(this);
    check_key(key);
    const std::string path = full(key);
    const std::string tmp = write_temp(key, path, data, n);
    const int rc = ::link(tmp.c_str(), path.c_str());
    const int e = errno;
    ::unlink(tmp.c_str());
    if (rc != 0) {
      if (e == EEXIST) return false;
      fail("link", key, e);
    }
    sync_dir(key, path);
    count_put(n);
    return true;
  }

  std::vector<uint8_t> get(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    Fd fd = open_object(key);
    std::vector<uint8_t> out(fd.size);
    read_at(fd.fd, key, out.data(), out.size(), 0);
    count_get(out.size());
    return out;
  }

  std::vector<uint8_t> get_range(const std::string& key, uint64_t offset, uint64_t n) override {
    CallTimer t(this);
    check_key(key);
    if (n == 0) return {};
    Fd fd = open_object(key);
    if (offset > fd.size || n > fd.size - offset)
      throw StoreError(where(key) + ": range [" + std::to_string(offset) + ", +" + std::to_string(n) +
                           ") past the end of a " + std::to_string(fd.size) + "-byte object",
                       false);
    std::vector<uint8_t> out(n);
    read_at(fd.fd, key, out.data(), n, offset);
    count_ranged_get(n);
    return out;
  }

  bool exists(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    struct stat st;
    if (::stat(full(key).c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return false;
      fail("stat", key, errno);
    }
    return S_ISREG(st.st_mode);
  }

  // Temp files whose writer is gone: the pid in the name is not alive, or the
  // file is older than a day (a pid reused by another process). A live
  // writer's temp file (this process's, or a running run's) is kept.
  std::vector<Leftover> stale_leftovers() override {
    std::vector<Leftover> out;
    std::error_code ec;
    if (!fs::is_directory(root_, ec)) return out;
    const auto now = fs::file_time_type::clock::now();
    fs::recursive_directory_iterator it(root_, ec), end;
    for (; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!is_tmp_name(name) || !it->is_regular_file(ec)) continue;
      const std::string rest = name.substr(sizeof(kTmpPrefix) - 1);
      const long pid = std::strtol(rest.c_str(), nullptr, 10);
      const bool alive = pid > 0 && (::kill((pid_t)pid, 0) == 0 || errno == EPERM);
      const auto age = now - fs::last_write_time(it->path(), ec);
      if (alive && (pid == ::getpid() || age < std::chrono::hours(24))) continue;
      out.push_back({it->path().lexically_relative(root_).generic_string(), (uint64_t)fs::file_size(it->path(), ec)});
    }
    std::sort(out.begin(), out.end(), [](const Leftover& a, const Leftover& b) { return a.path < b.path; });
    return out;
  }

  void remove_leftover(const std::string& path) override {
    // Only a temp file's name, inside the root.
    const fs::path p = fs::path(path);
    if (!is_tmp_name(p.filename().string()) || path.find("..") != std::string::npos || p.is_absolute())
      throw UserError("store " + url_ + ": '" + path + "' is not a temp file of this store");
    std::error_code ec;
    fs::remove(fs::path(root_) / p, ec);
  }

  std::vector<std::string> list(const std::string& prefix) override {
    CallTimer t(this);
    check_list_prefix(url_, prefix);
    // Walk only the directory that holds every possible match.
    const size_t slash = prefix.rfind('/');
    const std::string dir = slash == std::string::npos ? "" : prefix.substr(0, slash);
    std::vector<std::string> keys;
    const fs::path base = dir.empty() ? fs::path(root_) : fs::path(root_) / dir;
    std::error_code ec;
    if (fs::is_directory(base, ec)) {
      fs::recursive_directory_iterator it(base, ec), end;
      if (ec) fail("list", prefix, ec.value());
      for (; it != end; it.increment(ec)) {
        if (ec) fail("list", prefix, ec.value());
        if (!it->is_regular_file(ec) || is_tmp_name(it->path().filename().string())) continue;
        std::string key = it->path().lexically_relative(root_).generic_string();
        if (key.compare(0, prefix.size(), prefix) != 0) continue;
        // A file whose name is no good key (a backslash, a control
        // character) is refused loudly, as S3Store refuses such a listing.
        const std::string why = object_key_problem(key);
        if (!why.empty())
          throw UserError("store " + url_ + ": listing of '" + prefix + "' holds bad key " + quote_key(key) + ": " +
                          why + "; refusing the listing (rename or remove that file)");
        keys.push_back(std::move(key));
      }
    }
    std::sort(keys.begin(), keys.end());
    count_list();
    return keys;
  }

  void remove(const std::string& key) override {
    CallTimer t(this);
    check_key(key);
    if (::unlink(full(key).c_str()) != 0 && errno != ENOENT && errno != ENOTDIR) fail("unlink", key, errno);
    // A directory goes with its last object (keep_last's rotations would
    // otherwise leave one empty step directory per checkpoint, and every
    // listing would walk them all).
    remove_empty_parents(fs::path(key).parent_path());
    count_delete();
  }

  std::vector<std::string> empty_dirs() override {
    std::vector<std::string> out;
    std::error_code ec;
    if (!fs::is_directory(root_, ec)) return out;
    fs::recursive_directory_iterator it(root_, ec), end;
    for (; !ec && it != end; it.increment(ec))
      if (it->is_directory(ec) && !it->is_symlink(ec) && fs::is_empty(it->path(), ec))
        out.push_back(it->path().lexically_relative(root_).generic_string());
    std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) { return a > b; });
    return out;
  }

  void remove_empty_dir(const std::string& path) override {
    const fs::path p = fs::path(path);
    if (path.empty() || path.find("..") != std::string::npos || p.is_absolute())
      throw UserError("store " + url_ + ": '" + path + "' is not a directory inside this store");
    remove_empty_parents(p);
  }

  std::string url() const override { return url_; }

 private:
  struct Fd {
    int fd = -1;
    uint64_t size = 0;
    Fd() = default;
    Fd(Fd&& o) noexcept : fd(o.fd), size(o.size) { o.fd = -1; }
    Fd& operator=(Fd&&) = delete;
    ~Fd() {
      if (fd >= 0) ::close(fd);
    }
  };

  std::string where(const std::string& key) const { return "store " + url_ + ": key '" + key + "'"; }

  [[noreturn]] void fail(const char* what, const std::string& key, int err) const {
    const bool transient = err == EINTR || err == EAGAIN || err == EBUSY || err == EIO;
    throw StoreError(where(key) + ": " + what + ": " + std::strerror(err), transient);
  }

  // Keys stay inside the root: the shared check (store.h), plus the temp
  // files' reserved names.
  void check_key(const std::string& key) const {
    validate_object_key(url_, key);
    for (size_t b = 0; b < key.size();) {
      size_t e = key.find('/', b);
      if (e == std::string::npos) e = key.size();
      if (is_tmp_name(key.substr(b, e - b)))
        throw UserError("store " + url_ + ": bad key " + quote_key(key) + ": reserved temp-file name");
      b = e + 1;
    }
  }

  std::string full(const std::string& key) const { return root_ + "/" + key; }

  // rmdir `dir` (relative to the root) and its parents while they are empty;
  // rmdir itself refuses a directory that is not, so a concurrent put is
  // safe (and write_temp recreates a directory removed under it).
  void remove_empty_parents(fs::path dir) const {
    for (; !dir.empty() && dir != "." && dir != "/"; dir = dir.parent_path())
      if (::rmdir((fs::path(root_) / dir).c_str()) != 0) break;
  }

  // Writes data to a fresh temp file next to `path` and fsyncs it.
  std::string write_temp(const std::string& key, const std::string& path, const void* data, size_t n) {
    const std::string parent = fs::path(path).parent_path().string();
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec) fail("mkdir", key, ec.value());
    const std::string tmp = parent + "/" + kTmpPrefix + std::to_string(::getpid()) + "." +
                            std::to_string(tmp_seq.fetch_add(1));
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    // The directory emptied and removed between the two (remove()'s rmdir): again.
    for (int i = 0; i < 3 && fd < 0 && errno == ENOENT; ++i) {
      fs::create_directories(parent, ec);
      fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    }
    if (fd < 0) fail("create temp file", key, errno);
    const char* p = static_cast<const char*>(data);
    size_t left = n;
    while (left > 0) {
      // 1 MiB writes: the kernel starts writeback while we copy, and the
      // final fsync waits for less (measured ~3x faster than one huge write).
      const ssize_t w = ::write(fd, p, std::min<size_t>(left, size_t{1} << 20));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) {
        const int e = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        fail("write", key, e);
      }
      p += w;
      left -= static_cast<size_t>(w);
    }
    if (::fsync(fd) != 0 || ::close(fd) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      fail("fsync", key, e);
    }
    return tmp;
  }

  // Makes the new directory entry durable.
  void sync_dir(const std::string& key, const std::string& path) const {
    const std::string parent = fs::path(path).parent_path().string();
    const int fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) fail("open directory", key, errno);
    const int rc = ::fsync(fd);
    const int e = errno;
    ::close(fd);
    if (rc != 0) fail("fsync directory", key, e);
  }

  Fd open_object(const std::string& key) const {
    Fd f;
    f.fd = ::open(full(key).c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (f.fd < 0) {
      if (errno == ENOENT || errno == ENOTDIR) throw StoreError(where(key) + ": no such object", false);
      fail("open", key, errno);
    }
    if (::fstat(f.fd, &st) != 0) fail("fstat", key, errno);
    if (!S_ISREG(st.st_mode)) throw StoreError(where(key) + ": no such object", false);
    f.size = static_cast<uint64_t>(st.st_size);
    return f;
  }

  void read_at(int fd, const std::string& key, uint8_t* out, size_t n, uint64_t offset) const {
    size_t got = 0;
    while (got < n) {
      const ssize_t r = ::pread(fd, out + got, n - got, static_cast<off_t>(offset + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) fail("read", key, errno);
      if (r == 0) throw StoreError(where(key) + ": object shrank while being read", true);
      got += static_cast<size_t>(r);
    }
  }

  std::string root_, url_;
};

}  // namespace

std::unique_ptr<ObjectStore> make_file_store(const std::string& root, const std::string& url) {
  std::string r = root;
  while (r.size() > 1 && r.back() == '/') r.pop_back();
  return std::make_unique<FileStore>(r, url);
}

}  // namespace ls
