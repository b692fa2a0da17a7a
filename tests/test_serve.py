"""Disaggregated serving through the pool: real prefill and decode worker processes
on emulated nodes 1 and 2 (agents on 0, 1, 2), in plain mode and under the
non-coherence simulator.  The answer must be token-for-token the one the same
engine gives in one process."""
from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace

import numpy as np
import pytest

from agents import RunningAgent
from servers import Server, metric, request
from tract_cli.core.pool import Pool
from tract_cli.core.region import remove_region
from tract_cli.serve.engine import Engine, Sampling

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engine():
    return Engine.load(None, MODEL, 0)


def _cluster(simulate: bool, size: int = 64 << 20, flush_mode: str | None = None):
    path = f"/dev/shm/tract-test-serve-{uuid.uuid4().hex[:10]}.pool"
    Pool.create(path, size, MODEL, nodes=4, flush_mode=flush_mode).close()
    agents, servers = [], []
    try:
        agents = [RunningAgent(path, 0, manager=True, simulate=simulate),
                  RunningAgent(path, 1, manager=False, simulate=simulate),
                  RunningAgent(path, 2, manager=False, simulate=simulate)]
        sim = ["--simulate"] if simulate else []
        prefill = Server("serve-prefill", "--pool", path, "--node", "1", *sim)
        servers.append(prefill)
        decode = Server("serve-decode", "--pool", path, "--node", "2", "--prefill", prefill.url, *sim)
        servers.append(decode)
    except BaseException:
        for s in servers:
            s.stop()
        for a in agents:
            a.stop()
        remove_region(path)
        raise
    return SimpleNamespace(path=path, agents=agents, prefill=prefill, decode=decode,
                           simulate=simulate)


def _teardown(c):
    for s in (c.decode, c.prefill):
        s.stop()
    for a in c.agents:
        a.stop()
    remove_region(c.path)


@pytest.fixture(scope="module", params=["plain", "simulator", "clflush"])
def cluster(request):
    """plain: flush mode none; simulator: the non-coherence simulator; clflush:
    the flush mode a device gets, real flush instructions on every path."""
    c = _cluster(request.param == "simulator",
                 flush_mode="clflush" if request.param == "clflush" else None)
    yield c
    _teardown(c)


def complete(c, **body):
    status, out = request(c.decode.url + "/v1/completions", body)
    assert status == 200, out
    return out


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.mark.parametrize("kv_mode", ["copy", "zero-copy"])
def test_disaggregated_tokens_equal_single_process(cluster, engine, kv_mode):
    base = prompt(100 + (kv_mode == "zero-copy"), 80)
    # (prompt length, blocks expected from the pool): shorter than a block, on a
    # block boundary (then a full hit: all but the last block), a partial tail
    # with a partial hit, longer, and full hits with and without a tail
    cases = [(5, 0), (32, 0), (32, 1), (45, 2), (80, 2), (45, 2), (80, 4)]
    computed = 0
    for n, hits in cases:
        out = complete(cluster, prompt=base[:n], max_tokens=12, temperature=0, kv_mode=kv_mode)
        want = engine.generate(base[:n], Sampling(12, 0.0, 0))
        assert out["tract"]["token_ids"] == want, (n, hits)
        assert out["tract"]["hit_blocks"] == hits, (n, out["tract"])
        assert out["usage"] == {"prompt_tokens": n, "completion_tokens": len(want),
                                "total_tokens": n + len(want)}
        computed += n - 16 * hits
        assert out["tract"]["computed_tokens"] == n - 16 * hits


def test_sampling_with_temperature_and_seed_is_reproduced(cluster, engine):
    p = prompt(7, 50)
    for seed in (1, 2):
        out = complete(cluster, prompt=p, max_tokens=10, temperature=0.9, seed=seed)
        assert out["tract"]["token_ids"] == engine.generate(p, Sampling(10, 0.9, seed))


def test_shared_prefix_skips_compute_in_prefill_metrics(cluster, engine):
    _, before = request(cluster.prefill.url + "/metrics")
    shared = prompt(300, 64)
    a = shared + prompt(301, 20)
    b = shared + prompt(302, 9)
    complete(cluster, prompt=a, max_tokens=4, temperature=0)
    out = complete(cluster, prompt=b, max_tokens=4, temperature=0)
    assert out["tract"]["hit_blocks"] == 4
    assert out["tract"]["token_ids"] == engine.generate(b, Sampling(4, 0.0, 0))
    _, after = request(cluster.prefill.url + "/metrics")
    assert metric(after, "computed_tokens_total") - metric(before, "computed_tokens_total") == \
        len(a) + (len(b) - 64)
    assert metric(after, "prefix_hit_tokens_total") - metric(before, "prefix_hit_tokens_total") == 64


def test_tenants_with_different_cache_salts_never_share_prefixes(cluster, engine):
    """vLLM's `cache_salt`: the same prompt under another tenant's salt is a
    miss (its keys differ), under the same salt a hit; tokens are unchanged."""
    p = prompt(500, 64)
    want = engine.generate(p, Sampling(3, 0.0, 0))
    first = complete(cluster, prompt=p, max_tokens=3, temperature=0, cache_salt="tenant-a")
    assert first["tract"]["hit_blocks"] == 0
    other = complete(cluster, prompt=p, max_tokens=3, temperature=0, cache_salt="tenant-b")
    unsalted = complete(cluster, prompt=p, max_tokens=3, temperature=0)
    again = complete(cluster, prompt=p, max_tokens=3, temperature=0, cache_salt="tenant-a")
    assert other["tract"]["hit_blocks"] == 0 and unsalted["tract"]["hit_blocks"] == 0
    assert again["tract"]["hit_blocks"] == 3          # all but the last block
    for out in (first, other, unsalted, again):
        assert out["tract"]["token_ids"] == want
    status, err = request(cluster.decode.url + "/v1/completions",
                          {"prompt": p, "max_tokens": 1, "cache_salt": ""})
    assert status == 400 and err["error"]["param"] == "cache_salt"


def test_concurrent_requests_are_served_correctly(cluster, engine):
    prompts = [prompt(400 + i, 30 + 13 * i) for i in range(4)]
    results, errors = {}, []

    def run(i):
        try:
            results[i] = complete(cluster, prompt=prompts[i], max_tokens=8, temperature=0)
        except BaseException as exc:       # reported below, with the others
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 4, errors
    for i, p in enumerate(prompts):
        assert results[i]["tract"]["token_ids"] == engine.generate(p, Sampling(8, 0.0, 0))


def test_no_pins_or_handoffs_left_after_requests(cluster):
    with Pool.attach(cluster.path, node=3, readonly=True, prefault=False) as pool:
        from tract_cli.inspect.snapshot import take
        snap = take(pool)
    assert snap["index"]["pinned_blocks"] == 0
    assert snap["handoffs"]["in_flight"] == []


def test_a_metrics_scrape_does_not_hold_up_the_serving_path(engine, region_path):
    """A scrape that is slow inside its pool read (here: held there) must not
    stall a prefill of the same worker: the scrape takes no lock a request needs."""
    from tract_cli.core.handoff import Ticket
    from tract_cli.serve.prefill import PrefillWorker
    Pool.create(region_path, 64 << 20, MODEL, nodes=3).close()
    with RunningAgent(region_path, 0, manager=True):
        w = PrefillWorker(region_path, 1, engine, start_agent=False)
        inside, release = threading.Event(), threading.Event()
        real = w.pool.slots_in_use

        def held_scrape_read():
            inside.set()
            release.wait(60)               # bounded: the test sets it in any case
            return real()
        w.pool.slots_in_use = held_scrape_read
        scrape = threading.Thread(target=w.metrics.render)
        served = {}
        req = threading.Thread(target=lambda: served.update(
            w.handle({"tokens": prompt(7, 40), "max_tokens": 1})))
        try:
            scrape.start()
            assert inside.wait(30), "the scrape never read the pool"
            req.start()
            req.join(timeout=60)
            assert not req.is_alive(), "a prefill waited for a /metrics scrape"
            assert served["prompt_tokens"] == 40
        finally:
            release.set()
            scrape.join(timeout=60)
            req.join(timeout=60)
        assert not scrape.is_alive()
        w.pool.handoffs.ack(Ticket.from_dict(served["ticket"]))
        del w.pool.slots_in_use
        assert metric(w.metrics.render(), "pool_slots_used") == w.pool.slots_in_use()
        w.close()


def test_workers_of_other_weights_share_no_block_and_refuse_each_others_handoffs():
    """Two prefill workers of one KV geometry with other weights (--weights-seed) on
    one region: a prompt one computed is no hit for the other, and a decode worker
    answers 502 rather than load the KV of a prefill worker of other weights."""
    path = f"/dev/shm/tract-test-serve-{uuid.uuid4().hex[:10]}.pool"
    Pool.create(path, 32 << 20, MODEL, nodes=4).close()
    agents, servers = [], []
    try:
        agents = [RunningAgent(path, 0, manager=True)] + [
            RunningAgent(path, n, manager=False) for n in (1, 2, 3)]
        a = Server("serve-prefill", "--pool", path, "--node", "1")
        servers.append(a)
        b = Server("serve-prefill", "--pool", path, "--node", "3", "--weights-seed", "1")
        servers.append(b)
        d = Server("serve-decode", "--pool", path, "--node", "2", "--prefill", b.url)
        servers.append(d)
        body = {"tokens": prompt(700, 64), "max_tokens": 1}
        hits = []
        for server in (a, a, b):
            status, out = request(server.url + "/prefill", body)
            assert status == 200, out
            hits.append(out["hit_blocks"])
        assert hits == [0, 3, 0]           # the same weights hit; the others do not
        status, err = request(d.url + "/v1/completions", {"prompt": prompt(701, 40),
                                                         "max_tokens": 1})
        assert status == 502 and "serves another model" in err["error"]["message"], err
    finally:
        for s in servers:
            s.stop()
        for ag in agents:
            ag.stop()
        remove_region(path)
