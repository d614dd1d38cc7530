"""The README's examples work as written."""

import re
from pathlib import Path

import yaml

from kvflow.router import load_config

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_the_two_setup_commands_are_make_up_and_make_test():
    block = README.split("## Set up", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in block.strip().splitlines()] == ["make up", "make test"]


def test_the_profile_example_loads_and_replaces_the_default():
    [example] = re.findall(r"```yaml\n(.*?)```", README, re.S)
    config = load_config(yaml.safe_load(example))
    weights = {ref.plugin_ref: ref.weight for ref in config.profiles["default"].plugins}
    assert weights["prefix-precise"] == 3 and weights["queue"] == 1
