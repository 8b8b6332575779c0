"""Pipelined training on onnxruntime-training: stage graphs, workers, transport, optimizer, checkpoints."""
