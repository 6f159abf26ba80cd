"""Decoder language models exported as users export them (tests/decoder_model.py): every verb runs on them, the tied
lm_head / token embedding stays dense with its reason unless asked, and an export that runs only at batch 1 is
calibrated row by row."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")

import decoder_model as dm  # noqa: E402

from nmdeploy.cli import main  # noqa: E402
from nmdeploy.graph.model import OnnxModel  # noqa: E402
from nmdeploy.graph.weights import find_prunable_weights  # noqa: E402
from nmdeploy.masks.arrays import nm_compliance  # noqa: E402

pytestmark = pytest.mark.slow  # each export takes seconds on two cores (once per session)

TIED = "tied to the token embedding that Gather"


def weights_by_node(path) -> dict[str, np.ndarray]:
    """Every prunable weight of the model at ``path`` by its consumer node (the node names of the tiny decoder's
    exports agree across forms; the weights' names do not)."""
    model = OnnxModel.load(path)
    return {w.node_label: np.array(model.read(w.tensor)) for w in find_prunable_weights(model.proto).weights}


def embedding_table(path) -> np.ndarray:
    model = OnnxModel.load(path)
    (gather,) = [node for node in model.proto.graph.node if node.op_type == "Gather" and node.name == "node_embedding"]
    return np.array(model.read(model.index.main.stored(gather.input[0]).tensor))


def feed_for(form: str, ids: np.ndarray) -> dict[str, np.ndarray]:
    return dm.cache_feed(ids) if form == "cache" else {"input_ids": ids}


def write_rows(folder, form: str, ids: np.ndarray, rows_per_file: int):
    folder.mkdir()
    for start in range(0, len(ids), rows_per_file):
        np.savez(folder / f"rows-{start:03d}.npz", **feed_for(form, ids[start : start + rows_per_file]))
    return folder


def run_logits(path, feed) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], feed)[0]


def test_exports_compute_the_torch_model_and_the_batch1_form_fails_at_batch_2():
    import torch

    model = dm.build_decoder()
    ids = dm.token_rows(2, 8, seed=3)
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    for form in dm.FORMS:
        rows = 1 if form == "batch1" else 2
        logits = run_logits(dm.exported(form), feed_for(form, ids[:rows]))
        np.testing.assert_allclose(logits, expected[:rows], atol=1e-4)
    assert (dm.exported("cache").parent / "model.onnx.data").is_file()  # the external-data form
    declared = onnx.load(str(dm.exported("batch1")), load_external_data=False).graph.input[0]
    assert declared.type.tensor_type.shape.dim[0].dim_param == "batch"  # a free batch, as declared
    with pytest.raises(Exception, match="broadcast"):
        run_logits(dm.exported("batch1"), {"input_ids": ids})


@pytest.mark.parametrize("form", dm.FORMS)
def test_the_graph_query_finds_the_tied_embedding_and_only_it(form):
    weights = find_prunable_weights(onnx.load(str(dm.exported(form)))).weights
    assert len(weights) == 7 * dm.LAYERS + 1  # q, k, v, o, gate, up, down per layer, and the lm_head
    tied = [w for w in weights if w.dense_by_default]
    assert [w.node_label for w in tied] == ["node_linear_14"]
    assert tied[0].embedding_lookups == ("node_embedding",)
    assert tied[0].shape == (dm.VOCABULARY, dm.HIDDEN) and tied[0].uses[0].path == ("Transpose",)


def test_inspect_prune_and_convert_leave_the_tied_embedding_dense_and_say_why(tmp_path, capsys):
    source = dm.exported("plain")
    ids = dm.token_rows(16, 16, seed=1)
    data = write_rows(tmp_path / "data", "plain", ids, 16)
    assert main(["inspect", str(source), "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out)["weights"] if r["node_label"] == "node_linear_14")
    assert row["dense_on_purpose"].startswith(TIED)
    table = embedding_table(source)

    for verb, extra in (("prune", []), ("convert", ["--calib", str(data)])):
        out = tmp_path / f"{verb}.onnx"
        assert main([verb, str(source), "-o", str(out), "--require", "--json", *extra]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["passed"] is True
        rows = document["weights" if verb == "prune" else "report"]
        skipped = {r["node"]: r["skipped"] for r in rows if r.get("skipped")}
        assert list(skipped) == ["node_linear_14"] and skipped["node_linear_14"].startswith(TIED)
        assert [d["node"] for d in document["left_dense"]] == ["node_linear_14"]
        assert document["left_dense"][0]["allowed"] is True
        np.testing.assert_array_equal(embedding_table(out), table)  # the token embeddings untouched
        after = weights_by_node(out)
        for node, values in after.items():
            fraction = nm_compliance(values != 0, "2:4", 0).fraction  # MatMul weights [in, out]: axis 0
            assert fraction == (0.0 if node == "node_linear_14" else 1.0), node

    # Asked for, the tied table is made 2:4 along the lm_head's reduction axis (the embedding's hidden axis).
    out = tmp_path / "all.onnx"
    assert main(["convert", str(source), "-o", str(out), "--calib", str(data), "--sparse-lm-head"]) == 0
    assert "dense on purpose" not in capsys.readouterr().out
    assert nm_compliance(embedding_table(out) != 0, "2:4", 1).fraction == 1.0


def test_an_untied_lm_head_is_dense_by_default_with_its_reason_and_converted_when_asked(tmp_path, capsys):
    source = dm.exported("untied")
    (head,) = [w for w in find_prunable_weights(onnx.load(str(source))).weights if w.dense_by_default]
    assert head.vocabulary_scores == "logits" and not head.embedding_lookups
    assert head.shape == (dm.HIDDEN, dm.VOCABULARY)  # stored [in, out] for its MatMul
    data = write_rows(tmp_path / "data", "plain", dm.token_rows(16, 16, seed=1), 16)
    dense_head = weights_by_node(source)[head.node_label]
    for verb, extra in (("prune", []), ("convert", ["--calib", str(data)])):
        out = tmp_path / f"{verb}.onnx"
        assert main([verb, str(source), "-o", str(out), "--require", "--json", *extra]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["passed"] is True
        assert [d["node"] for d in document["left_dense"]] == [head.node_label]
        assert document["left_dense"][0]["reason"].startswith("the lm_head, scoring the vocabulary in 'logits'")
        after = weights_by_node(out)
        np.testing.assert_array_equal(after.pop(head.node_label), dense_head)
        assert all(nm_compliance(values != 0, "2:4", 0).fraction == 1.0 for values in after.values())

    # Asked for (the flag and its older name), the head is made 2:4 along its reduction axis like the other weights.
    for flag in ("--sparse-lm-head", "--sparse-tied-embedding"):
        out = tmp_path / f"all{flag}.onnx"
        assert main(["convert", str(source), "-o", str(out), "--calib", str(data), flag]) == 0
        assert "dense on purpose" not in capsys.readouterr().out
        assert nm_compliance(weights_by_node(out)[head.node_label] != 0, "2:4", 0).fraction == 1.0


def test_the_fidelity_budget_never_takes_the_tied_embedding(tmp_path, capsys):
    source = dm.exported("plain")
    ids = dm.token_rows(32, 16, seed=2)
    data = write_rows(tmp_path / "data", "plain", ids, 8)
    out = tmp_path / "budget.onnx"
    argv = ["convert", str(source), "-o", str(out), "--calib", str(data), "--min-fidelity", "0.5", "--json"]
    assert main(argv) == 0
    layers = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["budget"]["layers"]}
    assert layers["model.lm_head.weight"]["converted"] is False
    assert TIED in layers["model.lm_head.weight"]["reason"]
    np.testing.assert_array_equal(embedding_table(out), embedding_table(source))


def test_a_batch1_export_is_calibrated_row_by_row_to_the_same_model(tmp_path, capsys, caplog):
    ids = dm.token_rows(16, 16, seed=4)
    plain = write_rows(tmp_path / "plain", "plain", ids, 16)
    batched = tmp_path / "batched.onnx"
    assert main(["convert", str(dm.exported("plain")), "-o", str(batched), "--calib", str(plain), "--json"]) == 0
    assert "row_by_row" not in json.loads(capsys.readouterr().out)["summary"]

    rowwise = tmp_path / "rowwise.onnx"
    argv = ["convert", str(dm.exported("batch1")), "-o", str(rowwise), "--calib", str(plain), "--json"]
    with caplog.at_level("WARNING"):
        assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["row_by_row"] is True and summary["calibration_samples"] == 16
    said = [r.getMessage() for r in caplog.records if "row by row" in r.getMessage()]
    assert len(said) == 1 and "runs only one row at a time" in said[0]
    # Both exports hold the same weights: fitted on the same rows, batched or one at a time, they agree.
    expected, found = weights_by_node(batched), weights_by_node(rowwise)
    assert expected.keys() == found.keys()
    for node, values in expected.items():
        np.testing.assert_array_equal(found[node] != 0, values != 0, err_msg=node)
        np.testing.assert_allclose(found[node], values, atol=2e-4, err_msg=node)

    # quantize calibrates it the same way; compare reads one-row shards.
    quantized = tmp_path / "rowwise-int8.onnx"
    assert main(["quantize", str(rowwise), "-o", str(quantized), "--calib", str(plain)]) == 0
    one_row = write_rows(tmp_path / "one-row", "plain", ids[:4], 1)
    capsys.readouterr()
    assert main(["compare", str(dm.exported("batch1")), str(quantized), "--data", str(one_row), "--json"]) == 0
    shards = json.loads(capsys.readouterr().out)
    # compare fed multi-row batches runs them row by row, saying so once, to the figures of one-row shards.
    four_rows = write_rows(tmp_path / "four-rows", "plain", ids[:4], 4)
    caplog.clear()
    with caplog.at_level("WARNING"):
        argv = ["compare", str(dm.exported("batch1")), str(quantized), "--data", str(four_rows), "--json"]
        assert main(argv) == 0
    batches = json.loads(capsys.readouterr().out)
    said = [r.getMessage() for r in caplog.records if "row by row" in r.getMessage()]
    assert len(said) == 1 and "comparing row by row" in said[0]
    assert batches["outputs"][0]["samples"] == shards["outputs"][0]["samples"] == 4
    assert batches["fidelity"]["value"] == pytest.approx(shards["fidelity"]["value"], abs=1e-12)
    # auto judges a causal language model's logits by next-token perplexity where the tokens are text the model
    # predicts; this untrained model on random tokens is no better than a constant there, so neither perplexity nor
    # the KL can judge and the logits' own values do. The int8 model differs: measured, not a copy.
    figure = batches["judged"][0]
    assert figure["metric"] in ("cosine", "scale") and figure["ill_conditioned"] is None
    assert 0 < batches["fidelity"]["value"] < 1 - 1e-6


@pytest.mark.parametrize("piece_bytes", [1 << 28, 40_000])
def test_the_probe_runs_the_model_in_pieces_and_finds_only_the_batch1_form(monkeypatch, piece_bytes):
    from nmdeploy.calibration import batch_probe

    monkeypatch.setattr(batch_probe, "PIECE_BYTES", piece_bytes)
    ids = dm.token_rows(3, 8, seed=6)
    batch1 = OnnxModel.load(dm.exported("batch1"))
    assert len(batch_probe._cut_values(batch1)) == (1 if piece_bytes > 1e6 else 11)  # cuts, then the outputs
    failure = batch_probe.runs_one_row_only(batch1, {"input_ids": ids})
    assert failure is not None and "ONNXRuntimeError" in failure and "\n" not in failure
    for form in ("plain", "cache"):
        assert batch_probe.runs_one_row_only(OnnxModel.load(dm.exported(form)), feed_for(form, ids)) is None
    assert batch_probe.runs_one_row_only(batch1, {"input_ids": ids[:1]}) is None  # one row: nothing to probe


def test_the_budget_probes_the_batch_once_for_all_its_conversions(monkeypatch, tmp_path):
    from nmdeploy.calibration import batch_probe
    from nmdeploy.conversion.controller import Conversion

    probes = []
    probe = batch_probe.runs_one_row_only
    monkeypatch.setattr(batch_probe, "runs_one_row_only", lambda model, batch: probes.append(1) or probe(model, batch))
    data = write_rows(tmp_path / "data", "plain", dm.token_rows(24, 12, seed=7), 8)
    result = Conversion(calibration=str(data), min_fidelity=0.5)(OnnxModel.load(dm.exported("plain")))
    assert any(type(row).__name__ == "BudgetReport" for row in result.report)  # several inner conversions ran
    assert probes == [1]


@pytest.mark.parametrize("form", ["plain", "untied"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantize_keeps_the_lm_head_and_embedding_in_floating_point(precision, form, tmp_path, capsys):
    ids = dm.token_rows(16, 12, seed=8)
    data = write_rows(tmp_path / "data", "plain", ids, 8)
    quantized = tmp_path / "q.onnx"
    argv = ["quantize", str(dm.exported(form)), "-o", str(quantized), "--calib", str(data), "--json"]
    assert main([*argv, "--precision", precision]) == 0
    layers = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["report"] if row["item"] == "layer"}
    reason = TIED if form == "plain" else "the lm_head, scoring the vocabulary in 'logits'"
    (head,) = [row for row in layers.values() if reason in str(row)]
    assert head["weight_precision"] is None or head["weight_precision"] == "float", head
    np.testing.assert_array_equal(embedding_table(quantized), embedding_table(dm.exported(form)))
    assert sum(row["weight_precision"] == precision for row in layers.values()) == 7 * dm.LAYERS
    dense, candidate = run_logits(dm.exported(form), {"input_ids": ids}), run_logits(quantized, {"input_ids": ids})
    cosine = float((dense * candidate).sum() / np.linalg.norm(dense) / np.linalg.norm(candidate))
    assert cosine > 0.98


def test_random_calibration_feeds_a_cache_export_a_prefill(tmp_path, capsys):
    from nmdeploy.runtimes.data import graph_inputs, random_batches

    path = dm.exported("cache")
    (feed,) = random_batches(graph_inputs(OnnxModel.load(path).proto), batch_size=3, count=1, model=path)
    past_names, _ = dm.cache_names()
    rows, length = feed["input_ids"].shape
    assert rows == 3 and feed["input_ids"].max() < dm.VOCABULARY
    np.testing.assert_array_equal(feed["attention_mask"], np.ones((rows, length)))
    np.testing.assert_array_equal(feed["position_ids"], np.tile(np.arange(length), (rows, 1)))
    assert all(feed[name].shape == (rows, dm.KV_HEADS, 0, dm.HEAD_DIM) for name in past_names)
    logits = run_logits(path, feed)
    np.testing.assert_allclose(logits, run_logits(dm.exported("plain"), {"input_ids": feed["input_ids"]}), atol=1e-4)

    out = tmp_path / "out.onnx"
    assert main(["convert", str(path), "-o", str(out), "--calib", "random", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["converted"] == 7 * dm.LAYERS  # every block linear; the tied lm_head stays dense


def test_a_model_failing_at_batch_1_too_is_still_an_error(tmp_path, capsys):
    bad = tmp_path / "data"
    bad.mkdir()
    np.savez(bad / "rows.npz", input_ids=np.full((4, 8), dm.VOCABULARY + 5, np.int64))  # ids past the table
    out = tmp_path / "out.onnx"
    assert main(["convert", str(dm.exported("batch1")), "-o", str(out), "--calib", str(bad)]) == 2
    assert "row by row" not in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("form", ["cache", "plain"])
def test_every_verb_runs_on_the_decoder_exports(form, tmp_path, capsys):
    source = dm.copy_model(dm.exported(form), tmp_path / "model")
    before = {path.name: path.read_bytes() for path in source.parent.iterdir()}
    ids = dm.token_rows(16, 12, seed=5)
    data = write_rows(tmp_path / "data", form, ids, 8)
    converted, quantized = tmp_path / "out" / "converted.onnx", tmp_path / "out" / "int8.onnx"
    assert main(["convert", str(source), "-o", str(converted), "--calib", str(data)]) == 0
    assert main(["quantize", str(converted), "-o", str(quantized), "--calib", str(data)]) == 0
    capsys.readouterr()
    assert main(["compare", str(source), str(quantized), "--data", str(data)]) == 0
    assert "judged output" in capsys.readouterr().out
    assert main(["inspect", str(quantized), "--require"]) == 0
    assert "dense on purpose" in capsys.readouterr().out
    assert {path.name: path.read_bytes() for path in source.parent.iterdir()} == before  # inputs untouched
    # The converted model still computes: its logits stay near the dense model's on the calibration rows.
    dense, sparse = run_logits(source, feed_for(form, ids)), run_logits(converted, feed_for(form, ids))
    cosine = float((dense * sparse).sum() / np.linalg.norm(dense) / np.linalg.norm(sparse))
    assert 0.8 < cosine < 0.9999
    # Quantization leaves the tied table alone: no smoothing scales it, no Q/DQ feeds the embedding lookups.
    np.testing.assert_array_equal(embedding_table(quantized), embedding_table(converted))


def test_recovery_distils_a_decoders_next_token_distributions(tmp_path, capsys):
    ids = dm.token_rows(40, 16, seed=6)
    data = write_rows(tmp_path / "data", "plain", ids, 8)
    one_shot, recovered = tmp_path / "one-shot.onnx", tmp_path / "recovered.onnx"
    assert main(["convert", str(dm.exported("plain")), "-o", str(one_shot), "--calib", str(data)]) == 0
    capsys.readouterr()
    argv = ["convert", str(dm.exported("plain")), "-o", str(recovered), "--calib", str(data), "--recover", "60"]
    assert main([*argv, "--metric", "kl", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    recovery = next(row for row in summary["report"] if row["step"] == "recover")
    assert recovery["logits"] == ["logits"] and recovery["metric"] == "kl"
    assert recovery["held_out_after"] > recovery["held_out_before"] and recovery["best_step"] > 0
    # Judged on rows neither run fitted on, the recovered model's next tokens are closer to the dense model's.
    unseen = write_rows(tmp_path / "unseen", "plain", dm.token_rows(8, 16, seed=7), 8)
    figures = {}
    for path in (one_shot, recovered):
        assert (
            main(["compare", str(dm.exported("plain")), str(path), "--data", str(unseen), "--metric", "kl", "--json"])
            == 0
        )
        figures[path.stem] = json.loads(capsys.readouterr().out)["fidelity"]["value"]
    assert figures["recovered"] > figures["one-shot"]
    weights = [values for node, values in weights_by_node(recovered).items() if node != "node_linear_14"]
    assert all(nm_compliance(values != 0, "2:4", 0).fraction == 1.0 for values in weights)  # masks kept
