"""config.toml as the server reads it: every setting has one section and one line in the shipped
file (whose values are the built-in defaults), each key is read from its own section only, and a
misplaced or unknown key or section stops the start with a line naming the fix. KVSERVE_*
variables and flags are not sectioned and override the file as before."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from server.config import CHECKOUT_CONFIG, HOME, SECTIONS, _defaults, build_parser, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def refusal(path: Path, **env: str) -> str:
    with pytest.raises(SystemExit) as e:
        load_config([], env={"KVSERVE_CONFIG": str(path), **env})
    return str(e.value)


def test_every_setting_has_one_section_and_a_line_in_the_shipped_config_toml() -> None:
    settings = set(_defaults())
    flags = {a.dest for a in build_parser()._actions} - {"help", "config"}
    assert flags == settings  # a flag for every setting, and no flag that is not one
    placed = [key for keys in SECTIONS.values() for key in keys]
    assert len(placed) == len(set(placed)) == len(HOME), "a setting listed in two sections"
    assert not settings - set(HOME), f"settings with no section: {sorted(settings - set(HOME))}"
    assert not set(HOME) - settings, f"sections list non-settings: {sorted(set(HOME) - settings)}"
    shipped = tomllib.loads(CHECKOUT_CONFIG.read_text())
    assert {s: set(keys) for s, keys in shipped.items()} == {
        s: set(keys) for s, keys in SECTIONS.items()
    }, "config.toml should carry every setting, each in its section, and nothing else"


def test_the_shipped_values_are_the_built_in_defaults(tmp_path) -> None:
    """An installed copy without a config.toml serves as the checkout does."""
    empty = write(tmp_path, "")
    assert load_config(["--config", str(CHECKOUT_CONFIG)], env={}) == load_config(
        ["--config", str(empty)], env={}
    )


def test_a_key_in_another_section_is_refused_naming_its_own(tmp_path) -> None:
    path = write(tmp_path, "[server]\nport = 8123\nmax_num_seqs = 8\n")
    assert refusal(path) == f"{path}: [server] max_num_seqs belongs in [engine]"


def test_an_unknown_key_names_the_closest_setting_and_its_section(tmp_path) -> None:
    path = write(tmp_path, "[server]\nmax_num_seq = 8\nwhatever_else = 1\n")
    assert refusal(path).splitlines() == [
        f"{path}: [server] max_num_seq: unknown setting (did you mean max_num_seqs in [engine]?)",
        f"{path}: [server] whatever_else: unknown setting",
    ]


def test_an_unknown_section_and_a_key_above_every_section_are_refused(tmp_path) -> None:
    path = write(tmp_path, 'port = 9\n[engnie]\nmax_num_seqs = 8\n[server]\nhost = "x"\n')
    assert refusal(path).splitlines() == [
        f"{path}: outside every section: port belongs in [server]",
        f"{path}: unknown section [engnie] (did you mean [engine]?)",
    ]


def test_a_refused_file_is_refused_whatever_the_environment_and_flags_say(tmp_path) -> None:
    """The file is wrong even when a variable or flag overrides the misplaced key: its author
    meant something the server would not do."""
    path = write(tmp_path, "[server]\nmax_num_seqs = 8\n")
    assert "belongs in [engine]" in refusal(path, KVSERVE_MAX_NUM_SEQS="4")
    with pytest.raises(SystemExit, match="belongs in"):
        load_config(["--config", str(path), "--max-num-seqs", "4"], env={})


def test_file_then_environment_then_flags_with_kvserve_config(tmp_path) -> None:
    text = "[server]\nport = 8123\n[engine]\nmax_num_seqs = 5\n[lora]\nmax_loras = 2\n"
    path = write(tmp_path, text)
    env = {"KVSERVE_CONFIG": str(path)}
    cfg = load_config([], env=env)
    assert (cfg.server.port, cfg.engine.max_num_seqs, cfg.engine.max_loras) == (8123, 5, 2)
    cfg = load_config([], env=env | {"KVSERVE_PORT": "9001", "KVSERVE_MAX_NUM_SEQS": "6"})
    assert (cfg.server.port, cfg.engine.max_num_seqs) == (9001, 6)
    cfg = load_config(["--port", "9002"], env=env | {"KVSERVE_PORT": "9001"})
    assert cfg.server.port == 9002
    other = tmp_path / "other.toml"
    other.write_text("[server]\nport = 7000\n")
    assert load_config(["--config", str(other)], env=env).server.port == 7000  # the flag wins
    with pytest.raises(SystemExit, match=r"missing\.toml \(KVSERVE_CONFIG\) not found"):
        load_config([], env={"KVSERVE_CONFIG": str(tmp_path / "missing.toml")})
    with pytest.raises(SystemExit, match=r"\(--config\) not found"):
        load_config(["--config", str(tmp_path)], env={})  # a directory is no config file
