"""Worker connections: dispatch to the disaggregated or colocated flow, routing, the registry of
gRPC clients, and the one place protobuf becomes plain data."""
