def test_join_batches_by_default_with_the_schedulers_budget_and_0_turns_it_off():
    from shardnet.cli.compute import join
    from shardnet.inference.server.compute_peer import ComputePeer
    from shardnet.inference.server.scheduler import DEFAULT_MAX_TOKENS
    import inspect

    option = next(p for p in join.params if p.name == "batch_tokens")
    assert option.default == DEFAULT_MAX_TOKENS  # the CLI spells the number out to import no torch
    assert option.type.min == 0  # 0: one step per pass
    assert inspect.signature(ComputePeer).parameters["batch_tokens"].default == DEFAULT_MAX_TOKENS
