# Sourced by the guest scripts (run in the chroot by /init, see ../init.sh).
# `record CMD...` runs CMD, shows its output on the console and keeps it in
# $TRACT_VM_OUT/NN_<command>.txt, first line "# command: CMD", last "# rc=N",
# the way the recorded tool outputs in tests/data/cxl are kept.
set -u
OUT="$TRACT_VM_OUT"
PROJECT="$TRACT_VM_PROJECT"
E2E="$PROJECT/tools/cxl-vm/guest/e2e.py"
DEV=/dev/dax0.0
# the checkout's package, built in place (pip install -e), wins over any installed copy
if ls "$PROJECT"/tract_cli/_native*.so >/dev/null 2>&1; then
    export PYTHONPATH="$PROJECT"
fi
# internal errors with their traceback in the recorded outputs
export MPLCONFIGDIR=/tmp XDG_CACHE_HOME=/tmp NO_COLOR=1 TRACT_DEBUG=1
SEQ=0

tract() { python3 -m tract_cli.cli "$@"; }
e2e() { python3 "$E2E" "$@"; }      # the TraCT parts of the test: e2e.py

record() {
    SEQ=$((SEQ + 1))
    name=$(printf '%02d_%s' "$SEQ" "$(echo "$*" | sed 's#/dev/##g; s/[^A-Za-z0-9]\{1,\}/_/g' | cut -c1-60)")
    file="$OUT/$name.txt"
    echo "# command: $*" > "$file"
    echo "\$ $*"
    "$@" > "$file.body" 2>&1
    rc=$?
    cat "$file.body" >> "$file"
    cat "$file.body"
    rm -f "$file.body"
    echo "# rc=$rc" >> "$file"
    return $rc
}

# `must CMD...`: record, and stop the script with CMD's exit code if it failed
must() {
    record "$@" || { rc=$?; echo "tract-vm: '$*' failed with exit code $rc"; exit $rc; }
}

# `must_json FILE CMD...`: as must, and CMD's output (JSON) also in FILE
must_json() { f="$1"; shift; must "$@"; sed '1d;$d' "$file" > "$f"; }

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f\n", b - a }'; }
