"""Running kvgate: the local launcher, its supervisor, certificates, models, the scaler.

The launchers here start processes (subprocess.Popen: fork, then exec) from a process whose
gRPC threads are busy probing the others' health; gRPC's fork handlers are then skipped with a
warning, or can wait inside fork() forever. A child that execs at once needs none of them, so
they are off before anything here imports grpc.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
