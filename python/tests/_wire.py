"""JSON wire encoding shared by peer.py and peer_client.py (bytes and dicts with bytes keys)."""

import numpy as np


def enc(v):
    if isinstance(v, (bytes, bytearray)):
        return {"__b": bytes(v).hex()}
    if isinstance(v, dict):
        return {"__d": [[enc(k), enc(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return [enc(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    return v


def dec(v):
    if isinstance(v, dict):
        if "__b" in v:
            return bytes.fromhex(v["__b"])
        if "__d" in v:
            return {dec(k): dec(x) for k, x in v["__d"]}
        return {k: dec(x) for k, x in v.items()}
    if isinstance(v, list):
        return [dec(x) for x in v]
    return v
