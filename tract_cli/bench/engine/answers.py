"""Whether an answer is one vLLM's answer to the same prompt: compared by the
logprobs of each generated token's top candidates (as token ids: byte-level
tokens of a small vocabulary share strings), not only by its text.

Measured on vLLM's CPU backend (tests/vllm_stack.py, tests/test_vllm_faults.py):
a P/D path on unchanged KV answered exactly as one vLLM on the CPUs of those
measurements (on CPUs where vLLM's attention uses AMX, a P/D path that loads
all but the last token, or whole blocks and computes the rest, came within
0.075 nats of one vLLM in `tract bench --engine vllm`: another order of
the attention's sums; the margin to a wrong block is thinner); one wrong block of a
400-token prompt (176 cases) moves the top-20 logprobs of the answer by 0.16
nats at least, 1.2 in the median (its top-5 alone: 0.08 at least).  TOLERANCE,
~3 bf16 steps of a logit, leaves room for another arithmetic order's rounding:
another instruction set's, or a batch's (under load a prompt is computed with
others, or in chunks).
"""
from __future__ import annotations

TOP_LOGPROBS = 20           # candidates a token (vLLM's default --max-logprobs)
TOLERANCE = 0.1             # nats


def gap(got: list[tuple[str, dict]], want: list[tuple[str, dict]],
        tol: float = TOLERANCE) -> tuple[float, list[str]]:
    """How far GOT's answer is from WANT's, each a list of (chosen token, {token:
    logprob} of its top candidates) per generated token: the largest difference
    (nats) between the logprobs both give a token among a step's top ones, and
    what differs beyond TOL, in words.  A token in one side's top list only must
    lie within TOL of the other side's last one.  Steps are compared while both
    chose the same token; where they chose differently with every logprob of that
    step within TOL, it is a near-tie that rounding decided and the comparison
    ends (the texts go their own ways after it); a different choice with a step
    beyond TOL, or answers of different lengths, make the gap infinite."""
    worst, notes = 0.0, []
    for i, ((ta, topa), (tb, topb)) in enumerate(zip(got, want)):
        step = 0.0
        for tok in topa.keys() | topb.keys():
            if tok in topa and tok in topb:
                d = abs(topa[tok] - topb[tok])
            else:
                have, other = (topa, topb) if tok in topa else (topb, topa)
                d = max(0.0, have[tok] - min(other.values()))
            step = max(step, d)
            if d > tol:
                notes.append(f"token {i}: {tok} logprob {topa.get(tok, 'not in top')} where "
                             f"the reference gives {topb.get(tok, 'not in top')}")
        worst = max(worst, step)
        if ta != tb:
            if step > tol or tb not in topa or ta not in topb:
                return float("inf"), notes + [
                    f"token {i}: {ta} ({topa.get(ta, float('nan')):.3f}) where the reference "
                    f"chose {tb} ({topb.get(tb, float('nan')):.3f})"]
            return worst, notes
    if len(got) != len(want):
        return float("inf"), notes + [f"{len(got)} tokens where the reference has {len(want)}"]
    return worst, notes


def near_tie_at(got: list[tuple[str, dict]], want: list[tuple[str, dict]]) -> int | None:
    """The first token where the two chose differently, if any."""
    return next((i for i, ((ta, _), (tb, _)) in enumerate(zip(got, want)) if ta != tb), None)


def compare(got, want) -> dict:
    """GOT against WANT (`calls.Answer`s), one vLLM's answer to the same prompt:
    {"gap": the largest logprob difference (nats) of their tokens' top
    candidates, up to where a near-tie parts them (None: beyond any tolerance: a different choice, a
    different length), "parts_at": that token (None: they never part), "notes":
    what differs beyond the tolerance}.  Answers without tokens (no logprobs
    came) are compared by their text."""
    if not got.tokens or not want.tokens:
        same = bool(got.text) and got.text == want.text
        return {"gap": 0.0 if same else None, "parts_at": None,
                "notes": [] if same else ["no logprobs came, and the texts differ"]}
    steps = lambda a: list(zip(a.tokens, a.top))
    worst, notes = gap(steps(got), steps(want))
    return {"gap": worst if worst != float("inf") else None,
            "parts_at": near_tie_at(steps(got), steps(want)), "notes": notes}
