"""``shardnet --config FILE``: TOML option values, top-level for every command that has the option,
tables per command, the command line winning, and a typo refused with one line."""

from click.testing import CliRunner

from shardnet.cli import config_file, main


def _run(tmp_path, text, *args, env=None):
    cfg = tmp_path / "shardnet.toml"
    cfg.write_text(text)
    return CliRunner().invoke(main, ["--config", str(cfg), *args], env=env)


def test_top_level_keys_and_a_command_table_become_the_commands_defaults(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'identity = "{tmp_path}/a.key"\nbootstrap = ["/ip4/10.0.0.1/tcp/4001/p2p/X"]\n'
                   '[join]\nbatch-tokens = 0\nlayers = "0:4"\nlimit = ["sessions_per_peer=64"]\n')
    m = config_file.default_map(main, cfg)
    assert m["join"]["batch_tokens"] == 0 and m["join"]["layers"] == "0:4"
    assert m["join"]["limits"] == ["sessions_per_peer=64"]  # --limit (its parameter is "limits")
    assert m["join"]["bootstrap"] == m["generate"]["bootstrap"] == ["/ip4/10.0.0.1/tcp/4001/p2p/X"]
    assert m["id"] == {"identity": f"{tmp_path}/a.key"}
    assert "limits" not in m  # `shardnet limits` has none of these options


def test_the_file_supplies_defaults_and_the_command_line_wins(tmp_path):
    r = _run(tmp_path, f'[id]\nidentity = "{tmp_path}/from-file.key"\n', "id")
    assert r.exit_code == 0 and "from-file.key" in r.output, r.output
    r = _run(tmp_path, f'[id]\nidentity = "{tmp_path}/from-file.key"\n', "id", "--identity", str(tmp_path / "flag.key"))
    assert r.exit_code == 0 and "flag.key" in r.output and "from-file" not in r.output, r.output


def test_typos_and_bad_files_are_one_error_line(tmp_path):
    for text, words in (('nonsense = 1\n', "nonsense: no command has an option --nonsense"),
                        ('[jion]\nlayers = "0:4"\n', "[jion]: there is no command `shardnet jion`"),
                        ('[id]\nlayers = "0:4"\n', "[id] layers: `shardnet id` has no option --layers"),
                        ('[join]\nlayers = \n', "not valid TOML")):
        r = _run(tmp_path, text, "id")
        assert r.exit_code == 1 and r.output.count("\n") == 1 and r.output.startswith("error: config "), r.output
        assert words in r.output, r.output
    r = CliRunner().invoke(main, ["--config", str(tmp_path / "missing.toml"), "id"])
    assert r.exit_code == 1 and "cannot read it" in r.output
