"""splitserve's gRPC contracts: `splitserve.proto` and its generated stubs (committed;
regenerate with `python -m protos.gen`). `protos.convert` maps between the wire
messages and engine types; it imports no torch (the gateway uses it)."""
