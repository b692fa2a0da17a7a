# Two hosts, step 2 (guests A and B at the same time, one device): each
# creates its own CXL region over the shared memdev (the namespace comes back
# from the labels the setup guest wrote), then runs its part of the test:
# A = node 0, lock manager, prefill; B = node 1, decode.
. "$TRACT_VM_PROJECT/tools/cxl-vm/guest/lib.sh"

case "$TRACT_VM_ROLE" in
    nodeA) node=0; part=prefill ;;
    nodeB) node=1; part=decode ;;
    *) echo "tract-vm: unknown role $TRACT_VM_ROLE"; exit 2 ;;
esac
t0=$(now)
must tract init $DEV --provision-only
t1=$(now)
echo "{\"provision_s\": $(elapsed "$t0" "$t1")}" > "$OUT/timings.json"
# (`tract devices` and `tract info` on a device are the one-host scenario's:
# under the emulator each tract command costs ~45 s of Python start-up)
must e2e node $DEV --node $node --part $part --params "$OUT/params.json" \
    --out "$OUT/result.json"
must tract check $DEV
