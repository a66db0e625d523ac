"""A randomized model of decode_gemm_rs.cu's (v5) mbarrier protocol, run on a CPU before spending device time on a
schedule change (session 32 lost a 600 s call to a kernel that hung).

Agents: producer thread 0 (issues the copies, 1 arrival), the other 127 producer threads, the two consumer
warpgroups (128 arrivals each), and the copy engine (completes issued copies in random order). Each mbarrier is
modelled with its arrival count and phase, and `try_wait.parity` as the hardware answers it. Checked on thousands of
random interleavings, for RS_BSPLIT 0 and 1, 1..40 steps a tile, one tile a CTA and (RS_PERSIST) several: every agent finishes (no deadlock); a slot is refilled
only after all four readers read its previous step; every read of a slot finds the step it wants; a B stage is
written only while no wgmma uses it and used only when every writer has written that step.

    python benchmarks/nvfp4_gemm_proto/check_protocol.py [--ahead 3 --stages 4 --slots 7] [--skip-freed-wait]

`--skip-freed-wait` drops the copy issue's wait on the slot's readers: with the default schedule nothing fails
(the issue never needed to wait: the B-stage wait before it implies the slot was read); with `--ahead 4` the
overwrite check fires, which shows the model can fail.
"""
import argparse
import random
import sys

BREAK = False

def run(steps, S, A, P, bsplit, seed, tiles=1):
    per_tile, steps = steps, steps * tiles  # the K steps of one tile; the CTA's whole stream of steps
    rng = random.Random(seed)
    bars = {}
    def bar(name, count): bars[name] = {"count": count, "pending": count, "phase": 0}
    for s in range(S):
        bar(("full", s), 384 if bsplit else 128); bar(("empty", s), 2)
    for p in range(P):
        bar(("landed", p), 1); bar(("freed", p), 384)
    slot_step = [None] * P          # which step's bytes a slot holds (None: in flight / empty)
    slot_readers = [set() for _ in range(P)]
    stage_step = [None] * S; stage_writers = [set() for _ in range(S)]; stage_busy = [set() for _ in range(S)]
    tma_pending = []
    def arrive(name, n=1):
        b = bars[name]; b["pending"] -= n; assert b["pending"] >= 0, name
        if b["pending"] == 0: b["phase"] += 1; b["pending"] = b["count"]
    def done(name, parity): return (bars[name]["phase"] & 1) != parity
    def issue(k):
        p = k % P
        if k >= P: assert slot_readers[p] == {"P0", "PR", "C0", "C1"}, ("slot overwrite while read", k, slot_readers[p])
        slot_step[p] = None; slot_readers[p] = set()
        tma_pending.append(k)
    def read_slot(who, k):
        p = k % P; assert slot_step[p] == k, (who, "reads slot", p, "holds", slot_step[p], "wants", k)
        slot_readers[p].add(who)
    def write_stage(who, k):
        s = k % S
        assert not stage_busy[s], (who, "writes stage in use", s, stage_busy[s])
        if stage_step[s] != k: stage_step[s] = k; stage_writers[s] = set()
        stage_writers[s].add(who)
    def use_stage(who, k):
        s = k % S; assert stage_step[s] == k and stage_writers[s] == ({"P", "C0", "C1"} if bsplit else {"P"}), (who, k, stage_step[s], stage_writers[s])
        stage_busy[s].add((who, k))
    def free_stage(who, k): stage_busy[k % S].discard((who, k))
    # agents: P0 = producer thread 0 (weight 1), PR = the other 127, C0 / C1 consumer warpgroups
    def producer(zero):
        w = 1 if zero else 127
        if zero:
            for k in range(min(A, steps)): issue(k)
        for kt in range(steps):
            p, s = kt % P, kt % S
            if kt >= S:
                while not done(("empty", s), ((kt // S) + 1) & 1): yield
            if zero and kt + A < steps:
                k = kt + A
                if k >= P:
                    if not BREAK: 
                        while not done(("freed", k % P), ((k // P) + 1) & 1): yield
                issue(k)
            while not done(("landed", p), (kt // P) & 1): yield
            read_slot("P0" if zero else "PR", kt); write_stage("P", kt)
            arrive(("freed", p), w); arrive(("full", s), w)
            yield
    def consumer(c):
        name = f"C{c}"
        def b_part(k):
            p, s = k % P, k % S
            while not done(("landed", p), (k // P) & 1): yield
            if k >= S:
                while not done(("empty", s), ((k // S) + 1) & 1): yield
            read_slot(name, k); write_stage(name, k); arrive(("full", s), 128)
        if bsplit and steps > 0: yield from b_part(0)
        for g in range(steps):
            kt = g % per_tile
            p, s = g % P, g % S
            while not done(("landed", p), (g // P) & 1): yield
            read_slot(name, g); arrive(("freed", p), 128)
            while not done(("full", s), (g // S) & 1): yield
            use_stage(name, g)
            yield
            if kt > 0: free_stage(name, g - 1); arrive(("empty", (g - 1) % S), 1)
            if bsplit and g + 1 < steps: yield from b_part(g + 1)
            if kt == per_tile - 1:  # the tile's last wgmmas waited for: its stage released, then the epilogue
                free_stage(name, g); arrive(("empty", g % S), 1)
                yield
    agents = {"P0": producer(True), "PR": producer(False), "C0": consumer(0), "C1": consumer(1)}
    idle = 0
    while agents or tma_pending:
        if tma_pending and rng.random() < 0.3:
            k = tma_pending.pop(rng.randrange(len(tma_pending)))
            slot_step[k % P] = k; arrive(("landed", k % P), 1); continue
        if not agents: continue
        name = rng.choice(list(agents))
        try:
            next(agents[name]); idle = 0
        except StopIteration:
            del agents[name]
        idle += 1
        if idle > 100000: return f"deadlock: {list(agents)}"
    return "ok"

def main() -> int:
    global BREAK
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ahead", type=int, default=3)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--slots", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--tiles", type=int, default=3, help="tiles per CTA (RS_PERSIST); 1 as without it")
    ap.add_argument("--skip-freed-wait", action="store_true")
    args = ap.parse_args()
    BREAK = args.skip_freed_wait
    runs = 0
    for tiles in sorted({1, args.tiles}):
        for bsplit in (0, 1):
            for steps in list(range(1, 14)) + [40]:
                for seed in range(args.seeds):
                    r = run(steps, S=args.stages, A=args.ahead, P=args.slots, bsplit=bsplit, seed=seed, tiles=tiles)
                    runs += 1
                    if r != "ok":
                        print(f"tiles={tiles} RS_BSPLIT={bsplit} steps={steps} seed={seed}: {r}")
                        return 1
    print(f"{runs} interleavings: no deadlock, no slot or stage race")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
