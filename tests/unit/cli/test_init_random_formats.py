"""``shardnet model init-random --format``: a random checkpoint stored as checkpoints of that
format ship, readable by shardnet's loader (click's runner, no processes)."""

import json

import pytest
from click.testing import CliRunner

from shardnet.cli.model import STORED_FORMAT_WRITERS, model
from shardnet.inference.model.checkpoint import Checkpoint

#: formats that only one family's checkpoints ship in
FAMILY = {"mxfp4": ["--family", "gpt_oss"]}


@pytest.mark.parametrize("fmt", sorted(STORED_FORMAT_WRITERS))
def test_init_random_writes_each_stored_format(tmp_path, fmt):
    out = tmp_path / fmt
    r = CliRunner().invoke(model, ["init-random", str(out), "--format", fmt, "--dtype", "bfloat16", "--hidden", "256",
                                   "--layers", "2", *FAMILY.get(fmt, [])])
    assert r.exit_code == 0, r.output
    assert f"{fmt}) to" in r.output
    ckpt = Checkpoint(out)
    assert ckpt.quant is not None
    if fmt.startswith("gguf-"):  # one .gguf file: the config is its metadata
        assert ckpt.gguf_file == out / "model.gguf" and not (out / "config.json").exists()
        assert ckpt.entries["model.layers.0.mlp.down_proj.weight"].dtype == "GGUF_" + fmt[5:].upper()
    else:
        assert json.loads((out / "config.json").read_text())["quantization_config"]


def test_an_unknown_format_is_refused_by_click(tmp_path):
    r = CliRunner().invoke(model, ["init-random", str(tmp_path / "x"), "--format", "nf5"])
    assert r.exit_code == 2 and "'nf5' is not one of" in r.output
