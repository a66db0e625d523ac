"""One rank of tests/test_weight_cache.py's FSDP2 test (launched with torch.distributed.run, gloo): FSDP2's
all-gathers refill the unsharded weight in place without a version bump, so the weight cache must never
serve a copy made from an earlier gather."""

import os
import sys

from test_weight_cache import fsdp_rank

if __name__ == "__main__":
    fsdp_rank()  # every assertion, then a barrier and destroy_process_group: an error exits non-zero here
    # Passed and torn down: leave without the interpreter's shutdown. In loaded full-suite runs a rank
    # aborted there, after the test had passed ("terminate called without an active exception", SIGABRT:
    # a native thread destroyed unjoined during static destruction), in 3 of ~15 runs over two sessions.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
