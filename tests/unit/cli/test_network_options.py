"""The CLI's shared network options reach the NodeConfig they make (no process, no network)."""


def test_the_no_autonat_flag_turns_the_client_off_and_keeps_the_service():
    import click
    from click.testing import CliRunner

    from shardnet.cli import make_config, network_options

    made = []

    @click.command()
    @network_options("/ip4/127.0.0.1/tcp/0")
    def cmd(listen, announce, bootstrap, quic, mdns, relays):
        made.append(make_config(identity=None, listen=listen, announce=announce, bootstrap=bootstrap, quic=quic,
                                mdns=mdns, default_listen="/ip4/127.0.0.1/tcp/0", persistent=False, relays=relays))

    assert CliRunner().invoke(cmd, ["--no-autonat"]).exit_code == 0
    assert CliRunner().invoke(cmd, []).exit_code == 0
    assert (made[0].autonat_client, made[0].autonat) == (False, True)
    assert made[1].autonat_client is True
