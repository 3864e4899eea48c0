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
