# One host: from a bare CXL memdev to a formatted TraCT region on /dev/dax0.0,
# the platform report, and a put / lookup / read round trip on the device.
# The two-host scenario's first guest (role setup) runs this too: its round
# trip also creates the objects the two hosts share.  Each tract
# command costs ~45 s of Python start-up under the emulator: each runs once
# (must_json keeps the JSON the host reads).
. "$TRACT_VM_PROJECT/tools/cxl-vm/guest/lib.sh"

must uname -r
must cxl list -M
t0=$(now)
must tract init $DEV --provision --model tiny --nodes 2 --quiet
t1=$(now)
echo "{\"provision_s\": $(elapsed "$t0" "$t1")}" > "$OUT/timings.json"
must daxctl list -D
must ndctl list -N -X
must_json "$OUT/device.json" tract devices --json
must_json "$OUT/info.json" tract info $DEV --json
if [ "$TRACT_VM_ROLE" = setup ]; then
    must e2e roundtrip $DEV --out "$OUT/roundtrip.json" --shared-out "$OUT/shared.json"
else
    must e2e roundtrip $DEV --out "$OUT/roundtrip.json"
fi
must tract check $DEV
