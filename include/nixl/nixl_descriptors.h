/*
 * nixl_descriptors.h - gixl's C++ drop-in for NVIDIA NIXL 1.5.x: descriptors and descriptor lists.
 *
 * Plain C++ values (no gixl handle inside): the agent converts a list to gixl's C lists when it is passed
 * to a call. Serialization uses gixl's own nixlSerDes format.
 */
#ifndef _NIXL_DESCRIPTORS_H
#define _NIXL_DESCRIPTORS_H

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "nixl_types.h"
#include "serdes/serdes.h"

// One contiguous range: an address (or offset) of a device (or block, file, object).
class nixlBasicDesc {
public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;

    // Leaves the fields uninitialized, as NIXL.
    nixlBasicDesc() {};
    nixlBasicDesc(const uintptr_t &addr, const size_t &len, const uint64_t &dev_id);
    // From serialize()'s output; a blob of the wrong size gives a zero descriptor.
    nixlBasicDesc(const nixl_blob_t &str);
    nixlBasicDesc(const nixlBasicDesc &desc) = default;
    nixlBasicDesc &
    operator=(const nixlBasicDesc &desc) = default;
    ~nixlBasicDesc() = default;

    // Ordered by devId, then addr, then len.
    bool
    operator<(const nixlBasicDesc &desc) const noexcept {
        if (devId != desc.devId) return devId < desc.devId;
        if (addr != desc.addr) return addr < desc.addr;
        return len < desc.len;
    }

    friend bool
    operator==(const nixlBasicDesc &lhs, const nixlBasicDesc &rhs);
    friend bool
    operator!=(const nixlBasicDesc &lhs, const nixlBasicDesc &rhs);

    // Whether `query` lies inside this range, on the same device.
    bool
    covers(const nixlBasicDesc &query) const noexcept {
        if (devId != query.devId || addr > query.addr) return false;
        const uintptr_t top = std::numeric_limits<uintptr_t>::max();
        if (len == SIZE_MAX) return query.len <= top - query.addr;
        const uintptr_t end = addr + len;
        return query.addr <= end && query.len <= end - query.addr;
    }

    bool
    overlaps(const nixlBasicDesc &query) const;
    nixl_blob_t
    serialize() const;
    void
    print(const std::string &suffix) const;
};

// A run of `count` blocks of `len` bytes whose starts are `stride` bytes apart.
struct nixlStrideDesc : public nixlBasicDesc {
    size_t stride = 0;
    size_t count = 0;

    using nixlBasicDesc::nixlBasicDesc;

    nixlStrideDesc() = default;

    nixlStrideDesc(const uintptr_t &addr,
                   const size_t &len,
                   const uint64_t &dev_id,
                   const size_t &stride,
                   const size_t &count)
        : nixlBasicDesc(addr, len, dev_id),
          stride(stride),
          count(count) {}

    friend bool
    operator==(const nixlStrideDesc &lhs, const nixlStrideDesc &rhs) {
        return static_cast<const nixlBasicDesc &>(lhs) == static_cast<const nixlBasicDesc &>(rhs) &&
            lhs.stride == rhs.stride && lhs.count == rhs.count;
    }

    friend bool
    operator!=(const nixlStrideDesc &lhs, const nixlStrideDesc &rhs) {
        return !(lhs == rhs);
    }
};

// A registration descriptor: a range plus backend metadata (e.g. a file path for FILE_SEG).
class nixlBlobDesc : public nixlBasicDesc {
public:
    nixl_blob_t metaInfo;

    using nixlBasicDesc::nixlBasicDesc;

    nixlBlobDesc(const uintptr_t &addr, const size_t &len, const uint64_t &dev_id, const nixl_blob_t &meta_info);
    nixlBlobDesc(const nixlBasicDesc &desc, const nixl_blob_t &meta_info);
    nixlBlobDesc(const nixl_blob_t &str);

    friend bool
    operator==(const nixlBlobDesc &lhs, const nixlBlobDesc &rhs);
    nixl_blob_t
    serialize() const;
    void
    print(const std::string &suffix) const;
};

// A range of a named remote agent (for prepMemView).
struct nixlRemoteDesc : public nixlBasicDesc {
    std::string remoteAgent;

    using nixlBasicDesc::nixlBasicDesc;

    nixlRemoteDesc(const uintptr_t addr, const size_t len, const uint64_t dev_id, const std::string &remote_agent);
    nixlRemoteDesc(const nixlBasicDesc &desc, const std::string &remote_agent);
    explicit nixlRemoteDesc(const nixl_blob_t &str);

    nixl_blob_t
    serialize() const;
};

bool
operator==(const nixlRemoteDesc &lhs, const nixlRemoteDesc &rhs);

// A list of descriptors of one memory type, kept in the order added.
template<class T> class nixlDescList {
protected:
    nixl_mem_t type;
    std::vector<T> descs;

public:
    // `init_size` default-constructed descriptors.
    nixlDescList(const nixl_mem_t &type, const int &init_size = 0);
    // Reads a list written by serialize(); on malformed input the list is empty (DRAM_SEG).
    nixlDescList(nixlSerDes *deserializer);
    nixlDescList(const nixlDescList<T> &d_list) = default;
    nixlDescList &
    operator=(const nixlDescList<T> &d_list) = default;
    virtual ~nixlDescList() = default;

    inline nixl_mem_t
    getType() const {
        return type;
    }

    inline int
    descCount() const {
        return static_cast<int>(descs.size());
    }

    bool
    isEmpty() const noexcept {
        return descs.empty();
    }

    const T &
    operator[](size_t index) const {
        return descs[index];
    }

    T &
    operator[](size_t index) {
        return descs[index];
    }

    inline typename std::vector<T>::const_iterator
    begin() const {
        return descs.begin();
    }

    inline typename std::vector<T>::const_iterator
    end() const {
        return descs.end();
    }

    inline typename std::vector<T>::iterator
    begin() {
        return descs.begin();
    }

    inline typename std::vector<T>::iterator
    end() {
        return descs.end();
    }

    template<class Y>
    friend bool
    operator==(const nixlDescList<Y> &lhs, const nixlDescList<Y> &rhs);

    virtual void
    resize(const size_t &count);

    inline void
    reserve(size_t count) {
        descs.reserve(count);
    }

    inline void
    clear() {
        descs.clear();
    }

    virtual void
    addDesc(const T &desc);

    template<class... Args>
    T &
    emplace(Args &&...args) {
        return descs.emplace_back(std::forward<Args>(args)...);
    }

    // Throws std::out_of_range for an index outside the list.
    void
    remDesc(const int &index);

    // The same list without metadata.
    nixlDescList<nixlBasicDesc>
    trim() const;

    // The index of the first descriptor whose range equals `query`, or NIXL_ERR_NOT_FOUND.
    virtual int
    getIndex(const nixlBasicDesc &query) const;

    nixl_status_t
    serialize(nixlSerDes *serializer) const;

    void
    print() const;

    std::string
    to_string(bool compact = false) const;
};

using nixl_xfer_dlist_t = nixlDescList<nixlBasicDesc>;
using nixl_stride_dlist_t = nixlDescList<nixlStrideDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;
using nixl_remote_dlist_t = nixlDescList<nixlRemoteDesc>;
using nixl_local_dlist_t = nixlDescList<nixlBasicDesc>;

#ifndef GIXL_NIXL_ORACLE

namespace gixl_detail {
// The 24 bytes of a range: addr, len, devId in native byte order (serialized lists stay on one machine).
inline void
putRange(std::string &out, const nixlBasicDesc &d) {
    const uint64_t v[3] = {static_cast<uint64_t>(d.addr), static_cast<uint64_t>(d.len), d.devId};
    out.append(reinterpret_cast<const char *>(v), sizeof(v));
}

inline bool
getRange(const std::string &in, nixlBasicDesc &d) {
    uint64_t v[3];
    if (in.size() < sizeof(v)) return false;
    std::memcpy(v, in.data(), sizeof(v));
    d.addr = static_cast<uintptr_t>(v[0]);
    d.len = static_cast<size_t>(v[1]);
    d.devId = v[2];
    return true;
}

inline constexpr size_t kRangeBytes = 24;

// What follows the range in each descriptor type's serialized form.
inline std::string
extra(const nixlBasicDesc &) {
    return std::string();
}
inline std::string
extra(const nixlBlobDesc &d) {
    return d.metaInfo;
}
inline std::string
extra(const nixlRemoteDesc &d) {
    return d.remoteAgent;
}
inline std::string
extra(const nixlStrideDesc &d) {
    const uint64_t v[2] = {d.stride, d.count};
    return std::string(reinterpret_cast<const char *>(v), sizeof(v));
}

inline bool
setExtra(nixlBasicDesc &, const std::string &rest) {
    return rest.empty();
}
inline bool
setExtra(nixlBlobDesc &d, const std::string &rest) {
    d.metaInfo = rest;
    return true;
}
inline bool
setExtra(nixlRemoteDesc &d, const std::string &rest) {
    d.remoteAgent = rest;
    return true;
}
inline bool
setExtra(nixlStrideDesc &d, const std::string &rest) {
    uint64_t v[2];
    if (rest.size() != sizeof(v)) return false;
    std::memcpy(v, rest.data(), sizeof(v));
    d.stride = v[0];
    d.count = v[1];
    return true;
}

inline std::string
describe(const nixlBasicDesc &d) {
    std::ostringstream s;
    s << "(0x" << std::hex << d.addr << std::dec << ", " << d.len << ", " << d.devId << ")";
    return s.str();
}
inline std::string
describeExtra(const nixlBasicDesc &) {
    return std::string();
}
inline std::string
describeExtra(const nixlBlobDesc &d) {
    return " meta " + std::to_string(d.metaInfo.size()) + " bytes";
}
inline std::string
describeExtra(const nixlRemoteDesc &d) {
    return " agent " + d.remoteAgent;
}
inline std::string
describeExtra(const nixlStrideDesc &d) {
    return " stride " + std::to_string(d.stride) + " count " + std::to_string(d.count);
}
} // namespace gixl_detail

inline nixlBasicDesc::nixlBasicDesc(const uintptr_t &addr, const size_t &len, const uint64_t &dev_id)
    : addr(addr),
      len(len),
      devId(dev_id) {}

inline nixlBasicDesc::nixlBasicDesc(const nixl_blob_t &str) : addr(0), len(0), devId(0) {
    if (str.size() == gixl_detail::kRangeBytes) gixl_detail::getRange(str, *this);
}

inline bool
operator==(const nixlBasicDesc &lhs, const nixlBasicDesc &rhs) {
    return lhs.addr == rhs.addr && lhs.len == rhs.len && lhs.devId == rhs.devId;
}

inline bool
operator!=(const nixlBasicDesc &lhs, const nixlBasicDesc &rhs) {
    return !(lhs == rhs);
}

inline bool
nixlBasicDesc::overlaps(const nixlBasicDesc &query) const {
    if (devId != query.devId) return false;
    // Half-open ranges [addr, addr + len); computed without overflow.
    if (addr <= query.addr) return query.addr - addr < len;
    return addr - query.addr < query.len;
}

inline nixl_blob_t
nixlBasicDesc::serialize() const {
    std::string out;
    gixl_detail::putRange(out, *this);
    return out;
}

inline void
nixlBasicDesc::print(const std::string &suffix) const {
    std::cout << "desc " << suffix << " " << gixl_detail::describe(*this) << "\n";
}

inline nixlBlobDesc::nixlBlobDesc(const uintptr_t &addr,
                                  const size_t &len,
                                  const uint64_t &dev_id,
                                  const nixl_blob_t &meta_info)
    : nixlBasicDesc(addr, len, dev_id),
      metaInfo(meta_info) {}

inline nixlBlobDesc::nixlBlobDesc(const nixlBasicDesc &desc, const nixl_blob_t &meta_info)
    : nixlBasicDesc(desc),
      metaInfo(meta_info) {}

inline nixlBlobDesc::nixlBlobDesc(const nixl_blob_t &str) : nixlBasicDesc(0, 0, 0) {
    if (gixl_detail::getRange(str, *this)) metaInfo = str.substr(gixl_detail::kRangeBytes);
}

inline bool
operator==(const nixlBlobDesc &lhs, const nixlBlobDesc &rhs) {
    return static_cast<const nixlBasicDesc &>(lhs) == static_cast<const nixlBasicDesc &>(rhs) &&
        lhs.metaInfo == rhs.metaInfo;
}

inline nixl_blob_t
nixlBlobDesc::serialize() const {
    return nixlBasicDesc::serialize() + metaInfo;
}

inline void
nixlBlobDesc::print(const std::string &suffix) const {
    std::cout << "desc " << suffix << " " << gixl_detail::describe(*this) << gixl_detail::describeExtra(*this)
              << "\n";
}

inline nixlRemoteDesc::nixlRemoteDesc(const uintptr_t addr,
                                      const size_t len,
                                      const uint64_t dev_id,
                                      const std::string &remote_agent)
    : nixlBasicDesc(addr, len, dev_id),
      remoteAgent(remote_agent) {}

inline nixlRemoteDesc::nixlRemoteDesc(const nixlBasicDesc &desc, const std::string &remote_agent)
    : nixlBasicDesc(desc),
      remoteAgent(remote_agent) {}

inline nixlRemoteDesc::nixlRemoteDesc(const nixl_blob_t &str) : nixlBasicDesc(0, 0, 0) {
    if (gixl_detail::getRange(str, *this)) remoteAgent = str.substr(gixl_detail::kRangeBytes);
}

inline nixl_blob_t
nixlRemoteDesc::serialize() const {
    return nixlBasicDesc::serialize() + remoteAgent;
}

inline bool
operator==(const nixlRemoteDesc &lhs, const nixlRemoteDesc &rhs) {
    return static_cast<const nixlBasicDesc &>(lhs) == static_cast<const nixlBasicDesc &>(rhs) &&
        lhs.remoteAgent == rhs.remoteAgent;
}

template<class T>
nixlDescList<T>::nixlDescList(const nixl_mem_t &type, const int &init_size) : type(type) {
    if (init_size > 0) descs.resize(static_cast<size_t>(init_size));
}

template<class T> nixlDescList<T>::nixlDescList(nixlSerDes *deserializer) : type(DRAM_SEG) {
    if (deserializer == nullptr) return;
    int32_t t = 0;
    uint64_t n = 0;
    if (deserializer->getBuf("gixl.dlist.type", &t, sizeof(t)) != NIXL_SUCCESS || t < DRAM_SEG || t > FILE_SEG)
        return;
    if (deserializer->getBuf("gixl.dlist.count", &n, sizeof(n)) != NIXL_SUCCESS) return;
    std::vector<T> got;
    for (uint64_t i = 0; i < n; i++) {
        const ssize_t len = deserializer->getBufLen("gixl.dlist.desc");
        if (len < static_cast<ssize_t>(gixl_detail::kRangeBytes)) return;
        const std::string blob = deserializer->getStr("gixl.dlist.desc");
        T d;
        gixl_detail::getRange(blob, d);
        if (!gixl_detail::setExtra(d, blob.substr(gixl_detail::kRangeBytes))) return;
        got.push_back(std::move(d));
    }
    type = static_cast<nixl_mem_t>(t);
    descs = std::move(got);
}

template<class Y>
bool
operator==(const nixlDescList<Y> &lhs, const nixlDescList<Y> &rhs) {
    return lhs.type == rhs.type && lhs.descs == rhs.descs;
}

template<class T>
void
nixlDescList<T>::resize(const size_t &count) {
    descs.resize(count);
}

template<class T>
void
nixlDescList<T>::addDesc(const T &desc) {
    descs.push_back(desc);
}

template<class T>
void
nixlDescList<T>::remDesc(const int &index) {
    if (index < 0 || static_cast<size_t>(index) >= descs.size())
        throw std::out_of_range("nixlDescList::remDesc: index " + std::to_string(index) + " out of range");
    descs.erase(descs.begin() + index);
}

template<class T>
nixlDescList<nixlBasicDesc>
nixlDescList<T>::trim() const {
    nixlDescList<nixlBasicDesc> out(type);
    out.reserve(descs.size());
    for (const T &d : descs) out.addDesc(static_cast<const nixlBasicDesc &>(d));
    return out;
}

template<class T>
int
nixlDescList<T>::getIndex(const nixlBasicDesc &query) const {
    for (size_t i = 0; i < descs.size(); i++) {
        if (static_cast<const nixlBasicDesc &>(descs[i]) == query) return static_cast<int>(i);
    }
    return NIXL_ERR_NOT_FOUND;
}

template<class T>
nixl_status_t
nixlDescList<T>::serialize(nixlSerDes *serializer) const {
    if (serializer == nullptr) return NIXL_ERR_INVALID_PARAM;
    const int32_t t = static_cast<int32_t>(type);
    const uint64_t n = descs.size();
    nixl_status_t st = serializer->addBuf("gixl.dlist.type", &t, sizeof(t));
    if (st == NIXL_SUCCESS) st = serializer->addBuf("gixl.dlist.count", &n, sizeof(n));
    for (size_t i = 0; st == NIXL_SUCCESS && i < descs.size(); i++) {
        std::string blob;
        gixl_detail::putRange(blob, descs[i]);
        blob += gixl_detail::extra(descs[i]);
        st = serializer->addStr("gixl.dlist.desc", blob);
    }
    return st;
}

template<class T>
std::string
nixlDescList<T>::to_string(bool compact) const {
    std::ostringstream s;
    s << "DescList of type " << nixlEnumStrings::memTypeStr(type) << " with " << descs.size() << " descs";
    if (compact) return s.str();
    for (size_t i = 0; i < descs.size(); i++) {
        s << "\n  [" << i << "] " << gixl_detail::describe(descs[i]) << gixl_detail::describeExtra(descs[i]);
    }
    return s.str();
}

template<class T>
void
nixlDescList<T>::print() const {
    std::cout << to_string() << std::endl;
}

#endif // GIXL_NIXL_ORACLE

#endif
