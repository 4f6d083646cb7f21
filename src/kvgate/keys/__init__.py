"""API keys as data: created, rotated and revoked at run time, looked up per request."""

from kvgate.keys.records import KeyDirectory, KeyRecord, KeyRefusal, NewKey

__all__ = ["KeyDirectory", "KeyRecord", "KeyRefusal", "NewKey"]
