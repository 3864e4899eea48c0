"""The ``--help`` layout every ``jquant`` command shares."""

from __future__ import annotations

import argparse
import re


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their examples keep their lines; reST literals as plain text), and each
    option's default after its help. Unlike argparse's ``ArgumentDefaultsHelpFormatter`` it skips empty
    defaults (None, False, "") and help that already names its default, and writes a tuple default as
    the comma list the option takes (``1,16``, not ``(1, 16)``). argparse prints no default for an option
    without help text: every option of ``jquant`` has some (``tests/apps/test_help.py``)."""

    def _format_text(self, text):
        return super()._format_text(text.replace("``", ""))   # the docstrings' reST literals, read as plain text

    def _get_help_string(self, action):
        help_text = (action.help or "").strip()
        default = self._default_text(action)
        if not default or "default" in help_text:
            return help_text
        return f"{help_text} (default: {default.replace('%', '%%')})".strip()

    def _split_lines(self, text, width):
        # Lines break at spaces and after the commas of a comma list (a default such as
        # int8_ch,fp8_e4m3_channel,...), never inside a name: argparse cut "fp8_e" from "4m3_channel".
        lines, line = [], ""
        for word in text.split():
            for i, piece in enumerate(re.findall(r"[^,]*,|[^,]+", word)):
                joined = line + (" " if line and i == 0 else "") + piece
                if line and len(joined) > width:
                    lines.append(line)
                    joined = piece
                line = joined
        return lines + [line] if line else lines

    @staticmethod
    def _default_text(action) -> str:
        default = action.default
        if default in (None, False, "", argparse.SUPPRESS) or not action.option_strings:
            return ""
        if isinstance(default, (tuple, list)):
            return ",".join("x".join(map(str, d)) if isinstance(d, (tuple, list)) else str(d) for d in default)
        return str(default)
