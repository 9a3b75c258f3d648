"""Fluid 1.8's fleet API for parameter servers, over `Session` (one code path with
`launch`, the Ray backend and `RemoteExecutor`).

    import transpiler.fluid as fluid                                  # was: paddle.fluid
    from transpiler.fleet import fleet, role_maker, StrategyFactory   # was: ...incubate.fleet...

    role = role_maker.PaddleCloudRoleMaker()       # or UserDefinedRoleMaker(...)
    fleet.init(role)
    optimizer = fleet.distributed_optimizer(fluid.optimizer.SGD(0.1), StrategyFactory.create_sync_strategy())
    optimizer.minimize(loss)                       # builds the net's optimizer ops, then transpiles
    if fleet.is_server():
        fleet.init_server()                        # or init_server("model_dir"): Fluid LoDTensor files
        fleet.run_server()                         # until every worker stopped
    elif fleet.is_worker():
        fleet.init_worker()
        exe = fluid.Executor(fluid.CPUPlace())
        exe.run(fleet.startup_program)             # = fluid.default_startup_program(): receives the params
        for batch in batches:
            exe.run(fleet.main_program, feed=batch, fetch_list=[loss])
        if fleet.is_first_worker():
            fleet.save_persistables(exe, "model")  # whole params, gathered from the pservers
        fleet.stop_worker()

After `minimize`, `fleet.main_program` and `fleet.startup_program` are this role's
transpiled programs (a worker's trainer programs, a server's pserver programs) and a
worker's default main/startup programs are switched to them, so a script that runs
`fluid.default_main_program()` trains distributed, as under Fluid.
Strategies (`transpiler.fleet.strategy`): sync, async, half-async
(`transpiler.fleet.half_async`) and GEO-SGD (`transpiler.fleet.geo`; dense params, sparse
and distributed tables, lr decay) train.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transpiler.config import DistributeTranspilerConfig
from transpiler.errors import PsTranspilerError
from transpiler.fleet import role_maker
from transpiler.fleet.strategy import (
    AsyncStrategy,
    DistributedStrategy,
    GeoStrategy,
    HalfAsyncStrategy,
    StrategyFactory,
    SyncStrategy,
    TrainerRuntimeConfig,
    geo_update_frequency,
    is_half_async,
    strategy_for,
    training_options,
)
from transpiler.fluid import _distributed_env, io
from transpiler.frontend import default_main_program, default_startup_program
from transpiler.frontend.framework import switch_main_program, switch_startup_program
from transpiler.frontend.optimizer import Optimizer
from transpiler.runtime.session import Session, parameter_names


class FleetError(PsTranspilerError):
    """The fleet API used out of order (minimize before init, run_server on a worker, ...)."""


class DistributedOptimizer:
    """What `fleet.distributed_optimizer` returns: `minimize(loss)` runs the user's
    optimizer, then transpiles for this role."""

    def __init__(self, optimizer: Optimizer, strategy: DistributedStrategy, fleet: Fleet) -> None:
        self._optimizer, self._strategy, self._fleet = optimizer, strategy, fleet

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.backward(*args, **kwargs)

    def apply_gradients(self, params_grads: Any) -> Any:
        return self._optimizer.apply_gradients(params_grads)

    def minimize(self, loss: Any, startup_program: Any = None, parameter_list: Any = None, no_grad_set: Any = None):
        result = self._optimizer.minimize(loss, startup_program, parameter_list, no_grad_set)
        main = loss.program if hasattr(loss, "program") else default_main_program()
        self._fleet._transpile(main, startup_program if startup_program is not None else default_startup_program(),
                               self._strategy)
        return result


class Fleet:
    """Fluid 1.8's `fleet` for parameter servers (its `DistributedTranspiler`)."""

    def __init__(self) -> None:
        self._role_maker: role_maker.RoleMakerBase | None = None
        self._strategy: DistributedStrategy | None = None
        self._session: Session | None = None
        self._origin_main_program = None
        self._origin_startup_program = None
        self.main_program = None
        self.startup_program = None
        self._worker_started = False
        self._geo: int | None = None

    # ------------------------------------------------------------ the role
    def init(self, role_maker_: role_maker.RoleMakerBase | None = None) -> None:
        if role_maker_ is None:
            role_maker_ = role_maker.PaddleCloudRoleMaker()
        if not isinstance(role_maker_, role_maker.RoleMakerBase):
            raise TypeError("role_maker must be an instance of RoleMakerBase")
        role_maker_.generate_role()
        self.__init__()  # a second init starts over
        self._role_maker = role_maker_

    def _role(self) -> role_maker.RoleMakerBase:
        if self._role_maker is None:
            raise FleetError("call fleet.init(role) first")
        return self._role_maker

    def is_worker(self) -> bool:
        return self._role().is_worker()

    def is_server(self) -> bool:
        return self._role().is_server()

    def is_first_worker(self) -> bool:
        return self._role().is_first_worker()

    def worker_index(self) -> int:
        return self._role().worker_index()

    def worker_num(self) -> int:
        return self._role().worker_num()

    def server_num(self) -> int:
        return len(self._role().get_pserver_endpoints())

    def server_index(self) -> int:
        return self._role().server_index()

    def server_endpoints(self, to_string: bool = False) -> list[str] | str:
        endpoints = self._role().get_pserver_endpoints()
        return ",".join(endpoints) if to_string else endpoints

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        return "" if to_string else []

    # ------------------------------------------------------------ programs
    def distributed_optimizer(self, optimizer: Optimizer, strategy: Any = None) -> DistributedOptimizer:
        if not isinstance(optimizer, Optimizer):
            raise ValueError("optimizer must be an instance of Optimizer")
        if self._role_maker is None:
            raise ValueError("fleet.init(role) to initialize before optimizer.minimize(loss)")
        self._strategy = strategy_for(strategy)
        return DistributedOptimizer(optimizer, self._strategy, self)

    def _transpile(self, main: Any, startup: Any, strategy: DistributedStrategy) -> None:
        sync_mode, config = training_options(strategy)
        role = self._role()._runtime_role()
        self._origin_main_program, self._origin_startup_program = main, startup
        self._session = Session(main, startup, role=role, sync_mode=sync_mode, config=config)
        from ops.executor import global_scope

        self._session.scope = global_scope()
        geo = self._geo = geo_update_frequency(strategy)
        if role.is_pserver:
            self.main_program, self.startup_program = self._session.result.pservers[role.current_endpoint]
            if geo is not None:
                from transpiler.fleet.geo import check_supported, pserver_program

                check_supported(self._session)
                pserver_program(self.main_program, self.startup_program)
            elif is_half_async(strategy):
                from transpiler.fleet import half_async

                half_async.pserver_program(self.main_program)
            return
        if geo is not None:  # trains locally with the original programs; syncs every `geo` steps
            from transpiler.fleet.geo import GeoWorker

            worker = GeoWorker(self._session, geo)
            self.main_program, self.startup_program = main, startup
            main._fleet_after_run, startup._fleet_after_run = worker.after_step, worker.after_startup
        else:
            self.main_program, self.startup_program = self._session.program, self._session.startup_program
        self.main_program._fleet_save = self._gather  # fluid.io.save_* on the trainer program gathers
        self.main_program._fleet_origin = main
        switch_main_program(self.main_program)
        switch_startup_program(self.startup_program)

    def _need(self, what: str, *, server: bool) -> Session:
        if self._session is None:
            raise FleetError(f"{what}: call fleet.distributed_optimizer(...).minimize(loss) first")
        if server != self._session.role.is_pserver:
            raise FleetError(f"{what} is for {'servers' if server else 'workers'}; this process is "
                             f"{self._session.role.name}")
        return self._session

    # ------------------------------------------------------------ servers
    def init_server(self, model_dir: str | Path | None = None, **kwargs: Any) -> None:
        """Prepare this pserver; `model_dir` (Fluid LoDTensor files of whole vars, as
        `save_persistables` writes) sets the params this server holds, cut to its blocks."""
        session = self._need("init_server", server=True)
        if model_dir is not None:
            if not Path(model_dir).is_dir():
                raise ValueError(f"There is no directory named '{model_dir}'")
            session.init_from = Path(model_dir)

    def run_server(self) -> None:
        """Serve until every worker stopped (`stop_worker`)."""
        self._need("run_server", server=True).serve()

    # ------------------------------------------------------------ workers
    def init_worker(self) -> None:
        """Connect this worker's executors to the pservers (the startup program then
        receives the initial params)."""
        session = self._need("init_worker", server=False)
        _distributed_env["rpc"] = session.client
        self._worker_started = True

    def stop_worker(self) -> None:
        """Tell the pservers this worker is done; they stop when every worker did."""
        session = self._need("stop_worker", server=False)
        try:
            session.finish()
        finally:
            _distributed_env.pop("rpc", None)
            self._worker_started = False

    def _gather(self, names: list[str]) -> dict[str, Any]:
        """Whole values of `names`: params (and the distributed table) from the pservers,
        the rest (e.g. the learning rate) from this worker's scope."""
        session = self._need("save", server=False)
        remote = set(parameter_names(self._origin_main_program))
        plan = session.result.plan.to_json()
        if plan.get("table"):
            remote.add(plan["table"]["table"])
        wanted = [n for n in names if n in remote]
        if self._geo is not None:  # the merged params live on the pservers; a worker's are its own
            from ops.rpc.fetch import pull

            pulled = pull(session.client, plan, wanted) if wanted else {}
        else:
            pulled = session.pull(wanted)
        local = [n for n in names if n not in remote and _held(session, n)]
        return {**pulled, **io.scope_values(local, session.scope)}

    def save_persistables(self, executor: Any, dirname: str | Path, main_program: Any = None, **kwargs: Any) -> list[Path]:
        """Fluid's LoDTensor files in `dirname`, one per var: the whole params gathered from
        the pservers and the worker's other persistables it holds (optimizer accumulators
        live on the pservers and are not saved)."""
        session = self._need("save_persistables", server=False)
        program = self._origin_main_program if main_program is None else main_program
        names = [n for n in io.persistable_names(program) if n in set(parameter_names(program)) or _held(session, n)]
        return io.write_vars(dirname, self._gather(names))

    def save_inference_model(self, executor: Any, dirname: str | Path, feeded_var_names: list[str], target_vars: Any,
                             main_program: Any = None, export_for_deployment: bool = True) -> list[str]:
        """`__model__` (the net pruned to `target_vars`) and its params, gathered whole."""
        self._need("save_inference_model", server=False)
        return io.save_inference_model(dirname, feeded_var_names, target_vars, executor,
                                       main_program if main_program is not None else self.main_program)


def _held(session: Session, name: str) -> bool:
    from ops.tensor import LoDTensor

    return isinstance(session.scope.find_var(name), LoDTensor)


fleet = Fleet()

__all__ = [
    "AsyncStrategy",
    "DistributeTranspilerConfig",
    "DistributedOptimizer",
    "DistributedStrategy",
    "Fleet",
    "FleetError",
    "GeoStrategy",
    "HalfAsyncStrategy",
    "StrategyFactory",
    "SyncStrategy",
    "TrainerRuntimeConfig",
    "fleet",
    "role_maker",
]
