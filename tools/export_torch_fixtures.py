"""Export the small torch models whose ONNX files the tests load (tests/data/torch_*.onnx).

torch is not a dependency of onnxpipe: run this in an environment that has it
(`pip install torch onnxscript`), then commit the files it writes. The tests check that
real exports load, split, chain and train; this script is how those files were made.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).resolve().parent.parent / "tests" / "data"


class TinyGPT(nn.Module):
    """Two pre-LN decoder blocks with a causal mask and a tied output projection, ending in the loss."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos
        h = self.blocks(h, mask=self.mask, is_causal=True)
        logits = self.norm(h) @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class SmallCNN(nn.Module):
    """Conv + residual + pooling + linear head, the shape of a ResNet stem."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = torch.relu(h + self.body(h))
        return self.head(h.mean(dim=(2, 3)))


def main() -> None:
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    gpt = TinyGPT().eval()
    ids = torch.randint(0, 64, (4, 16))
    torch.onnx.export(gpt, (ids, ids), OUT / "torch_gpt_legacy.onnx", input_names=["ids", "labels"], output_names=["loss"],
                      opset_version=17, dynamo=False)
    cnn = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    torch.onnx.export(cnn, (x,), OUT / "torch_cnn_dynamic.onnx", input_names=["x"], output_names=["logits"],
                      opset_version=18, dynamo=False, dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
    program = torch.onnx.export(cnn, (x,), dynamo=True, opset_version=20, external_data=True)
    program.save(str(OUT / "torch_cnn_dynamo.onnx"), external_data=True)
    for path in sorted(OUT.glob("torch_*")):
        print(path.name, path.stat().st_size)


if __name__ == "__main__":
    main()
