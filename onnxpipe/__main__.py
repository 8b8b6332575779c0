"""`python -m onnxpipe` runs the CLI."""

from onnxpipe.cli import app

app()
