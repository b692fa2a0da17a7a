"""The non-coherence mutation test: for each flush and invalidate of the
lock, publish and pin paths (the sites of `enum tract_site` in
native/internal.h), a run with TRACT_MUTANT=<site> removes exactly that one;
the protocol tests under the non-coherence simulator must catch it (fail,
or hang and be stopped by their bounded waits).

    .venv/bin/python tests/mutation.py [--sites 1,5,9] [--timeout 120] [--json F]

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
# the multi-process protocol tests that run under the simulator
TESTS = ["tests/test_payload_ledger.py",
         "tests/test_lock.py::test_counters_are_exact_under_the_lock[sim]",
         "tests/test_index.py::test_prefill_and_decode_processes_share_prefixes[sim]",
         "tests/test_handoff.py::test_handoffs_between_processes[copying-sim]",
         "tests/test_handoff.py::test_handoffs_between_processes[zero-copy-sim]",
         "tests/test_noncoherence.py",
         "tests/test_takeover.py::test_under_the_simulator_every_party_sees_the_new_claim"]


def sites() -> list[tuple[int, str, str]]:
    """(number, name, comment) of every mutation site, read from the C header."""
    text = open(os.path.join(ROOT, "native", "internal.h")).read()
    body = text[text.index("enum tract_site {"):text.index("SITE_COUNT")]
    out = []
    for m in re.finditer(r"(SITE_[A-Z_]+)(?: = \d+)?,\s*(?:/\*\s*(.*?)\s*\*/)?", body):
        if m.group(1) != "SITE_NONE":
            out.append((len(out) + 1, m.group(1), m.group(2) or ""))
    return out


def run(site: int, timeout: float) -> dict:
    env = {**os.environ, "TRACT_MUTANT": str(site)}
    t0 = time.monotonic()
    try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                              *TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
        outcome = "passed" if res.returncode == 0 else "failed"
        last = (res.stdout.strip().splitlines() or [""])[-1]
        why = next((line.strip() for line in res.stdout.splitlines()
                    if line.startswith("E ")), last)
    except subprocess.TimeoutExpired:
        outcome, why = "hung", f"no result within {timeout:.0f} s"
    return {"outcome": outcome, "seconds": round(time.monotonic() - t0, 1), "why": why[:200]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", default="all", help="comma-separated site numbers, or all")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    known = sites()
    chosen = known if a.sites == "all" else [s for s in known
                                              if str(s[0]) in a.sites.split(",")]
    base = run(0, a.timeout)
    if base["outcome"] != "passed":
        print(f"mutation: the baseline run fails ({base['why']}); fix that first", file=sys.stderr)
        return 2
    results = []
    for num, name, what in chosen:
        r = run(num, a.timeout)
        r.update(site=num, name=name, what=what, caught=r["outcome"] != "passed")
        results.append(r)
        print(f"{num:2d} {name:30s} {'caught' if r['caught'] else 'MISSED'} ({r['outcome']}, "
              f"{r['seconds']} s): {r['why'][:90]}", flush=True)
    caught = sum(r["caught"] for r in results)
    summary = {"sites": len(results), "caught": caught, "baseline_s": base["seconds"],
               "results": results}
    print(f"caught {caught} of {len(results)} mutants")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
