import json

import pytest

from jquant.apps.quality_table import Row, markdown, record_rows


def test_rows_are_upserted_and_the_markdown_follows_the_json(tmp_path):
    path = tmp_path / "quality.json"
    record_rows(path, [Row("float", "", 16.0, 10.0), Row("int4 g64 sym", "round-to-nearest", 4.25, 14.0),
                       Row("int4 g64 sym", "GPTQ", 4.25, 12.0, recovered=0.5, seconds=9, baseline="int4 g64 sym")])
    record_rows(path, [Row("float", "", 16.0, 10.0), Row("mxfp4", "round-to-nearest", 4.25, 20.0),
                       Row("mxfp4 + Hadamard 32", "GPTQ", 4.25, 13.0, recovered=0.7, baseline="mxfp4")])
    record_rows(path, [Row("float", "", 16.0, 10.0), Row("int4 g64 sym", "round-to-nearest", 4.25, 14.0),
                       Row("int4 g64 sym", "GPTQ", 4.25, 11.0, recovered=0.75, baseline="int4 g64 sym")])
    table = json.loads(path.read_text())
    assert [(r["weights"], r["method"], r["ppl"]) for r in table["rows"]] == [
        ("float", "", 10.0), ("int4 g64 sym", "round-to-nearest", 14.0), ("int4 g64 sym", "GPTQ", 11.0),
        ("mxfp4", "round-to-nearest", 20.0), ("mxfp4 + Hadamard 32", "GPTQ", 13.0)]
    assert table["rows"][2]["delta_ppl"] == 1.0
    md = path.with_suffix(".md").read_text()
    assert md == markdown(table)
    body = [line.split("|")[1:3] for line in md.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(w.strip(), m.strip()) for w, m in body] == [
        ("float", ""), ("int4 g64 sym", "round-to-nearest"), ("int4 g64 sym", "GPTQ"),
        ("mxfp4", "round-to-nearest"), ("mxfp4 + Hadamard 32", "GPTQ")]
    assert "| 75% |" in md


def test_a_run_with_a_different_float_perplexity_is_refused(tmp_path):
    path = tmp_path / "quality.json"
    record_rows(path, [Row("float", "", 16.0, 10.0)])
    with pytest.raises(ValueError, match="evaluation differs"):
        record_rows(path, [Row("float", "", 16.0, 10.5), Row("int4", "round-to-nearest", 4.25, 14.0)])


def test_calibrated_summary_names_each_baselines_best_method(tmp_path):
    from jquant.apps.quality_table import calibrated_summary
    path = tmp_path / "quality.json"
    assert calibrated_summary(path) == ""
    record_rows(path, [Row("float", "", 16.0, 10.0), Row("mxfp4", "round-to-nearest", 4.25, 20.0),
                       Row("mxfp4 + Hadamard 32", "GPTQ", 4.25, 13.0, recovered=0.7, baseline="mxfp4"),
                       Row("mxfp4", "GPTQ", 4.25, 15.0, recovered=0.5, baseline="mxfp4")])
    lines = calibrated_summary(path).splitlines()
    assert len(lines) == 2 and "mxfp4 + Hadamard 32, GPTQ: +3.000" in lines[1] and "+10.000" in lines[1]
