"""gixl implementation of NIXL's high-level Python API (``nixl._api``).

This module is a pure-Python layer over the native bindings module
``nixl._bindings`` (provided by gixl's Rust extension). Its public surface
(names, signatures, defaults, return types and error behaviour) follows
NVIDIA NIXL 1.5.x so that existing consumers (vLLM, SGLang, LMCache, Dynamo,
TensorRT-LLM, Ray) keep working unchanged.

Deliberate, compatible differences from NIXL:

* every agent-name argument accepts ``str`` or ``bytes`` (``add_remote_agent``
  still returns ``bytes`` as NIXL does);
* ``send_notif(..., backend="UCX")`` works (NIXL raises ``TypeError``);
* ``check_remote_xfer_done`` accepts a ``bytes`` agent name and a ``str`` tag;
* non-contiguous ``Nx3`` numpy arrays are accepted (copied) instead of raising;
* transfer-handle ``__del__`` failures really are queued for the owning agent.

The bindings are looked up at call time through the module attribute
``nixlBind`` so tests can monkeypatch ``nixl._bindings.nixlAgent``.
"""

from __future__ import annotations

import pickle
import sys
import weakref
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from . import _bindings as nixlBind  # type: ignore[attr-defined]
from .logging import get_logger

if TYPE_CHECKING:  # pragma: no cover
    import torch  # noqa: F401

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]

logger = get_logger(__name__)

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT

# Names that mean "the local (initiator) side" in prep_xfer_dlist.
_LOCAL_SIDE_NAMES = ("NIXL_INIT_AGENT", "")


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def _agent_name(name: Any) -> Any:
    """Normalise an agent name to ``str``; ``bytes`` are decoded as UTF-8.

    Names that are not valid UTF-8 are passed through unchanged, so the
    bindings see exactly the bytes the caller gave.
    """
    if isinstance(name, (bytes, bytearray, memoryview)):
        raw = bytes(name)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
    return name


def _as_bytes(msg: Any) -> bytes:
    """Normalise a notification payload / metadata blob to ``bytes``."""
    if msg is None:
        return b""
    if isinstance(msg, bytes):
        return msg
    if isinstance(msg, str):
        return msg.encode("utf-8")
    if isinstance(msg, (bytearray, memoryview)):
        return bytes(msg)
    raise TypeError(f"expected bytes or str, got {type(msg).__name__!r}")


def _as_indices(indices: Any) -> np.ndarray:
    """Normalise transfer indices to a C-contiguous 1-D int64 array.

    Accepts lists, tuples, ranges and numpy arrays of any numeric dtype.
    Negative or too-large values are left for the bindings to reject with
    ``nixlInvalidParamError``.
    """
    if isinstance(indices, np.ndarray):
        if indices.ndim != 1:
            raise ValueError("index arrays must be one-dimensional")
        if indices.dtype.kind in "iu" and indices.dtype.isnative:
            # Any integer type and layout: the bindings read it in place (no conversion copy per call).
            return indices
        return np.ascontiguousarray(indices, dtype=np.int64)
    arr = np.asarray(indices if not isinstance(indices, range) else list(indices))
    if arr.ndim != 1:
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        raise ValueError("indices must be a flat sequence of integers")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"indices must be integers (got dtype {arr.dtype})")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _torch_tensor_type():
    """Return ``torch.Tensor`` if torch is already imported, else ``None``.

    torch is never imported here: a value can only be a tensor if the caller
    already imported torch.
    """
    torch_mod = sys.modules.get("torch")
    if torch_mod is None:
        return None
    return getattr(torch_mod, "Tensor", None)


def _is_tensor(obj: Any) -> bool:
    tensor_cls = _torch_tensor_type()
    return tensor_cls is not None and isinstance(obj, tensor_cls)


def _tensor_region(t: Any) -> tuple[int, int, int]:
    """(address, byte length, device id) of a contiguous tensor; CPU is device 0."""
    dev = int(t.get_device())
    return int(t.data_ptr()), int(t.numel()) * int(t.element_size()), (0 if dev < 0 else dev)


def _tensor_mem_name(t: Any) -> str:
    return "DRAM" if int(t.get_device()) < 0 else "VRAM"


# --------------------------------------------------------------------------
# opaque handles
# --------------------------------------------------------------------------


class nixl_prepped_dlist_handle:
    """Handle of a prepared descriptor list (from ``prep_xfer_dlist``).

    ``release()`` frees it explicitly (idempotent); ``__del__`` is a best-effort
    fallback.
    """

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent, value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self):
        if self._released:
            return
        self._agent.releasedDlistH(self._handle)
        self._released = True

    def __del__(self):
        if getattr(self, "_released", True):
            return
        try:
            self._agent.releasedDlistH(self._handle)
            self._released = True
        except Exception:
            try:
                logger.error("could not release prepared dlist handle 0x%x", self._handle)
            except Exception:
                pass


class nixl_xfer_handle:
    """Handle of a transfer request (from ``make_prepped_xfer``/``initialize_xfer``).

    ``release()`` frees it; if the transfer is still active NIXL tries to abort
    it and raises if it cannot (the handle then stays valid). ``__del__``
    releases best-effort and, on failure, queues the raw handle on the owning
    agent so the agent retries when it is destroyed.
    """

    __slots__ = ("_handle", "_agent", "_released", "_owner")

    def __init__(self, agent, value: int, owner=None):
        self._handle = int(value)
        self._agent = agent
        self._released = False
        self._owner = owner

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self):
        if self._released:
            return
        self._agent.releaseXferReq(self._handle)
        self._released = True

    def __del__(self):
        if getattr(self, "_released", True):
            return
        try:
            self._agent.releaseXferReq(self._handle)
            self._released = True
            return
        except Exception:
            pass
        try:
            logger.error(
                "could not release transfer handle 0x%x; deferring to agent teardown",
                self._handle,
            )
        except Exception:
            pass
        owner = None
        try:
            owner = self._owner() if self._owner is not None else None
        except Exception:
            owner = None
        for target in (owner, self._agent):
            try:
                if target is not None:
                    target._leaked_xfer_handles.append(self._handle)
                    return
            except Exception:
                continue


# Backend handles are plain integers; they never reach user code as objects.
nixl_backend_handle = int


class nixl_thread_sync_t(Enum):
    """Thread synchronisation modes; ``.value`` is the bindings' enum value."""

    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:
    """Agent configuration.

    Args:
        enable_prog_thread: run the backends' progress thread when they have one.
        enable_listen_thread: run the metadata listener (P2P exchange).
        listen_port: listener port (0 picks a free port).
        capture_telemetry: record per-transfer telemetry.
        num_threads: worker threads for multi-threaded backends (0 = default).
        backends: backends to create with the agent (missing plugins are skipped).
        sync_mode: a ``nixl_thread_sync_t``; ``None`` picks STRICT when the
            listener is enabled and NONE otherwise.
        check_overlap: gixl only (keyword): ``"warn"`` or ``"refuse"`` switches on
            gixl's check of transfers in flight on the same bytes (see gixl's
            docs/overlap-check.md); ``None`` (default) leaves it to
            ``GIXL_CHECK_OVERLAP``, off when unset.
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],  # noqa: B006 - part of the public signature
        sync_mode: Optional[nixl_thread_sync_t] = None,
        *,
        check_overlap: Optional[str] = None,
    ):
        if check_overlap is not None and (
            not isinstance(check_overlap, str)
            or check_overlap.strip().lower() not in ("off", "warn", "refuse")
        ):
            raise ValueError(
                f"check_overlap must be 'off', 'warn' or 'refuse' (got {check_overlap!r})"
            )
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.backends = list(backends) if backends is not None else []
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode
        self.check_overlap = check_overlap


# Which init parameter carries ``num_threads`` for each multi-threaded plugin.
_THREAD_PARAM = {
    "UCX": "num_threads",
    "OBJ": "num_threads",
    "LIBFABRIC": "num_threads",
    "GDS_MT": "thread_count",
    "UCCL": "num_cpus",
}


class nixl_agent:
    """A NIXL agent: owns backends, registrations, metadata and transfers.

    Args:
        agent_name: unique, non-empty name of this agent.
        nixl_conf: optional ``nixl_agent_config``.
        instantiate_all: create every available plugin (ignored when
            ``nixl_conf`` is given).
    """

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Optional[nixl_agent_config] = None,
        instantiate_all: bool = False,
    ):
        bind_name = _agent_name(agent_name)
        if bind_name in ("", b""):
            raise ValueError("Agent needs a non-empty name")

        if nixl_conf and instantiate_all:
            logger.warning("instantiate_all is ignored because an explicit config was given")
            instantiate_all = False
        if not nixl_conf:
            nixl_conf = nixl_agent_config()

        if nixl_conf.sync_mode is not None:
            sync_mode = nixl_conf.sync_mode
        elif nixl_conf.enable_listen:
            sync_mode = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        else:
            sync_mode = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE

        cfg = nixlBind.nixlAgentConfig()
        cfg.useProgThread = nixl_conf.enable_pthread
        cfg.useListenThread = nixl_conf.enable_listen
        cfg.listenPort = nixl_conf.port
        cfg.syncMode = sync_mode.value
        cfg.pthrDelay = 0
        cfg.lthrDelay = 100000
        cfg.captureTelemetry = nixl_conf.capture_telemetry
        check_overlap = getattr(nixl_conf, "check_overlap", None)
        if check_overlap is not None:
            cfg.gixlCheckOverlap = check_overlap

        # Looked up at call time on purpose (tests monkeypatch it).
        self.agent = nixlBind.nixlAgent(bind_name, cfg)

        self.name = agent_name
        self._leaked_xfer_handles: list[int] = []
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, nixl_backend_handle] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}

        self.nixl_mems = {
            "DRAM": nixlBind.DRAM_SEG,
            "VRAM": nixlBind.VRAM_SEG,
            "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG,
            "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG,  # deprecated alias
            "cuda": nixlBind.VRAM_SEG,  # deprecated alias
        }
        self.nixl_ops = {
            "WRITE": nixlBind.NIXL_WRITE,
            "READ": nixlBind.NIXL_READ,
        }

        self.plugin_list = list(self.agent.getAvailPlugins())
        if not self.plugin_list:
            logger.error("no NIXL backend plugins were found")
            raise RuntimeError("NIXL found no backend plugins; transfers are impossible")

        wanted = self.plugin_list if instantiate_all else list(nixl_conf.backends)
        for backend in wanted:
            if backend not in self.plugin_list:
                logger.warning("Skipping backend %s: no such plugin", backend)
                continue
            init: dict[str, str] = {}
            if nixl_conf.num_threads > 0 and backend in _THREAD_PARAM:
                init[_THREAD_PARAM[backend]] = str(nixl_conf.num_threads)
            self.create_backend(backend, init)

        logger.info("NIXL agent %s initialized", agent_name)

    def __del__(self):
        leaked = getattr(self, "_leaked_xfer_handles", None)
        if not leaked:
            return
        for raw in list(leaked):
            try:
                self.agent.releaseXferReq(raw)
            except Exception as exc:  # pragma: no cover - best effort
                try:
                    logger.error("could not release leaked transfer handle 0x%x: %s", raw, exc)
                except Exception:
                    pass
        leaked.clear()

    # ------------------------------------------------------------------
    # internal helpers
    # ------------------------------------------------------------------

    def _backend_handles(self, backends) -> list:
        """Map backend names to handles; unknown names raise ``KeyError``."""
        if not backends:
            return []
        return [self.backends[name] for name in backends]

    def _xfer_handle(self, raw) -> nixl_xfer_handle:
        return nixl_xfer_handle(self.agent, raw, weakref.ref(self))

    def _load_plugin_params(self, plugin: str) -> None:
        if plugin not in self.plugin_list:
            return
        try:
            options, mems = self.agent.getPluginParams(plugin)
        except Exception:
            logger.warning("could not query parameters of plugin %s", plugin, exc_info=True)
            return
        self.plugin_b_options[plugin] = dict(options)
        self.plugin_mem_types[plugin] = list(mems)

    # ------------------------------------------------------------------
    # plugins and backends
    # ------------------------------------------------------------------

    def get_plugin_list(self) -> list[str]:
        """Names of the discovered backend plugins."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        """Memory types (e.g. ``"DRAM_SEG"``) a plugin supports; ``[]`` if unknown."""
        if backend not in self.plugin_mem_types:
            self._load_plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning("Plugin %s is not available; no memory types to report", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        """Default init parameters of a plugin; ``{}`` if unknown."""
        if backend not in self.plugin_b_options:
            self._load_plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available; no parameters to report", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> list[str]:
        """Memory types of a created backend; ``[]`` if it was not created."""
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        logger.warning("Backend %s was not created; no memory types to report", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        """Parameters of a created backend; ``{}`` if it was not created."""
        if backend in self.backend_options:
            return self.backend_options[backend]
        logger.warning("Backend %s was not created; no parameters to report", backend)
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] = {}):  # noqa: B006
        """Create a backend from a plugin with the given init parameters."""
        handle = self.agent.createBackend(backend, dict(initParams))
        self.backends[backend] = handle
        options, mems = self.agent.getBackendParams(handle)
        self.backend_options[backend] = dict(options)
        self.backend_mems[backend] = list(mems)
        logger.info("Backend %s created", backend)

    # ------------------------------------------------------------------
    # memory registration
    # ------------------------------------------------------------------

    def register_memory(
        self,
        reg_list,
        mem_type: Optional[str] = None,
        backends: list[str] = [],  # noqa: B006
    ) -> nixlBind.nixlRegDList:
        """Register memory with all backends supporting its type (or ``backends``).

        ``reg_list`` is anything ``get_reg_descs`` accepts. Returns the
        registration list, to be passed to ``deregister_memory`` later.
        """
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        handles = self._backend_handles(backends)
        if reg_descs is None:
            raise TypeError(
                "register_memory: the input could not be turned into a nixlRegDList"
            )
        self.agent.registerMem(reg_descs, handles)
        return reg_descs

    def deregister_memory(
        self,
        dereg_list: nixlBind.nixlRegDList,
        backends: list[str] = [],  # noqa: B006
    ):
        """Deregister a list previously registered (descriptors must match exactly)."""
        handles = self._backend_handles(backends)
        self.agent.deregisterMem(dereg_list, handles)

    def query_memory(
        self,
        reg_list,
        backend: str,
        mem_type: Optional[str] = None,
    ) -> list[Optional[dict[str, str]]]:
        """Ask one backend about memory/storage; one dict (or ``None``) per descriptor."""
        reg_descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(
                f"query_memory: backend {backend!r} was not created "
                f"(created: {list(self.backends)})"
            )
        return self.agent.queryMem(reg_descs, self.backends[backend])

    # ------------------------------------------------------------------
    # connections and prepared lists
    # ------------------------------------------------------------------

    def make_connection(self, remote_agent: str, backends: list[str] = []):  # noqa: B006
        """Optionally connect to a remote agent ahead of the first transfer."""
        handles = self._backend_handles(backends)
        self.agent.makeConnection(_agent_name(remote_agent), handles)

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list,
        mem_type: Optional[str] = None,
        backends: list[str] = [],  # noqa: B006
    ) -> nixl_prepped_dlist_handle:
        """Prepare a descriptor list for later ``make_prepped_xfer`` calls.

        ``agent_name`` is ``"NIXL_INIT_AGENT"`` or ``""`` for the local
        (initiator) side, the remote agent's name for a remote side, or this
        agent's own name for a loopback target.

        ``xfer_list`` is anything ``get_xfer_descs`` accepts, or an ``Nx5``
        numpy array of strided rows ``(addr, len, dev_id, stride, count)``
        (``mem_type`` required), where each row expands to ``count`` blocks of
        ``len`` bytes spaced ``stride`` bytes apart. Indices then address the
        expanded blocks, row after row.
        """
        name = _agent_name(agent_name)
        if name in _LOCAL_SIDE_NAMES:
            name = nixlBind.NIXL_INIT_AGENT

        strided = (
            isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5
        )
        handles = self._backend_handles(backends)
        if strided:
            if mem_type is None:
                raise ValueError("strided (Nx5) descriptors need an explicit mem_type")
            mem = self.nixl_mems[mem_type]
            raw = self.agent.prepXferDlist(name, mem, np.ascontiguousarray(xfer_list), handles)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            raw = self.agent.prepXferDlist(name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, raw)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        """Estimated (duration_us, error_margin_us, method) of a transfer.

        The method is ``"ANALYTICAL_BACKEND"`` only when the bindings report the
        ``nixl_cost_t`` enum member itself; a plain integer is reported as
        ``"UNKNOWN"``, exactly as NIXL's Python layer behaves.
        """
        duration, margin, method = self.agent.estimateXferCost(req_handle._handle)
        analytical = nixlBind.NIXL_COST_ANALYTICAL_BACKEND
        if type(method) is type(analytical) and method == analytical:
            method_name = "ANALYTICAL_BACKEND"
        else:
            method_name = "UNKNOWN"
        return duration, margin, method_name

    # ------------------------------------------------------------------
    # transfers
    # ------------------------------------------------------------------

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Union[list[int], np.ndarray],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Union[list[int], np.ndarray],
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """Create a transfer from two prepared lists and matching index lists.

        ``operation`` is ``"READ"`` or ``"WRITE"``; ``notif_msg`` (bytes or str)
        is delivered to the remote agent after the data when non-empty.
        """
        op = self.nixl_ops[operation]
        handles = self._backend_handles(backends)
        raw = self.agent.makeXferReq(
            op,
            local_xfer_side._handle,
            _as_indices(local_indices),
            remote_xfer_side._handle,
            _as_indices(remote_indices),
            _as_bytes(notif_msg),
            handles,
            bool(skip_desc_merge),
        )
        return self._xfer_handle(raw)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: nixlBind.nixlXferDList,
        remote_descs: nixlBind.nixlXferDList,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
    ) -> nixl_xfer_handle:
        """Create a transfer directly from two descriptor lists (prepares both sides)."""
        op = self.nixl_ops[operation]
        handles = self._backend_handles(backends)
        raw = self.agent.createXferReq(
            op,
            local_descs,
            remote_descs,
            _agent_name(remote_agent),
            _as_bytes(notif_msg),
            handles,
        )
        return self._xfer_handle(raw)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post a transfer: ``"DONE"`` (finished inline), ``"PROC"`` or ``"ERR"``.

        An empty ``notif_msg`` keeps the handle's current notification; errors
        raise the matching ``nixl*Error``.
        """
        if notif_msg.__class__ is not bytes:
            notif_msg = _as_bytes(notif_msg)
        return self.agent._postState(handle._handle, notif_msg)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """Poll a posted transfer: ``"DONE"``, ``"PROC"`` or ``"ERR"`` (errors raise)."""
        return self.agent._xferState(handle._handle)

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        """Telemetry of a completed transfer (needs telemetry enabled)."""
        return self.agent.getXferTelemetry(handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """Name of the backend chosen for a transfer."""
        chosen = self.agent.queryXferBackend(handle._handle)
        for name, backend_handle in self.backends.items():
            if backend_handle == chosen:
                return name
        raise KeyError(f"transfer uses an unknown backend handle 0x{int(chosen):x}")

    def release_xfer_handle(self, handle: nixl_xfer_handle):
        """Release a transfer handle (aborts an active transfer, or raises)."""
        if handle._agent is not self.agent:
            # Another agent's handle: hand it to *this* agent, as NIXL does, which refuses it (NIXL: undefined
            # behaviour); releasing it on its owner would free a handle the owner still uses.
            self.agent.releaseXferReq(handle._handle)
            return
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle):
        """Release a prepared descriptor list handle (idempotent)."""
        if handle._agent is not self.agent:
            self.agent.releasedDlistH(handle._handle)  # another agent's handle: see release_xfer_handle
            return
        handle.release()

    def prep_mem_view(
        self,
        dlist: Union[nixlBind.nixlXferDList, nixlBind.nixlRemoteDList],
        *,
        backends: Optional[list[str]] = None,
    ) -> int:
        """Prepare a device memory view (GPU device API backends only)."""
        return self.agent.prepMemView(dlist, self._backend_handles(backends))

    def release_mem_view(self, mvh: int) -> None:
        """Release a memory view returned by ``prep_mem_view``."""
        self.agent.releaseMemView(mvh)

    # ------------------------------------------------------------------
    # notifications
    # ------------------------------------------------------------------

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        """Notifications received since the last call: ``{sender: [bytes, ...]}``."""
        handles = self._backend_handles(backends)
        return self.agent.getNotifs({}, handles)

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        """Append new notifications to ``self.notifs`` and return it."""
        handles = self._backend_handles(backends)
        self.notifs = self.agent.getNotifs(self.notifs, handles)
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: bytes,
        backends: list[str] = [],  # noqa: B006
        tag_is_prefix=True,
    ) -> bool:
        """Consume the first notification from ``remote_agent_name`` matching a tag.

        The tag matches as a prefix (or anywhere when ``tag_is_prefix`` is
        False); an empty tag matches any message. Returns whether one matched.
        """
        self.update_notifs(backends)
        sender = _agent_name(remote_agent_name)
        tag = _as_bytes(lookup_tag)
        messages = self.notifs.get(sender)
        if not messages:
            return False
        for pos, msg in enumerate(messages):
            hit = msg.startswith(tag) if tag_is_prefix else (tag in msg)
            if hit:
                del messages[pos]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None):
        """Send a standalone notification (bytes or str) to an agent."""
        name = _agent_name(remote_agent_name)
        payload = _as_bytes(notif_msg)
        if backend is None:
            self.agent.genNotif(name, payload)
        else:
            self.agent.genNotif(name, payload, [self.backends[backend]])

    # ------------------------------------------------------------------
    # metadata
    # ------------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """This agent's full metadata blob, to hand to peers out of band."""
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(
        self,
        descs: nixlBind.nixlRegDList,
        inc_conn_info: bool = False,
        backends: list[str] = [],  # noqa: B006
    ) -> bytes:
        """Metadata covering only ``descs`` (optionally with connection info)."""
        handles = self._backend_handles(backends)
        return self.agent.getLocalPartialMD(descs, inc_conn_info, handles)

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata; returns the peer's name as ``bytes``."""
        name = self.agent.loadRemoteMD(_as_bytes(metadata))
        if isinstance(name, str):
            name = name.encode("utf-8")
        return name

    def remove_remote_agent(self, agent: str):
        """Forget a peer and disconnect from it. Never raises."""
        try:
            self.agent.invalidateRemoteMD(_agent_name(agent))
        except _nixl_errors():
            pass

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Publish full metadata to a peer (``ip_addr``) or the metadata store."""
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(
        self,
        descs: nixlBind.nixlRegDList,
        inc_conn_info: bool = False,
        backends: list[str] = [],  # noqa: B006
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ):
        """Publish partial metadata to a peer or the metadata store (``label`` needed there)."""
        handles = self._backend_handles(backends)
        self.agent.sendLocalPartialMD(descs, inc_conn_info, handles, ip_addr, port, label)

    def fetch_remote_metadata(
        self,
        remote_agent: str,
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ):
        """Ask a peer or the store for an agent's metadata (asynchronous)."""
        self.agent.fetchRemoteMD(_agent_name(remote_agent), ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        """Withdraw this agent's metadata from a peer or the store."""
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: nixlBind.nixlXferDList = None) -> bool:
        """Whether metadata of ``agent`` (covering ``descs`` if given) is loaded. Never raises."""
        if descs is None:
            descs = nixlBind.nixlXferDList(nixlBind.DRAM_SEG)
        try:
            status = self.agent.checkRemoteMD(_agent_name(agent), descs)
        except _nixl_errors():
            return False
        return status == nixlBind.NIXL_SUCCESS

    # ------------------------------------------------------------------
    # descriptor list construction
    # ------------------------------------------------------------------

    @staticmethod
    def _tensor_mem_type(tensor) -> str:
        return _tensor_mem_name(tensor)

    def _tensor_list_array(self, tensors) -> Optional[tuple[np.ndarray, str]]:
        """Nx3 uint64 array and mem type for a list of tensors, or ``None``."""
        device = tensors[0].device
        rows = np.empty((len(tensors), 3), dtype=np.uint64)
        for i, t in enumerate(tensors):
            if t.device != device:
                logger.error("All tensors in the list must live on the same device")
                return None
            if not t.is_contiguous():
                logger.error("tensors must be contiguous")
                return None
            rows[i] = _tensor_region(t)
        return rows, _tensor_mem_name(tensors[0])

    def _build_dlist(self, descs, mem_type, cls, other_cls, width: int):
        """Shared dispatch of ``get_xfer_descs`` (width 3) and ``get_reg_descs`` (width 4)."""
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other_cls):
            logger.error(
                "%s given where a %s is needed", type(descs).__name__, cls.__name__
            )
            return None
        if isinstance(descs, np.ndarray):
            if len(descs) == 0:
                raise IndexError("index 0 is out of bounds for axis 0 with size 0")
            if mem_type is None:
                logger.error("mem_type is required unless tensors are given")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("An Nx3 numpy array (addr, len, dev_id) is required")
                return None
            return cls(self.nixl_mems[mem_type], np.ascontiguousarray(descs))
        if _is_tensor(descs):
            if not descs.is_contiguous():
                logger.error("tensors must be contiguous")
                return None
            addr, length, dev = _tensor_region(descs)
            row = (addr, length, dev) if width == 3 else (addr, length, dev, "")
            return cls(self.nixl_mems[_tensor_mem_name(descs)], [row])

        first = descs[0]  # IndexError on an empty list, TypeError on non-sequences
        if isinstance(first, tuple):
            if mem_type is None:
                logger.error("mem_type is required unless tensors are given")
                return None
            if len(first) != width:
                logger.error("A list of %d-tuples is required here", width)
                return None
            rows = descs if isinstance(descs, list) else list(descs)
            return cls(self.nixl_mems[mem_type], rows)
        if _is_tensor(first):
            built = self._tensor_list_array(descs)
            if built is None:
                return None
            rows, mem_name = built
            return cls(self.nixl_mems[mem_name], rows)
        return None

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None) -> nixlBind.nixlXferDList:
        """Build a ``nixlXferDList``.

        Accepts a list of ``(addr, len, dev_id)`` tuples or an ``Nx3``
        uint64/int64 numpy array (both with ``mem_type``), a contiguous tensor
        or list of tensors (memory type inferred), or a ``nixlXferDList``
        (returned as is). Unusable input is logged and gives ``None``.
        """
        return self._build_dlist(descs, mem_type, nixlBind.nixlXferDList, nixlBind.nixlRegDList, 3)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None) -> nixlBind.nixlRegDList:
        """Build a ``nixlRegDList``.

        Like ``get_xfer_descs`` but with ``(addr, len, dev_id, meta)`` tuples;
        arrays and tensors get empty metadata. Unusable input gives ``None``.
        """
        return self._build_dlist(descs, mem_type, nixlBind.nixlRegDList, nixlBind.nixlXferDList, 4)

    def get_remote_descs(self, descs, mem_type: Optional[str] = None) -> nixlBind.nixlRemoteDList:
        """Build a ``nixlRemoteDList`` from ``(addr, len, dev_id, agent_name)`` tuples."""
        if isinstance(descs, nixlBind.nixlRemoteDList):
            return descs
        first = descs[0]
        if not isinstance(first, tuple):
            return None
        if mem_type is None:
            logger.error("mem_type is required for remote descriptors")
            return None
        if len(first) != 4:
            logger.error("A list of (addr, len, dev_id, agent_name) tuples is required")
            return None
        rows = [(a, n, d, _agent_name(r)) for (a, n, d, r) in descs]
        return nixlBind.nixlRemoteDList(self.nixl_mems[mem_type], rows)

    def get_serialized_descs(self, descs) -> bytes:
        """Pickle a descriptor list."""
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        """Unpickle a descriptor list made by ``get_serialized_descs``."""
        return pickle.loads(serialized_descs)


def _nixl_errors() -> tuple:
    """All exception classes the bindings raise for NIXL statuses."""
    names = (
        "nixlNotPostedError",
        "nixlInvalidParamError",
        "nixlBackendError",
        "nixlNotFoundError",
        "nixlMismatchError",
        "nixlNotAllowedError",
        "nixlRepostActiveError",
        "nixlUnknownError",
        "nixlNotSupportedError",
        "nixlRemoteDisconnectError",
        "nixlCancelledError",
        "nixlNoTelemetryError",
    )
    found = tuple(getattr(nixlBind, n) for n in names if hasattr(nixlBind, n))
    return found or (Exception,)
