# Two hosts, step 1 (one guest, alone): provision the shared device once
# (region, namespace with --map=mem), format it for two nodes, and create the
# objects the two-host test shares (counter, mailbox, barrier).
. "$TRACT_VM_PROJECT/tools/cxl-vm/guest/lib.sh"

must uname -r
t0=$(now)
must tract init $DEV --provision --model tiny --nodes 2 --quiet
t1=$(now)
echo "{\"provision_s\": $(elapsed "$t0" "$t1")}" > "$OUT/timings.json"
must ndctl list -N -X
must e2e setup $DEV --out "$OUT/info.json"
