"""The Envoy-facing adapter: the ext_proc gRPC servicer and its per-stream state machine."""

from kvgate.extproc.handlers import Phase
from kvgate.extproc.servicer import ExternalProcessor
from kvgate.extproc.services import GatewayServices
from kvgate.extproc.session import StreamSession

__all__ = ["ExternalProcessor", "GatewayServices", "Phase", "StreamSession"]
