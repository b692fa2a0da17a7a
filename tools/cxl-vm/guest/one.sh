# One host: from a bare CXL memdev to a formatted TraCT region on /dev/dax0.0,
# the platform report, and a put / lookup / read round trip on the device.
. "$TRACT_VM_PROJECT/tools/cxl-vm/guest/lib.sh"

must uname -r
must cxl list -M
must tract devices
t0=$(now)
must tract init $DEV --provision --model tiny --nodes 2 --quiet
t1=$(now)
echo "{\"provision_s\": $(elapsed "$t0" "$t1")}" > "$OUT/timings.json"
must daxctl list -D
must tract devices --json
tract devices --json > "$OUT/device.json"
record tract doctor $DEV      # exit 1 when a check fails (TCG lacks some CPU features): keep going
must tract info $DEV
tract info $DEV --json > "$OUT/info.json"
must e2e roundtrip $DEV --out "$OUT/roundtrip.json"
must tract check $DEV
