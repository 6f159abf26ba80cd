"""What each section measures, from the shapes: the one plan behind --dry-run, --cpu-smoke and the device run."""

from __future__ import annotations

from gpu_check.carry import natural_rows
from gpu_check.common import ENCODER_FILTER, RECOVER_STEPS, ROWS, SEQUENCE


def build_plan(shapes: dict, smoke: bool = False) -> dict:
    """What each section would measure: the same plan drives --dry-run, --cpu-smoke and the device run."""
    unique = shapes["unique"]
    if smoke:  # the three smallest shapes, two row counts: the code paths, not the figures
        unique = sorted(unique, key=lambda s: s["out"] * s["in"])[:3]
    rows = (1, 8) if smoke else ROWS
    gemm_phases = [
        {"dtype": "float16", "backend": "cusparselt", "rows": "plain"},
        {"dtype": "bfloat16", "backend": "cusparselt", "rows": "plain"},
        {"dtype": "int8", "backend": "cusparselt", "rows": "plain"},
        {"dtype": "float16", "backend": "cusparselt", "rows": "natural"},
        {"dtype": "float16", "backend": "cutlass", "rows": "plain"},
        {"dtype": "int8", "backend": "cusparselt", "rows": "natural"},
    ]
    measurements = sum(
        len(rows) if phase["rows"] == "plain" else len([] if smoke else shape["natural_rows"])
        for phase in gemm_phases
        for shape in unique
    )
    steps = (5, 10) if smoke else RECOVER_STEPS
    return {
        "gemm": {
            "shapes": [{k: s[k] for k in ("out", "in", "ops", "layers", "natural_rows")} for s in unique],
            "rows": list(rows),
            "phases": gemm_phases,
            "measurements": measurements,
        },
        "convert": {"steps": steps[0], "argv": convert_argv("MODEL", "OUT", "CALIB", steps[0], "cuda")},
        "convert_10000": {"steps": steps[1], "when": "the measured step rate says it fits the time left"},
        "train_step": {"blocks": train_blocks(smoke)},
        "minilm_finetune": {"config": finetune_config(smoke)},
    }


def convert_argv(model: str, out: str, calib: str, steps: int | None, device: str | None) -> list[str]:
    argv = ["convert", model, "-o", out, "--calib", calib, "--include", ENCODER_FILTER, "--json"]
    if steps:
        argv += ["--recover", str(steps)]
    if device is not None:
        argv += ["--device", device]
    return argv


def train_blocks(smoke: bool) -> list[dict]:
    """FFN blocks (hidden -> inner -> hidden, GELU) and the tokens per step."""
    if smoke:
        return [{"name": "tiny", "hidden": 64, "inner": 128, "tokens": 64, "steps": 2}]
    return [
        {"name": "MiniLM FFN 384-1536-384", "hidden": 384, "inner": 1536, "tokens": 32 * SEQUENCE, "steps": 20},
        {"name": "MLP 4096-4096-4096", "hidden": 4096, "inner": 4096, "tokens": 64 * SEQUENCE, "steps": 20},
    ]


def finetune_config(smoke: bool) -> dict:
    if smoke:
        return {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128, "batch": 4, "steps": 2}
    return {"layers": 6, "hidden": 384, "heads": 12, "intermediate": 1536, "batch": 32, "steps": 30}


def print_plan(plan: dict, shapes: dict, sections: list[str]) -> None:
    print(
        f"models: {', '.join(shapes['models'])}" + "".join(f"; {m} skipped ({r})" for m, r in shapes["skipped"].items())
    )
    print(f"{'model':8} {'layer':48} {'op':6} {'out x in':>14} {'eligible':>8}  natural rows")
    for layer in shapes["layers"]:
        natural = ",".join(map(str, natural_rows(layer))) if layer["eligible"] else ""
        shape = f"{layer['out']}x{layer['in']}"
        eligible = str(layer["eligible"])
        print(f"{layer['model']:8} {layer['layer'][:48]:48} {layer['op']:6} {shape:>14} {eligible:>8}  {natural}")
    gemm = plan["gemm"]
    print(f"gemm: {len(gemm['shapes'])} distinct eligible shapes, rows {gemm['rows']} and natural rows, "
          f"{gemm['measurements']} dense/sparse pairs in phases "
          + "; ".join(f"{p['dtype']} {p['backend']} {p['rows']}" for p in gemm["phases"]))  # fmt: skip
    print(f"convert: nmdeploy {' '.join(plan['convert']['argv'])} (then without --device if the flag is rejected)")
    print(f"train_step: {', '.join(block['name'] for block in plan['train_step']['blocks'])}")
    print(f"minilm_finetune: {plan['minilm_finetune']['config']}")
    print(f"sections, in order: {', '.join(sections)}")
