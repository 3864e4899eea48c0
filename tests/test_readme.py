"""The README's first usage example runs as written."""

import pathlib
import re


def test_readme_usage_example_runs():
    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README lost its python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
