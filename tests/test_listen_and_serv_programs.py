"""`listen_and_serv` and the trainer kernels on transpiled programs, pservers and
trainers as threads of this process: sync training equals local training (sliced
params, lr decay with conditional sub-blocks on the pservers), async with run-time
split equals it for one trainer, the async lr-decay counter reaches the pservers, and
the kernels' own errors."""

from __future__ import annotations

import io

import numpy as np
import pytest

from conftest import run_job_threads
from ops.executor import ExecutionError, Executor
from ops.rpc.serve import ServeError, serve_program
from ops.scope import Scope
from ops.tensor import LoDTensor
from transpiler.config import DistributeTranspilerConfig
from transpiler.frontend import ParamAttr, layers, optimizer
from transpiler.frontend.fluid18_networks import build
from transpiler.runtime.launch import free_endpoints
from transpiler.runtime.role import PSERVER, TRAINER, Role
from transpiler.runtime.session import Session

STEPS, BATCH = 8, 8


def net(decay: str = "piecewise", opt: str = "sgd"):
    """x[64] → fc 256 relu (`fc1.w` is cut in two: 16384 > 8192) → fc 1, square error."""

    def body() -> None:
        x = layers.data(name="x", shape=[64], dtype="float32")
        y = layers.data(name="y", shape=[1], dtype="float32")
        h = layers.fc(input=x, size=256, act="relu", param_attr=ParamAttr(name="fc1.w"), bias_attr=ParamAttr(name="fc1.b"))
        p = layers.fc(input=h, size=1, param_attr=ParamAttr(name="fc2.w"), bias_attr=ParamAttr(name="fc2.b"))
        loss = layers.mean(layers.square_error_cost(input=p, label=y))
        if decay == "piecewise":
            lr = layers.piecewise_decay(boundaries=[3, 6], values=[0.05, 0.02, 0.01])
        elif decay == "exponential":
            lr = layers.exponential_decay(learning_rate=0.05, decay_steps=2, decay_rate=0.5, staircase=True)
        else:
            lr = 0.01
        (optimizer.Adam(learning_rate=lr) if opt == "adam" else optimizer.SGD(learning_rate=lr)).minimize(loss)

    return build(body)


def batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([7, step])
    x = (rng.standard_normal((BATCH, 64)) * 0.3).astype(np.float32)
    return {"x": x, "y": rng.standard_normal((BATCH, 1)).astype(np.float32)}


def train_in_threads(main, startup, *, pservers: int, trainers: int, sync_mode: bool = True, config=None):
    """(per-trainer (initial, final) params, per-endpoint pserver scopes)."""
    endpoints = tuple(free_endpoints(pservers))
    scopes: dict[str, Scope] = {}
    results: dict[int, tuple[dict, dict]] = {}
    errors: list[BaseException] = []

    def pserver(endpoint: str) -> None:
        try:
            role = Role(PSERVER, 0, trainers, endpoints, endpoint, sync_mode, 20.0)
            scopes[endpoint] = Session(main, startup, role=role, config=config).serve()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def trainer(tid: int) -> None:
        try:
            role = Role(TRAINER, tid, trainers, endpoints, None, sync_mode, 20.0)
            with Session(main, startup, role=role, config=config, out=io.StringIO()) as session:
                session.start()
                initial = session.params()
                for step in range(STEPS):
                    session.run(role.shard(batch(step)))
                results[tid] = (initial, session.params())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    run_job_threads(pserver, endpoints, trainer, trainers, errors)
    return results, scopes


def train_locally(main, startup, initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    scope, exe = Scope(), Executor()
    exe.run(startup, scope=scope)
    for name, value in initial.items():
        scope.set_var(name, LoDTensor(value))
    for step in range(STEPS):
        exe.run(main, feed=batch(step), scope=scope)
    return {name: np.array(scope.find_var(name).array) for name in initial}


def assert_same_params(dist: dict, local: dict, rtol: float = 1e-5) -> None:
    """Equal up to float32 rounding: |dist - local| <= rtol * max|local| per parameter
    (see tests/test_e2e_sync.py for why an element-wise relative bound cannot hold
    for elements near zero)."""
    assert dist.keys() == local.keys()
    for name in local:
        scale = float(np.abs(local[name]).max())
        np.testing.assert_allclose(dist[name], local[name], rtol=rtol, atol=rtol * scale, err_msg=name)


@pytest.mark.parametrize("decay", ["piecewise", "exponential"])
def test_sync_two_by_two_equals_local_training_with_lr_decay_on_the_pservers(decay):
    main, startup = net(decay)
    results, scopes = train_in_threads(main, startup, pservers=2, trainers=2)
    (init0, final0), (init1, final1) = results[0], results[1]
    assert all(np.array_equal(init0[n], init1[n]) and np.array_equal(final0[n], final1[n]) for n in init0)
    assert_same_params(final0, train_locally(main, startup, init0))
    # the lr block ran once per step on every pserver
    for scope in scopes.values():
        assert int(scope.find_var("@LR_DECAY_COUNTER@").array[0]) == STEPS - 1


def test_sync_adam_with_one_trainer_is_bitwise_local_training():
    main, startup = net("none", "adam")
    results, _ = train_in_threads(main, startup, pservers=2, trainers=1)
    init, final = results[0]
    local = train_locally(main, startup, init)
    assert all(np.array_equal(final[n], local[n]) for n in local)


def test_async_with_runtime_split_and_one_trainer_is_bitwise_local_training():
    config = DistributeTranspilerConfig()
    config.runtime_split_send_recv = True
    main, startup = net("none", "adam")
    results, _ = train_in_threads(main, startup, pservers=2, trainers=1, sync_mode=False, config=config)
    init, final = results[0]
    local = train_locally(main, startup, init)
    assert all(np.array_equal(final[n], local[n]) for n in local)


def test_async_lr_decay_counters_reach_every_pserver():
    main, startup = net("exponential")
    results, scopes = train_in_threads(main, startup, pservers=2, trainers=2, sync_mode=False)
    assert len(results) == 2
    for scope in scopes.values():
        counters = [int(scope.find_var(f"@LR_DECAY_COUNTER@.trainer_{k}").array[0]) for k in range(2)]
        assert counters == [1 + STEPS, 1 + STEPS]  # each starts at 1; every step adds the trainer's 1


def test_serving_a_program_that_is_not_a_pserver_program_is_refused():
    main, startup = net("none")
    with pytest.raises(ServeError, match="has 0"):
        serve_program(main, startup)


def test_an_endpoint_whose_port_differs_from_the_program_s_is_refused():
    main, startup = net("none")
    (endpoint,) = free_endpoints(1)
    sessions = Session(main, startup, role=Role(PSERVER, 0, 1, (endpoint,), endpoint))
    pmain, pstartup = sessions.result.pservers[endpoint]
    with pytest.raises(ServeError, match="does not match the program's endpoint"):
        serve_program(pmain, pstartup, endpoint="127.0.0.1:1")


def test_listen_and_serv_rejects_contradictory_attrs():
    main, startup = net("none")
    (endpoint,) = free_endpoints(1)
    session = Session(main, startup, role=Role(PSERVER, 0, 1, (endpoint,), endpoint))
    pmain, _ = session.result.pservers[endpoint]
    op = pmain.global_block().ops[0]
    op.set_attr("distributed_mode", 2)
    with pytest.raises(ExecutionError, match="sync_mode=True contradicts distributed_mode=2"):
        Executor().run(pmain, scope=Scope())
