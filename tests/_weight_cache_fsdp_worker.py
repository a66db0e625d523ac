"""One rank of tests/test_weight_cache.py's FSDP2 test (launched with torch.distributed.run, gloo): FSDP2's
all-gathers refill the unsharded weight in place without a version bump, so the weight cache must never
serve a copy made from an earlier gather."""

from test_weight_cache import fsdp_rank

if __name__ == "__main__":
    fsdp_rank()
