"""The non-coherence mutation test: for each flush and invalidate of the
lock, publish and pin paths (the sites of `enum tract_site` in
native/internal.h), a run with TRACT_MUTANT=<site> removes exactly that one;
the protocol test that predicts its absence, under the non-coherence
simulator, must fail.  A mutant counts as caught only when a test PREDICTED
names for it fails (an assertion or a bounded wait's error, within the time
limit): a hang, a setup error or another test's failure is not a catch.

    .venv/bin/python tests/mutation.py [--sites 1,5,9] [--timeout 120] [--json F]
    .venv/bin/python tests/mutation.py --discover    # which tests fail, per site

A baseline run without a mutant must pass first, or nothing is measured.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the multi-process protocol tests (most under the simulator; the walk-order
# ones need none: the order is the manager's, not a cache's)
TESTS = ["tests/test_payload_ledger.py",
         "tests/test_lock.py::test_counters_are_exact_under_the_lock[sim]",
         "tests/test_lock.py::test_a_walk_is_granted_its_stripes_in_order_so_no_wait_cycle_forms",
         "tests/test_lock.py::test_a_walk_request_waits_for_the_one_it_names_by_its_sequence",
         "tests/test_index.py::test_prefill_and_decode_processes_share_prefixes[sim]",
         "tests/test_handoff.py::test_handoffs_between_processes[copying-sim]",
         "tests/test_handoff.py::test_handoffs_between_processes[zero-copy-sim]",
         "tests/test_noncoherence.py",
         "tests/test_takeover.py::test_under_the_simulator_every_party_sees_the_new_claim"]


_PL = "tests/test_payload_ledger.py::"
_TAKEOVER = "tests/test_takeover.py::test_under_the_simulator_every_party_sees_the_new_claim"
# site -> the tests whose failure its removal predicts (the argument for each
# is docs/PROTOCOLS.md §2; `--discover` lists what fails); REDUNDANT: removals
# no test can catch, by the argument there; every other site must be in one
_NONCOH = "tests/test_noncoherence.py::"
_INDEX_SIM = "tests/test_index.py::test_prefill_and_decode_processes_share_prefixes[sim]"
_HANDOFFS_SIM = ["tests/test_handoff.py::test_handoffs_between_processes[copying-sim]",
                 "tests/test_handoff.py::test_handoffs_between_processes[zero-copy-sim]"]
PREDICTED = {
    "SITE_LOCK_PUBLISH_LOCKED": [_NONCOH + "test_another_host_sees_the_holder_of_a_lock_as_locked",
                                 _TAKEOVER],
    "SITE_INDEX_OBSERVE_LINE": [_INDEX_SIM,
                                _NONCOH + "test_a_stripe_line_another_host_rewrote_is_read_afresh"],
    "SITE_INDEX_PREFETCH": [_INDEX_SIM],
    "SITE_INDEX_OBSERVE_ANCHOR": [_INDEX_SIM],
    "SITE_INDEX_FLUSH_SECTION": [_INDEX_SIM, *_HANDOFFS_SIM,
                                 _NONCOH + "test_a_reused_handoff_record_is_read_afresh"],
    "SITE_INDEX_PUBLISH_ANCHOR": [_INDEX_SIM],
    "SITE_HANDOFF_PUBLISH_RECORD": [*_HANDOFFS_SIM,
                                    _NONCOH + "test_a_reused_handoff_record_is_read_afresh"],
    "SITE_HANDOFF_OBSERVE_RECORD": [_NONCOH + "test_a_reused_handoff_record_is_read_afresh"],
    "SITE_PAYLOAD_EVICT": [_PL + "test_a_reader_never_sees_a_stale_line_of_a_reused_slot",
                           _PL + "test_the_same_key_rewritten_in_the_same_slot_is_a_new_payload",
                           _PL + "test_a_pinned_payload_read_again_is_not_evicted_again"],
    "SITE_INDEX_CLAIM_EPOCH": [_PL + "test_the_same_key_rewritten_in_the_same_slot_is_a_new_payload",
                               _PL + "test_lookup_tags_name_the_bucket_and_a_new_epoch_per_claim"],
    "SITE_PAYLOAD_SWEEP_EVICT": [_PL + "test_a_swept_slot_is_read_afresh_without_an_eviction"],
    "SITE_PAYLOAD_SWEEP_LIVE": [_PL + "test_the_sweep_spares_a_payload_that_is_being_read"],
    "SITE_PAYLOAD_FORGET": [_PL + "test_a_slot_taken_by_a_writer_of_the_node_is_no_longer_evicted"],
    "SITE_LOCK_OBSERVE_CLAIMS": [_TAKEOVER],
    "SITE_MGR_OBSERVE_CLAIMS": [_TAKEOVER],
    "SITE_MGR_OBSERVE_ADOPT": [_TAKEOVER],
    # (the cycle test fails too, at its first check, but its walker then waits
    # out its lock timeout: the sequence test alone is the bounded run's)
    "SITE_MGR_WALK_ORDER": [
        "tests/test_lock.py::test_a_walk_request_waits_for_the_one_it_names_by_its_sequence"],
}
REDUNDANT = {"SITE_LOCK_OBSERVE_SEQ", "SITE_LOCK_OBSERVE_RELEASE", "SITE_MGR_PUBLISH_GRANT"}
# the lock sites whose removal leaves the protocol waiting: the test that
# predicts them bounds each acquire to 5 s, so they fail fast by a lock timeout
_LOCK_BOUND = _NONCOH + "test_a_lock_passes_between_hosts_within_a_bound"
PREDICTED.update({
    "SITE_LOCK_PUBLISH_WAITING": [_LOCK_BOUND],
    "SITE_LOCK_OBSERVE_GRANT": [_LOCK_BOUND],
    "SITE_LOCK_PUBLISH_IDLE": [_LOCK_BOUND],
    "SITE_MGR_OBSERVE_SLOTS": [_LOCK_BOUND],
})


def _classified() -> None:
    """Every site is predicted or redundant: a new site must say which."""
    names = {n for _, n, _ in sites()}
    loose = names - set(PREDICTED) - REDUNDANT
    unknown = (set(PREDICTED) | REDUNDANT) - names
    if loose or unknown:
        raise SystemExit(f"mutation.py: sites not classified {sorted(loose)}, "
                         f"classified but unknown {sorted(unknown)}")


def sites() -> list[tuple[int, str, str]]:
    """(number, name, comment) of every mutation site, read from the C header."""
    text = open(os.path.join(ROOT, "native", "internal.h")).read()
    body = text[text.index("enum tract_site {"):text.index("SITE_COUNT")]
    out = []
    for m in re.finditer(r"(SITE_[A-Z_]+)(?: = \d+)?,\s*(?:/\*\s*(.*?)\s*\*/)?", body):
        if m.group(1) != "SITE_NONE":
            out.append((len(out) + 1, m.group(1), m.group(2) or ""))
    return out


def _pytest(site: int, tests: list[str], timeout: float, stop_first: bool) -> dict:
    """Runs TESTS with TRACT_MUTANT=SITE: outcome, the failed and errored test
    ids, seconds, and the first error line."""
    env = {**os.environ, "TRACT_MUTANT": str(site)}
    t0 = time.monotonic()
    args = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
            *(["-x"] if stop_first else []), *tests]
    try:
        res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "hung", "failed": [], "errors": [],
                "seconds": round(time.monotonic() - t0, 1),
                "why": f"no result within {timeout:.0f} s"}
    lines = res.stdout.splitlines()
    failed = [ln.split()[1] for ln in lines if ln.startswith("FAILED ")]
    errors = [ln.split()[1] for ln in lines if ln.startswith("ERROR ")]
    why = next((ln.strip() for ln in lines if ln.startswith("E ")),
               (lines or [""])[-1])
    return {"outcome": "passed" if res.returncode == 0 else "failed", "failed": failed,
            "errors": errors, "seconds": round(time.monotonic() - t0, 1), "why": why[:200]}


def run(site: int, timeout: float, name: str | None = None, stop_first: bool = False) -> dict:
    """The mutant's run: site 0 (the baseline) runs every protocol test; a
    site runs its predicted tests, and is caught only if one of them failed
    (STOP_FIRST: at the first that fails, which is a catch: every test run is
    a predicted one)."""
    if site == 0:
        return _pytest(site, TESTS, timeout, stop_first=False) | {"caught": False}
    if name not in PREDICTED:
        raise ValueError(f"{name} names no predicted test (it is redundant)")
    want = PREDICTED[name]
    r = _pytest(site, want, timeout, stop_first=stop_first)
    r["caught"] = r["outcome"] == "failed" and any(
        f == w or f.startswith(w + "[") for f in r["failed"] for w in want)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", default="all", help="comma-separated site numbers, or all")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant")
    ap.add_argument("--discover", action="store_true",
                    help="run every protocol test against each mutant and list what fails")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    _classified()
    known = sites()
    chosen = known if a.sites == "all" else [s for s in known
                                              if str(s[0]) in a.sites.split(",")]
    base = run(0, a.timeout)
    if base["outcome"] != "passed":
        print(f"mutation: the baseline run fails ({base['why']}); fix that first", file=sys.stderr)
        return 2
    results = []
    for num, name, what in chosen:
        if a.discover:
            r = _pytest(num, TESTS, a.timeout, stop_first=False)
            print(f"{num:2d} {name:30s} {r['outcome']} ({r['seconds']} s): "
                  f"{', '.join(r['failed']) or '-'}", flush=True)
        elif name in REDUNDANT:
            why = "redundant by docs/PROTOCOLS.md §2"
            r = {"outcome": "not run", "caught": False, "failed": [], "seconds": 0, "why": why}
            print(f"{num:2d} {name:30s} not counted: {why}", flush=True)
        else:
            r = run(num, a.timeout, name)
            print(f"{num:2d} {name:30s} {'caught' if r['caught'] else 'MISSED'} ({r['outcome']}, "
                  f"{r['seconds']} s): {r['why'][:90]}", flush=True)
        r.update(site=num, name=name, what=what)
        results.append(r)
    if a.discover:
        return 0
    caught = sum(r["caught"] for r in results)
    expected = sum(r["name"] in PREDICTED for r in results)
    summary = {"sites": len(results), "caught": caught, "expected": expected,
               "baseline_s": base["seconds"], "results": results}
    print(f"caught {caught} of {expected} mutants that a test predicts; "
          f"{len(results) - expected} redundant")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if caught == expected else 1


if __name__ == "__main__":
    sys.exit(main())
