"""Renderers of a snapshot: Rich tables for the one-shot and live views."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from tract_cli.core.units import format_duration


def _s(seconds: float | None) -> str:
    """A duration cell ('-' when the snapshot has none)."""
    return "-" if seconds is None else format_duration(seconds)


def nodes_table(v: dict) -> Table:
    claim = v.get("current_claim")
    t = Table(title=f"nodes (manager: node {v['manager_node']}"
                    f"{f', claim {claim}' if claim else ''})", title_justify="left")
    for c in ("node", "state", "agent pid", "epoch", "heartbeat age", "live", "role", "claim",
              "started by"):
        t.add_column(c)
    for r in v["nodes"]:
        role = "manager" if r["manager"] else ("standby" if r.get("standby") else "")
        life = ("a worker (stops when the node is idle)" if r.get("started_by") == "worker"
                else "hand (runs until stopped)")
        state = r["state"]
        if state == "dead":
            # declared dead by the lock manager: how long ago, what came back
            state = (f"[red]dead[/] ({_s(r['declared_dead_age_s'])} ago; recovered: "
                     f"{', '.join(r['recovered']) or 'nothing yet'})")
        t.add_row(str(r["node"]), state, str(r["agent_pid"]), str(r["epoch"]),
                  _s(r["heartbeat_age_s"]), "yes" if r["live"] else "[red]stale[/]",
                  role, r.get("claim") or "-", life)
    return t


def locks_table(v: dict) -> Table:
    t = Table(title=f"locks ({len(v['locks'])} of {v['lock_count']} ever used)",
              title_justify="left")
    for c in ("lock", "holder", "held", "waiting", "grants", "flags"):
        t.add_column(c)
    for r in v["locks"]:
        holder = "-" if r["holder_node"] is None else f"node {r['holder_node']} pid {r['holder_pid']}"
        waiting = ", ".join(f"node {w['node']} ({_s(w['waited_s'])})" for w in r["waiting"]) or "-"
        t.add_row(f"{r['name']} [{r['id']}]", holder, _s(r["held_s"]), waiting, str(r["grants"]),
                  "[red]" + "; ".join(r["flags"]) + "[/]" if r["flags"] else "")
    return t


def index_table(v: dict) -> Group:
    t = Table(title=f"index ({v['buckets']} buckets in {v['stripes']} stripes)", title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    st = v["states"]
    t.add_row("ready / pending / tombstone / empty",
              f"{st['READY']} / {st['PENDING']} / {st['TOMBSTONE']} / {st['EMPTY']}")
    t.add_row("load factor", f"{100 * v['load_factor']:.1f} %")
    t.add_row("max probe length", str(v["max_probe_length"]))
    t.add_row("pinned blocks", f"{v['pinned_blocks']} ({v['pins_total']} pins; by node "
              f"{v['pinned_by_node'] or '-'})")
    c = v["counters"]
    t.add_row("lookups / hits / inserts / evictions",
              f"{c['lookups']} / {c['hits']} / {c['inserts']} / {c['evictions']}")
    ages = [s["oldest_age_s"] for s in v["lru"] if s["oldest_age_s"] is not None]
    t.add_row("oldest LRU entry", _s(max(ages)) if ages else "-")
    t.add_row("probe lengths", " ".join(str(x) for x in v["probe_length_histogram"][:12]))
    e = v["events"]
    t.add_row("KV event logs", f"{e['appended']} events appended, {e['kept']} kept "
              f"({e['per_stripe_capacity']} a stripe)")
    return Group(t, Text(f"occupancy |{v['occupancy_map']}|"))


def alloc_table(v: dict) -> Table:
    t = Table(title=f"allocator ({v['slots']} slots)", title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("free / taken / in use", f"{v['free']} / {v['taken']} / {v['in_use']}")
    t.add_row("claimed, not in use (node free lists)", str(v["claimed_not_in_use"]))
    for node, d in v["by_node"].items():
        t.add_row(f"node {node}", f"{d['claimed']} claimed, {d['in_use']} in use")
    t.add_row("batches claimed / released", f"{v['batches_claimed']} / {v['batches_released']}")
    t.add_row("free runs (largest)", f"{v['free_runs']} ({v['largest_free_run']})")
    t.add_row("bitmap, owners, header agree", "yes" if v["consistent"] else "[yellow]changing[/]")
    return t


def handoffs_table(v: dict) -> Table:
    t = Table(title=f"handoffs ({len(v['in_flight'])} in flight of {v['capacity']})",
              title_justify="left")
    for c in ("record", "state", "owner", "request", "blocks", "tokens", "age", "expires in"):
        t.add_column(c)
    for r in v["in_flight"]:
        t.add_row(str(r["record"]), r["state"], f"node {r['owner_node']} pid {r['owner_pid']}",
                  r["request_id"][:12], str(r["blocks"]), str(r["tokens"]), _s(r["age_s"]),
                  _s(r["expires_in_s"]))
    return t


RENDER = {"nodes": nodes_table, "locks": locks_table, "index": index_table,
          "alloc": alloc_table, "handoffs": handoffs_table}


def render(snap: dict) -> Group:
    parts = [Text(f"{snap['region']} ({snap['medium']}, model {snap['model']}) — snapshot "
                  f"{format_duration(snap['snapshot_ms'] / 1e3)}", style="bold")]
    for name, fn in RENDER.items():
        if name in snap:
            parts.append(fn(snap[name]))
    return Group(*parts)
