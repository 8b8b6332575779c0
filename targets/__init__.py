"""Bundled cluster descriptions (`*.toml`), read through `onnxpipe.target`."""
