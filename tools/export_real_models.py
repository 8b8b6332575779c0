"""Export the real-size models the planner benchmark plans (tools/bench_plan.py --exports), into build/exports/.

What a user has: torchvision ResNet-50, MobileNetV2 and ViT-B/16, transformers BERT-base and GPT-2 small,
random weights, exported by `torch.onnx.export` at its default settings (the dynamo exporter, optimised,
weights as external data) with a symbolic batch (and sequence) dim; GPT-2 once more with
`optimize=False`; two encoder-decoders, BART-base the same way and T5-small by the TorchScript
exporter; more families the same way, so that no rule fits one architecture: torchvision ConvNeXt-T (depthwise
convolutions, channel LayerNorm), EfficientNet-B0 (squeeze-excitation) and Swin-T (shifted windows: rolls and
window reshapes), transformers DistilBERT and a LLaMA-style decoder. Plus a GPT-2-XL-shaped model (48 layers, d_model 1600, 1.5 B parameters) built by the zoo
with its weights as external data in a sparse file (`onnxpipe.models.build_sparse`): never drawn nor held in memory.

torch is not a dependency of onnxpipe: run this with an environment that has torch, torchvision,
transformers and onnxscript (run it with that Python: `python tools/export_real_models.py`); the zoo
model alone needs only onnxpipe (`--only gpt2-xl`). The files are large and not committed.

Usage: PYTHON tools/export_real_models.py [--only a,b,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "exports"

#: Example-input sizes of the exports (their batch and sequence dims stay symbolic: --dim binds them).
BATCH, SEQ, IMAGE = 2, 16, 224


def _torchvision() -> object:
    """torchvision's models. A torchvision wheel whose C++ ops do not load (built for another torch)
    fails on import registering fake kernels for them; the models use none, so registration is skipped."""
    import torch

    original = torch.library.register_fake
    torch.library.register_fake = lambda *args, **kwargs: (lambda fn: fn)  # type: ignore[assignment]
    try:
        import torchvision.models as models
    finally:
        torch.library.register_fake = original  # type: ignore[assignment]
    return models


def _export(module: object, args: tuple, path: Path, names: Sequence[str], dynamic: dict, optimize: bool = True) -> None:
    import torch

    module.eval()  # type: ignore[attr-defined]
    program = torch.onnx.export(module, args, dynamo=True, optimize=optimize, input_names=list(names), dynamic_shapes=dynamic)
    program.save(str(path), external_data=True)


def _vision(builder_name: str) -> Callable[[Path], None]:
    def export(path: Path) -> None:
        import torch

        model = getattr(_torchvision(), builder_name)(weights=None)
        batch = torch.export.Dim("batch", min=1, max=4096)
        _export(model, (torch.randn(BATCH, 3, IMAGE, IMAGE),), path, ["images"], {"x": {0: batch}})

    return export


def _text(kind: str, optimize: bool = True) -> Callable[[Path], None]:
    """A transformers model from token ids (and, for the encoders, an attention mask): BERT-base, DistilBERT, GPT-2 small,
    or a LLaMA-style decoder of about GPT-2 small's size (grouped-query attention, RMSNorm, rotary positions, SiLU-gated
    MLP: the family most causal language models exported today share)."""

    def export(path: Path) -> None:
        import torch

        _torchvision()  # transformers imports it when present
        import transformers

        model = {
            "bert": lambda: transformers.BertModel(transformers.BertConfig()),
            "distilbert": lambda: transformers.DistilBertModel(transformers.DistilBertConfig()),
            "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(use_cache=False)),
            "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
                hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                vocab_size=32000, use_cache=False)),
        }[kind]()
        model.config.use_cache = False
        encoder = kind in ("bert", "distilbert")
        batch = torch.export.Dim("batch", min=1, max=4096)
        seq = torch.export.Dim("seq", min=2, max=512 if encoder else 1024)
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
        if encoder:
            mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
            _export(model, (ids, mask), path, ["input_ids", "attention_mask"],
                    {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}, optimize)
        else:
            _export(model, (ids,), path, ["input_ids"], {"input_ids": {0: batch, 1: seq}}, optimize)

    return export


def _seq2seq(kind: str) -> Callable[[Path], None]:
    """An encoder-decoder's last decoder hidden state from (input_ids, attention_mask, decoder_input_ids): BART-base by
    the default exporter; T5-small by the TorchScript one (`dynamo=False`, opset 17), as many users still export it."""

    def export(path: Path) -> None:
        import torch

        _torchvision()  # transformers imports it when present
        import transformers

        if kind == "bart":
            model = transformers.BartModel(transformers.BartConfig(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                                                                   decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072))
        else:
            model = transformers.T5Model(transformers.T5Config())
        model.config.use_cache = False

        class Hidden(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, ids: torch.Tensor, mask: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
                return self.model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, use_cache=False, return_dict=False)[0]

        module = Hidden().eval()
        names = ["input_ids", "attention_mask", "decoder_input_ids"]
        args = (torch.randint(0, model.config.vocab_size, (BATCH, SEQ)), torch.ones(BATCH, SEQ, dtype=torch.int64),
                torch.randint(0, model.config.vocab_size, (BATCH, SEQ)))
        if kind == "bart":
            batch, seq = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("seq", min=2, max=1024)
            _export(module, args, path, names, {"ids": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}, "decoder_ids": {0: batch, 1: seq}})
        else:
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17, input_names=names, output_names=["hidden"],
                              dynamic_axes={name: {0: "batch", 1: "seq"} for name in names})

    return export


def _gpt2_xl(path: Path) -> None:
    from onnxpipe.models import build_sparse

    build_sparse("gpt2", path, layers=48, d_model=1600, heads=25, seq=1024, vocab=50257, batch=1)


EXPORTS: dict[str, Callable[[Path], None]] = {
    "resnet50": _vision("resnet50"),
    "mobilenet_v2": _vision("mobilenet_v2"),
    "vit_b_16": _vision("vit_b_16"),
    "convnext_tiny": _vision("convnext_tiny"),
    "efficientnet_b0": _vision("efficientnet_b0"),
    "swin_t": _vision("swin_t"),
    "bert-base": _text("bert"),
    "distilbert": _text("distilbert"),
    "gpt2": _text("gpt2"),
    "gpt2-unoptimized": _text("gpt2", optimize=False),
    "llama": _text("llama"),
    "bart-base": _seq2seq("bart"),
    "t5-small": _seq2seq("t5"),
    "gpt2-xl": _gpt2_xl,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(EXPORTS), help="comma-separated names: " + ", ".join(EXPORTS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in [n for n in args.only.split(",") if n]:
        if name not in EXPORTS:
            sys.exit(f"unknown export {name!r}; choose from {', '.join(EXPORTS)}")
        path = args.out / f"{name}.onnx"
        for old in (path, path.with_name(path.name + ".data")):
            old.unlink(missing_ok=True)
        started = time.perf_counter()
        EXPORTS[name](path)
        size = sum(p.stat().st_size for p in args.out.glob(f"{name}.onnx*"))
        print(f"{name}: {path} ({size / 2**20:.0f} MiB with data) in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
