"""The README's first usage example runs as written."""

import pathlib
import re


def test_readme_usage_example_runs():
    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README lost its python example"
    exec(compile(blocks[0], "README.md", "exec"), {})


def test_readme_every_later_python_block_runs():
    """Each block after the first runs on its own, as a reader would paste it."""
    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)[1:]
    assert blocks, "README lost its Flax example"
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"README.md python block {i}", "exec"), {})


def test_readme_parity_table_names_real_presets():
    from jquant.formats import presets

    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    named = set(re.findall(r'`like="([^"]+)"', text))
    assert named, "README lost its parity table"
    assert named <= set(presets()), f"README names presets that do not exist: {named - set(presets())}"


ROOT = pathlib.Path(__file__).resolve().parent.parent
PATH_PREFIXES = ("jquant/", "bench/", "docs/", "tools/", "tests/", "notebooks/")


def readme_paths(text: str) -> set[str]:
    """Repository paths the README names in backticks: spans that contain a ``/`` and start with a
    top-level folder, a ``{a,b}`` suffix expanded (``w4a16.{json,md}``); a span with a space is a
    command, not a path."""
    paths = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        if "/" not in span or " " in span or not span.startswith(PATH_PREFIXES):
            continue
        alt = re.fullmatch(r"(.*)\{([^{}]+)\}(.*)", span)
        paths |= ({alt[1] + a + alt[3] for a in alt[2].split(",")} if alt else {span})
    return paths


def test_readme_paths_helper_reads_spans():
    text = ("`jquant/a.py`, `bench/x.{json,md}`, `jquant bench w4a16`, `tests/`, `qtensor.py`, "
            "`like=\"gguf\"`, `src/x.py`")
    assert readme_paths(text) == {"jquant/a.py", "bench/x.json", "bench/x.md", "tests/"}


def test_readme_paths_exist():
    named = readme_paths((ROOT / "README.md").read_text())
    assert named, "README names no repository paths"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_readme_layout_names_every_module():
    """The Layout table names each module and package of ``jquant/`` (as ``jquant/x``, ``x.py`` or
    ``x/``), so it follows the package as files come and go."""
    text = (ROOT / "README.md").read_text()
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    spans = set(re.findall(r"`([^`\n]+)`", layout))
    names = {s.rsplit("/", 2)[-2] + "/" if s.endswith("/") else s.rsplit("/", 1)[-1] for s in spans}
    pkg = ROOT / "jquant"
    entries = {p.name for p in pkg.glob("*.py") if p.name != "__init__.py"}
    entries |= {p.name + "/" for p in pkg.iterdir() if (p / "__init__.py").exists()}
    assert entries - names == set(), f"README's Layout does not name: {sorted(entries - names)}"


def _table_of_record() -> dict:
    import json

    records = json.loads((ROOT / "bench/results/h200/w4a16.json").read_text())
    return {(r["scheme"], f"{r['N']}×{r['K']}", r["M"]): r for r in records}


def test_readme_speed_table_matches_the_table_of_record():
    """Each cell of the README's H200 table is the int4 record's time and its ratio to XLA bf16,
    rounded to the digits shown ("XLA" where ``auto`` ran XLA)."""
    text = (ROOT / "README.md").read_text()
    head = re.search(r"^\| N×K \| (M=\d+ \|.*)$", text, re.M)
    assert head, "README lost its H200 speed table"
    ms = [int(m) for m in re.findall(r"M=(\d+)", head[1].split("XLA")[0])]
    rows = re.findall(r"^\| (\d+×\d+) \|(.*)\|$", text[head.end():].split("\n\n", 1)[0], re.M)
    assert len(rows) == 4   # the int4 shapes of the benchmark; K=576 takes no groups of 128
    records = _table_of_record()
    for shape, rest in rows:
        cells = [c.strip() for c in rest.split("|")]
        for m, cell in zip(ms, cells):
            r = records[("int4_g128", shape, m)]
            if cell == "XLA":
                assert r["op"] == "w4a16_xla", (shape, m)
                continue
            t, ratio = map(float, re.fullmatch(r"([\d.]+) µs \(([\d.]+)×\)", cell).groups())
            assert r["op"] == "w4a16_mgpu" and abs(t - r["time_us"]) <= 0.05 + 1e-9, (shape, m)
            assert abs(ratio - r["baselines"]["xla_bf16"] / r["time_us"]) <= 0.005 + 1e-9, (shape, m)
        bf16 = float(cells[-1].removesuffix(" µs"))
        assert abs(bf16 - records[("int4_g128", shape, 1)]["baselines"]["xla_bf16"]) <= 0.05 + 1e-9


def test_readme_quality_table_matches_the_quality_record():
    """Each row of the README's calibration table is ``quality.json``'s: the format's bits per weight
    (round-to-nearest's), and round-to-nearest's, GPTQ act-order's and AWQ's ΔPPL (recovered share) to
    the digits shown."""
    import json

    rows = json.loads((ROOT / "bench/results/quality.json").read_text())["rows"]
    record = {(r["weights"], r["method"]): r for r in rows}
    text = (ROOT / "README.md").read_text()
    head = text.index("| weights | bits/weight | round-to-nearest ΔPPL | GPTQ, act-order | AWQ |")
    table = re.findall(r"^\| ([^|]+?) \| ([\d.]+) \| ([+\d.]+) \| ([^|]+) \| ([^|]+) \|",
                       text[head:].split("\n\n", 1)[0], re.M)
    assert len(table) >= 10
    for weights, bits, rtn, gptq, awq in table:
        weights = weights.split(" (")[0]
        base = record[(weights, "round-to-nearest")]
        assert abs(float(bits) - base["bits_per_weight"]) <= 0.005 + 1e-9, weights
        assert abs(float(rtn) - base["delta_ppl"]) <= 0.005 + 1e-9, weights
        for cell, method in ((gptq, "GPTQ, act-order"), (awq, "AWQ")):
            if cell.strip() == "–":
                assert (weights, method) not in record, (weights, method)
                continue
            delta, pct = re.fullmatch(r"([+\d.]+) \((\d+)%\)", cell.strip()).groups()
            r = record[(weights, method)]
            assert abs(float(delta) - r["delta_ppl"]) <= 0.005 + 1e-9, cell
            assert abs(int(pct) - 100 * r["recovered"]) <= 0.5 + 1e-9, cell


def test_bench_readme_documents_every_record_field():
    """bench/README.md's record table names exactly the fields the table of record holds."""
    text = (ROOT / "bench/README.md").read_text()
    section = text.split("## Records", 1)[1].split("\n## ", 1)[0]
    documented = {f for row in re.findall(r"^\| (.+?) \|", section, re.M)
                  for f in re.findall(r"`(\w+)`", row)}
    held = set().union(*(r.keys() for r in _table_of_record().values()))
    assert documented == held, (f"undocumented: {sorted(held - documented)}, "
                                f"not in the records: {sorted(documented - held)}")
