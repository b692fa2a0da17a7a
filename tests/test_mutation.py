"""A bounded run of the mutation test (tests/mutation.py has all the sites):
removing one flush or invalidate of the lock, publish or pin paths makes the
protocol test under the simulator that predicts it fail (tests/mutation.py
PREDICTED; no other failure, and no hang, counts). These sites fail fast (the
lock sites through a test that bounds each acquire to 5 s); the rest are left
to the full command.  No baseline run here: the suite runs every predicted
test unmutated, and fails where one fails without a mutant (a predicted test
that failed anyway would count as a catch here alone); the full command,
`python tests/mutation.py`, runs one first."""
from __future__ import annotations

import mutation

FAST = {"SITE_LOCK_PUBLISH_LOCKED", "SITE_INDEX_OBSERVE_LINE", "SITE_INDEX_FLUSH_SECTION",
        "SITE_INDEX_PUBLISH_ANCHOR", "SITE_HANDOFF_PUBLISH_RECORD", "SITE_HANDOFF_OBSERVE_RECORD",
        "SITE_LOCK_OBSERVE_CLAIMS", "SITE_MGR_OBSERVE_CLAIMS", "SITE_MGR_OBSERVE_ADOPT",
        "SITE_PAYLOAD_EVICT", "SITE_INDEX_CLAIM_EPOCH", "SITE_PAYLOAD_SWEEP_EVICT",
        "SITE_PAYLOAD_SWEEP_LIVE", "SITE_PAYLOAD_FORGET", "SITE_LOCK_PUBLISH_WAITING",
        "SITE_LOCK_OBSERVE_GRANT", "SITE_LOCK_PUBLISH_IDLE", "SITE_MGR_OBSERVE_SLOTS",
        "SITE_MGR_WALK_ORDER"}


def test_each_removed_flush_or_invalidate_is_caught_by_the_simulator_tests():
    chosen = [s for s in mutation.sites() if s[1] in FAST]
    assert len(chosen) == len(FAST), "a site was renamed: update FAST"
    assert FAST <= set(mutation.PREDICTED), "every fast site names the tests that catch it"
    mutation._classified()
    # no baseline run here: each predicted test runs unmutated in the suite itself,
    # which fails where one fails without a mutant (the full command runs one);
    # each mutant stops at its first failure, a catch (only predicted tests run)
    for num, name, _ in chosen:
        r = mutation.run(num, 300, name, stop_first=True)
        assert r["caught"], (f"removing {name} was not caught by its predicted tests "
                             f"{mutation.PREDICTED[name]}: {r['outcome']}, failed {r['failed']}, "
                             f"errors {r['errors']}: {r['why']}")
