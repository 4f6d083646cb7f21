"""One request's life, free of any protocol: admit -> ticket -> meter -> settle.

- `admission.py`: from a parsed request to a `Ticket`, or `Rejected` with a domain reason;
- `ticket.py`: the immutable record carried from admission to settlement;
- `meter.py`: reads the answer as it passes, in bounded memory;
- `billing.py`: the one rule for what a request is charged, by how it ended;
- `settlement.py`: the one path that releases a reservation and books the charge, once;
- `leases.py`: keeps an open request's lease alive;
- `tasks.py`: work that outlives its stream (settlements), awaited at shutdown;
- `usage_report.py`: a tenant's usage for today and this month.
"""

from kvgate.lifecycle.admission import (
    Admission,
    ContextOverflow,
    PromptTokenizers,
    Rejected,
    Rejection,
)
from kvgate.lifecycle.billing import CutRequestCharge, ResponseReading, charged_usage
from kvgate.lifecycle.leases import LeaseKeeper
from kvgate.lifecycle.meter import ResponseMeter
from kvgate.lifecycle.settlement import Settler
from kvgate.lifecycle.tasks import BackgroundTasks
from kvgate.lifecycle.ticket import Ticket

__all__ = [
    "Admission",
    "BackgroundTasks",
    "ContextOverflow",
    "CutRequestCharge",
    "LeaseKeeper",
    "PromptTokenizers",
    "Rejected",
    "Rejection",
    "ResponseMeter",
    "ResponseReading",
    "Settler",
    "Ticket",
    "charged_usage",
]
