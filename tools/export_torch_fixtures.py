"""Export the small torch models whose ONNX files the tests load (tests/data/torch_*.onnx).

torch is not a dependency of onnxpipe: run this in an environment that has it
(`pip install torch onnxscript transformers`), then commit the files it writes. The tests check that
real exports load, split, chain and train; this script is how those files were made.

The GPT-2 fixtures (transformers' GPT2LMHeadModel, 2 layers, vocab 256, d 64, freshly initialised)
are exported twice by the dynamo exporter, with its default optimisation (which merges the
identical LayerNorm ones and zeros into one initializer each) and with `optimize=False` (which keeps
SplitToSequence/SequenceAt). Beside them, `torch_gpt2.npz` holds three training batches (and the LayerNorm
weights after training) and `torch_gpt2.json` the losses PyTorch's own SGD reaches on them: pipelined training must reproduce them.
`torch_gpt_legacy.npz` / `.json` hold three batches and PyTorch's SGD losses for the TorchScript TinyGPT.
The T5 fixture (transformers' T5ForConditionalGeneration, 2 + 2 layers, vocab 64, d 32, freshly initialised) is
exported by the TorchScript exporter, as many users still export T5, with its loss as the output, and
`torch_t5.npz` / `torch_t5.json` likewise: its attention adds the relative position bias [1, heads, q, k] under a
broadcast Where, which onnxruntime-training cannot differentiate as exported (`onnxpipe.rewrites`), and the exporter
writes its head, tied to the embedding, as a transposed copy of its own (`onnxpipe.initializers` ties it back).
The UNet fixture (GroupNorm, bilinear and nearest upsampling, a grouped ConvTranspose with output padding, an MSE
loss) is exported by the dynamo exporter, with `torch_unet.npz` / `torch_unet.json` likewise: onnxruntime-training has
no gradient for InstanceNormalization (GroupNorm's export) and no CPU kernels for the gradients of Resize and
ConvTranspose, which `onnxpipe.rewrites` writes out in ops that have them.
The GRU fixture (an embedding, a two-layer bidirectional batch-first GRU, a linear head, an MSE loss; TorchScript
exporter) likewise: onnxruntime-training has no GRU gradient, and `onnxpipe.recurrent` unrolls its steps.
The LSTM fixture (an embedding, a two-layer batch-first LSTM, a linear head, an MSE loss; dynamo exporter, which
reorders the gates of the weights it does not fold with Slices and feeds one zeros tensor as both initial states)
likewise: the profiler left those weights out of its gradient graph, and onnxruntime crashed running it.
The activations fixture (HardSwish and an SE block's HardSigmoid as in MobileNetV3, PReLU, PixelShuffle, ELU, SELU,
CELU, Mish, Softplus, torch.amax and an adaptive max pool; an MSE loss) is exported by both exporters, into
`torch_activations.onnx` (dynamo) and `torch_activations_ts.onnx` (TorchScript, opset 17), with one `.npz` / `.json`:
onnxruntime-training has no gradient for any of those ops as exported, and `onnxpipe.rewrites` writes them out.
The sequence fixture (a bidirectional LSTM, attention with a causal-mask buffer, torch.flip, a reflect pad, a grouped
dilated Conv1d, an RMSNorm and a LayerNorm without weights; dynamo exporter) likewise: each is a pattern
onnxruntime-training got wrong or could not train as exported, which `onnxpipe.lowerings`, `onnxpipe.recurrent` and
`onnxpipe.buffers` handle.
The Conv1D biases are drawn at random instead of torch's zeros: the default optimisation deletes an
all-zero Gemm bias (onnxscript's RemoveOptionalBiasFromGemm), and a weight missing from the file
cannot be trained like PyTorch trains it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
import transformers.utils
import transformers.utils.import_utils

# transformers imports torchvision when it is installed, and a torchvision built for another torch fails to
# import; GPT-2 needs none of it.
transformers.utils.is_torchvision_available = transformers.utils.import_utils.is_torchvision_available = lambda: False
from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration  # noqa: E402

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


def _save_reference(name: str, arrays: dict, *, lr: float, batch: int, steps: int, losses: list[float], **extra: object) -> None:
    """A fixture's batches (`name.npz`) and what PyTorch's SGD reached on them (`name.json`), as `tests/torch_reference.py`
    reads them."""
    import json

    import numpy as np

    np.savez(OUT / f"{name}.npz", **arrays)
    info = {"optimizer": "sgd", "lr": lr, "batch": batch, "steps": steps, "losses": losses, **extra, "torch": torch.__version__}
    (OUT / f"{name}.json").write_text(json.dumps(info, indent=1) + "\n")


def _sgd_losses(model: nn.Module, batches: list[tuple[torch.Tensor, ...]], lr: float) -> list[float]:
    """PyTorch's own SGD, one step per batch (`model(*batch)` is the loss): the losses pipelined training must reproduce."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        sgd.zero_grad()
        loss = model(*batch)
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses


GPT2_STEPS, GPT2_BATCH, GPT2_SEQ, GPT2_LR = 3, 8, 16, 0.1


class GPT2WithLoss(nn.Module):
    """transformers' GPT-2 language model ending in the mean token cross-entropy against `labels`."""

    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=256, n_positions=GPT2_SEQ, n_embd=64, n_layer=2, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt = GPT2LMHeadModel(config)
        with torch.no_grad():
            for name, param in self.gpt.named_parameters():
                if name.endswith(("c_attn.bias", "c_fc.bias", "c_proj.bias")):
                    param.normal_(0.0, 0.02)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(input_ids=input_ids).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def export_gpt2() -> None:
    """Both GPT-2 exports, the training batches, and PyTorch's SGD losses on them (full batch per step)."""
    torch.manual_seed(0)
    model = GPT2WithLoss().eval()
    ids = torch.randint(0, 256, (GPT2_STEPS, GPT2_BATCH, GPT2_SEQ))
    labels = torch.randint(0, 256, (GPT2_STEPS, GPT2_BATCH, GPT2_SEQ))
    batch = torch.export.Dim("batch")
    for name, optimize in (("torch_gpt2_dynamo.onnx", True), ("torch_gpt2_unoptimized.onnx", False)):
        program = torch.onnx.export(model, (ids[0], labels[0]), dynamo=True, optimize=optimize, opset_version=20,
                                    input_names=["input_ids", "labels"], output_names=["loss"],
                                    dynamic_shapes={"input_ids": {0: batch}, "labels": {0: batch}})
        program.save(str(OUT / name))
    names = [n for n, _ in model.named_parameters()]
    losses = _sgd_losses(model, [(ids[step], labels[step]) for step in range(GPT2_STEPS)], GPT2_LR)
    # The LayerNorm weights after training: the ones an exporter's merge would have kept equal.
    norms = {f"final/{n}": p.detach().numpy() for n, p in model.named_parameters() if ".ln_" in n}
    _save_reference("torch_gpt2", dict(input_ids=ids.numpy(), labels=labels.numpy(), **norms), lr=GPT2_LR, batch=GPT2_BATCH, steps=GPT2_STEPS,
                    losses=losses, parameters=names)


def legacy_reference(model: nn.Module, steps: int = 3, lr: float = 0.1) -> None:
    """Three batches for the TorchScript TinyGPT and the losses PyTorch's SGD reaches on them (`torch_gpt_legacy.npz`,
    `.json`). Its two layers are deep copies, equal when fresh, which the exporter stores once (read through Identity
    nodes), and its head, tied to the embedding, is written as a transposed copy."""
    import copy
    model = copy.deepcopy(model)
    ids, labels = torch.randint(0, 64, (steps, 4, 16)), torch.randint(0, 64, (steps, 4, 16))
    losses = _sgd_losses(model, [(ids[step], labels[step]) for step in range(steps)], lr)
    _save_reference("torch_gpt_legacy", dict(ids=ids.numpy(), labels=labels.numpy()), lr=lr, batch=4, steps=steps, losses=losses)


T5_STEPS, T5_BATCH, T5_SEQ, T5_LR = 3, 4, 8, 0.1


class T5WithLoss(nn.Module):
    """transformers' T5 with its language-model head, ending in the mean token cross-entropy against `labels`."""

    def __init__(self) -> None:
        super().__init__()
        config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                          relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False)
        self.t5 = T5ForConditionalGeneration(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.t5(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, use_cache=False, return_dict=False)[0]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def export_t5() -> None:
    """The T5 export, the training batches (a padded tail in the attention mask), and PyTorch's SGD losses on them."""
    torch.manual_seed(0)
    model = T5WithLoss().eval()
    shape = (T5_STEPS, T5_BATCH, T5_SEQ)
    ids, decoder_ids, labels = (torch.randint(0, 64, shape) for _ in range(3))
    mask = torch.ones(shape, dtype=torch.int64)
    mask[:, :, -2:] = 0
    names = ["input_ids", "attention_mask", "decoder_input_ids", "labels"]
    torch.onnx.export(model, (ids[0], mask[0], decoder_ids[0], labels[0]), str(OUT / "torch_t5.onnx"), dynamo=False, opset_version=17,
                      input_names=names, output_names=["loss"], dynamic_axes={name: {0: "batch"} for name in names})
    losses = _sgd_losses(model, [(ids[step], mask[step], decoder_ids[step], labels[step]) for step in range(T5_STEPS)], T5_LR)
    arrays = dict(input_ids=ids.numpy(), attention_mask=mask.numpy(), decoder_input_ids=decoder_ids.numpy(), labels=labels.numpy())
    _save_reference("torch_t5", arrays, lr=T5_LR, batch=T5_BATCH, steps=T5_STEPS, losses=losses)


UNET_STEPS, UNET_BATCH, UNET_LR = 3, 4, 0.1


class SmallUNet(nn.Module):
    """Down by a strided Conv, up three ways (bilinear, nearest, a grouped ConvTranspose), GroupNorm between, MSE loss."""

    def __init__(self) -> None:
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.SiLU())
        self.down2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.GroupNorm(4, 16), nn.SiLU())
        self.bilinear = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.nearest = nn.Upsample(scale_factor=2, mode="nearest")
        self.transposed = nn.ConvTranspose2d(16, 8, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.head = nn.Conv2d(16 + 16 + 8 + 8, 4, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(a)
        out = self.head(torch.cat([self.bilinear(b), self.nearest(b), self.transposed(b), a], 1))
        return nn.functional.mse_loss(out, target)


def export_unet() -> None:
    """The UNet export (dynamo, a symbolic batch), its training batches, and PyTorch's SGD losses on them."""
    torch.manual_seed(0)
    model = SmallUNet().eval()
    x, target = torch.randn(UNET_STEPS, UNET_BATCH, 3, 16, 16), torch.randn(UNET_STEPS, UNET_BATCH, 4, 16, 16)
    batch = torch.export.Dim("batch")
    program = torch.onnx.export(model, (x[0], target[0]), dynamo=True, input_names=["x", "target"], output_names=["loss"],
                                dynamic_shapes=({0: batch}, {0: batch}))
    program.save(str(OUT / "torch_unet.onnx"))
    losses = _sgd_losses(model, [(x[step], target[step]) for step in range(UNET_STEPS)], UNET_LR)
    _save_reference("torch_unet", dict(x=x.numpy(), target=target.numpy()), lr=UNET_LR, batch=UNET_BATCH, steps=UNET_STEPS, losses=losses)


GRU_STEPS, GRU_BATCH, GRU_SEQ, GRU_LR = 3, 4, 6, 0.1


class SmallRNN(nn.Module):
    """Embedding -> a two-layer batch-first recurrent layer (`cell`, with its own width and direction) -> Linear,
    MSE against `target`."""

    def __init__(self, cell: type[nn.Module], hidden: int, bidirectional: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.rnn = cell(8, hidden, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), 3)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return nn.functional.mse_loss(self.head(out), target)


def export_recurrent(name: str, cell: type[nn.Module], hidden: int, bidirectional: bool, dynamo: bool) -> None:
    """A SmallRNN export (a symbolic batch), its training batches, and PyTorch's SGD losses on them."""
    torch.manual_seed(0)
    model = SmallRNN(cell, hidden, bidirectional).eval()
    ids, target = torch.randint(0, 32, (GRU_STEPS, GRU_BATCH, GRU_SEQ)), torch.randn(GRU_STEPS, GRU_BATCH, GRU_SEQ, 3)
    names = ["ids", "target"]
    if dynamo:
        batch = torch.export.Dim("batch")
        program = torch.onnx.export(model, (ids[0], target[0]), dynamo=True, input_names=names, output_names=["loss"],
                                    dynamic_shapes=({0: batch}, {0: batch}))
        program.save(str(OUT / f"{name}.onnx"))
    else:
        torch.onnx.export(model, (ids[0], target[0]), str(OUT / f"{name}.onnx"), dynamo=False, opset_version=17, input_names=names,
                          output_names=["loss"], dynamic_axes={n: {0: "batch"} for n in names})
    losses = _sgd_losses(model, [(ids[step], target[step]) for step in range(GRU_STEPS)], GRU_LR)
    _save_reference(name, dict(ids=ids.numpy(), target=target.numpy()), lr=GRU_LR, batch=GRU_BATCH, steps=GRU_STEPS, losses=losses)


ACT_STEPS, ACT_BATCH, ACT_LR = 3, 4, 0.05


class ActivationNet(nn.Module):
    """Activations onnxruntime-training cannot differentiate as exported, each on the path from the weights to the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.se_reduce, self.se_expand = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.conv = nn.Conv2d(8, 16, 3, padding=1)
        self.prelu = nn.PReLU(16)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        f = nn.functional
        h = f.hardswish(self.stem(x))
        h = h * f.hardsigmoid(self.se_expand(f.relu(self.se_reduce(h.mean((2, 3), keepdim=True)))))
        h = f.pixel_shuffle(self.prelu(self.conv(h)), 2)
        h = f.elu(h) + f.selu(h) + f.celu(h, 1.5) + f.mish(h) + f.softplus(h)
        pooled = torch.cat([torch.amax(h, dim=(2, 3)), f.adaptive_max_pool2d(h, 1).flatten(1)], 1)
        return f.mse_loss(self.head(pooled), target)


def export_activations() -> None:
    """The activations model by both exporters (a symbolic batch), its training batches, and PyTorch's SGD losses."""
    torch.manual_seed(0)
    model = ActivationNet().eval()
    x, target = torch.randn(ACT_STEPS, ACT_BATCH, 3, 8, 8), torch.randn(ACT_STEPS, ACT_BATCH, 3)
    batch = torch.export.Dim("batch")
    program = torch.onnx.export(model, (x[0], target[0]), dynamo=True, input_names=["x", "target"], output_names=["loss"],
                                dynamic_shapes=({0: batch}, {0: batch}))
    program.save(str(OUT / "torch_activations.onnx"))
    torch.onnx.export(model, (x[0], target[0]), str(OUT / "torch_activations_ts.onnx"), dynamo=False, opset_version=17,
                      input_names=["x", "target"], output_names=["loss"], dynamic_axes={"x": {0: "batch"}, "target": {0: "batch"}})
    losses = _sgd_losses(model, [(x[step], target[step]) for step in range(ACT_STEPS)], ACT_LR)
    _save_reference("torch_activations", dict(x=x.numpy(), target=target.numpy()), lr=ACT_LR, batch=ACT_BATCH, steps=ACT_STEPS, losses=losses)


SEQ_STEPS, SEQ_BATCH, SEQ_LR = 3, 4, 0.05


class SequenceNet(nn.Module):
    """What audio and text models put together, each a pattern onnxruntime-training got wrong or could not train as
    exported: a bidirectional LSTM (its LSTMGrad runs forward ones only), self-attention with a causal-mask buffer (the
    dynamo exporter folds the mask into a tensor of its own), torch.flip (a Slice of step -1), a reflect F.pad, a
    grouped dilated Conv1d (its CPU ConvGrad writes the input gradient past its buffer), an RMSNorm and a LayerNorm
    without weights (whose ones the exporter merges with the RMSNorm's), ending in an MSE loss."""

    def __init__(self, d: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d, d // 2, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        nn.init.normal_(self.attn.in_proj_bias, std=0.1)  # all zeros, the exporter's optimizer deletes a bias
        nn.init.normal_(self.attn.out_proj.bias, std=0.1)
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))
        self.conv = nn.Conv1d(d, d, 3, dilation=2, groups=4)
        self.rms, self.norm = nn.RMSNorm(d), nn.LayerNorm(d, elementwise_affine=False)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.lstm(x)[0]
        h = h + self.attn(h, h, h, attn_mask=self.mask, need_weights=False)[0]
        c = self.conv(nn.functional.pad(torch.flip(h, [1]).transpose(1, 2), (2, 2), mode="reflect")).transpose(1, 2)
        h = self.norm(self.rms(h + c))
        return nn.functional.mse_loss(self.head(h.mean(1)), target)


def export_sequence() -> None:
    """The sequence model by the dynamo exporter (the TorchScript one has no RMSNorm or native attention), its batches and
    PyTorch's SGD losses."""
    torch.manual_seed(0)
    model = SequenceNet().eval()
    x, target = torch.randn(SEQ_STEPS, SEQ_BATCH, 8, 16), torch.randn(SEQ_STEPS, SEQ_BATCH, 3)
    program = torch.onnx.export(model, (x[0][: SEQ_BATCH // 2], target[0][: SEQ_BATCH // 2]), dynamo=True, input_names=["x", "target"],
                                output_names=["loss"])
    program.save(str(OUT / "torch_sequence.onnx"))
    losses = _sgd_losses(model, [(x[step], target[step]) for step in range(SEQ_STEPS)], SEQ_LR)
    _save_reference("torch_sequence", dict(x=x.numpy(), target=target.numpy()), lr=SEQ_LR, batch=SEQ_BATCH, steps=SEQ_STEPS, losses=losses)


def main() -> None:
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    gpt = TinyGPT().eval()
    ids = torch.randint(0, 64, (4, 16))
    torch.onnx.export(gpt, (ids, ids), OUT / "torch_gpt_legacy.onnx", input_names=["ids", "labels"], output_names=["loss"],
                      opset_version=17, dynamo=False)
    legacy_reference(gpt)
    cnn = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    torch.onnx.export(cnn, (x,), OUT / "torch_cnn_dynamic.onnx", input_names=["x"], output_names=["logits"],
                      opset_version=18, dynamo=False, dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
    program = torch.onnx.export(cnn, (x,), dynamo=True, opset_version=20, external_data=True)
    program.save(str(OUT / "torch_cnn_dynamo.onnx"), external_data=True)
    export_gpt2()
    export_t5()
    export_unet()
    export_recurrent("torch_gru", nn.GRU, 6, bidirectional=True, dynamo=False)
    export_recurrent("torch_lstm", nn.LSTM, 48, bidirectional=False, dynamo=True)  # wide enough that the exporter keeps the Slices
    export_activations()
    export_sequence()
    for path in sorted(OUT.glob("torch_*")):
        print(path.name, path.stat().st_size)


if __name__ == "__main__":
    main()
