"""Portico's gRPC server: the pipeline, its services, stores and providers."""

import os

# Portico forks only to exec Envoy and worker processes, through a preexec_fn (PR_SET_PDEATHSIG) that runs in the
# child before exec. With gRPC's fork support on, gRPC's fork handlers run there too and can crash the child while
# RPCs are in flight (measured: 23 of 300 forks died with SIGSEGV; with it off, 0 of 300). No child ever uses gRPC,
# so it is off. gRPC reads the setting when it is first imported, which is why it is set here, before any import.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
