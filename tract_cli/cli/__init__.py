"""The `tract` command: parse arguments, call the library, render. No logic here.

Errors from the library are TractError: printed as one line on stderr
("tract: error: <problem>; <fix>"), exit code 1 (2 for usage), no traceback.
"""
from __future__ import annotations

import os
import sys

import typer

from tract_cli.cli import (agent_cmd, bench_cmd, check_cmd, devices_cmd, doctor_cmd, events_cmd, hash_cmd,
                           info_cmd, init_cmd, inspect_cmd, microbench_cmd, serve_cmd)

app = typer.Typer(
    name="tract",
    help="TraCT: a CXL shared-memory KV cache for disaggregated LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("init")(init_cmd.init)
app.command("info")(info_cmd.info)
app.command("agent")(agent_cmd.agent)
app.command("hash")(hash_cmd.hash_)
app.command("devices")(devices_cmd.devices)
app.command("doctor")(doctor_cmd.doctor)
app.command("inspect")(inspect_cmd.inspect)
app.command("events")(events_cmd.events)
app.command("check")(check_cmd.check)
app.command("bench")(bench_cmd.bench)
app.command("serve-prefill")(serve_cmd.serve_prefill)
app.command("serve-decode")(serve_cmd.serve_decode)
app.command("generate")(serve_cmd.generate)
app.add_typer(microbench_cmd.app, name="microbench")


def _click_exceptions():
    """The usage-error and abort classes of the click that parses our arguments
    (newer typer releases carry their own copy of click)."""
    from types import SimpleNamespace
    try:
        from typer._click.exceptions import NoArgsIsHelpError, UsageError
        from typer.exceptions import Abort
    except ImportError:
        from click.exceptions import Abort, NoArgsIsHelpError, UsageError
    return SimpleNamespace(NoArgsIsHelpError=NoArgsIsHelpError, UsageError=UsageError,
                           Abort=Abort)


def main() -> None:
    """Entry point of the `tract` console script."""
    from tract_cli.core.errors import TractError

    cx = _click_exceptions()

    try:
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except cx.NoArgsIsHelpError:
        sys.exit(2)                      # the help was printed
    except cx.UsageError as err:
        # one line, like every other error: what is wrong, where the help is
        names, ctx = [], err.ctx
        while ctx is not None and ctx.parent is not None:
            names.append(ctx.info_name)
            ctx = ctx.parent
        where = " ".join(["tract", *reversed(names)])
        message = " ".join(err.format_message().split())
        print(f"tract: usage error: {message} (see `{where} -h`)", file=sys.stderr)
        sys.exit(2)
    except cx.Abort:
        print("tract: interrupted", file=sys.stderr)
        sys.exit(130)
    except TractError as err:
        print(f"tract: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("tract: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # a bug: still one line, traceback on request
        if os.environ.get("TRACT_DEBUG"):
            raise
        print(f"tract: internal error: {type(exc).__name__}: {exc}; "
              "rerun with TRACT_DEBUG=1 for a traceback and report it", file=sys.stderr)
        sys.exit(1)
