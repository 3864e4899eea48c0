"""``--help`` of every command: each option says what it does, and its default where it has one."""

import argparse

import pytest

from jquant.apps import bench, calibrate, cli, demo, embedding_quality
from jquant.apps.help_format import HelpFormatter


def _parsers():
    """Every (sub)parser of the commands whose parser is built without running them."""
    todo = [bench.build_parser(), calibrate.build_parser(), demo.build_parser(), embedding_quality.build_parser(),
            cli.build_ledger_parser()]
    while todo:
        parser = todo.pop()
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += action.choices.values()


@pytest.mark.parametrize("parser", list(_parsers()), ids=lambda p: p.prog)
def test_every_option_has_help_and_shows_its_default(parser):
    assert parser.formatter_class is HelpFormatter
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        assert action.help and action.help.strip(), f"{parser.prog} {action.option_strings[0]} has no help"
        if action.default not in (None, False, "", argparse.SUPPRESS) and "default" not in action.help:
            shown = HelpFormatter._default_text(action)
            # Whitespace aside: a long comma list wraps after its commas.
            assert f"(default:{shown})" in "".join(text.split()), (parser.prog, action.option_strings[0])


def test_defaults_read_as_the_option_takes_them():
    text = " ".join(bench.build_parser()._subparsers._group_actions[0].choices["decode"].format_help().split())
    assert "(default: 1,16)" in text and "(default: 1024,8192)" in text and "(1, 16)" not in text
    text = " ".join(calibrate.build_parser().format_help().split())
    assert "(default: 64)" in text and "(default: 32)" in text and "(default: 0.01)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_a_percent_sign_in_a_default_or_help_prints(capsys):
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--x", default="5%", help="a share")
    parser.add_argument("--y", type=float, default=25.0, help="spread limit (%%)")
    text = parser.format_help()
    assert "a share (default: 5%)" in text and "spread limit (%) (default: 25.0)" in text


def test_a_comma_list_wraps_after_a_comma_never_inside_a_name():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    names = ",".join(f"scheme_number_{i}" for i in range(12))
    parser.add_argument("--schemes", default=names, help="schemes")
    text = parser.format_help()
    block = text[text.index("--schemes SCHEMES "):].splitlines()
    assert len(block) > 2 and all(line.rstrip().endswith((",", ")")) for line in block), block
    assert f"(default:{names})" in "".join("".join(block).split())


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)


_EXAMPLES = [line.split()[2:] for line in bench._CPU_EXAMPLES.values()]


def test_the_help_shows_a_cpu_example_of_every_benchmark_that_has_a_cpu_mode():
    assert sorted(e[0] for e in _EXAMPLES) == ["decode", "gemm8", "gptq", "moe", "w4a16"]


@pytest.mark.parametrize("argv", _EXAMPLES, ids=lambda a: a[0])
def test_the_cpu_examples_of_the_help_run(argv, tmp_path, capsys):
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    assert (tmp_path / f"{argv[0]}.json").exists() and (tmp_path / f"{argv[0]}.md").exists()


@pytest.mark.parametrize("name, small", [("decode", "--shrink 8"), ("gptq", "--shrink 16"), ("moe", "--tiny")])
def test_without_a_gpu_the_message_names_the_cpu_option(name, small, tmp_path, capsys):
    assert bench.main([name, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no GPU present" in err and "--allow-cpu" in err and small in err
    assert not list(tmp_path.iterdir())


def test_descriptions_read_as_plain_text():
    text = bench.build_parser().format_help()
    assert "``" not in text and "jquant bench {w4a16," in text
