"""The command line: parse, call the API, print. Errors become one line and exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from onnxpipe.errors import OnnxpipeError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Cut ONNX models into balanced pipeline stages and train them as a pipeline.")
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn OnnxpipeError (and Ctrl-C) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OnnxpipeError as exc:
            if _state["debug"]:
                raise
            err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            sys.exit(130)

    return wrapper


def parse_dims(values: list[str] | None) -> dict[str, int]:
    """`--dim NAME=VALUE` pairs as a dict."""
    dims: dict[str, int] = {}
    for item in values or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().isdigit():
            raise OnnxpipeError(f"--dim {item!r}: expected NAME=VALUE with a positive integer, e.g. --dim batch=8")
        dims[name.strip()] = int(value)
    return dims
