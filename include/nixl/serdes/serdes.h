/*
 * serdes/serdes.h - gixl's C++ drop-in for NVIDIA NIXL 1.5.x: nixlSerDes, a tagged byte-string writer and
 * reader used to serialize descriptor lists.
 *
 * gixl's own format (not NIXL's bytes): "GXSD1" then, per entry, the tag's length (4 bytes, little endian),
 * the tag, the value's length (8 bytes, little endian) and the value. Entries are read back in the order they
 * were added; asking for a tag other than the next one's is an error and does not move the cursor.
 */
#ifndef _NIXL_SERDES_H
#define _NIXL_SERDES_H

#include <cstdint>
#include <cstring>
#include <string>
#include <sys/types.h>

#include "../nixl_types.h"

class nixlSerDes {
private:
    std::string buf_;
    size_t cursor_;
    // Whether the last call wrote (0) or read (1); also keeps the object NIXL's size (48 bytes).
    int mode_;

#ifndef GIXL_NIXL_ORACLE
    static constexpr const char *kMagic = "GXSD1";
    static constexpr size_t kMagicLen = 5;

    static void
    putLe(std::string &out, uint64_t v, int n) {
        for (int i = 0; i < n; i++) {
            out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
        }
    }

    bool
    getLe(size_t at, int n, uint64_t &v) const {
        if (at > buf_.size() || buf_.size() - at < static_cast<size_t>(n)) {
            return false;
        }
        v = 0;
        for (int i = 0; i < n; i++) {
            v |= static_cast<uint64_t>(static_cast<unsigned char>(buf_[at + i])) << (8 * i);
        }
        return true;
    }

    // The next entry if its tag is `tag`: where its value starts and how long it is.
    bool
    peek(const std::string &tag, size_t &value_at, size_t &value_len, size_t &next) const {
        uint64_t tag_len = 0;
        uint64_t len = 0;
        size_t at = cursor_;
        if (!getLe(at, 4, tag_len)) return false;
        at += 4;
        if (buf_.size() - at < tag_len) return false;
        if (buf_.compare(at, tag_len, tag) != 0 || tag_len != tag.size()) return false;
        at += tag_len;
        if (!getLe(at, 8, len)) return false;
        at += 8;
        if (buf_.size() - at < len) return false;
        value_at = at;
        value_len = static_cast<size_t>(len);
        next = at + len;
        return true;
    }
#endif

public:
    nixlSerDes();

    // Appends an entry.
    nixl_status_t
    addStr(const std::string &tag, const std::string &str);
    // The next entry's value if its tag is `tag` (and moves past it); "" otherwise.
    std::string
    getStr(const std::string &tag);

    nixl_status_t
    addBuf(const std::string &tag, const void *buf, ssize_t len);
    // The next entry's length if its tag is `tag`, else -1.
    ssize_t
    getBufLen(const std::string &tag) const;
    // Copies the next entry's value into `buf` if its tag is `tag` and its length is `len`.
    nixl_status_t
    getBuf(const std::string &tag, void *buf, ssize_t len);

    std::string
    exportStr() const;
    // Replaces the contents with `sdbuf` (an exportStr() result) and rewinds; MISMATCH if it is not one.
    nixl_status_t
    importStr(const std::string &sdbuf);
};

#ifndef GIXL_NIXL_ORACLE
inline nixlSerDes::nixlSerDes() : buf_(kMagic, kMagicLen), cursor_(kMagicLen), mode_(0) {}

inline nixl_status_t
nixlSerDes::addStr(const std::string &tag, const std::string &str) {
    return addBuf(tag, str.data(), static_cast<ssize_t>(str.size()));
}

inline std::string
nixlSerDes::getStr(const std::string &tag) {
    size_t at = 0, len = 0, next = 0;
    if (!peek(tag, at, len, next)) return std::string();
    cursor_ = next;
    return buf_.substr(at, len);
}

inline nixl_status_t
nixlSerDes::addBuf(const std::string &tag, const void *buf, ssize_t len) {
    if (len < 0 || (len > 0 && buf == nullptr) || tag.size() > UINT32_MAX) return NIXL_ERR_INVALID_PARAM;
    mode_ = 0;
    putLe(buf_, tag.size(), 4);
    buf_.append(tag);
    putLe(buf_, static_cast<uint64_t>(len), 8);
    if (len > 0) buf_.append(static_cast<const char *>(buf), static_cast<size_t>(len));
    return NIXL_SUCCESS;
}

inline ssize_t
nixlSerDes::getBufLen(const std::string &tag) const {
    size_t at = 0, len = 0, next = 0;
    if (!peek(tag, at, len, next)) return -1;
    return static_cast<ssize_t>(len);
}

inline nixl_status_t
nixlSerDes::getBuf(const std::string &tag, void *buf, ssize_t len) {
    size_t at = 0, n = 0, next = 0;
    if (!peek(tag, at, n, next) || len < 0 || static_cast<size_t>(len) != n) return NIXL_ERR_MISMATCH;
    if (n > 0) {
        if (buf == nullptr) return NIXL_ERR_INVALID_PARAM;
        std::memcpy(buf, buf_.data() + at, n);
    }
    cursor_ = next;
    mode_ = 1;
    return NIXL_SUCCESS;
}

inline std::string
nixlSerDes::exportStr() const {
    return buf_;
}

inline nixl_status_t
nixlSerDes::importStr(const std::string &sdbuf) {
    if (sdbuf.size() < kMagicLen || sdbuf.compare(0, kMagicLen, kMagic) != 0) return NIXL_ERR_MISMATCH;
    buf_ = sdbuf;
    cursor_ = kMagicLen;
    mode_ = 1;
    return NIXL_SUCCESS;
}
#endif

#endif
