# Two hosts, step 2 (guests A and B at the same time, one device): each
# creates its own CXL region over the shared memdev (the namespace comes back
# from the labels the first guest wrote), then runs its part of the test:
# A = node 0, lock manager, prefill; B = node 1, decode.  One Python process
# does it all (under the emulator each costs ~45 s to start): e2e.py runs
# what `tract init --provision-only` and `tract check` run, and records their
# output as those commands' (00_..., 02_...), forks the agent and the counters.
. "$TRACT_VM_PROJECT/tools/cxl-vm/guest/lib.sh"

case "$TRACT_VM_ROLE" in
    nodeA) node=0; part=prefill ;;
    nodeB) node=1; part=decode ;;
    *) echo "tract-vm: unknown role $TRACT_VM_ROLE"; exit 2 ;;
esac
must e2e node $DEV --node $node --part $part --params "$OUT/params.json" \
    --out "$OUT/result.json" --record "$OUT"
