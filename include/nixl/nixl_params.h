/*
 * nixl_params.h - gixl's C++ drop-in for NVIDIA NIXL 1.5.x: agent configuration.
 */
#ifndef _NIXL_PARAMS_H
#define _NIXL_PARAMS_H

#include <chrono>
#include <cstdint>
#include <string>

#include "nixl_types.h"

// How an agent is set up. gixl is thread-safe whatever syncMode says, and reads every field except
// etcdWatchTimeout (its etcd watch has its own bounded timeouts) and the constructor's num_workers.
struct nixlAgentConfig {
    static constexpr bool kDefaultUseProgThread = false;
    static constexpr bool kDefaultUseListenThread = false;
    static constexpr uint16_t kDefaultListenPort = default_comm_port;
    static constexpr nixl_thread_sync_t kDefaultSyncMode = nixl_thread_sync_t::NIXL_THREAD_SYNC_DEFAULT;
    static constexpr bool kDefaultCaptureTelemetry = false;
    static constexpr uint64_t kDefaultPthrDelayUs = 0;
    static constexpr uint64_t kDefaultLthrDelayUs = 100000;
    static constexpr std::chrono::microseconds kDefaultEtcdWatchTimeout = std::chrono::microseconds(5000000);

    bool useProgThread = kDefaultUseProgThread;
    bool useListenThread = kDefaultUseListenThread;
    uint16_t listenPort = kDefaultListenPort;
    nixl_thread_sync_t syncMode = kDefaultSyncMode;
    bool captureTelemetry = kDefaultCaptureTelemetry;
    uint64_t pthrDelay = kDefaultPthrDelayUs;
    uint64_t lthrDelay = kDefaultLthrDelayUs;
    std::chrono::microseconds etcdWatchTimeout = kDefaultEtcdWatchTimeout;

    nixlAgentConfig() = default;

    explicit nixlAgentConfig(const bool use_prog_thread,
                             const bool use_listen_thread = kDefaultUseListenThread,
                             uint16_t port = kDefaultListenPort,
                             nixl_thread_sync_t sync_mode = kDefaultSyncMode,
                             unsigned int num_workers = 1,
                             uint64_t pthr_delay_us = kDefaultPthrDelayUs,
                             uint64_t lthr_delay_us = kDefaultLthrDelayUs,
                             bool capture_telemetry = kDefaultCaptureTelemetry,
                             std::chrono::microseconds etcd_watch_timeout = kDefaultEtcdWatchTimeout) noexcept
        : useProgThread(use_prog_thread),
          useListenThread(use_listen_thread),
          listenPort(port),
          syncMode(sync_mode),
          captureTelemetry(capture_telemetry),
          pthrDelay(pthr_delay_us),
          lthrDelay(lthr_delay_us),
          etcdWatchTimeout(etcd_watch_timeout) {
        (void)num_workers;
    }
};

#endif
