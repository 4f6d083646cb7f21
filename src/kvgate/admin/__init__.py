"""The operator gRPC API (kvgate.admin.v1): generated stubs in v1/, the servicer in service.py."""
