"""Bad input everywhere: every command with a missing, wrong-type,
out-of-range or conflicting argument, a wrong path, or a region of another
format or version answers with one line on stderr and a non-zero exit code,
never a traceback. Table-driven: one row per case, real `tract` processes."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import uuid

import pytest

from conftest import remove_region
from tract_cli.core.pool import Pool


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    region = f"/dev/shm/tract-test-bad-{uuid.uuid4().hex[:8]}.pool"
    Pool.create(region, 4 << 20, "tiny", nodes=2).close()
    other = d / "not-a-region.bin"
    other.write_bytes(b"hello, this is not a TraCT region\n" * 200)
    old = d / "old-version.pool"
    shutil.copy(region, old)
    with open(old, "r+b") as f:                   # a region of format version 1
        f.seek(8)
        f.write(struct.pack("<I", 1))
    bad_toml = d / "bad-model.toml"
    bad_toml.write_text("name = 'x'\nnum_layers = 'many'\n")
    yield {"R": region, "OTHER": str(other), "OLD": str(old), "DIR": str(d),
           "MISSING": str(d / "missing.pool"), "TOML": str(bad_toml)}
    remove_region(region)


# (arguments, {NAME} fields filled from `files`; exit code; a word the one line must contain)
CASES = [
    # init
    ("init", 2, "Missing argument 'path'"),
    ("init {DIR}/x.pool --size 12Q", 2, "size"),
    ("init {DIR}/x.pool --size 4M --nodes 0", 2, "node"),
    ("init {DIR}/x.pool --size 4M --nodes 99", 2, "node"),
    ("init {DIR}/x.pool --size 4M --model no-such-model", 2, "no-such-model"),
    ("init {DIR}/x.pool --size 4M --model {TOML}", 2, "num_layers"),
    ("init {DIR}/x.pool --size 4M --flush-mode sometimes", 2, "flush mode"),
    ("init {DIR}/x.pool --size 4M --stripes 3", 2, "power of two"),
    ("init {DIR}/x.pool --size 4M --dry-run", 2, "--provision"),
    ("init {R} --size 4M --model tiny", 1, "already holds"),
    ("init {DIR}/x.pool --size 4M --group no-such-group-tract", 2, "unknown group"),
    ("init {DIR}/nodir/x.pool --size 4M", 2, "nodir"),
    # info / inspect / check on wrong things
    ("info", 2, "Missing argument"),
    ("info {MISSING}", 2, "does not exist"),
    ("info {OTHER}", 1, "no TraCT region"),
    ("info {OLD}", 1, "version"),
    ("info {DIR}", 2, "is a directory"),
    ("inspect {OTHER}", 1, "no TraCT region"),
    ("inspect {R} --interval 0", 2, "interval"),
    ("inspect {R} --count 3", 2, "--watch"),
    ("events {OTHER} --once", 1, "no TraCT region"),
    ("events {R} --once --tag 1234", 2, "--tag '1234' is not 32 hex digits"),
    ("events {R} --once --interval 0", 2, "--interval must be in"),
    ("events {R} --once --hash-format hex", 2, "--hash-format 'hex'"),
    ("events {R} --once --zmq tcp://*:5557", 2, "--once prints; --zmq serves"),
    ("events {R} --zmq tcp://*:5557", 2, "--zmq serves one model's blocks: --tag is missing"),
    ("events {R} --once --topic " + "t" * 300, 2, "--topic must be at most 256"),
    ("events {R} --once --node 9", 2, "node 9"),
    ("check {OLD}", 1, "version"),
    ("check {MISSING}", 2, "does not exist"),
    # agent
    ("agent --pool {R}", 2, "--node"),
    ("agent --pool {R} --node 7", 2, "node 7"),
    ("agent --pool {R} --node x", 2, "--node"),
    ("agent --pool {R} --node 0 --numa-node 999", 2, "999"),
    ("agent --pool {R} --node 0 --cpus 9-x", 2, "cpu"),
    ("agent --pool {R} --node 0 --takeover-after 0", 2, "--takeover-after 0 is outside"),
    ("agent --pool {R} --node 0 --takeover-after x", 2, "--takeover-after"),
    ("agent --pool {R} --node 0 --takeover-after 0.2 --heartbeat-ms 100", 2, "three heartbeats"),
    ("agent --pool {R} --node 0 --heartbeat-ms 0", 2, "--heartbeat-ms 0 is outside"),
    # hash
    ("hash --scheme nope 1 2 3", 2, "hash scheme"),
    ("hash --block-tokens 0 1 2 3", 2, "block"),
    ("hash abc", 2, "token"),
    # bench
    ("bench --input-len abc", 2, "--input-len"),
    ("bench --input-len -5", 2, "input"),
    ("bench --transport bogus", 2, "unknown transport"),
    ("bench --trace {MISSING}", 2, "missing.pool"),
    ("bench --trace {OTHER}", 2, "line 1"),
    ("bench --workload nope", 2, "nope"),
    ("bench --pool {OTHER}", 1, "no TraCT region"),
    ("bench --qps -1", 2, "qps"),
    ("bench --qps nan", 2, "--qps nan is not a rate"),
    ("bench --qps 1 --qps 2", 2, "a --qps sweep runs on real vLLM"),
    ("bench --engine vllm --qps 1", 2, "--qps is for a synthetic workload or a trace"),
    ("bench --engine vllm --model {MISSING} --load-mode lazy", 2, "--load-mode 'lazy'"),
    ("bench --engine vllm --model {MISSING} --request-gap -1", 2, "--request-gap -1 is not"),
    ("bench --engine vllm --model {MISSING} --request-gap inf", 2, "--request-gap inf is not"),
    ("bench --engine vllm --model {MISSING} --request-gap nan", 2, "--request-gap nan is not"),
    ("bench --engine vllm --model {MISSING} --request-gap 61", 2, "between 0 and 60 seconds"),
    ("bench --engine vllm --trace {MISSING} --request-gap 1", 2, "paces the static"),
    ("bench --engine vllm --workload synthetic --request-gap 1", 2, "paces the static"),
    ("bench --request-gap 1", 2, "--request-gap paces real vLLM"),
    ("bench --engine vllm --workload synthetic --mono-beside", 2, "--mono-beside is for the static"),
    ("bench --mono-beside", 2, "--mono-beside is for real vLLM"),
    ("bench --interleave", 2, "--interleave is for real vLLM"),
    ("bench --engine vllm --model {MISSING} --vllm-kv-cache-gib 0", 2,
     "--vllm-kv-cache-gib 0 is not a KV cache size"),
    ("bench --engine vllm --model {MISSING} --vllm-kv-cache-gib 1e-12", 2, "at least"),
    ("bench --engine vllm --model {MISSING} --vllm-kv-cache-gib inf", 2, "--vllm-kv-cache-gib inf"),
    ("bench --engine vllm --model {MISSING} --vllm-kv-cache-gib nan", 2,
     "--vllm-kv-cache-gib nan is not"),
    ("bench --engine vllm --model {MISSING} --vllm-kv-cache-gib 1e6", 2, "GiB available"),
    ("bench --engine vllm --workload synthetic --vllm-kv-cache-gib -1", 2,
     "--vllm-kv-cache-gib -1 is not"),
    ("bench --vllm-kv-cache-gib 1", 2, "--vllm-kv-cache-gib sizes real vLLM's KV cache"),
    ("bench --engine vllm --model {MISSING} --interleave --mono-beside", 2, "--mono-beside would add"),
    ("bench --engine vllm --workload synthetic --interleave", 2, "--interleave is for the static"),
    # serve
    ("serve-decode --pool {R} --node 1 --prefill http://127.0.0.1:9 --port 99999", 2, "port"),
    ("serve-decode --pool {R} --node 1", 2, "--prefill"),
    ("serve-prefill --pool {OTHER} --node 1", 1, "no TraCT region"),
    ("serve-decode --pool {R} --node 1 --prefill http://127.0.0.1:9 --kv-mode sideways", 2,
     "kv-mode"),
    ("serve-decode --pool {R} --node 1 --prefill ftp://x", 2, "prefill"),
    ("serve-decode --pool {R} --node 1 --prefill http://127.0.0.1:9 --paired", 2,
     "--paired is a flow of vLLM's front door"),
    ("serve-prefill --pool {R} --node 1 --log-level loud", 2, "--log-level"),
    ("generate --max-tokens 0 hello", 2, "max"),
    # devices / doctor / microbench
    ("doctor /nonexistent/x.pool", 2, "does not exist"),
    ("devices --bogus", 2, "No such option"),
    ("microbench copy --block-size 0", 2, "block"),
    ("microbench index --model tiny --input-len 64 --region-size 1M", 2, "--region-size"),
    ("microbench kvpages --page-tokens 127", 2, "--page-tokens"),
    ("microbench kvpages --input-len 64", 2, "no whole page"),
    ("microbench kvpages --flush-mode none --flush-mode sideways", 2, "unknown flush mode"),
    ("microbench kvpages --rounds 0", 2, "--rounds"),
    ("microbench nope", 2, "No such command"),
    ("nope", 2, "No such command"),
]


@pytest.mark.parametrize("argv,code,word", CASES, ids=[c[0].split(" {")[0][:40] + f"#{i}"
                                                       for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_an_exit_code(files, argv, code, word):
    args = [a.format(**files) for a in argv.split()]
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", *args], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    err = res.stderr.strip()
    assert "Traceback" not in err, err
    assert res.returncode == code, f"exit {res.returncode}, wanted {code}: {err}"
    assert len(err.splitlines()) == 1, f"not one line:\n{err}"
    assert err.startswith("tract: ") and word.lower() in err.lower(), err
