"""The networks of Paddle's own transpiler tests (Paddle 1.8's unittests test_dist_transpiler.py,
test_dist_transpiler_async_decay.py, test_dist_transpiler_config.py) and of the `fluid18_*`
fixtures, built with the builder. Each function returns `(main, startup)`, built under
fresh unique-name counters, so the names are the ones Fluid 1.8.5 gave (`fc_0.tmp_0`,
`learning_rate_0`, `_generated_var_0`, ...) whatever was built before.

Like Paddle's `TranspilerTest`, the main program has `random_seed = 1` and the startup
program 0, so initializer ops carry `seed = 0`.
"""

from __future__ import annotations

from collections.abc import Callable

from transpiler.frontend import layers, optimizer, unique_name
from transpiler.frontend.clip import GradientClipByValue
from transpiler.frontend.framework import Program, Variable, program_guard
from transpiler.frontend.param_attr import ParamAttr
from transpiler.frontend.regularizer import L2Decay


def build(body: Callable[[], object], *, main_seed: int = 1) -> tuple[Program, Program]:
    """Run `body` into a fresh (main, startup) pair under fresh name counters."""
    main, startup = Program(), Program()
    main.random_seed = main_seed
    with unique_name.guard(), program_guard(main, startup):
        body()
    return main, startup


def _net_conf(make_optimizer: Callable[[], optimizer.Optimizer], *, fc_w_attr: ParamAttr | None = None,
              bias: bool = True) -> Variable:
    """`TranspilerTest.net_conf`: x[1000] → fc 1000 (`fc_w`, `fc_b`) → square error → mean."""
    x = layers.data(name="x", shape=[1000], dtype="float32")
    y_predict = layers.fc(
        input=x,
        size=1000,
        act=None,
        param_attr=fc_w_attr or ParamAttr(name="fc_w"),
        bias_attr=ParamAttr(name="fc_b") if bias else False,
    )
    y = layers.data(name="y", shape=[1], dtype="float32")
    cost = layers.square_error_cost(input=y_predict, label=y)
    avg_cost = layers.mean(cost)
    make_optimizer().minimize(avg_cost)
    return avg_cost


def basic_model() -> tuple[Program, Program]:
    """`TranspilerTest.net_conf` / TestBasicModel (and the `fluid18_basic_sgd_2ps` fixture): SGD(0.1)."""
    return build(lambda: _net_conf(lambda: optimizer.SGD(learning_rate=0.1)))


def empty_pserver_model() -> tuple[Program, Program]:
    """TestEmptyPserverOptimizeBlocks: no bias, SGD(1.0)."""
    return build(lambda: _net_conf(lambda: optimizer.SGD(learning_rate=1.0), bias=False))


def lr_decay_model() -> tuple[Program, Program]:
    """TestLRDecay (and `fluid18_lr_exp_decay_2ps`): SGD(exponential_decay(1.0, 2100, 0.1, staircase=True))."""
    return build(
        lambda: _net_conf(
            lambda: optimizer.SGD(
                learning_rate=layers.exponential_decay(learning_rate=1.0, decay_steps=2100, decay_rate=0.1, staircase=True)
            )
        )
    )


def lr_decay_conditional_model() -> tuple[Program, Program]:
    """TestLRDecayConditional (and `fluid18_lr_piecewise_2ps`): SGD(piecewise_decay([10000, 20000], [1.0, 0.5, 1.0]))."""
    return build(
        lambda: _net_conf(
            lambda: optimizer.SGD(learning_rate=layers.piecewise_decay([10000, 20000], [1.0, 0.5, 1.0]))
        )
    )


def l2_decay_model(clip_all: bool = False) -> tuple[Program, Program]:
    """TestL2Decay: `fc_w` with `L2Decay()`, grads clipped by value 0.1, SGD(0.1).

    Version C of the test clips only `fc_w` (`need_clip`), which 1.8.5 can build only
    as `SGD(0.1, grad_clip=clip)` (its `minimize` has no `grad_clip`): that is the
    default here. The test's expected pserver lists (`clip` in both blocks) come from
    older Fluid applying the clip to every param; `clip_all=True` builds that.
    """
    clip = GradientClipByValue(0.1, need_clip=None if clip_all else (lambda p: p.name == "fc_w"))
    return build(
        lambda: _net_conf(
            lambda: optimizer.SGD(learning_rate=0.1, grad_clip=clip),
            fc_w_attr=ParamAttr(name="fc_w", regularizer=L2Decay()),
        )
    )


def l2_decay_with_piecewise_model() -> tuple[Program, Program]:
    """TestL2DecayWithPiecewise: Momentum(piecewise_decay([1, 10, 20, 30], [0.1**i]), 0.9, L2Decay(1e-4))."""
    base_lr = 1.0
    bd = [1, 10, 20, 30]
    lr = [base_lr * (0.1**i) for i in range(len(bd) + 1)]
    return build(
        lambda: _net_conf(
            lambda: optimizer.Momentum(
                learning_rate=layers.piecewise_decay(boundaries=bd, values=lr),
                momentum=0.9,
                regularization=L2Decay(1e-4),
            )
        )
    )


def async_decay_model() -> tuple[Program, Program]:
    """test_dist_transpiler_async_decay.py: SGD(exponential_decay(0.1, 100, 0.99, staircase=True))."""
    return build(
        lambda: _net_conf(
            lambda: optimizer.SGD(
                learning_rate=layers.exponential_decay(learning_rate=0.1, decay_steps=100, decay_rate=0.99, staircase=True)
            )
        )
    )


def optimizer_model(name: str) -> tuple[Program, Program]:
    """The default network with another optimizer (TestDecayedAdagrad, TestFtrl, TestRMSPropOptimizer)."""
    makers = {
        "sgd": lambda: optimizer.SGD(learning_rate=0.1),
        "momentum": lambda: optimizer.Momentum(learning_rate=0.1, momentum=0.9),
        "adam": lambda: optimizer.Adam(learning_rate=0.1),
        "adagrad": lambda: optimizer.Adagrad(learning_rate=0.1),
        "decayed_adagrad": lambda: optimizer.DecayedAdagrad(learning_rate=0.1),
        "ftrl": lambda: optimizer.Ftrl(learning_rate=0.1),
        "rmsprop": lambda: optimizer.RMSProp(learning_rate=0.1),
    }
    if name not in makers:
        from transpiler.frontend.errors import BuildError

        raise BuildError("optimizer_model", f"unknown optimizer {name!r} (known: {', '.join(makers)})")
    return build(lambda: _net_conf(makers[name]))


def network_with_table(is_sparse: bool, is_distributed: bool) -> tuple[Program, Program]:
    """`TestDistLookupTableBase.network_with_table`: three id slots, two on the
    shared table `shared_w` (1000×64, distributed when asked), one on `profile_emb`
    (never distributed), average-pooled, concatenated, fc 2, cross_entropy, Adam(0.003).
    The third data layer reuses the name `brand_ids`, as Paddle's test does."""

    def body() -> None:
        def emb_pool(ids: Variable, table_name: str, distributed: bool) -> Variable:
            emb = layers.embedding(
                input=ids,
                size=[1000, 64],
                dtype="float32",
                param_attr=table_name,
                is_sparse=is_sparse,
                is_distributed=distributed,
            )
            return layers.sequence_pool(input=emb, pool_type="average")

        title_ids = layers.data(name="title_ids", shape=[1], dtype="int64", lod_level=1)
        brand_ids = layers.data(name="brand_ids", shape=[1], dtype="int64", lod_level=1)
        profile_ids = layers.data(name="brand_ids", shape=[1], dtype="int64", lod_level=1)
        title_emb = emb_pool(title_ids, "shared_w", is_distributed)
        brand_emb = emb_pool(brand_ids, "shared_w", is_distributed)
        profile_emb = emb_pool(profile_ids, "profile_emb", False)
        fc0 = layers.concat(input=[title_emb, brand_emb, profile_emb], axis=1)
        predict = layers.fc(
            input=fc0, size=2, act=None, param_attr=ParamAttr(name="fc_w"), bias_attr=ParamAttr(name="fc_b")
        )
        label = layers.data(name="label", shape=[1], dtype="int64")
        cost = layers.cross_entropy(input=predict, label=label)
        avg_cost = layers.mean(cost)
        optimizer.Adam(learning_rate=0.003).minimize(avg_cost)

    return build(body)


def ctr_dist_model(is_sparse: bool = True, is_distributed: bool = True, slots: int = 3) -> tuple[Program, Program]:
    """The `fluid18_ctr_dist_sgd_2ps` fixture's network: `slots` LoD id slots on one
    100000×16 table `emb`, sum-pooled, concatenated, fc 32 relu (`ctr_fc.*`),
    fc 2 softmax (`ctr_out.*`), cross_entropy on `click`, mean, SGD(0.1)."""

    def body() -> None:
        pooled = []
        for i in range(slots):
            ids = layers.data(name=f"slot{i}", shape=[1], dtype="int64", lod_level=1)
            emb = layers.embedding(
                input=ids,
                size=[100000, 16],
                is_sparse=is_sparse,
                is_distributed=is_distributed,
                param_attr=ParamAttr(name="emb"),
            )
            pooled.append(layers.sequence_pool(input=emb, pool_type="sum"))
        concat = layers.concat(pooled, axis=1)
        hidden = layers.fc(
            input=concat, size=32, act="relu", param_attr=ParamAttr(name="ctr_fc.w"), bias_attr=ParamAttr(name="ctr_fc.b")
        )
        predict = layers.fc(
            input=hidden, size=2, act="softmax", param_attr=ParamAttr(name="ctr_out.w"), bias_attr=ParamAttr(name="ctr_out.b")
        )
        click = layers.data(name="click", shape=[1], dtype="int64")
        avg_cost = layers.mean(layers.cross_entropy(input=predict, label=click))
        optimizer.SGD(learning_rate=0.1).minimize(avg_cost)

    return build(body, main_seed=0)


# What each builder is, by the name Paddle's tests (or the fixtures) give it.
NETWORKS: dict[str, Callable[[], tuple[Program, Program]]] = {
    "TestBasicModel": basic_model,
    "TestLRDecay": lr_decay_model,
    "TestLRDecayConditional": lr_decay_conditional_model,
    "TestL2Decay": l2_decay_model,
    "TestL2DecayWithPiecewise": l2_decay_with_piecewise_model,
    "TestEmptyPserverOptimizeBlocks": empty_pserver_model,
    "TestLocalLookupTable": lambda: network_with_table(is_sparse=True, is_distributed=False),
    "TestDistLookupTable": lambda: network_with_table(is_sparse=True, is_distributed=True),
    "AsyncDecay": async_decay_model,
    "fluid18_basic_sgd_2ps": basic_model,
    "fluid18_lr_exp_decay_2ps": lr_decay_model,
    "fluid18_lr_piecewise_2ps": lr_decay_conditional_model,
    "fluid18_ctr_dist_sgd_2ps": ctr_dist_model,
}
