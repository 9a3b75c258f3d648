"""pserver_serve: block 0's listen_and_serv, its attrs gathered from the block passes."""

from __future__ import annotations

from pass_support import ops, run_until, tiny


def test_listen_and_serv_names_the_blocks_and_grads():
    main, startup = tiny(lr_decay=True)
    progs = run_until("pserver_serve", main, startup, min_block_size=4).pservers["127.0.0.1:6174"]
    assert ops(progs.main, 0) == ("op 0 listen_and_serv X=[b@GRAD.trainer_0, b@GRAD.trainer_1, "
                                  "w@GRAD.block1.trainer_0, w@GRAD.block1.trainer_1] ->\n")
    serve = progs.main.global_block().ops[0]
    assert serve.attr("optimize_blocks") == (1, 2, 3) and serve.attr("lr_decay_block_id") == 1
    assert serve.attr("grad_to_block_id") == ("b@GRAD:2", "w@GRAD.block1:3")
    assert (serve.attr("endpoint"), serve.attr("pserver_id"), serve.attr("Fanin")) == ("127.0.0.1:6174", 0, 2)


def test_a_pserver_with_nothing_placed_on_it_still_gets_an_optimize_block():
    main, startup = tiny()
    bundle = run_until("pserver_serve", main, startup, pservers="127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    idle = bundle.pservers["127.0.0.1:3"].main
    assert idle.num_blocks == 2 and len(idle.block(1)) == 0
    assert idle.global_block().ops[0].attr("optimize_blocks") == (1,)


def test_rpc_thread_nums_are_paddles_twelve():
    """Paddle's transpiler writes rpc_{get,send,prefetch}_thread_num 12; with the op's
    default 1, Fluid 1.8.5's sync pserver stalled a trainer that started late (docs/interop.md)."""
    main, startup = tiny()
    for progs in run_until("pserver_serve", main, startup).pservers.values():
        serve = progs.main.global_block().ops[0]
        assert [serve.attr(f"rpc_{kind}_thread_num") for kind in ("get", "send", "prefetch")] == [12, 12, 12]
