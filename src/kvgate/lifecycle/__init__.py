"""One request's life, free of any protocol: what it is charged and how its lease is kept."""

from kvgate.lifecycle.billing import CutRequestCharge, ResponseReading, charged_usage
from kvgate.lifecycle.leases import LeaseKeeper

__all__ = ["CutRequestCharge", "LeaseKeeper", "ResponseReading", "charged_usage"]
