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


def test_bootstrap_comes_from_the_environment_when_not_given():
    import click
    from click.testing import CliRunner

    from shardnet.cli import network_options

    @click.command()
    @network_options("/ip4/127.0.0.1/tcp/0")
    def cmd(listen, announce, bootstrap, quic, mdns, relays):
        click.echo("|".join(bootstrap))

    a = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWDAybgKg5Vd9sbRSohHv16emVryaVp9yUV2BeC3g53XFs"
    b = "/ip4/10.0.0.2/tcp/4001/p2p/12D3KooWE5VtKwDTFLXgptcHJfLZi7uRr2F2LwwELZ9JzJm8YgHU"
    r = CliRunner().invoke(cmd, [], env={"SHARDNET_BOOTSTRAP": f"{a} {b}"})
    assert r.exit_code == 0 and r.output.strip() == f"{a}|{b}", r.output
    r = CliRunner().invoke(cmd, ["--bootstrap", a], env={"SHARDNET_BOOTSTRAP": b})
    assert r.output.strip() == a  # the flag wins
