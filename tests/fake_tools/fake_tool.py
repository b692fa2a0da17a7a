#!/usr/bin/env python3
"""A test double for cxl / ndctl / daxctl: replays recorded outputs.

TRACT_FAKE_SCRIPT names a JSON file {"<command line>": [response, ...]}; each
call takes the first response of its command line (the last one repeats), so
a list can show a region only after create-region ran.  Every call is
appended to TRACT_FAKE_LOG.  A response is {"rc": N, "stdout": .., "stderr": ..}.
"""
import json
import os
import sys

tool = sys.argv[1]                      # the wrapper passes the tool's name
line = " ".join([tool] + sys.argv[2:])
with open(os.environ["TRACT_FAKE_LOG"], "a") as log:
    log.write(line + "\n")
script_path = os.environ["TRACT_FAKE_SCRIPT"]
with open(script_path) as f:
    script = json.load(f)
responses = script.get(line)
if not responses:
    sys.stderr.write(f"{tool}: fake has no response for: {line}\n")
    sys.exit(127)
resp = responses[0]
if len(responses) > 1:
    script[line] = responses[1:]
    with open(script_path, "w") as f:
        json.dump(script, f)
sys.stdout.write(resp.get("stdout", ""))
sys.stderr.write(resp.get("stderr", ""))
sys.exit(resp.get("rc", 0))
